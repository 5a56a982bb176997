"""A matrix's blocks converted and packed a chunk of rows at a time, straight into the block
module's buffers.

Converting a whole matrix first (`BlockType.arrays` hold one byte a weight for a Q6_K matrix)
and packing it after holds both copies at once, beside the file's pages: a 7B model's output
projection (49k × 4096 Q6_K) was 430 MB above its packed size at the load's peak. The packed
layout (blocks.packing) keeps each group of 8 rows to itself, so rows 8·g… of the whole are
rows 8·(g − g0)… of a chunk that starts at row 8·g0: `pack_in_chunks` converts a few MB of rows,
packs them as `Q4Linear` / `Q8Linear` would pack the whole matrix, copies them into their
place in the module's buffers and reuses its arrays for the next chunk.

Where a packed form is chosen from the values (float16 scales where every one is exact, codes
in 6 or 2 bits where every one fits, m = c·d), a chunk's choice is the whole matrix's when
every chunk chooses alike (each rule holds for the whole exactly when it holds for every
chunk); where chunks choose differently it returns None, and the caller packs the whole matrix
at once. The buffers are then the same bits either way (tests/test_blocks.py).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from torchllama.blocks.linear import BlockLinear, Q4Linear, Q8Linear
from torchllama.blocks.registry import BlockType
from torchllama.kernels import huge_pages

#: Weights converted a chunk (~2 MB of int8 codes): the conversion's arrays stay in cache, and
#: the two in flight (a thread each) add little to the load's peak.
CHUNK_WEIGHTS = 1 << 21

#: read(part, first row, end row, arrays): rows [a, b) of part `part` converted into `arrays`
#: (its type's `arrays` of b − a rows).
Reader = Callable[[int, int, int, list], None]


def chunk_rows(K: int, weights: int = CHUNK_WEIGHTS) -> int:
    """Rows a chunk of a (·, K) matrix: whole groups of 8, about `weights` weights."""
    return max(8, weights // K // 8 * 8)


def pack_in_chunks(kind: BlockType, K: int, sizes: list[int], read: Reader,
                   rows: Optional[int] = None) -> Optional[list[BlockLinear]]:
    """The block module of the rows of consecutive parts (`sizes` rows each: a fusion group's
    matrices, or one matrix), packed a chunk at a time.

    Args:
        kind: the parts' block type (one for all).
        K: the row length (weights).
        sizes: rows of each part; each a multiple of 8 where there are several.
        read: converts rows of a part (`Reader`); it may raise (a damaged file).
        rows: rows a chunk (a multiple of 8; default `chunk_rows(K)`).

    Returns:
        [the module of all rows, each part's module over views of its buffers], or None where
        chunks chose different packed forms (then pack the whole matrix at once).
    """
    rows = rows or chunk_rows(K)
    if rows % 8 or (len(sizes) > 1 and any(n % 8 for n in sizes)):
        raise ValueError(f"chunks and parts of whole groups of 8 rows, got {rows}, {sizes}")
    G = (sum(sizes) + 7) // 8
    arrays = kind.arrays(rows, K)
    whole: list[Optional[torch.Tensor]] = []
    flags = []                                     # per part: Q8's `small` of all its chunks
    g0 = 0
    for part, n in enumerate(sizes):
        small = True
        for a in range(0, n, rows):
            b = min(a + rows, n)
            chunk = [x[:b - a] for x in arrays]
            read(part, a, b, chunk)
            with huge_pages.small_pages():             # scratch, reused: not zeroed each time
                packed = _pack(kind, chunk).packed()
            if not whole:
                whole = [huge_pages.empty((G,) + tuple(t.shape[1:]), t.dtype) if t.dim() == 3
                         else t for t in packed]
            if not _same_forms(whole, packed):
                return None
            g1 = g0 + packed[0].shape[0]
            for out, t in zip(whole, packed):
                if t.dim() == 3:
                    out[g0:g1].copy_(t)                # (G_chunk, ·, ·) into its place
            small = small and _small_flag(packed)
            g0 = g1
        flags.append(small)
    return _modules(kind, K, sizes, whole, flags)


def _module_class(kind: BlockType) -> type[BlockLinear]:
    """The block module of a type's kernel form."""
    return Q4Linear if kind.form == "q4" else Q8Linear


def _pack(kind: BlockType, arrays: list[np.ndarray]) -> BlockLinear:
    """The module `Q4Linear` / `Q8Linear` packs of converted rows (the same as the whole's rows)."""
    return _module_class(kind)(kind.weight(arrays))


def _small_flag(packed: list[torch.Tensor]) -> bool:
    """A Q8 chunk's `small` flag (a bool scalar), True for a table or a Q4 chunk."""
    last = packed[-1]
    return bool(last) if last.dtype == torch.bool else True


def _same_forms(whole: list[torch.Tensor], packed: list[torch.Tensor]) -> bool:
    """Whether a chunk's buffers have the forms of the first chunk's: the packed tensors' dtype
    and widths, Q4's m = c·d with the same c, Q8's table the same (a `small` flag may differ:
    the whole's is every chunk's)."""
    for w, t in zip(whole, packed):
        if w.dtype != t.dtype or w.dim() != t.dim() or w.shape[1:] != t.shape[1:]:
            return False
        if t.dim() < 3 and t.dtype != torch.bool and not torch.equal(w, t):
            return False
    return True


def _modules(kind: BlockType, K: int, sizes: list[int], whole: list[torch.Tensor],
             flags: list[bool]) -> list[BlockLinear]:
    """[the module of every row, the parts' modules over views of its buffers]."""
    cls = _module_class(kind)
    q8_flag = cls is Q8Linear and whole[-1].dtype == torch.bool

    def buffers(g0: int, g1: int, small: bool) -> list[torch.Tensor]:
        out = [t[g0:g1] if t.dim() == 3 else t for t in whole]
        if q8_flag:
            out[-1] = torch.tensor(small)
        return out

    modules = [cls.from_packed(sum(sizes), K, buffers(0, len(whole[0]), all(flags)))]
    start = 0
    for n, small in zip(sizes, flags):
        modules.append(cls.from_packed(n, K, buffers(start // 8, (start + n + 7) // 8, small)))
        start += n
    return modules
