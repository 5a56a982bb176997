"""The K-quants: super-blocks of 256 weights, an f16 scale d (and min dmin) per super-block and
small integer sub-scales per 32 or 16 weights (ggml-common.h block_q4_K, block_q6_K; values:
ggml-quants.c dequantize_row_q4_K / _q6_K). Their C++ conversion: kernels/csrc/types/k_quants.cpp.

    Q4_K  w = (d·sc_j)·q − dmin·mn_j per 32,  q ∈ [0, 15], sc_j, mn_j ∈ [0, 63]
          → Q4 form: d = d·sc_j, m = −dmin·mn_j, and their factors (d, sc_j), (−dmin, mn_j)
    Q6_K  w = (d·sc_j)·(q − 32) per 16,       q ∈ [0, 63], sc_j ∈ [−128, 127]
          → Q8 form, B = 16: codes q − 32 (6 bits packed), d = d·sc_j, and its factors

The products of an f16 and a 6- or 8-bit integer are exact in float32: the kernels keep the
factors (`ScaleFactors`) and form the same scale themselves, in fewer bytes.
"""

from __future__ import annotations

import numpy as np

from torchllama.blocks.registry import BlockType, GGMLType, f16, register

Q4_K_BLOCK = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)])
Q6_K_BLOCK = np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")])


def q4_k_arrays(rows: int, K: int) -> list[np.ndarray]:
    """Q4 form [codes (rows, K/2) u8, d, m (rows, K/32) f32], then d's factors (super
    (rows, K/256) f16, sc_j (rows, K/32) u8) and m's (−dmin, mn_j)."""
    sup = lambda: np.empty((rows, K // 256), np.float16)                 # noqa: E731
    return [np.empty((rows, K // 2), np.uint8), np.empty((rows, K // 32), np.float32),
            np.empty((rows, K // 32), np.float32), sup(), np.empty((rows, K // 32), np.uint8),
            sup(), np.empty((rows, K // 32), np.uint8)]


def q6_k_arrays(rows: int, K: int) -> list[np.ndarray]:
    """Q8 form [codes (rows, K) i8, d (rows, K/16) f32], then d's factors (super (rows, K/256)
    f16, sc_j (rows, K/16) i8)."""
    return [np.empty((rows, K), np.int8), np.empty((rows, K // 16), np.float32),
            np.empty((rows, K // 256), np.float16), np.empty((rows, K // 16), np.int8)]


#: Byte masks repeated over a word: the nibble and bit-field operations below act on 8 (4)
#: bytes at once, each byte as it would alone (what a shift carries into a neighbour is masked).
_LOW4, _HIGH4, _LOW2 = (np.uint64(0x0101010101010101 * v) for v in (0x0F, 0xF0, 0x03))
_LOW6, _BITS45 = (np.uint32(0x01010101 * v) for v in (0x3F, 0x30))


def _words(b: np.ndarray, dtype, first: int, last: int) -> np.ndarray:
    """Bytes first..last-1 of every block of b (rows, blocks), as words of `dtype`: a view
    (rows, blocks, (last − first) / word size) when the block size allows it, else a copy."""
    raw = b.view(np.uint8).reshape(*b.shape, b.dtype.itemsize)[..., first:last]
    size = np.dtype(dtype).itemsize
    if b.dtype.itemsize % size or first % size:
        raw = np.ascontiguousarray(raw)
    return raw.view(dtype)


def _q4_k_rows(b: np.ndarray, codes: np.ndarray, d: np.ndarray, m: np.ndarray,
               d_super: np.ndarray, sc_out: np.ndarray, m_super: np.ndarray,
               mn_out: np.ndarray) -> None:
    """Q4_K super-blocks (rows, K/256) → Q4 blocks of 32 (ggml-common.h block_q4_K,
    ggml-quants.c dequantize_row_q4_K): w = (d·sc_j)·q − dmin·mn_j for sub-block j; the
    factors too (`ScaleFactors`: d and sc_j, −dmin and mn_j).

    Each 64 weights of a super-block are 32 bytes: weights 0-31 in their low nibbles,
    32-63 in their high nibbles; a Q4 block holds weights i and i + 16 in byte i. The eight
    6-bit sc_j, mn_j are packed in 12 bytes (`gguf.quants.Q4_K.get_scale_min`'s layout).
    """
    rows, nb = b.shape
    qs = _words(b, np.uint64, 16, 144).reshape(rows, nb, 4, 2, 2)   # (…, 64s, bytes 0-15 | 16-31)
    lo, hi = qs[..., 0, :], qs[..., 1, :]
    out = codes.view(np.uint64).reshape(rows, nb, 4, 2, 2)         # (…, sub-blocks 2j | 2j+1)
    np.bitwise_or(lo & _LOW4, (hi << 4) & _HIGH4, out=out[..., 0, :])    # weights 0-31
    np.bitwise_or((lo >> 4) & _LOW4, hi & _HIGH4, out=out[..., 1, :])    # weights 32-63
    s = _words(b, np.uint32, 4, 16)                               # (rows, K/256, 3): 12 bytes
    sc, mn = np.empty((2, rows, nb, 2), np.uint32)
    sc[..., 0], mn[..., 0] = s[..., 0] & _LOW6, s[..., 1] & _LOW6          # j = 0-3
    sc[..., 1] = (s[..., 2] & _LOW4.astype(np.uint32)) | ((s[..., 0] >> 2) & _BITS45)  # 4-7
    mn[..., 1] = ((s[..., 2] >> 4) & _LOW4.astype(np.uint32)) | ((s[..., 1] >> 2) & _BITS45)
    sc_out[:], mn_out[:] = sc.view(np.uint8).reshape(rows, -1), mn.view(np.uint8).reshape(rows, -1)
    d_super[:], m_super[:] = b["d"], -b["dmin"]                            # f16, exact
    sc, mn = (x.view(np.uint8).astype(np.float32) for x in (sc, mn))       # (rows, K/256, 8)
    d[:] = (b["d"].astype(np.float32)[..., None] * sc).reshape(rows, -1)
    m[:] = -(b["dmin"].astype(np.float32)[..., None] * mn).reshape(rows, -1)


def _q6_k_rows(b: np.ndarray, codes: np.ndarray, d: np.ndarray, d_super: np.ndarray,
               sc: np.ndarray) -> None:
    """Q6_K super-blocks (rows, K/256) → int8 codes q − 32 and one scale d·sc_j per 16
    weights, and its factors d, sc_j (ggml-common.h block_q6_K, ggml-quants.c
    dequantize_row_q6_K): each 128 weights
    take 64 bytes of low nibbles (ql) and 32 of 2-bit high parts (qh); weight l + 32·k of
    the 128 (l < 32) is ql[l + 32·(k % 2)] (low nibble for k < 2, high for k ≥ 2) with bits
    2k, 2k+1 of qh[l] above it."""
    rows, nb = b.shape
    ql = _words(b, np.uint64, 0, 128).reshape(rows, nb, 2, 2, 4)   # (…, 128s, l | l+32, 4)
    qh = _words(b, np.uint64, 128, 192).reshape(rows, nb, 2, 4)    # (…, 128s, 4 words of l)
    out = codes.view(np.uint64).reshape(rows, nb, 2, 4, 4)         # (…, 128s, k, 4 words)
    for k in range(4):
        low = ql[..., k % 2, :] & _LOW4 if k < 2 else (ql[..., k % 2, :] >> 4) & _LOW4
        np.bitwise_or(low, ((qh >> (2 * k)) & _LOW2) << 4, out=out[..., k, :])  # q ∈ [0, 63]
    codes -= 32                                                            # q − 32, int8
    d_super[:], sc[:] = b["d"], b["scales"].reshape(rows, -1)
    d[:] = (b["d"].astype(np.float32)[..., None] * b["scales"].astype(np.float32)
            ).reshape(rows, -1)                                            # (rows, K/16)


def _reference_q4_k(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q4_K: per 64 weights j = 2c, 2c + 1: y = (d·sc_j)·(q & 15) − dmin·mn_j,
    then (d·sc_{j+1})·(q >> 4) − dmin·mn_{j+1}."""
    rows, nb = b.shape
    arrays = q4_k_arrays(rows, nb * 256)
    _q4_k_rows(b, *arrays)                              # the sub-scales sc_j, mn_j (as stored)
    sc = arrays[4].reshape(rows, nb, 8).astype(np.float32)
    mn = arrays[6].reshape(rows, nb, 8).astype(np.float32)
    d1 = f16(b, "d")[..., None] * sc                                     # (rows, nb, 8)
    m1 = f16(b, "dmin")[..., None] * mn
    qs = b["qs"].reshape(rows, nb, 4, 32)                                # 64 weights a row
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, nb, 8, 32)    # sub-block j
    return (d1[..., None] * q.astype(np.float32) - m1[..., None]).reshape(rows, -1)


def _reference_q6_k(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q6_K: weight l + 32·k of each 128 (l < 32) is y = (d·sc)·(q − 32), q the
    low or high nibble of ql[l + 32·(k % 2)] with bits 2k, 2k+1 of qh[l] above it, sc the
    scale of its 16."""
    rows, nb = b.shape
    ql = b["ql"].reshape(rows, nb, 2, 2, 32)                             # (…, 128s, k % 2, l)
    qh = b["qh"].reshape(rows, nb, 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=3)                     # (…, 128s, k, l)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3      # (…, 128s, k, l)
    q = (low | (high << 4)).astype(np.float32) - 32                      # (rows, nb, 2, 4, 32)
    sc = b["scales"].astype(np.float32).reshape(rows, nb, 16)            # per 16 weights
    d = (f16(b, "d")[..., None] * sc).reshape(rows, nb, 2, 4, 2, 1)      # (…, 128s, k, half)
    return (d * q.reshape(rows, nb, 2, 4, 2, 16)).reshape(rows, -1)


Q4_K = register(BlockType(GGMLType.Q4_K, Q4_K_BLOCK, 256, "q4", q4_k_arrays,
                          lambda b, out: _q4_k_rows(b, *out), _reference_q4_k))
Q6_K = register(BlockType(GGMLType.Q6_K, Q6_K_BLOCK, 256, "q8", q6_k_arrays,
                          lambda b, out: _q6_k_rows(b, *out), _reference_q6_k))
