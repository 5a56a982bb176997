"""Reading a model's insides during its own forward pass: the attention probabilities of every
layer and the residual stream after every block.

Both are opt-in and leave the model as it was: `capture_attention` switches the attention
modules to the explicit softmax path (`torchllama.nn.attention.attend` with a capture list)
only inside its `with` block; `residual_stream` uses forward hooks removed before it returns.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from torchllama.model import Transformer


class AttentionCapture:
    """The attention probabilities recorded by `capture_attention`.

    Attributes:
        per_layer: one list per layer of the (B, H, T, S) float32 probabilities of each forward
            call made inside the block, in call order.
    """

    def __init__(self, n_layers: int):
        self.per_layer: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]

    @property
    def probs(self) -> torch.Tensor:
        """The last forward call's probabilities of every layer, stacked: (L, B, H, T, S)
        float32. Rows of query t sum to 1 over the keys s; masked keys hold exact zeros.

        Raises:
            RuntimeError: no forward call ran inside the block.
        """
        if not self.per_layer or not self.per_layer[0]:
            raise RuntimeError("capture_attention: no forward call was made inside the block")
        return torch.stack([calls[-1] for calls in self.per_layer])


# --8<-- [start:capture]
@contextmanager
def capture_attention(model: Transformer) -> Iterator[AttentionCapture]:
    """Record the attention probabilities softmax(q·kᵀ·scale + bias + mask) of every layer, per
    query head (with grouped-query attention each of the n_heads query heads has its own row,
    though groups share keys), for every forward call made inside the block.

    Attention then runs through the explicit (unfused) path, which gives the same outputs as
    the fused kernel up to float rounding; outside the block nothing changes (the capture costs
    nothing when off).

    Usage::

        with capture_attention(model) as cap:
            model(tokens)
        probs = cap.probs          # (L, B, H, T, S)
    """
    capture = AttentionCapture(len(model.layers))
    modules = [layer.attention for layer in model.layers]
    for module, calls in zip(modules, capture.per_layer):
        module.capture = calls
    try:
        yield capture
    finally:
        for module in modules:
            module.capture = None
# --8<-- [end:capture]


@torch.no_grad()
def residual_stream(model: Transformer, tokens: torch.Tensor,
                    pad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The residual stream h of every position before the first block and after each block
    (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits": the sum every
    layer reads from and writes into).

    Args:
        tokens: (B, T) int64 token ids.
        pad: (B,) left padding per row, as `Transformer.forward`.

    Returns:
        (L + 1, B, T, dim) float32: index 0 the embeddings (with absolute positions and
        embedding scale, as the first block sees them), index l the output of block l − 1.
    """
    states: list[torch.Tensor] = []
    hooks = [model.layers[0].register_forward_pre_hook(
        lambda module, args: states.append(args[0].detach().float()))]
    hooks += [layer.register_forward_hook(
        lambda module, args, out: states.append(out.detach().float())) for layer in model.layers]
    try:
        model(tokens, pad=pad, hidden=True)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(states)                                   # (L+1, B, T, D)
