// The CPU scored once and the kernel table built from it (see kernels.h): each kernel from the
// highest instruction set the CPU has that provides it, the scalar table completing the rest.
// The features are read with GCC's __builtin_cpu_supports (cpuid, and the OS's XSAVE state for
// the AVX registers); TORCHLLAMA_KERNELS_ISA lowers them for the tests and benchmarks.

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kernels.h"

namespace torchllama {

static CpuFeatures detect() {
  __builtin_cpu_init();
  CpuFeatures f;
  f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  f.avx512 = f.avx2 && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  f.avx512_vnni = f.avx512 && __builtin_cpu_supports("avx512vnni");
  return f;
}

// The features up to the level TORCHLLAMA_KERNELS_ISA names (never above the CPU's).
static CpuFeatures lowered(CpuFeatures f, const std::string& level) {
  if (level.empty() || level == "vnni" || level == "avx512_vnni") return f;
  if (level == "avx512") { f.avx512_vnni = false; return f; }
  if (level == "avx2") { f.avx512 = f.avx512_vnni = false; return f; }
  if (level == "scalar") return CpuFeatures{};
  std::fprintf(stderr, "warning: TORCHLLAMA_KERNELS_ISA=%s is not scalar, avx2, avx512 or "
               "vnni; ignored\n", level.c_str());
  return f;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = [] {
    const char* level = std::getenv("TORCHLLAMA_KERNELS_ISA");
    return lowered(detect(), level ? level : "");
  }();
  return f;
}

Isa isa_in_use() {
  const CpuFeatures& f = cpu_features();
  return f.avx512_vnni ? Isa::avx512_vnni : f.avx512 ? Isa::avx512 : f.avx2 ? Isa::avx2
                                                                        : Isa::scalar;
}

// Entries of t still null taken from `lower` (ggml's arch-fallback.h, at run time).
template <typename F>
static void take(F& entry, F lower) {
  if (entry == nullptr) entry = lower;
}

static void fall_back(Kernels& t, const Kernels& lower) {
  take(t.quantize_block, lower.quantize_block);
  take(t.q4_rows, lower.q4_rows);
  take(t.q8_rows, lower.q8_rows);
  take(t.rms_norm_rows, lower.rms_norm_rows);
  take(t.rope_head, lower.rope_head);
  take(t.attend_one, lower.attend_one);
  take(t.linear_rows, lower.linear_rows);
  take(t.linear_cols, lower.linear_cols);
}

static Kernels build(const CpuFeatures& f) {
  Kernels t;                                     // all null
  if (f.avx512_vnni) fall_back(t, avx512_vnni_kernels());
  if (f.avx512) fall_back(t, avx512_kernels());
  if (f.avx2) fall_back(t, avx2_kernels());
  fall_back(t, scalar_kernels());                // complete: every entry
  return t;
}

const Kernels& table() {
  static const Kernels t = build(cpu_features());
  return t;
}

}  // namespace torchllama
