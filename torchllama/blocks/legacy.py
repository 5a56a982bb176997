"""The legacy block types: 32 weights a block, one float16 scale d (and offset m) a block
(ggml-common.h block_q4_0, block_q4_1, block_q5_0, block_q5_1, block_q8_0; values:
ggml-quants.c dequantize_row_*). Their C++ conversion: kernels/csrc/types/legacy.cpp.

    Q4_0  w = d·(q − 8)     q ∈ [0, 15]  → Q4 form: d, m = −8·d (nothing stored per block)
    Q4_1  w = d·q + m       q ∈ [0, 15]  → Q4 form: d, m
    Q5_0  w = d·(q − 16)    q ∈ [0, 31]  → Q8 form, B = 32: codes q − 16 (6 bits packed)
    Q5_1  w = d·q + m       q ∈ [0, 31]  → Q4 form with fifth bits (`high`): d, m
    Q8_0  w = d·q           q ∈ [−128, 127] → Q8 form, B = 32

A 4-bit block's 16 bytes hold weight j in the low nibble of byte j and weight j + 16 in its high
nibble; Q5_0 and Q5_1 add the fifth bit of weight j as bit j of a 32-bit qh.
"""

from __future__ import annotations

import numpy as np

from torchllama.blocks.registry import BlockType, GGMLType, f16, register

Q4_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", 16)])
Q4_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])
Q5_0_BLOCK = np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)])
Q5_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)])
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", 32)])


def q4_arrays(rows: int, K: int) -> list[np.ndarray]:
    """The Q4 form's [codes (rows, K/2) uint8, d, m (rows, K/32) float32]."""
    return [np.empty((rows, K // 2), np.uint8), np.empty((rows, K // 32), np.float32),
            np.empty((rows, K // 32), np.float32)]


def q5_arrays(rows: int, K: int) -> list[np.ndarray]:
    """The Q4 form with fifth bits: [codes (rows, K/2) uint8, d, m (rows, K/32) float32, high
    (rows, K/8) uint8]."""
    return q4_arrays(rows, K) + [np.empty((rows, K // 8), np.uint8)]


def q8_arrays(rows: int, K: int) -> list[np.ndarray]:
    """The Q8 form's [codes (rows, K) int8, d (rows, K/32) float32]."""
    return [np.empty((rows, K), np.int8), np.empty((rows, K // 32), np.float32)]


def nibbles(qs: np.ndarray) -> np.ndarray:
    """(…, 16) bytes → (…, 32) uint8 codes: the low nibbles (weights 0-15), then the high."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(…,) uint32 → (…, 32) uint8: bit j of each, weight j's fifth bit."""
    return ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


# ---- Q4_0 and Q4_1: the stored bytes are the Q4 form's codes --------------------------------

def _convert_q4_0(b: np.ndarray, out: list[np.ndarray]) -> None:
    out[0].reshape(b.shape[0], b.shape[1], -1)[:] = b["qs"]             # the stored bytes
    out[1][:] = b["d"]                                                   # f16 → f32, exact
    np.multiply(out[1], np.float32(-8), out=out[2])                       # w = d·q − 8·d


def _convert_q4_1(b: np.ndarray, out: list[np.ndarray]) -> None:
    out[0].reshape(b.shape[0], b.shape[1], -1)[:] = b["qs"]
    out[1][:], out[2][:] = b["d"], b["m"]                                 # w = d·q + m


def _reference_q4_0(b: np.ndarray) -> np.ndarray:
    q = nibbles(b["qs"]).astype(np.int8) - np.int8(8)                    # (rows, nb, 32)
    return (q.astype(np.float32) * f16(b, "d")[..., None]).reshape(b.shape[0], -1)


def _reference_q4_1(b: np.ndarray) -> np.ndarray:
    q = nibbles(b["qs"]).astype(np.float32)
    return (q * f16(b, "d")[..., None] + f16(b, "m")[..., None]).reshape(b.shape[0], -1)


# ---- Q5_0: five-bit codes as int8 q − 16 ------------------------------------------------------

def _q5_0_codes(b: np.ndarray) -> np.ndarray:
    """(rows, nb) blocks → (rows, nb, 32) int8 codes q − 16."""
    q = nibbles(b["qs"]) | (_fifth_bits(b["qh"]) << 4)                   # (rows, nb, 32) 0..31
    return q.astype(np.int8) - np.int8(16)


def _convert_q5_0(b: np.ndarray, out: list[np.ndarray]) -> None:
    out[0].reshape(b.shape[0], b.shape[1], 32)[:] = _q5_0_codes(b)
    out[1][:] = b["d"]


def _reference_q5_0(b: np.ndarray) -> np.ndarray:
    q = _q5_0_codes(b).astype(np.float32)
    return (q * f16(b, "d")[..., None]).reshape(b.shape[0], -1)


# ---- Q5_1: the stored bytes are the Q4 form's codes and fifth bits ---------------------------

def _convert_q5_1(b: np.ndarray, out: list[np.ndarray]) -> None:
    """Q4 form with `high`: the 16 qs bytes are the codes' low 4 bits, the 4 qh bytes (bit j
    of the little-endian word: weight j's fifth bit) the form's high bits, both as stored."""
    out[0].reshape(b.shape[0], b.shape[1], -1)[:] = b["qs"]
    out[1][:], out[2][:] = b["d"], b["m"]                                 # w = d·q + m
    out[3].view("<u4")[:] = b["qh"]


def _reference_q5_1(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q5_1: y = d·q + m, q = the nibble with bit j of qh above it."""
    q = (nibbles(b["qs"]) | (_fifth_bits(b["qh"]) << 4)).astype(np.float32)
    return (q * f16(b, "d")[..., None] + f16(b, "m")[..., None]).reshape(b.shape[0], -1)


# ---- Q8_0: the stored int8 codes --------------------------------------------------------------

def _convert_q8_0(b: np.ndarray, out: list[np.ndarray]) -> None:
    out[0].reshape(b.shape[0], b.shape[1], 32)[:] = b["qs"]
    out[1][:] = b["d"]


def _reference_q8_0(b: np.ndarray) -> np.ndarray:
    return (b["qs"].astype(np.float32) * f16(b, "d")[..., None]).reshape(b.shape[0], -1)


Q4_0 = register(BlockType(GGMLType.Q4_0, Q4_0_BLOCK, 32, "q4", q4_arrays, _convert_q4_0,
                          _reference_q4_0))
Q4_1 = register(BlockType(GGMLType.Q4_1, Q4_1_BLOCK, 32, "q4", q4_arrays, _convert_q4_1,
                          _reference_q4_1))
Q5_0 = register(BlockType(GGMLType.Q5_0, Q5_0_BLOCK, 32, "q8", q8_arrays, _convert_q5_0,
                          _reference_q5_0))
Q5_1 = register(BlockType(GGMLType.Q5_1, Q5_1_BLOCK, 32, "q4", q5_arrays, _convert_q5_1,
                          _reference_q5_1, high=True))
Q8_0 = register(BlockType(GGMLType.Q8_0, Q8_0_BLOCK, 32, "q8", q8_arrays, _convert_q8_0,
                          _reference_q8_0))
