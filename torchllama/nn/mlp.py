"""Feed-forward (MLP) blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """SwiGLU feed-forward network (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6):
    FFN(x) = W2 · (SiLU(W1·x) ⊙ W3·x).

    Args:
        dim: model width.
        hidden_dim: width of the hidden layer (`ModelArgs.ffn_hidden_dim`).
    """

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)   # gate projection
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)   # down projection
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)   # up projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, D) → (B, T, F) gated → (B, T, D)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
