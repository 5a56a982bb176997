"""The kernels' packed layout (kernels/csrc/blocks_impl.h explains it): weight rows in groups of 8,
interleaved `chunk` bytes at a time within each block, so one 32-byte load holds 4 weights of 8
rows; codes in 6 or 2 bits where they fit (`pack_six`, `pack_two`); block scales float16 where
exact, float32, or the K-quants' super-block form (`pack_scales`; with offsets, Q2_K's,
`pack_pair_scales`). The `unpack_*` functions are their inverses (the
tests' round trips, a tied embedding's rows, fusion's checks).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from torchllama.blocks.forms import Q4Blocks, ScaleFactors
from torchllama.kernels import huge_pages


def compact_scales(*scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The block scales (and offsets) as float16 when every one of them is exactly a float16
    (GGUF's Q4_0/Q4_1/Q8_0/Q5_0 store f16; Q4_K/Q6_K sub-block products usually are not),
    else float32: the decode step reads them once per token, and half the bytes is faster."""
    halves = tuple(t.half() for t in scales)
    if all(torch.equal(h.float(), t) for h, t in zip(halves, scales)):
        return tuple(h.contiguous() for h in halves)
    return tuple(t.float().contiguous() for t in scales)


def pack_rows(t: torch.Tensor, blocks: int, chunk: int,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(N, blocks·P) → (⌈N/8⌉, blocks, 8·P): each group of 8 rows' block b side by side, `chunk`
    elements of row 0, of row 1, …, of row 7, then the next chunk. Rows past N (to a multiple of
    8) are zeros (weights 0: their outputs are cut off). Codes: chunk 4 (P = 16 bytes of a Q4
    block, 32 codes of a Q8 block); scales (N, blocks): P = chunk = 1. Written straight onto
    transparent huge pages where the system has them (`kernels.huge_pages.empty`), or into
    `out` (a (⌈N/8⌉, blocks, 8·P) view whose last dimension is contiguous: a part of a larger
    block's bytes)."""
    N, width = t.shape
    if N % 8:
        t = torch.cat([t, t.new_zeros(8 - N % 8, width)])                   # (8G, width)
    P, G = width // blocks, t.shape[0] // 8
    if out is None:
        out = (huge_pages.empty((G, blocks, 8 * P), t.dtype) if t.device.type == "cpu" else
               t.new_empty((G, blocks, 8 * P)))    # streamed once a token: on huge pages
    word = _WORDS.get(chunk * t.element_size())
    if word is not None and t.is_contiguous():     # a chunk as one element: the same bytes
        v = t.view(word).reshape(G, 8, blocks, P // chunk)                  # (G, 8, b, P/c)
        out.view(word).view(G, blocks, P // chunk, 8).copy_(v.permute(0, 2, 3, 1))
        return out
    v = t.reshape(G, 8, blocks, P // chunk, chunk)                         # (G, 8, b, P/c, c)
    out.view(G, blocks, P // chunk, 8, chunk).copy_(v.permute(0, 2, 3, 1, 4))
    return out                                                             # (G, b, 8·P)


#: Integer types of 2, 4 and 8 bytes: `pack_rows` moves a chunk of that size as one element
#: (4× fewer, larger elements to permute: a 7B model's codes 4× faster, 3.5 of ~30 s of load).
_WORDS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def unpack_rows(packed: torch.Tensor, chunk: int, rows: torch.Tensor | int) -> torch.Tensor:
    """The inverse of `pack_rows`: rows 0..rows−1 (an int) or the given row indices (a (R,)
    int64 tensor, e.g. token ids of a tied embedding: only those rows are read) → (R, blocks·P)."""
    G, blocks, P8 = packed.shape
    P = P8 // 8
    v = packed.view(G, blocks, P // chunk, 8, chunk)                       # (G, b, P/c, 8, c)
    if isinstance(rows, int):
        out = v.permute(0, 3, 1, 2, 4).reshape(8 * G, blocks * P)         # (8G, b·P)
        return out[:rows]
    return v[rows // 8, :, :, rows % 8, :].reshape(len(rows), blocks * P)  # (R, b·P)


def pack_six(packed: torch.Tensor) -> torch.Tensor:
    """Packed int8 codes (G, blocks, 256), every one in [−32, 31], → their 6-bit form (G, blocks,
    192) int8 (blocks_impl.h): u = code + 32; bytes 0..127 the low 4 bits of chunk c's (c < 4)
    codes in the low nibbles and of chunk 4 + c's in the high nibbles; bytes 128..159 the top
    2 bits of chunks 0..3 (chunk c at bits 2c, 2c + 1 of each lane), 160..191 of chunks 4..7."""
    G, blocks, _ = packed.shape
    u = (packed + 32).view(torch.uint8).view(G, blocks, 2, 4, 32)       # (G, b, 2, 4, 32) 0..63
    nibbles = (u[:, :, 0] & 15) | (u[:, :, 1] << 4)                     # (G, b, 4, 32)
    top = u >> 4                                                        # (G, b, 2, 4, 32) 0..3
    top = top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6)
    return torch.cat([nibbles.reshape(G, blocks, 128), top.reshape(G, blocks, 64)],
                     dim=2).view(torch.int8)                            # (G, b, 192)


def pack_two(packed: torch.Tensor) -> torch.Tensor:
    """Packed int8 codes (G, blocks, 256), every one in [0, 3], → their 2-bit form (G, blocks, 64)
    int8 (blocks_impl.h `two_to_eight`): Q8 chunk c = 4h + 2k + e's codes at bits 4h + 2e of
    the 32 bytes at 32·k."""
    G, blocks, _ = packed.shape
    u = packed.view(torch.uint8).view(G, blocks, 2, 2, 2, 32)          # (G, b, h, k, e, lane)
    shifts = (4 * torch.arange(2, dtype=torch.uint8).view(2, 1, 1, 1) +
              2 * torch.arange(2, dtype=torch.uint8).view(1, 1, 2, 1))      # (h, 1, e, 1)
    out = (u << shifts).sum(dim=(2, 4), dtype=torch.uint8)              # (G, b, k, lane)
    return huge_pages.adopt(out.reshape(G, blocks, 64).view(torch.int8))


def unpack_two(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_two`: (…, 64) → (…, 256) int8 codes in [0, 3]."""
    p = packed.view(torch.uint8).unflatten(-1, (1, 2, 1, 32))           # (…, 1, k, 1, lane)
    shifts = (4 * torch.arange(2, dtype=torch.uint8).view(2, 1, 1, 1) +
              2 * torch.arange(2, dtype=torch.uint8).view(1, 1, 2, 1))
    return ((p >> shifts) & 3).to(torch.int8).flatten(-4)              # (…, 256)


def pack_rows_six(codes: torch.Tensor, blocks: int) -> torch.Tensor:
    """`pack_six(pack_rows(codes, blocks, 4))` of int8 codes (N, K): torchllama's op where the
    kernels are built (one pass, no temporaries: a 7B head is 131 M codes), else that."""
    from torchllama import kernels

    if kernels.available():                      # streamed once a token: on huge pages
        return huge_pages.adopt(torch.ops.torchllama.pack_six(codes))
    return huge_pages.adopt(pack_six(pack_rows(codes, blocks, 4)))


def unpack_six(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_six`: (…, 192) → (…, 256) int8 codes."""
    p = packed.view(torch.uint8)
    nibbles = p[..., :128].unflatten(-1, (4, 32))                          # (…, 4, 32)
    top = p[..., 128:].unflatten(-1, (2, 1, 32))                           # (…, 2, 1, 32)
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)
    high = (top >> shifts) & 3                                             # (…, 2, 4, 32)
    low = torch.stack([nibbles & 15, nibbles >> 4], dim=-3)                # (…, 2, 4, 32)
    codes = (low | (high << 4)).to(torch.int8) - 32                        # (…, 2, 4, 32)
    return codes.flatten(-3)                                               # (…, 256)


def _index_bit_swaps() -> tuple[tuple[np.uint32, np.uint32], ...]:
    """The delta swaps (mask, shift) that exchange bit positions p and q of a 32-bit word's
    bit indices, for (p, q) = (0, 2), (1, 3), (2, 4), (3, 4): together they move bit
    i = 16h + 4c + j to 8j + 4h + c (the index's five bits rotated right by two)."""
    out = []
    for p, q in ((0, 2), (1, 3), (2, 4), (3, 4)):
        mask = sum(1 << a for a in range(32) if (a >> p) & 1 and not (a >> q) & 1)
        out.append((np.uint32(mask), np.uint32((1 << q) - (1 << p))))
    return tuple(out)


_PLANE_SWAPS = _index_bit_swaps()


def _swap_index_bits(t: torch.Tensor, swaps) -> torch.Tensor:
    """(N, 4·n) uint8 → the same shape: each little-endian 32-bit word of a row with the delta
    swaps `swaps` applied in order (each exchanges two bits of every bit index)."""
    x = t.contiguous().numpy().view(np.uint32).copy()                     # (N, n) words
    for mask, shift in swaps:
        d = (x ^ (x >> shift)) & mask
        x ^= d ^ (d << shift)
    return torch.from_numpy(x.view(np.uint8)).view(t.shape[0], -1)


def fifth_bit_plane(high: torch.Tensor) -> torch.Tensor:
    """`Q4Blocks.high` (N, K/8) → (N, K/8) bytes in the plane's order (blocks_impl.h): per
    block of 32, byte j (j < 4) holds at bit c the fifth bit of weight 4c + j and at bit 4 + c
    that of weight 16 + 4c + j, c < 4 (the 4-bit codes' chunk c, low and high nibbles).

    A block's 4 bytes are one little-endian word whose bit i is weight i's fifth bit, so the
    plane is that word with bit 16h + 4c + j moved to 8j + 4h + c: four delta swaps of bit
    indices (Knuth, TAOCP 7.1.3), in place of expanding every bit to a byte."""
    return _swap_index_bits(high, _PLANE_SWAPS)


def high_of_plane(plane: torch.Tensor) -> torch.Tensor:
    """The inverse of `fifth_bit_plane`: (R, K/8) plane bytes → `Q4Blocks.high` (R, K/8) (each
    delta swap undoes itself, so the same swaps in reverse order)."""
    return _swap_index_bits(plane, _PLANE_SWAPS[::-1])


def pack_q4_codes(w: Q4Blocks) -> torch.Tensor:
    """Q4's codes packed: (G, K/32, 128) uint8, or with 5-bit codes (`Q4Blocks.high`) (G, K/32,
    160): each group block's 4-bit codes, then its plane of fifth bits (`fifth_bit_plane`, rows
    interleaved 4 bytes at a time like the codes, so lane 4r + j is row r's byte j)."""
    N, K = w.shape
    if w.high is None:
        return pack_rows(w.codes, K // 32, 4)                              # (G, K/32, 128)
    out = huge_pages.empty(((N + 7) // 8, K // 32, 160), torch.uint8)
    pack_rows(w.codes, K // 32, 4, out=out[..., :128])
    pack_rows(fifth_bit_plane(w.high), K // 32, 4, out=out[..., 128:])     # (G, K/32, 32)
    return out


def unpack_lut_indices(packed: torch.Tensor, rows: torch.Tensor | int) -> torch.Tensor:
    """Codes stored as 4-bit indices ((G, b, 128), `Q8Blocks.lut`'s form packed) → the rows'
    (R, K/2) uint8 indices in Q4's nibble order (`Q8Blocks.codes` with a table)."""
    return unpack_rows(packed.view(torch.uint8), 4, rows)


def unpack_codes(packed: torch.Tensor, rows: torch.Tensor | int) -> torch.Tensor:
    """`unpack_rows` of packed codes of any kind (Q4's (G, b, 128) uint8, Q8's (G, b, 256)
    int8 or their 6- or 2-bit forms (G, b, 192 | 64)): only the rows' groups are expanded. Q4's 5-bit
    form (G, b, 160): its 4-bit codes (`unpack_high` gives the fifth bits)."""
    if packed.shape[-1] == 160:
        return unpack_rows(packed[..., :128], 4, rows)
    if packed.shape[-1] not in (192, 64):
        return unpack_rows(packed, 4, rows)
    expand = unpack_six if packed.shape[-1] == 192 else unpack_two
    if isinstance(rows, int):
        return unpack_rows(expand(packed[:(rows + 7) // 8]), 4, rows)
    groups = expand(packed[rows // 8])                                      # (R, b, 256)
    return unpack_rows(groups, 4, 8 * torch.arange(len(rows)) + rows % 8)   # (R, K)


def unpack_high(packed: torch.Tensor, rows: torch.Tensor | int) -> Optional[torch.Tensor]:
    """The fifth bits (`Q4Blocks.high`) of packed Q4 codes' rows, or None for 4-bit codes."""
    if packed.shape[-1] != 160:
        return None
    return high_of_plane(unpack_rows(packed[..., 128:], 4, rows))


def _form(values: torch.Tensor, factors: Optional[ScaleFactors]) -> str | torch.dtype:
    return "super" if factors is not None else compact_scales(values)[0].dtype


def pack_scales(values: torch.Tensor, factors: Optional[ScaleFactors] = None,
                form: str | torch.dtype | None = None) -> torch.Tensor:
    """(N, nd) block scales in the kernels' packed form (kernels.h ScaleForm): the super-block
    form (G, nd/S, 16 + 8·S) where `factors` are given (each row group's super-block: the 8
    rows' float16 super-scales as 16 bytes, then the S sub-scales of the 8 rows side by side;
    uint8 for S = 8, int8 for S = 16), else (G, nd, 8) float16 where exact, else float32;
    `form` ("super" or a dtype, `_form`) overrides that choice."""
    form = _form(values, factors) if form is None else form
    if form != "super":
        return pack_rows(values.to(form).contiguous(), values.shape[1], 1)
    sup, sub = factors.super.contiguous(), factors.sub.contiguous()
    nu, S = sup.shape[1], sub.shape[1] // sup.shape[1]
    D = pack_rows(sup, nu, 1).view(sub.dtype)                                # (G, nu, 16)
    s = pack_rows(sub, nu * S, 1).view(D.shape[0], nu, 8 * S)                # (G, nu, 8·S)
    return torch.cat([D, s], dim=2)                                         # (G, nu, 16+8S)


def pack_pair_scales(d: ScaleFactors, m: ScaleFactors) -> torch.Tensor:
    """Scales d and offsets m of 16 sub-blocks a super-block, given as products (Q2_K: d·sc_j and
    (−dmin)·mn_j, sc_j, mn_j ≤ 15), in one buffer (kernels.h scale_pair_u4): (G, nd/16, 160)
    uint8, each row group's super-block the 8 rows' float16 D, their float16 M, then the 16
    sub-blocks' s | t << 4, 8 rows side by side."""
    nu = d.super.shape[1]
    D = pack_rows(d.super.contiguous(), nu, 1).view(torch.uint8)            # (G, nu, 16)
    M = pack_rows(m.super.contiguous(), nu, 1).view(torch.uint8)
    st = (d.sub | (m.sub << 4)).contiguous()                                # (N, nd) u8
    s = pack_rows(st, st.shape[1], 1).view(D.shape[0], nu, 128)             # (G, nu, 8·16)
    return torch.cat([D, M, s], dim=2)                                      # (G, nu, 160)


def is_pair_form(packed: torch.Tensor) -> bool:
    """Whether packed scales are `pack_pair_scales`' (scales and offsets in one buffer)."""
    return packed.dim() == 3 and packed.dtype == torch.uint8 and packed.shape[2] == 160


def unpack_pair_scales(packed: torch.Tensor, rows: torch.Tensor | int
                       ) -> tuple[torch.Tensor, ScaleFactors, torch.Tensor, ScaleFactors]:
    """The inverse of `pack_pair_scales`: rows 0..rows−1 or the (R,) row indices → (d, its
    factors, m, its factors), d and m (R, nd) float32."""
    idx = torch.arange(rows) if isinstance(rows, int) else rows            # (R,)
    G, nu, _ = packed.shape
    lane, at = idx % 8, torch.arange(len(idx))
    groups = packed[idx // 8]                                               # (R, nu, 160)
    D = groups[..., :16].contiguous().view(torch.float16)[at, :, lane]      # (R, nu)
    M = groups[..., 16:32].contiguous().view(torch.float16)[at, :, lane]
    st = groups[..., 32:].reshape(-1, nu, 16, 8)[at, :, :, lane].reshape(len(idx), -1)
    d = ScaleFactors(D.contiguous(), (st & 15).contiguous())
    m = ScaleFactors(M.contiguous(), (st >> 4).contiguous())
    return d.values(), d, m.values(), m


def unpack_scales(packed: torch.Tensor, rows: torch.Tensor | int,
                  d: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[ScaleFactors]]:
    """The inverse of `pack_scales` (and of Q4's m = c·d, a scalar c, given the rows' d):
    rows 0..rows−1 or the (R,) row indices → ((R, nd) float32 values, their `ScaleFactors` or
    None); of `pack_pair_scales`, the scales d. Only the rows' groups are read."""
    if packed.dim() == 0:                                                   # m = c·d
        return d * packed, None
    if packed.dtype in (torch.float32, torch.float16):
        return unpack_rows(packed, 1, rows).float(), None
    if is_pair_form(packed):
        return unpack_pair_scales(packed, rows)[:2]
    idx = torch.arange(rows) if isinstance(rows, int) else rows            # (R,)
    G, nu, W = packed.shape
    S, lane, at = (W - 16) // 8, idx % 8, torch.arange(len(idx))
    groups = packed[idx // 8]                                               # (R, nu, W)
    sup = groups[..., :16].contiguous().view(torch.float16)[at, :, lane]    # (R, nu)
    sub = groups[..., 16:].reshape(-1, nu, S, 8)[at, :, :, lane]            # (R, nu, S)
    factors = ScaleFactors(sup.contiguous(), sub.reshape(len(idx), nu * S).contiguous())
    return factors.values(), factors


#: Q4_0's offsets are m = −8·d: kept as this multiple of d (nothing stored per block).
_Q4_0_MULTIPLE = -8.0


def _q4_forms(w: "Q4Blocks") -> tuple:
    """The forms of a Q4 weight's packed d and m (`_form`, or "times_d" for m = c·d): m in d's
    form (the kernel's rule), both float32 where they would differ."""
    d = _form(w.d, w.d_factors)
    if w.m_factors is None and torch.equal(w.m, w.d * _Q4_0_MULTIPLE):
        return d, "times_d"
    m = _form(w.m, w.m_factors)
    return (d, m) if d == m else (torch.float32, torch.float32)


def pack_q4_scales(w: "Q4Blocks") -> list[torch.Tensor]:
    """Q4's [d, m] in the kernels' forms (`_q4_forms`, `pack_scales`); m = c·d as the float32
    scalar c (Q4_0: c = −8, nothing stored per block)."""
    d_form, m_form = _q4_forms(w)
    d = pack_scales(w.d, w.d_factors, d_form)
    if m_form == "times_d":
        return [d, torch.tensor(_Q4_0_MULTIPLE)]
    return [d, pack_scales(w.m, w.m_factors, m_form)]
