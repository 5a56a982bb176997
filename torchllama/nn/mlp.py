"""Feed-forward (MLP) blocks: the position-wise network after attention.

- Plain MLP (Vaswani et al. 2017, eq. 2): W2 · act(W1·x), hidden 4·dim, with act ReLU
  (Vaswani), GELU (Hendrycks & Gimpel 2016; BERT) or GELU's tanh approximation (GPT-2).
- Gated (Shazeer 2020, "GLU Variants Improve Transformer", eq. 5-6): W2 · (act(W1·x) ⊙ W3·x),
  SwiGLU with act = SiLU (Llama), GeGLU with act = GELU (Gemma: tanh GELU); three matrices, so
  the hidden size is 2/3 of a plain MLP's for the same parameters (`ModelArgs.ffn_hidden_dim`).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchllama.nn.linear import Linear

#: ModelArgs.mlp → the activation applied to W1·x.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swiglu": F.silu,                                         # SiLU(x) = x·σ(x)
    "geglu": F.gelu,                                          # x·Φ(x)
    "geglu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
}


# --8<-- [start:swiglu]
class FeedForward(nn.Module):
    """Gated feed-forward network (Shazeer 2020, eq. 6 for SwiGLU):
    FFN(x) = W2 · (act(W1·x) ⊙ W3·x). Meta's names: w1 gate, w3 up, w2 down.

    Args:
        dim: model width.
        hidden_dim: width of the hidden layer (`ModelArgs.ffn_hidden_dim`).
        activation: a key of ACTIVATIONS ("swiglu", "geglu", "geglu_tanh").
        bias: biases on the three projections.
    """

    def __init__(self, dim: int, hidden_dim: int, activation: str = "swiglu", bias: bool = False):
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.w1 = Linear(dim, hidden_dim, bias=bias)      # gate projection
        self.w2 = Linear(hidden_dim, dim, bias=bias)      # down projection
        self.w3 = Linear(dim, hidden_dim, bias=bias)      # up projection
        #: w1 and w3 as one product, where `torchllama.transforms.fuse.fuse_projections` made one
        self.w13: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, D) → (B, T, F) gated → (B, T, D)
        if self.w13 is not None:
            gate, up = self.w13(x).chunk(2, dim=-1)       # (B, T, F) each, one product
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(self.act(gate) * up)
# --8<-- [end:swiglu]


# --8<-- [start:mlp]
class MLP(nn.Module):
    """Plain two-layer feed-forward network (Vaswani et al. 2017, eq. 2): W2 · act(W1·x).

    Args:
        dim: model width.
        hidden_dim: width of the hidden layer (4·dim by default).
        activation: a key of ACTIVATIONS ("relu", "gelu", "gelu_tanh").
        bias: biases on both projections (GPT-2).
    """

    def __init__(self, dim: int, hidden_dim: int, activation: str = "gelu", bias: bool = False):
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.w1 = Linear(dim, hidden_dim, bias=bias)      # up projection
        self.w2 = Linear(hidden_dim, dim, bias=bias)      # down projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, D) → (B, T, F) → (B, T, D)
        return self.w2(self.act(self.w1(x)))
# --8<-- [end:mlp]


def make_mlp(args) -> nn.Module:
    """The feed-forward block `args.mlp` names, of `args.ffn_hidden_dim` hidden units."""
    cls = FeedForward if args.gated_mlp else MLP
    return cls(args.dim, args.ffn_hidden_dim, args.mlp, bias=args.mlp_bias)
