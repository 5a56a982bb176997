"""What an exact int8 × int8 block product can reach at AVX2 (no VNNI): the tile of a prefill
(TM activation rows × TG groups of 8 weight rows, 32-weight blocks in the kernels' interleaved
layout, one float fma per block), written in each exact form AVX2 allows, one thread, weights and
activations in L2, best of 3 passes and of the tile shapes 2×4, 4×1, 4×2 and 6×1, in GFLOP/s
(2·M·N·K a product). Each form's outputs are checked equal to a double-precision reference
of the same integer sums. `vpmaddubsw` multiplies unsigned by signed bytes, so:

- sign:   ⟨|w|, sign(x, w)⟩, then `vpmaddwd` to int32 each chunk (a pair can reach 2·127·127):
          llama.cpp's idiom and our Q8_0 / IQ4 tiles (codes in [−128, 127], table values);
- split:  x = 16·x_hi + x_lo, ⟨x_lo, w⟩ and ⟨x_hi + 8, w⟩ − 128·Σw, both small enough for
          int16 sums over a block: two `vpmaddubsw` a chunk, no sign;
- int16:  codes and activations widened to int16, `vpmaddwd` (16 products an instruction);
- u6:     6-bit codes as u = code + 32 (Q6_K, Q5_0, Q3_K: `u32_tile`), one `vpmaddubsw` a
          chunk, int16 sums over two chunks, − 32·Σx a block;
- u4:     4-bit codes (Q4_0's form), one `vpmaddubsw` a chunk, int16 sums over the block.

The first three are what IQ4_XS / IQ4_NL (table values up to ±127) and Q8_0 can use; the last
two need codes that fit in 6 or 4 unsigned bits. docs/guides/quantized.md uses the table for
why AVX2's IQ4_XS prefill stays level with llama.cpp's (AVX2 CPUs only; needs g++).

    .venv/bin/python benchmarks/avx2_int8_forms.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
static inline __m256i bcast4(const void* p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
const int64_t K = 2048, NB = K / 32, M = 96, G = 64;        // 96 rows x 512 weight rows
struct Data {
  std::vector<int8_t> x, w;          // x: M x K; w: per group, block: chunk c = 8 rows x 4 codes
  std::vector<uint8_t> xs;           // split: per row, block: 32 x_lo then 32 x_hi + 8
  std::vector<int16_t> x16, w16;     // int16: w16 chunk (2 codes x 8 rows) = 16 lanes
  std::vector<int32_t> off;          // split: -128 sum w per group, block, row; u6: -32 sum x
  std::vector<float> dw, dx;
};
enum Form { SIGN, SPLIT, INT16, U6, U4 };

template <int F, int TM, int TG>
__attribute__((noinline)) void tile(const Data& D, int64_t m0, int64_t g0, float* y) {
  const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  __m256 acc[TM][TG];
  for (int i = 0; i < TM; ++i) for (int g = 0; g < TG; ++g) acc[i][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    __m256i s32[TM][TG], s16[TM][TG], h16[TM][TG];
    for (int i = 0; i < TM; ++i) for (int g = 0; g < TG; ++g)
      s32[i][g] = s16[i][g] = h16[i][g] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      __m256i wv[TG], wa[TG], wl[TG], wh[TG];
      for (int g = 0; g < TG; ++g) {
        const int64_t blk = ((g0 + g) * NB + b) * 256;
        if (F == INT16) {
          wl[g] = _mm256_loadu_si256((const __m256i*)(D.w16.data() + blk + 32 * c));
          wh[g] = _mm256_loadu_si256((const __m256i*)(D.w16.data() + blk + 32 * c + 16));
        } else {
          wv[g] = _mm256_loadu_si256((const __m256i*)(D.w.data() + blk + 32 * c));
          if (F == SIGN) wa[g] = _mm256_abs_epi8(wv[g]);
        }
      }
      for (int i = 0; i < TM; ++i) {
        const int64_t m = m0 + i;
        if (F == SIGN) {
          const __m256i xv = bcast4(D.x.data() + m * K + 32 * b + 4 * c);
          for (int g = 0; g < TG; ++g) s32[i][g] = _mm256_add_epi32(s32[i][g], _mm256_madd_epi16(
              _mm256_maddubs_epi16(wa[g], _mm256_sign_epi8(xv, wv[g])), ones));
        } else if (F == SPLIT) {
          const uint8_t* xr = D.xs.data() + (m * NB + b) * 64 + 4 * c;
          const __m256i lo = bcast4(xr), hi = bcast4(xr + 32);
          for (int g = 0; g < TG; ++g) {
            s16[i][g] = _mm256_add_epi16(s16[i][g], _mm256_maddubs_epi16(lo, wv[g]));
            h16[i][g] = _mm256_add_epi16(h16[i][g], _mm256_maddubs_epi16(hi, wv[g]));
          }
        } else if (F == INT16) {
          const int16_t* xr = D.x16.data() + m * K + 32 * b + 4 * c;
          const __m256i x0 = bcast4(xr), x1 = bcast4(xr + 2);
          for (int g = 0; g < TG; ++g) s32[i][g] = _mm256_add_epi32(s32[i][g], _mm256_add_epi32(
              _mm256_madd_epi16(wl[g], x0), _mm256_madd_epi16(wh[g], x1)));
        } else {
          const __m256i xv = bcast4(D.x.data() + m * K + 32 * b + 4 * c);
          for (int g = 0; g < TG; ++g) s16[i][g] = _mm256_add_epi16(s16[i][g], _mm256_maddubs_epi16(wv[g], xv));
          if (F == U6 && c % 2 == 1)
            for (int g = 0; g < TG; ++g) {
              s32[i][g] = _mm256_add_epi32(s32[i][g], _mm256_madd_epi16(s16[i][g], ones));
              s16[i][g] = _mm256_setzero_si256();
            }
        }
      }
    }
    for (int g = 0; g < TG; ++g) {
      const __m256 d = _mm256_loadu_ps(D.dw.data() + ((g0 + g) * NB + b) * 8);
      for (int i = 0; i < TM; ++i) {
        __m256i s = s32[i][g];
        if (F == SPLIT) s = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(s16[i][g], ones),
                _mm256_madd_epi16(h16[i][g], sixteen)),
            _mm256_loadu_si256((const __m256i*)(D.off.data() + ((g0 + g) * NB + b) * 8)));
        if (F == U4) s = _mm256_madd_epi16(s16[i][g], ones);
        if (F == U6) s = _mm256_add_epi32(s, _mm256_set1_epi32(D.off[(m0 + i) * NB + b]));
        acc[i][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d,
            _mm256_set1_ps(D.dx[(m0 + i) * NB + b])), acc[i][g]);
      }
    }
  }
  for (int i = 0; i < TM; ++i) for (int g = 0; g < TG; ++g) _mm256_storeu_ps(y + (i * TG + g) * 8, acc[i][g]);
}

// The form's data laid out: int8 codes in [-128, 127]; u6 stores u = code + 32 in [0, 63], u4
// codes in [0, 15].
Data make(int F) {
  Data D;
  std::mt19937 rng(1);
  const int lo = F == U6 || F == U4 ? 0 : -128, hi = F == U6 ? 63 : F == U4 ? 15 : 127;
  D.x.resize(M * K); D.w.resize(G * NB * 256); D.x16.resize(M * K); D.w16.resize(G * NB * 256);
  D.xs.resize(M * NB * 64); D.dw.resize(G * NB * 8); D.dx.resize(M * NB);
  for (auto& v : D.x) v = int8_t(int(rng() % 255) - 127);
  for (auto& v : D.w) v = int8_t(lo + int(rng() % (hi - lo + 1)));
  for (auto& v : D.dw) v = 1e-3f * (1 + rng() % 100);
  for (auto& v : D.dx) v = 1e-3f * (1 + rng() % 100);
  for (size_t i = 0; i < D.x.size(); ++i) D.x16[i] = D.x[i];
  for (int64_t gb = 0; gb < G * NB; ++gb)                 // int16: chunk c's codes 4c, 4c+1 then 4c+2, 4c+3
    for (int c = 0; c < 8; ++c) for (int r = 0; r < 8; ++r) for (int k = 0; k < 4; ++k)
      D.w16[gb * 256 + 32 * c + 16 * (k / 2) + 2 * r + (k & 1)] = D.w[gb * 256 + 32 * c + 4 * r + k];
  for (int64_t m = 0; m < M; ++m) for (int64_t b = 0; b < NB; ++b) for (int t = 0; t < 32; ++t) {
    const int v = D.x[m * K + 32 * b + t];
    D.xs[(m * NB + b) * 64 + t] = uint8_t(v & 15);
    D.xs[(m * NB + b) * 64 + 32 + t] = uint8_t((v >> 4) + 8);
  }
  if (F == SPLIT) {
    D.off.assign(G * NB * 8, 0);
    for (int64_t gb = 0; gb < G * NB; ++gb) for (int c = 0; c < 8; ++c) for (int r = 0; r < 8; ++r)
      for (int k = 0; k < 4; ++k) D.off[gb * 8 + r] -= 128 * D.w[gb * 256 + 32 * c + 4 * r + k];
  }
  if (F == U6) {
    D.off.assign(M * NB, 0);
    for (int64_t m = 0; m < M; ++m) for (int64_t b = 0; b < NB; ++b) for (int t = 0; t < 32; ++t)
      D.off[m * NB + b] -= 32 * D.x[m * K + 32 * b + t];
  }
  return D;
}

// The same sums in double, the codes as they are (u6: w − 32).
double max_error(const Data& D, int F, const std::vector<float>& y) {
  double worst = 0;
  for (int64_t m = 0; m < M; ++m) for (int64_t g = 0; g < G; ++g) for (int r = 0; r < 8; ++r) {
    double ref = 0, scale = 0;
    for (int64_t b = 0; b < NB; ++b) {
      int64_t s = 0;
      for (int c = 0; c < 8; ++c) for (int k = 0; k < 4; ++k)
        s += int64_t(D.w[(g * NB + b) * 256 + 32 * c + 4 * r + k] - (F == U6 ? 32 : 0)) *
             D.x[m * K + 32 * b + 4 * c + k];
      const double f = double(D.dw[(g * NB + b) * 8 + r]) * D.dx[m * NB + b];
      ref += double(s) * f; scale += std::fabs(double(s) * f);
    }
    worst = std::max(worst, std::fabs(ref - y[(m * G + g) * 8 + r]) / (scale + 1e-30));
  }
  return worst;
}

template <int F, int TM, int TG>
double rate(const Data& D, std::vector<float>& y) {
  double best = 1e30;
  for (int pass = 0; pass < 3; ++pass) {
    auto t0 = std::chrono::steady_clock::now();
    for (int rep = 0; rep < 10; ++rep)
      for (int64_t g = 0; g < G; g += TG)
        for (int64_t m = 0; m + TM <= M; m += TM) {
          float t[TM * TG * 8];
          tile<F, TM, TG>(D, m, g, t);
          for (int i = 0; i < TM; ++i) for (int gg = 0; gg < TG; ++gg)
            memcpy(&y[((m + i) * G + g + gg) * 8], t + (i * TG + gg) * 8, 32);
        }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 10.0 * 2 * M * G * 8 * K / best / 1e9;
}

template <int F>
void row(const char* name, const char* what) {
  Data D = make(F);
  std::vector<float> y(M * G * 8);
  double best = 0; const char* shape = "";
  auto keep = [&](double r, const char* s) { if (r > best) best = r, shape = s; };
  keep(rate<F, 2, 4>(D, y), "2x4"); keep(rate<F, 4, 1>(D, y), "4x1");
  keep(rate<F, 4, 2>(D, y), "4x2"); keep(rate<F, 6, 1>(D, y), "6x1");
  printf("%-6s %7.1f GFLOP/s  (%s)  relative error %.1e  %s\n", name, best, shape, max_error(D, F, y), what);
}

int main() {
  row<SIGN>("sign", "int8 codes: sign, maddubs, madd a chunk");
  row<SPLIT>("split", "int8 codes: x in nibbles, 2 maddubs a chunk");
  row<INT16>("int16", "int8 codes widened: 2 madd a chunk");
  row<U6>("u6", "6-bit codes + 32: 1 maddubs a chunk");
  row<U4>("u4", "4-bit codes: 1 maddubs a chunk");
}
"""


def main() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2" not in flags:
        sys.exit("avx2_int8_forms: this CPU has no AVX2")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "forms.cpp", Path(tmp) / "forms"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O3", "-std=c++17", "-mavx2", "-mfma", "-ffp-contract=off",
                        str(src), "-o", str(exe)], check=True)
        model = next((line.split(":", 1)[1].strip() for line in flags.splitlines()
                      if line.startswith("model name")), "unknown CPU")
        print(f"{model}, one thread, AVX2 + FMA (no VNNI), K = 2048, 96 rows x 512 weight rows")
        print(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout, end="")


if __name__ == "__main__":
    main()
