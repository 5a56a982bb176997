// The K-quants: super-blocks of 256 weights with sub-block scales (ggml-common.h block_q2_K,
// block_q3_K, block_q4_K, block_q5_K, block_q6_K; values: ggml-quants.c dequantize_row_q2_K /
// _q3_K / _q4_K / _q5_K / _q6_K), converted for the kernels (torchllama/blocks/k_quants.py is
// the readable form and names the arrays):
//   Q2_K → Q8 form with offsets: codes (rows, K) i8 = q ∈ [0, 3], d = d·sc_j, m = −(dmin·mn_j)
//          (rows, K/16) f32, then d (rows, K/256) f16, sc_j (rows, K/16) u8, −dmin f16, mn_j u8
//   Q3_K → Q8 form with a table ([−4, 3]): indices (rows, K/2) u8 = q + 4 in Q4's nibble order,
//          d = d·(sc_j − 32) (rows, K/16) f32, then d (rows, K/256) f16 and sc_j − 32
//          (rows, K/16) i8
//   Q4_K → Q4 form: codes (rows, K/2) u8 in Q4 blocks of 32 (byte i: weights i and i + 16),
//          d = d·sc_j, m = −dmin·mn_j (rows, K/32) f32, then their factors: d (rows, K/256)
//          f16, sc_j (rows, K/32) u8, −dmin (rows, K/256) f16, mn_j u8
//   Q5_K → Q4 form with fifth bits: Q4_K's arrays with high (rows, K/8) u8 after d and m
//          (4 bytes a block of 32: bit i of the little-endian word, weight i's fifth bit)
//   Q6_K → Q8 form: codes (rows, K) i8 = q − 32, d = d·sc_j (rows, K/16) f32, then d
//          (rows, K/256) f16 and sc_j (rows, K/16) i8
// Float32 products of float16 and small integers are exact in either order of evaluation, so
// these are the numpy functions' bits.

#include "types.h"

namespace torchllama {
namespace {

std::vector<int64_t> q4_k_widths(int64_t K) {
  return {K / 2, K / 8, K / 8, K / 128, K / 32, K / 128, K / 32};
}
std::vector<int64_t> q5_k_widths(int64_t K) {
  return {K / 2, K / 8, K / 8, K / 8, K / 128, K / 32, K / 128, K / 32};
}
std::vector<int64_t> q2_k_widths(int64_t K) {
  return {K, K / 4, K / 4, K / 128, K / 16, K / 128, K / 16};
}
std::vector<int64_t> q3_k_widths(int64_t K) { return {K / 2, K / 4, K / 128, K / 16}; }
std::vector<int64_t> q6_k_widths(int64_t K) { return {K, K / 4, K / 128, K / 16}; }

// Q4_K/Q5_K super-block i's scales: its f16 d and dmin at b, then the eight 6-bit sc_j, mn_j
// packed in 12 bytes (ggml-quants.c get_scale_min_k4) → d·sc_j, −dmin·mn_j (dd, mm) and the
// factors (f: d, sc_j, −dmin, mn_j); returns the count of those products not finite.
inline int64_t q4_k_scales(const uint8_t* __restrict__ b, int64_t i, float* __restrict__ dd,
                           float* __restrict__ mm, uint8_t* const* f) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* s = b + 4;
  std::memcpy(f[0] + 2 * i, b, 2);
  f[2][2 * i] = b[2];
  f[2][2 * i + 1] = b[3] ^ 0x80;                              // −dmin: the sign bit flipped
  for (int j = 0; j < 8; ++j) {
    const uint8_t sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    const uint8_t mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    f[1][8 * i + j] = sc;
    f[3][8 * i + j] = mn;
    dd[8 * i + j] = d * float(sc);
    mm[8 * i + j] = -(dmin * float(mn));
  }
  return !std::isfinite(d) || !std::isfinite(dmin)   // every product then, or none is
             ? count_non_finite(dd + 8 * i, 8) + count_non_finite(mm + 8 * i, 8) : 0;
}

// Q4_K/Q5_K codes: each 64 weights of a super-block are 32 bytes of qs (weights 0-31 in the
// low nibbles, 32-63 in the high ones) → the 8 Q4 blocks of 32 (byte l: weights l, l + 16).
inline void q4_k_codes(const uint8_t* __restrict__ qs, uint8_t* __restrict__ codes) {
  for (int c = 0; c < 4; ++c) {                    // 64 weights → Q4 blocks 2c and 2c + 1
    const uint8_t* lo = qs + 32 * c;               // weights 64c + l, l < 16 (and + 32)
    const uint8_t* hi = lo + 16;                   // weights 64c + 16 + l (and + 32)
    uint8_t* even = codes + 16 * (2 * c);
    uint8_t* odd = even + 16;
    for (int l = 0; l < 16; ++l) {
      even[l] = uint8_t((lo[l] & 0x0F) | ((hi[l] & 0x0F) << 4));
      odd[l] = uint8_t((lo[l] >> 4) | (hi[l] & 0xF0));
    }
  }
}

// Q4_K: d, dmin, 12 bytes of scales, 128 of qs.
int64_t q4_k_row(const uint8_t* __restrict__ b, int64_t nb, uint8_t* const* out) {
  float* dd = reinterpret_cast<float*>(out[1]);
  float* mm = reinterpret_cast<float*>(out[2]);
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 144) {
    bad += q4_k_scales(b, i, dd, mm, out + 3);
    q4_k_codes(b + 16, out[0] + 128 * i);
  }
  return bad;
}

// Q5_K: Q4_K's fields with 32 bytes of qh between the scales and qs; the fifth bit of weight e
// of a super-block is bit e / 32 of qh[e % 32]. The form wants it as bit e % 32 of block
// e / 32's little-endian 32-bit word: bit plane j of the 32 qh bytes is block j's word.
int64_t q5_k_row(const uint8_t* __restrict__ b, int64_t nb, uint8_t* const* out) {
  float* dd = reinterpret_cast<float*>(out[1]);
  float* mm = reinterpret_cast<float*>(out[2]);
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 176) {
    bad += q4_k_scales(b, i, dd, mm, out + 4);
    q4_k_codes(b + 48, out[0] + 128 * i);
    const uint8_t* qh = b + 16;
    uint32_t word[8] = {};
    for (int l = 0; l < 32; ++l)
      for (int j = 0; j < 8; ++j) word[j] |= uint32_t((qh[l] >> j) & 1) << l;
    std::memcpy(out[3] + 32 * i, word, 32);        // little-endian, as the file's words
  }
  return bad;
}

// Q2_K: 16 bytes of scales (sc_j in the low nibble, mn_j in the high one, per 16 weights), 64 of
// qs, the f16 d and dmin. Each 128 weights take 32 bytes of qs, weight l + 32·k of the 128
// (l < 32) bits 2k, 2k+1 of qs[l]; weight e's scale pair is scales[e / 16]:
// w = (d·sc_j)·q − dmin·mn_j.
int64_t q2_k_row(const uint8_t* b, int64_t nb, uint8_t* const* out) {
  float* dd = reinterpret_cast<float*>(out[1]);
  float* mm = reinterpret_cast<float*>(out[2]);
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 84) {
    const uint8_t *s = b, *qs = b + 16;
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    std::memcpy(out[3] + 2 * i, b + 80, 2);
    out[5][2 * i] = b[82];
    out[5][2 * i + 1] = b[83] ^ 0x80;                         // −dmin: the sign bit flipped
    for (int j = 0; j < 16; ++j) {
      const int sc = s[j] & 15, mn = s[j] >> 4;
      out[4][16 * i + j] = uint8_t(sc);
      out[6][16 * i + j] = uint8_t(mn);
      dd[16 * i + j] = d * float(sc);
      mm[16 * i + j] = -(dmin * float(mn));
    }
    if (!std::isfinite(d) || !std::isfinite(dmin))
      bad += count_non_finite(dd + 16 * i, 16) + count_non_finite(mm + 16 * i, 16);
    int8_t* c = reinterpret_cast<int8_t*>(out[0]) + 256 * i;
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 32; ++l) c[128 * h + 32 * k + l] = int8_t((qs[32 * h + l] >> (2 * k)) & 3);
  }
  return bad;
}

// Q3_K: 32 bytes of hmask, 64 of qs, 12 of scales, the f16 d. Each 128 weights take 32 bytes
// of qs, weight l + 32·k of the 128 (l < 32) bits 2k, 2k+1 of qs[l]; weight e's third bit is
// bit e / 32 of hmask[e % 32] (set: q = those two bits; clear: q = they − 4). The sixteen
// 6-bit sc_j: the low 4 bits in byte j % 8 (its high nibble for j ≥ 8), the high 2 at bits
// 2·(j / 4) of byte 8 + j % 4 (dequantize_row_q3_K's kmask1, kmask2); scale d·(sc_j − 32).
int64_t q3_k_row(const uint8_t* b, int64_t nb, uint8_t* const* out) {
  float* dd = reinterpret_cast<float*>(out[1]);
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 110) {
    const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
    const float d = half_at(b + 108);
    std::memcpy(out[2] + 2 * i, b + 108, 2);
    int8_t* sub = reinterpret_cast<int8_t*>(out[3]) + 16 * i;
    for (int j = 0; j < 16; ++j) {
      const int sc = ((s[j % 8] >> (4 * (j / 8))) & 15) |        // 6 bits: [0, 63]
                     (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4);
      sub[j] = int8_t(sc - 32);
      dd[16 * i + j] = d * float(sc - 32);
      bad += !std::isfinite(dd[16 * i + j]);
    }
    uint8_t q4[256];                                   // q + 4 ∈ [0, 7], natural order
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 32; ++l) {
          const int low = (qs[32 * h + l] >> (2 * k)) & 3;
          const int third = (hm[l] >> (4 * h + k)) & 1;
          q4[128 * h + 32 * k + l] = uint8_t(low | (third << 2));
        }
    uint8_t* idx = out[0] + 128 * i;                   // Q4's nibble order, per 32 weights
    for (int blk = 0; blk < 8; ++blk)
      for (int j = 0; j < 16; ++j)
        idx[16 * blk + j] = uint8_t(q4[32 * blk + j] | (q4[32 * blk + 16 + j] << 4));
  }
  return bad;
}

// Q6_K: each 128 weights take 64 bytes of low nibbles (ql) and 32 of 2-bit high parts (qh);
// weight l + 32·k of the 128 (l < 32) is ql[l + 32·(k % 2)] (low nibble for k < 2, high for
// k ≥ 2) with bits 2k, 2k+1 of qh[l] above it; 16 int8 scales, then the f16 d.
int64_t q6_k_row(const uint8_t* b, int64_t nb, uint8_t* const* out) {
  float* dd = reinterpret_cast<float*>(out[1]);
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 210) {
    const float d = half_at(b + 208);
    std::memcpy(out[2] + 2 * i, b + 208, 2);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    std::memcpy(out[3] + 16 * i, sc, 16);
    for (int j = 0; j < 16; ++j) {
      dd[16 * i + j] = d * float(sc[j]);
      bad += !std::isfinite(dd[16 * i + j]);
    }
    int8_t* c = reinterpret_cast<int8_t*>(out[0]) + 256 * i;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < 32; ++l) {
          const uint8_t q = ql[l + 32 * (k % 2)];
          const int low = k < 2 ? q & 15 : q >> 4;
          c[128 * h + 32 * k + l] = int8_t((low | (((qh[l] >> (2 * k)) & 3) << 4)) - 32);
        }
    }
  }
  return bad;
}

const bool registered =
    register_block_type({10, "Q2_K", 84, 256, q2_k_widths, q2_k_row}) &&
    register_block_type({11, "Q3_K", 110, 256, q3_k_widths, q3_k_row}) &&
    register_block_type({12, "Q4_K", 144, 256, q4_k_widths, q4_k_row}) &&
    register_block_type({13, "Q5_K", 176, 256, q5_k_widths, q5_k_row}) &&
    register_block_type({14, "Q6_K", 210, 256, q6_k_widths, q6_k_row});

}  // namespace
}  // namespace torchllama
