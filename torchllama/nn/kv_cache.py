"""The KV cache: keys and values of the tokens seen so far, one cache per attention layer.

A cache is addressed by *slots*: slot s of a row holds the keys and values of the token fed at
start_pos = s. Generation prefills slots 0..T-1 with the prompt and decodes one slot at a time;
batched callers (left-padded batches, the serving engine) keep all rows on one shared slot
counter and mask each row's padding slots.

Callers (Session, generate_batch, the engine) use this interface and nothing else:

    update(start_pos, k, v, rows)  write the new tokens' keys/values, return those to attend to
    shift(d, end)                  move every row's slots [0, end) by d (the engine's re-packing)
    zero(rows, start, end)         make slots finite (padding that was never written)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class KVCache(nn.Module):
    """Preallocated keys and values of one attention layer, written at the slots of new tokens.

    Buffers k_cache (max_batch_size, n_heads, max_seq_len, k_dim) and v_cache (…, v_dim). They are
    allocated uninitialised (untouched pages cost no memory): `update` only returns slots
    [0, start_pos + T), which previous calls have written — except padding slots a caller never
    wrote, which it must `zero`: masked slots still meet a zero attention weight, and 0 · NaN is
    NaN.

    Args:
        max_batch_size: rows.
        max_seq_len: slots per row.
        n_heads: key/value heads (n_kv_heads).
        k_dim, v_dim: width of one head's key and value (head_dim).
        dtype, device: of the buffers.
    """

    def __init__(self, max_batch_size: int, max_seq_len: int, n_heads: int, k_dim: int,
                 v_dim: int, dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.register_buffer("k_cache", torch.empty(
            (max_batch_size, n_heads, max_seq_len, k_dim), dtype=dtype, device=device),
            persistent=False)
        self.register_buffer("v_cache", torch.empty(
            (max_batch_size, n_heads, max_seq_len, v_dim), dtype=dtype, device=device),
            persistent=False)

    @property
    def max_batch_size(self) -> int:
        return self.k_cache.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k_cache.shape[2]

    def update(self, start_pos: int, xk: torch.Tensor, xv: torch.Tensor,
               rows: Optional[slice] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write xk (B, KV, T, k_dim) and xv (B, KV, T, v_dim) at slots start_pos..start_pos+T-1
        and return all keys and values written so far, (B, KV, S, ·) with S = start_pos + T
        (views, no copy).

        Returning only the filled part means decode attends over S slots, not max_seq_len:
        decode is bound by memory bandwidth, so reading the empty rest would cost time.
        `rows` selects the cache rows of the B sequences (default: rows 0..B-1).
        """
        B, _, T, _ = xk.shape
        rows = rows if rows is not None else slice(0, B)
        end = start_pos + T
        self.k_cache[rows, :, start_pos:end] = xk  # (B, KV, T, hd) into (B, KV, S_max, hd)
        self.v_cache[rows, :, start_pos:end] = xv
        return self.k_cache[rows, :, :end], self.v_cache[rows, :, :end]  # (B, KV, S, hd)

    def shift(self, d: int, end: int) -> None:
        """Move the slots [0, end) of every row by d (right if d > 0, left if d < 0); slots
        uncovered on the left by a right shift are zeroed (they become padding)."""
        for buf in (self.k_cache, self.v_cache):
            if d > 0:
                buf[:, :, d:d + end] = buf[:, :, :end].clone()
                buf[:, :, :d] = 0
            elif d < 0:
                buf[:, :, :end + d] = buf[:, :, -d:end].clone()

    def zero(self, rows: slice, start: int, end: int) -> None:
        """Set slots [start, end) of `rows` to 0."""
        self.k_cache[rows, :, start:end] = 0
        self.v_cache[rows, :, start:end] = 0
