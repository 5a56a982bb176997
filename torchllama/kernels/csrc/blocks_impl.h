// Matrix products of GGUF-style block weights with int8-quantized activations, for one
// instruction set. blocks.cpp includes this file once per instruction set, inside a namespace
// (`ISA`) and a `#pragma GCC target`, with ISA_LEVEL set to
//   0  scalar (any CPU): the 8 lanes of the vector paths emulated with plain loops,
//   1  AVX2 + FMA: _mm256_maddubs_epi16 / _mm256_madd_epi16 (llama.cpp's ggml-cpu/quants.c idiom),
//   2  AVX-512 VNNI on 256-bit registers: _mm256_dpbusd_epi32.
// Every level computes each output with the same float operations in the same order (the
// integer lanes are exact, so they are equal however they are formed): one answer on every CPU,
// for every batch size (see blocks.cpp for the contract).

namespace ISA {

// ---- eight int32 lanes: lane l = Σ_{t<4} u[4l+t] · s[4l+t] (u unsigned 8-bit, s signed) --------
#if ISA_LEVEL == 0
static inline void dot_lanes(const uint8_t* u, const int8_t* s, int32_t out[8]) {
  for (int l = 0; l < 8; ++l) {
    int32_t acc = 0;
    for (int t = 0; t < 4; ++t) acc += int32_t(u[4 * l + t]) * int32_t(s[4 * l + t]);
    out[l] = acc;
  }
}
#else
static inline __m256i dot_lanes(__m256i u, __m256i s) {
#if ISA_LEVEL == 2
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);          // 8 × int32
#else
  const __m256i p16 = _mm256_maddubs_epi16(u, s);                    // 16 × int16, pairs
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));               // 8 × int32, quads
#endif
}
#endif

// ---- float accumulators: 8 lanes, summed at the end by one fixed tree -------------------------
#if ISA_LEVEL == 0
struct Acc {
  float v[8];
  inline Acc() { for (int l = 0; l < 8; ++l) v[l] = 0.f; }
  // acc[l] = fma(float(p[l]), scale[l / 4], acc[l]): scale lo for lanes 0-3, hi for 4-7
  inline void add(const int32_t p[8], float lo, float hi) {
    for (int l = 0; l < 8; ++l) v[l] = std::fma(float(p[l]), l < 4 ? lo : hi, v[l]);
  }
  inline float sum() const {
    float a[4], b[2];
    for (int l = 0; l < 4; ++l) a[l] = v[l] + v[l + 4];               // 256 → 128
    b[0] = a[0] + a[2]; b[1] = a[1] + a[3];                           // 128 → 64
    return b[0] + b[1];                                               // 64 → 32
  }
};
#else
struct Acc {
  __m256 v;
  inline Acc() : v(_mm256_setzero_ps()) {}
  inline void add(__m256i p, float lo, float hi) {
    v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo)), v);
  }
  inline float sum() const {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));                   // lanes 0+2, 1+3
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
  }
};
#endif

// ---- block scales stored as float32, or as float16 bits where that is exact (half the bytes) --
static inline float scale_at(const float* p, int64_t i) { return p[i]; }
static inline float scale_at(const uint16_t* p, int64_t i) {
#if ISA_LEVEL == 0
  return c10::detail::fp16_ieee_to_fp32_value(p[i]);
#else
  return _cvtsh_ss(p[i]);
#endif
}

// ---- Q4 weights: w = d·q + m, q ∈ [0, 15]; byte j of a block: q[j] low, q[j+16] high nibble ----
// Tile of TM activation rows × TN weight rows. y[i][j] = Σ_b (d_w·d_x)·⟨q_w, q_x⟩_b + m_w·s_x.
template <int TM, int TN, typename S>
static inline void q4_tile(const Act& a, int64_t m0, const Q4Weight& w, int64_t n0, float* y,
                           int64_t ldy) {
  const S* wd_p = static_cast<const S*>(w.d);
  const S* wm_p = static_cast<const S*>(w.m);
  const int64_t nb = w.K / 32;
  Acc acc[TM][TN];
  float macc[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) macc[i][j] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
#if ISA_LEVEL == 0
    uint8_t wq[TN][32];
    for (int j = 0; j < TN; ++j) {
      const uint8_t* p = w.codes + (n0 + j) * (w.K / 2) + 16 * b;
      for (int t = 0; t < 16; ++t) { wq[j][t] = p[t] & 15; wq[j][t + 16] = p[t] >> 4; }
    }
#else
    __m256i wq[TN];
    for (int j = 0; j < TN; ++j) {
      const __m128i raw = _mm_loadu_si128((const __m128i*)(w.codes + (n0 + j) * (w.K / 2) + 16 * b));
      wq[j] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
    }
#endif
    float wd[TN], wm[TN];
    for (int j = 0; j < TN; ++j) {
      wd[j] = scale_at(wd_p, (n0 + j) * nb + b);
      wm[j] = scale_at(wm_p, (n0 + j) * nb + b);
    }
    for (int i = 0; i < TM; ++i) {
      const int8_t* xq = a.q + (m0 + i) * a.K + 32 * b;
      const float xd = a.d[(m0 + i) * nb + b], xs = a.s[(m0 + i) * nb + b];
#if ISA_LEVEL != 0
      const __m256i xv = _mm256_loadu_si256((const __m256i*)xq);
#endif
      for (int j = 0; j < TN; ++j) {
        const float scale = wd[j] * xd;
#if ISA_LEVEL == 0
        int32_t p[8];
        dot_lanes(wq[j], xq, p);
        acc[i][j].add(p, scale, scale);
#else
        acc[i][j].add(dot_lanes(wq[j], xv), scale, scale);
#endif
        macc[i][j] = std::fma(wm[j], xs, macc[i][j]);
      }
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) y[(m0 + i) * ldy + n0 + j] = acc[i][j].sum() + macc[i][j];
}

// ---- Q8 weights: w = d·q, q ∈ [-128, 127], one d per B = 32 or 16 weights ---------------------
// ⟨q_w, q_x⟩ as unsigned × signed: |q_w| · (sign(q_w) · q_x) (llama.cpp's idiom; q_x ≠ -128).
template <int TM, int TN, int B, typename S>
static inline void q8_tile(const Act& a, int64_t m0, const Q8Weight& w, int64_t n0, float* y,
                           int64_t ldy) {
  const S* wd_p = static_cast<const S*>(w.d);
  const int64_t nb = w.K / 32, nd = w.K / B;
  Acc acc[TM][TN];
  for (int64_t b = 0; b < nb; ++b) {
#if ISA_LEVEL == 0
    uint8_t wu[TN][32];
    const int8_t* wp[TN];
    for (int j = 0; j < TN; ++j) {
      wp[j] = w.codes + (n0 + j) * w.K + 32 * b;
      for (int t = 0; t < 32; ++t) wu[j][t] = uint8_t(wp[j][t] < 0 ? -int(wp[j][t]) : wp[j][t]);
    }
#else
    __m256i wv[TN], wu[TN];
    for (int j = 0; j < TN; ++j) {
      wv[j] = _mm256_loadu_si256((const __m256i*)(w.codes + (n0 + j) * w.K + 32 * b));
      wu[j] = _mm256_abs_epi8(wv[j]);
    }
#endif
    float dlo[TN], dhi[TN];
    for (int j = 0; j < TN; ++j) {
      const int64_t at = (n0 + j) * nd + (B == 32 ? b : 2 * b);
      dlo[j] = scale_at(wd_p, at);
      dhi[j] = B == 32 ? dlo[j] : scale_at(wd_p, at + 1);
    }
    for (int i = 0; i < TM; ++i) {
      const int8_t* xq = a.q + (m0 + i) * a.K + 32 * b;
      const float xd = a.d[(m0 + i) * nb + b];
#if ISA_LEVEL != 0
      const __m256i xv = _mm256_loadu_si256((const __m256i*)xq);
#endif
      for (int j = 0; j < TN; ++j) {
#if ISA_LEVEL == 0
        int8_t sx[32];
        for (int t = 0; t < 32; ++t) sx[t] = wp[j][t] < 0 ? -xq[t] : (wp[j][t] == 0 ? 0 : xq[t]);
        int32_t p[8];
        dot_lanes(wu[j], sx, p);
        acc[i][j].add(p, dlo[j] * xd, dhi[j] * xd);
#else
        acc[i][j].add(dot_lanes(wu[j], _mm256_sign_epi8(xv, wv[j])), dlo[j] * xd, dhi[j] * xd);
#endif
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

template <typename Tile1x4, typename Tile1x1, typename Tile4x2, typename Tile4x1>
static inline void drive(int64_t M, int64_t n_begin, int64_t n_end, Tile1x4 t14, Tile1x1 t11,
                         Tile4x2 t42, Tile4x1 t41) {
  for (int64_t mc = 0; mc < M; mc += MC) {
    const int64_t mend = std::min(M, mc + MC);
    int64_t n = n_begin;
    if (mend - mc >= 4) {
      for (; n + 2 <= n_end; n += 2) {
        int64_t m = mc;
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
        [&](int64_t m, int64_t n) { q4_tile<4, 1, S>(a, m, w, n, y, ld); });
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
        [&](int64_t m, int64_t n) { q8_tile<4, 1, B, S>(a, m, w, n, y, ld); });
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
