// The K-quants: super-blocks of 256 weights with sub-block scales (ggml-common.h block_q4_K,
// block_q6_K; values: ggml-quants.c dequantize_row_q4_K / _q6_K), converted for the kernels
// (torchllama/blocks/k_quants.py is the readable form and names the arrays):
//   Q4_K → Q4 form: codes (rows, K/2) u8 in Q4 blocks of 32 (byte i: weights i and i + 16),
//          d = d·sc_j, m = −dmin·mn_j (rows, K/32) f32, then their factors: d (rows, K/256)
//          f16, sc_j (rows, K/32) u8, −dmin (rows, K/256) f16, mn_j u8
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
std::vector<int64_t> q6_k_widths(int64_t K) { return {K, K / 4, K / 128, K / 16}; }

// Q4_K: each 64 weights of a super-block are 32 bytes of qs (weights 0-31 in the low nibbles,
// 32-63 in the high ones); the eight 6-bit sc_j, mn_j are packed in 12 bytes
// (ggml-quants.c get_scale_min_k4).
int64_t q4_k_row(const uint8_t* __restrict__ b, int64_t nb, uint8_t* const* out) {
  uint8_t* __restrict__ codes = out[0];              // restrict: the byte stores alias nothing
  float* __restrict__ dd = reinterpret_cast<float*>(out[1]);
  float* __restrict__ mm = reinterpret_cast<float*>(out[2]);
  uint8_t* __restrict__ sup_d = out[3];
  uint8_t* __restrict__ sub_d = out[4];
  uint8_t* __restrict__ sup_m = out[5];
  uint8_t* __restrict__ sub_m = out[6];
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 144) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* s = b + 4;
    const uint8_t* qs = b + 16;
    std::memcpy(sup_d + 2 * i, b, 2);
    sup_m[2 * i] = b[2];
    sup_m[2 * i + 1] = b[3] ^ 0x80;                           // −dmin: the sign bit flipped
    for (int j = 0; j < 8; ++j) {
      const uint8_t sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      const uint8_t mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      sub_d[8 * i + j] = sc;
      sub_m[8 * i + j] = mn;
      dd[8 * i + j] = d * float(sc);
      mm[8 * i + j] = -(dmin * float(mn));
    }
    bad += !std::isfinite(d) || !std::isfinite(dmin)   // every product then, or none is
               ? count_non_finite(dd + 8 * i, 8) + count_non_finite(mm + 8 * i, 8) : 0;
    for (int c = 0; c < 4; ++c) {                  // 64 weights → Q4 blocks 2c and 2c + 1
      const uint8_t* lo = qs + 32 * c;             // weights 64c + l, l < 16 (and + 32)
      const uint8_t* hi = lo + 16;                 // weights 64c + 16 + l (and + 32)
      uint8_t* even = codes + 16 * (8 * i + 2 * c);
      uint8_t* odd = even + 16;
      for (int l = 0; l < 16; ++l) {
        even[l] = uint8_t((lo[l] & 0x0F) | ((hi[l] & 0x0F) << 4));
        odd[l] = uint8_t((lo[l] >> 4) | (hi[l] & 0xF0));
      }
    }
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
    register_block_type({12, "Q4_K", 144, 256, q4_k_widths, q4_k_row}) &&
    register_block_type({14, "Q6_K", 210, 256, q6_k_widths, q6_k_row});

}  // namespace
}  // namespace torchllama
