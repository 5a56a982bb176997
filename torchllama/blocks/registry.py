"""The registry of GGUF block types on the kernels (`BlockType`, `TYPES`); the package docstring
(torchllama.blocks) tells how it is used. The family modules register their rows; importing
torchllama.blocks imports them all."""


from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import gguf
import numpy as np
import torch

from torchllama.blocks.forms import Q4Blocks, Q8Blocks, ScaleFactors

GGMLType = gguf.GGMLQuantizationType

#: Rows converted at a time by numpy: bounds the scratch arrays of a conversion (~16 MB at
#: K = 4096).
ROWS_PER_CHUNK = 4096


@dataclass(frozen=True)
class BlockType:
    """A GGUF block type the kernels take as stored.

    Attributes:
        ggml: its GGML type.
        block: one block as the file stores it (a numpy structured dtype; ggml-common.h).
        weights: weights per block (32, or 256 for a K-quant super-block).
        form: the kernel form it is converted into: "q4" (`Q4Blocks`, the `q4_rows` kernel) or
            "q8" (`Q8Blocks`, `q8_rows`).
        arrays: (rows, K) → the empty arrays of its conversion: the form's [codes, d(, m)],
            then the scale factors where the form keeps them (`ScaleFactors`).
        convert: (b (rows, blocks) of `block`, arrays of those rows) → None: the conversion in
            numpy (the readable form; the C++ twin gives the same bits).
        reference: (b (rows, blocks)) → (rows, K) float32: ggml's dequantization, in numpy.
        high: q4 form only: the codes have a fifth bit, `arrays` holding `Q4Blocks.high`
            (rows, K/8) uint8 right after d and m (Q5_1, Q5_K).
        lut: q8 form only: the 16 values every code is one of (`Q8Blocks.lut`; IQ4, Q3_K), or
            None.
        offsets: q8 form only: an offset m per scale too (`Q8Blocks.m`, Q2_K's −dmin·mn_j),
            `arrays` holding m right after d and its factors after d's.
    """

    ggml: GGMLType
    block: np.dtype
    weights: int
    form: str
    arrays: Callable[[int, int], list[np.ndarray]]
    convert: Callable[[np.ndarray, list[np.ndarray]], None]
    reference: Callable[[np.ndarray], np.ndarray]
    high: bool = False
    lut: tuple[int, ...] | None = None
    offsets: bool = False

    @property
    def name(self) -> str:
        return self.ggml.name

    @property
    def kernel(self) -> str:
        """The kernel table's entry its products run on (kernels/csrc/kernels.h)."""
        return f"{self.form}_rows"

    @property
    def storage(self) -> str:
        """How the kernels keep its codes, in words (`torchllama info`)."""
        if self.form == "q4":
            return ("5" if self.high else "4") + "-bit codes, a scale and an offset per block"
        if self.lut is not None:
            return "4-bit indices into a table of 16 values, a scale per block"
        if self.offsets:
            return "2-bit codes, a scale and an offset per 16 weights"
        return "int8 codes (in 6 bits where they fit), a scale per block"

    @property
    def n_scales(self) -> int:
        """How many of `arrays` after the codes are block scales (d, and m for Q4 and offsets)."""
        return 2 if self.form == "q4" or self.offsets else 1

    def weight(self, arrays: list[np.ndarray]) -> Union[Q4Blocks, Q8Blocks]:
        """`arrays`, filled, as the kernel form (sharing their memory): [codes, d(, m)], the
        fifth bits where `high`, then the factors (super, sub) of d (and m) where given."""
        t = [torch.from_numpy(x) for x in arrays]
        n = 1 + self.n_scales + self.high
        factors = [ScaleFactors(*t[i:i + 2]) for i in range(n, len(t), 2)]
        if self.form == "q4":
            factors += [None] * (2 - len(factors))
            return Q4Blocks(*t[:3], *factors, high=t[3] if self.high else None)
        lut = None if self.lut is None else torch.tensor(self.lut, dtype=torch.int8)
        if self.offsets:
            return Q8Blocks(t[0], t[1], factors[0], m=t[2], m_factors=factors[1])
        return Q8Blocks(*t[:2], *(factors or [None]), lut=lut)


#: GGML type → its row, filled by the family modules imported below.
TYPES: dict[GGMLType, BlockType] = {}


def register(block_type: BlockType) -> BlockType:
    """Add a row to `TYPES` (each family module calls it once per type)."""
    TYPES[block_type.ggml] = block_type
    return block_type


def block_type(ggml: GGMLType) -> BlockType | None:
    """The row of a GGML type, or None where the kernels do not take it as stored."""
    return TYPES.get(ggml)


def convert_blocks(b: np.ndarray, typ: GGMLType, out: list[np.ndarray]) -> int:
    """A matrix's blocks (b: (rows, blocks) of the type's `block` dtype, e.g. a view of the
    file mapping) converted into `out` (the type's `arrays` of that shape); returns the count of
    block scales (d, and m for Q4) that are not finite. On torchllama's kernels
    (`torch.ops.torchllama.gguf_blocks`, kernels/csrc/types/: one pass over the bytes) where
    they are available, else by numpy (`convert`, `ROWS_PER_CHUNK` rows at a time): the same
    bits."""
    from torchllama import kernels

    t = TYPES[typ]
    if kernels.available() and b.flags.c_contiguous and b.flags.writeable:
        raw = torch.from_numpy(b.view(np.uint8).reshape(b.shape[0], -1))     # (rows, bytes)
        return int(torch.ops.torchllama.gguf_blocks(raw, int(typ),
                                                    [torch.from_numpy(x) for x in out]))
    with np.errstate(all="ignore"):                  # a damaged scale: counted below
        for r in range(0, b.shape[0], ROWS_PER_CHUNK):
            t.convert(b[r:r + ROWS_PER_CHUNK], [x[r:r + ROWS_PER_CHUNK] for x in out])
    scales = out[1:1 + t.n_scales]                                          # d (and m)
    return sum(int(np.count_nonzero(~np.isfinite(x))) for x in scales)


def f16(b: np.ndarray, field: str) -> np.ndarray:
    """A float16 field of blocks as float32 (exact)."""
    return b[field].astype(np.float32)

