// torchllama's CPU kernels for the rest of a decoder layer, in float32: RMSNorm, RoPE,
// attention, and the linear layers' matrix product. The first three each replace
// several small torch ops of the eager model (a decode step of a small model is dominated by
// their dispatch); all are batch-invariant by construction: an output row depends only on its
// own inputs, through the same float operations in the same order whatever the batch, chunk,
// padding or thread (Thinking Machines 2025, "Defeating nondeterminism in LLM inference"); the
// scalar, AVX2 and AVX-512 builds give the same bits.
//
// Ops (torch.library `torchllama::…`, fake implementations in Python):
//   rms_norm(x (..., D) f32, w (D,) f32, eps, unit_offset) → (..., D)
//       x / sqrt(mean(x²) + eps) · w (Zhang & Sennrich 2019, eq. 4; Meta's RMSNorm), or
//       · (1 + w) with unit_offset (Gemma)
//   rope(x (B, T, H, hd) f32, cs (T | B·T, pairs, 2) f32) → (B, T, H, hd)
//       interleaved pairs rotated by (cos, sin) (RoFormer eq. 34; Meta's apply_rotary_emb);
//       dims past 2·pairs pass through (partial RoPE)
//   attention(q (B, H, T, hd), k (B, KV, S, hd), v (B, KV, S, dv), mask (T, S) | (B|1, 1, T, S)
//             bool or None, scale, softcap, key_start) → (B, H, T, dv)
//       softmax(q·kᵀ·scale [→ c·tanh(·/c)] masked)·v (Vaswani et al. 2017, eq. 1), query head h
//       on KV head h / (H/KV) (GQA, Ainslie et al. 2023). No mask: causal, query t of the last
//       T slots sees slots ≤ S − T + t. k and v as a KV cache stores them: float32, float16,
//       bfloat16, or uint8 q8_0 records (…, hd + hd/8): tiled over the visible keys, each
//       key read once for the H/KV heads that share it (layers_impl.h). The result is a
//       (B, H, T, dv) view of a (B, T, H, dv) buffer, so the caller's transpose + reshape to
//       (B, T, H·dv) copies nothing.
//   f32_linear(x (M, K) f32, w (N, K) f32) → (M, N) = x · wᵀ (nn.Linear without its bias);
//       w row-major, or column-major (the transpose of a contiguous (K, N): torchllama's
//       loaders store float32 weights so), any other layout is copied row-major first; or w
//       float16 / bfloat16 (GGUF's F16, BF16 matrices kept as stored), row-major, each weight
//       converted to float32 exactly as it is loaded: the float32 weights' bits.
//
// f32_linear's invariance: y[m, n] = dot(x_m, w_n, K) of layers_impl.h, whatever M, the tile,
// the thread, the instruction set or w's layout: 16 lanes, lane l the fused multiply-add chain
// over k ≡ l (mod 16) in increasing k from +0, then the lanes summed by one fixed tree. BLAS
// libraries (MKL) instead pick a kernel and its blocking by shape (a matrix-vector product for
// M = 1, a blocked GEMM otherwise), so a decode step and a prefill of the same token round
// differently; here the shape only picks which outputs are computed side by side
// (linear_impl.h: tiles of x rows × W rows, or × 16-column vectors of a column-major W, each
// reaching the same chains and tree). Threads split N only, never K. (Measured on SmolLM2 in
// float32 with MKL: 4 tokens' logits one at a time vs in one forward, 7.6e-5 apart.)
//
// This file is the ATen glue (argument checks, output tensors, the split over threads, the
// registration); the kernels are layers_impl.h and linear_impl.h, compiled once per
// instruction set by arch/*.cpp and reached through the kernel table (kernels.h): the AVX-512
// ones need F, VL and BW only, no VNNI.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "ops.h"

namespace torchllama {

static void check_f32(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

// ---- RMSNorm -----------------------------------------------------------------------------------

at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w_, double eps, bool unit_offset) {
  check_f32(x_, "rms_norm", "x");
  check_f32(w_, "rms_norm", "w");
  const int64_t D = x_.size(-1);
  TORCH_CHECK(w_.dim() == 1 && w_.size(0) == D, "rms_norm: w must be (", D, ",), got ",
              w_.sizes());
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t M = D ? x.numel() / D : 0;
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const auto rms_norm_rows = table().rms_norm_rows;
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)),
                   [&](int64_t m0, int64_t m1) {
    rms_norm_rows(xp, wp, yp, D, float(eps), unit_offset, m0, m1);
  });
  return y;
}

// ---- RoPE --------------------------------------------------------------------------------------

at::Tensor rope(const at::Tensor& x, const at::Tensor& cs_) {
  check_f32(x, "rope", "x");
  check_f32(cs_, "rope", "cs");
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "rope: x must be (B, T, H, hd) with hd "
              "contiguous, got ", x.sizes());
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), hd = x.size(3);
  const at::Tensor cs = cs_.contiguous();
  TORCH_CHECK(cs.size(-1) == 2 && cs.dim() >= 3 && 2 * cs.size(-2) <= hd &&
              (cs.numel() == T * cs.size(-2) * 2 || cs.numel() == B * T * cs.size(-2) * 2),
              "rope: cs must be (T, pairs, 2) or (B, T, pairs, 2) with 2·pairs ≤ ", hd,
              ", got ", cs.sizes());
  const int64_t pairs = cs.size(-2);
  const bool per_row = cs.numel() == B * T * pairs * 2 && B > 1;
  at::Tensor y = at::empty({B, T, H, hd}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2);
  const auto rope_head = table().rope_head;
  at::parallel_for(0, B * T, std::max<int64_t>(1, 8192 / std::max<int64_t>(H * hd, 1)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T, t = r % T;
      const float* c = cp + ((per_row ? b * T : 0) + t) * pairs * 2;
      for (int64_t h = 0; h < H; ++h)
        rope_head(xp + b * sb + t * st + h * sh, c, yp + (r * H + h) * hd, pairs, hd);
    }
  });
  return y;
}

// ---- attention ---------------------------------------------------------------------------------

// The KvType of keys or values as a KV cache stores them (uint8: q8_0 records).
static int32_t kv_type_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kv_f32;
    case at::kHalf: return kv_f16;
    case at::kBFloat16: return kv_bf16;
    case at::kByte: return kv_q8_0;
    default:
      TORCH_CHECK(false, "attention: keys and values must be float32, float16, bfloat16 or "
                  "uint8 q8_0 records, got ", t.scalar_type());
  }
}

// Each query head rounded to int8 per block of 32 (the activations' quantize_block): codes
// (B, T, H, hd) int8 and scales (B, T, H, hd/32), for scoring q8_0 keys.
static std::pair<at::Tensor, at::Tensor> quantize_queries(const at::Tensor& q) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3);
  at::Tensor qq = at::empty({B, T, H, hd}, q.options().dtype(at::kChar));
  at::Tensor qd = at::empty({B, T, H, hd / 32}, q.options());
  const float* qp = q.data_ptr<float>();
  int8_t* cp = qq.data_ptr<int8_t>();
  float* dp = qd.data_ptr<float>();
  const auto quantize_block = table().quantize_block;
  at::parallel_for(0, B * T * H, 64, [&](int64_t u0, int64_t u1) {
    float x[32], s;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t h = u % H, t = (u / H) % T, b = u / (H * T);
      const float* src = qp + b * q.stride(0) + h * q.stride(1) + t * q.stride(2);
      for (int64_t blk = 0; blk < hd / 32; ++blk) {
        for (int i = 0; i < 32; ++i) x[i] = src[(32 * blk + i) * q.stride(3)];
        quantize_block(x, cp + u * hd + 32 * blk, dp + u * (hd / 32) + blk, &s);
      }
    }
  });
  return {qq, qd};
}

// The keys query t of row b may see, in visiting order (from index `start` on, wrapping at S: a
// ring oldest slot first), into idx; returns how many. mp: the (B, 1, T, S) mask's data or
// null (causal: the last T keys are the queries').
static int64_t visible_keys(const bool* mp, const at::Tensor& mask, int64_t b, int64_t t,
                            int64_t T, int64_t S, int64_t start, int32_t* idx) {
  int64_t n = 0;
  for (int64_t j = 0; j < S; ++j) {
    const int64_t i = start + j < S ? start + j : start + j - S;
    const bool allowed = mp ? mp[b * mask.stride(0) + t * mask.stride(2) + i * mask.stride(3)]
                            : (T == 1 || i <= S - T + t);
    if (allowed) idx[n++] = int32_t(i);
  }
  return n;
}

// Queries a call needs before its keys are laid out in blocks of 16 (key_blocks): the layout
// costs a pass over the keys, and each query then scores 16 keys a block without a horizontal
// sum per key (layers_impl.h block_scores: the same bits).
constexpr int64_t KEY_BLOCK_ROWS = 8;

// k (B, KV, S, hd) float32/float16/bfloat16 as float32 (exact) in blocks of 16 slots, each
// element's 16 values side by side: (B, KV, ⌈S/16⌉, hd, 16), slots past S zero.
static at::Tensor key_blocks(const at::Tensor& k) {
  const int64_t B = k.size(0), KV = k.size(1), S = k.size(2), hd = k.size(3);
  const int64_t nblk = (S + 15) / 16;
  at::Tensor kf = at::zeros({B, KV, nblk * 16, hd}, k.options().dtype(at::kFloat));
  kf.narrow(2, 0, S).copy_(k);
  return kf.view({B, KV, nblk, 16, hd}).transpose(3, 4).contiguous();
}

// The answer of one group's state: out_r = o_r / l_r for its n heads (zeros without keys).
static void finish(const float* state, int64_t n, int64_t dv, int64_t n_keys, float* out,
                   int64_t out_s) {
  for (int64_t r = 0; r < n; ++r) {
    const float* st = state + r * (dv + 2);
    for (int64_t i = 0; i < dv; ++i) out[r * out_s + i] = n_keys ? st[2 + i] / st[1] : 0.f;
  }
}

struct AttnCall {           // one call's tensors and settings, shared by the work units
  const at::Tensor &q, &k, &v, &mask;
  at::Tensor qq, qd;
  const int64_t* key_start;
  int64_t B, H, T, KV, S, hd, dv, n_rep;
  int32_t type;
  float scale, softcap;
  at::Tensor kt;                      // (B, KV, ⌈S/16⌉, hd, 16) float32 keys, or undefined

  AttnArgs args(int64_t b, int64_t t, int64_t g) const {
    const int64_t h0 = g * n_rep, nb = hd / 32;
    const int64_t es = k.element_size();
    const uint8_t* kp = static_cast<const uint8_t*>(k.data_ptr());
    const uint8_t* vp = static_cast<const uint8_t*>(v.data_ptr());
    return AttnArgs{kp + (b * k.stride(0) + g * k.stride(1)) * es, k.stride(2) * es,
                    vp + (b * v.stride(0) + g * v.stride(1)) * es, v.stride(2) * es,
                    hd, dv, type, scale, softcap,
                    q.data_ptr<float>() + b * q.stride(0) + h0 * q.stride(1) + t * q.stride(2),
                    q.stride(1),
                    qq.defined() ? qq.data_ptr<int8_t>() + ((b * T + t) * H + h0) * hd : nullptr,
                    qd.defined() ? qd.data_ptr<float>() + ((b * T + t) * H + h0) * nb : nullptr,
                    n_rep, key_blocks_of(b, g)};
  }
  int64_t start(int64_t b) const { return key_start ? key_start[b] : 0; }
  const float* key_blocks_of(int64_t b, int64_t g) const {  // AttnArgs::kt of (b, g), or null
    return kt.defined() ? kt.data_ptr<float>() + (b * KV + g) * kt.size(2) * hd * 16 : nullptr;
  }
  int64_t state_size() const { return n_rep * (dv + 2); }
};

// Few groups (decode of a few rows): every tile of every group is a work unit, folded in order
// afterwards — the same bits as one group's tiles in one task (the fold's order is fixed).
static void attend_split(const AttnCall& c, float* op) {
  const int64_t rows = c.B * c.T, ss = c.state_size();
  std::vector<int32_t> idx(size_t(rows * c.S));
  std::vector<int64_t> n_keys(rows), first(rows * c.KV + 1, 0);   // first unit of (row, g)
  for (int64_t r = 0; r < rows; ++r) {
    n_keys[r] = visible_keys(c.mask.defined() ? c.mask.data_ptr<bool>() : nullptr, c.mask,
                             r / c.T, r % c.T, c.T, c.S, c.start(r / c.T), idx.data() + r * c.S);
    for (int64_t g = 0; g < c.KV; ++g)
      first[r * c.KV + g + 1] = first[r * c.KV + g] + (n_keys[r] + ATTN_TILE - 1) / ATTN_TILE;
  }
  const int64_t units = first.back();
  std::vector<float> parts(size_t(std::max<int64_t>(units, 1) * ss));
  const auto tiles = table().attend_tiles;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> scratch(size_t(4 * ATTN_TILE + ss));
    int64_t rg = std::upper_bound(first.begin(), first.end(), u0) - first.begin() - 1;
    for (int64_t u = u0; u < u1; ++u) {
      while (first[rg + 1] <= u) ++rg;
      const int64_t r = rg / c.KV, g = rg % c.KV;
      tiles(c.args(r / c.T, r % c.T, g), idx.data() + r * c.S, n_keys[r], u - first[rg],
            u - first[rg] + 1, true, parts.data() + u * ss, scratch.data());
    }
  });
  const auto fold = table().attend_fold;
  for (int64_t rg = 0; rg < rows * c.KV; ++rg) {
    const int64_t r = rg / c.KV, g = rg % c.KV;
    float* state = n_keys[r] ? parts.data() + first[rg] * ss : nullptr;
    for (int64_t u = first[rg] + 1; u < first[rg + 1]; ++u)
      fold(state, parts.data() + u * ss, c.n_rep, c.dv);
    finish(state, c.n_rep, c.dv, n_keys[r], op + (r * c.H + g * c.n_rep) * c.dv, c.dv);
  }
}

// Many groups (prefill, batched decode): one task per (row, KV head), its tiles in order. The
// rows are dealt first, last, second, second to last, …: a causal prompt's later rows see more
// keys, and the threads' contiguous ranges of tasks then get even shares (the order changes no
// row's answer).
// One query head a KV head (MHA: Llama 2 7B, GPT-2): a task is ROWS_TOGETHER consecutive rows
// of one sequence instead, which score the tiles of keys they all see (the same slots, whole
// tiles) as the R = 4 query heads of a GQA group are scored — each key and value read once for
// the four rows, where one query head alone reads a key (or converts a float16 value) per
// multiply-add. Each row then takes its own last tiles. A row's sums are the same operations in
// the same order either way (per query vector; the tiles hold the same keys), so the same bits.
constexpr int64_t ROWS_TOGETHER = 4;

static bool rows_together(const AttnCall& c) {
  return c.n_rep == 1 && c.type != kv_q8_0 && c.T >= ROWS_TOGETHER;   // q8_0: qq has no row stride
}

// Whole tiles that rows idx[i·S …], i < nr, all see, key for key (from the first on).
static int64_t common_tiles(const int32_t* idx, int64_t S, const int64_t* n, int64_t nr) {
  int64_t same = n[0];                              // keys every row lists alike
  for (int64_t i = 1; i < nr; ++i) {
    const int32_t* row = idx + i * S;
    same = std::min(same, n[i]);
    same = std::mismatch(idx, idx + same, row).first - idx;
  }
  return same / ATTN_TILE;
}

static void attend_groups(const AttnCall& c, float* op) {
  const int64_t R = rows_together(c) ? ROWS_TOGETHER : 1;    // rows a task
  const int64_t ss = c.state_size(), groups = (c.T + R - 1) / R;   // row groups a sequence
  const int64_t work = std::max<int64_t>(1, R * c.n_rep * c.S * (c.hd + c.dv));
  const auto tiles = table().attend_tiles;
  at::parallel_for(0, c.B * groups * c.KV, std::max<int64_t>(1, 32768 / work),
                   [&](int64_t u0, int64_t u1) {
    thread_local std::vector<int32_t> idx;
    thread_local std::vector<float> state, scratch;
    idx.resize(size_t(R * c.S));
    state.resize(size_t(R * ss));
    scratch.resize(size_t(4 * ATTN_TILE + R * ss));
    int64_t group = -1, n[ROWS_TOGETHER] = {}, nr = 0, common = 0;  // the rows in idx
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t rank = u / c.KV, g = u % c.KV;
      const int64_t rg = rank % 2 == 0 ? rank / 2 : c.B * groups - 1 - rank / 2;
      const int64_t b = rg / groups, t0 = rg % groups * R;
      if (group != rg) {
        group = rg, nr = std::min(R, c.T - t0);
        for (int64_t i = 0; i < nr; ++i)
          n[i] = visible_keys(c.mask.defined() ? c.mask.data_ptr<bool>() : nullptr, c.mask, b,
                              t0 + i, c.T, c.S, c.start(b), idx.data() + i * c.S);
        common = nr > 1 ? common_tiles(idx.data(), c.S, n, nr) : 0;
      }
      if (common > 0) {                                   // the rows' shared tiles at once
        AttnArgs a = c.args(b, t0, g);
        a.q_s = c.q.stride(2), a.n = nr;                  // "query heads": the rows
        tiles(a, idx.data(), n[0], 0, common, true, state.data(), scratch.data());
      }
      for (int64_t i = 0; i < nr; ++i) {                  // then each row's own
        float* st = state.data() + i * ss;
        tiles(c.args(b, t0 + i, g), idx.data() + i * c.S, n[i], common,
              (n[i] + ATTN_TILE - 1) / ATTN_TILE, common == 0, st, scratch.data());
        finish(st, c.n_rep, c.dv, n[i], op + ((b * c.T + t0 + i) * c.H + g * c.n_rep) * c.dv,
               c.dv);
      }
    }
  });
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask_, double scale, double softcap,
                     const std::optional<at::Tensor>& key_start_) {
  check_f32(q, "attention", "q");
  const int32_t type = kv_type_of(k);
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && k.device().is_cpu() && v.device().is_cpu(),
              "attention: keys and values must be CPU tensors of one dtype, got ",
              k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.stride(3) == 1 &&
              k.stride(3) == 1 && v.stride(3) == 1,
              "attention: q, k, v must be 4-D with a contiguous last dimension");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3);
  const int64_t KV = k.size(1), S = k.size(2);
  const bool q8 = type == kv_q8_0;
  const int64_t dv = q8 ? v.size(3) / 36 * 32 : v.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == KV && v.size(2) == S &&
              k.size(3) == (q8 ? hd + hd / 8 : hd) && KV > 0 && H % KV == 0 && T <= S &&
              (!q8 || (hd % 32 == 0 && v.size(3) % 36 == 0)),
              "attention: shapes do not match: q ", q.sizes(), ", k ", k.sizes(), ", v ",
              v.sizes(), q8 ? " (q8_0 records: hd + hd/8 bytes, hd a multiple of 32)" : "");
  at::Tensor mask;
  if (mask_.has_value()) {
    TORCH_CHECK(mask_->scalar_type() == at::kBool, "attention: the mask must be bool");
    mask = mask_->expand({B, 1, T, S});
  }
  at::Tensor key_start;                 // (B,) int64: row b's keys are visited from index
  if (key_start_.has_value()) {         // key_start[b] on, wrapping (a ring, oldest first)
    key_start = key_start_->to(at::kLong).contiguous();
    TORCH_CHECK(key_start.numel() == B, "attention: key_start must have B = ", B,
                " entries, got ", key_start.numel());
  }
  const int64_t* ks = key_start.defined() ? key_start.data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; ks && b < B; ++b)
    TORCH_CHECK(0 <= ks[b] && ks[b] < std::max<int64_t>(S, 1), "attention: key_start[", b,
                "] = ", ks[b], " is not an index of the ", S, " keys");
  at::Tensor out = at::empty({B, T, H, dv}, q.options());
  AttnCall c{q, k, v, mask, {}, {}, ks, B, H, T, KV, S, hd, dv, H / KV, type, float(scale),
             float(softcap)};
  if (q8) std::tie(c.qq, c.qd) = quantize_queries(q);
  else if (T >= KEY_BLOCK_ROWS) c.kt = key_blocks(k);
  // one task per (row, KV head) when they keep the threads busy; else tiles are the tasks
  if (B * T * KV >= 4 * at::get_num_threads()) attend_groups(c, out.data_ptr<float>());
  else attend_split(c, out.data_ptr<float>());
  return out.permute({0, 2, 1, 3});
}

// ---- f32_linear --------------------------------------------------------------------------------

// y (M, N) = x (M, K) · wᵀ, w (N, K): see the header. Threads take contiguous ranges of W's rows
// (row-major) or of 16-column vectors (column-major), at least ~64k multiply-adds each.
at::Tensor f32_linear(const at::Tensor& x_, const at::Tensor& w_) {
  check_f32(x_, "f32_linear", "x");
  const auto wt = w_.scalar_type();
  const bool half = wt == at::kHalf || wt == at::kBFloat16;   // row-major, converted exactly
  if (!half) check_f32(w_, "f32_linear", "w");
  TORCH_CHECK(w_.device().is_cpu(), "f32_linear: w must be a CPU tensor");
  TORCH_CHECK(x_.dim() == 2 && w_.dim() == 2 && x_.size(1) == w_.size(1),
              "f32_linear: x must be (M, K) and w (N, K), got ", x_.sizes(), " and ",
              w_.sizes());
  const at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w_.size(0);
  const bool col = !half && !w_.is_contiguous() && w_.t().is_contiguous();
  const at::Tensor w = col ? w_ : w_.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  LinearArgs a{x.data_ptr<float>(), half ? nullptr : w.data_ptr<float>(), y.data_ptr<float>(),
               M, N, K};
  if (half) {
    a.w16 = static_cast<const uint16_t*>(w.data_ptr());
    a.w16_type = wt == at::kHalf ? 1 : 2;
  }
  const auto kernel = col ? table().linear_cols : table().linear_rows;
  const int64_t unit = col ? 16 : 4;             // columns per work unit (a thread's share)
  const int64_t per_unit = std::max<int64_t>(1, M * K * unit);
  at::parallel_for(0, (N + unit - 1) / unit, std::max<int64_t>(1, 65536 / per_unit),
                   [&](int64_t u0, int64_t u1) {
    kernel(a, u0 * unit, std::min(N, u1 * unit));
  });
  return y;
}

}  // namespace torchllama

TORCH_LIBRARY_FRAGMENT(torchllama, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool unit_offset) -> Tensor");
  m.def("rope(Tensor x, Tensor cs) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float softcap, "
        "Tensor? key_start=None) "
        "-> Tensor");
  m.def("f32_linear(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchllama, CPU, m) {
  m.impl("rms_norm", &torchllama::rms_norm);
  m.impl("rope", &torchllama::rope);
  m.impl("attention", &torchllama::attention);
  m.impl("f32_linear", &torchllama::f32_linear);
}
