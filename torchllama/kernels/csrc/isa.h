// The instruction set the kernels run with, chosen once per process (blocks.cpp), and the ops.
#pragma once

namespace torchllama {
enum class Isa { scalar, avx2, vnni };   // vnni: AVX-512 (F, VL, BW, VNNI)
Isa isa_in_use();
}  // namespace torchllama

#include <ATen/ATen.h>
#include <optional>

namespace torchllama {
// The ops, callable from C++ (blocks.cpp, layers.cpp) as from Python.
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const at::Tensor& m);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool unit_offset);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cs);
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, double scale, double softcap,
                     const std::optional<at::Tensor>& key_start);
}  // namespace torchllama
