// The legacy 32-weight blocks (ggml-common.h block_q4_0, block_q4_1, block_q8_0, block_q5_0,
// block_q5_1; values: ggml-quants.c dequantize_row_*), converted for the kernels
// (torchllama/blocks/legacy.py is the readable form and names the arrays):
//   Q4_0, Q4_1 → Q4 form: codes (rows, K/2) u8 (the stored bytes), d, m (rows, K/32) f32
//                (Q4_0: m = −8·d; Q4_1: m as stored)
//   Q5_1       → Q4 form with fifth bits: codes (rows, K/2) u8 (the stored qs), d, m
//                (rows, K/32) f32, high (rows, K/8) u8 (the stored qh)
//   Q8_0       → Q8 form: codes (rows, K) i8, d (rows, K/32) f32
//   Q5_0       → Q8 form: codes (rows, K) i8 = q − 16, d (rows, K/32) f32

#include "types.h"

namespace torchllama {
namespace {

std::vector<int64_t> q4_widths(int64_t K) { return {K / 2, K / 8, K / 8}; }
std::vector<int64_t> q5_widths(int64_t K) { return {K / 2, K / 8, K / 8, K / 8}; }
std::vector<int64_t> q8_widths(int64_t K) { return {K, K / 8}; }

// Q4_0 (w = d·q − 8·d) and Q4_1 (w = d·q + m): the 16 code bytes as stored.
template <bool HAS_M>
int64_t q4_row(const uint8_t* b, int64_t nb, uint8_t* const* out) {
  uint8_t* codes = out[0];
  float* d = reinterpret_cast<float*>(out[1]);
  float* m = reinterpret_cast<float*>(out[2]);
  constexpr int64_t size = HAS_M ? 20 : 18, at = HAS_M ? 4 : 2;
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += size) {
    d[i] = half_at(b);
    m[i] = HAS_M ? half_at(b + 2) : d[i] * -8.0f;
    std::memcpy(codes + 16 * i, b + at, 16);
    bad += !std::isfinite(d[i]) + !std::isfinite(m[i]);
  }
  return bad;
}

int64_t q8_0_row(const uint8_t* b, int64_t nb, uint8_t* const* out) {
  float* d = reinterpret_cast<float*>(out[1]);
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 34) {
    d[i] = half_at(b);
    std::memcpy(out[0] + 32 * i, b + 2, 32);
    bad += !std::isfinite(d[i]);
  }
  return bad;
}

// Q5_0: w = d·(q − 16), q's 5th bit j in bit j of the 32-bit qh.
int64_t q5_0_row(const uint8_t* b, int64_t nb, uint8_t* const* out) {
  float* d = reinterpret_cast<float*>(out[1]);
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 22) {
    d[i] = half_at(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    int8_t* c = reinterpret_cast<int8_t*>(out[0]) + 32 * i;
    for (int j = 0; j < 16; ++j) {
      const uint8_t q = b[6 + j];
      c[j] = int8_t(((q & 15) | (((qh >> j) & 1) << 4)) - 16);
      c[j + 16] = int8_t(((q >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
    bad += !std::isfinite(d[i]);
  }
  return bad;
}

// Q5_1: w = d·q + m; the 16 qs bytes are the codes' low 4 bits in the Q4 form's order, the 4
// qh bytes (bit j of the little-endian word: weight j's fifth bit) the form's `high`.
int64_t q5_1_row(const uint8_t* b, int64_t nb, uint8_t* const* out) {
  float* d = reinterpret_cast<float*>(out[1]);
  float* m = reinterpret_cast<float*>(out[2]);
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 24) {
    d[i] = half_at(b);
    m[i] = half_at(b + 2);
    std::memcpy(out[3] + 4 * i, b + 4, 4);
    std::memcpy(out[0] + 16 * i, b + 8, 16);
    bad += !std::isfinite(d[i]) + !std::isfinite(m[i]);
  }
  return bad;
}

const bool registered = register_block_type({2, "Q4_0", 18, 32, q4_widths, q4_row<false>}) &&
                        register_block_type({3, "Q4_1", 20, 32, q4_widths, q4_row<true>}) &&
                        register_block_type({6, "Q5_0", 22, 32, q8_widths, q5_0_row}) &&
                        register_block_type({7, "Q5_1", 24, 32, q5_widths, q5_1_row}) &&
                        register_block_type({8, "Q8_0", 34, 32, q8_widths, q8_0_row});

}  // namespace
}  // namespace torchllama
