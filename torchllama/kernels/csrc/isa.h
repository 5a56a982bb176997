// The instruction set the kernels run with, chosen once per process (blocks.cpp).
#pragma once

namespace torchllama {
enum class Isa { scalar, avx2, vnni };   // vnni: AVX-512 (F, VL, BW, VNNI)
Isa isa_in_use();
}  // namespace torchllama
