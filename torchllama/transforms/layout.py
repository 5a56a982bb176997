"""CPU execution choices applied to a built model from outside it: the memory layout of the
linear layers' weights."""

from __future__ import annotations

import torch
from torch import nn

from torchllama.errors import ArgumentError


def column_major(w: torch.Tensor) -> torch.Tensor:
    """The same (out, in) matrix stored as the transpose of a contiguous (in, out) tensor."""
    return w.t().contiguous().t()                               # (out, in), strides (1, out)


def set_weight_layout(model: nn.Module, layout: str) -> nn.Module:
    """Choose how every nn.Linear weight is laid out in memory; values, shapes (out, in), names
    and ties are unchanged.

    - "row": (out, in) contiguous, torch's default.
    - "column": the transpose of a contiguous (in, out) tensor. F.linear then runs
      x @ W_in_out without a transposed operand. On x86 CPUs with MKL this is faster in
      float32, for matrix-vector products (decode) and some prefill GEMMs (`torchllama bench
      decode --dtype float32`). It does not help bfloat16 (oneDNN), so loaders use it for
      float32 only.

    Returns the model (modified in place).

    Raises:
        ArgumentError: unknown layout.
    """
    if layout not in ("row", "column"):
        raise ArgumentError(f"weight layout must be 'row' or 'column', got {layout!r}")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            w = module.weight.data                              # (out, in)
            if layout == "column":
                module.weight.data = column_major(w)
            else:
                module.weight.data = w.contiguous()             # (out, in), strides (in, 1)
    return model
