// torchllama's CPU kernels for GGUF block weights: y = x · Wᵀ with W kept in its file's blocks.
//
// Method (llama.cpp's ggml-cpu vec_dot for Q4_x/Q8_0 × Q8_0; the int8 idea: Dettmers et al. 2022,
// "LLM.int8()"): every activation row is quantized on the fly to int8 per block of 32,
//     d_x = max|x_b| / 127,  q_x = round_half_even(x_b · (1 / d_x)),  s_x = d_x · Σ q_x,
// the dot product of a block is an exact integer, and the float result is accumulated per block,
// in file order (blocks_impl.h gives the exact float operations):
//     Q4 (w = d_w·q_w + m_w):  y += (d_w·d_x)·⟨q_w, q_x⟩ + m_w·s_x
//     Q8 (w = d_w·q_w):        y += (d_w·d_x)·⟨q_w, q_x⟩      (d_w per 32, or per 16 for Q6_K)
//
// Batch invariance (Thinking Machines 2025, "Defeating nondeterminism in LLM inference"): an
// output y[m, n] depends only on row m of x and row n of W, through the same float operations in
// the same order whatever the number of rows, the tile it falls in or the thread that runs it;
// the scalar and AVX2 paths give the same bits (blocks_impl.h).
//
// Ops (registered as torch.library ops `torchllama::…`; fake implementations in Python):
//   q4_linear(x (M, K) f32, codes (N/8, K/32, 128) u8, d (N/8, K/32, 8), m (same)) → (M, N) f32
//   q8_linear(x (M, K) f32, codes (N/8, K/32, 256) i8, d (N/8, K/B, 8), small) → (M, N) f32,
//       B = 32 or 16; small: every |code| ≤ 32 (a speed hint the packer checks; same bits);
//       codes (N/8, K/32, 192): 6-bit codes, every one in [−32, 31] (Q6_K, Q5_0; small);
//       (N/8, K/32, 64): 2-bit codes in [0, 3] (Q2_K; small), and d may then hold offsets too
//       (scale_pair_u4: w = d·q + m per 16, Q2_K's −dmin·mn_j; y += m_w · (d_x · Σ q_x) after
//       each scale's product)
//   (the weights in the packed layout of blocks_impl.h: 8 rows interleaved 4 bytes at a time;
//   torchllama.blocks.packing packs them)
//   (d and m in one of kernels.h's ScaleForms, told apart by dtype and shape: float32
//   (G, nd, 8); float16 (G, nd, 8) where that is exact (Q4_0/Q4_1/Q8_0/Q5_0 scales are f16 in
//   the file); Q4_K's super-blocks uint8 (G, nd/8, 80), Q6_K's int8 (G, nd/16, 144); Q4's m a
//   float32 scalar c for m = c·d. The decode step reads every scale once per token: fewer
//   bytes are a faster step)
//   q4_linear_experts(x (M, K) f32, tokens (R,) i64, experts (R,) i64, E, codes (E·N/8, K/32,
//       128) u8, d, m) → (R, N) f32: row r = x[tokens[r]] · W_{experts[r]}ᵀ, the E experts'
//       matrices stacked (a mixture of experts' layer in one op: llama.cpp's MUL_MAT_ID)
//   q8_linear_experts(x, tokens, experts, E, codes (E·N/8, K/32, 256|192) i8, d, small) → the same
//   quantize_act(x (M, K) f32) → (q (M, K) i8, d (M, K/32) f32, s (M, K/32) f32)   [for tests]
//   pack_six(codes (N, K) i8 in [−32, 31]) → (N/8, K/32, 192) i8: the 6-bit packed codes
//   isa() → "scalar" | "avx2" | "avx512" | "avx512_vnni" …: the instruction set chosen for this
//       CPU (kernels.h: the table's levels); isa_names() → every level's name, lowest first
//   kernel_levels(isa) → ["q4_rows=avx2", …]: where each kernel of that level's table comes
//       from (the table assembled, nothing run: any level on any CPU)
//
// This file is the ATen glue: argument checks, the per-thread scratch of quantized
// activations, the split of W's row groups over threads, and the ops' registration. The SIMD code is
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

static std::string isa_name() { return isa_in_use(); }

// Where each kernel of instruction set `isa`'s table comes from (kernels.h; nothing runs).
static std::vector<std::string> kernel_levels_of(const std::string& isa) {
  std::vector<std::string> out = kernel_levels(isa);
  TORCH_CHECK(!out.empty(), "kernel_levels: no instruction set named ", isa, " (isa_names())");
  return out;
}

// Activation quantization (O(M·K), small next to the product's O(M·N·K)): each block by the
// table's `quantize_block` (blocks_impl.h), the same bits on every level. Row m of x at x + m·ld.
static void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s,
                          int64_t ld) {
  const int64_t nb = K / 32;
  const auto quantize_block = table().quantize_block;
  auto rows = [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m)
      for (int64_t b = 0; b < nb; ++b)
        quantize_block(x + m * ld + 32 * b, q + m * K + 32 * b, d + m * nb + b, s + m * nb + b);
  };
  if (M * K < 65536) rows(0, M);                 // decode: not worth waking a thread
  else at::parallel_for(0, M, 16, rows);
}

// Per-thread scratch for the quantized activations (no allocation per call in decode).
struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  Act quantize(const float* x, int64_t M, int64_t K, int64_t ld) {
    q.resize(size_t(M * K));
    d.resize(size_t(M * K / 32));
    s.resize(size_t(M * K / 32));
    quantize_rows(x, M, K, q.data(), d.data(), s.data(), ld);
    return Act{q.data(), d.data(), s.data(), M, K};
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
                s.data_ptr<float>(), K);
  return {q, d, s};
}

// Work split over groups of 8 output rows, at least ~32k multiply-adds per chunk so small
// decode matrices are not spread thinner than a thread wake-up costs.
template <typename F>
static void parallel_groups(int64_t M, int64_t G, int64_t K, const F& f) {
  const int64_t per_group = std::max<int64_t>(1, 8 * M * K);
  const int64_t grain = std::max<int64_t>(1, (32768 + per_group - 1) / per_group);
  at::parallel_for(0, G, grain, f);
}

static void check_x(const at::Tensor& x, int64_t K, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op,
              ": x must be a (M, K) float32 tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " columns, the weight has K = ", K);
}

// The table's kernel for groups [g0, g1) of one product.
static auto rows_kernel(const Q4Weight&) { return table().q4_rows; }
static auto rows_kernel(const Q8Weight&) { return table().q8_rows; }

// A product's output y (M, N) f32. Those of prefill size are kept for reuse (a few, per
// thread): malloc serves a fresh allocation of 32 MB or more by mmap, faulted in 4 KB page by
// page on first use — 7.8 ms for 32 MB here, a fifth of a 512-row w13 product. One is handed
// out again once nothing but the pool holds its storage.
static at::Tensor output(int64_t M, int64_t N, const at::TensorOptions& options) {
  constexpr int64_t POOL_FROM = int64_t(1) << 22;     // floats (16 MB); below, malloc reuses
  constexpr size_t POOL_SIZE = 4;
  const int64_t n = M * N;
  if (n < POOL_FROM) return at::empty({M, N}, options);
  thread_local std::vector<at::Tensor> pool;          // 1-D float32 buffers
  at::Tensor* spare = nullptr;
  for (at::Tensor& t : pool)
    if (t.storage().use_count() == 1) {
      if (t.numel() >= n) return t.narrow(0, 0, n).view({M, N});
      spare = &t;
    }
  at::Tensor fresh = at::empty({n}, options);
  if (spare != nullptr) *spare = fresh;                // a free one too small: replaced
  else if (pool.size() < POOL_SIZE) pool.push_back(fresh);
  return fresh.view({M, N});
}

// y (M, 8·G) f32 = x · Wᵀ: x quantized per block of 32, W's groups split over the threads. x's
// rows may be strided (a view of every row's first K numbers: the gated half of w13's output).
template <typename W>
static at::Tensor product(const at::Tensor& x_, const W& w, const char* op) {
  check_x(x_, w.K, op);
  const bool strided = x_.stride(1) == 1 && x_.stride(0) >= w.K;
  const at::Tensor x = strided ? x_ : x_.contiguous();
  const int64_t M = x.size(0);
  const Act a = scratch.quantize(x.data_ptr<float>(), M, w.K, M > 1 ? x.stride(0) : w.K);
  at::Tensor y = output(M, 8 * w.G, x.options());
  float* yp = y.data_ptr<float>();
  const auto rows = rows_kernel(w);
  parallel_groups(M, w.G, w.K, [&](int64_t g0, int64_t g1) { rows(a, w, yp, g0, g1); });
  return y;
}

// The form (kernels.h ScaleForm) of G row groups' scales, nd a row; −1 if t is none of them.
static int32_t scale_form(const at::Tensor& t, int64_t G, int64_t nd) {
  if (!t.is_contiguous() || t.dim() != 3 || t.size(0) != G) return -1;
  const auto type = t.scalar_type();
  if ((type == at::kFloat || type == at::kHalf) && t.size(1) == nd && t.size(2) == 8)
    return type == at::kFloat ? scale_f32 : scale_f16;
  if (type != at::kByte && type != at::kChar) return -1;
  for (int32_t form : {scale_super_u8, scale_super_i8, scale_super_i8_8, scale_pair_u4}) {
    const int64_t S = subs_per_super(form);                              // subs per super
    if ((type == at::kChar) == signed_subs(form) && nd % S == 0 && t.size(1) == nd / S &&
        t.size(2) == super_head(form) + 8 * S)
      return form;
  }
  return -1;
}

// The Q4 weight of packed buffers (argument checks: the ops' messages name `op`).
static Q4Weight q4_weight(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m,
                          const char* op) {
  TORCH_CHECK(codes.dim() == 3 && (codes.size(2) == 128 || codes.size(2) == 160) &&
              codes.scalar_type() == at::kByte && codes.is_contiguous(), op, ": codes must be "
              "contiguous uint8 (N/8, K/32, 128) (the packed layout) or (N/8, K/32, 160) (5-bit "
              "codes), got ", codes.sizes());
  const int64_t G = codes.size(0), nb = codes.size(1);
  const bool five = codes.size(2) == 160;
  const int32_t d_form = scale_form(d, G, nb);
  const bool times_d = m.dim() == 0 && m.scalar_type() == at::kFloat;
  const int32_t m_form = times_d ? scale_times_d : scale_form(m, G, nb);
  TORCH_CHECK((d_form == scale_f32 || d_form == scale_f16 || d_form == scale_super_u8) &&
              (m_form == d_form || (m_form == scale_times_d && !five)), op,
              ": d must be contiguous float32 or float16 (N/8, K/32, 8) or uint8 "
              "super-blocks (N/8, K/256, 80); m the same form, or a float32 scalar c (m = c·d); "
              "got d ", d.sizes(), " ", d.scalar_type(), ", m ", m.sizes(), " ", m.scalar_type());
  return Q4Weight{codes.data_ptr<uint8_t>(), d.data_ptr(), m.data_ptr(), G, 32 * nb,
                  d_form, m_form, times_d ? m.item<float>() : 0.f, five};
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const at::Tensor& m) {
  return product(x, q4_weight(codes, d, m, "q4_linear"), "q4_linear");
}

// `small`: a bool scalar (8- or 6-bit codes: every |code| ≤ 32), or the int8 table of 16 values
// of 4-bit codes (then small where every |value| ≤ 32).
static Q8Weight q8_weight(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& small_,
                          const char* op) {
  const bool has_lut = small_.dim() == 1;
  TORCH_CHECK(has_lut ? small_.size(0) == 16 && small_.scalar_type() == at::kChar &&
                            small_.is_contiguous()
                      : small_.dim() == 0 && small_.scalar_type() == at::kBool, op,
              ": small must be a bool scalar, or the (16,) int8 table of 4-bit codes; got ",
              small_.sizes(), " ", small_.scalar_type());
  const int64_t width = has_lut ? 128 : codes.size(-1);
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == width && (width == 256 || width == 192 ||
              width == 128 || width == 64) && codes.scalar_type() == at::kChar &&
              codes.is_contiguous(), op,
              ": codes must be contiguous int8 (N/8, K/32, 256) (the packed layout), (N/8, K/32, "
              "192) (6-bit codes), (N/8, K/32, 64) (2-bit codes) or, with a table, (N/8, K/32, "
              "128) (4-bit), got ", codes.sizes());
  const int8_t* lut = has_lut ? small_.data_ptr<int8_t>() : nullptr;
  bool small = !has_lut && small_.item<bool>();
  if (has_lut) {
    small = true;
    for (int i = 0; i < 16; ++i) small = small && lut[i] >= -32 && lut[i] <= 32;
  }
  const int64_t G = codes.size(0), nb = codes.size(1);
  const bool six = codes.size(2) == 192, two = codes.size(2) == 64;
  TORCH_CHECK(!(six || two) || small, op, ": 6- and 2-bit codes are small (within ±32): small "
              "must be true");
  int64_t block = 32;
  int32_t d_form = scale_form(d, G, nb);
  if (d_form != scale_f32 && d_form != scale_f16 && d_form != scale_super_i8_8) {
    block = 16;
    d_form = scale_form(d, G, 2 * nb);
  }
  TORCH_CHECK(d_form == scale_f32 || d_form == scale_f16 || (d_form == scale_super_i8 &&
              block == 16) || (d_form == scale_super_i8_8 && block == 32) ||
              (d_form == scale_pair_u4 && block == 16), op,
              ": d must be contiguous float32 or float16 (N/8, K/32 or K/16, 8), "
              "int8 super-blocks of 16 scales (N/8, K/256, 144) or of 8 (N/8, K/256, 80), or "
              "uint8 super-blocks of 16 scale and offset pairs (N/8, K/256, 160); got ",
              d.sizes(), " ", d.scalar_type());
  Q8Weight w{codes.data_ptr<int8_t>(), d.data_ptr(), G, 32 * nb, block, d_form, small, six,
             lut};
  w.two = two;
  if (d_form == scale_pair_u4) w.m = w.d;                      // d and m in one buffer
  return w;
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const at::Tensor& small) {
  return product(x, q8_weight(codes, d, small, "q8_linear"), "q8_linear");
}

// ---- mixture of experts: every (token, expert) pair of a layer in one op ---------------------

// Expert e's weight: the packed buffers' groups [e·Ge, (e+1)·Ge) (a buffer of one scalar, Q4's
// c of m = c·d, is every expert's).
static const void* groups_at(const at::Tensor& t, int64_t g) {
  if (t.dim() == 0) return t.data_ptr();
  return static_cast<const uint8_t*>(t.data_ptr()) + g * t.stride(0) * t.element_size();
}
static Q4Weight expert_weight(Q4Weight w, int64_t e, int64_t Ge, const at::Tensor& codes,
                              const at::Tensor& d, const at::Tensor& m) {
  w.codes = static_cast<const uint8_t*>(groups_at(codes, e * Ge));
  w.d = groups_at(d, e * Ge);
  w.m = groups_at(m, e * Ge);
  w.G = Ge;
  return w;
}
static Q8Weight expert_weight(Q8Weight w, int64_t e, int64_t Ge, const at::Tensor& codes,
                              const at::Tensor& d, const at::Tensor&) {
  w.codes = static_cast<const int8_t*>(groups_at(codes, e * Ge));
  w.d = groups_at(d, e * Ge);
  if (w.m) w.m = w.d;                                  // offsets: in d's buffer
  w.G = Ge;
  return w;
}

// A weight of experts stacked (E·N rows, packed) with its buffers, for `expert_weight`.
template <typename W>
struct Stacked { W w; at::Tensor codes, d, m; };

// y (R, ΣN) f32: row r = x[tokens[r]] · W_{experts[r]}ᵀ for each part's W (side by side: w1
// and w3 of a mixture of experts in one call), W the E experts' (N, K) matrices stacked (E·N
// rows, packed): llama.cpp's MUL_MAT_ID. x's rows are quantized once; the pairs are grouped by
// expert (a counting sort, pair order kept within an expert), each expert's rows gathered and
// multiplied by its groups, and the (part, expert, row group) work of every expert split over
// the threads at once. Each output is the kernel's y[m, n] of one activation row and one weight
// row: the same bits as that expert's own product, whatever else is in the batch or the call.
template <typename W>
static at::Tensor expert_product(const at::Tensor& x_, const at::Tensor& tokens_,
                                 const at::Tensor& experts_, int64_t E,
                                 const std::vector<Stacked<W>>& parts, const char* op) {
  const int64_t K = parts.at(0).w.K, nb = K / 32;
  check_x(x_, K, op);
  std::vector<int64_t> Ge, col(1, 0);                    // groups an expert, output columns
  for (const auto& p : parts) {
    TORCH_CHECK(E > 0 && p.w.G % E == 0 && p.w.K == K, op, ": ", p.w.G, " row groups of ",
                p.w.K, " columns do not split into ", E, " experts of ", K);
    Ge.push_back(p.w.G / E);
    col.push_back(col.back() + 8 * Ge.back());
  }
  TORCH_CHECK(tokens_.dim() == 1 && experts_.dim() == 1 && tokens_.size(0) == experts_.size(0)
              && tokens_.scalar_type() == at::kLong && experts_.scalar_type() == at::kLong, op,
              ": tokens and experts must be (R,) int64 tensors of one length");
  const at::Tensor x = x_.contiguous(), tokens = tokens_.contiguous(),
                   experts = experts_.contiguous();
  const int64_t M = x.size(0), R = tokens.size(0);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* ex = experts.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0), order(R);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(0 <= tok[r] && tok[r] < M && 0 <= ex[r] && ex[r] < E, op, ": pair ", r,
                " (token ", tok[r], ", expert ", ex[r], ") is out of range (", M, " tokens, ",
                E, " experts)");
    ++start[ex[r] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t r = 0; r < R; ++r) order[fill[ex[r]]++] = r;           // by expert, stable
  const Act a = scratch.quantize(x.data_ptr<float>(), M, K, K);       // each token once
  std::vector<int8_t> q(size_t(R * K));
  std::vector<float> qd(size_t(R * nb)), qs(size_t(R * nb));
  for (int64_t i = 0; i < R; ++i) {                                   // gathered by expert
    const int64_t t = tok[order[i]];
    std::memcpy(q.data() + i * K, a.q + t * K, size_t(K));
    std::memcpy(qd.data() + i * nb, a.d + t * nb, sizeof(float) * size_t(nb));
    std::memcpy(qs.data() + i * nb, a.s + t * nb, sizeof(float) * size_t(nb));
  }
  std::vector<int64_t> used;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) used.push_back(e);
  const int64_t U = int64_t(used.size()), P = int64_t(parts.size());
  std::vector<int64_t> unit0(1, 0);                      // work units: part p's from unit0[p]
  std::vector<at::Tensor> ys;                            // part p's rows, in expert order
  for (int64_t p = 0; p < P; ++p) {
    unit0.push_back(unit0.back() + U * Ge[p]);
    ys.push_back(at::empty({R, 8 * Ge[p]}, x.options()));
  }
  const auto rows = rows_kernel(parts[0].w);
  const int64_t per_group = std::max<int64_t>(1, 8 * K * R / std::max<int64_t>(1, U));
  const int64_t grain = std::max<int64_t>(1, (32768 + per_group - 1) / per_group);
  at::parallel_for(0, unit0.back(), grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {
      const int64_t p = std::upper_bound(unit0.begin(), unit0.end(), i) - unit0.begin() - 1;
      const int64_t j = i - unit0[p], G = Ge[p], e = used[j / G], g0 = j % G;
      const int64_t g1 = std::min({G, g0 + (i1 - i)}), s = start[e];
      const Act ae{q.data() + s * K, qd.data() + s * nb, qs.data() + s * nb, start[e + 1] - s, K};
      const Stacked<W>& w = parts[p];
      rows(ae, expert_weight(w.w, e, G, w.codes, w.d, w.m), ys[p].data_ptr<float>() + s * 8 * G,
           g0, g1);
      i += g1 - g0;
    }
  });
  const int64_t N = col.back();
  at::Tensor y = at::empty({R, N}, x.options());                     // back in pair order
  float* out = y.data_ptr<float>();
  for (int64_t p = 0; p < P; ++p) {
    const float* yp = ys[p].data_ptr<float>();
    const int64_t n = 8 * Ge[p];
    for (int64_t i = 0; i < R; ++i)
      std::memcpy(out + order[i] * N + col[p], yp + i * n, sizeof(float) * size_t(n));
  }
  return y;
}

at::Tensor q4_linear_experts(const at::Tensor& x, const at::Tensor& tokens,
                             const at::Tensor& experts, int64_t n_experts,
                             const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  return experts_linear(x, tokens, experts, n_experts, {codes, d, m});
}

at::Tensor q8_linear_experts(const at::Tensor& x, const at::Tensor& tokens,
                             const at::Tensor& experts, int64_t n_experts,
                             const at::Tensor& codes, const at::Tensor& d,
                             const at::Tensor& small) {
  return experts_linear(x, tokens, experts, n_experts, {codes, d, small});
}

at::Tensor experts_linear(const at::Tensor& x, const at::Tensor& tokens,
                          const at::Tensor& experts, int64_t n_experts,
                          const std::vector<at::Tensor>& w) {
  TORCH_CHECK(!w.empty() && w.size() % 3 == 0, "experts_linear: [codes, d, m] or [codes, d, "
              "small] per stacked weight expected, got ", w.size(), " tensors");
  if (w[0].scalar_type() == at::kByte) {
    std::vector<Stacked<Q4Weight>> parts;
    for (size_t i = 0; i < w.size(); i += 3)
      parts.push_back({q4_weight(w[i], w[i + 1], w[i + 2], "q4_linear_experts"), w[i],
                       w[i + 1], w[i + 2]});
    return expert_product(x, tokens, experts, n_experts, parts, "q4_linear_experts");
  }
  std::vector<Stacked<Q8Weight>> parts;
  for (size_t i = 0; i < w.size(); i += 3)
    parts.push_back({q8_weight(w[i], w[i + 1], w[i + 2], "q8_linear_experts"),
                     w[i], w[i + 1], w[i + 1]});
  return expert_product(x, tokens, experts, n_experts, parts, "q8_linear_experts");
}

// int8 codes (N, K), every one in [−32, 31], straight into the packed 6-bit layout (G, K/32,
// 192) (blocks_impl.h; the bits of Python's `pack_six(pack_rows(codes, K/32, 4))`, in one pass
// without temporaries). Rows past N (to a multiple of 8) are code 0.
static at::Tensor pack_six(const at::Tensor& codes_) {
  TORCH_CHECK(codes_.dim() == 2 && codes_.scalar_type() == at::kChar && codes_.size(1) % 32 == 0,
              "pack_six: codes must be (N, K) int8 with K a multiple of 32, got ", codes_.sizes());
  const at::Tensor codes = codes_.contiguous();
  if (codes.numel() > 0) {
    const auto [lo, hi] = at::aminmax(codes);
    TORCH_CHECK(lo.item<int8_t>() >= -32 && hi.item<int8_t>() <= 31, "pack_six: codes must "
                "lie in [-32, 31], got [", int(lo.item<int8_t>()), ", ", int(hi.item<int8_t>()),
                "]");
  }
  const int64_t N = codes.size(0), K = codes.size(1), G = (N + 7) / 8, nb = K / 32;
  at::Tensor out = at::zeros({G, nb, 192}, codes.options());
  const int8_t* src = codes.data_ptr<int8_t>();
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr<int8_t>());
  at::parallel_for(0, G, 64, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int r = 0; r < 8; ++r) {
        const int8_t* row = 8 * g + r < N ? src + (8 * g + r) * K : nullptr;   // null: zeros
        for (int64_t b = 0; b < nb; ++b) {
          uint8_t* o = dst + (g * nb + b) * 192;
          for (int c = 0; c < 4; ++c)
            for (int j = 0; j < 4; ++j) {
              const int lo = (row ? row[32 * b + 4 * c + j] : 0) + 32;
              const int hi = (row ? row[32 * b + 16 + 4 * c + j] : 0) + 32;
              const int l = 4 * r + j;
              o[32 * c + l] = uint8_t((lo & 15) | ((hi & 15) << 4));
              o[128 + l] |= uint8_t((lo >> 4) << (2 * c));
              o[160 + l] |= uint8_t((hi >> 4) << (2 * c));
            }
        }
      }
  });
  return out;
}

}  // namespace torchllama

TORCH_LIBRARY(torchllama, m) {
  m.def("q4_linear(Tensor x, Tensor codes, Tensor d, Tensor m) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor codes, Tensor d, Tensor small) -> Tensor");
  m.def("q4_linear_experts(Tensor x, Tensor tokens, Tensor experts, int n_experts, Tensor codes, "
        "Tensor d, Tensor m) -> Tensor");
  m.def("q8_linear_experts(Tensor x, Tensor tokens, Tensor experts, int n_experts, Tensor codes, "
        "Tensor d, Tensor small) -> Tensor");
  m.def("quantize_act(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("pack_six(Tensor codes) -> Tensor");
  m.def("isa() -> str", &torchllama::isa_name);
  m.def("isa_names() -> str[]", &torchllama::isa_names);
  m.def("kernel_levels(str isa) -> str[]", &torchllama::kernel_levels_of);
}

TORCH_LIBRARY_IMPL(torchllama, CPU, m) {
  m.impl("q4_linear", &torchllama::q4_linear);
  m.impl("q8_linear", &torchllama::q8_linear);
  m.impl("q4_linear_experts", &torchllama::q4_linear_experts);
  m.impl("q8_linear_experts", &torchllama::q8_linear_experts);
  m.impl("quantize_act", &torchllama::quantize_act);
  m.impl("pack_six", &torchllama::pack_six);
}

