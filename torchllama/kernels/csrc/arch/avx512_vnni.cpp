// The AVX-512 VNNI level of the int8 block kernels: activation quantization 16 lanes at a time,
// and the block products (q4_rows: vpdpbusd on two row groups per register instead of maddubs +
// madd, decode and prefill; q8_rows: prefill by vpdpbusd on the codes offset to unsigned, its
// decode tiles AVX2's compiled again here). blocks_impl.h with ISA_LEVEL 2 under `#pragma GCC target`; dispatch.cpp calls
// it only on a CPU with AVX-512 F, VL, BW and VNNI.
// The float32 layer kernels of that CPU are arch/avx512.cpp's (they need no VNNI).

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
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#define ISA avx512_vnni
#define ISA_LEVEL 2
#include "../blocks_impl.h"
#undef ISA
#undef ISA_LEVEL
#pragma GCC pop_options

const Kernels& avx512_vnni_kernels() {
  static const Kernels k = [] {
    Kernels k;                                   // float32 layer kernels: avx512
    k.quantize_block = &avx512_vnni::quantize_block;
    k.q4_rows = &avx512_vnni::q4_rows;
    k.q8_rows = &avx512_vnni::q8_rows;
    return k;
  }();
  return k;
}

}  // namespace torchllama
