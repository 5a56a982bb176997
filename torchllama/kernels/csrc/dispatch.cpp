// The CPU scored once and the kernel table built from it (see kernels.h): each kernel from the
// highest instruction set the CPU has that provides it, the scalar table completing the rest.
// The features are read with GCC's __builtin_cpu_supports (cpuid, and the OS's XSAVE state for
// the AVX registers); TORCHLLAMA_KERNELS_ISA lowers them for the tests and benchmarks.
//
// The instruction sets are data: one row of ISAS each (ggml-cpu's cpu-feats scores and
// arch-fallback.h, as a table). A row names its level, checks what it adds to the rows before it
// (a row is used only when every row before it is too) and points at its arch/ file's table.

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels.h"

namespace torchllama {
namespace {

struct IsaRow {
  const char* name;
  const char* alias;                  // another name TORCHLLAMA_KERNELS_ISA takes, or null
  bool (*cpu_has)();                  // what this level adds (__builtin_cpu_supports needs
                                      // literal names, hence a function per row)
  const Kernels& (*kernels)();        // its arch/ file's table
};

const IsaRow ISAS[] = {
    {"scalar", nullptr, [] { return true; }, &scalar_kernels},
    {"avx2", nullptr,
     [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                 __builtin_cpu_supports("f16c"); },
     &avx2_kernels},
    {"avx512", nullptr,
     [] { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                 __builtin_cpu_supports("avx512bw"); },
     &avx512_kernels},
    {"avx512_vnni", "vnni", [] { return __builtin_cpu_supports("avx512vnni") != 0; },
     &avx512_vnni_kernels},
};
constexpr int N_ISAS = sizeof(ISAS) / sizeof(ISAS[0]);

// The row named `name` (or its alias), or -1.
int row_of(const std::string& name) {
  for (int i = 0; i < N_ISAS; ++i)
    if (name == ISAS[i].name || (ISAS[i].alias && name == ISAS[i].alias)) return i;
  return -1;
}

// The highest row the CPU runs (every row up to it present), capped by TORCHLLAMA_KERNELS_ISA.
int detect_top() {
  __builtin_cpu_init();
  int top = 0;
  while (top + 1 < N_ISAS && ISAS[top + 1].cpu_has()) ++top;
  const char* env = std::getenv("TORCHLLAMA_KERNELS_ISA");
  const std::string level = env ? env : "";
  if (!level.empty()) {
    const int cap = row_of(level);
    if (cap < 0) {
      std::string names;
      for (int i = 0; i < N_ISAS; ++i) names += std::string(i ? ", " : "") + ISAS[i].name;
      std::fprintf(stderr, "warning: TORCHLLAMA_KERNELS_ISA=%s is not one of %s; ignored\n",
                   level.c_str(), names.c_str());
    } else if (cap < top) {
      top = cap;
    }
  }
  return top;
}

int top_row() {
  static const int top = detect_top();
  return top;
}

// f(name, entry of t, entry of u) for every entry of the table.
template <typename F>
void each_entry(Kernels& t, const Kernels& u, F f) {
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

// Entries still null taken from each level in turn, rows top..0 (ggml's arch-fallback.h, as data).
Kernels build(int top) {
  Kernels t;                                     // all null
  for (int i = top; i >= 0; --i)
    each_entry(t, ISAS[i].kernels(), [](const char*, auto& entry, auto lower) {
      if (entry == nullptr) entry = lower;
    });
  return t;
}

}  // namespace

std::vector<std::string> isa_names() {
  std::vector<std::string> out;
  for (const IsaRow& row : ISAS) out.push_back(row.name);
  return out;
}

const std::string& isa_in_use() {
  static const std::string name = ISAS[top_row()].name;
  return name;
}

const Kernels& table() {
  static const Kernels t = build(top_row());
  return t;
}

std::vector<std::string> kernel_levels(const std::string& name) {
  const int top = row_of(name);
  if (top < 0) return {};
  Kernels t = build(top);
  std::vector<std::string> out;
  for (int i = top; i >= 0; --i)                 // an entry is the function of one level
    each_entry(t, ISAS[i].kernels(), [&](const char* entry_name, auto& entry, auto lower) {
      if (entry == lower) out.push_back(std::string(entry_name) + "=" + ISAS[i].name);
    });
  return out;
}

}  // namespace torchllama
