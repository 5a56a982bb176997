// The AVX2 + FMA + F16C kernels: the int8 block products (_mm256_maddubs_epi16 /
// _mm256_madd_epi16, llama.cpp's ggml-cpu idiom) and the float32 layer kernels (16 lanes as
// two ymm halves). The impl headers are included with ISA_LEVEL 1 under `#pragma GCC target`,
// so this one file is compiled for AVX2 while the rest of the extension stays baseline x86-64;
// dispatch.cpp calls it only on a CPU that has AVX2, FMA and F16C. rope_head is left to the
// scalar table (plain float ops, the same bits, nothing to gain).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../kernels.h"

namespace torchllama {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define ISA avx2
#define ISA_LEVEL 1
#include "../blocks_impl.h"
#include "../layers_impl.h"
#include "../linear_impl.h"
#undef ISA
#undef ISA_LEVEL
#pragma GCC pop_options

const Kernels& avx2_kernels() {
  static const Kernels k = [] {
    Kernels k;
    k.quantize_block = &avx2::quantize_block;
    k.q4_rows = &avx2::q4_rows;
    k.q8_rows = &avx2::q8_rows;
    k.rms_norm_rows = &avx2::rms_norm_rows;
    k.f32_to_f16 = &avx2::f32_to_f16;
    k.attend_tiles = &avx2::attend_tiles;
    k.attend_fold = &avx2::attend_fold;
    k.linear_rows = &avx2::linear_rows;
    k.linear_cols = &avx2::linear_cols;
    return k;
  }();
  return k;
}

}  // namespace torchllama
