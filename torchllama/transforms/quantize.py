"""Weight-only quantization: linear layers whose weights stay 4 or 8 bits wide in memory.

Decode reads every weight once per token and does little arithmetic with each, so it is bound by
memory bandwidth: SmolLM2-135M reads 540 MB per token in float32, ~97 MB as its GGUF's blocks.

The canonical forms are GGUF's block formats (torchllama.blocks: the registry of file types, the
forms each lands in, the packed layout and the block modules):

    Q4Blocks:  w[n, k] = d[n, b] · q[n, k] + m[n, b]     q ∈ [0, 15],   b = k // 32
    Q8Blocks:  w[n, k] = d[n, b] · q[n, k]               q ∈ [-128, 127], b = k // B (B = 32 or 16)

They run on torchllama's own kernels (`torchllama.blocks.linear`: `Q4Linear`, `Q8Linear`, int8
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

import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchllama.errors import ArgumentError
from torchllama.blocks.forms import (BlockWeight, HalfMatrix, Int4Weight, Int8Weight, Q4Blocks,
                                     Q8Blocks, QuantizedWeight)
from torchllama.blocks.linear import (BlockEmbedding, BlockLinear, HalfEmbedding, HalfLinear,
                                      Q4Linear, Q8Linear, WeightOnlyLinear)
from torchllama.transforms import fuse

#: Group sizes `_weight_int4pack_mm_for_cpu` accepts.
INT4_GROUP_SIZES = (32, 64, 128, 256)
#: The activation dtype of the quantized matmuls (see the module docstring).
COMPUTE_DTYPE = torch.bfloat16


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


# --------------------------------------------------------------------------------------------
# The kernels' packed layout (kernels/csrc/blocks_impl.h): rows in groups of 8, interleaved
# `chunk` bytes at a time within each block, so one 32-byte load holds 4 weights of 8 rows
# --------------------------------------------------------------------------------------------


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

    if isinstance(weight, HalfMatrix):                      # F16 / BF16 as stored
        return HalfLinear(weight, bias) if kernels.available() else \
            Int8Linear(Int8Weight.from_float(weight.dequantize()), bias)
    if isinstance(weight, (Q4Blocks, Q8Blocks)):
        if kernels.available():
            return (Q4Linear if isinstance(weight, Q4Blocks) else Q8Linear)(weight, bias)
        if isinstance(weight, Q4Blocks) and weight.shape[0] % 16 == 0 and weight.high is None:
            weight = weight.to_int4()
        else:
            weight = (Q8Blocks.from_float(weight.dequantize()) if isinstance(weight, Q4Blocks)
                      else weight).to_int8()
    return Int8Linear(weight, bias) if isinstance(weight, Int8Weight) else Int4Linear(weight, bias)


def quantized_embedding(weight: QuantizedWeight | BlockLinear,
                        linear: Optional[nn.Module] = None) -> nn.Module:
    """Token embeddings from a quantized table: the tied output projection's `linear` (its
    buffers shared), or `weight` alone (a block module's packed table too: the loader packs an
    untied table as it packs a linear's)."""
    if isinstance(weight, BlockLinear) and linear is None:
        return BlockEmbedding(weight)
    if isinstance(linear, BlockLinear):
        return BlockEmbedding(linear)
    if isinstance(linear, HalfLinear):
        return HalfEmbedding(linear.weight)
    if isinstance(weight, HalfMatrix):
        return HalfEmbedding(weight.values)
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
    fuse.fuse_projections(model)
    fuse.stack_experts(model)
    fuse.install(model)                  # blocks the one-op path computes take it


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
