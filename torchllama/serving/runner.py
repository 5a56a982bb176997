"""One model forward of the engine, and the sampling of its logits.

    prefill   a chunk of one prompt in its cache row, at its own positions   ─▶ logits (1, V)
    decode    one token for each decoding row at once, each at its own
              position (−1: an idle row, which writes and attends nothing)   ─▶ logits (B, V)
    speculate one speculative round for the only decoding row
              (`torchllama.generation.speculative.SpeculativeDecoder.step`)  ─▶ its tokens
    sample    a row's next token from its logits (its grammar's mask, its sampling settings)

Nothing is shared between rows — no common cursor, no padding, no shifts — so a request computes
what it would alone, whatever else runs: with torchllama's kernels (batch-invariant products,
attention summed in slot order, chunked prefill giving the same bits as whole) the very same
bits, for every kind of cache (full, sliding-window rings, MLA's latents).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from torchllama.generation.sampling import sample
from torchllama.generation.speculative import SpeculativeDecoder
from torchllama.serving.request import _Row


class ModelRunner:
    """Runs the model for the engine (see the module docstring) and counts what it ran.

    Args:
        model: a `Transformer` (eval mode) with its caches allocated (`CacheRows`).
        pad_id: token fed to idle rows (nothing written, nothing attended).
        speculator: a `SpeculativeDecoder` over the model, or None.

    Attributes:
        steps: decode steps and speculative rounds run.
        prefills: prefill forward passes run (chunks).
        prefill_tokens: prompt tokens prefilled.
    """

    def __init__(self, model, pad_id: int = 0,
                 speculator: Optional[SpeculativeDecoder] = None):
        self.model, self.pad_id, self.speculator = model, pad_id, speculator
        self.device = model.device
        self.steps = 0
        self.prefills = 0
        self.prefill_tokens = 0

    def adapters(self, rows: list[int]):
        """The context of a forward whose batch row b uses LoRA adapter id rows[b] (−1: the
        base model; `transforms.multi_lora`); nothing without adapters."""
        adapter_set = getattr(self.model, "adapter_set", None)
        if adapter_set is None or not adapter_set.ids:
            return contextlib.nullcontext()
        return adapter_set.selecting(rows)

    def prefill(self, b: int, tokens: list[int], pos: int, adapter: int = -1,
                every: bool = False) -> torch.Tensor:
        """Prefill `tokens` of cache row b at positions pos.. (its slots), with adapter id
        `adapter` (−1: none). Returns the last token's logits (1, V), or with `every` each
        token's (n, V) (a prompt being scored)."""
        ids = torch.tensor([tokens], device=self.device)                        # (1, n)
        with self.adapters([adapter]):
            logits = self.model(ids, pos, last_only=not every, cache_rows=slice(b, b + 1))
        self.prefills += 1
        self.prefill_tokens += len(tokens)
        return logits[0] if every else logits[:, -1]                    # (n, V) or (1, V)

    def decode(self, tokens: list[int], pos: list[int],
               adapters: Optional[list[int]] = None) -> torch.Tensor:
        """One decode step of rows 0..B-1: row b feeds tokens[b] at position pos[b] (−1: idle)
        with adapter id adapters[b] (−1 or None: none). Returns the logits (B, V)."""
        with self.adapters(adapters or [-1] * len(tokens)):
            logits = self.model(torch.tensor(tokens, device=self.device)[:, None],  # (B, 1)
                                torch.tensor(pos, device=self.device),
                                cache_rows=slice(0, len(tokens)))[:, -1]         # (B, V)
        self.steps += 1
        return logits

    def speculate(self, b: int, row: _Row, left: int, adapter: int = -1):
        """One speculative round for row b: `SpeculativeDecoder.step` on its cache row, at
        most `left` tokens, the model with adapter id `adapter` (the drafter without). Returns
        its `Round` (tokens, logits, drafted, accepted)."""
        request = row.request
        context = request.prompt_ids + row.generated       # the last one is fed at row.pos
        with self.adapters([adapter]):
            step = self.speculator.step(context, request.sampling, row.generator,
                                        row.generated, left, cache_rows=slice(b, b + 1))
        self.steps += 1
        return step

    @staticmethod
    def sample(row: _Row, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The row's next token from its logits (1, V): masked by its grammar, if any, then
        drawn with its sampling settings and generator. Returns (token, the raw logits:
        what its log-probabilities are reported from, as OpenAI's and vLLM's default — a
        grammar's −inf would make the alternatives it refuses −inf, which JSON cannot
        carry). Raises what sampling raises (a request's own settings can fail, e.g. a tiny
        temperature: inf/NaN)."""
        request = row.request
        masked = logits
        if request.constraint is not None:           # −inf where the grammar says no
            masked = request.constraint.mask_logits(logits)
        token = sample(masked, request.sampling, row.generator,
                       [request.prompt_ids + row.generated], [row.generated])     # (1,)
        return int(token), logits
