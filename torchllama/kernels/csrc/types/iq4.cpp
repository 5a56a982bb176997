// The IQ4 types: 4-bit indices into ggml's grid of 16 int8 values (ggml-common.h kvalues_iq4nl,
// block_iq4_nl, block_iq4_xs; values: ggml-quants.c dequantize_row_iq4_nl / _iq4_xs),
// converted for the kernels (torchllama/blocks/iq4.py is the readable form and names the
// arrays):
//   IQ4_NL → Q8 form with a table (kv): indices (rows, K/2) u8 as stored, d (rows, K/32) f32
//   IQ4_XS → the same, d = d·(ls_j − 32) (rows, K/32) f32, then d (rows, K/256) f16 and
//            ls_j − 32 (rows, K/32) i8

#include "types.h"

namespace torchllama {
namespace {

// The indices (ggml-common.h kvalues_iq4nl's) stay as stored: weight l of a block in the low
// nibble of byte l, weight l + 16 in its high nibble, the Q8 form's 4-bit order.
std::vector<int64_t> iq4_nl_widths(int64_t K) { return {K / 2, K / 8}; }
std::vector<int64_t> iq4_xs_widths(int64_t K) { return {K / 2, K / 8, K / 128, K / 32}; }

// IQ4_NL: w = d·kv[i]; the f16 d, then 16 bytes of indices.
int64_t iq4_nl_row(const uint8_t* b, int64_t nb, uint8_t* const* out) {
  float* d = reinterpret_cast<float*>(out[1]);
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 18) {
    d[i] = half_at(b);
    std::memcpy(out[0] + 16 * i, b + 2, 16);
    bad += !std::isfinite(d[i]);
  }
  return bad;
}

// IQ4_XS: w = (d·(ls_j − 32))·kv[i] for sub-block j of 32; the f16 d, the 16-bit scales_h
// (bits 2j, 2j+1: ls_j's high 2 bits), 4 bytes of scales_l (nibble j % 2 of byte j / 2: its
// low 4 bits), then 128 bytes of indices, 16 a sub-block.
int64_t iq4_xs_row(const uint8_t* b, int64_t nb, uint8_t* const* out) {
  float* dd = reinterpret_cast<float*>(out[1]);
  int8_t* sub = reinterpret_cast<int8_t*>(out[3]);
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 136) {
    const float d = half_at(b);
    std::memcpy(out[2] + 2 * i, b, 2);
    uint16_t high;
    std::memcpy(&high, b + 2, 2);
    const uint8_t* low = b + 4;
    for (int j = 0; j < 8; ++j) {
      const int ls = ((low[j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
      sub[8 * i + j] = int8_t(ls - 32);
      dd[8 * i + j] = d * float(ls - 32);
      bad += !std::isfinite(dd[8 * i + j]);
    }
    std::memcpy(out[0] + 128 * i, b + 8, 128);
  }
  return bad;
}

const bool registered =
    register_block_type({20, "IQ4_NL", 18, 32, iq4_nl_widths, iq4_nl_row}) &&
    register_block_type({23, "IQ4_XS", 136, 256, iq4_xs_widths, iq4_xs_row});

}  // namespace
}  // namespace torchllama
