// RMSNorm, RoPE and attention in float32, for one instruction set. arch/scalar.cpp,
// arch/avx2.cpp and arch/avx512.cpp each include this file once, inside a namespace (`ISA`)
// and (but for scalar) a `#pragma GCC target`, with ISA_LEVEL 0 (plain loops), 1 (AVX2 + FMA:
// 16 lanes as two ymm) or 2 (AVX-512 F/VL/BW: one zmm): the loops are plain C++ that the
// compiler vectorizes for the target. Every float operation is written out (no FMA
// contraction: -ffp-contract=off; no -ffast-math; reductions in a fixed lane order and a fixed
// tree), so every instruction set gives the same bits, and so does every batch size.
// rms_norm_rows, rope_head and attend_one are the table's entries (kernels.h).

namespace ISA {

constexpr int LANES = 16;   // partial sums of a reduction: element i goes to lane i mod 16

// Sixteen float lanes: a GCC vector (one zmm on AVX-512, four xmm on plain x86-64), or on AVX2
// two 8-lane halves (GCC lowers a 64-byte vector poorly through memory without AVX-512: the
// attention kernel ran 7× slower). Every operation is lane-wise IEEE arithmetic, so every
// target rounds the same way.
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
#if ISA_LEVEL == 1
struct v16 { v8 lo, hi; };                       // lanes 0-7, 8-15
static inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v.lo, p, 32);
  std::memcpy(&v.hi, p + 8, 32);
  return v;
}
static inline void store16(float* p, v16 v) {
  std::memcpy(p, &v.lo, 32);
  std::memcpy(p + 8, &v.hi, 32);
}
static inline v16 splat16(float x) { return v16{v8{} + x, v8{} + x}; }
static inline v16 sub16(v16 a, v16 b) { return v16{a.lo - b.lo, a.hi - b.hi}; }
static inline v16 fma16(v16 a, v16 b, v16 c) {   // a·b + c rounded once
  return v16{(v8)_mm256_fmadd_ps((__m256)a.lo, (__m256)b.lo, (__m256)c.lo),
             (v8)_mm256_fmadd_ps((__m256)a.hi, (__m256)b.hi, (__m256)c.hi)};
}
static inline v8 fold16(v16 acc) { return acc.lo + acc.hi; }   // lane l + lane l + 8
#else
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
static inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
static inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
static inline v16 splat16(float x) { return v16{} + x; }
static inline v16 sub16(v16 a, v16 b) { return a - b; }

// a·b + c rounded once (fused multiply-add: exact on every target, in hardware where it exists;
// the scalar build calls fmaf, slower but the same bits).
static inline v16 fma16(v16 a, v16 b, v16 c) {
#if ISA_LEVEL == 2
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  v16 r;
  for (int l = 0; l < LANES; ++l) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
#endif
}
static inline v8 fold16(v16 acc) {               // lane l + lane l + 8
  return __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif

// Σ of the 16 lanes by a fixed tree: lane l + lane l + w for w = 8, 4, 2, 1.
static inline float tree_sum(v16 acc) {
  const v8 a = fold16(acc);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const float c0 = b[0] + b[2], c1 = b[1] + b[3];
  return c0 + c1;
}

// Σ a[i]·b[i] over n elements: element i in lane i mod 16, then tree_sum.
static inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) acc = fma16(load16(a + i), load16(b + i), acc);
  if (i < n) {                                   // the tail: lane l takes element i + l
    float t[LANES];
    store16(t, acc);
    for (int l = 0; i < n; ++i, ++l) t[l] = std::fma(a[i], b[i], t[l]);
    acc = load16(t);
  }
  return tree_sum(acc);
}

// tree_sum of four accumulators at once: out[r] = tree_sum(acc_r), the same pairs of lanes
// added at each level, four sums side by side in one register on the 16-lane targets.
static inline void tree_sum4(v16 acc0, v16 acc1, v16 acc2, v16 acc3, float out[4]) {
#if ISA_LEVEL == 1
  out[0] = tree_sum(acc0); out[1] = tree_sum(acc1);
  out[2] = tree_sum(acc2); out[3] = tree_sum(acc3);
#else
  const v16 a01 = __builtin_shufflevector(acc0, acc1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                          20, 21, 22, 23) +
                  __builtin_shufflevector(acc0, acc1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                          27, 28, 29, 30, 31);                // 16 → 8 each
  const v16 a23 = __builtin_shufflevector(acc2, acc3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                          20, 21, 22, 23) +
                  __builtin_shufflevector(acc2, acc3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                          27, 28, 29, 30, 31);
  const v16 f4 = __builtin_shufflevector(a01, a23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19,
                                         24, 25, 26, 27) +
                 __builtin_shufflevector(a01, a23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23,
                                         28, 29, 30, 31);                     // 8 → 4 each
  const v8 c = __builtin_shufflevector(f4, f4, 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(f4, f4, 2, 3, 6, 7, 10, 11, 14, 15);   // 4 → 2 each
  const v4 r = __builtin_shufflevector(c, c, 0, 2, 4, 6) +
               __builtin_shufflevector(c, c, 1, 3, 5, 7);                     // 2 → 1 each
  std::memcpy(out, &r, sizeof r);
#endif
}

// dot(a, b_r) for four vectors b_r = b + r·ld at once (a read once; each result's operations
// are dot's, in dot's order). n a multiple of LANES.
static inline void dot4(const float* a, const float* b, int64_t ld, int64_t n, float out[4]) {
  v16 acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};
  for (int64_t i = 0; i < n; i += LANES) {
    const v16 av = load16(a + i);
    acc0 = fma16(av, load16(b + i), acc0);
    acc1 = fma16(av, load16(b + ld + i), acc1);
    acc2 = fma16(av, load16(b + 2 * ld + i), acc2);
    acc3 = fma16(av, load16(b + 3 * ld + i), acc3);
  }
  tree_sum4(acc0, acc1, acc2, acc3, out);
}

// e^x for x ≤ 0 (−inf → 0), as Cephes' expf (Moshier 1992): x = n·ln2 + r with |r| ≤ ln2/2,
// e^r by its degree-7 minimax polynomial, 2^n by building the exponent. Relative error < 2e-7.
// Written once for a float and for 16 lanes with the same operations: the same bits.
template <typename F, typename I>
static inline F exp_poly(F x, F xc) {
  const F n = (xc * 1.44269504f + 12582912.f) - 12582912.f;    // round(x / ln2)
  F r = xc - n * 0.693359375f;                                 // ln2, high part (exact)
  r = r - n * -2.12194440e-4f;                                 // ln2, low part
  F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const F er = p * (r * r) + r + 1.f;
  I bits;
  if constexpr (sizeof(F) == 4) bits = (I(n) + 127) << 23;
  else bits = (__builtin_convertvector(n, I) + 127) << 23;
  F two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return er * two_n;
}

static inline float exp_nonpositive(float x) {
  const float xc = x < -87.3f ? -87.3f : x;                 // 2^n stays a normal float
  return x < -87.3f ? 0.f : exp_poly<float, int32_t>(x, xc);
}

#if ISA_LEVEL == 1
static inline v8 exp_nonpositive(v8 x) {
  const v8 xc = x < -87.3f ? v8{} - 87.3f : x;
  const v8 e = exp_poly<v8, v8i>(x, xc);
  return x < -87.3f ? v8{} : e;
}
static inline v16 exp_nonpositive(v16 x) {
  return v16{exp_nonpositive(x.lo), exp_nonpositive(x.hi)};
}
#else
static inline v16 exp_nonpositive(v16 x) {
  const v16 xc = x < -87.3f ? v16{} - 87.3f : x;
  const v16 e = exp_poly<v16, v16i>(x, xc);
  return x < -87.3f ? v16{} : e;
}
#endif

// RMSNorm of rows [m0, m1): y = x / sqrt(mean(x²) + eps) · g, g = w or 1 + w (unit_offset).
static void rms_norm_rows(const float* x, const float* w, float* y, int64_t D, float eps,
                          bool unit_offset, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* xm = x + m * D;
    float* ym = y + m * D;
    const float r = 1.f / std::sqrt(dot(xm, xm, D) / float(D) + eps);
    if (unit_offset)
      for (int64_t i = 0; i < D; ++i) ym[i] = xm[i] * r * (1.f + w[i]);
    else
      for (int64_t i = 0; i < D; ++i) ym[i] = (xm[i] * r) * w[i];
  }
}

// RoPE of one head vector: pairs (x[2i], x[2i+1]) rotated by (cos, sin) = cs[2i], cs[2i+1]
// for i < pairs; the dims past 2·pairs are copied.
static inline void rope_head(const float* x, const float* cs, float* y, int64_t pairs,
                             int64_t hd) {
  for (int64_t i = 0; i < pairs; ++i) {
    const float x0 = x[2 * i], x1 = x[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
    y[2 * i] = x0 * c - x1 * s;
    y[2 * i + 1] = x0 * s + x1 * c;
  }
  for (int64_t i = 2 * pairs; i < hd; ++i) y[i] = x[i];
}

// Attention of one query vector over the keys its row may see, in slot order.
//   scores s_j = (q·k_j)·scale (→ c·tanh(s_j/c) with soft-capping), −inf where not allowed;
//   p_j = e^{s_j − max}, l = Σ_j p_j (sequential in j), out = (Σ_j p_j·v_j) / l
// Keys outside the mask contribute exact zeros to l and are skipped in Σ p_j·v_j, so a row's
// answer does not depend on padding before it or on other rows: the same bits alone or batched.
// j runs over the key indices from a.start, wrapping at S (a sliding-window ring is visited
// oldest slot first): the visible keys are summed in slot order whatever the storage layout,
// so a ring (decode) and a plain list of keys (prefill, any chunking) give the same bits. The
// scores land in sc in visiting order; dot4 gives the bits of four dot() calls.

static void attend_one(const AttnArgs& a, const float* q, const uint8_t* allowed_at, float* sc,
                       float* out) {
  float mx = -INFINITY;
  const bool by4 = a.hd % LANES == 0;
  const int64_t S = a.S, r = a.start;
  auto index = [&](int64_t j) { return r + j < S ? r + j : r + j - S; };   // j-th visited key
  int64_t j = 0;
  for (; j + 4 <= S; j += 4) {          // four keys at a time where all four are allowed
    const int64_t i = index(j);
    if (by4 && i + 3 < S &&
        (allowed_at[i] & allowed_at[i + 1] & allowed_at[i + 2] & allowed_at[i + 3])) {
      dot4(q, a.k + i * a.k_s, a.k_s, a.hd, sc + j);
      continue;
    }
    for (int64_t t = j; t < j + 4; ++t) {
      const int64_t it = index(t);
      sc[t] = allowed_at[it] ? dot(q, a.k + it * a.k_s, a.hd) : -INFINITY;
    }
  }
  for (; j < S; ++j) {
    const int64_t i = index(j);
    sc[j] = allowed_at[i] ? dot(q, a.k + i * a.k_s, a.hd) : -INFINITY;
  }
  for (int64_t i = 0; i < S; ++i) {
    if (sc[i] == -INFINITY) continue;
    float s = sc[i] * a.scale;
    if (a.softcap != 0.f) s = a.softcap * std::tanh(s / a.softcap);
    sc[i] = s;
    mx = s > mx ? s : mx;
  }
  if (mx == -INFINITY) {                // no key allowed (callers never ask): zeros, not NaN
    for (int64_t i = 0; i < a.dv; ++i) out[i] = 0.f;
    return;
  }
  j = 0;
  for (; j + LANES <= a.S; j += LANES) store16(sc + j, exp_nonpositive(sub16(load16(sc + j), splat16(mx))));
  for (; j < a.S; ++j) sc[j] = exp_nonpositive(sc[j] - mx);
  // l = Σ p_j and out = Σ p_j·v_j, both in slot order (a masked slot's p_j is 0: skipped;
  // out by fused multiply-adds, 64 dims at a time in registers)
  float l = 0.f;
  if (a.dv < 4 * LANES)
    for (int64_t j = 0; j < a.S; ++j) l += sc[j];
  int64_t i0 = 0;
  for (; i0 + 4 * LANES <= a.dv; i0 += 4 * LANES) {
    v16 o0 = {}, o1 = {}, o2 = {}, o3 = {};
    for (int64_t j = 0; j < a.S; ++j) {
      if (sc[j] == 0.f) continue;
      if (i0 == 0) l += sc[j];          // (its latency hides under the multiply-adds)
      const v16 p = splat16(sc[j]);
      const float* vj = a.v + index(j) * a.v_s + i0;
      o0 = fma16(p, load16(vj), o0);
      o1 = fma16(p, load16(vj + LANES), o1);
      o2 = fma16(p, load16(vj + 2 * LANES), o2);
      o3 = fma16(p, load16(vj + 3 * LANES), o3);
    }
    store16(out + i0, o0); store16(out + i0 + LANES, o1);
    store16(out + i0 + 2 * LANES, o2); store16(out + i0 + 3 * LANES, o3);
  }
  for (; i0 < a.dv; ++i0) {
    float o = 0.f;
    for (int64_t j = 0; j < a.S; ++j)
      if (sc[j] != 0.f) o = std::fma(sc[j], a.v[index(j) * a.v_s + i0], o);
    out[i0] = o;
  }
  for (int64_t i = 0; i < a.dv; ++i) out[i] = out[i] / l;
}

}  // namespace ISA
