// The GGUF loader's conversion of a matrix's blocks, from the file's bytes to the canonical
// block arrays of torchllama.checkpoint.gguf (`_empty_blocks`): one pass over the mapped bytes,
// row by row. The numpy functions there (`_convert_rows`, `_q4_k_rows`, `_q6_k_rows`) are the
// readable form, the fallback without these kernels, and the tests' reference (the same bytes).
//
// Block layouts: ggml-common.h (block_q4_0, block_q4_1, block_q8_0, block_q5_0, block_q4_K,
// block_q6_K); their values: ggml-quants.c dequantize_row_*.
//
// Op:
//   gguf_blocks(raw (rows, row_bytes) u8, type, out) → the count of block scales that are not
//   finite (d, and m for the Q4 types; the caller names the tensor). `type` is the GGML type
//   number; `out` the arrays of `_empty_blocks(type, rows, K)`, contiguous, written in place:
//     Q4_0, Q4_1 → codes (rows, K/2) u8 (the stored bytes), d, m (rows, K/32) f32
//                  (Q4_0: m = −8·d; Q4_1: m as stored)
//     Q8_0       → codes (rows, K) i8, d (rows, K/32) f32
//     Q5_0       → codes (rows, K) i8 = q − 16, d (rows, K/32) f32
//     Q4_K       → codes (rows, K/2) u8 in Q4 blocks of 32 (byte i: weights i and i + 16),
//                  d = d·sc_j, m = −dmin·mn_j (rows, K/32) f32, then their factors: d
//                  (rows, K/256) f16, sc_j (rows, K/32) u8, −dmin (rows, K/256) f16, mn_j u8
//     Q6_K       → codes (rows, K) i8 = q − 32, d = d·sc_j (rows, K/16) f32, then d
//                  (rows, K/256) f16 and sc_j (rows, K/16) i8
// Float32 products of float16 and small integers are exact in either order of evaluation, so
// these are the numpy functions' bits.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace torchllama {
namespace {

// GGML type numbers (ggml.h enum ggml_type).
enum GgmlType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

// Bytes per block of a type (ggml-common.h), 0 for the types not converted here.
int64_t block_bytes(int64_t type) {
  return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : type == Q5_0 ? 22
       : type == Q4_K ? 144 : type == Q6_K ? 210 : 0;
}

float half_at(const uint8_t* p) {                       // a little-endian float16 → float32
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

int64_t count_non_finite(const float* x, int n) {
  int64_t bad = 0;
  for (int i = 0; i < n; ++i) bad += !std::isfinite(x[i]);
  return bad;
}

// One row's blocks (`nb` of them) → its slice of each output array. Returns the row's count
// of scales that are not finite.
struct RowOut {
  uint8_t* codes;           // Q4: K/2 bytes; Q8: K int8
  float* d;
  float* m;                 // Q4 types only
  uint8_t* sup_d;           // K-quants: f16 bits of the super-block d (Q4_K, Q6_K)
  uint8_t* sub_d;           // K-quants: sc_j
  uint8_t* sup_m;           // Q4_K: f16 bits of −dmin
  uint8_t* sub_m;           // Q4_K: mn_j
};

int64_t plain_row(const uint8_t* b, int64_t nb, int64_t type, const RowOut& o) {
  int64_t bad = 0;
  const int64_t size = block_bytes(type);
  for (int64_t i = 0; i < nb; ++i, b += size) {
    const float d = half_at(b);
    o.d[i] = d;
    if (type == Q4_0 || type == Q4_1) {
      o.m[i] = type == Q4_0 ? d * -8.0f : half_at(b + 2);   // w = d·q − 8·d | d·q + m
      std::memcpy(o.codes + 16 * i, b + (type == Q4_0 ? 2 : 4), 16);
      bad += !std::isfinite(o.m[i]);
    } else if (type == Q8_0) {
      std::memcpy(o.codes + 32 * i, b + 2, 32);
    } else {                                                 // Q5_0: w = d·(q − 16)
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      int8_t* c = reinterpret_cast<int8_t*>(o.codes) + 32 * i;
      for (int j = 0; j < 16; ++j) {
        const uint8_t q = b[6 + j];
        c[j] = int8_t(((q & 15) | (((qh >> j) & 1) << 4)) - 16);
        c[j + 16] = int8_t(((q >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
      }
    }
    bad += !std::isfinite(d);
  }
  return bad;
}

// Q4_K: each 64 weights of a super-block are 32 bytes of qs (weights 0-31 in the low nibbles,
// 32-63 in the high ones); the eight 6-bit sc_j, mn_j are packed in 12 bytes
// (ggml-quants.c get_scale_min_k4).
int64_t q4_k_row(const uint8_t* __restrict__ b, int64_t nb, const RowOut& o) {
  int64_t bad = 0;
  uint8_t* __restrict__ codes = o.codes;             // restrict: the byte stores alias nothing
  float* __restrict__ dd = o.d;
  float* __restrict__ mm = o.m;
  uint8_t* __restrict__ sub_d = o.sub_d;
  uint8_t* __restrict__ sub_m = o.sub_m;
  for (int64_t i = 0; i < nb; ++i, b += 144) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* s = b + 4;
    const uint8_t* qs = b + 16;
    std::memcpy(o.sup_d + 2 * i, b, 2);
    o.sup_m[2 * i] = b[2];
    o.sup_m[2 * i + 1] = b[3] ^ 0x80;                         // −dmin: the sign bit flipped
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
int64_t q6_k_row(const uint8_t* b, int64_t nb, const RowOut& o) {
  int64_t bad = 0;
  for (int64_t i = 0; i < nb; ++i, b += 210) {
    const float d = half_at(b + 208);
    std::memcpy(o.sup_d + 2 * i, b + 208, 2);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    std::memcpy(o.sub_d + 16 * i, sc, 16);
    for (int j = 0; j < 16; ++j) {
      o.d[16 * i + j] = d * float(sc[j]);
      bad += !std::isfinite(o.d[16 * i + j]);
    }
    int8_t* c = reinterpret_cast<int8_t*>(o.codes) + 256 * i;
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

}  // namespace

static int64_t gguf_blocks(const at::Tensor& raw, int64_t type, at::TensorList out) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "gguf_blocks: raw must be contiguous (rows, bytes) uint8, got ", raw.sizes());
  const int64_t block = block_bytes(type);
  TORCH_CHECK(block > 0, "gguf_blocks: GGML type ", type, " is not converted here");
  const bool super = type == Q4_K || type == Q6_K, q4 = type == Q4_0 || type == Q4_1 || type == Q4_K;
  const size_t want = type == Q4_K ? 7 : type == Q6_K ? 4 : q4 ? 3 : 2;
  TORCH_CHECK(out.size() == want, "gguf_blocks: type ", type, " takes ", want, " arrays, got ",
              out.size());
  const int64_t rows = raw.size(0), nb = raw.size(1) / block;
  TORCH_CHECK(raw.size(1) % block == 0, "gguf_blocks: a row of ", raw.size(1),
              " bytes is not a whole number of ", block, "-byte blocks");
  const int64_t K = nb * (super ? 256 : 32);
  // Per output: its bytes per row (each array is (rows, its width) contiguous).
  std::vector<int64_t> width;
  if (type == Q4_K) width = {K / 2, K / 8, K / 8, K / 128, K / 32, K / 128, K / 32};
  else if (type == Q6_K) width = {K, K / 4, K / 128, K / 16};
  else if (q4) width = {K / 2, K / 8, K / 8};
  else width = {K, K / 8};
  for (size_t i = 0; i < want; ++i)
    TORCH_CHECK(out[i].is_contiguous() && out[i].dim() == 2 && out[i].size(0) == rows &&
                out[i].size(1) * int64_t(out[i].element_size()) == width[i],
                "gguf_blocks: output ", i, " must be contiguous (", rows, ", ", width[i],
                " bytes), got ", out[i].sizes(), " of ", out[i].scalar_type());
  auto bytes = [&](size_t i) { return static_cast<uint8_t*>(out[i].data_ptr()); };
  const uint8_t* src = raw.data_ptr<uint8_t>();
  std::vector<int64_t> bad(at::get_num_threads() + 1, 0);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    int64_t n = 0;
    for (int64_t r = r0; r < r1; ++r) {
      auto at = [&](size_t i) { return out.size() > i ? bytes(i) + r * width[i] : nullptr; };
      const RowOut o{at(0), reinterpret_cast<float*>(at(1)),
                     q4 ? reinterpret_cast<float*>(at(2)) : nullptr,
                     type == Q4_K ? at(3) : type == Q6_K ? at(2) : nullptr,
                     type == Q4_K ? at(4) : type == Q6_K ? at(3) : nullptr,
                     type == Q4_K ? at(5) : nullptr, type == Q4_K ? at(6) : nullptr};
      const uint8_t* b = src + r * raw.size(1);
      n += type == Q4_K ? q4_k_row(b, nb, o) : type == Q6_K ? q6_k_row(b, nb, o)
                                                            : plain_row(b, nb, type, o);
    }
    bad[at::get_thread_num()] += n;
  });
  int64_t total = 0;
  for (int64_t n : bad) total += n;
  return total;
}

}  // namespace torchllama

TORCH_LIBRARY_FRAGMENT(torchllama, m) {
  m.def("gguf_blocks(Tensor raw, int type, Tensor(a!)[] out) -> int");
}

TORCH_LIBRARY_IMPL(torchllama, CPU, m) {
  m.impl("gguf_blocks", &torchllama::gguf_blocks);
}
