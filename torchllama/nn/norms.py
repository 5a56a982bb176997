"""Normalization layers: RMSNorm (Llama; Gemma's (1 + w) variant) and LayerNorm (GPT-2).

Both are computed in float32 whatever the input dtype and cast back, as the reference
implementations do. `make_norm` picks one from `ModelArgs` (norm, norm_bias, norm_unit_offset).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchllama import kernels


# --8<-- [start:rmsnorm]
class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, eq. 4): x / RMS(x) · g.

    RMS(x) = sqrt(mean(x²) + eps): each vector is rescaled, not re-centred. As Meta's reference
    (llama/model.py, RMSNorm.forward) the normalised x is cast back to the input dtype before the
    gain multiplies it.

    With unit_offset (Gemma, Google's gemma_pytorch and transformers' Gemma3RMSNorm) the gain is
    (1 + w) with w initialised to 0, and the product is taken in float32 before the cast.

    Shapes: x (..., dim) any float dtype → (..., dim) same dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        # g = w (dim,), or 1 + w with unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def neutral_values(self) -> list[tuple[nn.Parameter, float]]:
        """(parameter, value) pairs that make this norm a pure normalization (for init)."""
        return [(self.weight, 0.0 if self.unit_offset else 1.0)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.layer_ops_apply(x, self.weight):        # csrc/layers.cpp: one op, same math
            return torch.ops.torchllama.rms_norm(x, self.weight, self.eps, self.unit_offset)
        x32 = x.float()                                                    # (..., D) fp32
        rms_inv = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., 1)
        if self.unit_offset:
            return (x32 * rms_inv * (1.0 + self.weight.float())).type_as(x)   # (..., D)
        return (x32 * rms_inv).type_as(x) * self.weight                    # (..., D)
# --8<-- [end:rmsnorm]


# --8<-- [start:layernorm]
class LayerNorm(nn.Module):
    """Layer normalization (Ba et al. 2016, eq. 3-4): (x − μ) / sqrt(σ² + eps) · γ + β, with μ
    and σ² the mean and (biased) variance over the last dimension; β optional (GPT-2 has it,
    OLMo and MPT do not). Computed in float32 by `F.layer_norm`, cast back.

    Shapes: x (..., dim) → (..., dim) same dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))                         # γ (dim,)
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None        # β (dim,)

    def neutral_values(self) -> list[tuple[nn.Parameter, float]]:
        """(parameter, value) pairs that make this norm a pure normalization (for init)."""
        return [(self.weight, 1.0)] + ([(self.bias, 0.0)] if self.bias is not None else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), bias,
                            self.eps).type_as(x)                           # (..., D)
# --8<-- [end:layernorm]


def make_norm(args, dim: int) -> nn.Module:
    """The norm `args` asks for (args.norm, norm_bias, norm_unit_offset, norm_eps) over `dim`."""
    if args.norm == "layernorm":
        return LayerNorm(dim, eps=args.norm_eps, bias=args.norm_bias)
    return RMSNorm(dim, eps=args.norm_eps, unit_offset=args.norm_unit_offset)
