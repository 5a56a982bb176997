"""The block modules: `Q4Linear` and `Q8Linear` run a kernel form's product on torchllama's
kernels (`torch.ops.torchllama.q4_linear`, `q8_linear`), over buffers in the packed layout
(blocks.packing); `BlockEmbedding` looks tokens up in such a table. `WeightOnlyLinear` is the base
of every weight-only linear (these and transforms.quantize's torch fallbacks): the fast product
without autograd, and QLoRA's gradient of the input through the frozen weight.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from torchllama.blocks.forms import BlockWeight, HalfMatrix, Q4Blocks, Q8Blocks
from torchllama.blocks.packing import (is_pair_form, pack_pair_scales, pack_q4_codes,
                                       pack_q4_scales, pack_rows, pack_rows_six, pack_scales,
                                       pack_two, unpack_codes, unpack_high, unpack_lut_indices,
                                       unpack_pair_scales, unpack_scales)


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
    uint8, or (G, K/32, 160) for 5-bit codes (`pack_q4_codes`: Q5_1, Q5_K); d and m
    (`pack_q4_scales`): (G, K/32, 8) float16 where exact, else float32, or the K-quants'
    super-blocks (G, K/256, 80) uint8; m may be a float32 scalar c for m = c·d (Q4_0).
    """

    NAMES = ("codes", "d", "m")

    def __init__(self, weight: Q4Blocks, bias: Optional[torch.Tensor] = None):
        N, K = weight.shape
        self._init(N, K, [pack_q4_codes(weight), *pack_q4_scales(weight)], bias)

    def weight_blocks(self, rows: torch.Tensor | None = None) -> Q4Blocks:
        """The canonical blocks (a copy): every row, or the given (R,) row indices."""
        r = self.out_features if rows is None else rows
        d, d_factors = unpack_scales(self.d, r)
        m, m_factors = unpack_scales(self.m, r, d)
        return Q4Blocks(unpack_codes(self.codes, r), d, m, d_factors, m_factors,
                        unpack_high(self.codes, r))

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
    persistent), packed (`pack_rows`): codes (G, K/32, 256) int8; or (G, K/32, 128), 4-bit
    indices into a table of 16 values (`Q8Blocks.lut`: IQ4_NL, IQ4_XS, Q3_K); or (G, K/32, 192)
    in 6 bits where every code is in [−32, 31] (`pack_six`: Q6_K, Q5_0); or (G, K/32, 64) in 2
    bits where every code is in [0, 3] (`pack_two`: Q2_K); d (`pack_scales`): (G, K/B, 8)
    float16 where exact, else float32, or int8 super-blocks (G, K/256, 16 + 8·S); with offsets
    (`Q8Blocks.m`: Q2_K) d and m in one buffer (G, K/256, 160) uint8 (`pack_pair_scales`);
    small: a bool scalar, every |code| ≤ 32 (Q6_K, Q5_0), which lets the kernel sum longer in
    int16 (the same bits either way), or with 4-bit codes the (16,) int8 table.
    """

    NAMES = ("codes", "d", "small")

    def __init__(self, weight: Q8Blocks, bias: Optional[torch.Tensor] = None):
        N, K = weight.shape
        if weight.lut is not None:                                   # 4-bit indices, as Q4's
            codes = pack_rows(weight.codes, K // 32, 4).view(torch.int8)    # (G, K/32, 128)
            small = weight.lut.to(torch.int8).contiguous()                   # (16,)
        else:
            span = _code_range(weight.codes)
            if _two_bit(span):
                codes = pack_two(pack_rows(weight.codes, K // 32, 4))       # (G, K/32, 64)
            elif _six_bit(span):
                codes = pack_rows_six(weight.codes, K // 32)                # (G, K/32, 192)
            else:
                codes = pack_rows(weight.codes, K // 32, 4)                 # (G, K/32, 256)
            small = torch.tensor(_small(span))
        self._init(N, K, [codes, _pack_q8_scales(weight), small], bias)

    @property
    def block(self) -> int:
        """Weights per scale: 32, or 16 (Q6_K, Q3_K)."""
        nd = self.d.shape[1]
        if is_pair_form(self.d):                                           # scales and offsets
            nd *= 16
        elif self.d.dtype not in (torch.float32, torch.float16):           # super-blocks
            nd *= (self.d.shape[2] - 16) // 8
        return self.in_features // nd

    @property
    def lut(self) -> Optional[torch.Tensor]:
        """The (16,) int8 table of 4-bit codes, or None."""
        return self.small if self.small.dim() == 1 else None

    @staticmethod
    def small_codes(codes: torch.Tensor) -> torch.Tensor:
        """The `small` flag of int8 codes (N, K): a bool scalar tensor, true when every code
        is within ±32 (and there is at least one)."""
        return torch.tensor(_small(_code_range(codes)))

    def weight_blocks(self, rows: torch.Tensor | None = None) -> Q8Blocks:
        """The canonical blocks (a copy): every row, or the given (R,) row indices."""
        r = self.out_features if rows is None else rows
        lut = self.lut
        codes = unpack_codes(self.codes, r) if lut is None else unpack_lut_indices(self.codes, r)
        if is_pair_form(self.d):
            d, d_factors, m, m_factors = unpack_pair_scales(self.d, r)
            return Q8Blocks(codes, d, d_factors, m=m, m_factors=m_factors)
        return Q8Blocks(codes, *unpack_scales(self.d, r), lut)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)                                # (M, K)
        y = torch.ops.torchllama.q8_linear(x2 if x2.dtype == torch.float32 else x2.float(),
                                           self.codes, self.d, self.small)  # (M, 8G)
        return self._output(x, y)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"q8 blocks of {self.block}")


def _pack_q8_scales(weight: Q8Blocks) -> torch.Tensor:
    """Q8's packed d (`pack_scales`), or with offsets d and m in one buffer (`pack_pair_scales`).

    Raises:
        ValueError: offsets not given as the products the kernels take (Q2_K's factors, 16
            sub-blocks of at most 4 bits a super-block).
    """
    if weight.m is None:
        return pack_scales(weight.d, weight.d_factors)
    f = (weight.d_factors, weight.m_factors)
    if any(x is None or x.sub.dtype != torch.uint8 or x.sub.shape[1] != 16 * x.super.shape[1]
           or (x.sub.numel() and int(x.sub.max()) > 15) for x in f):
        raise ValueError("Q8 blocks with offsets need the scales and offsets as products of "
                         "a float16 and 4-bit integers, 16 a super-block (Q2_K's)")
    return pack_pair_scales(*f)


def _two_bit(span: tuple[int, int]) -> bool:
    """Codes of this (min, max) all lie in [0, 3] (Q2_K's): the kernels keep them in 2 bits."""
    return span[0] >= 0 and span[1] <= 3


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
            names, tensors = weight.NAMES, weight.packed()            # codes, d, m | small
        else:
            self.num_embeddings, self.embedding_dim = weight.shape
            self.bits = 4 if isinstance(weight, Q4Blocks) else 8
            names = ("codes", "d", "m", "high") if self.bits == 4 else ("codes", "d", "m", "lut")
            tensors = [weight.codes, weight.d, weight.m,                # 5th bits | 4-bit
                       weight.high if self.bits == 4 else weight.lut]   # indices' table
        for name, t in zip(names, tensors):
            self.register_buffer(name, t, persistent=False)

    def _rows(self, flat: torch.Tensor) -> BlockWeight:
        """The blocks of rows `flat` (R,): read from the packed table, or indexed."""
        if not self.packed:
            if self.bits == 4:
                high = None if self.high is None else self.high[flat]
                return Q4Blocks(self.codes[flat], self.d[flat], self.m[flat], high=high)
            return Q8Blocks(self.codes[flat], self.d[flat], lut=self.lut,
                            m=None if self.m is None else self.m[flat])
        if self.bits == 8 and is_pair_form(self.d):                         # with offsets
            d, _, m, _ = unpack_pair_scales(self.d, flat)
            return Q8Blocks(unpack_codes(self.codes, flat), d, m=m)
        d = unpack_scales(self.d, flat)[0]                                  # (R, nd)
        if self.bits == 4:
            return Q4Blocks(unpack_codes(self.codes, flat), d, unpack_scales(self.m, flat, d)[0],
                            high=unpack_high(self.codes, flat))
        if self.small.dim() == 1:                                           # 4-bit indices
            return Q8Blocks(unpack_lut_indices(self.codes, flat), d, lut=self.small)
        return Q8Blocks(unpack_codes(self.codes, flat), d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1)                                           # (B·T,)
        rows = self._rows(flat)
        return rows.dequantize().view(*tokens.shape, self.embedding_dim)    # (B, T, D)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q{self.bits} blocks"


class HalfLinear(WeightOnlyLinear):
    """y = x · Wᵀ (+ b) with W kept in half precision as the file stores it (`HalfMatrix`: GGUF's
    F16 and BF16 matrices), on torchllama's `f32_linear`, which converts each weight to float32
    exactly as it loads it: the float32 weights' bits, in half their bytes.

    Shapes: x (..., in_features) float32 → (..., out_features) float32. Buffer (not
    persistent): weight (N, K) float16 or bfloat16, row-major.
    """

    def __init__(self, weight: HalfMatrix, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.values.contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float()                                          # (N, K) fp32

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)                                # (M, K)
        y = torch.ops.torchllama.f32_linear(x2 if x2.dtype == torch.float32 else x2.float(),
                                            self.weight)                    # (M, N) fp32
        y = y.view(*x.shape[:-1], self.out_features)
        y = y if x.dtype == torch.float32 else y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{str(self.weight.dtype).removeprefix('torch.')}")


class HalfEmbedding(nn.Module):
    """Token embeddings looked up in a half-precision table (a `HalfMatrix`, or the tied output
    projection's `HalfLinear` weight, shared): (B, T) int64 ids → (B, T, dim) float32."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.shape
        self.register_buffer("weight", table, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight[tokens].float()                                  # (B, T, D)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"{str(self.weight.dtype).removeprefix('torch.')}")
