// Matrix products of GGUF-style block weights with int8-quantized activations, for one
// instruction set. arch/scalar.cpp, arch/avx2.cpp and arch/avx512_vnni.cpp each include this
// file once, inside a namespace (`ISA`) and (but for scalar) a `#pragma GCC target`, with
// ISA_LEVEL set to
//   0  scalar (any CPU): the 8 lanes of the vector paths emulated with plain loops,
//   1  AVX2 + FMA + F16C: _mm256_maddubs_epi16 / _mm256_madd_epi16 (llama.cpp's
//      ggml-cpu/quants.c idiom),
//   2  AVX-512 F/VL/BW + VNNI: _mm512_dpbusd_epi32, a pair of blocks per instruction.
// Every level computes each output with the same float operations in the same order (the
// integer lanes are exact, so they are equal however they are formed): one answer on every CPU,
// for every batch size (see blocks.cpp for the contract). The arguments (Act, Q4Weight,
// Q8Weight) are kernels.h's; q4_rows, q8_rows and quantize_block are the table's entries.

namespace ISA {

// ---- Two blocks side by side ------------------------------------------------------------------
// Every output accumulates its blocks in pairs (b, b+1) into 16 float lanes, each lane the
// integer dot product of 4 byte pairs (an exact int32) times its block's scale, by one fused
// multiply-add per lane per pair; the 16 lanes are summed at the end by one fixed tree. Which
// bytes feed which lane (the "lane map") is fixed per weight kind:
//   Q8: lanes 0-7 block b (lane l: bytes 4l..4l+3), lanes 8-15 block b+1;
//   Q4: lanes 0-3 block b bytes 0-15 (the low nibbles), 4-7 block b+1 bytes 0-15,
//       8-11 block b bytes 16-31 (the high nibbles), 12-15 block b+1 bytes 16-31,
// so one AVX-512 register holds a pair (one VNNI instruction for 64 weights), AVX2 two, and the
// scalar path loops; all three give the same bits. An odd last block fills only its lanes (the
// others get + 0·0, which leaves a lane's bits as they are: a lane is never −0).

#if ISA_LEVEL == 0
struct Lanes { int32_t v[16]; };                 // int32 dot products of a pair
struct Scales { float v[16]; };                  // the scale of each lane
#elif ISA_LEVEL == 1
struct Lanes { __m256i lo, hi; };                // lanes 0-7, 8-15
struct Scales { __m256 lo, hi; };
#else
typedef __m512i Lanes;
typedef __m512 Scales;
#endif

struct Acc {
#if ISA_LEVEL == 0
  float v[16];
  inline Acc() { for (int l = 0; l < 16; ++l) v[l] = 0.f; }
  inline void add(const Lanes& p, const Scales& s) {
    for (int l = 0; l < 16; ++l) v[l] = std::fma(float(p.v[l]), s.v[l], v[l]);
  }
  inline float sum() const {                     // lane l + lane l + w for w = 8, 4, 2, 1
    float a[8], b[4];
    for (int l = 0; l < 8; ++l) a[l] = v[l] + v[l + 8];
    for (int l = 0; l < 4; ++l) b[l] = a[l] + a[l + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
  }
#elif ISA_LEVEL == 1
  __m256 lo, hi;
  inline Acc() : lo(_mm256_setzero_ps()), hi(_mm256_setzero_ps()) {}
  inline void add(const Lanes& p, const Scales& s) {
    lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p.lo), s.lo, lo);
    hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p.hi), s.hi, hi);
  }
  inline float sum() const { return sum8(_mm256_add_ps(lo, hi)); }
#else
  __m512 v;
  inline Acc() : v(_mm512_setzero_ps()) {}
  inline void add(const Lanes& p, const Scales& s) {
    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, v);
  }
  inline float sum() const {
    const __m256 hi8 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return sum8(_mm256_add_ps(_mm512_castps512_ps256(v), hi8));
  }
#endif
#if ISA_LEVEL != 0
  static inline float sum8(__m256 a) {           // lane l + lane l + w for w = 4, 2, 1
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                 // b0+b2, b1+b3
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
  }
#endif
};

// ---- block scales stored as float32, or as float16 bits where that is exact (half the bytes) --
static inline float scale_at(const float* p, int64_t i) { return p[i]; }
static inline float scale_at(const uint16_t* p, int64_t i) {
#if ISA_LEVEL == 0
  return c10::detail::fp16_ieee_to_fp32_value(p[i]);
#else
  return _cvtsh_ss(p[i]);
#endif
}

// The 16 lane scales of a pair from c = (c0, c1, c2, c3), one per lane quarter (the lane
// map's): Q8 quarters (b, b, b+1, b+1), or with B = 16 (b lo, b hi, b+1 lo, b+1 hi); Q4
// quarters (b, b+1, b, b+1). A lane's scale is d_w·d_x, one IEEE product on every path
// (`mul` of the weight's and the activation's lane scales).
#if ISA_LEVEL == 0
struct F4 { float v[4]; };
static inline Scales quarters(F4 c) {
  Scales s;
  for (int l = 0; l < 16; ++l) s.v[l] = c.v[l / 4];
  return s;
}
#else
typedef __m128 F4;
static inline Scales quarters(F4 c) {
#if ISA_LEVEL == 1
  const __m256 c8 = _mm256_castps128_ps256(c);
  return Scales{_mm256_permutevar8x32_ps(c8, _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0)),
                _mm256_permutevar8x32_ps(c8, _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2))};
#else
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(c));
#endif
}
#endif

// Lane-wise products of two lane scale vectors (quarters(a) ⊙ quarters(b) = quarters(a ⊙ b)).
static inline Scales mul(const Scales& a, const Scales& b) {
#if ISA_LEVEL == 0
  Scales s;
  for (int l = 0; l < 16; ++l) s.v[l] = a.v[l] * b.v[l];
  return s;
#elif ISA_LEVEL == 1
  return Scales{_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
#else
  return _mm512_mul_ps(a, b);
#endif
}

// a·b + c rounded once, lane by lane (4 lanes), and b broadcast.
static inline F4 fma4(F4 a, F4 b, F4 c) {
#if ISA_LEVEL == 0
  for (int q = 0; q < 4; ++q) c.v[q] = std::fma(a.v[q], b.v[q], c.v[q]);
  return c;
#else
  return _mm_fmadd_ps(a, b, c);
#endif
}
static inline F4 splat4(float x) {
#if ISA_LEVEL == 0
  return F4{{x, x, x, x}};
#else
  return _mm_set1_ps(x);
#endif
}
static inline F4 F4_of(float a, float b, float c, float d) {   // lanes (a, b, c, d)
#if ISA_LEVEL == 0
  return F4{{a, b, c, d}};
#else
  return _mm_set_ps(d, c, b, a);
#endif
}
static inline float lane4(F4 v, int i) {
#if ISA_LEVEL == 0
  return v.v[i];
#else
  float t[4];
  _mm_storeu_ps(t, v);
  return t[i];
#endif
}

// n (1, 2 or 4) consecutive scales from p as (p[0], .., p[n-1], 0, ..) in 4 float lanes, and
// four lanes picked from them (lane q = v[I_q]).
template <typename S>
static inline F4 load_scales(const S* p, int n) {
#if ISA_LEVEL == 0
  F4 v{{0.f, 0.f, 0.f, 0.f}};
  for (int i = 0; i < n; ++i) v.v[i] = scale_at(p, i);
  return v;
#else
  if constexpr (std::is_same<S, float>::value) {
    if (n == 4) return _mm_loadu_ps(p);
    if (n == 2) return _mm_castpd_ps(_mm_load_sd((const double*)p));
    return _mm_load_ss(p);
  } else {
    if (n == 4) return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)p));
    uint32_t bits = p[0];
    if (n == 2) std::memcpy(&bits, p, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(int(bits)));
  }
#endif
}

template <int I0, int I1, int I2, int I3>
static inline F4 pick(F4 v) {
#if ISA_LEVEL == 0
  return F4{{v.v[I0], v.v[I1], v.v[I2], v.v[I3]}};
#else
  return _mm_shuffle_ps(v, v, _MM_SHUFFLE(I3, I2, I1, I0));
#endif
}

// quarters of (c0, c1, c0, c1) (the Q4 pattern: b, b+1, b, b+1) from c's first two lanes; on
// AVX2 the two halves are the same register.
static inline Scales quarters_q4(F4 c) {
#if ISA_LEVEL == 1
  const __m256 lo = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(c),
                                             _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
  return Scales{lo, lo};
#else
  return quarters(pick<0, 1, 0, 1>(c));
#endif
}

static inline F4 mul4(F4 a, F4 b) {
#if ISA_LEVEL == 0
  for (int q = 0; q < 4; ++q) a.v[q] *= b.v[q];
  return a;
#else
  return _mm_mul_ps(a, b);
#endif
}

// ---- activation quantization: one block of 32 floats → int8, d = amax / 127, s = d·Σq ------
// The exact float operations of blocks.cpp's contract (and the tests' NumPy reference) on every
// level: amax = max |x| (exact in any order), d = amax / 127, id = 1 / d, q = rint(x·id) (round
// half to even, the default mode), s = d · Σq (an exact integer sum). The vector levels only
// do the same operations 16 or 8 lanes at a time (libm's nearbyint, one call per float, was
// ~1/8 of a batch-8 decode step).
static inline void quantize_block(const float* xb, int8_t* qb, float* d, float* s) {
#if ISA_LEVEL == 0
  float amax = 0.f;
  for (int t = 0; t < 32; ++t) amax = std::max(amax, std::fabs(xb[t]));
  const float db = amax / 127.f;
  const float id = db != 0.f ? 1.f / db : 0.f;
  int32_t sum = 0;
  for (int t = 0; t < 32; ++t) {
    const int32_t v = int32_t(std::nearbyint(xb[t] * id));
    qb[t] = int8_t(v);
    sum += v;
  }
#elif ISA_LEVEL == 1
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4], a = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    x[k] = _mm256_loadu_ps(xb + 8 * k);
    a = _mm256_max_ps(a, _mm256_andnot_ps(sign, x[k]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float db = amax / 127.f;
  const float id = db != 0.f ? 1.f / db : 0.f;
  const __m256 vid = _mm256_set1_ps(id);
  alignas(32) int32_t v[32];
  for (int k = 0; k < 4; ++k)
    _mm256_store_si256((__m256i*)(v + 8 * k), _mm256_cvtps_epi32(_mm256_round_ps(
        _mm256_mul_ps(x[k], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  int32_t sum = 0;
  for (int t = 0; t < 32; ++t) {
    qb[t] = int8_t(v[t]);
    sum += v[t];
  }
#else
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float db = amax / 127.f;
  const float id = db != 0.f ? 1.f / db : 0.f;
  const __m512 vid = _mm512_set1_ps(id);
  const int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x0, vid), rn));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x1, vid), rn));
  _mm_storeu_si128((__m128i*)qb, _mm512_cvtepi32_epi8(q0));          // |q| ≤ 127: exact
  _mm_storeu_si128((__m128i*)(qb + 16), _mm512_cvtepi32_epi8(q1));
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#endif
  *d = db;
  *s = db * float(sum);
}

// ---- Q4 pair: weight bytes as the lane map wants them, activations likewise (once per row) ---
// A Q4 block is 16 bytes: byte t holds q[t] (low nibble) and q[t+16] (high nibble).
#if ISA_LEVEL == 0
struct Q4Pair { uint8_t u[64]; };                // lane l: bytes 4l..4l+3
struct XPair { int8_t s[64]; };
// byte position of lane-map byte i (0..63) in (block 0|1, index within the block 0..31)
static inline void q4_map(int i, int& blk, int& t) {
  const int lane = i / 4;
  blk = (lane / 4) % 2;
  t = 16 * (lane / 8) + 4 * (lane % 4) + i % 4;
}
#elif ISA_LEVEL == 1
struct Q4Pair { __m256i lo, hi; };
struct XPair { __m256i lo, hi; };
#else
typedef __m512i Q4Pair;
typedef __m512i XPair;
#endif

// `two`: blocks b and b+1 both exist (else b+1 reads as zeros).
static inline Q4Pair q4_pair(const uint8_t* p, bool two) {
#if ISA_LEVEL == 0
  Q4Pair w;
  for (int i = 0; i < 64; ++i) {
    int blk, t;
    q4_map(i, blk, t);
    const uint8_t byte = (blk == 0 || two) ? p[16 * blk + t % 16] : 0;
    w.u[i] = t < 16 ? (byte & 15) : (byte >> 4);
  }
  return w;
#else
  const __m256i raw = two ? _mm256_loadu_si256((const __m256i*)p)
                          : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)p));
  const __m256i m4 = _mm256_set1_epi8(15);
  const __m256i lo = _mm256_and_si256(raw, m4);                       // q[0..15] of b, b+1
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);  // q[16..31]
#if ISA_LEVEL == 1
  return Q4Pair{lo, hi};
#else
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
#endif
#endif
}

static inline XPair q4_x_pair(const int8_t* x, bool two) {
#if ISA_LEVEL == 0
  XPair v;
  for (int i = 0; i < 64; ++i) {
    int blk, t;
    q4_map(i, blk, t);
    v.s[i] = (blk == 0 || two) ? x[32 * blk + t] : 0;
  }
  return v;
#else
  const __m256i x0 = _mm256_loadu_si256((const __m256i*)x);
  const __m256i x1 = two ? _mm256_loadu_si256((const __m256i*)(x + 32)) : _mm256_setzero_si256();
  const __m256i lo = _mm256_permute2x128_si256(x0, x1, 0x20);        // x0[0:16], x1[0:16]
  const __m256i hi = _mm256_permute2x128_si256(x0, x1, 0x31);        // x0[16:32], x1[16:32]
#if ISA_LEVEL == 1
  return XPair{lo, hi};
#else
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
#endif
#endif
}

// A pair of activation blocks already in the lane map's order (Act::q4): 64 bytes.
static inline XPair q4_x_laid_out(const int8_t* p) {
#if ISA_LEVEL == 0
  XPair v;
  std::memcpy(v.s, p, 64);
  return v;
#elif ISA_LEVEL == 1
  return XPair{_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 32))};
#else
  return _mm512_loadu_si512(p);
#endif
}

static inline Lanes q4_dot(const Q4Pair& w, const XPair& x) {
#if ISA_LEVEL == 0
  Lanes p;
  for (int l = 0; l < 16; ++l) {
    int32_t acc = 0;
    for (int t = 0; t < 4; ++t) acc += int32_t(w.u[4 * l + t]) * int32_t(x.s[4 * l + t]);
    p.v[l] = acc;
  }
  return p;
#elif ISA_LEVEL == 1
  const __m256i one = _mm256_set1_epi16(1);
  return Lanes{_mm256_madd_epi16(_mm256_maddubs_epi16(w.lo, x.lo), one),
               _mm256_madd_epi16(_mm256_maddubs_epi16(w.hi, x.hi), one)};
#else
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
#endif
}

// ---- Q8 pair: 64 weight bytes (32 with one block) against 64 activation bytes -----------------
// ⟨q_w, q_x⟩ as unsigned × signed: |q_w| · (sign(q_w) · q_x) (llama.cpp's idiom; q_x ≠ -128).
#if ISA_LEVEL == 0
typedef XPair Q8X;
#elif ISA_LEVEL == 1
struct Q8X { __m256i lo, hi; };
#else
typedef __m512i Q8X;
#endif

static inline Q8X q8_x_pair(const int8_t* x, bool two) {
#if ISA_LEVEL == 0
  Q8X v;
  for (int i = 0; i < 64; ++i) v.s[i] = (i < 32 || two) ? x[i] : 0;
  return v;
#elif ISA_LEVEL == 1
  return Q8X{_mm256_loadu_si256((const __m256i*)x),
             two ? _mm256_loadu_si256((const __m256i*)(x + 32)) : _mm256_setzero_si256()};
#else
  return two ? _mm512_loadu_si512(x) : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)x));
#endif
}

static inline Lanes q8_dot(const int8_t* w, const Q8X& x, bool two) {
#if ISA_LEVEL == 0
  Lanes p;
  for (int l = 0; l < 16; ++l) {
    int32_t acc = 0;
    for (int t = 0; t < 4 && (l < 8 || two); ++t) acc += int32_t(w[4 * l + t]) * x.s[4 * l + t];
    p.v[l] = acc;
  }
  return p;
#elif ISA_LEVEL == 1
  const __m256i one = _mm256_set1_epi16(1);
  auto dot8 = [&](__m256i wv, __m256i xv) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv)), one);
  };
  const __m256i w0 = _mm256_loadu_si256((const __m256i*)w);
  return Lanes{dot8(w0, x.lo),
               two ? dot8(_mm256_loadu_si256((const __m256i*)(w + 32)), x.hi) : _mm256_setzero_si256()};
#else
  const __m512i wv = two ? _mm512_loadu_si512(w)
                         : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)w));
  const __m512i xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), x);
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(wv), xs);
#endif
}

// Decode tiles (one activation row) prefetch the weight bytes PF rows ahead: the rows stream
// from memory once per token, and the hardware prefetcher alone leaves half the bandwidth
// unused (Gemma 3's 262144 × 640 Q8_0 output projection: 5.3 → 4.2 ms with 2 threads).
constexpr int64_t PF = 8;

static inline float first(F4 v) {
#if ISA_LEVEL == 0
  return v.v[0];
#else
  return _mm_cvtss_f32(v);
#endif
}
static inline float second(F4 v) {
#if ISA_LEVEL == 0
  return v.v[1];
#else
  return _mm_cvtss_f32(_mm_movehdup_ps(v));
#endif
}

// ---- Q4 weights: w = d·q + m, q ∈ [0, 15] ------------------------------------------------------
// Tile of TM activation rows × TN weight rows. y[i][j] = Σ_b (d_w·d_x)·⟨q_w, q_x⟩_b + m_w·s_x,
// the first sum over pairs of blocks (see the lane map), the second a plain chain over b.
template <int TM, int TN, typename S>
static inline void q4_tile(const Act& a, int64_t m0, const Q4Weight& w, int64_t n0, float* y,
                           int64_t ldy) {
  const S* wd_p = static_cast<const S*>(w.d);
  const S* wm_p = static_cast<const S*>(w.m);
  const int64_t nb = w.K / 32;
  constexpr int TQ = (TM + 3) / 4;               // groups of four rows
  const bool laid_out = TM % 4 == 0 && a.q4 != nullptr;   // prefill: Act::q4 and Act::s_t
  Acc acc[TM][TN];
  float macc[TM][TN];                            // the m_w·s_x chain, one per output
  F4 macc4[TQ][TN];                              // the same chains, four rows as lanes
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) macc[i][j] = 0.f;
  for (int q = 0; q < TQ; ++q)
    for (int j = 0; j < TN; ++j) macc4[q][j] = splat4(0.f);
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    const int n = two ? 2 : 1;
    Q4Pair wq[TN];
    F4 wd[TN];                                   // (d_w of block b, of block b+1, -, -)
    Scales wds[TM > 1 ? TN : 1];                 // several rows: d_w spread over the lanes once
    F4 wm[TN];                                   // (m_w of block b, of block b+1, -, -)
    for (int j = 0; j < TN; ++j) {
      const uint8_t* codes = w.codes + (n0 + j) * (w.K / 2) + 16 * b;
      if (TM == 1) __builtin_prefetch(codes + PF * (w.K / 2));   // see PF
      wq[j] = q4_pair(codes, two);
      wd[j] = load_scales(wd_p + (n0 + j) * nb + b, n);
      if constexpr (TM > 1) wds[j] = quarters_q4(wd[j]);
      wm[j] = load_scales(wm_p + (n0 + j) * nb + b, n);
    }
    for (int i = 0; i < TM; ++i) {
      const int64_t r = (m0 + i) * nb + b;
      const XPair xv = laid_out ? q4_x_laid_out(a.q4 + (m0 + i) * a.Kp + 32 * b)
                                : q4_x_pair(a.q + (m0 + i) * a.K + 32 * b, two);
      const F4 xd = load_scales(a.d + r, n);
      // lane scales d_w·d_x (the same float products either way), products of 2 lanes
      if constexpr (TM == 1) {
        for (int j = 0; j < TN; ++j) acc[i][j].add(q4_dot(wq[j], xv), quarters_q4(mul4(wd[j], xd)));
      } else {
        const Scales xds = quarters_q4(xd);
        for (int j = 0; j < TN; ++j) acc[i][j].add(q4_dot(wq[j], xv), mul(wds[j], xds));
      }
      if (laid_out) continue;
      if (TM == 1 && TN == 4) {                  // the four m_w·s_x chains as 4 lanes
        macc4[0][0] = fma4(F4_of(first(wm[0]), first(wm[1]), first(wm[2]), first(wm[3])),
                           splat4(a.s[r]), macc4[0][0]);
        if (two)
          macc4[0][0] = fma4(F4_of(second(wm[0]), second(wm[1]), second(wm[2]), second(wm[3])),
                             splat4(a.s[r + 1]), macc4[0][0]);
        continue;
      }
      for (int j = 0; j < TN; ++j) {
        macc[i][j] = std::fma(first(wm[j]), a.s[r], macc[i][j]);
        if (two) macc[i][j] = std::fma(second(wm[j]), a.s[r + 1], macc[i][j]);
      }
    }
    if (laid_out) {
      for (int q = 0; q < TQ; ++q) {
        const F4 s0 = load_scales(a.s_t + b * a.M + m0 + 4 * q, 4);
        for (int j = 0; j < TN; ++j) macc4[q][j] = fma4(splat4(first(wm[j])), s0, macc4[q][j]);
        if (two) {
          const F4 s1 = load_scales(a.s_t + (b + 1) * a.M + m0 + 4 * q, 4);
          for (int j = 0; j < TN; ++j)
            macc4[q][j] = fma4(splat4(second(wm[j])), s1, macc4[q][j]);
        }
      }
    }
  }
  if (TM == 1 && TN == 4 && !laid_out)
    for (int j = 0; j < TN; ++j) macc[0][j] = lane4(macc4[0][0], j);
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j)
      y[(m0 + i) * ldy + n0 + j] = acc[i][j].sum() +
                                   (laid_out ? lane4(macc4[i / 4][j], i % 4) : macc[i][j]);
}

// ---- Q8 weights: w = d·q, q ∈ [-128, 127], one d per B = 32 or 16 weights ---------------------
template <int TM, int TN, int B, typename S>
static inline void q8_tile(const Act& a, int64_t m0, const Q8Weight& w, int64_t n0, float* y,
                           int64_t ldy) {
  const S* wd_p = static_cast<const S*>(w.d);
  const int64_t nb = w.K / 32, nd = w.K / B;
  Acc acc[TM][TN];
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    Scales wd[TN];                               // the lanes' weight scales
    for (int j = 0; j < TN; ++j) {
      const S* d = wd_p + (n0 + j) * nd + b * (32 / B);
      wd[j] = quarters(B == 16 ? load_scales(d, two ? 4 : 2)
                               : pick<0, 0, 1, 1>(load_scales(d, two ? 2 : 1)));
    }
    for (int i = 0; i < TM; ++i) {
      const int64_t r = (m0 + i) * nb + b;
      const Q8X xv = q8_x_pair(a.q + (m0 + i) * a.K + 32 * b, two);
      const Scales xd = quarters(pick<0, 0, 1, 1>(load_scales(a.d + r, two ? 2 : 1)));
      for (int j = 0; j < TN; ++j) {
        const int8_t* codes = w.codes + (n0 + j) * w.K + 32 * b;
        if (TM == 1) __builtin_prefetch(codes + PF * w.K);              // see PF
        acc[i][j].add(q8_dot(codes, xv, two), mul(wd[j], xd));
      }
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) y[(m0 + i) * ldy + n0 + j] = acc[i][j].sum();
}

// ---- drivers: rows [n_begin, n_end) of W for every activation row -----------------------------
// Decode (few rows): 1 × 4 tiles, four independent accumulators per activation row. Prefill:
// 4 × 2 tiles over chunks of MC activation rows, so a weight tile is reused from cache.
constexpr int64_t MC = 64;

template <typename Tile1x4, typename Tile1x1, typename Tile4x2, typename Tile4x1,
          typename Tile8x2>
static inline void drive(int64_t M, int64_t n_begin, int64_t n_end, Tile1x4 t14, Tile1x1 t11,
                         Tile4x2 t42, Tile4x1 t41, Tile8x2 t82) {
  for (int64_t mc = 0; mc < M; mc += MC) {
    const int64_t mend = std::min(M, mc + MC);
    int64_t n = n_begin;
    if (mend - mc >= 4) {
      for (; n + 2 <= n_end; n += 2) {
        int64_t m = mc;
        for (; m + 8 <= mend; m += 8) t82(m, n);
        for (; m + 4 <= mend; m += 4) t42(m, n);
        for (; m < mend; ++m) { t11(m, n); t11(m, n + 1); }
      }
      for (; n < n_end; ++n) {
        int64_t m = mc;
        for (; m + 4 <= mend; m += 4) t41(m, n);
        for (; m < mend; ++m) t11(m, n);
      }
    } else {
      for (; n + 4 <= n_end; n += 4)
        for (int64_t m = mc; m < mend; ++m) t14(m, n);
      for (; n < n_end; ++n)
        for (int64_t m = mc; m < mend; ++m) t11(m, n);
    }
  }
}

template <typename S>
static void q4_rows_s(const Act& a, const Q4Weight& w, float* y, int64_t n_begin, int64_t n_end) {
  const int64_t ld = w.N;
  drive(a.M, n_begin, n_end,
        [&](int64_t m, int64_t n) { q4_tile<1, 4, S>(a, m, w, n, y, ld); },
        [&](int64_t m, int64_t n) { q4_tile<1, 1, S>(a, m, w, n, y, ld); },
        [&](int64_t m, int64_t n) { q4_tile<4, 2, S>(a, m, w, n, y, ld); },
        [&](int64_t m, int64_t n) { q4_tile<4, 1, S>(a, m, w, n, y, ld); },
        [&](int64_t m, int64_t n) { q4_tile<8, 2, S>(a, m, w, n, y, ld); });
}

static void q4_rows(const Act& a, const Q4Weight& w, float* y, int64_t n_begin, int64_t n_end) {
  if (w.half) q4_rows_s<uint16_t>(a, w, y, n_begin, n_end);
  else q4_rows_s<float>(a, w, y, n_begin, n_end);
}

template <int B, typename S>
static void q8_rows_b(const Act& a, const Q8Weight& w, float* y, int64_t n_begin, int64_t n_end) {
  const int64_t ld = w.N;
  drive(a.M, n_begin, n_end,
        [&](int64_t m, int64_t n) { q8_tile<1, 4, B, S>(a, m, w, n, y, ld); },
        [&](int64_t m, int64_t n) { q8_tile<1, 1, B, S>(a, m, w, n, y, ld); },
        [&](int64_t m, int64_t n) { q8_tile<4, 2, B, S>(a, m, w, n, y, ld); },
        [&](int64_t m, int64_t n) { q8_tile<4, 1, B, S>(a, m, w, n, y, ld); },
        [&](int64_t m, int64_t n) { q8_tile<4, 2, B, S>(a, m, w, n, y, ld);
                                    q8_tile<4, 2, B, S>(a, m + 4, w, n, y, ld); });
}

static void q8_rows(const Act& a, const Q8Weight& w, float* y, int64_t n_begin, int64_t n_end) {
  if (w.block == 16) {
    if (w.half) q8_rows_b<16, uint16_t>(a, w, y, n_begin, n_end);
    else q8_rows_b<16, float>(a, w, y, n_begin, n_end);
  } else {
    if (w.half) q8_rows_b<32, uint16_t>(a, w, y, n_begin, n_end);
    else q8_rows_b<32, float>(a, w, y, n_begin, n_end);
  }
}

}  // namespace ISA
