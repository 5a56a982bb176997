"""The IQ4 block types: 4-bit indices into a non-linear grid of 16 int8 values (ggml-common.h
kvalues_iq4nl, block_iq4_nl, block_iq4_xs; values: ggml-quants.c dequantize_row_iq4_nl /
_iq4_xs). Their C++ conversion: kernels/csrc/types/iq4.cpp.

    IQ4_NL  w = d·kv[i] per 32,              i ∈ [0, 15]
            → Q8 form, B = 32, lut kv: the indices i as stored, d
    IQ4_XS  w = (d·(ls_j − 32))·kv[i] per 32 of 256, i ∈ [0, 15], ls_j ∈ [0, 63]
            → Q8 form, B = 32, lut kv: the indices i as stored, d = d·(ls_j − 32), and its
              factors

Each 32 weights are 16 bytes as a Q4_0 block's: index j in the low nibble of byte j, index
j + 16 in its high nibble: the Q8 form's 4-bit indices (`Q8Blocks.lut`), the file's bytes.
"""

from __future__ import annotations

import numpy as np

from torchllama.blocks.legacy import nibbles
from torchllama.blocks.registry import BlockType, GGMLType, f16, register

#: ggml-common.h kvalues_iq4nl: the value of each 4-bit index.
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                   np.int8)

IQ4_NL_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", 16)])
IQ4_XS_BLOCK = np.dtype([("d", "<f2"), ("scales_h", "<u2"), ("scales_l", "u1", 4),
                         ("qs", "u1", 128)])


def iq4_nl_arrays(rows: int, K: int) -> list[np.ndarray]:
    """Q8 form with a table: [indices (rows, K/2) u8, d (rows, K/32) f32]."""
    return [np.empty((rows, K // 2), np.uint8), np.empty((rows, K // 32), np.float32)]


def iq4_xs_arrays(rows: int, K: int) -> list[np.ndarray]:
    """`iq4_nl_arrays`, then d's factors (super (rows, K/256) f16, ls_j − 32 (rows, K/32)
    i8)."""
    return iq4_nl_arrays(rows, K) + [np.empty((rows, K // 256), np.float16),
                                     np.empty((rows, K // 32), np.int8)]


# ---- IQ4_NL: one f16 scale per 32 --------------------------------------------------------------

def _convert_iq4_nl(b: np.ndarray, out: list[np.ndarray]) -> None:
    out[0].reshape(b.shape[0], b.shape[1], 16)[:] = b["qs"]           # the stored indices
    out[1][:] = b["d"]                                                   # f16 → f32, exact


def _reference_iq4_nl(b: np.ndarray) -> np.ndarray:
    """dequantize_row_iq4_nl: y[j] = d·kv[qs[j] & 15], y[j + 16] = d·kv[qs[j] >> 4]."""
    q = KVALUES[nibbles(b["qs"])].astype(np.float32)                     # (rows, nb, 32)
    return (f16(b, "d")[..., None] * q).reshape(b.shape[0], -1)


# ---- IQ4_XS: super-blocks of 256, a 6-bit scale per 32 ----------------------------------------

def _iq4_xs_scales(b: np.ndarray) -> np.ndarray:
    """(rows, nb) super-blocks → (rows, nb, 8) int8 ls_j − 32 ∈ [−32, 31]: ls_j's low 4 bits
    are nibble j % 2 of scales_l[j / 2], its high 2 bits bits 2j, 2j+1 of scales_h
    (dequantize_row_iq4_xs)."""
    s = b["scales_l"]                                                    # (rows, nb, 4)
    low = np.stack([s & 15, s >> 4], axis=-1).reshape(*b.shape, 8)      # j = 2·byte + nibble
    high = (b["scales_h"][..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    return (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)


def _iq4_xs_rows(b: np.ndarray, codes: np.ndarray, d: np.ndarray, d_super: np.ndarray,
                 sub: np.ndarray) -> None:
    """IQ4_XS super-blocks (rows, K/256) → their indices as stored and one scale
    d·(ls_j − 32) per 32 weights, and its factors d, ls_j − 32 (ggml-common.h block_iq4_xs):
    the 128 bytes of qs are eight IQ4_NL-ordered blocks of 16."""
    rows, nb = b.shape
    codes.reshape(rows, nb, 128)[:] = b["qs"]
    sc = _iq4_xs_scales(b)
    d_super[:], sub[:] = b["d"], sc.reshape(rows, -1)
    d[:] = (b["d"].astype(np.float32)[..., None] * sc.astype(np.float32)).reshape(rows, -1)


def _reference_iq4_xs(b: np.ndarray) -> np.ndarray:
    """dequantize_row_iq4_xs: for sub-block j, dl = d·(ls_j − 32), y[l] = dl·kv[qs[l] & 15],
    y[l + 16] = dl·kv[qs[l] >> 4]."""
    rows, nb = b.shape
    dl = f16(b, "d")[..., None] * _iq4_xs_scales(b).astype(np.float32)   # (rows, nb, 8)
    q = KVALUES[nibbles(b["qs"].reshape(rows, nb, 8, 16))].astype(np.float32)
    return (dl[..., None] * q).reshape(rows, -1)


LUT = tuple(int(v) for v in KVALUES)

IQ4_NL = register(BlockType(GGMLType.IQ4_NL, IQ4_NL_BLOCK, 32, "q8", iq4_nl_arrays,
                            _convert_iq4_nl, _reference_iq4_nl, lut=LUT))
IQ4_XS = register(BlockType(GGMLType.IQ4_XS, IQ4_XS_BLOCK, 256, "q8", iq4_xs_arrays,
                            lambda b, out: _iq4_xs_rows(b, *out), _reference_iq4_xs, lut=LUT))
