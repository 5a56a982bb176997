// Matrix products of GGUF-style block weights with int8-quantized activations, for one
// instruction set. arch/scalar.cpp, arch/avx2.cpp and arch/avx512_vnni.cpp each include this
// file once, inside a namespace (`ISA`) and (but for scalar) a `#pragma GCC target`, with
// ISA_LEVEL set to
//   0  scalar (any CPU): plain loops, the reference,
//   1  AVX2 + FMA + F16C: _mm256_maddubs_epi16 / _mm256_madd_epi16 (llama.cpp's
//      ggml-cpu/quants.c idiom) on 8 weight rows at once,
//   2  AVX-512 F/VL/BW + VNNI: the activation quantization 16 lanes at a time, Q4's decode and
//      prefill tiles by vpdpbusd on two row groups per zmm (`q4_tile_vnni`), Q8's prefill tiles
//      (`q8_tile_rows_vnni`, 4-bit indices looked up as stored; Q2_K's `q8_tile_vnni`); Q8's decode
//      tiles are AVX2's, compiled again here.
// Every level computes each output with the same float operations in the same order (the
// integer sums are exact, so they are equal however they are formed): one answer on every CPU,
// for every batch size (see blocks.cpp for the contract). The arguments (Act, Q4Weight,
// Q8Weight) are kernels.h's; q4_rows, q8_rows and quantize_block are the table's entries.
//
// ---- The packed layout: weight rows in groups of 8, interleaved 4 bytes at a time -------------
// (the interleaved-row idea of llama.cpp's ggml-cpu/repack.cpp "q4_0_8x8" and ik_llama.cpp's
// `_R8` types; the layout here is ours.) For group g (rows 8g..8g+7) and block b of 32 weights:
//   Q4: 128 bytes, chunk c = 0..3 of 32 bytes: for r = 0..7 the file's bytes 4c..4c+3 of row
//       8g+r's block (low nibbles: q[4c..4c+3], high nibbles: q[16+4c..16+4c+3]);
//   Q8: 256 bytes, chunk c = 0..7: for r = 0..7 the codes 4c..4c+3 of row 8g+r's block;
//   Q8 in 6 bits (codes in [−32, 31]: Q6_K, Q5_0): 192 bytes of u = code + 32: 128 bytes of
//       its low 4 bits in Q4's arrangement (chunk c = 0..3: the low nibbles hold Q8's chunk c,
//       the high nibbles Q8's chunk 4 + c), then 32 bytes of the top 2 bits of the low nibbles'
//       weights (lane l: chunk c's at bits 2c, 2c + 1) and 32 of the high nibbles' (`six_to_eight`);
//   Q4 in 5 bits (Q5_1, Q5_K): Q4's 128 bytes, then a 32-byte plane of the fifth bits (lane l:
//       bit c that of chunk c's low-nibble weight, bit 4 + c its high-nibble one), 160 bytes;
//   Q8 as 4-bit indices (Q8Weight::lut: IQ4, Q3_K): Q4's 128-byte arrangement of the indices,
//       each looked up in the 16-value table (`lut_to_eight`, `lut_chunk`);
//   Q8 in 2 bits (codes in [0, 3]: Q2_K): 64 bytes, Q8's chunk c = 4h + 2k + e at bits
//       4h + 2e of the 32 bytes at 32k (`two_to_eight`, `two_chunk`: one shift and mask a chunk);
//   scales d (and m): the 8 rows' values of a block side by side, (G, K/B, 8), float32 or
//       float16; or (K-quants) super-blocks: per 8 (Q4_K) or 16 (Q6_K) consecutive scales of
//       a row group, the 8 rows' float16 D, then the sub-scales s, 8 rows side by side
//       (kernels.h ScaleForm). The scale is then D·s, one IEEE product, exact (an 11-bit
//       significand times a 6- or 8-bit integer): the value GGUF's dequantization forms, and
//       the loader's float32 d·sc_j, bit for bit, in 4.6 bits a weight instead of 6 (Q4_K).
// One 32-byte load thus holds 4 weights of each of 8 rows, one broadcast holds the 4
// activations they meet, and maddubs + madd leave row r's partial sum in int32 lane r: a
// block's integer sums for 8 rows end in one register, and the float epilogue runs once per
// 8 rows instead of once per row (the old per-row epilogue was half of a prefill's work).
//
// ---- The float order of one output y[m, n] (every level, every tile, every M) -----------------
//   y = 0;  for b = 0 .. K/32 − 1:
//     Q4:        y = fma(float(isum_b), d_w,b · d_x,b, y);  y = fma(m_w,b, s_x,b, y)
//     Q8, B=32:  y = fma(float(isum_b), d_w,b · d_x,b, y)
//     Q8, B=16:  y = fma(float(isum_b,0), d_w,2b · d_x,b, y);  y = fma(float(isum_b,1), d_w,2b+1 · d_x,b, y)
//     Q8 with offsets (Q2_K, B=16): after each scale's fma, y = fma(m_w,j, d_x,b · Σ_j q_x, y),
//                Σ_j over the scale's 16 activations (an exact integer; one IEEE product), the
//                Q4 form's order per 16 weights
// with isum the exact integer dot product of the block's (sub-block's) codes and q_x, and
// d_w·d_x one IEEE product; d_w (m_w) as stored, or D·s for a super-block form, and m_w = c·d_w
// (one IEEE product) where m is stored as a multiple of d (Q4_0's m = −8·d: nothing stored).
// A chain over blocks in file order: nothing depends on M, the tile, the thread or the vector
// width.

namespace ISA {

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

// ---- scales: value j of row r of group g, nd values a row, stored in form F -----------------
template <int F>
static inline const uint8_t* super_block(const void* p, int64_t g, int64_t j, int64_t nd) {
  constexpr int64_t S = subs_per_super(F);                        // sub-scales per super-block
  return static_cast<const uint8_t*>(p) + (g * (nd / S) + j / S) * (super_head(F) + 8 * S);
}

static inline float half_to_float(uint16_t h) {
#if ISA_LEVEL == 0
  return c10::detail::fp16_ieee_to_fp32_value(h);
#else
  return _cvtsh_ss(h);
#endif
}

// OFFSET: scale_pair_u4's m = M·t instead of its d = D·s (other forms: p is m's own buffer).
template <int F, bool OFFSET = false>
static inline float scale_at(const void* p, int64_t g, int64_t j, int64_t nd, int r) {
  if constexpr (F == scale_f32) {
    return static_cast<const float*>(p)[(g * nd + j) * 8 + r];
  } else if constexpr (F == scale_f16) {
    return half_to_float(static_cast<const uint16_t*>(p)[(g * nd + j) * 8 + r]);
  } else {
    constexpr int64_t S = subs_per_super(F);
    const uint8_t* u = super_block<F>(p, g, j, nd);
    uint16_t D;
    std::memcpy(&D, u + (OFFSET ? 16 : 0) + 2 * r, 2);
    uint8_t sub = u[super_head(F) + 8 * (j % S) + r];
    if (F == scale_pair_u4) sub = OFFSET ? sub >> 4 : sub & 15;
    return half_to_float(D) * float(signed_subs(F) ? int(int8_t(sub)) : int(sub));
  }
}

// Q4's offset m of block b, row r: stored in form MF, or c·d (scale_times_d).
template <int DF, int MF>
static inline float offset_at(const Q4Weight& w, int64_t g, int64_t b, int64_t nb, int r) {
  if constexpr (MF == scale_times_d) return w.m_mult * scale_at<DF>(w.d, g, b, nb, r);
  else return scale_at<MF>(w.m, g, b, nb, r);
}

// One 6-bit block of a row group (192 bytes) as Q8's 256 int8 codes (the layout above).
static inline void six_to_eight(const uint8_t* p, int8_t* out) {
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      const int top_lo = (p[128 + l] >> (2 * c)) & 3, top_hi = (p[160 + l] >> (2 * c)) & 3;
      out[32 * c + l] = int8_t(((p[32 * c + l] & 15) | (top_lo << 4)) - 32);
      out[32 * (4 + c) + l] = int8_t(((p[32 * c + l] >> 4) | (top_hi << 4)) - 32);
    }
}

// One 4-bit block of a row group (128 bytes of indices in Q4's arrangement) as Q8's 256 int8
// codes: each index looked up in the weight's table of 16 values (the layout above).
static inline void lut_to_eight(const uint8_t* p, const int8_t* lut, int8_t* out) {
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      out[32 * c + l] = lut[p[32 * c + l] & 15];
      out[32 * (4 + c) + l] = lut[p[32 * c + l] >> 4];
    }
}

// One 2-bit block of a row group (64 bytes) as Q8's 256 int8 codes in [0, 3]: chunk c's codes
// at bits 2·(c & 1) + 4·(c >> 2) of the 32 bytes at 32·((c & 3) >> 1) (the layout above).
static inline void two_to_eight(const uint8_t* p, int8_t* out) {
  for (int c = 0; c < 8; ++c)
    for (int l = 0; l < 32; ++l)
      out[32 * c + l] = int8_t((p[32 * ((c & 3) >> 1) + l] >> (2 * (c & 1) + 4 * (c >> 2))) & 3);
}

// Bytes of one block of a row group: 4-bit codes, or 5-bit ones (their fifth bits' plane after
// the nibbles: lane l's bit c that of the low-nibble weight of chunk c, bit 4 + c the high's).
static inline int64_t q4_block_bytes(bool five) { return five ? 160 : 128; }

#if ISA_LEVEL == 0
// ---- the reference: one output row at a time, the order above spelled out --------------------
template <int DF, int MF, bool FIVE>
static void q4_rows_s(const Act& a, const Q4Weight& w, float* y, int64_t g0, int64_t g1) {
  const int64_t nb = w.K / 32, N = w.G * 8, BB = q4_block_bytes(FIVE);
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t g = g0; g < g1; ++g)
      for (int r = 0; r < 8; ++r) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = w.codes + (g * nb + b) * BB;
          const int8_t* x = a.q + m * a.K + 32 * b;
          int32_t isum = 0;
          for (int c = 0; c < 4; ++c)
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = blk[32 * c + 4 * r + j];
              const uint8_t top = FIVE ? blk[128 + 4 * r + j] : 0;
              const int32_t lo = (byte & 15) | (((top >> c) & 1) << 4);
              const int32_t hi = (byte >> 4) | (((top >> (4 + c)) & 1) << 4);
              isum += lo * x[4 * c + j] + hi * x[16 + 4 * c + j];
            }
          const float dd = scale_at<DF>(w.d, g, b, nb, r) * a.d[m * nb + b];
          acc = std::fma(float(isum), dd, acc);
          acc = std::fma(offset_at<DF, MF>(w, g, b, nb, r), a.s[m * nb + b], acc);
        }
        y[m * N + 8 * g + r] = acc;
      }
}

template <int B, int DF>
static void q8_rows_b(const Act& a, const Q8Weight& w, float* y, int64_t g0, int64_t g1) {
  const int64_t nb = w.K / 32, nd = w.K / B, N = w.G * 8;
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t g = g0; g < g1; ++g)
      for (int r = 0; r < 8; ++r) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          int8_t expanded[256];
          const uint8_t* raw = reinterpret_cast<const uint8_t*>(w.codes);
          if (w.six) six_to_eight(raw + (g * nb + b) * 192, expanded);
          if (w.lut) lut_to_eight(raw + (g * nb + b) * 128, w.lut, expanded);
          if (w.two) two_to_eight(raw + (g * nb + b) * 64, expanded);
          const bool narrow = w.six || w.lut || w.two;
          const int8_t* blk = narrow ? expanded : w.codes + (g * nb + b) * 256;
          const int8_t* x = a.q + m * a.K + 32 * b;
          for (int h = 0; h < 32 / B; ++h) {          // the block's one or two scales
            int32_t isum = 0, xsum = 0;
            for (int c = h * B / 4; c < (h + 1) * B / 4; ++c)
              for (int j = 0; j < 4; ++j) {
                isum += int32_t(blk[32 * c + 4 * r + j]) * x[4 * c + j];
                xsum += x[4 * c + j];
              }
            const float dx = a.d[m * nb + b];
            const float dd = scale_at<DF>(w.d, g, b * (32 / B) + h, nd, r) * dx;
            acc = std::fma(float(isum), dd, acc);
            if (w.m)                                   // the offset: m_w · (d_x · Σ q_x)
              acc = std::fma(scale_at<DF, true>(w.m, g, b * (32 / B) + h, nd, r),
                             dx * float(xsum), acc);
          }
        }
        y[m * N + 8 * g + r] = acc;
      }
}
#else
// ---- AVX2: TM activation rows × TG groups of 8 weight rows per tile ---------------------------
// The 8 rows' scale j of group g (`scale_at`, 8 lanes; OFFSET as there).
template <int F, bool OFFSET = false>
static inline __m256 scales8(const void* p, int64_t g, int64_t j, int64_t nd) {
  if constexpr (F == scale_f32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + (g * nd + j) * 8);
  } else if constexpr (F == scale_f16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(
        (const __m128i*)(static_cast<const uint16_t*>(p) + (g * nd + j) * 8)));
  } else {
    constexpr int64_t S = subs_per_super(F);
    const uint8_t* u = super_block<F>(p, g, j, nd);
    const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(u + (OFFSET ? 16 : 0))));
    const __m128i s8 = _mm_loadl_epi64((const __m128i*)(u + super_head(F) + 8 * (j % S)));
    __m256i s32 = signed_subs(F) ? _mm256_cvtepi8_epi32(s8) : _mm256_cvtepu8_epi32(s8);
    if (F == scale_pair_u4)
      s32 = OFFSET ? _mm256_srli_epi32(s32, 4) : _mm256_and_si256(s32, _mm256_set1_epi32(15));
    return _mm256_mul_ps(D, _mm256_cvtepi32_ps(s32));                  // exact
  }
}
// The 8 rows' offset m of block b of group g, d their scale (scales8): stored in form MF, or
// c·d (scale_times_d: one IEEE product, as offset_at).
template <int MF>
static inline __m256 offsets8(const Q4Weight& w, int64_t g, int64_t b, int64_t nb, __m256 d) {
  if constexpr (MF == scale_times_d) return _mm256_mul_ps(d, _mm256_set1_ps(w.m_mult));
  else return scales8<MF>(w.m, g, b, nb);
}
static inline __m256i bcast4(const int8_t* p) {     // 4 activation bytes in every int32 lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Decode tiles of DG groups prefetch each group's stream PF blocks ahead: the rows stream from
// memory once per token, and the hardware prefetcher alone leaves bandwidth unused.
constexpr int64_t PF = 4;
// One activation row's tiles (one group each, group after group: see DG) prefetch their one
// sequential stream with kernels.h's prefetch_row (PF_ROW ahead into L1, PF_ROW_L2 into L2): a
// page's worth of lines in flight, where PF blocks (512 B of Q4 codes) left the stream short of
// lines (`torchllama bench decode` at batch 1 measures it). Tiles of 2–8 rows keep PF
// (prefetch_ahead).
// Groups of a decode tile of 2–8 activation rows (`drive_decode`, `q4_decode_vnni`). One row
// goes group after group instead (every block kind): a thread's groups are then one sequential
// stream, where DG groups at a time are DG streams of only 8 KiB each at K = 2048, each paying
// the memory's latency to restart (`benchmarks/decode_roofline.py` measures the products).
constexpr int DG = 4;
// How far ahead of block b of a group (nb blocks, `bytes` each) a VNNI decode tile of TG groups
// prefetches: PF blocks on in the same group, or, within PF of its end, the next tile's group
// (TG groups on) at block b + PF − nb, so the next tile's streams are already in flight (past
// the buffer's end at the last tile: a prefetch never faults). A group of K = 2048 is only 8 KiB
// of Q4 codes, each new stream paying the memory's latency. (The AVX2 tile, compute-bound
// where it was tuned, keeps PF.)
static inline int64_t prefetch_ahead(int64_t b, int64_t nb, int TG, int64_t bytes) {
  return (b + PF < nb ? PF : (TG - 1) * nb + PF) * bytes;
}

// The fifth bits of chunk c's low-nibble (HI = 0) or high-nibble (HI = 1) weights, at bit 4 of
// each byte, from a block's plane `top` (the layout above) shifted right by c already.
template <int HI>
static inline __m256i fifth_bits(__m256i top_c) {
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  return _mm256_and_si256(HI ? top_c : _mm256_slli_epi16(top_c, 4), bit4);
}

// Q4: 8 maddubs per block (4 chunks × low/high nibbles), summed as int16 (each lane ≤
// 8 · 2 · 15 · 127 = 30480 < 2^15, so no saturation), one madd to int32. 5-bit codes (FIVE):
// two chunks' int16 sums (≤ 4 · 2 · 31 · 127 = 31496) to int32 at a time.
// Chunk c of block b: the TM rows' products with the TG groups' unpacked codes (lo, hi), summed
// as int16; 5-bit codes to int32 after chunk 1.
template <int TM, int TG, bool FIVE>
static inline void q4_chunk(__m256i (&s16)[TM][TG], __m256i (&s32)[TM][TG], const __m256i* lo,
                            const __m256i* hi, const Act& a, int64_t m0, int64_t b, int c) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < TM; ++i) {
    const int8_t* x = a.q + (m0 + i) * a.K + 32 * b + 4 * c;
    const __m256i xl = bcast4(x), xh = bcast4(x + 16);
    for (int g = 0; g < TG; ++g)
      s16[i][g] = _mm256_add_epi16(s16[i][g], _mm256_add_epi16(
          _mm256_maddubs_epi16(lo[g], xl), _mm256_maddubs_epi16(hi[g], xh)));
  }
  if (FIVE && c == 1)
    for (int i = 0; i < TM; ++i)
      for (int g = 0; g < TG; ++g) {
        s32[i][g] = _mm256_madd_epi16(s16[i][g], ones);
        s16[i][g] = _mm256_setzero_si256();
      }
}
// A block's float steps, per row i and group g: y = fma(isum, d_w · d_x, y), y = fma(m_w, s_x, y).
template <int TM, int TG, bool FIVE>
static inline void q4_fold(__m256 (&acc)[TM][TG], __m256i (&s16)[TM][TG], __m256i (&s32)[TM][TG],
                           const __m256* dw, const __m256* mw, const Act& a, int64_t m0, int64_t b) {
  const int64_t nb = a.K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < TM; ++i) {
    const __m256 dx = _mm256_set1_ps(a.d[(m0 + i) * nb + b]);
    const __m256 sx = _mm256_set1_ps(a.s[(m0 + i) * nb + b]);
    for (int g = 0; g < TG; ++g) {
      const __m256i sum = _mm256_madd_epi16(s16[i][g], ones);
      const __m256 isum = _mm256_cvtepi32_ps(FIVE ? _mm256_add_epi32(s32[i][g], sum) : sum);
      acc[i][g] = _mm256_fmadd_ps(isum, _mm256_mul_ps(dw[g], dx), acc[i][g]);
      acc[i][g] = _mm256_fmadd_ps(mw[g], sx, acc[i][g]);
    }
  }
}
template <int TM, int TG, int DF, int MF, bool FIVE = false>
static inline void q4_tile(const Act& a, int64_t m0, const Q4Weight& w, int64_t g0, float* y) {
  constexpr int64_t BB = FIVE ? 160 : 128;
  const int64_t nb = w.K / 32, N = w.G * 8;
  const __m256i m4 = _mm256_set1_epi8(15);
  __m256 acc[TM][TG];
  for (int i = 0; i < TM; ++i)
    for (int g = 0; g < TG; ++g) acc[i][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s16[TM][TG], s32[TM][TG], top[TG];
    for (int i = 0; i < TM; ++i)
      for (int g = 0; g < TG; ++g) s16[i][g] = s32[i][g] = _mm256_setzero_si256();
    if (FIVE)
      for (int g = 0; g < TG; ++g)
        top[g] = _mm256_loadu_si256((const __m256i*)(w.codes + ((g0 + g) * nb + b) * BB + 128));
    for (int c = 0; c < 4; ++c) {
      __m256i lo[TG], hi[TG];
      for (int g = 0; g < TG; ++g) {
        const uint8_t* p = w.codes + ((g0 + g) * nb + b) * BB + 32 * c;
        if (TM == 1 && TG == 1) prefetch_row(p);
        else if (TM == 1) _mm_prefetch((const char*)(p + PF * BB), _MM_HINT_T0);
        const __m256i raw = _mm256_loadu_si256((const __m256i*)p);
        lo[g] = _mm256_and_si256(raw, m4);                                  // q[4c..4c+3]
        hi[g] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);           // q[16+4c..]
        if (FIVE) {
          lo[g] = _mm256_or_si256(lo[g], fifth_bits<0>(top[g]));
          hi[g] = _mm256_or_si256(hi[g], fifth_bits<1>(top[g]));
          top[g] = _mm256_srli_epi16(top[g], 1);                         // chunk c + 1's bits
        }
      }
      q4_chunk<TM, TG, FIVE>(s16, s32, lo, hi, a, m0, b, c);
    }
    __m256 dw[TG], mw[TG];
    for (int g = 0; g < TG; ++g) {
      dw[g] = scales8<DF>(w.d, g0 + g, b, nb);
      mw[g] = offsets8<MF>(w, g0 + g, b, nb, dw[g]);
    }
    q4_fold<TM, TG, FIVE>(acc, s16, s32, dw, mw, a, m0, b);
  }
  for (int i = 0; i < TM; ++i)
    for (int g = 0; g < TG; ++g) _mm256_storeu_ps(y + (m0 + i) * N + 8 * (g0 + g), acc[i][g]);
}

// Q4 prefill on AVX2: q4_tile on codes unpacked once per chunk of rows (`unpack_q4_codes`, at
// u) and float32 scales (d, m: (TG, nb, 8) from the tile's first group), its outputs at y (row
// i at y + i · N): the same sums and float steps. Chunk after chunk, not unrolled: unrolled, GCC
// hoisted every maddubs of a block ahead of its adds and spilled them.
template <int TM, int TG, bool FIVE>
static inline void q4_tile_unpacked(const Act& a, int64_t m0, const uint8_t* u, const float* d,
                                    const float* m, float* y, int64_t N) {
  const int64_t nb = a.K / 32;
  __m256 acc[TM][TG];
  for (int i = 0; i < TM; ++i)
    for (int g = 0; g < TG; ++g) acc[i][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s16[TM][TG], s32[TM][TG];
    for (int i = 0; i < TM; ++i)
      for (int g = 0; g < TG; ++g) s16[i][g] = s32[i][g] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int c = 0; c < 4; ++c) {
      __m256i lo[TG], hi[TG];
      for (int g = 0; g < TG; ++g) {
        const uint8_t* o = u + ((b * 4 + c) * TG + g) * 64;
        lo[g] = _mm256_loadu_si256((const __m256i*)o);
        hi[g] = _mm256_loadu_si256((const __m256i*)(o + 32));
      }
      q4_chunk<TM, TG, FIVE>(s16, s32, lo, hi, a, m0, b, c);
    }
    __m256 dw[TG], mw[TG];
    for (int g = 0; g < TG; ++g) {
      dw[g] = _mm256_loadu_ps(d + (g * nb + b) * 8);
      mw[g] = _mm256_loadu_ps(m + (g * nb + b) * 8);
    }
    q4_fold<TM, TG, FIVE>(acc, s16, s32, dw, mw, a, m0, b);
  }
  for (int i = 0; i < TM; ++i)
    for (int g = 0; g < TG; ++g) _mm256_storeu_ps(y + i * N + 8 * g, acc[i][g]);
}

// Prefill on AVX2: the codes of `groups` groups from `codes` on unpacked to bytes once per chunk
// of rows and group tile, so the chunk's row tiles load them as they are (q4_tile's u): per
// block b, chunk c and group g, 64 bytes at out + ((4b + c) · groups + g) · 64: the 8 rows'
// weights 4c..4c+3 (low nibbles), then 16+4c..16+4c+3 (high), with their fifth bits (FIVE).
template <bool FIVE>
static void unpack_q4_codes(const uint8_t* codes, int64_t groups, int64_t nb, uint8_t* out) {
  const int64_t BB = FIVE ? 160 : 128;
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = codes + (g * nb + b) * BB;
      __m256i top = FIVE ? _mm256_loadu_si256((const __m256i*)(p + 128)) : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(p + 32 * c));
        __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        if (FIVE) {
          lo = _mm256_or_si256(lo, fifth_bits<0>(top));
          hi = _mm256_or_si256(hi, fifth_bits<1>(top));
          top = _mm256_srli_epi16(top, 1);
        }
        uint8_t* o = out + ((b * 4 + c) * groups + g) * 64;
        _mm256_storeu_si256((__m256i*)o, lo);
        _mm256_storeu_si256((__m256i*)(o + 32), hi);
      }
    }
}

#if ISA_LEVEL == 2
// Q4 decode on AVX-512 VNNI: groups g0..g0+TG−1 (TG even) two per zmm (lanes 0-7 group g, 8-15
// group g + 1); vpdpbusd adds the four u8 × s8 products of a lane to its int32 sum directly
// (no int16 step: exact, as q4_tile's, whose sums never saturate), and the float epilogue is
// q4_tile's per lane: the same operations, so the same bits.
template <int F>
static inline __m512 scales16(const void* p, int64_t g, int64_t j, int64_t nd) {
  return _mm512_castpd_ps(_mm512_insertf64x4(                  // (AVX-512 F, no DQ)
      _mm512_castps_pd(_mm512_castps256_ps512(scales8<F>(p, g, j, nd))),
      _mm256_castps_pd(scales8<F>(p, g + 1, j, nd)), 1));
}

// fifth_bits of two blocks side by side (a zmm of two planes).
template <int HI>
static inline __m512i fifth_bits512(__m512i top_c) {
  const __m512i bit4 = _mm512_set1_epi8(0x10);
  return _mm512_and_si512(HI ? top_c : _mm512_slli_epi16(top_c, 4), bit4);
}
static inline __m512i two_planes(const uint8_t* p0, const uint8_t* p1) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p0)),
                            _mm256_loadu_si256((const __m256i*)p1), 1);
}

// Chunk c of a block of two groups side by side (raw: two_planes of their 32 bytes) unpacked:
// lo = q[4c..4c+3], hi = q[16+4c..16+4c+3]; 5-bit codes (FIVE) take their fifth bits from
// *top (the blocks' two planes, shifted right by c already), which moves on to chunk c + 1.
template <bool FIVE>
static inline void unpack_chunk(__m512i raw, __m512i* top, __m512i* lo, __m512i* hi) {
  const __m512i m4 = _mm512_set1_epi8(15);
  *lo = _mm512_and_si512(raw, m4);
  *hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
  if (FIVE) {
    *lo = _mm512_or_si512(*lo, fifth_bits512<0>(*top));
    *hi = _mm512_or_si512(*hi, fifth_bits512<1>(*top));
    *top = _mm512_srli_epi16(*top, 1);
  }
}

// A VNNI prefill tile's float sums: zeroed, and stored to y (row i at y + i·N, pair t's 16
// outputs at 16t).
template <int TM, int TP>
static inline void zero_tile(__m512 (&acc)[TM][TP]) {
#pragma GCC unroll 8
  for (int i = 0; i < TM; ++i)
#pragma GCC unroll 8
    for (int t = 0; t < TP; ++t) acc[i][t] = _mm512_setzero_ps();
}
template <int TM, int TP>
static inline void zero_tile(__m512i (&sums)[TM][TP]) {           // a block's integer sums
#pragma GCC unroll 8
  for (int i = 0; i < TM; ++i)
#pragma GCC unroll 8
    for (int t = 0; t < TP; ++t) sums[i][t] = _mm512_setzero_si512();
}
template <int TM, int TP>
static inline void store_tile(const __m512 (&acc)[TM][TP], float* y, int64_t N) {
  for (int i = 0; i < TM; ++i)
    for (int t = 0; t < TP; ++t) _mm512_storeu_ps(y + i * N + 16 * t, acc[i][t]);
}

// A block's 4 activations x[4c..4c+3] (vl) and x[16+4c..16+4c+3] (vh), each in every int32
// lane: the ones chunk c's low and high nibbles meet.
static inline void x_pair(const int8_t* x, int c, __m512i* vl, __m512i* vh) {
  int32_t l, h;
  std::memcpy(&l, x + 4 * c, 4);
  std::memcpy(&h, x + 16 + 4 * c, 4);
  *vl = _mm512_set1_epi32(l), *vh = _mm512_set1_epi32(h);
}

template <int TM, int TG, int DF, int MF, bool FIVE = false>
static inline void q4_tile_vnni(const Act& a, int64_t m0, const Q4Weight& w, int64_t g0,
                                float* y) {
  constexpr int TP = TG / 2;                               // group pairs
  constexpr int64_t BB = FIVE ? 160 : 128;
  const int64_t nb = w.K / 32, N = w.G * 8;
  const int8_t* xr[TM];                                    // the rows' activations
  const float *dr[TM], *sr[TM];                            // and their scales
  for (int i = 0; i < TM; ++i)
    xr[i] = a.q + (m0 + i) * a.K, dr[i] = a.d + (m0 + i) * nb, sr[i] = a.s + (m0 + i) * nb;
  const uint8_t* wp[TP];                                   // pair t's first group
  for (int t = 0; t < TP; ++t) wp[t] = w.codes + (g0 + 2 * t) * nb * BB;
  __m512 acc[TM][TP];
  zero_tile(acc);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i s32[TM][TP], top[TP];
    zero_tile(s32);
    if (FIVE)
#pragma GCC unroll 8
      for (int t = 0; t < TP; ++t) top[t] = two_planes(wp[t] + b * BB + 128, wp[t] + (nb + b) * BB + 128);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i lo[TP], hi[TP];                  // the pairs' weights, unpacked once for TM rows
#pragma GCC unroll 8
      for (int t = 0; t < TP; ++t) {
        const uint8_t* p0 = wp[t] + b * BB + 32 * c;
        const uint8_t* p1 = p0 + nb * BB;                                   // group g + 1
        if (c == 0) {
          const int64_t ahead = prefetch_ahead(b, nb, TG, BB);
          _mm_prefetch((const char*)(p0 + ahead), _MM_HINT_T0);
          _mm_prefetch((const char*)(p0 + ahead + 64), _MM_HINT_T0);
          _mm_prefetch((const char*)(p1 + ahead), _MM_HINT_T0);
          _mm_prefetch((const char*)(p1 + ahead + 64), _MM_HINT_T0);
        }
        unpack_chunk<FIVE>(two_planes(p0, p1), &top[t], &lo[t], &hi[t]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < TM; ++i) {
        __m512i vl, vh;
        x_pair(xr[i] + 32 * b, c, &vl, &vh);
#pragma GCC unroll 8
        for (int t = 0; t < TP; ++t)
          s32[i][t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s32[i][t], lo[t], vl), hi[t], vh);
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TP; ++t) {
      const __m512 dw = scales16<DF>(w.d, g0 + 2 * t, b, nb);
      const __m512 mw = MF == scale_times_d ? _mm512_mul_ps(dw, _mm512_set1_ps(w.m_mult))
                                            : scales16<MF>(w.m, g0 + 2 * t, b, nb);
#pragma GCC unroll 8
      for (int i = 0; i < TM; ++i) {
        const __m512 dx = _mm512_set1_ps(dr[i][b]);
        const __m512 sx = _mm512_set1_ps(sr[i][b]);
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[i][t]), _mm512_mul_ps(dw, dx),
                                    acc[i][t]);
        acc[i][t] = _mm512_fmadd_ps(mw, sx, acc[i][t]);
      }
    }
  }
  store_tile(acc, y + m0 * N + 8 * g0, N);
}

// One activation row m against row group g on VNNI, for a single row's decode: one group at a
// time, so a thread's groups are one sequential stream of codes (and one of scales) that the
// prefetchers never restart — where the tiles of DG groups read DG streams of only 8 KiB each
// at K = 2048. Two blocks per zmm (lanes 0-7 block b, 8-15 block b + 1: the same 8 rows), the
// integer sums exact as q4_tile's, and the float epilogue block after block as q4_tile's: the
// same bits.
template <int DF, int MF, bool FIVE = false>
static inline void q4_row_vnni(const Act& a, int64_t m, const Q4Weight& w, int64_t g, float* y) {
  constexpr int64_t BB = FIVE ? 160 : 128;
  const int64_t nb = w.K / 32, N = w.G * 8;
  const int8_t* x = a.q + m * a.K;
  const uint8_t* codes = w.codes + g * nb * BB;
  __m256 acc = _mm256_setzero_ps();
  const auto add_block = [&](__m256i s32, int64_t b) {      // q4_tile's epilogue, one block
    const __m256 dw = scales8<DF>(w.d, g, b, nb);
    const __m256 mw = offsets8<MF>(w, g, b, nb, dw);
    const __m256 dx = _mm256_set1_ps(a.d[m * nb + b]), sx = _mm256_set1_ps(a.s[m * nb + b]);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(dw, dx), acc);
    acc = _mm256_fmadd_ps(mw, sx, acc);
  };
  const auto x4 = [&](int64_t i) { int32_t v; std::memcpy(&v, x + i, 4); return v; };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const uint8_t* p = codes + b * BB;
    for (int l = 0; l < 2 * BB; l += 64) prefetch_row(p + l);
    __m512i s32 = _mm512_setzero_si512();
    __m512i top = FIVE ? two_planes(p + 128, p + BB + 128) : _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      __m512i lo, hi;
      unpack_chunk<FIVE>(two_planes(p + 32 * c, p + BB + 32 * c), &top, &lo, &hi);  // b, b + 1
      const int64_t i0 = 32 * b + 4 * c, i1 = i0 + 32;                      // blocks b, b + 1
      const __m512i vl = _mm512_inserti64x4(_mm512_set1_epi32(x4(i0)),
                                            _mm256_set1_epi32(x4(i1)), 1);
      const __m512i vh = _mm512_inserti64x4(_mm512_set1_epi32(x4(i0 + 16)),
                                            _mm256_set1_epi32(x4(i1 + 16)), 1);
      s32 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s32, lo, vl), hi, vh);
    }
    add_block(_mm512_castsi512_si256(s32), b);
    add_block(_mm512_extracti64x4_epi64(s32, 1), b + 1);
  }
  if (b < nb) {                                             // an odd last block
    const uint8_t* p = codes + b * BB;
    __m256i s32 = _mm256_setzero_si256();
    __m256i top = FIVE ? _mm256_loadu_si256((const __m256i*)(p + 128)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256((const __m256i*)(p + 32 * c));
      __m256i lo = _mm256_and_si256(raw, _mm256_set1_epi8(15));
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15));
      if (FIVE) {
        lo = _mm256_or_si256(lo, fifth_bits<0>(top));
        hi = _mm256_or_si256(hi, fifth_bits<1>(top));
        top = _mm256_srli_epi16(top, 1);
      }
      const int64_t i0 = 32 * b + 4 * c;
      s32 = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s32, lo, _mm256_set1_epi32(x4(i0))), hi,
                                _mm256_set1_epi32(x4(i0 + 16)));
    }
    add_block(s32, b);
  }
  _mm256_storeu_ps(y + m * N + 8 * g, acc);
}

// Decode on VNNI: one activation row, group after group (q4_row_vnni); more rows per tile of DG
// groups, 4, then 2, then 1 at a time (the weights unpacked once per tile of rows); single
// groups after, AVX2's.
template <int DF, int MF, bool FIVE>
static inline void q4_decode_vnni(const Act& a, const Q4Weight& w, float* y, int64_t g_begin,
                                  int64_t g_end) {
  if (a.M == 1) {
    for (int64_t g = g_begin; g < g_end; ++g) q4_row_vnni<DF, MF, FIVE>(a, 0, w, g, y);
    return;
  }
  int64_t g = g_begin;
  for (; g + DG <= g_end; g += DG) {
    int64_t m = 0;
    for (; m + 4 <= a.M; m += 4) q4_tile_vnni<4, DG, DF, MF, FIVE>(a, m, w, g, y);
    for (; m + 2 <= a.M; m += 2) q4_tile_vnni<2, DG, DF, MF, FIVE>(a, m, w, g, y);
    for (; m < a.M; ++m) q4_tile_vnni<1, DG, DF, MF, FIVE>(a, m, w, g, y);
  }
  for (; g < g_end; ++g)
    for (int64_t m = 0; m < a.M; ++m) q4_tile<1, 1, DF, MF, FIVE>(a, m, w, g, y);
}
#endif

// Σ q_x over the activations of scale h of block b (H scales a block of 32), from one row's
// sums per 16 (`SumBuffer`).
template <int H>
static inline int32_t scale_sum(const int32_t* s16, int64_t b, int h) {
  return H == 2 ? s16[2 * b + h] : s16[2 * b] + s16[2 * b + 1];
}

// Q8: ⟨q_w, q_x⟩ as |q_w| · (sign(q_w) · q_x) (llama.cpp's idiom; q_x ≠ −128). A maddubs lane
// can reach 2 · 128 · 127, so full-range codes go to int32 after every chunk; codes with
// |q| ≤ 32 (Q6_K, Q5_0: `small`) sum the 4 chunks of 16 weights as int16 first (≤ 32512).
// How the codes are stored (ST): int8 (Q8_0), 4-bit indices (Q8Weight::lut: chunk c's int8
// codes looked up, vpshufb, in the table of 16 values from the indices in the low (c < 4) or
// high (c ≥ 4) nibbles of the block's bytes of chunk c % 4), or 2 bits (Q8Weight::two: codes in
// [0, 3], already unsigned, so maddubs takes them as they are). The layouts: see above.
enum CodeStore : int { store_int8 = 0, store_lut = 1, store_two = 2 };
static inline __m256i lut_chunk(const uint8_t* blk, int c, __m256i table) {
  const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + 32 * (c & 3)));
  const __m256i idx = _mm256_and_si256(c < 4 ? raw : _mm256_srli_epi16(raw, 4),
                                       _mm256_set1_epi8(15));
  return _mm256_shuffle_epi8(table, idx);
}
static inline __m256i lut_table(const int8_t* lut) {             // the 16 values, both lanes
  return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)lut));
}
static inline __m256i two_chunk(const uint8_t* blk, int c) {     // two_to_eight's chunk c
  const __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + 32 * ((c & 3) >> 1)));
  return _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(2 * (c & 1) + 4 * (c >> 2))),
                          _mm256_set1_epi8(3));
}
static constexpr int64_t q8_block_bytes(int store) {
  return store == store_lut ? 128 : store == store_two ? 64 : 256;
}

// With offsets (OFF: Q2_K's m per scale), each scale's fma is followed by m's, the Q4 form's
// order per 16 or 32 weights: y = fma(m_w, d_x · Σ q_x, y), Σ q_x over the scale's weights
// (sx: Σ q_x per 16 activations of each row, `SumBuffer`; null without offsets).
template <int TM, int TG, int B, int DF, bool SMALL, int ST = store_int8, bool OFF = false>
static inline void q8_tile(const Act& a, int64_t m0, const Q8Weight& w, int64_t g0, float* y,
                           const int32_t* sx = nullptr) {
  constexpr int H = 32 / B;                          // scales per block
  constexpr int64_t BB = q8_block_bytes(ST);         // bytes of a group's block
  const int64_t nb = w.K / 32, nd = w.K / B, N = w.G * 8;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i table = ST == store_lut ? lut_table(w.lut) : _mm256_setzero_si256();
  __m256 acc[TM][TG];
  for (int i = 0; i < TM; ++i)
    for (int g = 0; g < TG; ++g) acc[i][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (TM == 1 && TG == 1)
      for (int l = 0; l < BB; l += 64)
        prefetch_row(reinterpret_cast<const uint8_t*>(w.codes) + (g0 * nb + b) * BB + l);
    __m256i s32[H][TM][TG];
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < TM; ++i)
        for (int g = 0; g < TG; ++g) s32[h][i][g] = _mm256_setzero_si256();
    for (int q = 0; q < 2; ++q) {                    // halves of 16 weights (4 chunks each)
      __m256i s16[TM][TG];
      for (int i = 0; i < TM; ++i)
        for (int g = 0; g < TG; ++g) s16[i][g] = _mm256_setzero_si256();
      for (int c = 4 * q; c < 4 * q + 4; ++c) {
        __m256i wv[TG], wa[TG];
        for (int g = 0; g < TG; ++g) {
          const uint8_t* blk = reinterpret_cast<const uint8_t*>(w.codes) +
                               ((g0 + g) * nb + b) * BB;
          const uint8_t* p = blk + 32 * (ST == store_lut ? c & 3 : c);
          if (TM == 1 && TG > 1 && c % 2 == 0 && 32 * c < BB)
            _mm_prefetch((const char*)(p + PF * BB), _MM_HINT_T0);
          wv[g] = ST == store_lut ? lut_chunk(blk, c, table)
                : ST == store_two ? two_chunk(blk, c) : _mm256_loadu_si256((const __m256i*)p);
          wa[g] = ST == store_two ? wv[g] : _mm256_abs_epi8(wv[g]);
        }
        for (int i = 0; i < TM; ++i) {
          const __m256i xv = bcast4(a.q + (m0 + i) * a.K + 32 * b + 4 * c);
          for (int g = 0; g < TG; ++g) {
            const __m256i p16 = _mm256_maddubs_epi16(
                wa[g], ST == store_two ? xv : _mm256_sign_epi8(xv, wv[g]));
            if (SMALL) s16[i][g] = _mm256_add_epi16(s16[i][g], p16);
            else s32[q * H / 2][i][g] = _mm256_add_epi32(s32[q * H / 2][i][g],
                                                         _mm256_madd_epi16(p16, ones));
          }
        }
      }
      if (SMALL)
        for (int i = 0; i < TM; ++i)
          for (int g = 0; g < TG; ++g)
            s32[q * H / 2][i][g] = _mm256_add_epi32(s32[q * H / 2][i][g],
                                                    _mm256_madd_epi16(s16[i][g], ones));
    }
    for (int h = 0; h < H; ++h) {
      __m256 dw[TG], mw[TG];
      for (int g = 0; g < TG; ++g) {
        dw[g] = scales8<DF>(w.d, g0 + g, b * H + h, nd);
        if (OFF) mw[g] = scales8<DF, true>(w.m, g0 + g, b * H + h, nd);
      }
      for (int i = 0; i < TM; ++i) {
        const float dxf = a.d[(m0 + i) * nb + b];
        const __m256 dx = _mm256_set1_ps(dxf);
        __m256 sxv = _mm256_setzero_ps();
        if (OFF) {
          sxv = _mm256_set1_ps(dxf * float(scale_sum<H>(sx + (m0 + i) * (a.K / 16), b, h)));
        }
        for (int g = 0; g < TG; ++g) {
          acc[i][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[h][i][g]),
                                      _mm256_mul_ps(dw[g], dx), acc[i][g]);
          if (OFF) acc[i][g] = _mm256_fmadd_ps(mw[g], sxv, acc[i][g]);
        }
      }
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int g = 0; g < TG; ++g) _mm256_storeu_ps(y + (m0 + i) * N + 8 * (g0 + g), acc[i][g]);
}

// 6-bit codes (Q8Weight::six). u = code + 32 of chunk c's low-nibble (HI = 0) or high-nibble
// (HI = 1) weights of the block at p: the low 4 bits, or'ed with the top 2 moved to bits 4, 5.
template <int C, int HI>
static inline __m256i six_u(const uint8_t* p) {
  const __m256i raw = _mm256_loadu_si256((const __m256i*)(p + 32 * C));
  const __m256i top = _mm256_loadu_si256((const __m256i*)(p + 128 + 32 * HI));
  const __m256i nib = _mm256_and_si256(HI ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(15));
  const __m256i at45 = C == 2 ? top : C == 3 ? _mm256_srli_epi16(top, 2)   // bits 2C, 2C+1 → 4, 5
                                             : _mm256_slli_epi16(top, 4 - 2 * C);
  return _mm256_or_si256(nib, _mm256_and_si256(at45, _mm256_set1_epi8(0x30)));
}

// A block of 4-bit indices at p as Q8's 8 chunks of int8 codes (prefill's expansion, as
// six_to_eight8's).
static inline void lut_to_eight8(const uint8_t* p, __m256i table, int8_t* out) {
  for (int c = 0; c < 8; ++c) _mm256_storeu_si256((__m256i*)(out + 32 * c), lut_chunk(p, c, table));
}
static inline void two_to_eight8(const uint8_t* p, int8_t* out) {   // 2-bit codes, the same
  for (int c = 0; c < 8; ++c) _mm256_storeu_si256((__m256i*)(out + 32 * c), two_chunk(p, c));
}

// The block at p as Q8's 8 chunks of int8 codes (prefill expands a tile's blocks once per chunk
// of activation rows and runs the 8-bit tiles on them); U: as u = code + 32 (`u32_tile`).
template <bool U = false>
static inline void six_to_eight8(const uint8_t* p, int8_t* out) {
  const __m256i off = _mm256_set1_epi8(32);
  auto put = [&](int c, __m256i u) { _mm256_storeu_si256((__m256i*)(out + 32 * c),
                                                         U ? u : _mm256_sub_epi8(u, off)); };
  put(0, six_u<0, 0>(p)), put(1, six_u<1, 0>(p)), put(2, six_u<2, 0>(p)), put(3, six_u<3, 0>(p));
  put(4, six_u<0, 1>(p)), put(5, six_u<1, 1>(p)), put(6, six_u<2, 1>(p)), put(7, six_u<3, 1>(p));
}

// Decode on 6-bit codes: ⟨u, q_x⟩ by maddubs (u ≤ 63, so two chunks' int16 sums stay ≤ 32004),
// then isum = ⟨u, q_x⟩ − 32·Σ q_x over the (sub-)block, the exact integer ⟨code, q_x⟩ that the
// 8-bit tile forms; the float steps are q8_tile's. sx: Σ q_x per 16 activations of row m.
template <int HI, int TG>
static inline void six_half(const uint8_t* const* p, const int8_t* x, __m256i* s32) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s16[TG];
  auto pair = [&](auto c0, auto c1) {
    const __m256i x0 = bcast4(x + 16 * HI + 4 * decltype(c0)::value),
                  x1 = bcast4(x + 16 * HI + 4 * decltype(c1)::value);
    for (int g = 0; g < TG; ++g)
      s16[g] = _mm256_add_epi16(_mm256_maddubs_epi16(six_u<decltype(c0)::value, HI>(p[g]), x0),
                                _mm256_maddubs_epi16(six_u<decltype(c1)::value, HI>(p[g]), x1));
    for (int g = 0; g < TG; ++g) s32[g] = _mm256_add_epi32(s32[g], _mm256_madd_epi16(s16[g], ones));
  };
  pair(std::integral_constant<int, 0>{}, std::integral_constant<int, 1>{});
  pair(std::integral_constant<int, 2>{}, std::integral_constant<int, 3>{});
}

template <int TG, int B, int DF>
static inline void six_tile(const Act& a, int64_t m, const Q8Weight& w, int64_t g0, float* y,
                            const int32_t* sx) {
  constexpr int H = 32 / B;
  const int64_t nb = w.K / 32, nd = w.K / B, N = w.G * 8;
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(w.codes);
  __m256 acc[TG];
  for (int g = 0; g < TG; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p[TG];
    for (int g = 0; g < TG; ++g) {
      p[g] = codes + ((g0 + g) * nb + b) * 192;
      for (int l = 0; l < 192; l += 64)
        if (TG == 1) prefetch_row(p[g] + l);
        else _mm_prefetch((const char*)(p[g] + PF * 192 + l), _MM_HINT_T0);
    }
    const int8_t* x = a.q + m * a.K + 32 * b;
    const __m256 dx = _mm256_set1_ps(a.d[m * nb + b]);
    __m256i s32[TG];
    for (int g = 0; g < TG; ++g) s32[g] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {                    // low nibbles (weights 0..15), high (16..31)
      if (h == 0) six_half<0, TG>(p, x, s32);
      else six_half<1, TG>(p, x, s32);
      if (H == 1 && h == 0) continue;                // one scale: both halves, then the fma
      const int32_t sum_x = scale_sum<H>(sx, b, h);
      const __m256i off = _mm256_set1_epi32(32 * sum_x);
      for (int g = 0; g < TG; ++g) {
        const __m256 dw = scales8<DF>(w.d, g0 + g, b * H + (H == 2 ? h : 0), nd);
        const __m256i isum = _mm256_sub_epi32(s32[g], off);
        acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, dx), acc[g]);
        s32[g] = _mm256_setzero_si256();
      }
    }
  }
  for (int g = 0; g < TG; ++g) _mm256_storeu_ps(y + m * N + 8 * (g0 + g), acc[g]);
}

// Σ q_x per 16 activations of rows 0..M−1 (exact integers), for `six_tile`.
struct SumBuffer {
  std::vector<int32_t> v;
  const int32_t* sums(const Act& a) {
    v.resize(size_t(a.M * a.K / 16));
    for (int64_t i = 0; i < a.M * a.K / 16; ++i) {
      int32_t t = 0;
      for (int j = 0; j < 16; ++j) t += a.q[16 * i + j];
      v[i] = t;
    }
    return v.data();
  }
};
static thread_local SumBuffer sum_buffer;

#if ISA_LEVEL == 1
// Prefill on full-range codes (Q8_0; IQ4_XS, IQ4_NL looked up) at AVX2, expanded to int8 in
// Q8's layout: q8_tile's sign form (|q_w| · sign(q_x, q_w), each chunk to int32), written with
// one scale's chunks unrolled and nothing else live, as the sign form's row of
// benchmarks/avx2_int8_forms.py. The same integer sums and float steps: the same bits.
template <int TM, int TG, int B>
static inline void sign_tile(const Act& a, int64_t m0, const Q8Weight& w, int64_t g0, float* y) {
  constexpr int H = 32 / B;
  const int64_t nb = w.K / 32, nd = w.K / B, N = w.G * 8;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* codes = w.codes;
  __m256 acc[TM][TG];
  for (int i = 0; i < TM; ++i)
    for (int g = 0; g < TG; ++g) acc[i][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b)
    for (int h = 0; h < H; ++h) {
      __m256i s32[TM][TG];
      for (int i = 0; i < TM; ++i)
        for (int g = 0; g < TG; ++g) s32[i][g] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int c = h * 8 / H; c < (h + 1) * 8 / H; ++c) {
        __m256i wv[TG], wa[TG];
        for (int g = 0; g < TG; ++g) {
          wv[g] = _mm256_loadu_si256((const __m256i*)(codes + ((g0 + g) * nb + b) * 256 + 32 * c));
          wa[g] = _mm256_abs_epi8(wv[g]);
        }
        for (int i = 0; i < TM; ++i) {
          const __m256i xv = bcast4(a.q + (m0 + i) * a.K + 32 * b + 4 * c);
          for (int g = 0; g < TG; ++g)
            s32[i][g] = _mm256_add_epi32(s32[i][g], _mm256_madd_epi16(
                _mm256_maddubs_epi16(wa[g], _mm256_sign_epi8(xv, wv[g])), ones));
        }
      }
      for (int g = 0; g < TG; ++g) {
        const __m256 dw = scales8<scale_f32>(w.d, g0 + g, b * H + h, nd);
        for (int i = 0; i < TM; ++i)
          acc[i][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[i][g]),
                                      _mm256_mul_ps(dw, _mm256_set1_ps(a.d[(m0 + i) * nb + b])),
                                      acc[i][g]);
      }
    }
  for (int i = 0; i < TM; ++i)
    for (int g = 0; g < TG; ++g) _mm256_storeu_ps(y + (m0 + i) * N + 8 * (g0 + g), acc[i][g]);
}

// Prefill on small codes (|code| ≤ 32: Q6_K, Q5_0, Q3_K) at AVX2, expanded once a tile as
// u = code + 32 in Q8's layout (`six_to_eight8<true>`, or the indices' table + 32): maddubs
// takes u as it is, two chunks' int16 sums stay ≤ 2 · 2 · 63 · 127 = 32004, and each scale's
// exact ⟨code, q_x⟩ is ⟨u, q_x⟩ − 32 · Σ q_x over its weights (sx: `SumBuffer`): one maddubs
// a chunk where the sign form (q8_tile) takes a sign and a maddubs, and an abs per group. The
// float steps are q8_tile's: the same bits. TM rows from m0 × TG groups from g0 of w (its
// expanded view, float32 scales).
template <int TM, int TG, int B>
static inline void u32_tile(const Act& a, int64_t m0, const Q8Weight& w, int64_t g0, float* y,
                            const int32_t* sx) {
  constexpr int H = 32 / B;
  const int64_t nb = w.K / 32, nd = w.K / B, N = w.G * 8;
  const __m256i ones = _mm256_set1_epi16(1);
  const uint8_t* u8 = reinterpret_cast<const uint8_t*>(w.codes);
  __m256 acc[TM][TG];
  for (int i = 0; i < TM; ++i)
    for (int g = 0; g < TG; ++g) acc[i][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s32[TM][TG];
    for (int h = 0; h < 2; ++h) {                    // weights 16h .. 16h + 15: chunks 4h .. 4h + 3
      if (h == 0 || H == 2)                          // B = 32: from −32 · Σ q_x, nothing to
        for (int i = 0; i < TM; ++i) {               // subtract at the end; B = 16: from 0 (the
                                                     // faster of each: quantized guide)
          const int32_t sum = H == 1 ? scale_sum<H>(sx + (m0 + i) * (a.K / 16), b, 0) : 0;
          for (int g = 0; g < TG; ++g) s32[i][g] = _mm256_set1_epi32(-32 * sum);
        }
      for (int c = 4 * h; c < 4 * h + 4; c += 2) {
        __m256i w0[TG], w1[TG];
        for (int g = 0; g < TG; ++g) {
          const uint8_t* p = u8 + ((g0 + g) * nb + b) * 256 + 32 * c;
          w0[g] = _mm256_loadu_si256((const __m256i*)p);
          w1[g] = _mm256_loadu_si256((const __m256i*)(p + 32));
        }
        for (int i = 0; i < TM; ++i) {
          const int8_t* x = a.q + (m0 + i) * a.K + 32 * b + 4 * c;
          const __m256i x0 = bcast4(x), x1 = bcast4(x + 4);
          for (int g = 0; g < TG; ++g)
            s32[i][g] = _mm256_add_epi32(s32[i][g], _mm256_madd_epi16(_mm256_add_epi16(
                _mm256_maddubs_epi16(w0[g], x0), _mm256_maddubs_epi16(w1[g], x1)), ones));
        }
      }
      if (H == 1 && h == 0) continue;                // one scale: both halves, then the fma
      const int j = H == 2 ? h : 0;                  // the scale
      __m256 dw[TG];
      for (int g = 0; g < TG; ++g) dw[g] = scales8<scale_f32>(w.d, g0 + g, b * H + j, nd);
      for (int i = 0; i < TM; ++i) {
        const int32_t sum = H == 2 ? scale_sum<H>(sx + (m0 + i) * (a.K / 16), b, j) : 0;
        const __m256i off = _mm256_set1_epi32(32 * sum);
        const __m256 dx = _mm256_set1_ps(a.d[(m0 + i) * nb + b]);
        for (int g = 0; g < TG; ++g) {
          const __m256i isum = H == 2 ? _mm256_sub_epi32(s32[i][g], off) : s32[i][g];
          acc[i][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw[g], dx),
                                      acc[i][g]);
        }
      }
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int g = 0; g < TG; ++g) _mm256_storeu_ps(y + (m0 + i) * N + 8 * (g0 + g), acc[i][g]);
}
#endif

#if ISA_LEVEL == 2
// Q8 prefill on AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes, so the weights go in
// as u = code + 128 (an xor of the sign bit) and each (sub-)block's exact ⟨code, q_x⟩ is
// ⟨u, q_x⟩ − 128·Σ q_x (sx: Σ q_x per 16 activations, `SumBuffer`); groups g, g + 1 side by
// side in a zmm (q4_tile_vnni's pairs), and the float steps are q8_tile's (offsets too, OFF:
// m float32 as the scales): the same bits.
template <int TM, int TG, int B, bool OFF = false>
static inline void q8_tile_vnni(const Act& a, int64_t m0, const Q8Weight& w, int64_t g0,
                                float* y, const int32_t* sx) {
  constexpr int TP = TG / 2, H = 32 / B;
  const int64_t nb = w.K / 32, nd = w.K / B, N = w.G * 8;
  const __m512i flip = _mm512_set1_epi8(int8_t(0x80));
  const int8_t* xr[TM];                                    // the rows' activations, their
  const float* dr[TM];                                     // scales and Σ q_x per 16
  const int32_t* sr[TM];
  for (int i = 0; i < TM; ++i)
    xr[i] = a.q + (m0 + i) * a.K, dr[i] = a.d + (m0 + i) * nb, sr[i] = sx + (m0 + i) * (a.K / 16);
  const uint8_t* wp[TP];                                   // pair t's first group
  for (int t = 0; t < TP; ++t)
    wp[t] = reinterpret_cast<const uint8_t*>(w.codes) + (g0 + 2 * t) * nb * 256;
  __m512 acc[TM][TP];
  zero_tile(acc);
  for (int64_t b = 0; b < nb; ++b)
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {                      // a scale's chunks, then its fma
      __m512i s32[TM][TP];                             // from −128·Σ q_x: ⟨code, q_x⟩
#pragma GCC unroll 8
      for (int i = 0; i < TM; ++i) {
        const __m512i start = _mm512_set1_epi32(-128 * scale_sum<H>(sr[i], b, h));
#pragma GCC unroll 8
        for (int t = 0; t < TP; ++t) s32[i][t] = start;
      }
#pragma GCC unroll 8
      for (int c = h * 8 / H; c < (h + 1) * 8 / H; ++c) {
        __m512i u[TP];
#pragma GCC unroll 8
        for (int t = 0; t < TP; ++t) {
          const uint8_t* p0 = wp[t] + b * 256 + 32 * c;
          u[t] = _mm512_xor_si512(two_planes(p0, p0 + nb * 256), flip);
        }
#pragma GCC unroll 8
        for (int i = 0; i < TM; ++i) {
          int32_t x4;
          std::memcpy(&x4, xr[i] + 32 * b + 4 * c, 4);
          const __m512i xv = _mm512_set1_epi32(x4);
#pragma GCC unroll 8
          for (int t = 0; t < TP; ++t) s32[i][t] = _mm512_dpbusd_epi32(s32[i][t], u[t], xv);
        }
      }
#pragma GCC unroll 8
      for (int t = 0; t < TP; ++t) {
        const __m512 dw = scales16<scale_f32>(w.d, g0 + 2 * t, b * H + h, nd);
        const __m512 mw = OFF ? scales16<scale_f32>(w.m, g0 + 2 * t, b * H + h, nd)
                              : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < TM; ++i) {
          const float dxf = dr[i][b];
          const __m512 dx = _mm512_set1_ps(dxf);
          acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[i][t]), _mm512_mul_ps(dw, dx), acc[i][t]);
          if (OFF)
            acc[i][t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dxf * float(scale_sum<H>(sr[i], b, h))),
                                        acc[i][t]);
        }
      }
    }
  store_tile(acc, y + m0 * N + 8 * g0, N);
}
#endif

#if ISA_LEVEL == 2
// One activation row m against row group g on VNNI, for a single row's decode of codes stored
// as 4-bit indices (lut) or 2 bits: q4_row_vnni's shape (one group at a time, so a thread's
// groups are one sequential stream; two blocks per zmm, lanes 0-7 block b, 8-15 block b + 1).
// Looked-up codes go in as u = code + 128 (q8_tile_vnni's xor), 2-bit ones as they are; each
// scale's integer sum is then exact and the float steps are q8_tile's, block after block: the
// same bits. sums: Σ q_x per 16 activations of each row (`SumBuffer`). An odd block count:
// q8_tile.
template <int B, int DF, bool SMALL, int ST, bool OFF>
static inline void q8_row_vnni(const Act& a, int64_t m, const Q8Weight& w, int64_t g, float* y,
                               const int32_t* sums) {
  constexpr int H = 32 / B;
  constexpr int64_t BB = q8_block_bytes(ST);
  const int64_t nb = w.K / 32, nd = w.K / B, N = w.G * 8;
  if (nb % 2) {
    q8_tile<1, 1, B, DF, SMALL, ST, OFF>(a, m, w, g, y, sums);
    return;
  }
  const int8_t* x = a.q + m * a.K;
  const int32_t* S = sums + m * (a.K / 16);
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(w.codes) + g * nb * BB;
  const __m512i table = ST == store_lut
      ? _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)w.lut)) : _mm512_setzero_si512();
  __m256 acc = _mm256_setzero_ps();
  const auto add_block = [&](const __m256i* s32, int64_t b) {     // q8_tile's float steps
    const float dxf = a.d[m * nb + b];
    const __m256 dx = _mm256_set1_ps(dxf);
    for (int h = 0; h < H; ++h) {
      const int32_t sum_x = scale_sum<H>(S, b, h);
      const __m256i isum = ST == store_lut ? _mm256_sub_epi32(s32[h], _mm256_set1_epi32(128 * sum_x))
                                           : s32[h];
      const __m256 dw = scales8<DF>(w.d, g, b * H + h, nd);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, dx), acc);
      if (OFF) acc = _mm256_fmadd_ps(scales8<DF, true>(w.m, g, b * H + h, nd),
                                     _mm256_set1_ps(dxf * float(sum_x)), acc);
    }
  };
  const auto x4 = [&](int64_t i) { int32_t v; std::memcpy(&v, x + i, 4); return v; };
  for (int64_t b = 0; b < nb; b += 2) {
    const uint8_t* p = codes + b * BB;
    for (int l = 0; l < 2 * BB; l += 64) prefetch_row(p + l);
    __m512i s[H];
    for (int h = 0; h < H; ++h) s[h] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      __m512i u;
      if constexpr (ST == store_lut) {
        const __m512i raw = two_planes(p + 32 * (c & 3), p + BB + 32 * (c & 3));
        const __m512i idx = _mm512_and_si512(c < 4 ? raw : _mm512_srli_epi16(raw, 4),
                                             _mm512_set1_epi8(15));
        u = _mm512_xor_si512(_mm512_shuffle_epi8(table, idx), _mm512_set1_epi8(int8_t(0x80)));
      } else {
        const __m512i raw = two_planes(p + 32 * ((c & 3) >> 1), p + BB + 32 * ((c & 3) >> 1));
        u = _mm512_and_si512(_mm512_srl_epi16(raw, _mm_cvtsi32_si128(2 * (c & 1) + 4 * (c >> 2))),
                             _mm512_set1_epi8(3));
      }
      const int64_t i0 = 32 * b + 4 * c;                                 // blocks b, b + 1
      const __m512i xv = _mm512_inserti64x4(_mm512_set1_epi32(x4(i0)),
                                            _mm256_set1_epi32(x4(i0 + 32)), 1);
      s[c * H / 8] = _mm512_dpbusd_epi32(s[c * H / 8], u, xv);
    }
    __m256i lo[H], hi[H];
    for (int h = 0; h < H; ++h) {
      lo[h] = _mm512_castsi512_si256(s[h]);
      hi[h] = _mm512_extracti64x4_epi64(s[h], 1);
    }
    add_block(lo, b);
    add_block(hi, b + 1);
  }
  _mm256_storeu_ps(y + m * N + 8 * g, acc);
}
#endif

// ---- drivers: groups [g_begin, g_end) of W for every activation row --------------------------
// Decode (M < 4): 1 × 4-group tiles (32 weight rows, four independent chains per row), reading
// the scales as stored. Prefill: PM × PG tiles over chunks of MC activation rows, so a weight
// tile is reused from cache, on float32 scales expanded once per chunk and group tile (forming
// the K-quants' factors in every tile made their prefill slower). The tile shapes (PM × PG per
// block kind, TL_TILES) were chosen on AVX2's 16 ymm registers, the fastest of the shapes tried
// for 128- and 512-row products on 2 threads; Q4's 3 × 2 on its codes unpacked once per chunk
// (`q4_tile_unpacked`: 3 × 2 leaves 6 sums, 4 codes and 2 activations live); small codes' 3 × 2
// on u = code + 32 (`u32_tile`; 2 × 2 and 2 × 4 within 3%); full-range codes' 6 × 1
// (`sign_tile`: 8 × 1 within 3%, 2 × 4 and 3 × 2 −7–13%); docs/guides/quantized.md has the
// figures.
#ifndef TL_TILES
#define TL_TILES 3, 2, 3, 2, 6, 1
#endif
constexpr int TILES[6] = {TL_TILES};              // Q4 PM, PG; small Q8 PM, PG; Q8 PM, PG
// The prefill tiles on AVX-512 VNNI (Q4's, Q8's, the 4-bit indices'): VM rows × VG groups, the
// groups in pairs a zmm. 8 rows share each chunk's unpacking and loads of a pair's codes, where 4
// did: on a Xeon (its 512-bit integer and float operations on the same two ports) +5–20% per
// product (docs/guides/quantized.md).
#ifndef TL_VNNI_TILES
#define TL_VNNI_TILES 8, 4
#endif
constexpr int VNNI_TILES[2] = {TL_VNNI_TILES};
// MC: each chunk of rows re-expands its group tiles' scales (and 6-, 4- or 2-bit codes), so a
// chunk is as many rows as a weight tile stays in L2 for (4 groups of K = 11008 Q5_K: 220 KiB)
// while the rows stream past it: a 128-row prompt is one chunk (docs/guides/quantized.md
// measures 256 against 64 and 512).
#ifndef TL_MC
#define TL_MC 256
#endif
constexpr int64_t MC = TL_MC;

// Decode (M below TL_DECODE_ROWS): per tile of DG groups (then single groups), every
// activation row, so the rows read each weight tile from memory once; one row goes group after
// group (one sequential stream a thread: see DG). From TL_DECODE_ROWS rows on, prefill's tiles,
// whose weights are unpacked once for a tile of rows, are the faster (benchmarks/
// block_products.py at M = 2–8, 2 threads): VNNI's Q4 decode tile to 8 rows; AVX2's Q4 tile
// unpacks the codes for every row, so there 3 rows on go to prefill's; the 8-bit decode tiles
// (6-bit and int8 codes, TL_DECODE_ROWS_Q8) 4 rows on, at every level.
#ifndef TL_DECODE_ROWS
#define TL_DECODE_ROWS (ISA_LEVEL == 2 ? 9 : 3)
#endif
#ifndef TL_DECODE_ROWS_Q8
#define TL_DECODE_ROWS_Q8 4
#endif
template <typename T14, typename T11>
static inline void drive_decode(int64_t M, int64_t g_begin, int64_t g_end, T14 t14, T11 t11) {
  if (M == 1) {                                     // one row: group after group (DG's note)
    for (int64_t g = g_begin; g < g_end; ++g) t11(0, g);
    return;
  }
  int64_t g = g_begin;
  for (; g + DG <= g_end; g += DG)
    for (int64_t m = 0; m < M; ++m) t14(m, g);
  for (; g < g_end; ++g)
    for (int64_t m = 0; m < M; ++m) t11(m, g);
}

template <int N>
using Rows = std::integral_constant<int, N>;       // a tile's rows, as a tile lambda's argument

// The rows [m, mend) in tiles of PM rows, then (PM > 4) of 4, then single rows: tile(Rows<TM>,
// m). A short prompt's last rows thus go 4 at a time, not one by one.
template <int PM, typename Tile>
static inline void row_tiles(int64_t m, int64_t mend, Tile tile) {
  for (; m + PM <= mend; m += PM) tile(Rows<PM>{}, m);
  if constexpr (PM > 4)
    for (; m + 4 <= mend; m += 4) tile(Rows<4>{}, m);
  for (; m < mend; ++m) tile(Rows<1>{}, m);
}

// Prefill: per chunk of MC rows [mc, mend) (chunk(mc, mend) first), per tile of PG groups (then
// single groups): prep(g, groups), then the row tiles over it: tiles(Rows<TM>, m, g) over PG
// groups, single(Rows<TM>, m, g) over one.
struct NoChunk {
  void operator()(int64_t, int64_t) const {}
};
template <int PM, int PG, typename Prep, typename Tiles, typename Single, typename Chunk = NoChunk>
static inline void drive_prefill(int64_t M, int64_t g_begin, int64_t g_end, Prep prep,
                                 Tiles tiles, Single single, Chunk chunk = {}) {
  for (int64_t mc = 0; mc < M; mc += MC) {
    const int64_t mend = std::min(M, mc + MC);
    chunk(mc, mend);
    int64_t g = g_begin;
    for (; g + PG <= g_end; g += PG) {
      prep(g, PG);
      row_tiles<PM>(mc, mend, [&](auto tm, int64_t m) { tiles(tm, m, g); });
    }
    for (; g < g_end; ++g) {
      prep(g, 1);
      row_tiles<PM>(mc, mend, [&](auto tm, int64_t m) { single(tm, m, g); });
    }
  }
}

// Prefill reuses each block's scales in the chunk's MC / PM tiles, so scales stored in another
// form than float32 are expanded once per chunk and group tile into float32 (the same values:
// exact conversions, the same IEEE products; m = c·d as the tile forms it) and the tiles run on
// `view`: W from group g on, those float32 scales. Its groups count from g (outputs at y + 8g).
// A thread's scratch array, grown as needed and kept.
template <typename T>
struct Scratch {
  std::vector<T> v;
  T* get(size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};
static thread_local Scratch<float> scale_buffer;
static thread_local Scratch<uint8_t> codes_buffer;      // AVX2: a group tile's codes, unpacked

#if ISA_LEVEL == 2
// ---- Q4 prefill on VNNI: each tile reads its rows and its scales in the order it uses them ----
// A 4-row × 4-group tile's block was 64 `vpdpbusd`; with 4 row pointers, 4 of activation scales
// and 4 of offsets, 2 of codes and 2 of weight scales, the tile was short of registers (GCC
// kept pointers in vector registers and reloaded them) and formed a pair's scales with two
// loads and an insert. So, once per chunk of MC rows, the chunk's rows are copied tile by
// tile (`interleave_rows`: per tile of TM rows and block b, the TM rows' 32 codes, then their
// TM d, then their TM s: TM · ROW_BYTES bytes), and once per chunk and tile of VG groups the
// groups' scales pair by pair (`pair_scales`: per block b and pair, the 16 rows' d, then their
// 16 m, float32: the values `scales8` gives, m = c·d as the other tiles form it), and the
// groups' codes unpacked to bytes pair by pair (`expand_q4_pairs`). A tile then walks one
// pointer for its rows, one for its scales and one for its codes: the same integer sums and
// the same float operations in the same order as q4_tile's, so the same bits.
constexpr int64_t ROW_BYTES = 40;          // one row's block: 32 int8 codes, float d, float s

template <int TM>
static void interleave_rows(const Act& a, int64_t m0, int64_t tiles, uint8_t* out) {
  const int64_t nb = a.K / 32;
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* o = out + (t * nb + b) * TM * ROW_BYTES;
      for (int i = 0; i < TM; ++i) {
        const int64_t m = m0 + t * TM + i;
        std::memcpy(o + 32 * i, a.q + m * a.K + 32 * b, 32);
        std::memcpy(o + 32 * TM + 4 * i, a.d + m * nb + b, 4);
        std::memcpy(o + 36 * TM + 4 * i, a.s + m * nb + b, 4);
      }
    }
}

template <int DF, int MF>
static void pair_scales(const Q4Weight& w, int64_t g, int64_t pairs, float* out) {
  const int64_t nb = w.K / 32;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t t = 0; t < pairs; ++t)
      for (int h = 0; h < 2; ++h) {
        const int64_t gh = g + 2 * t + h;
        float* o = out + (b * pairs + t) * 32 + 8 * h;
        const __m256 d = scales8<DF>(w.d, gh, b, nb);
        _mm256_storeu_ps(o, d);
        _mm256_storeu_ps(o + 16, offsets8<MF>(w, gh, b, nb, d));
      }
}

// A tile of 2·TP groups' 4- or 5-bit codes (from the first group's, BB bytes a block) unpacked
// to bytes once per chunk of rows and group tile, pair by pair as expand_pairs lays them out
// (slot c the low nibbles of chunk c, 4 + c its high ones: codes 4k..4k+3 in slot k), so the
// tiles load them where each unpacked every chunk of every pair.
template <int TP, bool FIVE>
static void expand_q4_pairs(const uint8_t* codes, int64_t nb, uint8_t* out) {
  const int64_t BB = q4_block_bytes(FIVE), gb = nb * BB;
  for (int64_t b = 0; b < nb; ++b)
    for (int t = 0; t < TP; ++t) {
      const uint8_t* p = codes + 2 * t * gb + b * BB;
      __m512i top = FIVE ? two_planes(p + 128, p + gb + 128) : _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        __m512i lo, hi;
        unpack_chunk<FIVE>(two_planes(p + 32 * c, p + gb + 32 * c), &top, &lo, &hi);
        _mm512_storeu_si512(out + ((b * 8 + c) * TP + t) * 64, lo);
        _mm512_storeu_si512(out + ((b * 8 + 4 + c) * TP + t) * 64, hi);
      }
    }
}

// TM rows (xa: `interleave_rows`' tile) × TP pairs of groups (u8: expand_q4_pairs' codes, sc:
// `pair_scales`' copy), output rows at y, y + N, …
template <int TM, int TP, bool FIVE>
static inline void q4_tile_rows_vnni(const uint8_t* xa, const float* sc, const uint8_t* u8,
                                     int64_t nb, float* y, int64_t N) {
  __m512 acc[TM][TP];
  zero_tile(acc);
  for (int64_t b = 0; b < nb; ++b, xa += TM * ROW_BYTES, sc += 32 * TP) {
    const uint8_t* p = u8 + b * 8 * TP * 64;
    __m512i s32[TM][TP];
    zero_tile(s32);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i lo[TP], hi[TP];                  // the pairs' weights (expand_q4_pairs)
#pragma GCC unroll 8
      for (int t = 0; t < TP; ++t) {
        lo[t] = _mm512_loadu_si512(p + (c * TP + t) * 64);
        hi[t] = _mm512_loadu_si512(p + ((4 + c) * TP + t) * 64);
      }
#pragma GCC unroll 8
      for (int i = 0; i < TM; ++i) {
        __m512i vl, vh;
        x_pair(reinterpret_cast<const int8_t*>(xa) + 32 * i, c, &vl, &vh);
#pragma GCC unroll 8
        for (int t = 0; t < TP; ++t)
          s32[i][t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s32[i][t], lo[t], vl), hi[t], vh);
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TP; ++t) {
      const __m512 dw = _mm512_loadu_ps(sc + 32 * t), mw = _mm512_loadu_ps(sc + 32 * t + 16);
#pragma GCC unroll 8
      for (int i = 0; i < TM; ++i) {
        float dxf, sxf;
        std::memcpy(&dxf, xa + 32 * TM + 4 * i, 4);
        std::memcpy(&sxf, xa + 36 * TM + 4 * i, 4);
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[i][t]),
                                    _mm512_mul_ps(dw, _mm512_set1_ps(dxf)), acc[i][t]);
        acc[i][t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sxf), acc[i][t]);
      }
    }
  }
  store_tile(acc, y, N);
}

static thread_local Scratch<uint8_t> rows_buffer;       // a chunk's rows, tile by tile
static thread_local Scratch<uint8_t> pairs_buffer;      // a group tile's codes as u, pair by pair

// Per chunk of MC rows: its rows copied tile by tile (`row_tiles`: VM rows a tile, then 4, then
// 1; row m's tile at nb · ROW_BYTES · (m − mc)), then per tile of VG groups their scales copied
// and the row tiles over them; the groups after the last whole tile (< VG) by q4_tile on the
// scales as stored.
template <int DF, int MF, bool FIVE>
static void q4_prefill_vnni(const Act& a, const Q4Weight& w, float* y, int64_t g0, int64_t g1) {
  constexpr int VM = VNNI_TILES[0], VG = VNNI_TILES[1], TP = VG / 2;
  const int64_t nb = w.K / 32, N = w.G * 8, BB = q4_block_bytes(FIVE);
  uint8_t* xs = rows_buffer.get(size_t(std::min(a.M, MC) * nb * ROW_BYTES));
  float* sc = scale_buffer.get(size_t(VG * nb * 16));
  uint8_t* u8 = pairs_buffer.get(size_t(VG * nb * 256));
  for (int64_t mc = 0; mc < a.M; mc += MC) {
    const int64_t mend = std::min(a.M, mc + MC);
    row_tiles<VM>(mc, mend, [&](auto tm, int64_t m) {
      interleave_rows<decltype(tm)::value>(a, m, 1, xs + (m - mc) * nb * ROW_BYTES);
    });
    int64_t g = g0;
    for (; g + VG <= g1; g += VG) {
      pair_scales<DF, MF>(w, g, TP, sc);
      expand_q4_pairs<TP, FIVE>(w.codes + g * nb * BB, nb, u8);
      row_tiles<VM>(mc, mend, [&](auto tm, int64_t m) {
        q4_tile_rows_vnni<decltype(tm)::value, TP, FIVE>(xs + (m - mc) * nb * ROW_BYTES, sc,
                                                        u8, nb, y + m * N + 8 * g, N);
      });
    }
    for (; g < g1; ++g)
      row_tiles<VM>(mc, mend, [&](auto tm, int64_t m) {
        q4_tile<decltype(tm)::value, 1, DF, MF, FIVE>(a, m, w, g, y);
      });
  }
}

// ---- Q8 prefill on VNNI (8-bit codes, 6-bit ones expanded, 4-bit indices): the same copies ----
// A chunk's rows copied tile by tile as for Q4 (`interleave_rows8`: per tile of TM rows and
// block b, the TM rows' 32 codes, their TM d, then their TM · H sums' starts −128·Σ q_x, one a
// scale of B activations), so a tile of 8 rows walks one pointer where it had 24. Per block,
// scale after scale (h), the TM × TP sums then the scale's fma, as q8_tile_vnni, on the codes
// as `expand_pairs` lays them out (with B = 16, slots 0–3 are scale 0's, 4–7 scale 1's: 16 sums
// live, not 32). The same integer sums and the same float operations in the same order: the
// same bits.
template <int H>
static constexpr int64_t row8_bytes() { return 36 + 4 * H; }   // codes, d, H starts

template <int TM, int H>
static void interleave_rows8(const Act& a, int64_t m0, const int32_t* s16, uint8_t* out) {
  const int64_t nb = a.K / 32;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* o = out + b * TM * row8_bytes<H>();
    for (int i = 0; i < TM; ++i) {
      const int64_t m = m0 + i;
      std::memcpy(o + 32 * i, a.q + m * a.K + 32 * b, 32);
      std::memcpy(o + 32 * TM + 4 * i, a.d + m * nb + b, 4);
      for (int h = 0; h < H; ++h) {
        const int32_t start = -128 * scale_sum<H>(s16 + m * (a.K / 16), b, h);
        std::memcpy(o + 36 * TM + 4 * (H * i + h), &start, 4);
      }
    }
  }
}

// A tile of 2·TP groups' codes as vpdpbusd's unsigned operand u = code + 128, pair by pair, once
// per chunk of rows and group tile: per block b, slot k = 0..7 (codes 4k..4k+3) and pair t, 64
// bytes, the pair's two groups side by side; from int8 codes (Q8's layout, 256 bytes a block:
// an xor of the sign bit) or 4-bit indices (Q4's arrangement, 128 bytes a block: slot c the low
// nibbles of chunk c, 4 + c its high ones, looked up in `table` of u). A tile then loads each
// pair's u in one 64-byte load: no vpshufb, mask, shift, xor or insert per tile, which share
// vpdpbusd's ports (on a Xeon each prefill tile had 24–32 of them to 128 vpdpbusd a block).
template <int TP>
static void expand_pairs(const uint8_t* codes, int64_t nb, const int8_t* lut, uint8_t* out) {
  const __m512i flip = _mm512_set1_epi8(int8_t(0x80));
  const __m512i table = lut ? _mm512_xor_si512(
      _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)lut)), flip) : flip;
  const int64_t BB = lut ? 128 : 256, gb = nb * BB;
  auto put = [&](int64_t b, int k, int t, __m512i u) {
    _mm512_storeu_si512(out + ((b * 8 + k) * TP + t) * 64, u);
  };
  for (int64_t b = 0; b < nb; ++b)
    for (int t = 0; t < TP; ++t) {
      const uint8_t* p = codes + 2 * t * gb + b * BB;
      for (int c = 0; c < (lut ? 4 : 8); ++c) {
        const __m512i r = two_planes(p + 32 * c, p + gb + 32 * c);
        if (!lut) {
          put(b, c, t, _mm512_xor_si512(r, flip));
          continue;
        }
        __m512i lo, hi;
        unpack_chunk<false>(r, nullptr, &lo, &hi);                 // the indices, then u
        put(b, c, t, _mm512_shuffle_epi8(table, lo));
        put(b, 4 + c, t, _mm512_shuffle_epi8(table, hi));
      }
    }
}

// TM rows (xa: interleave_rows8's tile) × TP pairs of groups: u as expand_pairs lays it out, d
// the groups' float32 scales (q8_prefill's view: group-major, nd a group), outputs at y,
// y + N, …
template <int TM, int TP, int B>
static inline void q8_tile_rows_vnni(const uint8_t* xa, const float* d, const uint8_t* u8,
                                     int64_t nb, float* y, int64_t N) {
  constexpr int H = 32 / B;
  constexpr int64_t RB = row8_bytes<H>();
  const int64_t nd = nb * H;
  __m512 acc[TM][TP];
  zero_tile(acc);
  for (int64_t b = 0; b < nb; ++b, xa += TM * RB) {
    const uint8_t* p = u8 + b * 8 * TP * 64;
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      __m512i s32[TM][TP];
#pragma GCC unroll 8
      for (int i = 0; i < TM; ++i) {
        int32_t start;
        std::memcpy(&start, xa + 36 * TM + 4 * (H * i + h), 4);
#pragma GCC unroll 8
        for (int t = 0; t < TP; ++t) s32[i][t] = _mm512_set1_epi32(start);
      }
#pragma GCC unroll 8
      for (int k = h * 8 / H; k < (h + 1) * 8 / H; ++k) {          // slot k: codes 4k..4k+3
        __m512i u[TP];
#pragma GCC unroll 8
        for (int t = 0; t < TP; ++t) u[t] = _mm512_loadu_si512(p + (k * TP + t) * 64);
#pragma GCC unroll 8
        for (int i = 0; i < TM; ++i) {
          int32_t x4;
          std::memcpy(&x4, xa + 32 * i + 4 * k, 4);
          const __m512i xv = _mm512_set1_epi32(x4);
#pragma GCC unroll 8
          for (int t = 0; t < TP; ++t) s32[i][t] = _mm512_dpbusd_epi32(s32[i][t], u[t], xv);
        }
      }
#pragma GCC unroll 8
      for (int t = 0; t < TP; ++t) {
        const __m512 dw = scales16<scale_f32>(d, 2 * t, b * H + h, nd);
#pragma GCC unroll 8
        for (int i = 0; i < TM; ++i) {
          float dxf;
          std::memcpy(&dxf, xa + 32 * TM + 4 * i, 4);
          acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[i][t]),
                                      _mm512_mul_ps(dw, _mm512_set1_ps(dxf)), acc[i][t]);
        }
      }
    }
  }
  store_tile(acc, y, N);
}
#endif


template <int DF, int MF, bool FIVE>
static void q4_rows_s(const Act& a, const Q4Weight& w, float* y, int64_t g0, int64_t g1) {
  if (a.M < TL_DECODE_ROWS) {
#if ISA_LEVEL == 2
    q4_decode_vnni<DF, MF, FIVE>(a, w, y, g0, g1);
#else
    drive_decode(a.M, g0, g1,
                 [&](int64_t m, int64_t g) { q4_tile<1, DG, DF, MF, FIVE>(a, m, w, g, y); },
                 [&](int64_t m, int64_t g) { q4_tile<1, 1, DF, MF, FIVE>(a, m, w, g, y); });
#endif
    return;
  }
#if ISA_LEVEL == 2
  q4_prefill_vnni<DF, MF, FIVE>(a, w, y, g0, g1);      // the tiles' own copies (above)
#else
  constexpr int PM = TILES[0], PG = TILES[1];
  const int64_t nb = w.K / 32, n = PG * nb * 8, N = w.G * 8;  // a tile's scales
  float* d = scale_buffer.get(size_t(2 * n));
  float* m = d + n;
  uint8_t* u8 = codes_buffer.get(size_t(PG * nb * 256));     // the tile's codes, unpacked
  auto prep = [&](int64_t g, int64_t groups) {
    unpack_q4_codes<FIVE>(w.codes + g * nb * q4_block_bytes(FIVE), groups, nb, u8);
    for (int64_t i = 0; i < groups; ++i)
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 dw = scales8<DF>(w.d, g + i, b, nb);
        _mm256_storeu_ps(d + (i * nb + b) * 8, dw);
        _mm256_storeu_ps(m + (i * nb + b) * 8, offsets8<MF>(w, g + i, b, nb, dw));
      }
  };
  drive_prefill<PM, PG>(a.M, g0, g1, prep,
      [&](auto tm, int64_t r, int64_t g) {
        q4_tile_unpacked<decltype(tm)::value, PG, FIVE>(a, r, u8, d, m, y + r * N + 8 * g, N); },
      [&](auto tm, int64_t r, int64_t g) {
        q4_tile_unpacked<decltype(tm)::value, 1, FIVE>(a, r, u8, d, m, y + r * N + 8 * g, N); });
#endif
}

constexpr bool LUT_VNNI = ISA_LEVEL == 2;    // 4-bit indices' prefill tiles read them as stored

// q8_prefill's tiles: view is the weight as the tiles read it (int8 codes or u = code + 32,
// float32 scales) for the group tile that prep(g, groups) last expanded from group gv on.
#if ISA_LEVEL == 2
// AVX-512 VNNI: the rows interleaved once per chunk (`interleave_rows8`), each group tile's u
// pair by pair (`expand_pairs`), q8_tile_rows_vnni (Q2_K's offsets: q8_tile_vnni).
template <int B, bool SMALL, bool OFF, typename Prep>
static void q8_prefill_vnni(const Act& a, const Q8Weight& w, const Q8Weight& view, const float* buf,
                            float* y, int64_t g0, int64_t g1, const int32_t* sx, Prep& prep,
                            const int64_t& gv) {
  constexpr int VM = VNNI_TILES[0], VG = VNNI_TILES[1];     // VNNI: VG groups a tile (pairs)
  const int64_t nb = w.K / 32;
  const int32_t* s16 = sx ? sx : sum_buffer.sums(a);
  auto single = [&](auto tm, int64_t m, int64_t g) {
    q8_tile<decltype(tm)::value, 1, B, scale_f32, SMALL, store_int8, OFF>(
        a, m, view, g - gv, y + 8 * gv, s16);
  };
  if (OFF) {                                    // Q2_K: q8_tile_vnni, its offsets' fmas
    drive_prefill<VM, VG>(a.M, g0, g1, prep,
        [&](auto tm, int64_t m, int64_t g) { q8_tile_vnni<decltype(tm)::value, VG, B, OFF>(
            a, m, view, g - gv, y + 8 * gv, s16); }, single);
    return;
  }
  constexpr int H = 32 / B;
  const int64_t N = w.G * 8;
  uint8_t* xs = rows_buffer.get(size_t(std::min(a.M, MC) * nb * row8_bytes<H>()));
  uint8_t* pairs = pairs_buffer.get(size_t(VG * nb * 256));
  auto prep_pairs = [&](int64_t g, int64_t groups) {      // scales (prep), then u pair by pair
    prep(g, groups);
    if (groups == VG)
      expand_pairs<VG / 2>(w.lut ? reinterpret_cast<const uint8_t*>(w.codes) + g * nb * 128
                                 : reinterpret_cast<const uint8_t*>(view.codes), nb, w.lut, pairs);
  };
  drive_prefill<VM, VG>(a.M, g0, g1, prep_pairs,
      [&](auto tm, int64_t m, int64_t g) {
        q8_tile_rows_vnni<decltype(tm)::value, VG / 2, B>(xs + (m % MC) * nb * row8_bytes<H>(),
                                                         buf, pairs, nb, y + m * N + 8 * g, N);
      }, single,
      [&](int64_t mc, int64_t mend) {                // each chunk's rows, tile by tile
        row_tiles<VM>(mc, mend, [&](auto tm, int64_t m) {
          interleave_rows8<decltype(tm)::value, H>(a, m, s16, xs + (m - mc) * nb * row8_bytes<H>());
        });
      });
}
#else
// AVX2: full-range codes on sign_tile, small ones expanded as u = code + 32 (u32) on u32_tile;
// Q2_K's offsets and the scalar level on q8_tile.
template <int B, bool SMALL, bool OFF, typename Prep>
static void q8_prefill_tiles(const Act& a, const Q8Weight& view, float* y, int64_t g0, int64_t g1,
                             const int32_t* sx, bool u32, Prep& prep, const int64_t& gv) {
  constexpr int PM = SMALL ? TILES[2] : TILES[4], PG = SMALL ? TILES[3] : TILES[5];
#if ISA_LEVEL == 1
  if constexpr (!SMALL && !OFF) {
    drive_prefill<PM, PG>(a.M, g0, g1, prep,
        [&](auto tm, int64_t m, int64_t g) { sign_tile<decltype(tm)::value, PG, B>(
            a, m, view, g - gv, y + 8 * gv); },
        [&](auto tm, int64_t m, int64_t g) { sign_tile<decltype(tm)::value, 1, B>(
            a, m, view, g - gv, y + 8 * gv); });
    return;
  }
  if (u32) {
    const int32_t* s16 = sum_buffer.sums(a);
    drive_prefill<PM, PG>(a.M, g0, g1, prep,
        [&](auto tm, int64_t m, int64_t g) { u32_tile<decltype(tm)::value, PG, B>(
            a, m, view, g - gv, y + 8 * gv, s16); },
        [&](auto tm, int64_t m, int64_t g) { u32_tile<decltype(tm)::value, 1, B>(
            a, m, view, g - gv, y + 8 * gv, s16); });
    return;
  }
#endif
  constexpr int F = scale_f32, I8 = store_int8;
  drive_prefill<PM, PG>(a.M, g0, g1, prep,
      [&](auto tm, int64_t m, int64_t g) { q8_tile<decltype(tm)::value, PG, B, F, SMALL, I8, OFF>(
          a, m, view, g - gv, y + 8 * gv, sx); },
      [&](auto tm, int64_t m, int64_t g) { q8_tile<decltype(tm)::value, 1, B, F, SMALL, I8, OFF>(
          a, m, view, g - gv, y + 8 * gv, sx); });
}
#endif

// Q8 prefill: codes stored narrower than int8 (6 bits, 4-bit indices, 2 bits) expanded once per
// chunk and group tile, scales (and offsets) as float32 (`scale_buffer`), then the 8-bit tiles.
template <int B, int DF, bool SMALL, bool OFF>
static void q8_prefill(const Act& a, const Q8Weight& w, float* y, int64_t g0, int64_t g1,
                       const int32_t* sx) {
  constexpr int PM = SMALL ? TILES[2] : TILES[4], PG = SMALL ? TILES[3] : TILES[5];
  const int64_t nb = w.K / 32, nd = w.K / B;
  const bool narrow = w.six || w.lut || w.two;           // codes in 6, 4 or 2 bits
  const int64_t GB = std::max(PG, VNNI_TILES[1]);        // groups of a tile, any level
  const int64_t ns = GB * nd * 8;                        // a tile's scales (and offsets)
  float* buf = scale_buffer.get(size_t((OFF ? 2 : 1) * ns + (narrow ? GB * nb * 64 : 0)));
  int8_t* expanded = reinterpret_cast<int8_t*>(buf + (OFF ? 2 : 1) * ns);  // codes as int8
  Q8Weight view = w;
  view.d = buf, view.d_form = scale_f32, view.six = view.two = false, view.lut = nullptr;
  view.m = OFF ? buf + ns : nullptr;                     // m in d's form: float32 too
  // AVX2, small codes in 6 bits or 4-bit indices: expanded as u = code + 32 (`u32_tile`)
  const bool u32 = ISA_LEVEL == 1 && SMALL && !OFF && (w.six || w.lut);
  const __m256i table = !w.lut ? _mm256_setzero_si256()
      : u32 ? _mm256_add_epi8(lut_table(w.lut), _mm256_set1_epi8(32)) : lut_table(w.lut);
  int64_t gv = 0;
  auto prep = [&](int64_t g, int64_t groups) {
    gv = g;
    view.codes = w.codes + g * nb * 256;
    if (narrow && !(LUT_VNNI && !OFF && w.lut && groups > 1)) {
      view.codes = expanded;
      const int64_t BB = w.six ? 192 : w.lut ? 128 : 64;
      const uint8_t* p = reinterpret_cast<const uint8_t*>(w.codes) + g * nb * BB;
      for (int64_t i = 0; i < groups * nb; ++i) {
        if (w.six && u32) six_to_eight8<true>(p + BB * i, expanded + 256 * i);
        else if (w.six) six_to_eight8(p + BB * i, expanded + 256 * i);
        else if (w.lut) lut_to_eight8(p + BB * i, table, expanded + 256 * i);
        else two_to_eight8(p + BB * i, expanded + 256 * i);
      }
    }
    for (int64_t i = 0; i < groups; ++i)
      for (int64_t j = 0; j < nd; ++j) {
        _mm256_storeu_ps(buf + (i * nd + j) * 8, scales8<DF>(w.d, g + i, j, nd));
        if (OFF) _mm256_storeu_ps(buf + ns + (i * nd + j) * 8, scales8<DF, true>(w.m, g + i, j, nd));
      }
  };
#if ISA_LEVEL == 2
  q8_prefill_vnni<B, SMALL, OFF>(a, w, view, buf, y, g0, g1, sx, prep, gv);
#else
  q8_prefill_tiles<B, SMALL, OFF>(a, view, y, g0, g1, sx, u32, prep, gv);
#endif
}

// Q8's products: decode tiles by how the codes are stored (6 bits: six_tile; 4-bit indices and
// 2 bits, one row: q8_tile on them; int8: q8_tile), prefill (and 2–8 rows of narrow codes,
// expanded once a tile rather than unpacked for every row) by q8_prefill.
template <int B, int DF, bool SMALL, bool OFF = false>
static void q8_rows_k(const Act& a, const Q8Weight& w, float* y, int64_t g0, int64_t g1) {
  const int32_t* sx = OFF ? sum_buffer.sums(a) : nullptr;
  if (a.M < TL_DECODE_ROWS_Q8 && w.six) {
    const int32_t* s16 = sum_buffer.sums(a);
    drive_decode(a.M, g0, g1,
                 [&](int64_t m, int64_t g) { six_tile<DG, B, DF>(a, m, w, g, y, s16 + m * a.K / 16); },
                 [&](int64_t m, int64_t g) { six_tile<1, B, DF>(a, m, w, g, y, s16 + m * a.K / 16); });
    return;
  }
  if (a.M == 1 && (w.lut || w.two)) {
    auto one = [&](auto st) {
      constexpr int ST = decltype(st)::value;
#if ISA_LEVEL == 2                     // one row: VNNI, group after group
      const int32_t* s16 = sx ? sx : sum_buffer.sums(a);
      for (int64_t g = g0; g < g1; ++g) q8_row_vnni<B, DF, SMALL, ST, OFF>(a, 0, w, g, y, s16);
      return;
#endif
      drive_decode(a.M, g0, g1,
          [&](int64_t m, int64_t g) { q8_tile<1, DG, B, DF, SMALL, ST, OFF>(a, m, w, g, y, sx); },
          [&](int64_t m, int64_t g) { q8_tile<1, 1, B, DF, SMALL, ST, OFF>(a, m, w, g, y, sx); });
    };
    if (w.lut) one(std::integral_constant<int, store_lut>{});
    else one(std::integral_constant<int, store_two>{});
    return;
  }
  if (a.M < TL_DECODE_ROWS_Q8 && !w.lut && !w.two) {
    constexpr int I8 = store_int8;
    drive_decode(a.M, g0, g1,
        [&](int64_t m, int64_t g) { q8_tile<1, DG, B, DF, SMALL, I8, OFF>(a, m, w, g, y, sx); },
        [&](int64_t m, int64_t g) { q8_tile<1, 1, B, DF, SMALL, I8, OFF>(a, m, w, g, y, sx); });
    return;
  }
  q8_prefill<B, DF, SMALL, OFF>(a, w, y, g0, g1, sx);
}

template <int B, int DF>
static void q8_rows_b(const Act& a, const Q8Weight& w, float* y, int64_t g0, int64_t g1) {
  if (w.small) q8_rows_k<B, DF, true>(a, w, y, g0, g1);
  else q8_rows_k<B, DF, false>(a, w, y, g0, g1);
}
#endif

// ---- the table's entries: groups [g0, g1) of 8 weight rows against every activation row -------
// (blocks.cpp admits only these forms: m in d's form or c·d, 5-bit codes with m in d's form;
// super_u8 for Q4; super_i8 for Q8 with blocks of 16, super_i8_8 with blocks of 32.)
template <int DF>
static void q4_rows_d(const Act& a, const Q4Weight& w, float* y, int64_t g0, int64_t g1) {
  if (w.m_form == scale_times_d) q4_rows_s<DF, scale_times_d, false>(a, w, y, g0, g1);
  else if (w.five) q4_rows_s<DF, DF, true>(a, w, y, g0, g1);       // Q5_1, Q5_K: m stored
  else q4_rows_s<DF, DF, false>(a, w, y, g0, g1);
}

static void q4_rows(const Act& a, const Q4Weight& w, float* y, int64_t g0, int64_t g1) {
  if (w.d_form == scale_f16) q4_rows_d<scale_f16>(a, w, y, g0, g1);
  else if (w.d_form == scale_super_u8) q4_rows_d<scale_super_u8>(a, w, y, g0, g1);
  else q4_rows_d<scale_f32>(a, w, y, g0, g1);
}

static void q8_rows(const Act& a, const Q8Weight& w, float* y, int64_t g0, int64_t g1) {
#if ISA_LEVEL > 0
  if (w.d_form == scale_pair_u4) {                      // Q2_K: codes in [0, 3], offsets
    q8_rows_k<16, scale_pair_u4, true, true>(a, w, y, g0, g1);
    return;
  }
#else
  if (w.d_form == scale_pair_u4) q8_rows_b<16, scale_pair_u4>(a, w, y, g0, g1);
  else
#endif
  if (w.d_form == scale_super_i8) q8_rows_b<16, scale_super_i8>(a, w, y, g0, g1);
  else if (w.d_form == scale_super_i8_8) q8_rows_b<32, scale_super_i8_8>(a, w, y, g0, g1);
  else if (w.block == 16 && w.d_form == scale_f16) q8_rows_b<16, scale_f16>(a, w, y, g0, g1);
  else if (w.block == 16) q8_rows_b<16, scale_f32>(a, w, y, g0, g1);
  else if (w.d_form == scale_f16) q8_rows_b<32, scale_f16>(a, w, y, g0, g1);
  else q8_rows_b<32, scale_f32>(a, w, y, g0, g1);
}

}  // namespace ISA
