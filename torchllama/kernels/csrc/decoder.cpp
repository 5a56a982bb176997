// One Llama decoder layer as a single op: the same kernels the Python modules call, in the same
// order, sequenced in C++. A decode step of a small model spends more time dispatching ~40 small
// ops per layer from Python than computing them; this op does it with one call, and gives the
// same bits as the modules (tests/test_kernels.py checks it against them).
//
//   llama_layer(x (B, T, D) f32, attention_norm (D,), wqkv, wo, ffn_norm (D,), w13, w2,
//               k_cache (R, KV, L, hd), v_cache, row0, start_pos, cs (T | B·T, hd/2, 2),
//               mask, n_heads, n_kv_heads, eps, scale) → (B, T, D)
// Pre-norm block (Xiong et al. 2020; Meta's TransformerBlock.forward):
//   h = x + Wo·Attn(RoPE(Wq·n), RoPE(Wk·n), Wv·n) with n = RMSNorm(x)
//   out = h + W2·(SiLU(W1·m) ⊙ W3·m) with m = RMSNorm(h)           (SwiGLU, Shazeer 2020)
// Each weight is a block matrix given as [codes, d, m] (Q4) or [codes, d] (Q8); wqkv stacks
// wq, wk, wv and w13 stacks w1, w3 (torchllama.quantize.fuse_projections). The new keys and
// values are written into cache rows row0.. at slots start_pos..start_pos+T-1 (a KVCache in
// slot order), and attention reads slots 0..start_pos+T-1 with `mask` (see attention()).

#include <torch/library.h>
#include <ATen/ATen.h>

#include <vector>

#include "isa.h"

namespace torchllama {

static at::Tensor linear(const at::Tensor& x2, const std::vector<at::Tensor>& w) {
  TORCH_CHECK(w.size() == 2 || w.size() == 3, "llama_layer: a weight is [codes, d] or "
              "[codes, d, m], got ", w.size(), " tensors");
  return w.size() == 3 ? q4_linear(x2, w[0], w[1], w[2]) : q8_linear(x2, w[0], w[1]);
}

static int64_t rows_of(const std::vector<at::Tensor>& w) { return w.at(0).size(0); }

at::Tensor llama_layer(const at::Tensor& x, const at::Tensor& attention_norm,
                       const std::vector<at::Tensor>& wqkv, const std::vector<at::Tensor>& wo,
                       const at::Tensor& ffn_norm, const std::vector<at::Tensor>& w13,
                       const std::vector<at::Tensor>& w2, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, int64_t row0, int64_t start_pos,
                       const at::Tensor& cs, const std::optional<at::Tensor>& mask,
                       int64_t n_heads, int64_t n_kv_heads, double eps, double scale) {
  TORCH_CHECK(x.dim() == 3, "llama_layer: x must be (B, T, D), got ", x.sizes());
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  const int64_t H = n_heads, KV = n_kv_heads, hd = rows_of(wqkv) / (H + 2 * KV);
  TORCH_CHECK(hd * (H + 2 * KV) == rows_of(wqkv) && k_cache.size(3) == hd &&
              k_cache.size(1) == KV && start_pos + T <= k_cache.size(2) &&
              row0 + B <= k_cache.size(0),
              "llama_layer: wqkv, the cache and the slots do not match");
  // attention: n = RMSNorm(x); q, k, v = n·Wqkvᵀ; RoPE on q and k (adjacent: one call)
  const at::Tensor n = rms_norm(x, attention_norm, eps, false);                 // (B, T, D)
  const at::Tensor qkv = linear(n.view({B * T, D}), wqkv).view({B, T, H + 2 * KV, hd});
  const at::Tensor qk = rope(qkv.narrow(2, 0, H + KV), cs);                    // (B, T, H+KV, hd)
  const at::Tensor xq = qk.narrow(2, 0, H).transpose(1, 2);                    // (B, H, T, hd)
  const at::Tensor kc = k_cache.narrow(0, row0, B), vc = v_cache.narrow(0, row0, B);
  kc.narrow(2, start_pos, T).copy_(qk.narrow(2, H, KV).transpose(1, 2));       // (B, KV, T, hd)
  vc.narrow(2, start_pos, T).copy_(qkv.narrow(2, H + KV, KV).transpose(1, 2));
  const at::Tensor keys = kc.narrow(2, 0, start_pos + T);                      // (B, KV, S, hd)
  const at::Tensor values = vc.narrow(2, 0, start_pos + T);
  const at::Tensor attn = attention(xq, keys, values, mask, scale, 0.0);       // (B, H, T, hd)
  const at::Tensor h = x + linear(attn.transpose(1, 2).reshape({B * T, H * hd}), wo)
                               .view({B, T, D});
  // feed-forward: m = RMSNorm(h); h + W2·(SiLU(gate) ⊙ up), [gate, up] = m·W13ᵀ
  const at::Tensor m = rms_norm(h, ffn_norm, eps, false);
  const auto gate_up = linear(m.view({B * T, D}), w13).chunk(2, -1);           // (BT, F) each
  const at::Tensor act = at::silu(gate_up[0]) * gate_up[1];
  return h + linear(act, w2).view({B, T, D});
}

}  // namespace torchllama

TORCH_LIBRARY_FRAGMENT(torchllama, m) {
  m.def("llama_layer(Tensor x, Tensor attention_norm, Tensor[] wqkv, Tensor[] wo, "
        "Tensor ffn_norm, Tensor[] w13, Tensor[] w2, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "int row0, int start_pos, Tensor cs, Tensor? mask, int n_heads, int n_kv_heads, "
        "float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchllama, CPU, m) {
  m.impl("llama_layer", &torchllama::llama_layer);
}
