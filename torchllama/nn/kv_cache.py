"""The KV cache: keys and values of the tokens seen so far, one cache per attention layer.

A cache is addressed by *slots*: slot s of a row holds the keys and values of the token fed at
start_pos = s. Generation prefills slots 0..T-1 with the prompt and decodes one slot at a time;
batched callers (left-padded batches, the serving engine) keep all rows on one shared slot
counter and mask each row's padding slots.

Callers (Session, generate_batch, the engine) use this interface and nothing else:

    update(start_pos, k, v, rows)   write the new tokens' keys/values, return those to attend to
    key_slots(start_pos, T)         the slot of each key `update` returns (for masks and biases)
    can_write_at(start_pos)         whether a write may start there (rewinding a window cache)
    shift(d, end)                   move every row's slots [0, end) by d (the engine's re-packing)
    zero(rows, start, end)          make slots finite (padding that was never written)

Two kinds: `KVCache` keeps every slot (global attention); `SlidingWindowKVCache` keeps only the
last window (+ a margin) of slots in a ring buffer (local attention, Mistral / Gemma). MLA's
latent cache is a `KVCache` with one "head" holding the latent c_kv as keys and the decoupled
RoPE key as values.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class KVCache(nn.Module):
    """Preallocated keys and values of one attention layer, written at the slots of new tokens.
    `update` returns slots 0..start_pos+T-1 in order (`in_slot_order`), so plain causal
    attention needs no mask.

    Buffers k_cache (max_batch_size, n_heads, max_seq_len, k_dim) and v_cache (…, v_dim). They are
    allocated uninitialised (untouched pages cost no memory): `update` only returns slots
    [0, start_pos + T), which previous calls have written — except padding slots a caller never
    wrote, which it must `zero`: masked slots still meet a zero attention weight, and 0 · NaN is
    NaN.

    Args:
        max_batch_size: rows.
        max_seq_len: slots per row.
        n_heads: key/value heads (n_kv_heads; 1 for MLA's latent).
        k_dim, v_dim: width of one head's key and value (MLA: kv_lora_rank and
            qk_rope_head_dim).
        dtype, device: of the buffers.
    """

    in_slot_order = True

    def __init__(self, max_batch_size: int, max_seq_len: int, n_heads: int, k_dim: int,
                 v_dim: int, dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self._allocate(torch.empty, max_batch_size, n_heads, max_seq_len, k_dim, v_dim, dtype,
                       device)

    def _allocate(self, factory, rows: int, heads: int, slots: int, k_dim: int, v_dim: int,
                  dtype: torch.dtype, device) -> None:
        """Register k_cache (rows, heads, slots, k_dim) and v_cache (…, v_dim), made by
        `factory` (torch.empty or torch.zeros), as non-persistent buffers."""
        for name, width in (("k_cache", k_dim), ("v_cache", v_dim)):
            self.register_buffer(name, factory((rows, heads, slots, width), dtype=dtype,
                                               device=device), persistent=False)

    @property
    def max_batch_size(self) -> int:
        return self.k_cache.shape[0]

    @property
    def max_seq_len(self) -> int:
        """Slots a row can address (the context this cache serves)."""
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

    def write_slots(self, start_pos: int, T: int) -> Optional[tuple[int, int]]:
        """For an op that writes the T new keys and values into the buffers itself
        (`torch.ops.torchllama.decoder_layer`): (index of the first one, number of indices to attend
        over) — what `update` would write and return — or None when the buffers cannot take
        them in place. Counts the write, as `update` does."""
        return (start_pos, start_pos + T) if type(self) is KVCache else None

    def key_slots(self, start_pos: int, T: int, device: torch.device) -> torch.Tensor:
        """Slot of each key `update(start_pos, …T tokens)` returns: 0..start_pos+T-1, (S,)."""
        return torch.arange(start_pos + T, device=device)

    def key_start(self, start_pos: int, T: int) -> int:
        """Index of the oldest key `update` returns: attention visits the keys from there on,
        wrapping, so that it sums them in slot order (0: they are in slot order already)."""
        return 0

    def can_write_at(self, start_pos: int) -> bool:
        """Every slot is kept, so a write may start anywhere (rewinding is free)."""
        return True

    def shift(self, d: int, end: int) -> None:
        """Move the slots [0, end) of every row by d (right if d > 0, left if d < 0); slots
        uncovered on the left by a right shift are zeroed (they become padding)."""
        for buf in (self.k_cache, self.v_cache):
            if d > 0:
                buf[:, :, d:d + end] = buf[:, :, :end].clone()
                buf[:, :, :d] = 0
            elif d < 0:
                buf[:, :, :end + d] = buf[:, :, -d:end].clone()

    def snapshot(self) -> tuple:
        """A copy of the cache's state (buffers and bookkeeping) for `restore`."""
        return self.k_cache.clone(), self.v_cache.clone()

    def restore(self, state: tuple) -> None:
        """Put back a `snapshot` taken from this cache."""
        self.k_cache.copy_(state[0])
        self.v_cache.copy_(state[1])

    def zero(self, rows: slice, start: int, end: int) -> None:
        """Set slots [start, end) of `rows` to 0."""
        self.k_cache[rows, :, start:end] = 0
        self.v_cache[rows, :, start:end] = 0


class SlidingWindowKVCache(KVCache):
    """The keys and values of the last `capacity` slots only, in a ring buffer: slot s lives at
    index s mod capacity. For local attention layers, whose queries see only the last `window`
    tokens (Mistral, Gemma: Beltagy et al. 2020's sliding window), so memory is
    O(window) instead of O(context).

    capacity = window + margin: the margin lets a caller rewind (write again from a slot up to
    margin + 1 before the furthest slot written, e.g. a chat turn that re-tokenizes the end of
    the previous answer) without losing the window the rewound queries need; `can_write_at`
    tells when a rewind goes further, and the caller must then start over from slot 0.

    Two ways to attend, chosen by `update`:
    - appending one token (decode): write it, then attend over the whole ring in storage order
      (no copy); `key_slots` tells the mask which slot each ring index holds and `key_start`
      where the oldest is, so that attention visits the keys in slot order;
    - several tokens, or a rewind: attend over the ring as it was, rotated into slot order,
      *plus* the new keys (concatenated), then write the newest `capacity` of them.
    Either way a query sees its keys in slot order, so a prompt prefilled at once, in chunks or
    decoded token by token gives the same bits on torchllama's attention kernel.
    Never-written indices hold zeros (the buffer is zero-initialised) and negative slots, so masks
    exclude them.

    Args:
        window: tokens a query sees, itself included.
        margin: extra slots kept for rewinds.
        (others: as `KVCache`; max_seq_len is the context, the slots a row can address.)
    """

    in_slot_order = False

    def __init__(self, max_batch_size: int, max_seq_len: int, n_heads: int, k_dim: int,
                 v_dim: int, dtype: torch.dtype, device: torch.device | str | None = None, *,
                 window: int, margin: int = 64):
        capacity = min(window + margin, max_seq_len)
        nn.Module.__init__(self)
        self._allocate(torch.zeros, max_batch_size, n_heads, capacity, k_dim, v_dim, dtype,
                       device)
        self.window, self.capacity, self.context = window, capacity, max_seq_len
        self.high = 0                  # one past the furthest slot written (all rows)

    @property
    def max_seq_len(self) -> int:
        return self.context

    def _appends_one(self, start_pos: int, T: int) -> bool:
        return T == 1 and start_pos >= self.high

    def _ring_slots(self, end: int, device: torch.device) -> torch.Tensor:
        """Slot held at each ring index when `end` is one past the last slot written: the
        largest s < end with s ≡ index (mod capacity); negative = never written. (C,)"""
        C = self.capacity
        index = torch.arange(C, device=device)
        return end - 1 - (end - 1 - index) % C

    def key_slots(self, start_pos: int, T: int, device: torch.device) -> torch.Tensor:
        """(C,) when appending one token, else (C + T,): the ring's slots (rotated into slot
        order, see `update`), then the new ones."""
        if self._appends_one(start_pos, T):
            return self._ring_slots(start_pos + 1, device)
        ring = self._ring_slots(start_pos, device).roll(-(start_pos % self.capacity))
        return torch.cat([ring, torch.arange(start_pos, start_pos + T, device=device)])

    def key_start(self, start_pos: int, T: int) -> int:
        """When appending one token: the ring index of the oldest slot, (start_pos + 1) mod C;
        else 0 (`update` returns the keys in slot order)."""
        return (start_pos + 1) % self.capacity if self._appends_one(start_pos, T) else 0

    def can_write_at(self, start_pos: int) -> bool:
        """False when rewinding to start_pos would need slots already overwritten: a query at
        start_pos needs slots from start_pos − window + 1, which the ring holds while
        high − start_pos ≤ capacity − window + 1."""
        return self.high - start_pos <= self.capacity - self.window + 1

    def write_slots(self, start_pos: int, T: int) -> Optional[tuple[int, int]]:
        """(start_pos mod capacity, capacity) when appending one token (then the whole ring is
        attended over in storage order, as `update` does), else None (see `KVCache`)."""
        if type(self) is not SlidingWindowKVCache or not self._appends_one(start_pos, T):
            return None
        self.high = start_pos + 1
        return start_pos % self.capacity, self.capacity

    def update(self, start_pos: int, xk: torch.Tensor, xv: torch.Tensor,
               rows: Optional[slice] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write xk (B, KV, T, k_dim), xv (B, KV, T, v_dim) at slots start_pos..start_pos+T-1
        (their ring indices) and return the keys and values to attend over, in the order
        `key_slots` describes: the ring (B, KV, C, ·), or the ring before the write followed by
        the new ones (B, KV, C + T, ·)."""
        B, _, T, _ = xk.shape
        rows = rows if rows is not None else slice(0, B)
        C = self.capacity
        if self._appends_one(start_pos, T):
            self.k_cache[rows, :, start_pos % C] = xk[:, :, 0]
            self.v_cache[rows, :, start_pos % C] = xv[:, :, 0]
            self.high = start_pos + 1
            return self.k_cache[rows], self.v_cache[rows]                 # (B, KV, C, ·)
        r = start_pos % C                       # the oldest slot's index: rotate it first
        keys = torch.cat([self.k_cache[rows, :, r:], self.k_cache[rows, :, :r], xk],
                         dim=2)                                           # (B, KV, C + T, ·)
        values = torch.cat([self.v_cache[rows, :, r:], self.v_cache[rows, :, :r], xv], dim=2)
        n = min(T, C)                                                     # the newest n slots
        index = torch.arange(start_pos + T - n, start_pos + T, device=xk.device) % C
        self.k_cache[rows, :, index] = xk[:, :, T - n:]
        self.v_cache[rows, :, index] = xv[:, :, T - n:]
        self.high = max(self.high, start_pos + T)
        return keys, values

    def shift(self, d: int, end: int) -> None:
        """Move every row's slots by d: the ring rotates by d, so slot s + d sits where s + d
        mod capacity says (the contents of slots [0, d) after a right shift are padding and
        masked; they stay finite)."""
        for buf in (self.k_cache, self.v_cache):
            buf.copy_(torch.roll(buf, d, dims=2))
        self.high = end + d

    def snapshot(self) -> tuple:
        return (*super().snapshot(), self.high)

    def restore(self, state: tuple) -> None:
        super().restore(state)
        self.high = state[2]

    def zero(self, rows: slice, start: int, end: int) -> None:
        """Zero the ring indices of slots [start, end) still held (those ≥ high − capacity)."""
        start = max(start, self.high - self.capacity, 0)
        if end > start:
            index = torch.arange(start, end, device=self.k_cache.device) % self.capacity
            self.k_cache[rows, :, index] = 0
            self.v_cache[rows, :, index] = 0
