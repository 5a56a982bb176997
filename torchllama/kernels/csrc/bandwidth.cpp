// The machine's memory read bandwidth, as fast as the CPU reads: the roofline that a decode
// step (which streams every weight once per token) is measured against
// (torchllama.bench.roofline times this op; `torchllama bench shapes` prints the fraction).
//
// Ops:
//   read_bytes(buf (n,) uint8 contiguous, threads, streams, prefetch, nt, level, chunk) → the
//   XOR of every little-endian 64-bit word of buf (the last n % 8 bytes zero-padded into one
//   word), as int64: numpy's `bitwise_xor.reduce` of the same words (the test's oracle), and
//   what keeps the compiler from dropping the loads. The caller times the call. Any n and any
//   address (unaligned loads; a whole number of vectors or pages is not needed).
//     threads   threads reading (at::parallel_for; 0: torch's thread count)
//     chunk     bytes (rounded up to 4 KiB) a thread takes at a time from a shared counter, so a
//               thread whose core is busy with another process reads less and the others more;
//               0: one fixed slice a thread instead (then the pass waits for the slowest)
//     streams   1, 2, 4 or 8: each piece cut into that many equal parts, read side by side (one
//               256-byte step of each part per loop), so that several sequential streams are in
//               flight at once (more misses outstanding, more hardware prefetcher streams)
//     prefetch  software prefetch distance in bytes ahead of each stream (0: none; one
//               prefetch instruction per 64-byte line)
//     nt        non-temporal: `prefetchnta` and the streaming load (vmovntdqa) where the buffer
//               is 64-byte aligned; on ordinary write-back memory vmovntdqa is an ordinary
//               load (Intel SDM, MOVNTDQA), so only the prefetch hint differs
//     level     −1: the widest the CPU has; 0 scalar 64-bit words, 1 AVX2 (32-byte ymm loads),
//               2 AVX-512 F (64-byte zmm loads); a level the CPU lacks falls to the one below
//   read_level() → the level read_bytes(level=−1) runs here (2, 1 or 0), for the report.
//
// The method is STREAM's (McCalpin, "Memory Bandwidth and Machine Balance", 1995) reduced to
// its read half, in the shape of likwid-bench's `load_avx512` loop (RRZE-HPC/likwid
// bench/x86-64/load_avx512.ptt: four 64-byte loads per 256-byte step): the widest loads into
// independent accumulators (XOR: one cycle, and any order gives the same bits, so no add chain
// limits the loop), a buffer far larger than the last-level cache (the caller's 1 GiB; 32 MiB
// of L3 on the test machine), the best of several passes. The buffer must have been written
// before it is read: an anonymous page never written reads as the kernel's shared zero page,
// which stays in cache and would give a fake figure.
//
// The variants (streams, prefetch, non-temporal, AVX-512 or AVX2) read within the run-to-run
// noise of each other on the machines measured (`torchllama bench shapes` prints the figure), so
// the defaults are the simplest: 2 streams, no software prefetch, ordinary loads, 4 MiB chunks.
// What makes the figure trustworthy is less the loop than where and when it runs: on huge pages
// like the weights, the best of 1 and n threads (roofline.py; a thread whose core another
// process holds starts late), in the process and near the time of the decode it divides.
//
// Each level is compiled for its instruction set by a target attribute on its functions (the
// file builds with the project's baseline flags) and chosen at run time by
// __builtin_cpu_supports, as dispatch.cpp chooses the kernels' levels (TORCHLLAMA_KERNELS_ISA
// does not apply: every level gives the same checksum, and the test asks each by `level`).

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace torchllama {
namespace {

constexpr int64_t STEP = 256;    // bytes of one stream read per loop iteration (4 zmm, 8 ymm)
constexpr int64_t PAGE = 4096;   // threads' slices start on page offsets of the buffer

inline uint64_t word_at(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

// ---- scalar: 64-bit words ---------------------------------------------------------------------

uint64_t xor_words(const uint8_t* p, int64_t n) {          // n a multiple of 8
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 ^= word_at(p + i); a1 ^= word_at(p + i + 8);
    a2 ^= word_at(p + i + 16); a3 ^= word_at(p + i + 24);
  }
  for (; i < n; i += 8) a0 ^= word_at(p + i);
  return a0 ^ a1 ^ a2 ^ a3;
}

// ---- AVX2: 32-byte loads ----------------------------------------------------------------------

#define TL_AVX2 __attribute__((target("avx2")))

TL_AVX2 inline __m256i load32(const uint8_t* p, bool nt) {
  // vmovntdqa needs 32-byte alignment; `nt` is only passed for an aligned buffer (steps of 256)
  return nt ? _mm256_stream_load_si256(reinterpret_cast<const __m256i*>(p))
            : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

TL_AVX2 uint64_t fold32(__m256i v) {
  alignas(32) uint64_t w[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(w), v);
  return w[0] ^ w[1] ^ w[2] ^ w[3];
}

// S streams of `len` bytes each (a multiple of STEP), at p, p + len, …, p + (S−1)·len.
template <int S, bool NT>
TL_AVX2 uint64_t streams_avx2(const uint8_t* p, int64_t len, int64_t pf) {
  __m256i a[8];
  for (auto& x : a) x = _mm256_setzero_si256();
  for (int64_t i = 0; i < len; i += STEP) {
    for (int s = 0; s < S; ++s) {
      const uint8_t* q = p + s * len + i;
      if (pf) {
        for (int l = 0; l < STEP; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(q + pf + l), NT ? _MM_HINT_NTA : _MM_HINT_T0);
      }
      for (int k = 0; k < 8; ++k) a[k] = _mm256_xor_si256(a[k], load32(q + 32 * k, NT));
    }
  }
  for (int k = 1; k < 8; ++k) a[0] = _mm256_xor_si256(a[0], a[k]);
  return fold32(a[0]);
}

TL_AVX2 uint64_t tail_avx2(const uint8_t* p, int64_t n) {  // n a multiple of 8
  __m256i a = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) a = _mm256_xor_si256(a, load32(p + i, false));
  return fold32(a) ^ xor_words(p + i, n - i);
}

// ---- AVX-512 F: 64-byte loads -----------------------------------------------------------------

#define TL_AVX512 __attribute__((target("avx512f")))

TL_AVX512 inline __m512i load64(const uint8_t* p, bool nt) {
  return nt ? _mm512_stream_load_si512(reinterpret_cast<void*>(const_cast<uint8_t*>(p)))
            : _mm512_loadu_si512(p);
}

TL_AVX512 uint64_t fold64(__m512i v) {
  alignas(64) uint64_t w[8];
  _mm512_store_si512(w, v);
  return w[0] ^ w[1] ^ w[2] ^ w[3] ^ w[4] ^ w[5] ^ w[6] ^ w[7];
}

template <int S, bool NT>
TL_AVX512 uint64_t streams_avx512(const uint8_t* p, int64_t len, int64_t pf) {
  __m512i a[4];
  for (auto& x : a) x = _mm512_setzero_si512();
  for (int64_t i = 0; i < len; i += STEP) {
    for (int s = 0; s < S; ++s) {
      const uint8_t* q = p + s * len + i;
      if (pf) {
        for (int l = 0; l < STEP; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(q + pf + l), NT ? _MM_HINT_NTA : _MM_HINT_T0);
      }
      for (int k = 0; k < 4; ++k) a[k] = _mm512_xor_si512(a[k], load64(q + 64 * k, NT));
    }
  }
  a[0] = _mm512_xor_si512(_mm512_xor_si512(a[0], a[1]), _mm512_xor_si512(a[2], a[3]));
  return fold64(a[0]);
}

TL_AVX512 uint64_t tail_avx512(const uint8_t* p, int64_t n) {
  __m512i a = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) a = _mm512_xor_si512(a, load64(p + i, false));
  return fold64(a) ^ xor_words(p + i, n - i);
}

// ---- one thread's slice -------------------------------------------------------------------------

struct Plan { int level; int streams; int64_t prefetch; bool nt; };

template <int S>
uint64_t streams_at(const Plan& c, const uint8_t* p, int64_t len) {
  if (c.level == 2) return c.nt ? streams_avx512<S, true>(p, len, c.prefetch)
                                : streams_avx512<S, false>(p, len, c.prefetch);
  return c.nt ? streams_avx2<S, true>(p, len, c.prefetch)
              : streams_avx2<S, false>(p, len, c.prefetch);
}

// XOR of the words of [p, p + n), n a multiple of 8: the streams over the largest part that
// splits into `streams` equal multiples of STEP, the rest by one plain loop.
uint64_t read_slice(const Plan& c, const uint8_t* p, int64_t n) {
  if (c.level == 0) return xor_words(p, n);
  const int64_t len = n / (STEP * c.streams) * STEP;     // bytes per stream
  uint64_t x = 0;
  if (len > 0) {
    switch (c.streams) {
      case 1: x = streams_at<1>(c, p, len); break;
      case 2: x = streams_at<2>(c, p, len); break;
      case 4: x = streams_at<4>(c, p, len); break;
      default: x = streams_at<8>(c, p, len); break;
    }
  }
  const int64_t done = len * c.streams;
  return x ^ (c.level == 2 ? tail_avx512(p + done, n - done) : tail_avx2(p + done, n - done));
}

int cpu_level() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
}

}  // namespace

static int64_t read_level() {
  static const int best = cpu_level();
  return best;
}

static int64_t read_bytes(const at::Tensor& buf, int64_t threads, int64_t streams,
                          int64_t prefetch, bool nt, int64_t level, int64_t chunk) {
  TORCH_CHECK(buf.scalar_type() == at::kByte && buf.is_contiguous() && buf.device().is_cpu(),
              "read_bytes: buf must be a contiguous CPU uint8 tensor, got ", buf.scalar_type(),
              " ", buf.sizes());
  TORCH_CHECK(streams == 1 || streams == 2 || streams == 4 || streams == 8,
              "read_bytes: streams must be 1, 2, 4 or 8, got ", streams);
  TORCH_CHECK(prefetch >= 0 && chunk >= 0, "read_bytes: prefetch and chunk must be ≥ 0 bytes, "
              "got ", prefetch, " and ", chunk);
  const int best = int(read_level());
  Plan c{level < 0 ? best : int(std::min<int64_t>(level, best)), int(streams), prefetch, nt};
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t n = buf.numel();
  // vmovntdqa faults on an unaligned address: ordinary loads for a buffer not 64-byte aligned
  // (every stream and step then starts at a multiple of 64 from an aligned start)
  c.nt = c.nt && reinterpret_cast<uintptr_t>(p) % 64 == 0;

  const int64_t words = n / 8 * 8;
  const int64_t T = std::max<int64_t>(1, threads > 0 ? threads : at::get_num_threads());
  std::vector<uint64_t> part(T, 0);
  if (chunk > 0) {                     // chunks of whole pages, taken in turn from a counter
    const int64_t size = (chunk + PAGE - 1) / PAGE * PAGE, count = (words + size - 1) / size;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        uint64_t x = 0;
        for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
          const int64_t a = i * size;
          x ^= read_slice(c, p + a, std::min(words, a + size) - a);
        }
        part[t] = x;
      }
    });
  } else {                             // one slice a thread, a whole number of pages
    const int64_t slice = (words / T + PAGE - 1) / PAGE * PAGE;
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t a = std::min(words, t * slice);
        const int64_t b = t + 1 == T ? words : std::min(words, a + slice);
        part[t] = read_slice(c, p + a, b - a);
      }
    });
  }
  uint64_t x = 0;
  for (uint64_t v : part) x ^= v;
  if (n > words) {                                  // the last n % 8 bytes, zero-padded
    uint8_t last[8] = {0};
    std::memcpy(last, p + words, n - words);
    x ^= word_at(last);
  }
  int64_t out;
  std::memcpy(&out, &x, 8);
  return out;
}

}  // namespace torchllama

TORCH_LIBRARY_FRAGMENT(torchllama, m) {
  m.def("read_bytes(Tensor buf, int threads=0, int streams=2, int prefetch=0, bool nt=False, "
        "int level=-1, int chunk=4194304) -> int");
  m.def("read_level() -> int", &torchllama::read_level);     // no tensor: a catch-all kernel
}

TORCH_LIBRARY_IMPL(torchllama, CPU, m) {
  m.impl("read_bytes", &torchllama::read_bytes);
}
