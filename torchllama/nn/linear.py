"""The model's linear layer: `nn.Linear` whose float32 inference product is batch-invariant.

y = x·Wᵀ + b. In float32 on the CPU at inference (no gradient tracked, no autocast, kernels
built: `torchllama.kernels.layer_ops_apply`), the product is torchllama's `f32_linear` kernel
(csrc/layers.cpp, linear_impl.h): every output is one dot product computed by the same float
operations in the same order whatever the number of rows, so a token's logits are the same bits
whether it is decoded alone (M = 1), verified among the k + 1 tokens of a speculative step, or
served in a batch. torch's F.linear (MKL) picks a matrix-vector kernel for one row and a blocked
GEMM for more, which round differently (SmolLM2's float32 logits: 7.6e-5 apart). Otherwise
(training, other dtypes or devices, TORCHLLAMA_KERNELS=0) it is F.linear.

The kernel serves every M, and was faster than MKL's F.linear for the decode step, a few-token
verification and a long prefill where it was tuned (`torchllama bench decode --dtype float32`
measures it).

The class is an `nn.Linear` (same parameters, state-dict keys and repr), so code that looks for
`isinstance(m, nn.Linear)` (quantization, LoRA, checkpoint loading) treats it as one.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from torchllama import kernels

#: False routes every product through F.linear (for comparisons and benchmarks); the default
#: reads TORCHLLAMA_F32_LINEAR (0/off/false/no: off).
use_kernel: bool = os.environ.get("TORCHLLAMA_F32_LINEAR", "1").strip().lower() not in (
    "0", "off", "false", "no")


class Linear(nn.Linear):
    """`nn.Linear` with the batch-invariant float32 kernel at inference (see the module doc).

    Shapes: x (..., in_features) → (..., out_features).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight                                          # (N, K)
        if (use_kernel and w.dtype == torch.float32 and x.shape[-1] == w.shape[1]
                and kernels.layer_ops_apply(x, w, *(() if self.bias is None else (self.bias,)))):
            y = torch.ops.torchllama.f32_linear(x.reshape(-1, w.shape[1]), w)   # (M, N)
            y = y.view(*x.shape[:-1], w.shape[0])
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, w, self.bias)


def invariant_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x·wᵀ (x (..., K), w (N, K) → (..., N)) with `Linear`'s batch-invariant float32 kernel
    where it applies (else F.linear): each row's result does not depend on the other rows
    (batched LoRA updates, `transforms.multi_lora`)."""
    if use_kernel and w.dtype == torch.float32 and x.dtype == torch.float32 and \
            kernels.layer_ops_apply(x, w):
        y = torch.ops.torchllama.f32_linear(x.reshape(-1, w.shape[1]).contiguous(), w)
        return y.view(*x.shape[:-1], w.shape[0])                                  # (..., N)
    return F.linear(x, w)
