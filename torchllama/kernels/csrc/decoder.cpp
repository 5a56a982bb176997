// One decoder layer as a single op: the same kernels the Python modules call, in the same order,
// sequenced in C++. A decode step of a small model spends more time dispatching ~40 small ops
// per layer from Python than computing them; this op does it with one call, and gives the same
// bits as the modules (tests/test_kernels.py checks it against them).
//
//   decoder_layer(x (B, T, D) f32, norms [attention_norm, ffn_norm(, post_attention_norm,
//                 post_ffn_norm)] (D,) each, wqkv, wo, w13, w2, qk_norms [] | [q_norm, k_norm]
//                 (hd,) each or (H·hd,), (KV·hd,), k_cache (R, KV, C, hd), v_cache, row0,
//                 write_pos, n_keys,
//                 cs (T | B·T, hd/2, 2), mask, n_heads, n_kv_heads, eps, scale, softcap,
//                 unit_offset, gelu_tanh, row_write_pos (B,) | None, key_start (B,) | None,
//                 router [] | [W_g (E, D)] | block weight, experts [] | w1, w3, w2 stacked,
//                 n_experts, top_k, norm_topk, moe_scale) → (B, T, D)
// Pre-norm block (Xiong et al. 2020; Meta's TransformerBlock.forward), SwiGLU (Shazeer 2020):
//   h = x + Wo·Attn(RoPE(Wq·n), RoPE(Wk·n), Wv·n) with n = RMSNorm(x)
//   out = h + W2·(SiLU(W1·m) ⊙ W3·m) with m = RMSNorm(h)
// With the Gemma 2/3 options (gemma_pytorch's GemmaDecoderLayer): "sandwich" norms on each
// sublayer's output (4 norms), QK-norm (RMSNorm over each head's hd dims, before RoPE; over
// all heads' H·hd and KV·hd dims where the norms are that long, as OLMoE's),
// RMSNorm gains (1 + w) (unit_offset), GeGLU with tanh GELU, soft-capped scores (softcap > 0).
// With a router (Mixtral, Qwen3-MoE, OLMoE): the feed-forward is a softmax-routed mixture of
// experts (moe_feed_forward; w13 and w2 unused), every expert's projection one MUL_MAT_ID op.
// Each weight is a block matrix given as [codes, d, m] (Q4) or [codes, d, small] (Q8); wqkv stacks
// wq, wk, wv and w13 stacks w1, w3 (torchllama.quantize.fuse_projections). The T new keys and
// values are written into cache rows row0.. at indices write_pos..write_pos+T-1 (as the cache
// stores them: float32, float16, bfloat16 or q8_0 records, see write_keys_values), and attention
// reads indices 0..n_keys-1 with `mask` (see attention()): a KVCache in slot order
// (write_pos = start_pos, n_keys = start_pos + T), or one token appended to a sliding-window
// ring (write_pos = start_pos mod C, n_keys = C; the mask says which slot each index holds,
// key_start where the oldest is). Rows at their own positions (the serving engine's decode,
// T = 1): row_write_pos[b] is the index row b writes its key and value at (−1: the row is
// idle, nothing is written), and write_pos is unused.

#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "ops.h"

namespace torchllama {

// A weight is [codes (uint8), d, m] (Q4) or [codes (int8), d, small (a bool scalar, or the
// table of 4-bit codes)] (Q8), in
// the packed layout (blocks.cpp); a product of P stacked weights, 3·P tensors: their outputs
// side by side (q, k and v of different types, as in llama.cpp's Q4_K_M mix: Q6_K v).
static at::Tensor product(const at::Tensor& x2, const at::Tensor& codes, const at::Tensor& d,
                          const at::Tensor& m) {
  if (codes.scalar_type() == at::kByte) return q4_linear(x2, codes, d, m);
  return q8_linear(x2, codes, d, m);
}

static at::Tensor linear(const at::Tensor& x2, const std::vector<at::Tensor>& w) {
  TORCH_CHECK(!w.empty() && w.size() % 3 == 0, "decoder_layer: a weight is [codes, d, m] or "
              "[codes, d, small] per stacked part, got ", w.size(), " tensors");
  if (w.size() == 3) return product(x2, w[0], w[1], w[2]);
  std::vector<at::Tensor> parts;
  for (size_t i = 0; i < w.size(); i += 3) parts.push_back(product(x2, w[i], w[i + 1], w[i + 2]));
  return at::cat(parts, 1);                                                  // (M, Σ rows)
}

static int64_t rows_of(const std::vector<at::Tensor>& w) {
  int64_t rows = 0;
  for (size_t i = 0; i < w.size(); i += 3) rows += 8 * w.at(i).size(0);
  return rows;
}

// One projection of each (token, expert) pair r: x2[tokens[r]] times expert experts[r]'s
// matrix, the experts' matrices stacked in one block weight (3 tensors: MUL_MAT_ID, blocks.cpp);
// parts = 2: w[i..i+5] two such weights side by side, in one call where they are of one kind.
static at::Tensor experts_product(const at::Tensor& x2, const at::Tensor& tokens,
                                  const at::Tensor& experts, int64_t n_experts,
                                  const std::vector<at::Tensor>& w, size_t i, size_t parts) {
  const auto part = [&](size_t j) { return std::vector<at::Tensor>(w.begin() + j,
                                                                   w.begin() + j + 3); };
  if (parts == 1) return experts_linear(x2, tokens, experts, n_experts, part(i));
  if (w.at(i).scalar_type() == w.at(i + 3).scalar_type())
    return experts_linear(x2, tokens, experts, n_experts,
                          std::vector<at::Tensor>(w.begin() + i, w.begin() + i + 6));
  return at::cat({experts_linear(x2, tokens, experts, n_experts, part(i)),
                  experts_linear(x2, tokens, experts, n_experts, part(i + 3))}, 1);
}

// hidden (R, F) = act ⊙ up, up the right half of gate_up (R, 2F): IEEE products, the bits of
// torch's `act * up`.
static at::Tensor gated(const at::Tensor& act, const at::Tensor& gate_up) {
  const int64_t R = act.size(0), F = act.size(1);
  const at::Tensor a = act.contiguous();
  at::Tensor hidden = at::empty({R, F}, a.options());
  const float *ap = a.data_ptr<float>(), *up = gate_up.data_ptr<float>() + F;
  float* hp = hidden.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < F; ++i) hp[r * F + i] = ap[r * F + i] * up[r * 2 * F + i];
  return hidden;
}

// h2 + Σ_j g_j·y_j for each token n (h2 (N, D), y (N·k, D) its pairs' outputs, g (N·k,)):
// torch's `h + (y * g[..., None]).sum(1)`, whose sum takes each (n, d)'s terms one after
// another from +0 (its cascade's levels add +0 after: a −0 sum becomes +0): the same bits.
static at::Tensor residual_weighted_sum(const at::Tensor& h2, const at::Tensor& y,
                                        const float* g, int64_t k) {
  const int64_t N = h2.size(0), D = h2.size(1);
  const at::Tensor hc = h2.contiguous();
  at::Tensor out = at::empty({N, D}, hc.options());
  const float *hp = hc.data_ptr<float>(), *yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    float* o = op + n * D;
    std::fill(o, o + D, 0.f);
    for (int64_t j = 0; j < k; ++j) {
      const float* yj = yp + (n * k + j) * D;
      const float gj = g[n * k + j];
      for (int64_t d = 0; d < D; ++d) o[d] += yj[d] * gj;
    }
    for (int64_t d = 0; d < D; ++d) o[d] = hp[n * D + d] + (o[d] + 0.f);
  }
  return out;
}

// h2 + the mixture-of-experts feed-forward of m2 (N, D) → (N, D): torchllama/nn/moe.py's
// `MoE.forward` with the softmax router and the stacked products, op for op (the same bits),
// and the block's residual:
//   p = softmax(m·W_gᵀ) (N, E); (g, e) = TopK(p, k), g / Σ g if norm_topk, × moe_scale;
//   each token's experts in increasing e; y_j = W2_e·(act(W1_e·m) ⊙ W3_e·m); h + Σ_j g_j·y_j.
// router: [W_g (E, D) float32] or a block weight; experts: w1, w3, w2 stacked (9 tensors).
// After the products, plain loops (`gated`, `residual_weighted_sum`) instead of 4 torch ops,
// each of which pays its dispatch with caches the weights' stream has flushed.
static at::Tensor moe_feed_forward(const at::Tensor& h2, const at::Tensor& m2,
                                   const std::vector<at::Tensor>& router,
                                   const std::vector<at::Tensor>& experts, int64_t n_experts,
                                   int64_t top_k, bool norm_topk, double moe_scale,
                                   bool gelu_tanh) {
  TORCH_CHECK(experts.size() == 9 && (router.size() == 1 || router.size() == 3) && top_k > 0 &&
              top_k <= n_experts, "decoder_layer: a mixture of experts needs a router weight, "
              "the experts' w1, w3, w2 (9 tensors) and 0 < top_k ≤ n_experts");
  const int64_t N = m2.size(0);
  const at::Tensor logits = router.size() == 1 ? f32_linear(m2, router[0]) : linear(m2, router);
  const auto [top, ids] = at::topk(at::softmax(logits, -1), top_k, -1);        // (N, k) each
  at::Tensor g = norm_topk ? top / top.sum(-1, true) : top;
  if (moe_scale != 1.0) g = g * moe_scale;
  // each token's experts in increasing e, their weights with them (ids.sort, weights.gather:
  // a row's ids are distinct, so one order), and the pairs' tokens: plain loops, exact
  const at::Tensor id = ids.contiguous(), gc = g.contiguous();
  at::Tensor flat = at::empty({N * top_k}, id.options()), pairs = at::empty_like(flat),
             rows = at::empty_like(flat);                                      // (N·k,) each
  std::vector<float> gs(size_t(N * top_k));                                   // (N·k,)
  const int64_t* ip = id.data_ptr<int64_t>();
  const float* gp = gc.data_ptr<float>();
  int64_t *fp = flat.data_ptr<int64_t>(), *pp = pairs.data_ptr<int64_t>(),
          *rp = rows.data_ptr<int64_t>();
  std::vector<int64_t> slot(static_cast<size_t>(top_k));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t j = 0; j < top_k; ++j) slot[j] = j;
    std::sort(slot.begin(), slot.end(), [&](int64_t a, int64_t b) {
      return ip[n * top_k + a] < ip[n * top_k + b]; });
    for (int64_t j = 0, r = n * top_k; j < top_k; ++j, ++r) {
      fp[r] = ip[n * top_k + slot[j]], gs[r] = gp[n * top_k + slot[j]], pp[r] = n, rp[r] = r;
    }
  }
  const at::Tensor gate_up = experts_product(m2, pairs, flat, n_experts, experts, 0, 2)
                                 .contiguous();                               // (N·k, 2F)
  const at::Tensor gate = gate_up.narrow(1, 0, gate_up.size(1) / 2);         // (N·k, F)
  const at::Tensor act = gelu_tanh ? at::gelu(gate, "tanh") : at::silu(gate);
  const at::Tensor y = experts_product(gated(act, gate_up), rows, flat, n_experts, experts, 6,
                                       1).contiguous();                       // (N·k, D)
  return residual_weighted_sum(h2, y, gs.data(), top_k);                     // (N, D)
}

// (B, T, H, hd) queries and (B, T, KV, hd) keys after QK-norm (if any) and RoPE.
static std::pair<at::Tensor, at::Tensor> queries_keys(
    const at::Tensor& qkv, int64_t H, int64_t KV, const std::vector<at::Tensor>& qk_norms,
    const at::Tensor& cs, double eps, bool unit_offset) {
  if (qk_norms.empty()) {                                    // q and k adjacent: one RoPE call
    const at::Tensor qk = rope(qkv.narrow(2, 0, H + KV), cs);               // (B, T, H+KV, hd)
    return {qk.narrow(2, 0, H), qk.narrow(2, H, KV)};
  }
  const int64_t B = qkv.size(0), T = qkv.size(1), hd = qkv.size(3);
  if (qk_norms[0].numel() == H * hd && H > 1) {       // over all heads' H·hd dims (OLMoE)
    const at::Tensor q = rms_norm(qkv.narrow(2, 0, H).reshape({B, T, H * hd}), qk_norms[0], eps,
                                  unit_offset).view({B, T, H, hd});
    const at::Tensor k = rms_norm(qkv.narrow(2, H, KV).reshape({B, T, KV * hd}), qk_norms[1],
                                  eps, unit_offset).view({B, T, KV, hd});
    return {rope(q, cs), rope(k, cs)};
  }
  const at::Tensor q = rms_norm(qkv.narrow(2, 0, H), qk_norms[0], eps, unit_offset);
  const at::Tensor k = rms_norm(qkv.narrow(2, H, KV), qk_norms[1], eps, unit_offset);
  return {rope(q, cs), rope(k, cs)};
}

// One head vector x (n floats) into a cache slot as the cache stores it (torchllama.nn.kv_cache):
// float32 as is, float16 / bfloat16 rounded to nearest even (the table's f32_to_f16, c10's
// conversion: as torch's copy_ rounds), q8_0 as a record: n codes and n/32 scales from
// quantize_block, the bits of `q8_0_quantize`.
static void store_head(at::ScalarType type, const float* x, uint8_t* dst, int64_t n) {
  if (type == at::kFloat) {
    std::memcpy(dst, x, size_t(n) * sizeof(float));
  } else if (type == at::kHalf) {
    table().f32_to_f16(x, reinterpret_cast<uint16_t*>(dst), n);
  } else if (type == at::kBFloat16) {
    at::BFloat16* h = reinterpret_cast<at::BFloat16*>(dst);
    for (int64_t i = 0; i < n; ++i) h[i] = at::BFloat16(x[i]);
  } else {
    const auto quantize_block = table().quantize_block;
    for (int64_t b = 0; b < n / 32; ++b) {
      float d, s;
      quantize_block(x + 32 * b, reinterpret_cast<int8_t*>(dst) + 32 * b, &d, &s);
      std::memcpy(dst + n + 4 * b, &d, sizeof d);
    }
  }
}

// The new keys and values k, v (B, KV, T, hd) float32 into the cache rows kc, vc (B, KV, C, ·)
// as they store them: at indices write_pos.. for every row, or row b's one token at
// row_write_pos[b] (−1: skipped).
static void write_keys_values(const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& k,
                              const at::Tensor& v, int64_t write_pos,
                              const std::optional<at::Tensor>& row_write_pos) {
  const int64_t B = k.size(0), KV = k.size(1), T = k.size(2), C = kc.size(2);
  const int64_t hd = k.size(3), dv = v.size(3);
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type() && k.scalar_type() == at::kFloat &&
              v.scalar_type() == at::kFloat && kc.stride(3) == 1 && vc.stride(3) == 1 &&
              k.stride(3) == 1 && v.stride(3) == 1,
              "decoder_layer: float32 keys and values, caches of one dtype, contiguous heads "
              "expected");
  std::vector<int64_t> index(size_t(B * T));             // where (b, t) goes; −1: nowhere
  if (!row_write_pos.has_value()) {
    TORCH_CHECK(write_pos + T <= C, "decoder_layer: slots past the cache");
    for (int64_t r = 0; r < B * T; ++r) index[r] = write_pos + r % T;
  } else {
    const at::Tensor pos = row_write_pos->to(at::kLong).contiguous();
    TORCH_CHECK(T == 1 && pos.numel() == B, "decoder_layer: row_write_pos needs one token per "
                "row and B = ", B, " positions, got T = ", T, ", ", pos.numel());
    for (int64_t b = 0; b < B; ++b) {
      index[b] = pos.data_ptr<int64_t>()[b];
      TORCH_CHECK(index[b] < C, "decoder_layer: row_write_pos[", b, "] = ", index[b],
                  " past the cache");
    }
  }
  const at::ScalarType type = kc.scalar_type();
  const int64_t es = kc.element_size();
  uint8_t *kcp = static_cast<uint8_t*>(kc.data_ptr()), *vcp = static_cast<uint8_t*>(vc.data_ptr());
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  for (int64_t r = 0; r < B * T; ++r) {   // one head vector at a time (the per-row ATen
    if (index[r] < 0) continue;           // select/copy_ cost more than the copy itself)
    const int64_t b = r / T, t = r % T, i = index[r];
    for (int64_t h = 0; h < KV; ++h) {
      store_head(type, kp + b * k.stride(0) + h * k.stride(1) + t * k.stride(2),
                 kcp + (b * kc.stride(0) + h * kc.stride(1) + i * kc.stride(2)) * es, hd);
      store_head(type, vp + b * v.stride(0) + h * v.stride(1) + t * v.stride(2),
                 vcp + (b * vc.stride(0) + h * vc.stride(1) + i * vc.stride(2)) * es, dv);
    }
  }
}

at::Tensor decoder_layer(const at::Tensor& x, const std::vector<at::Tensor>& norms,
                         const std::vector<at::Tensor>& wqkv, const std::vector<at::Tensor>& wo,
                         const std::vector<at::Tensor>& w13, const std::vector<at::Tensor>& w2,
                         const std::vector<at::Tensor>& qk_norms, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, int64_t row0, int64_t write_pos,
                         int64_t n_keys, const at::Tensor& cs,
                         const std::optional<at::Tensor>& mask, int64_t n_heads,
                         int64_t n_kv_heads, double eps, double scale, double softcap,
                         bool unit_offset, bool gelu_tanh,
                         const std::optional<at::Tensor>& row_write_pos,
                         const std::optional<at::Tensor>& key_start,
                         const std::vector<at::Tensor>& router,
                         const std::vector<at::Tensor>& experts, int64_t n_experts,
                         int64_t top_k, bool norm_topk, double moe_scale) {
  TORCH_CHECK(x.dim() == 3, "decoder_layer: x must be (B, T, D), got ", x.sizes());
  TORCH_CHECK((norms.size() == 2 || norms.size() == 4) &&
              (qk_norms.empty() || qk_norms.size() == 2),
              "decoder_layer: 2 or 4 norms and 0 or 2 QK-norms expected");
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  const int64_t H = n_heads, KV = n_kv_heads, hd = rows_of(wqkv) / (H + 2 * KV);
  const int64_t stored = k_cache.scalar_type() == at::kByte ? hd + hd / 8 : hd;   // q8_0
  TORCH_CHECK(hd * (H + 2 * KV) == rows_of(wqkv) && k_cache.size(3) == stored &&
              k_cache.size(1) == KV &&
              n_keys <= k_cache.size(2) && row0 + B <= k_cache.size(0),
              "decoder_layer: wqkv, the cache and the slots do not match");
  // attention: n = RMSNorm(x); q, k, v = n·Wqkvᵀ; (QK-norm,) RoPE on q and k
  const at::Tensor n = rms_norm(x, norms[0], eps, unit_offset);              // (B, T, D)
  const at::Tensor qkv = linear(n.view({B * T, D}), wqkv).view({B, T, H + 2 * KV, hd});
  const auto [q, k] = queries_keys(qkv, H, KV, qk_norms, cs, eps, unit_offset);
  const at::Tensor kc = k_cache.narrow(0, row0, B), vc = v_cache.narrow(0, row0, B);
  write_keys_values(kc, vc, k.transpose(1, 2), qkv.narrow(2, H + KV, KV).transpose(1, 2),
                    write_pos, row_write_pos);                                // (B, KV, T, hd)
  const at::Tensor attn = attention(q.transpose(1, 2), kc.narrow(2, 0, n_keys),  // (B, H, T, hd)
                                    vc.narrow(2, 0, n_keys), mask, scale, softcap, key_start);
  at::Tensor o = linear(attn.transpose(1, 2).reshape({B * T, H * hd}), wo).view({B, T, D});
  if (norms.size() == 4) o = rms_norm(o, norms[2], eps, unit_offset);          // sandwich
  const at::Tensor h = x + o;
  // feed-forward: m = RMSNorm(h); h + W2·(act(gate) ⊙ up), [gate, up] = m·W13ᵀ
  const at::Tensor m = rms_norm(h, norms[1], eps, unit_offset);
  if (!router.empty()) {                                  // a mixture of experts (no sandwich)
    TORCH_CHECK(norms.size() == 2, "decoder_layer: a mixture of experts with 2 norms expected");
    return moe_feed_forward(h.view({B * T, D}), m.view({B * T, D}), router, experts,
                            n_experts, top_k, norm_topk, moe_scale, gelu_tanh).view({B, T, D});
  }
  const auto gate_up = linear(m.view({B * T, D}), w13).chunk(2, -1);           // (BT, F) each
  at::Tensor gate = gate_up[0];              // act(gate) ⊙ up in place: w13's output is ours,
  if (gelu_tanh) at::gelu_(gate, "tanh");    // and w2 reads its rows strided (no new
  else at::silu_(gate);                      // (BT, F) arrays at prefill)
  gate.mul_(gate_up[1]);
  at::Tensor f = linear(gate, w2).view({B, T, D});
  if (norms.size() == 4) f = rms_norm(f, norms[3], eps, unit_offset);
  return h + f;
}

}  // namespace torchllama

TORCH_LIBRARY_FRAGMENT(torchllama, m) {
  m.def("decoder_layer(Tensor x, Tensor[] norms, Tensor[] wqkv, Tensor[] wo, Tensor[] w13, "
        "Tensor[] w2, Tensor[] qk_norms, Tensor(a!) k_cache, Tensor(b!) v_cache, int row0, "
        "int write_pos, int n_keys, Tensor cs, Tensor? mask, int n_heads, int n_kv_heads, "
        "float eps, float scale, float softcap, bool unit_offset, bool gelu_tanh, "
        "Tensor? row_write_pos, Tensor? key_start, Tensor[] router, Tensor[] experts, "
        "int n_experts, int top_k, bool norm_topk, float moe_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchllama, CPU, m) {
  m.impl("decoder_layer", &torchllama::decoder_layer);
}
