// RMSNorm, RoPE and attention (over float32, float16, bfloat16 or q8_0 keys and values) in
// float32, for one instruction set. arch/scalar.cpp,
// arch/avx2.cpp and arch/avx512.cpp each include this file once, inside a namespace (`ISA`)
// and (but for scalar) a `#pragma GCC target`, with ISA_LEVEL 0 (plain loops), 1 (AVX2 + FMA:
// 16 lanes as two ymm) or 2 (AVX-512 F/VL/BW: one zmm): the loops are plain C++ that the
// compiler vectorizes for the target. Every float operation is written out (no FMA
// contraction: -ffp-contract=off; no -ffast-math; reductions in a fixed lane order and a fixed
// tree), so every instruction set gives the same bits, and so does every batch size.
// rms_norm_rows, rope_head, f32_to_f16, attend_tiles and attend_fold are the table's entries
// (kernels.h).

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
static inline v16 bcast16(const float* p) {        // *p in every lane, as it is (−0 kept)
  const v8 h = (v8)_mm256_broadcast_ss(p);
  return v16{h, h};
}
static inline v16 sub16(v16 a, v16 b) { return v16{a.lo - b.lo, a.hi - b.hi}; }
static inline v16 add16(v16 a, v16 b) { return v16{a.lo + b.lo, a.hi + b.hi}; }
static inline v16 fma16(v16 a, v16 b, v16 c) {   // a·b + c rounded once
  return v16{(v8)_mm256_fmadd_ps((__m256)a.lo, (__m256)b.lo, (__m256)c.lo),
             (v8)_mm256_fmadd_ps((__m256)a.hi, (__m256)b.hi, (__m256)c.hi)};
}
static inline v8 fold16(v16 acc) { return acc.lo + acc.hi; }   // lane l + lane l + 8
static inline v16 mul16(v16 a, v16 b) { return v16{a.lo * b.lo, a.hi * b.hi}; }
static inline v16 max16(v16 a, v16 b) {          // a > b ? a : b per lane (a NaN gives b)
  return v16{a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi};
}
#else
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
static inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
static inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
static inline v16 splat16(float x) { return v16{} + x; }
static inline v16 bcast16(const float* p) {        // *p in every lane, as it is (−0 kept)
#if ISA_LEVEL == 2
  return (v16)_mm512_set1_ps(*p);
#else
  v16 r;
  for (int l = 0; l < LANES; ++l) r[l] = *p;
  return r;
#endif
}
static inline v16 sub16(v16 a, v16 b) { return a - b; }
static inline v16 add16(v16 a, v16 b) { return a + b; }
static inline v16 mul16(v16 a, v16 b) { return a * b; }
static inline v16 max16(v16 a, v16 b) { return a > b ? a : b; }   // per lane (a NaN gives b)

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
  // the same pairs on 8-lane halves: fold16 (l + l+8), then lanes l + l+4 of two sums side by
  // side ([b0 | b1], [b2 | b3]), then (0 + 2, 1 + 3) of all four, then the last pair (IEEE
  // addition commutes exactly, so c1 + c0 is c0 + c1's bits)
  const __m256 a0 = (__m256)fold16(acc0), a1 = (__m256)fold16(acc1);
  const __m256 a2 = (__m256)fold16(acc2), a3 = (__m256)fold16(acc3);
  const __m256 b01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20),
                                   _mm256_permute2f128_ps(a0, a1, 0x31));        // 8 → 4 each
  const __m256 b23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20),
                                   _mm256_permute2f128_ps(a2, a3, 0x31));
  const __m256 c = _mm256_add_ps(_mm256_shuffle_ps(b01, b23, 0x44),
                                 _mm256_shuffle_ps(b01, b23, 0xee));  // [c0 c1 of 0, of 2 | 1, 3]
  const __m256 r = _mm256_add_ps(c, _mm256_shuffle_ps(c, c, 0xb1));     // lanes 0, 4, 2, 6
  const __m128 r4 = _mm256_castps256_ps128(
      _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 2, 6, 0, 0, 0, 0)));
  _mm_storeu_ps(out, r4);
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

// n float32 numbers as float16 bits, rounded to nearest even (IEEE 754; torch's float32 →
// float16 copy_ rounds so): c10's conversion on the scalar level, F16C's above it (the same
// bits but a NaN's payload: c10 gives the canonical quiet NaN). A decode step stores 2·KV·hd
// numbers a layer, which c10's bit arithmetic made a visible share of a step.
static inline void f32_to_f16(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
#if ISA_LEVEL == 0
  for (; i < n; ++i) y[i] = c10::detail::fp16_ieee_from_fp32_value(x[i]);
#else
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
#endif
}

// ---- attention ---------------------------------------------------------------------------------
// softmax(q·kᵀ·scale [→ c·tanh(·/c)])·v for the n query heads that share one KV head (GQA:
// each key and value is read once for all of them), over the keys a row may see:
// idx[0..n_keys), in slot order (the caller lists them, layers.cpp). The keys are taken
// ATTN_TILE at a time, in that order; tile τ gives, per query head, its partial softmax
// (Milakov & Gimelshein 2018; the FlashAttention tiling of Dao et al. 2022, here over one query):
//   s_j = dot(q, k_j)·scale (soft-capped), m_τ = max_j s_j, p_j = e^{s_j − m_τ},
//   l_τ = Σ_j p_j (in j order from 0), o_τ = Σ_j p_j·v_j (per dim, a fused multiply-add
//   chain in j order from 0)
// and the tiles fold left to right into (m, l, o) (`attend_fold`): m' = max(m, m_τ),
// a = e^{m − m'}, b = e^{m_τ − m'}, l = l·a + l_τ·b, o = o·a + o_τ·b; the answer: o / l.
// Tiles are counted in *visible* keys, so they hold the same keys whatever the storage around
// them (padding, other rows, a ring's rotation, a chunked prefill): a row's answer is the same
// bits alone or batched, and whichever thread computes a tile (the fold's order is fixed).
// A prompt's call (layers.cpp KEY_BLOCK_ROWS) also lays the keys out in blocks of 16 slots
// (AttnArgs::kt), and 16 keys that are one block are scored side by side, a key a lane, by the
// same lanes and tree (`block_scores`): the same bits as key by key.
// Keys and values are read as the cache stores them (kernels.h KvType): float32; float16 or
// bfloat16, converted exactly to float32 in registers; q8_0 records, where the query is
// rounded to int8 per 32 too (the caller does it, `quantize_block`) and
// q·k_j = Σ_b fma(float(Σ_i qq_i·kq_i), qd_b·kd_b, ·) over the blocks b in order (exact
// integer sums), and v_j's numbers are vd·code (p_j·vd_b one product, then the chain of fused
// multiply-adds).

// A float16 or bfloat16 number's bits as float32 (exact): F16C's conversion, or c10's on the
// scalar level (the same IEEE value); bfloat16 is float32's upper half.
template <int KT>
static inline float kv_half_to_float(uint16_t h) {
  if constexpr (KT == kv_bf16) {
    const uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
#if ISA_LEVEL == 0
    return c10::detail::fp16_ieee_to_fp32_value(h);
#else
    return _cvtsh_ss(h);
#endif
  }
}

// 16 numbers of a float32 / float16 / bfloat16 row from element i on, as float32 (exact).
template <int KT>
static inline v16 kv_load16(const uint8_t* row, int64_t i) {
  if constexpr (KT == kv_f32) {
    return load16(reinterpret_cast<const float*>(row) + i);
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(row) + i;
#if ISA_LEVEL == 1
    const __m128i lo = _mm_loadu_si128((const __m128i*)h);
    const __m128i hi = _mm_loadu_si128((const __m128i*)(h + 8));
    if constexpr (KT == kv_f16) return v16{(v8)_mm256_cvtph_ps(lo), (v8)_mm256_cvtph_ps(hi)};
    return v16{(v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16),
               (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16)};
#elif ISA_LEVEL == 2
    const __m256i x = _mm256_loadu_si256((const __m256i*)h);
    if constexpr (KT == kv_f16) return (v16)_mm512_cvtph_ps(x);
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16);
#else
    v16 r;
    for (int l = 0; l < LANES; ++l) r[l] = kv_half_to_float<KT>(h[l]);
    return r;
#endif
  }
}

template <int KT>
static inline float kv_load1(const uint8_t* row, int64_t i) {
  if constexpr (KT == kv_f32) return reinterpret_cast<const float*>(row)[i];
  else return kv_half_to_float<KT>(reinterpret_cast<const uint16_t*>(row)[i]);
}

// 16 int8 codes as float32 (exact).
static inline v16 codes16(const int8_t* c) {
#if ISA_LEVEL == 1
  const __m128i lo = _mm_loadl_epi64((const __m128i*)c);
  const __m128i hi = _mm_loadl_epi64((const __m128i*)(c + 8));
  return v16{(v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
             (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))};
#elif ISA_LEVEL == 2
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)c)));
#else
  v16 r;
  for (int l = 0; l < LANES; ++l) r[l] = float(c[l]);
  return r;
#endif
}

// Σ_{i<32} a_i·b_i of two blocks of 32 int8 codes in [−127, 127] (exact in int32).
static inline int32_t block_dot(const int8_t* a, const int8_t* b) {
#if ISA_LEVEL == 0
  int32_t s = 0;
  for (int i = 0; i < 32; ++i) s += int32_t(a[i]) * int32_t(b[i]);
  return s;
#else
  const __m256i x = _mm256_loadu_si256((const __m256i*)a);
  const __m256i y = _mm256_loadu_si256((const __m256i*)b);
  // |y| · (x·sign y): maddubs multiplies unsigned by signed bytes (llama.cpp's idiom); pairs
  // sum to ≤ 2·127² < 2^15, so no saturation
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(y, y), _mm256_sign_epi8(x, y));
  const __m256i s = _mm256_madd_epi16(p, _mm256_set1_epi16(1));                 // 8 int32
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  return _mm_cvtsi128_si32(t);
#endif
}

static inline float record_scale(const uint8_t* rec, int64_t width, int64_t b) {
  float d;
  std::memcpy(&d, rec + width + 4 * b, sizeof d);
  return d;
}

template <int KT>
static inline int64_t row_bytes(int64_t width) {
  return KT == kv_q8_0 ? width + width / 8 : KT == kv_f32 ? 4 * width : 2 * width;
}

// Decode reads each key and value from memory once per token, key after key: a (row, KV head)'s
// slots are one ascending stream of K rows and one of V rows, and each row, as it is read,
// prefetches its stream's lines ahead (kernels.h's prefetch_row, as the block products' one-row
// tiles do) — a steady stream, where a burst of a tile's rows at once stalled on the L1 miss
// buffers (docs/guides/quantized.md has the figures). Slots not in ascending order (a ring's
// wrap, a mask's gaps) only make some prefetches useless.
static inline void stream_ahead(const uint8_t* row, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) prefetch_row(row + c);
}

// out[r] = q_r·k for the R query heads q0 + r (R ≤ 4): `dot`'s lanes and tree for the float
// kinds, the block chain above for q8_0.
template <int KT, int R>
static inline void key_scores(const AttnArgs& a, int64_t q0, const uint8_t* key, float* out) {
  if constexpr (KT == kv_q8_0) {
    const int64_t nb = a.hd / 32;
    float acc[R] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const float kd = record_scale(key, a.hd, b);
      const int8_t* kc = reinterpret_cast<const int8_t*>(key) + 32 * b;
      for (int r = 0; r < R; ++r)
        acc[r] = std::fma(float(block_dot(a.qq + (q0 + r) * a.hd + 32 * b, kc)),
                          a.qd[(q0 + r) * nb + b] * kd, acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  } else {
    v16 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = splat16(0.f);
    int64_t i = 0;
    for (; i + LANES <= a.hd; i += LANES) {
      const v16 kv = kv_load16<KT>(key, i);
      for (int r = 0; r < R; ++r) acc[r] = fma16(load16(a.q + (q0 + r) * a.q_s + i), kv, acc[r]);
    }
    for (int r = 0; r < R && i < a.hd; ++r) {     // the tail: lane l takes element i + l
      float t[LANES];
      store16(t, acc[r]);
      for (int64_t e = i, l = 0; e < a.hd; ++e, ++l)
        t[l] = std::fma(a.q[(q0 + r) * a.q_s + e], kv_load1<KT>(key, e), t[l]);
      acc[r] = load16(t);
    }
    if constexpr (R == 4) tree_sum4(acc[0], acc[1], acc[2], acc[3], out);
    else
      for (int r = 0; r < R; ++r) out[r] = tree_sum(acc[r]);
  }
}

// o_r = Σ_j p_r,j·v_j over the tile's n values (p_r at p + r·ATTN_TILE, o_r at o + r·os): C
// 16-lane chunks of dims from i0 side by side (R·C independent chains, each in j order).
// l: null, or l_r += p_r,j in j order too (the softmax's denominators, R chains in the shadow
// of the value sums' work instead of on their own).
template <int KT, int R, int C>
static inline void value_chunks(const AttnArgs& a, const int32_t* idx, int64_t n, const float* p,
                                float* o, int64_t os, int64_t i0, float* l) {
  v16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = splat16(0.f);
  float lr[R] = {};
  for (int64_t j = 0; j < n; ++j) {
    if (l)
      for (int r = 0; r < R; ++r) lr[r] += p[r * ATTN_TILE + j];
    const uint8_t* row = a.v + idx[j] * a.v_s;
    if (!a.kt && i0 == 0) stream_ahead(row, row_bytes<KT>(a.dv));      // decode: see above
    for (int c = 0; c < C; ++c) {
      const int64_t i = i0 + LANES * c;
      if constexpr (KT == kv_q8_0) {
        const float d = record_scale(row, a.dv, i / 32);
        const v16 vv = codes16(reinterpret_cast<const int8_t*>(row) + i);
        for (int r = 0; r < R; ++r) acc[r][c] = fma16(splat16(p[r * ATTN_TILE + j] * d), vv, acc[r][c]);
      } else {
        const v16 vv = kv_load16<KT>(row, i);
        for (int r = 0; r < R; ++r) acc[r][c] = fma16(bcast16(p + r * ATTN_TILE + j), vv, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store16(o + r * os + i0 + LANES * c, acc[r][c]);
  if (l)
    for (int r = 0; r < R; ++r) l[r] = lr[r];
}

template <int KT, int R>
static inline void value_sums(const AttnArgs& a, const int32_t* idx, int64_t n, const float* p,
                              float* o, int64_t os, float* l) {
  constexpr int C = R <= 2 ? 4 : 16 / R;          // chunks a pass: ≤ 16 accumulators
  int64_t i0 = 0;
  for (; i0 + C * LANES <= a.dv; i0 += C * LANES)      // l_r in the first pass
    value_chunks<KT, R, C>(a, idx, n, p, o, os, i0, i0 == 0 ? l : nullptr);
  for (; i0 + LANES <= a.dv; i0 += LANES)
    value_chunks<KT, R, 1>(a, idx, n, p, o, os, i0, i0 == 0 ? l : nullptr);
  if (l && a.dv < LANES)                           // no pass took them
    for (int64_t j = 0; j < n; ++j)
      for (int r = 0; r < R; ++r) l[r] += p[r * ATTN_TILE + j];
  if constexpr (KT != kv_q8_0) {                   // dv off the 16 lanes (q8_0: dv % 32 == 0)
    for (; i0 < a.dv; ++i0)
      for (int r = 0; r < R; ++r) {
        float s = 0.f;
        for (int64_t j = 0; j < n; ++j)
          s = std::fma(p[r * ATTN_TILE + j], kv_load1<KT>(a.v + idx[j] * a.v_s, i0), s);
        o[r * os + i0] = s;
      }
  }
}

// s_j ← s_j·scale (soft-capped: c·tanh(s_j·scale / c)) for j < n; returns max_j s_j (a NaN
// score is never the maximum). The maximum is exact in any order, so 16 lanes take it.
static inline float scaled_max(float* s, int64_t n, float scale, float softcap) {
  float mx = -INFINITY;
  int64_t j = 0;
  if (softcap == 0.f) {
    v16 m16 = splat16(-INFINITY);
    for (; j + LANES <= n; j += LANES) {
      const v16 x = mul16(load16(s + j), splat16(scale));
      store16(s + j, x);
      m16 = max16(x, m16);
    }
    float t[LANES];
    store16(t, m16);
    for (int l = 0; l < LANES; ++l) mx = t[l] > mx ? t[l] : mx;
  }
  for (; j < n; ++j) {
    float x = s[j] * scale;
    if (softcap != 0.f) x = softcap * std::tanh(x / softcap);
    s[j] = x;
    mx = x > mx ? x : mx;
  }
  return mx;
}

// Lane l's partial sums of key_scores' dot for 16 keys side by side (a block of a.kt, kt):
// p_r = Σ fma(q_r,i, k_i) over i ≡ l (mod 16), i < hd, in i order — each key's lane l.
// NI: hd / 16 when hd is a multiple of 16 known here (the loop unrolled), else 0.
template <int R, int NI>
static inline void lane_partials(const AttnArgs& a, const float* const* q, const float* kt,
                                 int l, v16* p) {
  for (int r = 0; r < R; ++r) p[r] = splat16(0.f);
  if constexpr (NI > 0) {
#pragma GCC unroll 16
    for (int m = 0; m < NI; ++m) {
      const v16 k = load16(kt + LANES * (l + LANES * m));
      for (int r = 0; r < R; ++r) p[r] = fma16(bcast16(q[r] + l + LANES * m), k, p[r]);
    }
  } else {
    for (int64_t i = l; i < a.hd; i += LANES) {
      const v16 k = load16(kt + LANES * i);
      for (int r = 0; r < R; ++r) p[r] = fma16(bcast16(q[r] + i), k, p[r]);
    }
  }
}

// a_l = p_l + p_{l+8}, then b_l = a_l + a_{l+4}: tree_sum's first two levels, 16 keys at once.
template <int R, int NI>
static inline void tree_b(const AttnArgs& a, const float* const* q, const float* kt, int l,
                          v16* b) {
  v16 p[R], p8[R], a0[R];
  lane_partials<R, NI>(a, q, kt, l, p);
  lane_partials<R, NI>(a, q, kt, l + 8, p8);
  for (int r = 0; r < R; ++r) a0[r] = add16(p[r], p8[r]);
  lane_partials<R, NI>(a, q, kt, l + 4, p);
  lane_partials<R, NI>(a, q, kt, l + 12, p8);
  for (int r = 0; r < R; ++r) b[r] = add16(a0[r], add16(p[r], p8[r]));
}

// key_scores of 16 keys at once, from their block of a.kt: the same lanes and the same tree
// (c0 = b0 + b2, c1 = b1 + b3, c0 + c1), each key's in its own lane, so the same bits without
// a horizontal sum per key; into out[r·ATTN_TILE + j], j < 16.
template <int R, int NI>
static inline void block_scores(const AttnArgs& a, int64_t q0, const float* kt, float* out) {
  const float* q[R];
  for (int r = 0; r < R; ++r) q[r] = a.q + (q0 + r) * a.q_s;
  v16 b0[R], b2[R], c0[R];
  tree_b<R, NI>(a, q, kt, 0, b0);
  tree_b<R, NI>(a, q, kt, 2, b2);
  for (int r = 0; r < R; ++r) c0[r] = add16(b0[r], b2[r]);
  tree_b<R, NI>(a, q, kt, 1, b0);
  tree_b<R, NI>(a, q, kt, 3, b2);
  for (int r = 0; r < R; ++r) store16(out + r * ATTN_TILE, add16(c0[r], add16(b0[r], b2[r])));
}

template <int R>
static inline void block_scores_hd(const AttnArgs& a, int64_t q0, const float* kt, float* out) {
  switch (a.hd) {
    case 64: return block_scores<R, 4>(a, q0, kt, out);
    case 128: return block_scores<R, 8>(a, q0, kt, out);
    default: return block_scores<R, 0>(a, q0, kt, out);
  }
}

// The tile's scores into sc[r·ATTN_TILE + j]: 16 keys at a time where they are one block of
// a.kt (16 consecutive slots from a multiple of 16; a tile's last keys may be the block's
// first ones), else key by key.
template <int KT, int R>
static void tile_scores(const AttnArgs& a, int64_t q0, const int32_t* idx, int64_t n, float* sc) {
  float s4[4];
  for (int64_t j0 = 0; j0 < n; j0 += LANES) {
    const int64_t cnt = std::min<int64_t>(LANES, n - j0);
    const int32_t first = idx[j0];
    bool block = KT != kv_q8_0 && a.kt && first % LANES == 0;
    for (int64_t c = 1; block && c < cnt; ++c) block = idx[j0 + c] == first + c;
    if (block) {
      block_scores_hd<R>(a, q0, a.kt + (first / LANES) * a.hd * LANES, sc + j0);
      continue;
    }
    for (int64_t j = j0; j < j0 + cnt; ++j) {
      if (!a.kt && q0 == 0) stream_ahead(a.k + idx[j] * a.k_s, row_bytes<KT>(a.hd));
      key_scores<KT, R>(a, q0, a.k + idx[j] * a.k_s, s4);
      for (int r = 0; r < R; ++r) sc[r * ATTN_TILE + j] = s4[r];
    }
  }
}

// One tile's partial (m, l, o) for query heads q0..q0+R−1 into part + r·(dv + 2).
template <int KT, int R>
static void tile_part(const AttnArgs& a, int64_t q0, const int32_t* idx, int64_t n, float* sc,
                      float* part) {
  tile_scores<KT, R>(a, q0, idx, n, sc);
  const int64_t stride = a.dv + 2;
  for (int r = 0; r < R; ++r) {
    float* s = sc + r * ATTN_TILE;
    const float mx = scaled_max(s, n, a.scale, a.softcap);
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
      store16(s + j, exp_nonpositive(sub16(load16(s + j), splat16(mx))));
    for (; j < n; ++j) s[j] = exp_nonpositive(s[j] - mx);
    part[r * stride] = mx;
  }
  float l[R] = {};                                 // l_r = Σ_j p_r,j in j order (value_sums)
  value_sums<KT, R>(a, idx, n, sc, part + 2, stride, l);
  for (int r = 0; r < R; ++r) part[r * stride + 1] = l[r];
}

// state (m, l, o) of a.n heads, each dv + 2 floats, folded with a tile's part: see above.
static void attend_fold(float* state, const float* part, int64_t n, int64_t dv) {
  for (int64_t r = 0; r < n; ++r) {
    float* st = state + r * (dv + 2);
    const float* pt = part + r * (dv + 2);
    const float m = st[0] > pt[0] ? st[0] : pt[0];
    const float ea = exp_nonpositive(st[0] - m), eb = exp_nonpositive(pt[0] - m);
    st[0] = m;
    st[1] = st[1] * ea + pt[1] * eb;
    for (int64_t i = 0; i < dv; ++i) st[2 + i] = st[2 + i] * ea + pt[2 + i] * eb;
  }
}

template <int KT>
static void tiles_of(const AttnArgs& a, const int32_t* idx, int64_t n_keys, int64_t t0,
                     int64_t t1, bool fresh, float* state, float* scratch) {
  float* sc = scratch;                                   // 4 × ATTN_TILE scores
  float* part = fresh ? state : scratch + 4 * ATTN_TILE; // a.n × (dv + 2)
  for (int64_t t = t0; t < t1; ++t) {
    const int32_t* ti = idx + t * ATTN_TILE;
    const int64_t n = std::min<int64_t>(ATTN_TILE, n_keys - t * ATTN_TILE);
    for (int64_t q0 = 0; q0 < a.n; q0 += 4) {
      float* pr = part + q0 * (a.dv + 2);
      switch (std::min<int64_t>(4, a.n - q0)) {
        case 1: tile_part<KT, 1>(a, q0, ti, n, sc, pr); break;
        case 2: tile_part<KT, 2>(a, q0, ti, n, sc, pr); break;
        case 3: tile_part<KT, 3>(a, q0, ti, n, sc, pr); break;
        default: tile_part<KT, 4>(a, q0, ti, n, sc, pr); break;
      }
    }
    if (part != state) attend_fold(state, part, a.n, a.dv);
    part = scratch + 4 * ATTN_TILE;                      // later tiles fold into the state
  }
}

// Tiles [t0, t1) of the n_keys visible keys idx (tile t: idx[t·ATTN_TILE …]) for the a.n query
// heads, folded in order into state (a.n × (m, l, o[dv])); fresh: the first tile starts the
// state. scratch: 4·ATTN_TILE + a.n·(dv + 2) floats.
static void attend_tiles(const AttnArgs& a, const int32_t* idx, int64_t n_keys, int64_t t0,
                         int64_t t1, bool fresh, float* state, float* scratch) {
  switch (a.type) {
    case kv_f16: return tiles_of<kv_f16>(a, idx, n_keys, t0, t1, fresh, state, scratch);
    case kv_bf16: return tiles_of<kv_bf16>(a, idx, n_keys, t0, t1, fresh, state, scratch);
    case kv_q8_0: return tiles_of<kv_q8_0>(a, idx, n_keys, t0, t1, fresh, state, scratch);
    default: return tiles_of<kv_f32>(a, idx, n_keys, t0, t1, fresh, state, scratch);
  }
}

}  // namespace ISA
