"""The kernel forms: the canonical containers every quantized weight is converted into, whatever
its file type (torchllama.blocks' registry says which type lands in which form).

    Q4Blocks:  w[n, k] = d[n, b] · q[n, k] + m[n, b]     q ∈ [0, 15],   b = k // 32
    Q8Blocks:  w[n, k] = d[n, b] · q[n, k] (+ m[n, b])   q ∈ [-128, 127], b = k // B (B = 32 or 16)

run on torchllama's kernels (`q4_rows`, `q8_rows`: blocks.linear's `Q4Linear`, `Q8Linear`);
`HalfMatrix` keeps GGUF's F16 / BF16 matrices as stored (`HalfLinear`, on f32_linear);
Int8Weight and Int4Weight are torch's own weight-only forms (the fallback without our kernels,
transforms.quantize's `Int8Linear`, `Int4Linear`). For the K-quants the loader also hands over
the scales' two factors (`ScaleFactors`): the kernels then keep the f16 super-scale and the
small integers and form the product themselves, bit for bit the same scale in fewer bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch


@dataclass
class Int8Weight:
    """A (N, K) matrix as int8 codes with one scale per row: w = q · scale[:, None].

    Attributes:
        q: (N, K) int8, in [-127, 127].
        scale: (N,) float32.
    """

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32 weights."""
        return self.q.float() * self.scale[:, None]

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Int8Weight":
        """Symmetric per-row quantization: scale = max|w[n]| / 127, q = round(w / scale)."""
        w = w.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127                 # (N,)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale)


@dataclass
class Int4Weight:
    """A (N, K) matrix as 4-bit codes with a scale and a zero per group of G consecutive inputs:
    w[n, k] = (q[n, k] − 8) · scale[n, k // G] + zero[n, k // G].

    Attributes:
        q: (N, K) uint8 codes in [0, 15].
        scale, zero: (N, K // G) float32.
        group_size: G.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32 weights."""
        N, K = self.q.shape
        G = self.group_size
        q = self.q.float().view(N, K // G, G) - 8                         # (N, K/G, G)
        return (q * self.scale[..., None] + self.zero[..., None]).view(N, K)

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int = 32) -> "Int4Weight":
        """Asymmetric min/max quantization per group (as GGUF's Q4_1): scale = (max − min)/15,
        q = round((w − min)/scale), so w ≈ q·scale + min = (q − 8)·scale + (min + 8·scale)."""
        N, K = w.shape
        G = group_size
        groups = w.float().view(N, K // G, G)                              # (N, K/G, G)
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)                  # (N, K/G)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15)
        return cls(q.to(torch.uint8).view(N, K), scale, lo + 8 * scale, G)


@dataclass
class ScaleFactors:
    """Block scales given as products: scale[n, j] = super[n, j // S] · sub[n, j], exact in
    float32 (a float16 times an integer of at most 8 bits).

    Attributes:
        super: (N, nd/S) float16, one per super-block of S scales (GGUF's d, or −dmin).
        sub: (N, nd) uint8 (Q4_K's 6-bit sc_j, mn_j: S = 8) or int8 (Q6_K's sc_j: S = 16).
    """

    super: torch.Tensor
    sub: torch.Tensor

    def values(self) -> torch.Tensor:
        """(N, nd) float32 scales."""
        S = self.sub.shape[1] // self.super.shape[1]
        return self.super.float().repeat_interleave(S, dim=1) * self.sub.float()

    def map_rows(self, fn) -> "ScaleFactors":
        return ScaleFactors(fn(self.super), fn(self.sub))


def _map_factors(f: Optional[ScaleFactors], fn) -> Optional[ScaleFactors]:
    return None if f is None else f.map_rows(fn)


@dataclass
class Q4Blocks:
    """A (N, K) matrix as 4- or 5-bit blocks of 32 consecutive weights of a row: w = d·q + m,
    q unsigned.

    Attributes:
        codes: (N, K/2) uint8; byte j of block b holds q[32b + j] in its low nibble and
            q[32b + j + 16] in its high nibble (GGUF's Q4_0/Q4_1 order): q's low 4 bits.
        d, m: (N, K/32) float32 block scales and offsets.
        d_factors, m_factors: the same d and m as products (`ScaleFactors`, Q4_K: d·sc_j and
            (−dmin)·mn_j), or None.
        high: None (q ∈ [0, 15]), or (N, K/8) uint8: q's fifth bits, 4 bytes a block, bit j of
            the block's little-endian 32-bit word that of q[32b + j] (GGUF's Q5_0/Q5_1 qh), so
            q ∈ [0, 31] (Q5_1, Q5_K).
    """

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    d_factors: Optional[ScaleFactors] = None
    m_factors: Optional[ScaleFactors] = None
    high: Optional[torch.Tensor] = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.codes.shape[1] * 2))

    def values(self) -> torch.Tensor:
        """(N, K) uint8 codes q ∈ [0, 15] (or [0, 31] with `high`), unpacked."""
        N = self.codes.shape[0]
        c = self.codes.view(N, -1, 16)                                      # (N, K/32, 16)
        q = torch.cat([c & 15, c >> 4], dim=-1).view(N, -1)                 # (N, K)
        if self.high is None:
            return q
        bits = torch.arange(8, dtype=torch.uint8)
        fifth = (self.high.view(N, -1, 1) >> bits) & 1                      # (N, K/8, 8)
        return q | (fifth.view(N, -1) << 4)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32 weights d·q + m."""
        N, K = self.shape
        q = self.values().float().view(N, K // 32, 32)                      # (N, K/32, 32)
        return (q * self.d.float()[..., None] + self.m.float()[..., None]).view(N, K)

    @classmethod
    def from_values(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> "Q4Blocks":
        """Pack (N, K) codes in [0, 15] with (N, K/32) d and m."""
        N, K = q.shape
        q = q.to(torch.uint8).view(N, K // 32, 2, 16)                       # halves of a block
        codes = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(N, K // 2)
        return cls(codes.contiguous(), d.float().contiguous(), m.float().contiguous())

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int = 32) -> "Q4Blocks":
        """Min/max quantization per group of G inputs (`Int4Weight.from_float`, GGUF's Q4_1
        rule), written as blocks of 32 (a group of G > 32 repeats its scale and offset)."""
        return cls.from_int4(Int4Weight.from_float(w, group_size))

    @classmethod
    def from_int4(cls, w: Int4Weight) -> "Q4Blocks":
        """The same codes: (q − 8)·scale + zero = scale·q + (zero − 8·scale)."""
        r = w.group_size // 32
        d = w.scale.repeat_interleave(r, dim=1)
        return cls.from_values(w.q, d, w.zero.repeat_interleave(r, dim=1) - 8 * d)

    def to_int4(self) -> Int4Weight:
        """For torch's int4 kernel (G = 32): scale d, zero m + 8·d, the codes unchanged (4-bit
        codes only: with `high`, ValueError)."""
        if self.high is not None:
            raise ValueError("5-bit codes do not fit torch's int4 kernel")
        d, m = self.d.float(), self.m.float()
        return Int4Weight(self.values(), d, m + 8 * d, 32)

    def map_rows(self, fn) -> "Q4Blocks":
        return Q4Blocks(fn(self.codes), fn(self.d), fn(self.m), _map_factors(self.d_factors, fn),
                        _map_factors(self.m_factors, fn),
                        None if self.high is None else fn(self.high))

    def split_rows(self, sizes) -> tuple["Q4Blocks", ...]:
        bounds = np.cumsum([0] + list(sizes)).tolist()
        return tuple(self.map_rows(lambda t, a=a, b=b: t[a:b]) for a, b in zip(bounds, bounds[1:]))


@dataclass
class Q8Blocks:
    """A (N, K) matrix as int8 codes with one scale per block of B = 32 (or 16) weights of a
    row: w = d·q, or w = d·q + m with offsets (Q2_K).

    Attributes:
        codes: (N, K) int8; or, with `lut`, (N, K/2) uint8 4-bit indices into it, in Q4's
            nibble order (byte j of block b: index 32b + j low, 32b + j + 16 high).
        d: (N, K/B) float32.
        d_factors: the same d as products (`ScaleFactors`, Q6_K: d·sc_j), or None.
        lut: None, or (16,) int8: the value of each 4-bit index (IQ4's non-linear grid, Q3_K's
            [−4, 3]): code = lut[index].
        m: None, or (N, K/B) float32 offsets (Q2_K's −dmin·mn_j, with codes in [0, 3]).
        m_factors: m as products (`ScaleFactors`: −dmin and mn_j), or None.
    """

    codes: torch.Tensor
    d: torch.Tensor
    d_factors: Optional[ScaleFactors] = None
    lut: Optional[torch.Tensor] = None
    m: Optional[torch.Tensor] = None
    m_factors: Optional[ScaleFactors] = None

    @property
    def shape(self) -> torch.Size:
        N, width = self.codes.shape
        return torch.Size((N, 2 * width if self.lut is not None else width))

    @property
    def block(self) -> int:
        return self.shape[1] // self.d.shape[1]

    def values(self) -> torch.Tensor:
        """(N, K) int8 codes (looked up in `lut` where given)."""
        if self.lut is None:
            return self.codes
        N = self.codes.shape[0]
        c = self.codes.view(N, -1, 16)                                      # (N, K/32, 16)
        idx = torch.cat([c & 15, c >> 4], dim=-1).view(N, -1)               # (N, K)
        return self.lut[idx.long()]

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32 weights d·q (+ m)."""
        N, K = self.shape
        B = self.block
        q = self.values().float().view(N, K // B, B)
        w = q * self.d.float()[..., None]
        return (w if self.m is None else w + self.m.float()[..., None]).view(N, K)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Q8Blocks":
        """GGUF's Q8_0 rule per block of 32: d = max|w_b| / 127, q = round(w / d)."""
        N, K = w.shape
        blocks = w.float().view(N, K // 32, 32)                             # (N, K/32, 32)
        d = blocks.abs().amax(dim=-1) / 127                                 # (N, K/32)
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return cls(q.view(N, K).contiguous(), d.contiguous())

    def to_int8(self) -> Int8Weight:
        """For torch's int8 kernel: re-quantized per row (one rounding more)."""
        return Int8Weight.from_float(self.dequantize())

    def map_rows(self, fn) -> "Q8Blocks":
        return Q8Blocks(fn(self.codes), fn(self.d), _map_factors(self.d_factors, fn), self.lut,
                        None if self.m is None else fn(self.m), _map_factors(self.m_factors, fn))

    def split_rows(self, sizes) -> tuple["Q8Blocks", ...]:
        bounds = np.cumsum([0] + list(sizes)).tolist()
        return tuple(self.map_rows(lambda t, a=a, b=b: t[a:b]) for a, b in zip(bounds, bounds[1:]))


@dataclass
class HalfMatrix:
    """A (N, K) float matrix kept as the file stores it, in half precision (GGUF's F16 and BF16
    matrices): run by f32_linear, each weight converted to float32 exactly as it is loaded.

    Attributes:
        values: (N, K) float16 or bfloat16.
    """

    values: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32 weights (exact)."""
        return self.values.float()

    def map_rows(self, fn) -> "HalfMatrix":
        return HalfMatrix(fn(self.values))

    def split_rows(self, sizes) -> tuple["HalfMatrix", ...]:
        return tuple(HalfMatrix(t) for t in self.values.split(list(sizes)))


BlockWeight = Union[Q4Blocks, Q8Blocks]


QuantizedWeight = Union[Int8Weight, Int4Weight, Q4Blocks, Q8Blocks, HalfMatrix]
