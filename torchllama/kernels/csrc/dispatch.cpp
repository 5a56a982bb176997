// The CPU scored once and the kernel table built from it (see kernels.h): each kernel from the
// highest instruction set the CPU has that provides it, the scalar table completing the rest.
// The features are read with GCC's __builtin_cpu_supports (cpuid, and the OS's XSAVE state for
// the AVX registers); TORCHLLAMA_KERNELS_ISA lowers them for the tests and benchmarks.

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

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

CpuFeatures features_of(Isa isa) {
  CpuFeatures f;
  f.avx2 = isa != Isa::scalar;
  f.avx512 = isa == Isa::avx512 || isa == Isa::avx512_vnni;
  f.avx512_vnni = isa == Isa::avx512_vnni;
  return f;
}

// The features up to the level TORCHLLAMA_KERNELS_ISA names (never above the CPU's).
static CpuFeatures lowered(const CpuFeatures& cpu, const std::string& level) {
  Isa cap = Isa::avx512_vnni;
  if (level == "scalar") cap = Isa::scalar;
  else if (level == "avx2") cap = Isa::avx2;
  else if (level == "avx512") cap = Isa::avx512;
  else if (!level.empty() && level != "vnni" && level != "avx512_vnni")
    std::fprintf(stderr, "warning: TORCHLLAMA_KERNELS_ISA=%s is not scalar, avx2, avx512 or "
                 "vnni; ignored\n", level.c_str());
  const CpuFeatures c = features_of(cap);
  CpuFeatures f;
  f.avx2 = cpu.avx2 && c.avx2;
  f.avx512 = cpu.avx512 && c.avx512;
  f.avx512_vnni = cpu.avx512_vnni && c.avx512_vnni;
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

// f(name, entry of t, entry of u) for every entry of the table.
template <typename F>
static void each_entry(Kernels& t, const Kernels& u, F f) {
  f("quantize_block", t.quantize_block, u.quantize_block);
  f("q4_rows", t.q4_rows, u.q4_rows);
  f("q8_rows", t.q8_rows, u.q8_rows);
  f("rms_norm_rows", t.rms_norm_rows, u.rms_norm_rows);
  f("rope_head", t.rope_head, u.rope_head);
  f("f32_to_f16", t.f32_to_f16, u.f32_to_f16);
  f("attend_tiles", t.attend_tiles, u.attend_tiles);
  f("attend_fold", t.attend_fold, u.attend_fold);
  f("linear_rows", t.linear_rows, u.linear_rows);
  f("linear_cols", t.linear_cols, u.linear_cols);
}

// The levels f allows, highest first; scalar always (every entry).
struct Level { const char* name; const Kernels& (*kernels)(); };

static std::vector<Level> levels(const CpuFeatures& f) {
  std::vector<Level> out;
  if (f.avx512_vnni) out.push_back({"avx512_vnni", &avx512_vnni_kernels});
  if (f.avx512) out.push_back({"avx512", &avx512_kernels});
  if (f.avx2) out.push_back({"avx2", &avx2_kernels});
  out.push_back({"scalar", &scalar_kernels});
  return out;
}

// Entries still null taken from each level in turn (ggml's arch-fallback.h, as data).
static Kernels build(const CpuFeatures& f) {
  Kernels t;                                     // all null
  for (const Level& level : levels(f))
    each_entry(t, level.kernels(), [](const char*, auto& entry, auto lower) {
      if (entry == nullptr) entry = lower;
    });
  return t;
}

const Kernels& table() {
  static const Kernels t = build(cpu_features());
  return t;
}

std::vector<std::string> kernel_levels(const CpuFeatures& f) {
  Kernels t = build(f);
  std::vector<std::string> out;
  for (const Level& level : levels(f))           // an entry is the function of one level
    each_entry(t, level.kernels(), [&](const char* name, auto& entry, auto lower) {
      if (entry == lower) out.push_back(std::string(name) + "=" + level.name);
    });
  return out;
}

}  // namespace torchllama
