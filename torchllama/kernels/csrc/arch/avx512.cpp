// The AVX-512 float32 layer kernels: RMSNorm, attention and f32_linear with their 16 lanes in
// one zmm register. They need AVX-512 F, VL and BW only, so a CPU without VNNI (Skylake-SP,
// Cascade Lake without it) runs them too; the int8 block kernels need VNNI for their AVX-512
// path (arch/avx512_vnni.cpp) and come from the AVX2 table otherwise (dispatch.cpp).
// layers_impl.h and linear_impl.h with ISA_LEVEL 2 under `#pragma GCC target`.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../kernels.h"

namespace torchllama {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")
#define ISA avx512
#define ISA_LEVEL 2
#include "../layers_impl.h"
#include "../linear_impl.h"
#undef ISA
#undef ISA_LEVEL
#pragma GCC pop_options

const Kernels& avx512_kernels() {
  static const Kernels k = [] {
    Kernels k;                                   // block kernels: avx512_vnni or avx2
    k.rms_norm_rows = &avx512::rms_norm_rows;
    k.attend_tiles = &avx512::attend_tiles;
    k.attend_fold = &avx512::attend_fold;
    k.linear_rows = &avx512::linear_rows;
    k.linear_cols = &avx512::linear_cols;
    return k;
  }();
  return k;
}

}  // namespace torchllama
