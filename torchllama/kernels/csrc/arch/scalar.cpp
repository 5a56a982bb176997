// The scalar kernels: every entry of the table, in plain C++ for any x86-64 (the compiler's
// baseline, SSE2), and the reference the SIMD levels match bit for bit. The impl headers are
// written once for every level and included here with ISA_LEVEL 0, where their 16 lanes are
// plain loops (blocks_impl.h, layers_impl.h, linear_impl.h explain the methods).
//
// Standard headers come first, outside any target region (as in every arch/ file), so the
// inline library functions they define are compiled for the baseline only.

#include <c10/util/Half.h>   // fp16_ieee_to_fp32_value: float16 block scales, exactly
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../kernels.h"

namespace torchllama {

#define ISA scalar
#define ISA_LEVEL 0
#include "../blocks_impl.h"
#include "../layers_impl.h"
#include "../linear_impl.h"
#undef ISA
#undef ISA_LEVEL

const Kernels& scalar_kernels() {
  static const Kernels k = [] {
    Kernels k;
    k.quantize_block = &scalar::quantize_block;
    k.q4_rows = &scalar::q4_rows;
    k.q8_rows = &scalar::q8_rows;
    k.rms_norm_rows = &scalar::rms_norm_rows;
    k.rope_head = &scalar::rope_head;      // the only level: plain float ops, the same bits
    k.f32_to_f16 = &scalar::f32_to_f16;
    k.attend_tiles = &scalar::attend_tiles;
    k.attend_fold = &scalar::attend_fold;
    k.linear_rows = &scalar::linear_rows;
    k.linear_cols = &scalar::linear_cols;
    return k;
  }();
  return k;
}

}  // namespace torchllama
