"""Weight-only quantization: linear layers whose weights stay 4 or 8 bits wide in memory.

Decode reads every weight once per token and does little arithmetic with each, so it is bound by
memory bandwidth: SmolLM2-135M reads 540 MB per token in float32, ~97 MB as its GGUF's blocks.

The canonical forms are GGUF's block formats, which every supported file type maps onto exactly
(see the table above `Q4Blocks`):

    Q4Blocks:  w[n, k] = d[n, b] · q[n, k] + m[n, b]     q ∈ [0, 15],   b = k // 32
    Q8Blocks:  w[n, k] = d[n, b] · q[n, k]               q ∈ [-128, 127], b = k // B (B = 32 or 16)

They run on torchllama's own kernels (`torchllama.kernels`: `Q4Linear`, `Q8Linear`, int8
activations per block of 32, integer dot products, rows independent of the batch bit for bit).
Where those cannot be built, on PyTorch's CPU weight-only kernels, which run vectorised for
bfloat16 activations: `aten._weight_int4pack_mm_for_cpu` for Q4 blocks (`Int4Linear`, the same
codes; scale and zero rounded to bf16; weights packed at load by
`aten._convert_weight_to_int4pack_for_cpu` into an ISA-specific layout, never saved) and
`aten._weight_int8pack_mm` for Q8 blocks (`Int8Linear`, re-quantized per row):

    int8, per output channel:   w[n, k] = q[n, k] · scale[n]                    q ∈ [-127, 127]
    int4, per group of G inputs: w[n, k] = (q[n, k] − 8) · scale[n, g] + zero[n, g]

Either way the rest of the model (norms, RoPE, attention, the KV cache) stays float32.

How models get here, applied from outside the model (its modules stay plain `nn.Linear`s until
swapped, `install_quantized`):
- `quantize_model(model, "int8" | "int4")`: quantize a float model's linear layers (Q8_0's and
  Q4_1's rules), and a tied embedding with its output projection (one table serves both).
- GGUF files keep their own blocks (`torchllama.checkpoint.gguf.read_blocks`).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from torchllama.errors import ArgumentError
from torchllama.kernels import huge_pages
from torchllama.transforms import fuse, structure

#: Group sizes `_weight_int4pack_mm_for_cpu` accepts.
INT4_GROUP_SIZES = (32, 64, 128, 256)
#: The activation dtype of the quantized matmuls (see the module docstring).
COMPUTE_DTYPE = torch.bfloat16


# --------------------------------------------------------------------------------------------
# Canonical quantized weights
# --------------------------------------------------------------------------------------------

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


# GGUF-style block forms: what a GGUF file stores, in the layout torchllama's kernels read
# (torchllama/kernels/csrc/blocks.cpp). Every supported file type maps onto one of them exactly:
#   Q4_0  w = d·(q − 8)        → Q4Blocks d, m = −8·d                 (ggml-common.h block_q4_0)
#   Q4_1  w = d·q + m          → Q4Blocks d, m                        (block_q4_1)
#   Q4_K  w = d·sc_j·q − dmin·mn_j per sub-block j of 32 → Q4Blocks d·sc_j, −dmin·mn_j (block_q4_K)
#   Q8_0  w = d·q              → Q8Blocks B = 32                      (block_q8_0)
#   Q5_0  w = d·(q − 16)       → Q8Blocks B = 32, codes q − 16        (block_q5_0)
#   Q6_K  w = d·sc_j·(q − 32) per 16 → Q8Blocks B = 16, codes q − 32  (block_q6_K)
# (the products d·sc_j of an f16 and a 6- or 8-bit integer are exact in float32). For the
# K-quants the loader also hands over those two factors (`ScaleFactors`): the kernels then keep
# the f16 d and the small integers and form the product themselves, bit for bit the same scale
# in 4.6 instead of 6 bits a weight (Q4_K), 8.6 instead of 10 (Q6_K).

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
    """A (N, K) matrix as 4-bit blocks of 32 consecutive weights of a row: w = d·q + m.

    Attributes:
        codes: (N, K/2) uint8; byte j of block b holds q[32b + j] in its low nibble and
            q[32b + j + 16] in its high nibble (GGUF's Q4_0/Q4_1 order).
        d, m: (N, K/32) float32 block scales and offsets.
        d_factors, m_factors: the same d and m as products (`ScaleFactors`, Q4_K: d·sc_j and
            (−dmin)·mn_j), or None.
    """

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    d_factors: Optional[ScaleFactors] = None
    m_factors: Optional[ScaleFactors] = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.codes.shape[1] * 2))

    def values(self) -> torch.Tensor:
        """(N, K) uint8 codes q ∈ [0, 15], unpacked."""
        N = self.codes.shape[0]
        c = self.codes.view(N, -1, 16)                                      # (N, K/32, 16)
        return torch.cat([c & 15, c >> 4], dim=-1).view(N, -1)              # (N, K)

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
        """For torch's int4 kernel (G = 32): scale d, zero m + 8·d, the codes unchanged."""
        d, m = self.d.float(), self.m.float()
        return Int4Weight(self.values(), d, m + 8 * d, 32)

    def map_rows(self, fn) -> "Q4Blocks":
        return Q4Blocks(fn(self.codes), fn(self.d), fn(self.m), _map_factors(self.d_factors, fn),
                        _map_factors(self.m_factors, fn))

    def split_rows(self, sizes) -> tuple["Q4Blocks", ...]:
        bounds = np.cumsum([0] + list(sizes)).tolist()
        return tuple(self.map_rows(lambda t, a=a, b=b: t[a:b]) for a, b in zip(bounds, bounds[1:]))


@dataclass
class Q8Blocks:
    """A (N, K) matrix as int8 codes with one scale per block of B = 32 (or 16) weights of a
    row: w = d·q.

    Attributes:
        codes: (N, K) int8.
        d: (N, K/B) float32.
        d_factors: the same d as products (`ScaleFactors`, Q6_K: d·sc_j), or None.
    """

    codes: torch.Tensor
    d: torch.Tensor
    d_factors: Optional[ScaleFactors] = None

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def block(self) -> int:
        return self.codes.shape[1] // self.d.shape[1]

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32 weights."""
        N, K = self.codes.shape
        B = self.block
        return (self.codes.float().view(N, K // B, B) * self.d.float()[..., None]).view(N, K)

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
        return Q8Blocks(fn(self.codes), fn(self.d), _map_factors(self.d_factors, fn))

    def split_rows(self, sizes) -> tuple["Q8Blocks", ...]:
        bounds = np.cumsum([0] + list(sizes)).tolist()
        return tuple(self.map_rows(lambda t, a=a, b=b: t[a:b]) for a, b in zip(bounds, bounds[1:]))


BlockWeight = Union[Q4Blocks, Q8Blocks]

QuantizedWeight = Union[Int8Weight, Int4Weight, Q4Blocks, Q8Blocks]


@dataclass(frozen=True)
class Scheme:
    """A weight-only quantization scheme: bits 8 (per channel) or 4 (group-wise, group_size)."""

    bits: int
    group_size: int = 32


def parse_scheme(name: str) -> Optional[Scheme]:
    """`int8`, `int4` (G = 32) or `int4-gG` (G in 32, 64, 128, 256) → a Scheme; None for
    anything else (a float dtype name).

    Raises:
        ArgumentError: `int4-gG` with an unsupported G.
    """
    if name == "int8":
        return Scheme(8)
    m = re.fullmatch(r"int4(?:-g(\d+))?", name)
    if not m:
        return None
    G = int(m.group(1) or 32)
    if G not in INT4_GROUP_SIZES:
        raise ArgumentError(f"--dtype {name!r}: the int4 group size must be one of "
                            f"{', '.join(map(str, INT4_GROUP_SIZES))}")
    return Scheme(4, G)


#: The matrices of the vocabulary: the output projection and token embeddings.
VOCAB_WEIGHTS = frozenset({"output.weight", "tok_embeddings.weight"})


def scheme_for(name: str, scheme: Scheme) -> Scheme:
    """The scheme a weight gets when the model is quantized with `scheme`: int4 models keep
    their output projection (and tied embeddings) in int8, as llama.cpp's 4-bit mixes keep it
    at Q6_K/Q8_0. Measured on SmolLM2-135M: its head in int4 (G = 32) raises the perplexity by
    7%, in int8 by 0.3% (the quantized-weights guide, docs/guides/quantized.md)."""
    return Scheme(8) if name in VOCAB_WEIGHTS and scheme.bits < 8 else scheme


def fits(shape: torch.Size, scheme: Scheme) -> bool:
    """Whether a (N, K) matrix can be held in this scheme: the blocks need K divisible by 32
    (and by G); int4 on torch's kernel also needs N divisible by 16 (checked where it is
    used, `quantized_linear`)."""
    N, K = shape
    return K % 32 == 0 and (scheme.bits == 8 or K % scheme.group_size == 0)


def quantize_weight(w: torch.Tensor, scheme: Scheme) -> BlockWeight:
    """Quantize a float (N, K) matrix, round to nearest: int8 → `Q8Blocks` (GGUF's Q8_0 rule),
    int4 → `Q4Blocks` (min/max per group of G, GGUF's Q4_1 rule)."""
    if scheme.bits == 8:
        return Q8Blocks.from_float(w)
    return Q4Blocks.from_float(w, scheme.group_size)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------

class _InputGradient(torch.autograd.Function):
    """y = module._forward(x) with ∂L/∂x = ∂L/∂y · W, W dequantized in the backward pass and
    dropped after it (QLoRA, Dettmers et al. 2023 §3: the frozen 4-bit weight is dequantized
    to compute the gradient of the input, never stored in float). W gets no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        ctx.module = module
        return module._forward(x)                                          # (..., N)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        w = ctx.module.dequantize()                                        # (N, K) fp32
        grad_x = grad_y.to(w.dtype) @ w                                    # (..., K)
        return grad_x.to(grad_y.dtype), None


class WeightOnlyLinear(nn.Module):
    """Base of the weight-only quantized linears: `forward` runs the subclass's `_forward`
    (the fast product, no autograd) and, when x requires a gradient (QLoRA: adapters before
    this layer), adds the backward pass of x through the frozen weight (`_InputGradient`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _InputGradient.apply(x, self)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError


class Int8Linear(WeightOnlyLinear):
    """y = x · Wᵀ (+ b) with W int8 per output channel (`Int8Weight`).

    Shapes: x (..., in_features) float → (..., out_features) in x's dtype; the product runs in
    bfloat16 on `aten._weight_int8pack_mm` (dequantized F.linear off the CPU).
    Buffers are not persistent: a quantized model is not saved through its state dict.
    """

    def __init__(self, weight: Int8Weight, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_int8", weight.q.contiguous(), persistent=False)  # (N, K)
        self.register_buffer("scale", weight.scale.to(COMPUTE_DTYPE), persistent=False)  # (N,)
        # the exact float32 scales too, for a tied embedding table (bf16 would add up to 2⁻⁹
        # of each row's largest value to its rounding error)
        self.register_buffer("scale_fp32", weight.scale.float(), persistent=False)  # (N,)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def dequantize(self) -> torch.Tensor:
        return self.weight_int8.float() * self.scale.float()[:, None]     # (N, K) fp32

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)             # (M, K) bf16
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scale)  # (M, N)
        else:
            y = F.linear(x2, self.dequantize().to(COMPUTE_DTYPE))
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(WeightOnlyLinear):
    """y = x · Wᵀ (+ b) with W int4 group-wise (`Int4Weight`), packed for
    `aten._weight_int4pack_mm_for_cpu`.

    Shapes: x (..., in_features) float → (..., out_features) in x's dtype, computed in
    bfloat16. Buffers: `weight_packed` (the kernel's CPU-specific layout, (N, K/2) uint8 on
    x86) and `scales_and_zeros` (K/G, N, 2) bf16; neither is persistent.
    """

    def __init__(self, weight: Int4Weight, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 1)
        self.register_buffer("weight_packed", packed, persistent=False)
        sz = torch.stack([weight.scale.t(), weight.zero.t()], dim=-1)      # (K/G, N, 2)
        self.register_buffer("scales_and_zeros", sz.to(COMPUTE_DTYPE).contiguous(),
                             persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32 weights, as the kernel sees them (bf16 scales and zeros)."""
        eye = torch.eye(self.in_features, dtype=COMPUTE_DTYPE)
        cols = torch.ops.aten._weight_int4pack_mm_for_cpu(                 # (K, N) = I · Wᵀ
            eye, self.weight_packed, self.group_size, self.scales_and_zeros)
        return cols.t().float()

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)             # (M, K) bf16
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(                    # (M, N) bf16
            x2, self.weight_packed, self.group_size, self.scales_and_zeros)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4, group_size={self.group_size}")


def compact_scales(*scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The block scales (and offsets) as float16 when every one of them is exactly a float16
    (GGUF's Q4_0/Q4_1/Q8_0/Q5_0 store f16; Q4_K/Q6_K sub-block products usually are not),
    else float32: the decode step reads them once per token, and half the bytes is faster."""
    halves = tuple(t.half() for t in scales)
    if all(torch.equal(h.float(), t) for h, t in zip(halves, scales)):
        return tuple(h.contiguous() for h in halves)
    return tuple(t.float().contiguous() for t in scales)


# --------------------------------------------------------------------------------------------
# The kernels' packed layout (kernels/csrc/blocks_impl.h): rows in groups of 8, interleaved
# `chunk` bytes at a time within each block, so one 32-byte load holds 4 weights of 8 rows
# --------------------------------------------------------------------------------------------

def pack_rows(t: torch.Tensor, blocks: int, chunk: int) -> torch.Tensor:
    """(N, blocks·P) → (⌈N/8⌉, blocks, 8·P): each group of 8 rows' block b side by side, `chunk`
    elements of row 0, of row 1, …, of row 7, then the next chunk. Rows past N (to a multiple of
    8) are zeros (weights 0: their outputs are cut off). Codes: chunk 4 (P = 16 bytes of a Q4
    block, 32 codes of a Q8 block); scales (N, blocks): P = chunk = 1. Written straight onto
    transparent huge pages where the system has them (`kernels.huge_pages.empty`)."""
    N, width = t.shape
    if N % 8:
        t = torch.cat([t, t.new_zeros(8 - N % 8, width)])                   # (8G, width)
    P, G = width // blocks, t.shape[0] // 8
    out = (huge_pages.empty((G, blocks, 8 * P), t.dtype) if t.device.type == "cpu" else
           t.new_empty((G, blocks, 8 * P)))        # streamed once a token: on huge pages
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


def unpack_codes(packed: torch.Tensor, rows: torch.Tensor | int) -> torch.Tensor:
    """`unpack_rows` of packed codes of any kind (Q4's (G, b, 128) uint8, Q8's (G, b, 256)
    int8 or their 6-bit form (G, b, 192)): only the rows' groups are expanded."""
    if packed.shape[-1] != 192:
        return unpack_rows(packed, 4, rows)
    if isinstance(rows, int):
        return unpack_rows(unpack_six(packed[:(rows + 7) // 8]), 4, rows)
    groups = unpack_six(packed[rows // 8])                                  # (R, b, 256)
    return unpack_rows(groups, 4, 8 * torch.arange(len(rows)) + rows % 8)   # (R, K)


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


def unpack_scales(packed: torch.Tensor, rows: torch.Tensor | int,
                  d: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[ScaleFactors]]:
    """The inverse of `pack_scales` (and of Q4's m = c·d, a scalar c, given the rows' d):
    rows 0..rows−1 or the (R,) row indices → ((R, nd) float32 values, their `ScaleFactors` or
    None). Only the rows' groups are read."""
    if packed.dim() == 0:                                                   # m = c·d
        return d * packed, None
    if packed.dtype in (torch.float32, torch.float16):
        return unpack_rows(packed, 1, rows).float(), None
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


class BlockLinear(WeightOnlyLinear):
    """What `Q4Linear` and `Q8Linear` share: packed buffers (`NAMES`), the output cut to N rows,
    the op's weight list."""

    NAMES: tuple[str, ...] = ()

    def _init(self, N: int, K: int, packed: list[torch.Tensor], bias) -> None:
        WeightOnlyLinear.__init__(self)
        self.out_features, self.in_features = N, K
        for name, t in zip(self.NAMES, packed):
            self.register_buffer(name, t, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @classmethod
    def from_packed(cls, N: int, K: int, packed: list[torch.Tensor], bias=None) -> "BlockLinear":
        """A module over buffers already packed (in `NAMES` order; no copy)."""
        module = cls.__new__(cls)
        module._init(N, K, packed, bias)
        return module

    def packed(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.NAMES]

    def kernel_weight(self) -> Optional[list[torch.Tensor]]:
        """The packed buffers as `decoder_layer` takes the product ([codes, d, m] for Q4,
        [codes, d, small] for Q8); None with a bias or with padded rows (N not a multiple of 8)."""
        return None if self.bias is not None or self.out_features % 8 else self.packed()

    def dequantize(self) -> torch.Tensor:
        return self.weight_blocks().dequantize()                            # (N, K) fp32

    def _output(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The op's (M, 8G) output as (..., N) in x's dtype, plus the bias."""
        if y.shape[1] != self.out_features:                               # padded rows
            y = y[:, :self.out_features].contiguous()                       # (M, N)
        y = y.view(*x.shape[:-1], self.out_features)                        # (..., N)
        y = y if x.dtype == torch.float32 else y.to(x.dtype)
        return y if self.bias is None else y + self.bias


class Q4Linear(BlockLinear):
    """y = x · Wᵀ (+ b) with W in 4-bit blocks (`Q4Blocks`), on torchllama's kernel
    `torch.ops.torchllama.q4_linear` (torchllama.kernels: int8 activations per block of 32,
    integer dot products; each output row is independent of the others, bit for bit).

    Shapes: x (..., in_features) float32 → (..., out_features) float32. Buffers (not
    persistent), in the kernels' packed layout (`pack_rows`; G = ⌈N/8⌉): codes (G, K/32, 128)
    uint8; d and m (`pack_q4_scales`): (G, K/32, 8) float16 where exact, else float32, or
    Q4_K's super-blocks (G, K/256, 80) uint8; m may be a float32 scalar c for m = c·d (Q4_0).
    """

    NAMES = ("codes", "d", "m")

    def __init__(self, weight: Q4Blocks, bias: Optional[torch.Tensor] = None):
        N, K = weight.shape
        self._init(N, K, [pack_rows(weight.codes, K // 32, 4), *pack_q4_scales(weight)], bias)

    def weight_blocks(self, rows: torch.Tensor | None = None) -> Q4Blocks:
        """The canonical blocks (a copy): every row, or the given (R,) row indices."""
        r = self.out_features if rows is None else rows
        d, d_factors = unpack_scales(self.d, r)
        m, m_factors = unpack_scales(self.m, r, d)
        return Q4Blocks(unpack_codes(self.codes, r), d, m, d_factors, m_factors)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)                                # (M, K)
        y = torch.ops.torchllama.q4_linear(x2 if x2.dtype == torch.float32 else x2.float(),
                                        self.codes, self.d, self.m)  # (M, 8G) fp32
        return self._output(x, y)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q4 blocks"


class Q8Linear(BlockLinear):
    """y = x · Wᵀ (+ b) with W in int8 blocks (`Q8Blocks`, B = 32 or 16), on
    `torch.ops.torchllama.q8_linear` (see `Q4Linear`).

    Shapes: x (..., in_features) float32 → (..., out_features) float32. Buffers (not
    persistent), packed (`pack_rows`): codes (G, K/32, 256) int8, or (G, K/32, 192) in 6 bits
    where every code is in [−32, 31] (`pack_six`: Q6_K, Q5_0), d (`pack_scales`): (G, K/B, 8)
    float16 where exact, else float32, or Q6_K's super-blocks (G, K/256, 144) int8; small: a
    bool scalar, every |code| ≤ 32 (Q6_K, Q5_0), which lets the kernel sum longer in int16 (the
    same bits either way).
    """

    NAMES = ("codes", "d", "small")

    def __init__(self, weight: Q8Blocks, bias: Optional[torch.Tensor] = None):
        N, K = weight.shape
        span = _code_range(weight.codes)
        if _six_bit(span):
            codes = pack_rows_six(weight.codes, K // 32)                    # (G, K/32, 192)
        else:
            codes = pack_rows(weight.codes, K // 32, 4)                     # (G, K/32, 256)
        self._init(N, K, [codes, pack_scales(weight.d, weight.d_factors),
                          torch.tensor(_small(span))], bias)

    @property
    def block(self) -> int:
        """Weights per scale: 32, or 16 (Q6_K; its super-block form is only ever that)."""
        floats = self.d.dtype in (torch.float32, torch.float16)
        return 32 if floats and self.d.shape[1] == self.in_features // 32 else 16

    @staticmethod
    def small_codes(codes: torch.Tensor) -> torch.Tensor:
        """The `small` flag of int8 codes (N, K): a bool scalar tensor, true when every code
        is within ±32 (and there is at least one)."""
        return torch.tensor(_small(_code_range(codes)))

    def weight_blocks(self, rows: torch.Tensor | None = None) -> Q8Blocks:
        """The canonical blocks (a copy): every row, or the given (R,) row indices."""
        r = self.out_features if rows is None else rows
        return Q8Blocks(unpack_codes(self.codes, r), *unpack_scales(self.d, r))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)                                # (M, K)
        y = torch.ops.torchllama.q8_linear(x2 if x2.dtype == torch.float32 else x2.float(),
                                        self.codes, self.d, bool(self.small))  # (M, 8G)
        return self._output(x, y)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"q8 blocks of {self.block}")


def _code_range(codes: torch.Tensor) -> tuple[int, int]:
    """(min, max) of int8 codes in one pass; int8's whole range for none (no narrower form)."""
    if codes.numel() == 0:
        return -128, 127
    lo, hi = torch.aminmax(codes)
    return int(lo), int(hi)


def _six_bit(span: tuple[int, int]) -> bool:
    """Codes of this (min, max) all lie in [−32, 31] (Q6_K's, Q5_0's): the kernels keep them in
    6 bits (`pack_six`: 0.75× the bytes, the same products)."""
    return span[0] >= -32 and span[1] <= 31


def _small(span: tuple[int, int]) -> bool:
    """Codes of this (min, max) are within ±32: `Q8Linear`'s `small` flag."""
    return span[0] >= -32 and span[1] <= 32


class BlockEmbedding(nn.Module):
    """Token embeddings looked up in a block table, dequantized row by row: (B, T) int64 ids →
    (B, T, dim) float32. The table is the tied output projection's (a `Q4Linear` / `Q8Linear`:
    its packed buffers shared, one copy in memory, only the ids' rows read) or its own
    (`Q4Blocks` / `Q8Blocks`, kept as they are)."""

    def __init__(self, weight: BlockWeight | BlockLinear):
        super().__init__()
        self.packed = isinstance(weight, BlockLinear)
        if self.packed:
            self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
            self.bits = 4 if isinstance(weight, Q4Linear) else 8
            tensors = weight.packed()
        else:
            self.num_embeddings, self.embedding_dim = weight.shape
            self.bits = 4 if isinstance(weight, Q4Blocks) else 8
            tensors = [weight.codes, weight.d] + ([weight.m] if self.bits == 4 else [])
        for name, t in zip(("codes", "d", "m") if self.bits == 4 else ("codes", "d"), tensors):
            self.register_buffer(name, t, persistent=False)

    def _rows(self, flat: torch.Tensor) -> BlockWeight:
        """The blocks of rows `flat` (R,): read from the packed table, or indexed."""
        if not self.packed:
            if self.bits == 4:
                return Q4Blocks(self.codes[flat], self.d[flat], self.m[flat])
            return Q8Blocks(self.codes[flat], self.d[flat])
        codes = unpack_codes(self.codes, flat)                              # (R, K/2 or K)
        d = unpack_scales(self.d, flat)[0]                                  # (R, nd)
        if self.bits == 4:
            return Q4Blocks(codes, d, unpack_scales(self.m, flat, d)[0])
        return Q8Blocks(codes, d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1)                                           # (B·T,)
        rows = self._rows(flat)
        return rows.dequantize().view(*tokens.shape, self.embedding_dim)    # (B, T, D)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q{self.bits} blocks"


class QuantizedEmbedding(nn.Module):
    """Token embeddings looked up in a quantized table (the tied output projection's, or its
    own), dequantized row by row: (B, T) int64 ids → (B, T, dim) float32.

    int8 keeps the (V, D) codes and (V,) scales; int4 keeps the codes two per byte, (V, D/2)
    uint8 (low nibble: even column), with (V, D/G) scales and zeros.
    """

    def __init__(self, weight: QuantizedWeight, shared: Optional[Int8Linear] = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.bits = 8 if isinstance(weight, Int8Weight) else 4
        if self.bits == 8:
            # a tied Int8Linear's codes serve as the table (one copy in memory)
            self.register_buffer("codes", shared.weight_int8 if shared is not None
                                 else weight.q.contiguous(), persistent=False)
            self.register_buffer("scale", weight.scale.float(), persistent=False)  # (V,)
        else:
            q = weight.q.view(self.num_embeddings, -1, 2)                   # (V, D/2, 2)
            self.register_buffer("codes", q[..., 0] | (q[..., 1] << 4), persistent=False)
            self.register_buffer("scale", weight.scale.float(), persistent=False)  # (V, D/G)
            self.register_buffer("zero", weight.zero.float(), persistent=False)
            self.group_size = weight.group_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        codes = self.codes[tokens]                                          # (B, T, D | D/2)
        if self.bits == 8:
            return codes.float() * self.scale[tokens][..., None]            # (B, T, D)
        q = torch.stack([codes & 15, codes >> 4], dim=-1).float()           # (B, T, D/2, 2)
        G, D = self.group_size, self.embedding_dim
        q = q.view(*tokens.shape, D // G, G) - 8                            # (B, T, D/G, G)
        w = q * self.scale[tokens][..., None] + self.zero[tokens][..., None]
        return w.view(*tokens.shape, D)                                     # (B, T, D)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int{self.bits}"


def quantized_linear(weight: QuantizedWeight, bias: Optional[torch.Tensor] = None) -> nn.Module:
    """The module for a quantized weight. Block weights run on torchllama's kernels
    (`Q4Linear` / `Q8Linear`) where they are available (`torchllama.kernels.available()`),
    otherwise on torch's: `Int4Linear` (Q4 blocks as int4 G = 32, the codes unchanged) or
    `Int8Linear` (Q8 blocks re-quantized per row; also Q4 blocks whose N is not a multiple of
    16, which torch's int4 kernel needs)."""
    from torchllama import kernels

    if isinstance(weight, (Q4Blocks, Q8Blocks)):
        if kernels.available():
            return (Q4Linear if isinstance(weight, Q4Blocks) else Q8Linear)(weight, bias)
        if isinstance(weight, Q4Blocks) and weight.shape[0] % 16 == 0:
            weight = weight.to_int4()
        else:
            weight = (Q8Blocks.from_float(weight.dequantize()) if isinstance(weight, Q4Blocks)
                      else weight).to_int8()
    return Int8Linear(weight, bias) if isinstance(weight, Int8Weight) else Int4Linear(weight, bias)


def quantized_embedding(weight: QuantizedWeight, linear: Optional[nn.Module] = None) -> nn.Module:
    """Token embeddings from a quantized table: the tied output projection's `linear` (its
    buffers shared), or `weight` alone."""
    if isinstance(linear, BlockLinear):
        return BlockEmbedding(linear)
    if isinstance(linear, Int8Linear):
        return QuantizedEmbedding(Int8Weight(linear.weight_int8, linear.scale_fp32), linear)
    if isinstance(weight, (Q4Blocks, Q8Blocks)):
        return BlockEmbedding(weight)
    return QuantizedEmbedding(weight)


# --------------------------------------------------------------------------------------------
# Applying quantization to a model
# --------------------------------------------------------------------------------------------

def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def install_quantized(model: nn.Module, weights: dict[str, QuantizedWeight],
                      biases: dict[str, torch.Tensor]) -> None:
    """Swap the modules whose weights are given (our names, "….weight") for quantized ones.

    `output.weight` of a tied model (args.tie_embeddings) also gives the token embeddings, read
    from the same integers (`QuantizedEmbedding`); `tok_embeddings.weight` alone (untied) gives
    a `QuantizedEmbedding` of its own.

    Args:
        model: a `Transformer` (on any device, including meta: its float parameters are
            untouched).
        weights: our parameter name → quantized weight, or the module already built from one
            (`quantized_linear`, without a bias; for a tied output projection only a
            `BlockLinear`, whose table serves the embeddings: then `tok_embeddings.weight`
            may be that module too, and is not read).
        biases: our bias names → float tensors, for the quantized linears that have one.
    """
    tied = getattr(model.args, "tie_embeddings", False) and "output.weight" in weights
    for name, weight in weights.items():
        module_name = name.removesuffix(".weight")
        if module_name == "tok_embeddings":
            if not tied:                       # else the tied output's table serves (below)
                model.tok_embeddings = quantized_embedding(weight)
            continue
        linear = weight if isinstance(weight, nn.Module) else \
            quantized_linear(weight, biases.get(module_name + ".bias"))
        _set_module(model, module_name, linear)
        if module_name == "output" and tied:
            model.tok_embeddings = quantized_embedding(weight, linear)
    fuse_projections(model)
    stack_experts(model)
    fuse.install(model)                  # blocks the one-op path computes take it


def _side_by_side(tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensor whose consecutive slices along dim 0 these are (contiguous views of one
    buffer, each starting where the one before ends), or None."""
    first, end = tensors[0], tensors[0].storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or \
                not t.is_contiguous() or t.storage_offset() != end:
            return None
        end += t.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]),
                            first.stride())                                  # no copy


def fuse_rows(linears: list[nn.Module]) -> Optional[nn.Module]:
    """One block linear whose output is the given linears' outputs side by side (their weight
    rows stacked), or None unless all are `Q4Linear`s, or all `Q8Linear`s, with the same scale
    layout and dtype, whole groups of 8 rows (the packed layout), and all or none with a bias.
    The parts keep working: their buffers become views of the fused ones (no second copy).
    Parts that already lie side by side in one buffer (`fused_linears`) are not copied.

    Each output row of the kernels depends only on its weight row and the activation row
    (blocks.cpp), so the fused product equals the separate ones bit for bit; it quantizes the
    activations once and wakes the threads once instead of once per part."""
    first = linears[0]
    if not isinstance(first, BlockLinear) or \
            any(type(lin) is not type(first) or lin.out_features % 8 for lin in linears):
        return None
    names = first.NAMES[:2] + (("m",) if isinstance(first, Q4Linear) else ())
    for lin in linears:
        for n in names:
            a, b = getattr(lin, n), getattr(first, n)
            if a.dtype != b.dtype or a.dim() != b.dim() or a.shape[1:] != b.shape[1:] or \
                    (a.dim() == 0 and not torch.equal(a, b)):            # m = c·d: one c
                return None
    if len({lin.bias is None for lin in linears}) > 1:
        return None
    parts = []
    for n in names:
        tensors = [getattr(lin, n) for lin in linears]
        if tensors[0].dim() == 0:                                          # the shared c
            parts.append(tensors[0])
            continue
        joined = _side_by_side(tensors)
        if joined is None:                          # streamed once a token: on huge pages
            joined = torch.cat(tensors, out=huge_pages.empty(
                (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), tensors[0].dtype))
        parts.append(joined)                                                # (ΣG, ·, ·)
    if isinstance(first, Q8Linear):                         # small where every part is
        parts.append(torch.tensor(all(bool(lin.small) for lin in linears)))
    bias = None if first.bias is None else torch.cat([lin.bias for lin in linears])
    N = sum(lin.out_features for lin in linears)
    fused = type(first).from_packed(N, first.in_features, parts, bias)
    start = 0
    for lin in linears:
        rows = slice(start, start + lin.out_features)
        groups = slice(rows.start // 8, rows.stop // 8)
        for n in names:
            if getattr(fused, n).dim():
                setattr(lin, n, getattr(fused, n)[groups])     # (G_i, ·, ·) view
        if bias is not None:
            lin.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
        start = rows.stop
    return fused


def _scale_forms(weight: BlockWeight) -> tuple:
    """The forms the packed d (and m) of a weight take (`_form`, `_q4_forms`)."""
    if isinstance(weight, Q8Blocks):
        return (_form(weight.d, weight.d_factors),)
    return _q4_forms(weight)


def fused_linears(weight: BlockWeight, sizes: list[int]) -> Optional[list[BlockLinear]]:
    """The block linears of consecutive row ranges of `weight` (`sizes` rows each), as
    `fuse_rows` leaves linears built apart: each a module over views of one module's buffers,
    which is built (packed) once over every row. Nothing is built apart and copied together
    (a 7B model: 2.3 GB less copying, and no freed parts left in the allocator's free lists).

    Returns:
        [the module of all rows, the part modules…], or None where `fuse_rows` would not fuse
        them (no kernels, a part that is not whole groups of 8 rows, or parts whose scales
        would be packed in different forms, `_scale_forms`, or codes in 6 and in 8 bits):
        then build them apart.
    """
    from torchllama import kernels

    if not kernels.available() or any(n % 8 for n in sizes):
        return None
    q4 = isinstance(weight, Q4Blocks)
    bounds = list(zip(np.cumsum([0] + sizes[:-1]).tolist(), np.cumsum(sizes).tolist()))
    forms = _scale_forms(weight)          # a part of float16, super-block or c·d scales is so
    if torch.float32 in forms and any(_scale_forms(w) != forms for w in weight.split_rows(sizes)):
        return None                           # too; of float32 ones it may be float16 alone
    spans = [] if q4 else [_code_range(weight.codes[a:b]) for a, b in bounds]   # per part
    if len({_six_bit(span) for span in spans}) > 1:
        return None                           # codes in 6 bits and in 8
    fused = quantized_linear(weight)                                  # Q4Linear / Q8Linear
    parts = []
    for i, (a, b) in enumerate(bounds):
        packed = [t[a // 8:b // 8] if t.dim() else t                    # (G_i, ·, ·), or c
                  for t in fused.packed()[:3 if q4 else 2]]
        if not q4:                                    # as `Q8Linear` decides it, per part
            packed.append(torch.tensor(_small(spans[i])))
        parts.append(type(fused).from_packed(b - a, fused.in_features, packed))
    return [fused] + parts


#: What `fuse_projections` fuses: (a layer's submodule, its linears in row order, the fused
#: module's name).
FUSED_PROJECTIONS = (("attention", ("wq", "wk", "wv"), "wqkv"),
                     ("feed_forward", ("w1", "w3"), "w13"))


def fusion_groups(names: set[str]) -> list[tuple[str, ...]]:
    """Our weight names that `fuse_projections` fuses, per layer and product, among `names`:
    ("layers.0.attention.wq.weight", "…wk.weight", "…wv.weight"), ("layers.0.feed_forward.w1
    .weight", "…w3.weight"), …, where every one of a group is there."""
    groups = []
    for name in sorted(names):
        for sub, linears, _ in FUSED_PROJECTIONS:
            suffix = f".{sub}.{linears[0]}.weight"
            if name.startswith("layers.") and name.endswith(suffix):
                group = tuple(f"{name[:-len(suffix)]}.{sub}.{n}.weight" for n in linears)
                if all(n in names for n in group):
                    groups.append(group)
    return groups


def fuse_projections(model: nn.Module) -> None:
    """Where the kernels run the projections, give each attention layer one product for q, k
    and v (`attention.wqkv`) and each gated feed-forward one for its gate and up projections
    (`feed_forward.w13`), as llama.cpp and gpt-fast fuse them: one activation quantization and
    one thread split instead of three (`torchllama bench decode` measures the step)."""
    for layer in getattr(model, "layers", ()):
        for sub, linears, fused in FUSED_PROJECTIONS:
            module = getattr(layer, sub)
            if all(hasattr(module, n) for n in linears):
                setattr(module, fused, fuse_rows([getattr(module, n) for n in linears]))


class ExpertsProduct:
    """One projection of every expert of a mixture of experts, as one block linear of the
    experts' matrices stacked (E·N rows): `(x (M, K), tokens (R,), experts (R,)) → (R, N)`,
    row r = x[tokens[r]] · W_{experts[r]}ᵀ, on `torch.ops.torchllama.q4_linear_experts` /
    `q8_linear_experts` (kernels/csrc/blocks.cpp: llama.cpp's MUL_MAT_ID; each row the same
    bits as that expert's own `BlockLinear`)."""

    def __init__(self, stacked: "BlockLinear", n_experts: int):
        self.stacked, self.n_experts = stacked, n_experts

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor
                 ) -> torch.Tensor:
        w = self.stacked
        op = torch.ops.torchllama.q4_linear_experts if isinstance(w, Q4Linear) else \
            torch.ops.torchllama.q8_linear_experts
        return op(x.float(), tokens, experts, self.n_experts, *w.packed())        # (R, N)


class StackedExperts:
    """A mixture of experts' w1, w3 and w2 as `ExpertsProduct`s (`MoE.stacked`), valid while
    the experts' modules are the ones stacked (`serves`: a LoRA wrapper put on an expert since,
    e.g. QLoRA or a served adapter, sends the MoE back to its expert-by-expert path)."""

    def __init__(self, w1: ExpertsProduct, w3: ExpertsProduct, w2: ExpertsProduct,
                 experts: nn.ModuleList):
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.parts = {name: [e._modules[name] for e in experts] for name in ("w1", "w3", "w2")}
        self._answer: Optional[tuple[int, nn.ModuleList, bool]] = None   # (version, experts, …)

    def serves(self, experts: nn.ModuleList) -> bool:
        """Whether every expert's w1, w3, w2 are still the modules stacked. Asked every
        forward: the last answer stands while no module was assigned anywhere since
        (`structure.version`), else the experts' `_modules` are read again (at C speed)."""
        now = structure.version()
        if self._answer is not None and self._answer[0] == now and self._answer[1] is experts:
            return self._answer[2]
        modules = [e._modules for e in experts]
        answer = all(all(map(operator.is_, map(operator.itemgetter(name), modules), stacked))
                     for name, stacked in self.parts.items())
        self._answer = (now, experts, answer)
        return answer


def stack_experts(model: nn.Module) -> int:
    """Give every mixture of experts (`torchllama.nn.moe.MoE`) whose experts' matrices are all
    block linears of one kind and layout (`fuse_rows`) its `stacked` products: a layer's
    gate, up and down projections of every (token, expert) pair in three ops instead of three
    per expert used. The experts' own modules become views of the stacked buffers (no copy
    where they already lie side by side: a GGUF's 3-D `ffn_*_exps`). Returns how many.

    Stacked, a layer's products read each expert's weights once for all the tokens sent to it
    (llama.cpp's MUL_MAT_ID); `torchllama bench decode` on the OLMoE shape measures it (the
    quantized-weights guide, "Mixture of experts on the kernels")."""
    from torchllama.nn.moe import MoE

    n = 0
    for module in model.modules():
        if not isinstance(module, MoE) or any(b is not None for e in module.experts
                                                 for b in (e.w1.bias, e.w2.bias, e.w3.bias)):
            continue
        products = [fuse_rows([getattr(e, name) for e in module.experts])
                    for name in ("w1", "w3", "w2")]
        if all(isinstance(p, BlockLinear) for p in products):
            module.stacked = StackedExperts(*(ExpertsProduct(p, module.n_experts)
                                              for p in products), module.experts)
            n += 1
    return n


def quantize_model(model: nn.Module, scheme: Scheme | str) -> nn.Module:
    """Quantize a float model's linear layers in place (weight-only): every `nn.Linear` whose
    shape the kernels take (`fits`), the output projection in int8 at least (`scheme_for`), and,
    when it is tied to the token embeddings, both from one quantized table.

    Args:
        model: a `Transformer` with float weights on the CPU.
        scheme: a Scheme or its name ('int8', 'int4', 'int4-g128', ...).

    Returns:
        The model (changed in place); layers that do not fit stay float.

    Raises:
        ArgumentError: an unknown scheme name.
    """
    if isinstance(scheme, str):
        parsed = parse_scheme(scheme)
        if parsed is None:
            raise ArgumentError(f"unknown quantization {scheme!r}; use int8, int4 or int4-gG")
        scheme = parsed
    weights, biases = {}, {}
    for name, module in model.named_modules():
        if name.endswith(".feed_forward.gate"):   # a mixture of experts' router stays float
            continue                              # (llama.cpp's mixes keep ffn_gate_inp F32:
        chosen = scheme_for(name + ".weight", scheme)  # tiny, and top-k choices are sensitive)
        if isinstance(module, nn.Linear) and fits(module.weight.shape, chosen):
            weights[name + ".weight"] = quantize_weight(module.weight.detach(), chosen)
            if module.bias is not None:
                biases[name + ".bias"] = module.bias.detach()
    install_quantized(model, weights, biases)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each storage counted once; KV caches
    excluded): the resident size of its weights."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "kv_cache" in name or t.device.type == "meta":
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
