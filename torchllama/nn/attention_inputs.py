"""The attention inputs of one forward call: which slots the new tokens go to, which keys each
query may see, how each is rotated or biased — built once per call and kind of layer, in one
place, and shared by every attention layer of that kind.

Two ways a call addresses the KV cache (see `torchllama.nn.kv_cache`):

    for_slots  the B rows' T new tokens at slots start_pos..start_pos+T-1 (prefill, decode,
               chunked prefill of one row, left-padded batches)
    for_rows   one new token per row, row b's at its own slot row_pos[b] (the serving
               engine's batched decode step; −1 marks an idle row)

Masks follow the decoder's causal rule (query at slot q sees key slots s ≤ q that were written,
and only s > q − window in a local layer: Beltagy et al. 2020); rotations are RoPE's (Su et al.
2021, eq. 34) for each query's position; relative biases (ALiBi, T5) are added to the scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from torchllama.config import LayerSpec
from torchllama.nn.kv_cache import KVCache
from torchllama.nn.position import RotaryEmbedding


def slot_positions(device: torch.device, start_pos: int, end: int,
                   pad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Positions of the tokens in slots start_pos..end-1: the slots themselves (T,), or per row
    slot − pad[b] (B, T) int64 for left-padded rows (padding slots get position 0)."""
    q_slot = torch.arange(start_pos, end, device=device)             # (T,)
    if pad is None:
        return q_slot
    return (q_slot[None, :] - pad[:, None]).clamp(min=0)             # (B, T)


@dataclass
class AttentionInputs:
    """What one forward call gives every attention layer of one kind.

    Attributes:
        start_pos: slot of the first new token (tokens already in the KV cache).
        freqs_cis: RoPE rotations of the new tokens, (T, rot/2) complex64 or (B, T, rot/2) for
            rows with their own positions (left padding, for_rows); real (cos, sin) pairs under
            torch.compile; None without RoPE.
        mask: (T, S) or (B, 1, T, S) bool, True where query t may attend key s; None means causal
            among the T new tokens when nothing is cached before them, or no mask for a single
            token (it may see every cached slot).
        bias: (1|B, H, T, S) float added to the scores (ALiBi, T5), with −inf where the mask
            forbids (then `mask` is None); None without a position bias.
        cache_rows: KV cache rows of the B sequences (default 0..B-1).
        key_start: (B,) int64, where the keys the cache returns start in slot order (a
            sliding-window ring: its oldest slot; see `KVCache.key_start`), or None (in order).
        row_pos: rows at their own positions (one new token each; the serving engine's
            decode): row b's token goes to slot row_pos[b] (−1: an idle row, nothing written,
            nothing attended); start_pos is then the furthest row's slot. None: every row at
            start_pos.
        row_index: (B,) int64, with row_pos: the cache index each row writes at (−1: none).
    """

    start_pos: int
    freqs_cis: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    bias: Optional[torch.Tensor] = None
    cache_rows: Optional[slice] = None
    key_start: Optional[torch.Tensor] = None
    row_pos: Optional[list[int]] = None
    row_index: Optional[torch.Tensor] = None

    @property
    def n_keys(self) -> int:
        """S, the number of keys each query is scored against (the mask's or bias's last dim)."""
        return (self.mask if self.mask is not None else self.bias).shape[-1]

    def cache_update(self, cache: KVCache, xk: torch.Tensor, xv: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys xk (B, KV, T, ·) and values into `cache` and return the keys and
        values to attend over, (B, KV, S, ·) (`KVCache.update` or `update_rows`)."""
        if self.row_pos is None:
            return cache.update(self.start_pos, xk, xv, self.cache_rows)
        return cache.update_rows(self.row_pos, self.row_index, xk, xv, self.cache_rows,
                                 self.n_keys)

    @classmethod
    def for_slots(cls, spec: LayerSpec, rope: Optional[RotaryEmbedding],
                  cache: Optional[KVCache], position_bias: Optional[nn.Module],
                  device: torch.device, start_pos: int, end: int, B: int = 1,
                  pad: Optional[torch.Tensor] = None, cache_rows: Optional[slice] = None
                  ) -> AttentionInputs:
        """Inputs for the new tokens in slots start_pos..end-1 of B rows, for a layer of kind
        `spec` with these rotations, cache (the kind's first layer's; None: uncached) and
        relative position bias module (ALiBi/T5, or None). pad (B,): row b's first pad[b]
        slots hold left padding."""
        T = end - start_pos
        windowed = spec.window is not None and end > spec.window
        # Plain causal attention over every slot so far (Llama's decode and prefill): nothing
        # to build but the rotations of the new positions.
        if pad is None and not windowed and position_bias is None and \
                (T == 1 or start_pos == 0) and (cache is None or cache.in_slot_order):
            freqs_cis = rope.span(start_pos, end, device) if rope else None   # (T, rot/2)
            return cls(start_pos, freqs_cis, None, None, cache_rows)

        q_slot = torch.arange(start_pos, end, device=device)             # (T,)
        key_start = None
        if cache is not None:
            k_slot = cache.key_slots(start_pos, T, device)               # (S,)
            first = cache.key_start(start_pos, T)                        # ring: oldest index
            if first:
                key_start = torch.full((B,), first, dtype=torch.long, device=device)  # (B,)
        else:
            k_slot = torch.arange(start_pos, end, device=device)         # (S = T,)
        mask = _causal_mask(q_slot[:, None], k_slot[None, :], spec.window)   # (T, S)
        if pad is not None:
            mask = _skip_padding(mask, q_slot, k_slot, pad)               # (B, 1, T, S)
        freqs_cis = None
        if rope:
            freqs_cis = rope(slot_positions(device, start_pos, end, pad), end)  # (…, T, rot/2)
        bias = None
        if position_bias is not None:            # relative: pad-independent (q − k slots)
            bias = position_bias(q_slot, k_slot)                         # (1, H, T, S)
            bias = bias.masked_fill(~mask, float("-inf"))                # (1|B, H, T, S)
            mask = None
        return cls(start_pos, freqs_cis, mask, bias, cache_rows, key_start)

    @classmethod
    def for_rows(cls, spec: LayerSpec, rope: Optional[RotaryEmbedding], cache: KVCache,
                 position_bias: Optional[nn.Module], device: torch.device, row_pos: list[int],
                 cache_rows: Optional[slice] = None) -> AttentionInputs:
        """Inputs for one new token per row, row b's at slot row_pos[b] (−1: idle), for a layer
        of kind `spec` (arguments as `for_slots`): each row attends to its own slots up to its
        own, within the window of a local layer; an idle row attends nothing."""
        index, k_slot, key_start = cache.row_slots(row_pos, device)      # (B,), (B, S), (B,)
        q_slot = torch.tensor(row_pos, device=device)[:, None]           # (B, 1)
        mask = _causal_mask(q_slot, k_slot, spec.window)[:, None, None, :]  # (B, 1, 1, S)
        freqs_cis = None
        if rope:
            freqs_cis = rope(q_slot.clamp(min=0), max(row_pos) + 1)      # (B, 1, rot/2)
        bias = None
        if position_bias is not None:            # relative: row by row (q − k slots)
            bias = torch.cat([position_bias(q_slot[b], k_slot[b])        # (1, H, 1, S) each
                              for b in range(len(row_pos))])             # (B, H, 1, S)
            bias = bias.masked_fill(~mask, float("-inf"))
            mask = None
        return cls(max(row_pos), freqs_cis, mask, bias, cache_rows, key_start, row_pos, index)


# --8<-- [start:causal-mask]
def _causal_mask(q_slot: torch.Tensor, k_slot: torch.Tensor,
                 window: Optional[int]) -> torch.Tensor:
    """Query at slot q may attend key slot s iff s was written (s ≥ 0), s ≤ q, and, in a local
    layer, s > q − window. q_slot and k_slot broadcast against each other: (T, 1) and (1, S)
    → (T, S) bool, or (B, 1) and (B, S) → (B, S)."""
    mask = (k_slot >= 0) & (k_slot <= q_slot)
    if window is not None:
        mask &= k_slot > q_slot - window
    return mask
# --8<-- [end:causal-mask]


# --8<-- [start:padding-mask]
def _skip_padding(mask: torch.Tensor, q_slot: torch.Tensor, k_slot: torch.Tensor,
                  pad: torch.Tensor) -> torch.Tensor:
    """The (T, S) mask for left-padded rows, (B, 1, T, S): row b's first pad[b] slots hold
    padding and are never attended. A padding query would see nothing (an all −inf softmax row
    gives NaN): it sees itself; its output is never used, since no real query attends it."""
    real = k_slot[None, None, :] >= pad[:, None, None]                  # (B, 1, S)
    itself = k_slot[None, None, :] == q_slot[None, :, None]             # (1, T, S)
    return ((mask[None] & real) | itself)[:, None]                      # (B, 1, T, S)
# --8<-- [end:padding-mask]
