// The ATen ops, callable from C++ (decoder.cpp) as from Python (torch.ops.torchllama.*):
// defined by the glue files blocks.cpp and layers.cpp, which check the arguments, split the
// work over threads and call the kernel table (kernels.h).
#pragma once

#include <ATen/ATen.h>
#include <optional>
#include <vector>

namespace torchllama {
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const at::Tensor& m);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                     const at::Tensor& small);
at::Tensor q4_linear_experts(const at::Tensor& x, const at::Tensor& tokens,
                             const at::Tensor& experts, int64_t n_experts,
                             const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m);
at::Tensor q8_linear_experts(const at::Tensor& x, const at::Tensor& tokens,
                             const at::Tensor& experts, int64_t n_experts,
                             const at::Tensor& codes, const at::Tensor& d,
                             const at::Tensor& small);
// Several stacked weights of one kind side by side ([codes, d, m | small] each): (R, ΣN).
at::Tensor experts_linear(const at::Tensor& x, const at::Tensor& tokens,
                          const at::Tensor& experts, int64_t n_experts,
                          const std::vector<at::Tensor>& w);
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool unit_offset);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cs);
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, double scale, double softcap,
                     const std::optional<at::Tensor>& key_start);
}  // namespace torchllama
