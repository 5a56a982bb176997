"""The two forward passes generation is made of, shared by `torchllama.generation.session` and
`torchllama.generation.speculative` (a module of its own so that neither imports the other for them):

    prefill           the prompt (or a speculative round's k + 1 positions) in one forward
    decode_one_token  one token at its cache position, through the compiled step if any
"""

from __future__ import annotations

import warnings

import torch


# --8<-- [start:prefill]
def prefill(model, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
    """Run the prompt through the model once, filling the KV cache from start_pos.

    Shapes: tokens (B, T) int64 → logits of the token after the last one, (B, V) float32.
    """
    return model(tokens, start_pos, last_only=True)[:, -1]             # (B, V)
# --8<-- [end:prefill]


# --8<-- [start:decode-one-token]
def decode_one_token(model, token: torch.Tensor, pos: int) -> torch.Tensor:
    """One decode step: feed the last sampled token at position pos.

    Shapes: token (B, 1) int64 → next-token logits (B, V) float32.
    Runs the step `compile_decode` compiled for this model, if any.
    """
    step = getattr(model, "compiled_decode", None)
    if step is not None:
        try:
            return step(token, pos)[:, -1]                              # (B, V)
        except Exception as e:                 # a compiler failure must not stop generation
            warnings.warn(f"the compiled decode step failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); decoding eagerly",
                          stacklevel=2)
            model.compiled_decode = None
    return model(token, pos)[:, -1]                                     # (B, V)
# --8<-- [end:decode-one-token]
