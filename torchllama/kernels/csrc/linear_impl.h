// The float32 matrix product y = x · Wᵀ for one instruction set (see layers.cpp's header for the
// contract). The arch/ files include it after layers_impl.h inside each instruction set's
// namespace (linear_rows and linear_cols are the table's entries): it builds on that file's
// 16-lane vectors (v16, load16, fma16, splat16) and on its reduction tree (tree_sum,
// tree_sum4), so every output is `dot(x_m, w_n, K)` of layers_impl.h:
//   lane l (0..15) = the fused multiply-add chain over k ≡ l (mod 16), k increasing, from +0;
//   y = tree_sum(lanes) = ((l0+l8)+(l4+l12)) + ((l2+l10)+(l6+l14))
//                       + ((l1+l9)+(l5+l13)) + ((l3+l11)+(l7+l15)).
// Two layouts of W reach that same sum by different routes:
//   row-major W (N, K): `row_tile` keeps one 16-lane accumulator per output (lanes over k) and
//       reduces it by the tree at the end, TM rows of x × TN rows of W per tile;
//   column-major W (the transpose of a contiguous (K, N), the layout torchllama's loaders give
//       float32 weights): `col_tile` puts 16 outputs (columns) in the lanes of a vector and runs
//       the 16 chains of each output (k ≡ r) as 16 passes over the tile's rows of Wᵀ, adding
//       the passes' results by the same tree (bit-reversed pass order: each finished pair, quad,
//       octet is added as soon as it is complete, `merge`).
// Tiles, threads and layouts only choose which outputs are computed together, never the order
// of an output's own operations: the same bits for every M, tile and instruction set.

namespace ISA {

// Tile shapes per instruction set (registers: 32 zmm on AVX-512, 16 ymm on AVX2, where a v16
// is two ymm). Row-major: RM rows of x × RN rows of W (RM·RN accumulators), 1 × 4 for a lone
// row. Column-major: CM rows × CV vectors of 16 columns, 1 × CV1 for a lone row (decode).
// Measured against MKL's sgemm on one thread of a Zen 5, 512 rows of SmolLM2's shapes:
// AVX-512 in about half its time; the AVX2 build (forced) as fast with a column-major W and
// 1.25-1.3× slower with a row-major one (its 16-lane accumulators take two ymm each).
#if ISA_LEVEL == 2
constexpr int RM = 6, RN = 4, CM = 6, CV = 4, CV1 = 16;
#elif ISA_LEVEL == 1
constexpr int RM = 3, RN = 2, CM = 3, CV = 2, CV1 = 4;
#else
constexpr int RM = 1, RN = 1, CM = 1, CV = 1, CV1 = 1;
#endif

// Weights in half precision (LinearArgs::w16): the stored bits, converted to float32 exactly
// where they are loaded (F16C / AVX-512's vcvtph2ps for float16, a 16-bit shift for bfloat16).
struct f16w { uint16_t bits; };
struct bf16w { uint16_t bits; };
static inline float to_f32(float w) { return w; }
static inline float to_f32(bf16w w) {
  const uint32_t u = uint32_t(w.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline float to_f32(f16w w) {
#if ISA_LEVEL == 0
  return c10::detail::fp16_ieee_to_fp32_value(w.bits);
#else
  return _cvtsh_ss(w.bits);
#endif
}
static inline v16 load16(const f16w* p) {
#if ISA_LEVEL == 2
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#elif ISA_LEVEL == 1
  return v16{(v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)),
             (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
#else
  float t[LANES];
  for (int l = 0; l < LANES; ++l) t[l] = to_f32(p[l]);
  return load16(t);
#endif
}
static inline v16 load16(const bf16w* p) {
#if ISA_LEVEL == 2
  return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#elif ISA_LEVEL == 1
  const auto half = [](const bf16w* q) {
    return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)q)), 16));
  };
  return v16{half(p), half(p + 8)};
#else
  float t[LANES];
  for (int l = 0; l < LANES; ++l) t[l] = to_f32(p[l]);
  return load16(t);
#endif
}

// dot's tail: lane l takes element k0 + l of the last K − k0 (< 16) elements.
template <typename W>
static inline v16 tail16(v16 acc, const float* a, const W* b, int64_t k0, int64_t K) {
  float t[LANES];
  store16(t, acc);
  for (int l = 0; k0 < K; ++k0, ++l) t[l] = std::fma(a[k0], to_f32(b[k0]), t[l]);
  return load16(t);
}

// ---- row-major W -------------------------------------------------------------------------------

// Software prefetch of a byte range, `lines` cache lines per step of a tile's k loop: the next
// block of W rows while a block is computed. (The hardware prefetchers stay just ahead of the
// loads, so each block's first tiles waited on memory.)
struct Ahead {
  const char* p = nullptr; const char* end = nullptr; int64_t lines = 0;
  inline void step() {
    for (int64_t q = 0; q < lines && p < end; ++q, p += 64) __builtin_prefetch(p);
  }
};

// y[i][j] = dot(x_i, w_j, K) for i < TM, j < TN: x TM rows and w TN rows at stride K, y rows at
// stride ldy. Each 16 elements of a row of x or W are loaded once for the whole tile.
template <int TM, int TN, typename W>
static inline void row_tile(const float* x, const W* w, int64_t K, float* y, int64_t ldy,
                            Ahead& ahead) {
  v16 acc[TM][TN];
#pragma GCC unroll 16
  for (int i = 0; i < TM; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < TN; ++j) acc[i][j] = splat16(0.f);
  const int64_t K16 = K / LANES * LANES;
  for (int64_t k = 0; k < K16; k += LANES) {
    ahead.step();
    v16 wv[TN];
#pragma GCC unroll 8
    for (int j = 0; j < TN; ++j) wv[j] = load16(w + j * K + k);
#pragma GCC unroll 8
    for (int i = 0; i < TM; ++i) {
      const v16 xv = load16(x + i * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < TN; ++j) acc[i][j] = fma16(xv, wv[j], acc[i][j]);
    }
  }
  if (K16 < K)
#pragma GCC unroll 16
    for (int i = 0; i < TM; ++i)
#pragma GCC unroll 16
      for (int j = 0; j < TN; ++j) acc[i][j] = tail16(acc[i][j], x + i * K, w + j * K, K16, K);
#pragma GCC unroll 16
  for (int i = 0; i < TM; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j + 4 <= TN; j += 4)
      tree_sum4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3], y + i * ldy + j);
#pragma GCC unroll 4
    for (int j = TN / 4 * 4; j < TN; ++j) y[i * ldy + j] = tree_sum(acc[i][j]);
  }
}

// Rows m .. m + tm − 1 of x (tm ≤ RM) against W rows [n0, n1): tiles of tm × TN, then single rows.
template <int TM, typename W>
static void row_span(const LinearArgs& a, const W* w, int64_t m, int64_t n0, int64_t n1,
                     Ahead& ahead) {
  constexpr int TN = TM == 1 ? 4 : RN;
  const float* x = a.x + m * a.K;
  float* y = a.y + m * a.N;
  int64_t n = n0;
  for (; n + TN <= n1; n += TN) row_tile<TM, TN>(x, w + n * a.K, a.K, y + n, a.N, ahead);
  for (; n < n1; ++n) row_tile<TM, 1>(x, w + n * a.K, a.K, y + n, a.N, ahead);
}

template <typename W>
static void row_span_any(int tm, const LinearArgs& a, const W* w, int64_t m, int64_t n0,
                         int64_t n1, Ahead& ahead) {
  switch (tm) {                                  // tm ≤ RM
    case 1: row_span<1>(a, w, m, n0, n1, ahead); break;
    case 2: row_span<2 <= RM ? 2 : 1>(a, w, m, n0, n1, ahead); break;
    case 3: row_span<3 <= RM ? 3 : 1>(a, w, m, n0, n1, ahead); break;
    case 4: row_span<4 <= RM ? 4 : 1>(a, w, m, n0, n1, ahead); break;
    case 5: row_span<5 <= RM ? 5 : 1>(a, w, m, n0, n1, ahead); break;
    default: row_span<RM>(a, w, m, n0, n1, ahead); break;
  }
}

// y[:, n0:n1) for a row-major W (N, K) of element type W: blocks of W rows that stay in L2
// (~128 KiB of float32) while every tile of x rows passes over them, the next block prefetched
// meanwhile (several rows of x; a lone row streams W, which the hardware prefetchers follow).
template <typename W>
static void linear_rows_of(const LinearArgs& a, const W* w, int64_t n0, int64_t n1) {
  const int64_t NB = std::max<int64_t>(4, (32768 / std::max<int64_t>(a.K, 1)) / 4 * 4);
  for (int64_t nb = n0; nb < n1; nb += NB) {
    const int64_t ne = std::min(n1, nb + NB), next = std::min(n1, ne + NB);
    Ahead ahead;                                 // spread over the block's k-steps
    if (a.M > 1 && next > ne) {
      const int64_t steps = (a.M + RM - 1) / RM * ((ne - nb + RN - 1) / RN) * (a.K / LANES);
      const int64_t lines = (next - ne) * a.K * int64_t(sizeof(W)) / 64;
      ahead = Ahead{reinterpret_cast<const char*>(w + ne * a.K),
                    reinterpret_cast<const char*>(w + next * a.K),
                    (lines + steps - 1) / std::max<int64_t>(steps, 1)};
    }
    for (int64_t m = 0; m < a.M; m += RM)
      row_span_any(int(std::min<int64_t>(RM, a.M - m)), a, w, m, nb, ne, ahead);
  }
}

// The table's entry: float32 weights, or half-precision ones (LinearArgs::w16_type).
static void linear_rows(const LinearArgs& a, int64_t n0, int64_t n1) {
  if (a.w16_type == 1) linear_rows_of(a, reinterpret_cast<const f16w*>(a.w16), n0, n1);
  else if (a.w16_type == 2) linear_rows_of(a, reinterpret_cast<const bf16w*>(a.w16), n0, n1);
  else linear_rows_of(a, a.w, n0, n1);
}

// ---- column-major W ----------------------------------------------------------------------------

// A vector of 16 copies of x (splat16 adds x to a zero vector, which would turn −0 into +0).
static inline v16 bcast16(float x) {
#if ISA_LEVEL == 2
  return (v16)_mm512_set1_ps(x);
#elif ISA_LEVEL == 1
  const v8 h = (v8)_mm256_set1_ps(x);
  return v16{h, h};
#else
  v16 v;
  for (int l = 0; l < LANES; ++l) v[l] = x;
  return v;
#endif
}

// Pass order: pass p runs the chains k ≡ PASS_LANE[p] (mod 16), bitrev4(p), so passes 2q and
// 2q + 1 are the lanes tree_sum adds first (l, l + 8), passes 4q..4q+3 its second level, …
constexpr int PASS_LANE[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

// The rows of Wᵀ a tile reads: straight from Wᵀ (row k at w + k·ld), or from a panel that
// pack_panel laid out lane by lane (lane r's rows r, r + 16, … consecutive from lane_row(r)).
struct ColSrc { const float* w; int64_t ld; bool packed; };

static inline int64_t lane_row(int64_t r, int64_t K) {     // rows of lanes < r before lane r
  return r * (K / LANES) + std::min<int64_t>(r, K % LANES);
}

// y[i][16v + c] = dot(x_i, column 16v + c of Wᵀ) for i < TM, v < TV, c < 16: x TM rows at
// stride ldx, y rows at stride ldy. 16 passes (one per lane l of the contract: k = l, l + 16,
// …), each a register tile of TM × TV chains; a pass's result joins the finished subtrees of
// the reduction tree (`done`, at most one per level) as a binary counter does: after pass p
// it is added to the subtree of each level below ctz(p + 1).
template <int TM, int TV>
static inline void col_tile(const float* x, int64_t ldx, int64_t K, const ColSrc& w, float* y,
                            int64_t ldy) {
  v16 done[4][TM][TV];
  for (int p = 0; p < LANES; ++p) {
    v16 acc[TM][TV];
#pragma GCC unroll 16
    for (int i = 0; i < TM; ++i)
#pragma GCC unroll 16
      for (int v = 0; v < TV; ++v) acc[i][v] = splat16(0.f);
    const int64_t r = PASS_LANE[p];
    const float* wk = w.w + (w.packed ? lane_row(r, K) : r) * w.ld;
    const int64_t step = w.packed ? w.ld : LANES * w.ld;
    for (int64_t k = r; k < K; k += LANES, wk += step) {
#pragma GCC unroll 8
      for (int i = 0; i < TM; ++i) {
        const v16 xb = bcast16(x[i * ldx + k]);
#pragma GCC unroll 16
        for (int v = 0; v < TV; ++v) acc[i][v] = fma16(xb, load16(wk + LANES * v), acc[i][v]);
      }
    }
    int level = 0;
    for (int c = p + 1; (c & 1) == 0; c >>= 1, ++level)      // merge: done[level] + acc
#pragma GCC unroll 16
      for (int i = 0; i < TM; ++i)
#pragma GCC unroll 16
        for (int v = 0; v < TV; ++v) acc[i][v] = add16(done[level][i][v], acc[i][v]);
#pragma GCC unroll 16
    for (int i = 0; i < TM; ++i)
#pragma GCC unroll 16
      for (int v = 0; v < TV; ++v) {
        if (p == LANES - 1) store16(y + i * ldy + LANES * v, acc[i][v]);
        else done[level][i][v] = acc[i][v];
      }
  }
}

// dot(x, column of Wᵀ at w, stride ldw) one float at a time: the columns past the last full
// vector (N mod 16 of them).
static float dot_strided(const float* x, const float* w, int64_t ldw, int64_t K) {
  float lane[LANES] = {};
  for (int64_t k = 0; k < K; ++k) lane[k % LANES] = std::fma(x[k], w[k * ldw], lane[k % LANES]);
  float a[8], b[4];
  for (int l = 0; l < 8; ++l) a[l] = lane[l] + lane[l + 8];
  for (int l = 0; l < 4; ++l) b[l] = a[l] + a[l + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Rows m .. m + TM − 1 of x against nv vectors of 16 columns from column n of y, read from w
// (pointing at the first of them): tiles of TV vectors, the rest in tiles of TV/2, TV/4, … 1.
template <int TM, int TV>
static void col_span(const LinearArgs& a, int64_t m, const ColSrc& w, int64_t n, int64_t nv) {
  int64_t v = 0;
  for (; v + TV <= nv; v += TV)
    col_tile<TM, TV>(a.x + m * a.K, a.K, a.K, ColSrc{w.w + LANES * v, w.ld, w.packed},
                     a.y + m * a.N + n + LANES * v, a.N);
  if constexpr (TV > 1)
    if (v < nv) col_span<TM, TV / 2>(a, m, ColSrc{w.w + LANES * v, w.ld, w.packed}, n + LANES * v,
                                     nv - v);
}

// The same for tm ≤ CM rows: CM × CV tiles on a packed panel, or read straight from Wᵀ
// (`direct`, all the rows of a small batch in one tile) in tiles as wide as the registers
// allow, so that each row of Wᵀ is read in runs of 16·TV floats: memory pages are read
// efficiently in long runs (wider was faster than packing for a vocabulary-sized product).
template <bool direct>
static void col_span_any(int tm, const LinearArgs& a, int64_t m, const ColSrc& w, int64_t n,
                         int64_t nv) {
  constexpr int W2 = direct && CV1 >= 4 ? CV1 * 3 / 4 : CV;      // AVX-512: 12, 8, 6 vectors
  constexpr int W3 = direct && CV1 >= 4 ? CV1 / 2 : CV;
  constexpr int W4 = direct && CV1 >= 8 ? CV1 * 3 / 8 : CV;
  switch (tm) {
    case 1: col_span<1, direct ? CV1 : CV>(a, m, w, n, nv); break;
    case 2: col_span<2 <= CM ? 2 : 1, W2>(a, m, w, n, nv); break;
    case 3: col_span<3 <= CM ? 3 : 1, W3>(a, m, w, n, nv); break;
    case 4: col_span<4 <= CM ? 4 : 1, W4>(a, m, w, n, nv); break;
    case 5: col_span<5 <= CM ? 5 : 1, CV>(a, m, w, n, nv); break;
    default: col_span<CM, CV>(a, m, w, n, nv); break;
  }
}

// Columns [n, n + 16·nv) of Wᵀ (K rows at stride ldw, nv ≤ PV vectors) into panel: each group
// of CV vectors as K rows of 16·CV floats (group g from panel + g·K·16·CV), lane by lane: row k
// of Wᵀ goes to row lane_row(k mod 16) + k / 16, so that every pass of a tile reads consecutive
// rows. Wᵀ is read in order, 1 KiB of each row at a time (memory pages are read efficiently in
// long runs: 256 B runs read the output matrix at a third of the bandwidth), PACK_AHEAD rows
// prefetched ahead. (Read in place, rows of Wᵀ a multiple of 4 KiB apart would also all fall
// in the same few cache sets: a group of columns would not stay in cache for the next rows.)
constexpr int64_t PV = 16, PACK_AHEAD = 16;

static void pack_panel(const float* wt, int64_t ldw, int64_t K, int64_t nv, float* panel) {
  for (int64_t k = 0; k < K; ++k) {
    if (k + PACK_AHEAD < K)
      for (int64_t v = 0; v < nv; ++v) __builtin_prefetch(wt + (k + PACK_AHEAD) * ldw + LANES * v);
    float* dst = panel + (lane_row(k % LANES, K) + k / LANES) * (LANES * CV);
    for (int64_t v = 0; v < nv; ++v)
      store16(dst + (v / CV) * K * LANES * CV + LANES * (v % CV), load16(wt + k * ldw + LANES * v));
  }
}

// y[:, n0:n1) for a column-major W (a.w = Wᵀ, (K, N) contiguous), n0 a multiple of 16, PV
// vectors of columns at a time. Tiles of up to CM rows of x read Wᵀ in place (the group's rows
// stay in cache for the next tile of rows), except for many rows (M ≥ PACK_M) or rows of Wᵀ a
// multiple of 8 KiB apart (a vocabulary-sized N: cache-set conflicts), where the group is
// packed first (pack_panel); in-place tiles were the faster for SmolLM2's layers where this
// was tuned (`torchllama bench decode --dtype float32`).
constexpr int64_t PACK_M = 64;

static void linear_cols(const LinearArgs& a, int64_t n0, int64_t n1) {
  const int64_t nfull = n0 + (n1 - n0) / LANES * LANES;
  if (a.M <= CM) {                               // one tile of rows reads each column once
    col_span_any<true>(int(a.M), a, 0, ColSrc{a.w + n0, a.N, false}, n0, (nfull - n0) / LANES);
  } else {
    const bool pack = a.M >= PACK_M || a.N % 2048 == 0;
    thread_local std::vector<float> panel;
    if (pack) panel.resize(size_t(a.K * LANES * PV));
    for (int64_t n = n0; n < nfull; n += LANES * PV) {
      const int64_t nv = std::min<int64_t>(PV, (nfull - n) / LANES);
      if (!pack) {                               // in place: the group's rows stay cached
        for (int64_t m = 0; m < a.M; m += CM)
          col_span_any<true>(int(std::min<int64_t>(CM, a.M - m)), a, m,
                             ColSrc{a.w + n, a.N, false}, n, nv);
        continue;
      }
      pack_panel(a.w + n, a.N, a.K, nv, panel.data());
      for (int64_t g = 0; g * CV < nv; ++g)     // each packed group of CV vectors
        for (int64_t m = 0; m < a.M; m += CM)
          col_span_any<false>(int(std::min<int64_t>(CM, a.M - m)), a, m,
                              ColSrc{panel.data() + g * a.K * LANES * CV, LANES * CV, true},
                              n + g * LANES * CV, std::min<int64_t>(CV, nv - g * CV));
    }
  }
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t n = nfull; n < n1; ++n)
      a.y[m * a.N + n] = dot_strided(a.x + m * a.K, a.w + n, a.N, a.K);
}

}  // namespace ISA
