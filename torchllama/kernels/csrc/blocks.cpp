// torchllama's CPU kernels for GGUF block weights: y = x · Wᵀ with W kept in its file's blocks.
//
// Method (llama.cpp's ggml-cpu vec_dot for Q4_x/Q8_0 × Q8_0; the int8 idea: Dettmers et al. 2022,
// "LLM.int8()"): every activation row is quantized on the fly to int8 per block of 32,
//     d_x = max|x_b| / 127,  q_x = round_half_even(x_b · (1 / d_x)),  s_x = d_x · Σ q_x,
// the dot product of a block is an exact integer, and the float result is accumulated per block:
//     Q4 (w = d_w·q_w + m_w):  y += (d_w·d_x)·⟨q_w, q_x⟩ + m_w·s_x
//     Q8 (w = d_w·q_w):        y += (d_w·d_x)·⟨q_w, q_x⟩      (d_w per 32, or per 16 for Q6_K)
//
// Batch invariance (Thinking Machines 2025, "Defeating nondeterminism in LLM inference"): an
// output y[m, n] depends only on row m of x and row n of W, through the same float operations in
// the same order whatever the number of rows, the tile it falls in or the thread that runs it;
// the scalar, AVX2 and AVX-512 VNNI paths give the same bits (blocks_impl.h).
//
// Ops (registered as torch.library ops `torchllama::…`; fake implementations in Python):
//   q4_linear(x (M, K) f32, codes (N, K/2) u8, d (N, K/32), m (N, K/32)) → (M, N) f32
//   q8_linear(x (M, K) f32, codes (N, K) i8, d (N, K/B)) → (M, N) f32, B = K / d.size(1)
//   (d and m float32, or float16 where that is exact: Q4_0/Q4_1/Q8_0/Q5_0 scales are f16 in the
//   file; the decode step reads every scale once per token, so half the bytes is faster)
//   quantize_act(x (M, K) f32) → (q (M, K) i8, d (M, K/32) f32, s (M, K/32) f32)   [for tests]
//   isa() → 0 scalar | 1 AVX2 + FMA | 2 AVX-512 VNNI | 3 AVX-512 F/BW without VNNI: the
//       instruction set chosen for this CPU (kernels.h: the table's levels)
//   kernel_levels(isa) → ["q4_rows=avx2", …]: where each kernel of that level's table comes
//       from (the table assembled, nothing run: any level on any CPU)
//
// This file is the ATen glue: argument checks, the per-thread scratch of quantized
// activations, the split of W's rows over threads, and the ops' registration. The SIMD code is
// in blocks_impl.h, compiled once per instruction set by arch/*.cpp; it is reached only
// through the kernel table, `table().q4_rows(…)` (kernels.h, dispatch.cpp).

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "ops.h"

namespace torchllama {

static int64_t isa_code() { return int64_t(isa_in_use()); }

// Where each kernel of instruction set `isa`'s table comes from (kernels.h; nothing runs).
static std::vector<std::string> kernel_levels_of(int64_t isa) {
  TORCH_CHECK(0 <= isa && isa <= 3, "kernel_levels: isa must be 0, 1, 2 or 3, got ", isa);
  return kernel_levels(features_of(Isa(isa)));
}

// Activation quantization (O(M·K), small next to the product's O(M·N·K)): each block by the
// table's `quantize_block` (blocks_impl.h), the same bits on every level.
static void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t nb = K / 32;
  const auto quantize_block = table().quantize_block;
  auto rows = [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m)
      for (int64_t b = 0; b < nb; ++b)
        quantize_block(x + m * K + 32 * b, q + m * K + 32 * b, d + m * nb + b, s + m * nb + b);
  };
  if (M * K < 65536) rows(0, M);                 // decode: not worth waking a thread
  else at::parallel_for(0, M, 16, rows);
}

// The Q4 prefill layout of Act (q4, s_t): a copy of the activations, O(M·K), reused by every
// weight row instead of being rearranged in each tile.
static void q4_layout(Act& a, std::vector<int8_t>& q4, std::vector<float>& s_t) {
  const int64_t nb = a.K / 32, Kp = 32 * (nb + nb % 2);
  q4.assign(size_t(a.M * Kp), 0);
  s_t.resize(size_t(a.M * nb));
  for (int64_t m = 0; m < a.M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* src = a.q + m * a.K + 32 * b;
      int8_t* dst = q4.data() + m * Kp + 64 * (b / 2) + 16 * (b % 2);
      std::memcpy(dst, src, 16);                 // bytes 0-15 → lanes 0-3 (b) or 4-7 (b+1)
      std::memcpy(dst + 32, src + 16, 16);       // bytes 16-31 → lanes 8-11 or 12-15
      s_t[size_t(b * a.M + m)] = a.s[m * nb + b];
    }
  }
  a.q4 = q4.data();
  a.s_t = s_t.data();
  a.Kp = Kp;
}

// Per-thread scratch for the quantized activations (no allocation per call in decode).
struct Scratch {
  std::vector<int8_t> q, q4;
  std::vector<float> d, s, s_t;
  Act quantize(const float* x, int64_t M, int64_t K, bool q4_prefill) {
    q.resize(size_t(M * K));
    d.resize(size_t(M * K / 32));
    s.resize(size_t(M * K / 32));
    quantize_rows(x, M, K, q.data(), d.data(), s.data());
    Act a{q.data(), d.data(), s.data(), M, K};
    if (q4_prefill && M >= 4) q4_layout(a, q4, s_t);
    return a;
  }
};
static thread_local Scratch scratch;

static std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_act(const at::Tensor& x_) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat,
              "quantize_act: x must be a (M, K) float32 tensor");
  TORCH_CHECK(x_.size(1) % 32 == 0, "quantize_act: K = ", x_.size(1), " is not a multiple of 32");
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / 32}, x.options());
  at::Tensor s = at::empty({M, K / 32}, x.options());
  quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(),
                s.data_ptr<float>());
  return {q, d, s};
}

// Work split over output rows: chunks of whole tiles (4 rows), at least ~32k multiply-adds each
// so small decode matrices are not spread thinner than a thread wake-up costs.
template <typename F>
static void parallel_rows(int64_t M, int64_t N, int64_t K, const F& f) {
  const int64_t per_row = std::max<int64_t>(1, M * K);
  const int64_t grain = std::max<int64_t>(4, ((32768 + per_row - 1) / per_row + 3) / 4 * 4);
  at::parallel_for(0, (N + 3) / 4, (grain + 3) / 4, [&](int64_t t0, int64_t t1) {
    f(t0 * 4, std::min(N, t1 * 4));
  });
}

static void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op,
              ": x must be a (M, K) float32 tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " columns, the weight has K = ", K);
}

// The table's kernel for rows [n0, n1) of one product.
static auto rows_kernel(const Q4Weight&) { return table().q4_rows; }
static auto rows_kernel(const Q8Weight&) { return table().q8_rows; }

// y (M, N) f32 = x · Wᵀ: x quantized per block of 32, W's rows split over the threads.
template <typename W>
static at::Tensor product(const at::Tensor& x_, const W& w, const char* op) {
  check_x(x_, w.K, op);
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0);
  const Act a = scratch.quantize(x.data_ptr<float>(), M, w.K,
                                 std::is_same<W, Q4Weight>::value);
  at::Tensor y = at::empty({M, w.N}, x.options());
  float* yp = y.data_ptr<float>();
  const auto rows = rows_kernel(w);
  parallel_rows(M, w.N, w.K, [&](int64_t n0, int64_t n1) { rows(a, w, yp, n0, n1); });
  return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const at::Tensor& m) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  TORCH_CHECK(K % 32 == 0, "q4_linear: K = ", K, " is not a multiple of the block (32)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "q4_linear: codes must be contiguous uint8");
  TORCH_CHECK((d.scalar_type() == at::kFloat || d.scalar_type() == at::kHalf) &&
              m.scalar_type() == d.scalar_type() && d.is_contiguous() && m.is_contiguous() &&
              d.dim() == 2 && d.size(0) == N && d.size(1) == K / 32 && m.sizes() == d.sizes(),
              "q4_linear: d and m must be contiguous float32 or float16 (N, K/32)");
  const Q4Weight w{codes.data_ptr<uint8_t>(), d.data_ptr(), m.data_ptr(), N, K,
                   d.scalar_type() == at::kHalf};
  return product(x, w, "q4_linear");
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(K % 32 == 0, "q8_linear: K = ", K, " is not a multiple of the block (32)");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "q8_linear: codes must be contiguous int8");
  TORCH_CHECK((d.scalar_type() == at::kFloat || d.scalar_type() == at::kHalf) && d.is_contiguous() &&
              d.dim() == 2 && d.size(0) == N && (d.size(1) == K / 32 || d.size(1) == K / 16),
              "q8_linear: d must be contiguous float32 or float16 (N, K/32) or (N, K/16)");
  const Q8Weight w{codes.data_ptr<int8_t>(), d.data_ptr(), N, K, K / d.size(1),
                   d.scalar_type() == at::kHalf};
  return product(x, w, "q8_linear");
}

}  // namespace torchllama

TORCH_LIBRARY(torchllama, m) {
  m.def("q4_linear(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor codes, Tensor d) -> Tensor");
  m.def("quantize_act(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("isa() -> int", &torchllama::isa_code);
  m.def("kernel_levels(int isa) -> str[]", &torchllama::kernel_levels_of);
}

TORCH_LIBRARY_IMPL(torchllama, CPU, m) {
  m.impl("q4_linear", &torchllama::q4_linear);
  m.impl("q8_linear", &torchllama::q8_linear);
  m.impl("quantize_act", &torchllama::quantize_act);
}

