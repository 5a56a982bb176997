"""GGUF block types on torchllama's kernels: a registry, one row per type, one module per family.

A quantized GGUF matrix is kept in its file's blocks: the loader converts the blocks, as stored,
into the arrays of one of the kernel forms (`blocks.forms`: `Q4Blocks`, `Q8Blocks`), which the
block modules pack (`blocks.packing`) and run (`blocks.linear`: `Q4Linear` on the `q4_rows`
kernel, `Q8Linear` on `q8_rows`). Each type is one `BlockType` row, registered by its family's
module, which holds the type's file layout, its conversion and its reference dequantization:

    legacy.py     Q4_0, Q4_1, Q5_0, Q5_1, Q8_0   blocks of 32: one f16 scale (and offset) a block
    k_quants.py   Q2_K … Q6_K                    super-blocks of 256: an f16 scale, small sub-scales
    iq4.py        IQ4_NL, IQ4_XS                 4-bit indices into a 16-value grid, scaled

and the C++ twin of its conversion in kernels/csrc/types/<family>.cpp (a `BlockType` row of
types.h, run by the loader's `torch.ops.torchllama.gguf_blocks`). The loader
(`checkpoint.gguf`), the modules and `torchllama info` read this registry; nothing else names a
type. Adding a type whose values fit a kernel form: one section of a family module (its
`BlockType`), one C++ row converter, one `register` call each; the tests take every row.

Each row's conversion is exact: the kernel form's values are the file's, bit for bit (float32
products of an f16 and a small integer are exact), and `reference` — a plain numpy transcription
of ggml-quants.c's `dequantize_row_*` — is the oracle the tests hold both to (and hold to
`gguf.quants.dequantize`).
"""

from torchllama.blocks import iq4, k_quants, legacy  # noqa: F401  (each registers its types)
from torchllama.blocks.registry import TYPES, BlockType, block_type, convert_blocks

__all__ = ["TYPES", "BlockType", "block_type", "convert_blocks"]
