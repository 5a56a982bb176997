"""Where each request's keys and values live: one row of the model's KV cache per request.

A request owns one cache row from slot 0, as it would alone: its prompt fills slots 0..P-1 and
its n-th generated token is written at slot P + n − 1. When a row is given to a new request it
is reset, and the longest cached prefix of its prompt (`torchllama.serving.prefix_cache`) is
copied in, so that prefilling starts where they differ; when a prompt's prefill completes, and
when its request ends (prompt and generated tokens), its row is offered to the prefix cache.

Slots never written hold whatever the memory held (NaN, possibly). A decode step attends over
the first `end` slots of the batch, masked past each row's own position, and torch's attention
multiplies masked values by 0 — 0 · NaN is NaN — so every row's slots up to `end` must be
finite: `make_finite` zeroes them, 256 slots ahead, so that this costs a call every 256 steps.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torchllama.serving.prefix_cache import BlockPrefixCache, PrefixCache


class CacheRows:
    """The model's cache rows and the prefix cache of one engine.

    Args:
        model: the `Transformer` whose caches these are.
        rows: cache rows (the engine's max_batch_size).
        context: slots per row.
        prefix_cache_bytes: memory for the prefix cache (0: none).
        kv_cache_dtype: what the cache stores (`Transformer.setup_caches`; None: the model's
            default).

    Attributes:
        prefix_cache: the `PrefixCache`, or None.
    """

    def __init__(self, model, rows: int, context: int, prefix_cache_bytes: int = 0,
                 kv_cache_dtype: Optional[str] = None):
        self.model, self.rows, self.context = model, rows, context
        self.kv_cache_dtype = kv_cache_dtype
        self.prefix_cache_bytes = prefix_cache_bytes
        self.prefix_cache: Optional[BlockPrefixCache | PrefixCache] = None   # (`allocate`)
        self._finite = [0] * rows                # per row: slots [0, n) hold finite numbers

    def allocate(self) -> None:
        """Allocate the model's KV cache: `rows` rows of `context` slots; and the prefix cache:
        by blocks, or by whole prompts where a layer keeps a sliding-window ring."""
        with torch.inference_mode(False):
            self.model.setup_caches(self.rows, self.context, self.kv_cache_dtype)
        if self.prefix_cache_bytes and self.prefix_cache is None:
            kind = PrefixCache if self.model.caches.sliding else BlockPrefixCache
            self.prefix_cache = kind(self.model, self.prefix_cache_bytes)

    def claim(self, b: int, prompt_ids: Sequence[int], salt: bytes = b"",
              reuse: bool = True) -> int:
        """Give row b to a new prompt: reset it, and (`reuse`) put the prompt's cached prefix
        in it (of the same `salt`: the adapter's name). Returns the prompt tokens already in
        the row (0 without a hit)."""
        self.model.caches.reset_rows(slice(b, b + 1))
        reused = 0
        if self.prefix_cache is not None and reuse:
            reused = self.prefix_cache.restore(prompt_ids, b, salt)
        self.written(b, reused)
        return reused

    def prefilled(self, b: int, prompt_ids: Sequence[int], salt: bytes = b"") -> None:
        """Row b holds the whole prompt now: offer it to the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.store(prompt_ids, b, salt)

    def finished(self, b: int, tokens: Sequence[int], salt: bytes = b"") -> None:
        """Row b's request ended, its slots 0..len(tokens)-1 holding `tokens` (the prompt and
        the generated tokens fed to the model): offer them to a block prefix cache (a
        whole-prompt cache keeps prompts only)."""
        if isinstance(self.prefix_cache, BlockPrefixCache) and tokens:
            self.prefix_cache.store(tokens, b, salt)

    def written(self, b: int, end: int) -> None:
        """Slots [0, end) of row b hold finite numbers (the row's tokens were written there)."""
        self._finite[b] = max(self._finite[b], end)

    def make_finite(self, rows: Sequence[int], end: int) -> None:
        """Make slots [0, end) of these cache rows finite (see the module docstring)."""
        for b in rows:
            if self._finite[b] < end:
                stop = min(max(end, self._finite[b] + 256), self.context)
                self.model.caches.zero(slice(b, b + 1), self._finite[b], stop)
                self._finite[b] = stop
