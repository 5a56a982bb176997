"""The K-quants: super-blocks of 256 weights, an f16 scale d (and min dmin) per super-block and
small integer sub-scales per 32 or 16 weights (ggml-common.h block_q2_K, block_q3_K, block_q4_K,
block_q5_K, block_q6_K; values: ggml-quants.c dequantize_row_q2_K / _q3_K / _q4_K / _q5_K /
_q6_K). Their C++ conversion: kernels/csrc/types/k_quants.cpp.

    Q2_K  w = (d·sc_j)·q − dmin·mn_j per 16,   q ∈ [0, 3], sc_j, mn_j ∈ [0, 15]
          → Q8 form with offsets, B = 16: codes q (2 bits packed), d = d·sc_j, m = −dmin·mn_j,
            and their factors (d, sc_j), (−dmin, mn_j)
    Q3_K  w = (d·(sc_j − 32))·q per 16,        q ∈ [−4, 3], sc_j ∈ [0, 63]
          → Q8 form, B = 16, lut [−4, 3]: indices q + 4, d = d·(sc_j − 32), and its factors
    Q4_K  w = (d·sc_j)·q − dmin·mn_j per 32,  q ∈ [0, 15], sc_j, mn_j ∈ [0, 63]
          → Q4 form: d = d·sc_j, m = −dmin·mn_j, and their factors (d, sc_j), (−dmin, mn_j)
    Q5_K  as Q4_K with q ∈ [0, 31]
          → Q4 form with fifth bits (`high`), the same scales and factors
    Q6_K  w = (d·sc_j)·(q − 32) per 16,       q ∈ [0, 63], sc_j ∈ [−128, 127]
          → Q8 form, B = 16: codes q − 32 (6 bits packed), d = d·sc_j, and its factors

The products of an f16 and a 6- or 8-bit integer are exact in float32: the kernels keep the
factors (`ScaleFactors`) and form the same scale themselves, in fewer bytes.
"""

from __future__ import annotations

import numpy as np

from torchllama.blocks.registry import BlockType, GGMLType, f16, register

Q2_K_BLOCK = np.dtype([("scales", "u1", 16), ("qs", "u1", 64), ("d", "<f2"), ("dmin", "<f2")])
Q3_K_BLOCK = np.dtype([("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12), ("d", "<f2")])
Q4_K_BLOCK = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)])
Q5_K_BLOCK = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", 32),
                       ("qs", "u1", 128)])
Q6_K_BLOCK = np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")])


def q4_k_arrays(rows: int, K: int) -> list[np.ndarray]:
    """Q4 form [codes (rows, K/2) u8, d, m (rows, K/32) f32], then d's factors (super
    (rows, K/256) f16, sc_j (rows, K/32) u8) and m's (−dmin, mn_j)."""
    sup = lambda: np.empty((rows, K // 256), np.float16)                 # noqa: E731
    return [np.empty((rows, K // 2), np.uint8), np.empty((rows, K // 32), np.float32),
            np.empty((rows, K // 32), np.float32), sup(), np.empty((rows, K // 32), np.uint8),
            sup(), np.empty((rows, K // 32), np.uint8)]


def q5_k_arrays(rows: int, K: int) -> list[np.ndarray]:
    """Q4_K's arrays with the fifth bits `high` (rows, K/8) u8 right after d and m."""
    a = q4_k_arrays(rows, K)
    return a[:3] + [np.empty((rows, K // 8), np.uint8)] + a[3:]


def q2_k_arrays(rows: int, K: int) -> list[np.ndarray]:
    """Q8 form with offsets [codes (rows, K) i8, d, m (rows, K/16) f32], then d's factors
    (super (rows, K/256) f16, sc_j (rows, K/16) u8) and m's (−dmin, mn_j)."""
    sup = lambda: np.empty((rows, K // 256), np.float16)                 # noqa: E731
    sub = lambda: np.empty((rows, K // 16), np.uint8)                    # noqa: E731
    return [np.empty((rows, K), np.int8), np.empty((rows, K // 16), np.float32),
            np.empty((rows, K // 16), np.float32), sup(), sub(), sup(), sub()]


def q3_k_arrays(rows: int, K: int) -> list[np.ndarray]:
    """Q8 form with a table [indices (rows, K/2) u8, d (rows, K/16) f32], then d's factors
    (super (rows, K/256) f16, sc_j − 32 (rows, K/16) i8)."""
    return [np.empty((rows, K // 2), np.uint8)] + q6_k_arrays(rows, K)[1:]


def q6_k_arrays(rows: int, K: int) -> list[np.ndarray]:
    """Q8 form [codes (rows, K) i8, d (rows, K/16) f32], then d's factors (super (rows, K/256)
    f16, sc_j (rows, K/16) i8)."""
    return [np.empty((rows, K), np.int8), np.empty((rows, K // 16), np.float32),
            np.empty((rows, K // 256), np.float16), np.empty((rows, K // 16), np.int8)]


#: Byte masks repeated over a word: the nibble and bit-field operations below act on 8 (4)
#: bytes at once, each byte as it would alone (what a shift carries into a neighbour is masked).
_LOW4, _HIGH4, _LOW2, _LOW1 = (np.uint64(0x0101010101010101 * v) for v in (0x0F, 0xF0, 0x03, 1))
_LOW6, _BITS45, _LOW4_32, _LOW2_32 = (np.uint32(0x01010101 * v) for v in (0x3F, 0x30, 0x0F, 0x03))


def _words(b: np.ndarray, dtype, first: int, last: int) -> np.ndarray:
    """Bytes first..last-1 of every block of b (rows, blocks), as words of `dtype`: a view
    (rows, blocks, (last − first) / word size) when the block size allows it, else a copy."""
    raw = b.view(np.uint8).reshape(*b.shape, b.dtype.itemsize)[..., first:last]
    size = np.dtype(dtype).itemsize
    if b.dtype.itemsize % size or first % size:
        raw = np.ascontiguousarray(raw)
    return raw.view(dtype)


def _q4_k_codes(b: np.ndarray, first: int, codes: np.ndarray) -> None:
    """The 128 bytes of 4-bit codes at byte `first` of each Q4_K/Q5_K super-block (rows,
    K/256) → `codes` (rows, K/2), Q4 blocks of 32 (ggml-common.h block_q4_K, block_q5_K qs).

    Each 64 weights of a super-block are 32 bytes: weights 0-31 in their low nibbles,
    32-63 in their high nibbles; a Q4 block holds weights i and i + 16 in byte i.
    """
    rows, nb = b.shape
    qs = _words(b, np.uint64, first, first + 128).reshape(rows, nb, 4, 2, 2)  # 64s, 0-15 | 16-31
    lo, hi = qs[..., 0, :], qs[..., 1, :]
    out = codes.view(np.uint64).reshape(rows, nb, 4, 2, 2)         # (…, sub-blocks 2j | 2j+1)
    np.bitwise_or(lo & _LOW4, (hi << 4) & _HIGH4, out=out[..., 0, :])    # weights 0-31
    np.bitwise_or((lo >> 4) & _LOW4, hi & _HIGH4, out=out[..., 1, :])    # weights 32-63


def _q4_k_scales(b: np.ndarray, d: np.ndarray, m: np.ndarray, d_super: np.ndarray,
                 sc_out: np.ndarray, m_super: np.ndarray, mn_out: np.ndarray) -> None:
    """The scales of Q4_K/Q5_K super-blocks (rows, K/256) per 32 weights: d·sc_j and
    −dmin·mn_j, and their factors (`ScaleFactors`: d and sc_j, −dmin and mn_j). The eight
    6-bit sc_j, mn_j are packed in the 12 bytes after d and dmin (ggml-quants.c
    get_scale_min_k4, `gguf.quants.Q4_K.get_scale_min`'s layout)."""
    rows, nb = b.shape
    s = _words(b, np.uint32, 4, 16)                               # (rows, K/256, 3): 12 bytes
    sc, mn = np.empty((2, rows, nb, 2), np.uint32)
    sc[..., 0], mn[..., 0] = s[..., 0] & _LOW6, s[..., 1] & _LOW6          # j = 0-3
    sc[..., 1] = (s[..., 2] & _LOW4_32) | ((s[..., 0] >> 2) & _BITS45)           # j = 4-7
    mn[..., 1] = ((s[..., 2] >> 4) & _LOW4_32) | ((s[..., 1] >> 2) & _BITS45)
    sc_out[:], mn_out[:] = sc.view(np.uint8).reshape(rows, -1), mn.view(np.uint8).reshape(rows, -1)
    d_super[:], m_super[:] = b["d"], -b["dmin"]                            # f16, exact
    sc, mn = (x.view(np.uint8).astype(np.float32) for x in (sc, mn))       # (rows, K/256, 8)
    d[:] = (b["d"].astype(np.float32)[..., None] * sc).reshape(rows, -1)
    m[:] = -(b["dmin"].astype(np.float32)[..., None] * mn).reshape(rows, -1)


def _q4_k_rows(b: np.ndarray, codes: np.ndarray, d: np.ndarray, m: np.ndarray,
               *factors: np.ndarray) -> None:
    """Q4_K super-blocks (rows, K/256) → Q4 blocks of 32 (ggml-common.h block_q4_K,
    ggml-quants.c dequantize_row_q4_K): w = (d·sc_j)·q − dmin·mn_j for sub-block j; the
    factors too (d, sc_j, −dmin, mn_j)."""
    _q4_k_codes(b, 16, codes)
    _q4_k_scales(b, d, m, *factors)


def _q5_k_rows(b: np.ndarray, codes: np.ndarray, d: np.ndarray, m: np.ndarray,
               high: np.ndarray, *factors: np.ndarray) -> None:
    """Q5_K super-blocks (rows, K/256) → Q4 blocks of 32 with fifth bits (ggml-common.h
    block_q5_K, ggml-quants.c dequantize_row_q5_K): Q4_K's codes, scales and factors, qh
    between the scales and qs. The fifth bit of weight e of a super-block is bit e // 32 of
    qh[e % 32]; the form wants it as bit e % 32 of sub-block e // 32's 32-bit word: bit plane
    j of the 32 qh bytes, gathered into 4 bytes."""
    rows, nb = b.shape
    _q4_k_codes(b, 48, codes)
    _q4_k_scales(b, d, m, *factors)
    planes = (b["qh"][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (…, j, i)
    high.reshape(rows, nb, 8, 4)[:] = np.packbits(planes, axis=-1, bitorder="little")


def _q2_k_rows(b: np.ndarray, codes: np.ndarray, d: np.ndarray, m: np.ndarray,
               d_super: np.ndarray, sc: np.ndarray, m_super: np.ndarray, mn: np.ndarray) -> None:
    """Q2_K super-blocks (rows, K/256) → codes q ∈ [0, 3] and per 16 weights d·sc_j and
    −dmin·mn_j, and their factors (ggml-common.h block_q2_K, ggml-quants.c
    dequantize_row_q2_K): each 128 weights take 32 bytes of qs, weight l + 32·k of the 128
    (l < 32) bits 2k, 2k+1 of qs[l]; scales[j] holds sc_j (low nibble) and mn_j (high) of
    weights 16j..16j+15."""
    rows, nb = b.shape
    qs = _words(b, np.uint64, 16, 80).reshape(rows, nb, 2, 4)       # (…, 128s, 4 words of l)
    out = codes.view(np.uint64).reshape(rows, nb, 2, 4, 4)          # (…, 128s, k, 4 words)
    for k in range(4):
        np.bitwise_and(qs >> np.uint64(2 * k), _LOW2, out=out[..., k, :])
    s = b["scales"]                                                 # (rows, nb, 16)
    sc[:], mn[:] = (s & 15).reshape(rows, -1), (s >> 4).reshape(rows, -1)
    d_super[:], m_super[:] = b["d"], -b["dmin"]                     # f16, exact
    d[:] = (b["d"].astype(np.float32)[..., None] * (s & 15).astype(np.float32)).reshape(rows, -1)
    m[:] = -(b["dmin"].astype(np.float32)[..., None] * (s >> 4).astype(np.float32)
             ).reshape(rows, -1)


def _q3_k_rows(b: np.ndarray, codes: np.ndarray, d: np.ndarray, d_super: np.ndarray,
               sub: np.ndarray) -> None:
    """Q3_K super-blocks (rows, K/256) → indices q + 4 ∈ [0, 7] (the table's: code q) in Q4's
    nibble order, and one scale d·(sc_j − 32)
    per 16 weights, and its factors d, sc_j − 32 (ggml-common.h block_q3_K, ggml-quants.c
    dequantize_row_q3_K): each 128 weights take 32 bytes of qs, weight l + 32·k of the 128
    (l < 32) bits 2k, 2k+1 of qs[l]; weight e's third bit is bit e // 32 of hmask[e % 32]:
    set, q = those two bits; clear, q = they − 4. The sixteen 6-bit sc_j are packed in 12
    bytes: the low 4 bits of sc_j in byte j % 8 (its low nibble for j < 8), the high 2 at
    bits 2·(j // 4) of byte 8 + j % 4 (dequantize_row_q3_K's kmask1, kmask2)."""
    rows, nb = b.shape
    hm = _words(b, np.uint64, 0, 32).reshape(rows, nb, 1, 4)        # (…, 1, 4 words of l)
    qs = _words(b, np.uint64, 32, 96).reshape(rows, nb, 2, 4)       # (…, 128s, 4 words of l)
    q4 = np.empty((rows, nb * 256), np.uint8)                       # q + 4, natural order
    out = q4.view(np.uint64).reshape(rows, nb, 2, 4, 4)             # (…, 128s, k, 4 words)
    first = np.array([[0], [4]], np.uint64)                         # 128s: hmask bits 0-3, 4-7
    for k in range(4):
        third = (hm >> (first + k)) & _LOW1                         # (…, 128s, 4 words)
        np.bitwise_or((qs >> (2 * k)) & _LOW2, third << 2, out=out[..., k, :])  # q + 4
    halves = q4.reshape(rows, -1, 2, 16)                            # per 32: weights j, j + 16
    np.bitwise_or(halves[:, :, 0], halves[:, :, 1] << 4, out=codes.reshape(rows, -1, 16))
    s = _words(b, np.uint32, 96, 108)                               # (rows, K/256, 3): 12 bytes
    # word w of the result holds sc_{4w}..sc_{4w+3}: low nibbles of bytes 0-7, then high ones
    low = (s[..., [0, 1, 0, 1]] >> np.array([0, 0, 4, 4], np.uint32)) & _LOW4_32
    high = (s[..., 2:3] >> np.array([0, 2, 4, 6], np.uint32)) & _LOW2_32    # bits 2w, 2w+1
    sc = (low | (high << 4)).view(np.int8).reshape(rows, nb, 16) - np.int8(32)   # [−32, 31]
    d_super[:], sub[:] = b["d"], sc.reshape(rows, -1)
    d[:] = (b["d"].astype(np.float32)[..., None] * sc.astype(np.float32)).reshape(rows, -1)


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


def _reference_q2_k(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q2_K: weight l + 32·k of each 128 (l < 32) is
    y = (d·sc)·((qs[l] >> 2k) & 3) − dmin·mn, (sc, mn) the nibbles of its 16's scales byte."""
    rows, nb = b.shape
    s = b["scales"].reshape(rows, nb, 2, 4, 2, 1)                        # (…, 128s, k, half)
    dl = f16(b, "d")[..., None, None, None, None] * (s & 15).astype(np.float32)
    ml = f16(b, "dmin")[..., None, None, None, None] * (s >> 4).astype(np.float32)
    qs = b["qs"].reshape(rows, nb, 2, 1, 32)                             # (…, 128s, 1, l)
    q = ((qs >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).astype(np.float32)
    return (dl * q.reshape(rows, nb, 2, 4, 2, 16) - ml).reshape(rows, -1)


def _reference_q3_k(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q3_K: weight l + 32·k of each 128 (l < 32) is y = (d·(sc − 32))·q,
    q = ((qs[l] >> 2k) & 3) − (0 if its hmask bit is set, else 4), sc the scale of its 16."""
    rows, nb = b.shape
    s = b["scales"]                                                      # (rows, nb, 12)
    low = np.concatenate([s[..., :8] & 15, s[..., :8] >> 4], axis=-1)    # sc_j: byte j % 8
    high = (s[..., None, 8:] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [j//4, j%4]
    sc = (low | (high.reshape(rows, nb, 16) << 4)).astype(np.float32) - 32
    qs = b["qs"].reshape(rows, nb, 2, 1, 32)                             # (…, 128s, 1, l)
    low2 = (qs >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3       # (…, 128s, k, l)
    hm = b["hmask"].reshape(rows, nb, 1, 1, 32)
    bit = (hm >> np.arange(8, dtype=np.uint8).reshape(2, 4, 1)) & 1     # bit 4·(128s) + k
    q = low2.astype(np.float32) - np.where(bit == 1, 0, 4).astype(np.float32)
    dl = (f16(b, "d")[..., None] * sc).reshape(rows, nb, 2, 4, 2, 1)     # (…, 128s, k, half)
    return (dl * q.reshape(rows, nb, 2, 4, 2, 16)).reshape(rows, -1)


def _sub_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks' sc_j, mn_j as stored: (rows, nb, 8) float32 each."""
    rows, nb = b.shape
    arrays = q4_k_arrays(rows, nb * 256)
    _q4_k_scales(b, *arrays[1:])
    return tuple(x.reshape(rows, nb, 8).astype(np.float32) for x in (arrays[4], arrays[6]))


def _reference_q4_k(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q4_K: per 64 weights j = 2c, 2c + 1: y = (d·sc_j)·(q & 15) − dmin·mn_j,
    then (d·sc_{j+1})·(q >> 4) − dmin·mn_{j+1}."""
    rows, nb = b.shape
    sc, mn = _sub_scales(b)
    d1 = f16(b, "d")[..., None] * sc                                     # (rows, nb, 8)
    m1 = f16(b, "dmin")[..., None] * mn
    qs = b["qs"].reshape(rows, nb, 4, 32)                                # 64 weights a row
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, nb, 8, 32)    # sub-block j
    return (d1[..., None] * q.astype(np.float32) - m1[..., None]).reshape(rows, -1)


def _reference_q5_k(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q5_K: as Q4_K, y = d1·((ql & 15) + (16 if bit j of qh[l] else 0)) − m1
    for weight l of sub-block j."""
    rows, nb = b.shape
    sc, mn = _sub_scales(b)
    d1 = f16(b, "d")[..., None] * sc                                     # (rows, nb, 8)
    m1 = f16(b, "dmin")[..., None] * mn
    qs = b["qs"].reshape(rows, nb, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, nb, 8, 32)    # sub-block j, l
    fifth = (b["qh"][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # bit j of qh[l]
    q = (q | (fifth << 4)).astype(np.float32)
    return (d1[..., None] * q - m1[..., None]).reshape(rows, -1)


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


Q2_K = register(BlockType(GGMLType.Q2_K, Q2_K_BLOCK, 256, "q8", q2_k_arrays,
                          lambda b, out: _q2_k_rows(b, *out), _reference_q2_k, offsets=True))
Q3_K = register(BlockType(GGMLType.Q3_K, Q3_K_BLOCK, 256, "q8", q3_k_arrays,
                          lambda b, out: _q3_k_rows(b, *out), _reference_q3_k,
                          lut=(-4, -3, -2, -1, 0, 1, 2, 3) + (0,) * 8))
Q4_K = register(BlockType(GGMLType.Q4_K, Q4_K_BLOCK, 256, "q4", q4_k_arrays,
                          lambda b, out: _q4_k_rows(b, *out), _reference_q4_k))
Q5_K = register(BlockType(GGMLType.Q5_K, Q5_K_BLOCK, 256, "q4", q5_k_arrays,
                          lambda b, out: _q5_k_rows(b, *out), _reference_q5_k, high=True))
Q6_K = register(BlockType(GGMLType.Q6_K, Q6_K_BLOCK, 256, "q8", q6_k_arrays,
                          lambda b, out: _q6_k_rows(b, *out), _reference_q6_k))
