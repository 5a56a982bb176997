"""Normalization layers.

RMSNorm (Zhang & Sennrich 2019) is what Llama uses: it rescales each vector by its root mean square,
with a learned gain and no re-centring.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, eq. 4): x / RMS(x) · g.

    RMS(x) = sqrt(mean(x²) + eps). Computed in float32 whatever the input dtype, then cast back,
    as Meta's reference does (llama/model.py, RMSNorm.forward).

    Shapes: x (..., dim) any float dtype → (..., dim) same dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # g, the learned gain (dim,)

    def neutral_values(self) -> list[tuple[nn.Parameter, float]]:
        """(parameter, value) pairs that make this norm a pure normalization (for init)."""
        return [(self.weight, 1.0)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()                                                    # (..., D) fp32
        rms_inv = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., 1)
        return (x32 * rms_inv).type_as(x) * self.weight                    # (..., D)
