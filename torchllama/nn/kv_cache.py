"""The KV cache: keys and values of the tokens seen so far, one cache per attention layer.

A cache is addressed by *slots*: slot s of a row holds the keys and values of the token fed at
start_pos = s. Generation prefills slots 0..T-1 with the prompt and decodes one slot at a time;
left-padded batches keep all rows on one slot counter and mask each row's padding slots; the
serving engine keeps every row at its own position (a row is one request, from slot 0).

One layer's cache has this interface (attention layers and the attention inputs use it):

    update(start_pos, k, v, rows)     write the new tokens' keys/values, return those to attend to
    key_slots(start_pos, T)           the slot of each key `update` returns (for masks and biases)
    key_start(start_pos, T)           where the oldest of them is (a ring's), for slot order
    row_slots(pos) / update_rows(…)   the same for one token per row at its own position
    in_place_slots / record_write     where an op that writes the buffers itself writes, and
                                      noting afterwards that it did
    can_write_at(start_pos, row)      whether a write may start there (rewinding a window cache)
    reset_rows(rows)                  rows given to new sequences
    read_row / write_row              a copy of a row's slots, put back into any row (prefixes)
    zero(rows, start, end)            make slots finite (padding that was never written)

and `KVCaches` holds a model's caches, one per layer, with the row operations applied to every
layer (what Session, the serving engine and its prefix cache call).

Two kinds: `KVCache` keeps every slot (global attention); `SlidingWindowKVCache` keeps only the
last window (+ a margin) of slots in a ring buffer (local attention, Mistral / Gemma). MLA's
latent cache is a `KVCache` with one "head" holding the latent c_kv as keys and the decoupled
RoPE key as values.

What a slot holds (`kv_cache_dtype`, chosen where caches are allocated: `torchllama.load`,
`Transformer.setup_caches`, `Session`, the serving `Engine`, the CLI's --kv-cache-dtype):

    float32    the keys and values as computed (the exact reference path)
    float16    IEEE half (10 mantissa bits, max 65504), rounded to nearest even: half the bytes
    bfloat16   bfloat16 (7 mantissa bits, float32's range), rounded to nearest even
    q8_0       per token and head, blocks of 32 along the head dim: 32 int8 codes and one
               float32 scale, quantized exactly as torchllama's int8 activations are (d =
               max|x| / 127, q = rint(x · (1/d)), ties to even; `q8_0_quantize`): 36 bytes
               per 32 numbers, 0.56× float16. Each slot is quantized alone, so what a row's
               cache holds never depends on the other rows (batch invariance).
    auto       float16 for a model whose linear layers are weight-only quantized (the default
               path: a quantized GGUF on torchllama's kernels — its weights already round far
               more than a float16 key does), else the model's own dtype (a float32 model keeps
               the exact float32 cache).

A q8_0 cache stores each slot's head vector as one uint8 *record* of w + w/8 bytes: the w codes
(int8), then the w/32 scales (float32); `q8_0_dequantize` reads it back. Attention reads every
kind as stored: torchllama's kernel converts in registers (csrc/layers_impl.h), torch's
fallback converts to the query's dtype first (`stored_to_float`).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from torchllama.errors import ArgumentError

#: The choices of kv_cache_dtype (see the module docstring).
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "q8_0")
#: Numbers per q8_0 block (one scale each), as in GGUF's Q8_0 and our int8 activations.
Q8_BLOCK = 32
#: A cache's storage: a torch float dtype, or "q8_0" (uint8 records).
KVStorage = Union[torch.dtype, str]
_FLOAT_KV = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_kv_cache_dtype(name: str, what: str = "kv_cache_dtype") -> str:
    """`name` if it is one of KV_CACHE_DTYPES, else ArgumentError naming `what` (the argument,
    e.g. "--kv-cache-dtype") and listing the choices."""
    if name not in KV_CACHE_DTYPES:
        raise ArgumentError(f"{what} {name!r} is not supported; use one of "
                            f"{', '.join(KV_CACHE_DTYPES)}")
    return name


def kv_storage(name: str, model_dtype: torch.dtype, quantized: bool) -> KVStorage:
    """What a cache of kv_cache_dtype `name` stores for a model of `model_dtype` whose linear
    layers are weight-only `quantized` (or not): a torch dtype, or "q8_0". "auto": float16 when
    quantized, else model_dtype (module docstring). Raises ArgumentError for an unknown name."""
    check_kv_cache_dtype(name)
    if name == "auto":
        return torch.float16 if quantized else model_dtype
    return _FLOAT_KV.get(name, name)


def q8_0_record_bytes(width: int) -> int:
    """Bytes of one q8_0 record of `width` numbers (a multiple of 32): codes + float32 scales."""
    return width + width // Q8_BLOCK * 4


def q8_0_width(record_bytes: int) -> int:
    """The numbers a q8_0 record of `record_bytes` holds (inverse of `q8_0_record_bytes`)."""
    return record_bytes * Q8_BLOCK // (Q8_BLOCK + 4)


def q8_0_quantize(x: torch.Tensor) -> torch.Tensor:
    """x (..., w) float, w a multiple of 32 → (..., w + w/8) uint8 records: per block of 32,
    d = max|x| / 127, q = rint(x · (1/d)) (0 where d = 0; ties to even), as float32 operations
    in this order — the bits of csrc/blocks_impl.h quantize_block, which the kernels use."""
    *lead, w = x.shape
    blocks = x.float().reshape(*lead, w // Q8_BLOCK, Q8_BLOCK)          # (..., w/32, 32)
    d = blocks.abs().amax(-1) / 127.0                                     # (..., w/32) fp32
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))               # 1/d, or 0
    q = torch.round(blocks * inv[..., None]).to(torch.int8)               # (..., w/32, 32)
    return torch.cat([q.reshape(*lead, w).view(torch.uint8),
                      d.contiguous().view(torch.uint8)], dim=-1)          # (..., w + w/8)


def q8_0_dequantize(records: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., w + w/8) uint8 q8_0 records → (..., w) d · q in `dtype` (computed in float32)."""
    *lead, nbytes = records.shape
    w = q8_0_width(nbytes)
    q = records[..., :w].contiguous().view(torch.int8).float()            # (..., w)
    d = records[..., w:].contiguous().view(torch.float32)                 # (..., w/32)
    x = q.reshape(*lead, w // Q8_BLOCK, Q8_BLOCK) * d[..., None]          # (..., w/32, 32)
    return x.reshape(*lead, w).to(dtype)


def stored_to_float(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values as a cache returns them (float, or uint8 q8_0 records) in `dtype`."""
    if t.dtype == torch.uint8:
        return q8_0_dequantize(t, dtype)
    return t if t.dtype == dtype else t.to(dtype)


def _row_range(rows: Optional[slice], B: int) -> range:
    """The cache row indices of a `rows` slice over B sequences (default rows 0..B-1)."""
    first = 0 if rows is None else (rows.start or 0)
    return range(first, first + B)


class KVCache(nn.Module):
    """Preallocated keys and values of one attention layer, written at the slots of new tokens.
    `update` returns slots 0..start_pos+T-1 in order (`in_slot_order`), so plain causal
    attention needs no mask.

    Buffers k_cache (max_batch_size, n_heads, max_seq_len, k_dim) and v_cache (…, v_dim). They are
    allocated uninitialised (untouched pages cost no memory): `update` only returns slots
    [0, start_pos + T), which previous calls have written — except padding slots, or the slots
    past a row's own position when rows decode at their own positions, which a caller never
    wrote and must `zero`: masked slots still meet a zero attention weight, and 0 · NaN is NaN
    (torchllama's attention kernel skips them; torch's SDPA does not).

    Args:
        max_batch_size: rows.
        max_seq_len: slots per row.
        n_heads: key/value heads (n_kv_heads; 1 for MLA's latent).
        k_dim, v_dim: width of one head's key and value (MLA: kv_lora_rank and
            qk_rope_head_dim).
        dtype: what a slot stores (`kv_storage`): float32, float16, bfloat16, or "q8_0" (the
            buffers then hold uint8 records of k_dim + k_dim/8 and v_dim + v_dim/8 bytes).
        device: of the buffers.

    Raises:
        ArgumentError: "q8_0" with a k_dim or v_dim that is not a multiple of 32.
    """

    in_slot_order = True

    def __init__(self, max_batch_size: int, max_seq_len: int, n_heads: int, k_dim: int,
                 v_dim: int, dtype: KVStorage, device: torch.device | str | None = None):
        super().__init__()
        self._allocate(torch.empty, max_batch_size, n_heads, max_seq_len, k_dim, v_dim, dtype,
                       device)

    def _allocate(self, factory, rows: int, heads: int, slots: int, k_dim: int, v_dim: int,
                  dtype: KVStorage, device) -> None:
        """Register k_cache (rows, heads, slots, k_dim) and v_cache (…, v_dim), made by
        `factory` (torch.empty or torch.zeros), as non-persistent buffers; for "q8_0", uint8
        records (…, k_dim + k_dim/8) and (…, v_dim + v_dim/8)."""
        self.kv_dtype = dtype
        if dtype == "q8_0" and (k_dim % Q8_BLOCK or v_dim % Q8_BLOCK):
            raise ArgumentError(f"kv_cache_dtype 'q8_0' needs key and value widths that are "
                                f"multiples of {Q8_BLOCK}; this model's are {k_dim}, {v_dim}")
        for name, width in (("k_cache", k_dim), ("v_cache", v_dim)):
            if dtype == "q8_0":
                shape, storage = (rows, heads, slots, q8_0_record_bytes(width)), torch.uint8
            else:
                shape, storage = (rows, heads, slots, width), dtype
            self.register_buffer(name, factory(shape, dtype=storage, device=device),
                                 persistent=False)

    def store(self, x: torch.Tensor) -> torch.Tensor:
        """New keys or values (..., width) float as this cache stores them: q8_0 records, or x
        in the buffers' dtype (rounded to nearest even)."""
        return q8_0_quantize(x) if self.kv_dtype == "q8_0" else x.to(self.k_cache.dtype)

    @property
    def max_batch_size(self) -> int:
        return self.k_cache.shape[0]

    @property
    def max_seq_len(self) -> int:
        """Slots a row can address (the context this cache serves)."""
        return self.k_cache.shape[2]

    # --8<-- [start:kv-update]
    def update(self, start_pos: int, xk: torch.Tensor, xv: torch.Tensor,
               rows: Optional[slice] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write xk (B, KV, T, k_dim) and xv (B, KV, T, v_dim) at slots start_pos..start_pos+T-1
        and return all keys and values written so far as stored (`store`: the buffers' dtype,
        or q8_0 records), (B, KV, S, ·) with S = start_pos + T (views, no copy).

        Returning only the filled part means decode attends over S slots, not max_seq_len:
        decode is bound by memory bandwidth, so reading the empty rest would cost time.
        `rows` selects the cache rows of the B sequences (default: rows 0..B-1).
        """
        B, _, T, _ = xk.shape
        rows = rows if rows is not None else slice(0, B)
        end = start_pos + T
        self.k_cache[rows, :, start_pos:end] = self.store(xk)  # (B, KV, T, ·) → (…, S_max, ·)
        self.v_cache[rows, :, start_pos:end] = self.store(xv)
        return self.k_cache[rows, :, :end], self.v_cache[rows, :, :end]  # (B, KV, S, hd)
    # --8<-- [end:kv-update]

    def in_place_slots(self, start_pos: int, T: int) -> Optional[tuple[int, int]]:
        """For an op that writes T new keys and values into the buffers itself
        (`torch.ops.torchllama.decoder_layer`): (buffer index of the first one, number of
        indices to attend over) — what `update` would write and return — or None when the
        buffers cannot take them in place. A query: after the op wrote, call `record_write`."""
        return (start_pos, start_pos + T) if type(self) is KVCache else None

    def record_write(self, start_pos: int, T: int, rows: range) -> None:
        """Note that rows `rows` wrote slots start_pos..start_pos+T-1 in place (every slot is
        kept, so nothing to note here; a ring moves its furthest slot)."""

    def key_slots(self, start_pos: int, T: int, device: torch.device) -> torch.Tensor:
        """Slot of each key `update(start_pos, …T tokens)` returns: 0..start_pos+T-1, (S,)."""
        return torch.arange(start_pos + T, device=device)

    def key_start(self, start_pos: int, T: int) -> int:
        """Index of the oldest key `update` returns: attention visits the keys from there on,
        wrapping, so that it sums them in slot order (0: they are in slot order already)."""
        return 0

    # ---- rows at their own positions (one new token each) ---------------------------------

    def row_slots(self, pos: list[int], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """For B rows writing one token each at slot pos[b] (−1: the row is idle and writes
        nothing): (index each row writes at (B,) int64, −1 for idle rows; the slot held at each
        of the S indices `update_rows` returns, (B, S), negative where none; where each row's
        oldest key is, (B,) int64, or None when they are in slot order). Here the S = max(pos)
        + 1 first slots, the same for every row."""
        index = torch.tensor(pos, dtype=torch.long, device=device)                 # (B,)
        S = max(pos) + 1
        return index, torch.arange(S, device=device).expand(len(pos), S), None      # (B, S)

    def update_rows(self, pos: list[int], index: torch.Tensor, xk: torch.Tensor,
                    xv: torch.Tensor, rows: Optional[slice], n_keys: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write row b's key xk[b] (KV, 1, k_dim) and value of slot pos[b] at buffer index
        index[b] (skipped where −1; both from `row_slots`) and return the first n_keys indices of
        the B rows as stored, (B, KV, n_keys, ·)."""
        B = xk.shape[0]
        first = _row_range(rows, B)[0]
        live = (index >= 0).nonzero().flatten()                                     # (n,)
        self.k_cache[first + live, :, index[live]] = self.store(xk[live, :, 0])     # (n, KV, ·)
        self.v_cache[first + live, :, index[live]] = self.store(xv[live, :, 0])
        self.count_row_writes(pos, rows)
        rows = slice(first, first + B)
        return self.k_cache[rows, :, :n_keys], self.v_cache[rows, :, :n_keys]

    def count_row_writes(self, pos: list[int], rows: Optional[slice]) -> None:
        """Note that row b wrote slot pos[b] (−1: nothing), e.g. in place by an op."""

    # ---- rows given to new sequences -------------------------------------------------------

    def can_write_at(self, start_pos: int, row: Optional[int] = None) -> bool:
        """Every slot is kept, so a write may start anywhere (rewinding is free)."""
        return True

    def reset_rows(self, rows: slice) -> None:
        """The rows start new sequences from slot 0 (nothing to forget: every slot is
        rewritten before it is attended)."""

    def read_row(self, row: int, end: int) -> tuple:
        """A copy of what row `row` holds for slots [0, end), for `write_row` (a prefix cache
        entry): keys (n_heads, end, k_dim) and values."""
        return (self.k_cache[row, :, :end].clone(), self.v_cache[row, :, :end].clone())

    def write_row(self, row: int, state: tuple) -> None:
        """Put a `read_row` copy back into row `row` (any row): its slots [0, end) are as they
        were, and a write may start at any slot up to end."""
        k, v = state
        self.k_cache[row, :, :k.shape[1]] = k
        self.v_cache[row, :, :v.shape[1]] = v

    def read_slots(self, row: int, start: int, end: int) -> tuple:
        """A copy of slots [start, end) of row `row` (a prefix cache block): keys (n_heads,
        end − start, k_dim) and values, as stored."""
        return (self.k_cache[row, :, start:end].clone(), self.v_cache[row, :, start:end].clone())

    def write_slots(self, row: int, start: int, blocks: list) -> None:
        """Put `read_slots` copies, one after another, into row `row` from slot `start`."""
        k = torch.cat([b[0] for b in blocks], dim=1)            # (n_heads, slots, k_dim)
        v = torch.cat([b[1] for b in blocks], dim=1)
        self.k_cache[row, :, start:start + k.shape[1]] = k
        self.v_cache[row, :, start:start + v.shape[1]] = v

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
    the previous answer, or a prefix cache hit that ends before the prompt it was saved with)
    without losing the window the rewound queries need; `can_write_at` tells when a rewind goes
    further, and the caller must then start over from slot 0 (`reset_rows`). Each row keeps its
    own furthest slot (`high`), so rows at different positions are independent.

    Two ways to attend, chosen by `update`:
    - one new token (decode): write it, then attend over the whole ring in storage order
      (no copy); `key_slots` tells the mask which slot each ring index holds and `key_start`
      where the oldest is, so that attention visits the keys in slot order;
    - several tokens: attend over the ring as it was, rotated into slot order, *plus* the new
      keys (concatenated), then write the newest `capacity` of them.
    Either way a query sees its keys in slot order, so a prompt prefilled at once, in chunks or
    decoded token by token gives the same bits on torchllama's attention kernel. A ring index
    whose slot a rewind abandoned is seen as the slot `capacity` before it, which is outside
    every window as long as `can_write_at` held. Never-written indices hold zeros (the buffer
    is zero-initialised: always finite) and negative slots, so masks exclude them.

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
        self.high = [0] * max_batch_size   # per row: one past the furthest slot written

    @property
    def max_seq_len(self) -> int:
        return self.context

    def _ring_slots(self, end: int, device: torch.device) -> torch.Tensor:
        """Slot held at each ring index when `end` is one past the last slot written: the
        largest s < end with s ≡ index (mod capacity); negative = never written. (C,)"""
        C = self.capacity
        index = torch.arange(C, device=device)
        return end - 1 - (end - 1 - index) % C

    def _wrote(self, rows, end: int) -> None:
        """Rows `rows` wrote slots up to end − 1: each row's furthest slot moves on."""
        for b in rows:
            self.high[b] = max(self.high[b], end)

    def key_slots(self, start_pos: int, T: int, device: torch.device) -> torch.Tensor:
        """(C,) for one new token, else (C + T,): the ring's slots (rotated into slot order, see
        `update`), then the new ones."""
        if T == 1:
            return self._ring_slots(start_pos + 1, device)
        ring = self._ring_slots(start_pos, device).roll(-(start_pos % self.capacity))
        return torch.cat([ring, torch.arange(start_pos, start_pos + T, device=device)])

    def key_start(self, start_pos: int, T: int) -> int:
        """For one new token: the ring index of the oldest slot, (start_pos + 1) mod C; else 0
        (`update` returns the keys in slot order)."""
        return (start_pos + 1) % self.capacity if T == 1 else 0

    def row_slots(self, pos: list[int], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """As `KVCache.row_slots`, over the whole ring (S = capacity): row b writes at index
        pos[b] mod C and then holds `_ring_slots(pos[b] + 1)`, oldest at (pos[b] + 1) mod C."""
        C = self.capacity
        index = torch.tensor([p % C if p >= 0 else -1 for p in pos], dtype=torch.long,
                             device=device)                                        # (B,)
        slots = torch.stack([self._ring_slots(p + 1, device) if p >= 0 else
                             torch.full((C,), -1, dtype=torch.long, device=device)
                             for p in pos])                                        # (B, C)
        start = torch.tensor([(p + 1) % C if p >= 0 else 0 for p in pos], dtype=torch.long,
                             device=device)                                        # (B,)
        return index, slots, start

    def count_row_writes(self, pos: list[int], rows: Optional[slice]) -> None:
        for b, p in zip(_row_range(rows, len(pos)), pos):
            if p >= 0:
                self._wrote((b,), p + 1)

    def can_write_at(self, start_pos: int, row: Optional[int] = None) -> bool:
        """False when rewinding to start_pos would need slots already overwritten: a query at
        start_pos needs slots from start_pos − window + 1, which the ring holds while
        high − start_pos ≤ capacity − window + 1 (high of `row`, default: of every row)."""
        high = max(self.high) if row is None else self.high[row]
        return high - start_pos <= self.capacity - self.window + 1

    def reset_rows(self, rows: slice) -> None:
        """The rows start new sequences from slot 0: what they held is seen as never written
        (negative slots) from then on."""
        for b in range(*rows.indices(self.max_batch_size)):
            self.high[b] = 0

    def read_row(self, row: int, end: int) -> tuple:
        """A copy of row `row`'s ring after writing slots up to end − 1, with its `high`."""
        return (self.k_cache[row].clone(), self.v_cache[row].clone(), self.high[row])

    def write_row(self, row: int, state: tuple) -> None:
        k, v, high = state
        self.k_cache[row] = k
        self.v_cache[row] = v
        self.high[row] = high

    def read_slots(self, row: int, start: int, end: int) -> tuple:
        """Not for a ring: its slots are not kept (`KVCaches.sliding`)."""
        raise NotImplementedError("a sliding-window ring keeps no slot range: read_row")

    write_slots = read_slots

    def in_place_slots(self, start_pos: int, T: int) -> Optional[tuple[int, int]]:
        """(start_pos mod capacity, capacity) for one new token (then the whole ring is
        attended over in storage order, as `update` does), else None (see `KVCache`)."""
        if type(self) is not SlidingWindowKVCache or T != 1:
            return None
        return start_pos % self.capacity, self.capacity

    def record_write(self, start_pos: int, T: int, rows: range) -> None:
        self._wrote(rows, start_pos + T)

    def update(self, start_pos: int, xk: torch.Tensor, xv: torch.Tensor,
               rows: Optional[slice] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write xk (B, KV, T, k_dim), xv (B, KV, T, v_dim) at slots start_pos..start_pos+T-1
        (their ring indices) and return the keys and values to attend over as stored, in the
        order `key_slots` describes: the ring (B, KV, C, ·), or the ring before the write
        followed by the new ones, rounded as the ring stores them (B, KV, C + T, ·)."""
        B, _, T, _ = xk.shape
        self._wrote(_row_range(rows, B), start_pos + T)
        rows = rows if rows is not None else slice(0, B)
        C = self.capacity
        xk, xv = self.store(xk), self.store(xv)          # rounded as stored: read back the same
        if T == 1:
            self.k_cache[rows, :, start_pos % C] = xk[:, :, 0]
            self.v_cache[rows, :, start_pos % C] = xv[:, :, 0]
            return self.k_cache[rows], self.v_cache[rows]                 # (B, KV, C, ·)
        r = start_pos % C                       # the oldest slot's index: rotate it first
        keys = torch.cat([self.k_cache[rows, :, r:], self.k_cache[rows, :, :r], xk],
                         dim=2)                                           # (B, KV, C + T, ·)
        values = torch.cat([self.v_cache[rows, :, r:], self.v_cache[rows, :, :r], xv], dim=2)
        n = min(T, C)                                                     # the newest n slots
        index = torch.arange(start_pos + T - n, start_pos + T, device=xk.device) % C
        self.k_cache[rows, :, index] = xk[:, :, T - n:]
        self.v_cache[rows, :, index] = xv[:, :, T - n:]
        return keys, values

    def snapshot(self) -> tuple:
        return (*super().snapshot(), list(self.high))

    def restore(self, state: tuple) -> None:
        super().restore(state)
        self.high = list(state[2])

    def zero(self, rows: slice, start: int, end: int) -> None:
        """Nothing to do: the ring is zero-initialised and only ever holds written keys."""


class KVCaches:
    """The KV caches of a whole model, one per layer, and the operations on cache rows that a
    caller applies to every layer at once (a row is one sequence: Session uses row 0, the
    serving engine one row per request).

    Iterable and indexable like the tuple of per-layer caches it holds. A model's `caches` is a
    new KVCaches at every `setup_caches`, so a caller can tell by identity whether the caches
    it filled are still in place.

    Args:
        layers: the caches of layers 0..n_layers-1.
    """

    def __init__(self, layers: list[KVCache]):
        self.layers = tuple(layers)

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> KVCache:
        return self.layers[i]

    @property
    def shape(self) -> tuple[int, int]:
        """(max_batch_size, max_seq_len): rows, and slots a row can address."""
        return self.layers[0].max_batch_size, self.layers[0].max_seq_len

    @property
    def kv_dtype(self) -> KVStorage:
        """What a slot stores: a torch float dtype, or "q8_0" (see the module docstring)."""
        return self.layers[0].kv_dtype

    def can_write_at(self, start_pos: int, row: Optional[int] = None) -> bool:
        """Whether every layer can take a write starting at start_pos in row `row` (default: in
        every row): rewinding a sliding-window ring further than its margin cannot; then start
        over at 0 (`reset_rows`)."""
        return all(cache.can_write_at(start_pos, row) for cache in self.layers)

    def reset_rows(self, rows: slice) -> None:
        """The rows start new sequences from slot 0 (`KVCache.reset_rows`)."""
        for cache in self.layers:
            cache.reset_rows(rows)

    @property
    def sliding(self) -> bool:
        """Some layer keeps only a sliding window's ring (no slot ranges to read)."""
        return any(isinstance(cache, SlidingWindowKVCache) for cache in self.layers)

    def read_slots(self, row: int, start: int, end: int) -> list:
        """A copy of slots [start, end) of row `row` in every layer (a prefix cache block)."""
        return [cache.read_slots(row, start, end) for cache in self.layers]

    def write_slots(self, row: int, start: int, blocks: list) -> None:
        """Put `read_slots` copies (a list of them, one block after another) into row `row`
        from slot `start`, in every layer."""
        for i, cache in enumerate(self.layers):
            cache.write_slots(row, start, [block[i] for block in blocks])

    def read_row(self, row: int, end: int) -> list:
        """A copy of row `row`'s slots [0, end) in every layer (a prefix cache entry; a
        sliding-window layer's ring as it is), for `write_row`."""
        return [cache.read_row(row, end) for cache in self.layers]

    def write_row(self, row: int, state: list) -> None:
        """Put a `read_row` copy into row `row` (any row)."""
        for cache, layer_state in zip(self.layers, state):
            cache.write_row(row, layer_state)

    def zero(self, rows: slice, start: int, end: int) -> None:
        """Zero slots [start, end) of the given rows in every layer (`KVCache.zero`)."""
        for cache in self.layers:
            cache.zero(rows, start, end)
