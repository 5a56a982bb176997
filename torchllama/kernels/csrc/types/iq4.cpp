// The IQ4 types: 4-bit indices into ggml's grid of 16 int8 values (ggml-common.h kvalues_iq4nl,
// block_iq4_nl, block_iq4_xs; values: ggml-quants.c dequantize_row_iq4_nl / _iq4_xs),
// converted for the kernels (torchllama/blocks/iq4.py is the readable form and names the
// arrays):
//   IQ4_NL → Q8 form: codes (rows, K) i8 = kv[i], d (rows, K/32) f32
//   IQ4_XS → Q8 form: codes (rows, K) i8 = kv[i], d = d·(ls_j − 32) (rows, K/32) f32, then d
//            (rows, K/256) f16 and ls_j − 32 (rows, K/32) i8

#include "types.h"

namespace torchllama {
namespace {

// ggml-common.h kvalues_iq4nl: the value of each 4-bit index.
constexpr int8_t kvalues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                1,    13,   25,  38,  53,  69,  89,  113};

std::vector<int64_t> iq4_nl_widths(int64_t K) { return {K, K / 8}; }
std::vector<int64_t> iq4_xs_widths(int64_t K) { return {K, K / 8, K / 128, K / 32}; }

// 16 bytes → 32 codes, as a Q4_0 block: weight l in the low nibble of byte l, weight l + 16 in
// its high nibble.
inline void iq4_codes(const uint8_t* qs, int8_t* c) {
  for (int l = 0; l < 16; ++l) {
    c[l] = kvalues[qs[l] & 15];
    c[l + 16] = kvalues[qs[l] >> 4];
  }
}

// IQ4_NL: w = d·kv[i]; the f16 d, then 16 bytes of indices.
int64_t iq4_nl_row(const uint8_t* b, int64_t nb, uint8_t* const* out) {
  float* d = reinterpret_cast<float*>(out[1]);
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 18) {
    d[i] = half_at(b);
    iq4_codes(b + 2, reinterpret_cast<int8_t*>(out[0]) + 32 * i);
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
      iq4_codes(b + 8 + 16 * j, reinterpret_cast<int8_t*>(out[0]) + 256 * i + 32 * j);
    }
  }
  return bad;
}

const bool registered =
    register_block_type({20, "IQ4_NL", 18, 32, iq4_nl_widths, iq4_nl_row}) &&
    register_block_type({23, "IQ4_XS", 136, 256, iq4_xs_widths, iq4_xs_row});

}  // namespace
}  // namespace torchllama
