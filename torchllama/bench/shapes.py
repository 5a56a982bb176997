"""Random-weight GGUF files of real model shapes, for benchmarks at real sizes
(`torchllama bench shapes`).

Shapes (`SHAPES`; sources: each model's published config.json):

    1b     Llama 3.2 1B: dim 2048, 16 layers, 32/8 heads, FFN 8192, θ 500000, tied embeddings
    3b     Llama 3.2 3B: dim 3072, 28 layers, 24/8 heads, FFN 8192, θ 500000, tied embeddings
    7b     Llama 2 7B:   dim 4096, 32 layers, 32/32 heads, FFN 11008, θ 10000, untied
    8b     Llama 3.1 8B: dim 4096, 32 layers, 32/8 heads, FFN 14336, θ 500000, untied
    olmoe-1b-7b  OLMoE-1B-7B (preset `olmoe-1b-7b`; llama.cpp's `olmoe` architecture): dim
           2048, 16 layers, 16/16 heads, QK-norm over the projections, 64 experts of 1024
           per layer, 8 per token; 6.9B parameters, 1.3B active per token, untied
    qwen3-30b-a3b-2l  Qwen3-30B-A3B's layers (`qwen3moe`: dim 2048, 32/4 heads of 128, QK-norm,
           128 experts of 768, 8 per token, renormalized), 2 of its 48
    mixtral-8x7b-2l   Mixtral 8x7B's layers (`llama` with experts: dim 4096, 32/8 heads, 8
           experts of 14336, 2 per token), 2 of its 32
    deepseek-v2-lite  DeepSeek-V2-Lite whole (`deepseek2`: MLA without query compression, a
           dense first layer, 64 experts of 1408, 6 per token, 2 shared; 15.7B parameters)
    tiny   a test shape: dim 256, 2 layers, 4/2 heads, FFN 512, tied

Every file carries SmolLM2's tokenizer (copied from the embedded SmolLM2-135M GGUF), so the
vocabulary is 49152 tokens, not the real models' (Llama 3: 128256, Llama 2: 32000): the
embedding and output matrices are smaller than the real ones (1B: 101M parameters each instead
of 263M; 7B: 201M instead of 131M). Llama 3's RoPE frequency scaling is not written (it changes
the rotation angles, not the work).

Types (`QUANT_TYPES`), with llama.cpp's choice of type per tensor (`tensor_type`). The
output projection (or the token embedding when tied to it) is Q6_K in every mix but q8_0; an
untied token embedding has the mix's base type. "more bits" layers are `use_more_bits`'s
(first and last eighth, every third between); n_gqa = query heads / key-value heads (1b 4,
3b 3, 7b 1, 8b 4, tiny 2):

    q4_0     Q4_0 matrices
    q4_k_m   Q4_K; attn_v and ffn_down Q6_K in the more-bits layers
    q8_0     Q8_0 everywhere (the output too)
    q5_k_m   Q5_K; attn_v and ffn_down Q6_K in the more-bits layers
    q5_k_s   Q5_K matrices
    q3_k_m   Q3_K; attn_v Q5_K in layers 0-1, Q4_K after; ffn_down Q5_K in the first
             n_layers/16 layers, Q4_K after; attn_output Q4_K
    q2_k     Q2_K; attn_v Q4_K when n_gqa ≥ 4, else Q3_K; ffn_down and attn_output Q3_K
    iq4_xs   IQ4_XS; attn_v Q5_K when n_gqa ≥ 4; ffn_down Q5_K in the first eighth of layers
    iq4_nl   IQ4_NL, with iq4_xs's exceptions
    q5_1     Q5_1 matrices
    q5_0     Q5_0 matrices

The new mixes (all but the first three) are written for the dense shapes only: the mixtures of
experts raise ArgumentError with them (llama.cpp's rules for experts differ).

Norms are float32 ~1; matrices are ~N(0, 0.02): Q4_0, Q5_0, Q5_1 and Q8_0 quantized from such
floats by `gguf.quants.quantize`; the K-quants and IQ4 types (which the `gguf` package cannot
quantize) written as random valid blocks — random codes and sub-scales — whose f16 scales give
values of that spread (`_q2_k_blocks`, `_q3_k_blocks`, `_q4_k_blocks`, `_q5_k_blocks`,
`_q6_k_blocks`, `_iq4_nl_blocks`, `_iq4_xs_blocks`); so are the experts' 3-D Q4_0 tensors
(`_q4_0_blocks`: 5.6B values, written ~10× faster than drawn and quantized). Files are written
tensor by tensor (peak memory: the largest tensor's bytes), atomically, into
`$TORCHLLAMA_CACHE/shapes/<shape>-<type>.gguf` and reused while their `torchllama.shapes.spec`
metadata matches (`ensure_shape_file`). Never commit them.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import gguf
import numpy as np

from torchllama.errors import ArgumentError

#: Bumped whenever the bytes a spec produces change (old cached files are then rewritten).
GENERATOR_VERSION = 1
SPEC_KEY = "torchllama.shapes.spec"
WEIGHT_STD = 0.02            # spread of every matrix's values (Llama's init std)
CHUNK_VALUES = 1 << 22       # values generated at a time (16 MiB of float32)
VOCAB_SIZE = 49152           # SmolLM2's tokenizer (checked against the copied token list)
T = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture model shape (sizes only; the weights are random).

    Attributes:
        name: the shape's name in `SHAPES` (and in file names).
        dim: model width.
        n_layers: decoder layers.
        n_heads: query heads (head_dim = dim / n_heads).
        n_kv_heads: key/value heads.
        hidden_dim: SwiGLU hidden size.
        rope_theta: RoPE base.
        tie_embeddings: the output projection is the token embedding (no output tensor).
        context_length: the model's trained context (`llama.context_length`).
        norm_eps: RMSNorm epsilon.
        model: what the shape is of, for tables.
        preset: a `torchllama.config` preset that gives the whole architecture (a mixture of
            experts: its experts, QK-norm; the fields above repeat its sizes, n_layers may
            keep fewer of its layers), written in its GGUF family's format; None: Llama's
            architecture from the fields above.
    """

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    rope_theta: float
    tie_embeddings: bool
    context_length: int
    norm_eps: float = 1e-5
    model: str = ""
    preset: Optional[str] = None


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("tiny", 256, 2, 4, 2, 512, 500000.0, True, 4096, model="test shape"),
    Shape("1b", 2048, 16, 32, 8, 8192, 500000.0, True, 131072, model="Llama 3.2 1B"),
    Shape("3b", 3072, 28, 24, 8, 8192, 500000.0, True, 131072, model="Llama 3.2 3B"),
    Shape("7b", 4096, 32, 32, 32, 11008, 10000.0, False, 4096, model="Llama 2 7B"),
    Shape("8b", 4096, 32, 32, 8, 14336, 500000.0, False, 131072, model="Llama 3.1 8B"),
    Shape("olmoe-1b-7b", 2048, 16, 16, 16, 1024, 10000.0, False, 4096, model="OLMoE-1B-7B",
          preset="olmoe-1b-7b"),
    Shape("qwen3-30b-a3b-2l", 2048, 2, 32, 4, 6144, 1000000.0, False, 40960, 1e-6,
          model="Qwen3-30B-A3B, 2 of 48 layers", preset="qwen3-30b-a3b"),
    Shape("mixtral-8x7b-2l", 4096, 2, 32, 8, 14336, 1000000.0, False, 32768,
          model="Mixtral 8x7B, 2 of 32 layers", preset="mixtral-8x7b"),
    Shape("deepseek-v2-lite", 2048, 27, 16, 16, 10944, 10000.0, False, 163840, 1e-6,
          model="DeepSeek-V2-Lite", preset="deepseek-v2-lite"),
)}

F = gguf.LlamaFileType
#: --type → (the type of most matrices, GGUF's general.file_type: llama.cpp's mix).
QUANT_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "q4_0": (T.Q4_0, F.MOSTLY_Q4_0),
    "q4_k_m": (T.Q4_K, F.MOSTLY_Q4_K_M),
    "q8_0": (T.Q8_0, F.MOSTLY_Q8_0),
    "q5_k_m": (T.Q5_K, F.MOSTLY_Q5_K_M),
    "q5_k_s": (T.Q5_K, F.MOSTLY_Q5_K_S),
    "q3_k_m": (T.Q3_K, F.MOSTLY_Q3_K_M),
    "q2_k": (T.Q2_K, F.MOSTLY_Q2_K),
    "iq4_xs": (T.IQ4_XS, F.MOSTLY_IQ4_XS),
    "iq4_nl": (T.IQ4_NL, F.MOSTLY_IQ4_NL),
    "q5_1": (T.Q5_1, F.MOSTLY_Q5_1),
    "q5_0": (T.Q5_0, F.MOSTLY_Q5_0),
}
#: The mixes written for the mixtures of experts too (`tensor_plan`).
EXPERT_TYPES = ("q4_0", "q4_k_m", "q8_0")


def get_shape(name: str) -> Shape:
    """The `SHAPES` entry called `name`.

    Raises:
        ArgumentError: an unknown name (the choices listed).
    """
    if name not in SHAPES:
        raise ArgumentError(f"--shape {name!r}: use one of {', '.join(SHAPES)}")
    return SHAPES[name]


def check_type(qtype: str) -> str:
    """`qtype` itself when it is one of `QUANT_TYPES`.

    Raises:
        ArgumentError: an unknown type (the choices listed).
    """
    if qtype not in QUANT_TYPES:
        raise ArgumentError(f"--type {qtype!r}: use one of {', '.join(QUANT_TYPES)}")
    return qtype


def model_args(shape: Shape):
    """The shape as our `ModelArgs` (SmolLM2's vocabulary of 49152 tokens)."""
    from torchllama.config import ModelArgs, get_preset

    if shape.preset is not None:
        return get_preset(shape.preset).replace(vocab_size=VOCAB_SIZE, n_layers=shape.n_layers)
    return ModelArgs(dim=shape.dim, n_layers=shape.n_layers, n_heads=shape.n_heads,
                     n_kv_heads=shape.n_kv_heads, vocab_size=VOCAB_SIZE,
                     hidden_dim=shape.hidden_dim, norm_eps=shape.norm_eps,
                     rope_theta=shape.rope_theta, max_seq_len=shape.context_length,
                     tie_embeddings=shape.tie_embeddings)



# ---------------------------------------------------------------------------------------------
# Which type each tensor gets: llama.cpp's rule
# ---------------------------------------------------------------------------------------------

def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the _M mixes: the first and last
    eighth, and every third layer between (src/llama-quant.cpp, `use_more_bits`)."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


_LAYER = re.compile(r"layers\.(\d+)\.")


def tensor_type(our_name: str, shape: tuple[int, ...], qtype: str, n_layers: int,
                tied: bool, n_gqa: int = 1) -> gguf.GGMLQuantizationType:
    """The GGUF type llama-quantize gives one of our tensors in the `qtype` mix.

    Source: llama.cpp src/llama-quant.cpp (`llama_tensor_get_type_impl`, ggml-org/llama.cpp
    at commit 007dbbf, read through the search tool), for the Llama architecture without an
    imatrix, nor 70B's or 8-expert models' rules: 1-D tensors and a mixture of experts' router
    stay F32; the output projection — or the token embedding when the output is tied to it —
    is Q6_K unless the mix is Q8_0; attn_v (our attention.wv), ffn_down (our
    feed_forward.w2) and attn_output (our attention.wo) follow the mix's exceptions
    (`_attn_v_type`, `_ffn_down_type`, `_attn_output_type`; the attn_v count equals the
    layer index in a layer-ordered file); every other matrix has the mix's base type (the
    token embedding of an untied model included).

    Args:
        our_name: our parameter name (Meta's: layers.{i}.attention.wv.weight, ...).
        shape: its shape; rows must divide into the type's blocks.
        qtype: a `QUANT_TYPES` name.
        n_layers: the model's layers.
        tied: the output projection is the token embedding.
        n_gqa: query heads per key/value head (llama.cpp's `n_gqa()`, which q2_k and the
            IQ4 mixes look at).

    Raises:
        ArgumentError: rows that do not divide into the chosen type's blocks.
    """
    base, ftype = QUANT_TYPES[check_type(qtype)]
    if len(shape) == 1 or our_name.endswith("feed_forward.gate.weight"):   # (llama-quantize
        return T.F32                                   # keeps a router, ffn_gate_inp, float)
    layer = _LAYER.match(our_name)
    i = int(layer.group(1)) if layer else -1
    if our_name == "output.weight" or (tied and our_name == "tok_embeddings.weight"):
        chosen = base if base == T.Q8_0 else T.Q6_K
    elif our_name.endswith("attention.wv.weight"):
        chosen = _attn_v_type(ftype, base, i, n_layers, n_gqa)
    elif our_name.endswith("feed_forward.w2.weight"):
        chosen = _ffn_down_type(ftype, base, i, n_layers)
    elif our_name.endswith("attention.wo.weight"):
        chosen = _attn_output_type(ftype, base)
    else:
        chosen = base
    block = gguf.GGML_QUANT_SIZES[chosen][0]
    if shape[-1] % block:
        raise ArgumentError(f"{our_name}: rows of {shape[-1]} values do not divide into "
                            f"{chosen.name} blocks of {block}")
    return chosen


def _attn_v_type(ftype: gguf.LlamaFileType, base: gguf.GGMLQuantizationType, i: int,
                 n_layers: int, n_gqa: int) -> gguf.GGMLQuantizationType:
    """attn_v of layer i (llama.cpp's `category_is_attn_v` branch)."""
    if ftype == F.MOSTLY_Q2_K:
        return T.Q4_K if n_gqa >= 4 else T.Q3_K
    if ftype == F.MOSTLY_Q3_K_M:
        return T.Q5_K if i < 2 else T.Q4_K
    if ftype in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS) and n_gqa >= 4:
        return T.Q5_K
    if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(i, n_layers):
        return T.Q6_K
    return base


def _ffn_down_type(ftype: gguf.LlamaFileType, base: gguf.GGMLQuantizationType, i: int,
                   n_layers: int) -> gguf.GGMLQuantizationType:
    """ffn_down of layer i (llama.cpp's FFN_DOWN branch, not Falcon, no imatrix)."""
    if ftype == F.MOSTLY_Q2_K:
        return T.Q3_K
    if ftype == F.MOSTLY_Q3_K_M:
        return T.Q5_K if i < n_layers // 16 else T.Q4_K
    if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(i, n_layers):
        return T.Q6_K
    if ftype in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS) and i < n_layers // 8:
        return T.Q5_K
    return base


def _attn_output_type(ftype: gguf.LlamaFileType, base: gguf.GGMLQuantizationType
                      ) -> gguf.GGMLQuantizationType:
    """attn_output (llama.cpp's ATTENTION_OUTPUT branch, not Falcon, fewer than 8 experts)."""
    return {F.MOSTLY_Q2_K: T.Q3_K, F.MOSTLY_Q3_K_M: T.Q4_K}.get(ftype, base)


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a shape file: GGUF name, our name (the first expert's, for a 3-D tensor of
    experts), (rows, columns) or (experts, rows, columns) and GGUF type."""

    name: str
    ours: str
    shape: tuple[int, ...]
    type: gguf.GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        """Bytes of its data in the file (before alignment padding)."""
        block, size = gguf.GGML_QUANT_SIZES[self.type]
        return int(np.prod(self.shape)) // block * size


def tensor_plan(shape: Shape, qtype: str) -> list[PlannedTensor]:
    """The tensors of a `shape` file of type `qtype`, in llama.cpp's file order (token
    embedding, layer by layer, final norm, output). Names and shapes come from our model (built
    on the meta device) and the Llama family's GGUF table, which keeps Meta's layout.

    Raises:
        ArgumentError: an unknown qtype, one not in EXPERT_TYPES for a mixture of experts, or
            rows that do not divide into blocks.
    """
    import torch

    from torchllama.families import family_for_args
    from torchllama.model import Transformer

    args = model_args(shape)
    if args.n_experts and check_type(qtype) not in EXPERT_TYPES:
        raise ArgumentError(f"--type {qtype}: the {shape.name} shape (a mixture of experts) "
                            f"is written only as {', '.join(EXPERT_TYPES)}")
    with torch.device("meta"):
        state = Transformer(args).state_dict()
    if args.tie_embeddings:
        state.pop("output.weight", None)
    from torchllama.checkpoint.gguf import written_mappings
    from torchllama.families.base import Part

    plan = []
    for m in written_mappings(family_for_args(args, "gguf").mappings("gguf", args.n_layers,
                                                                      set(state))):
        ours = m.ours[0]                  # (several: the experts of a 3-D tensor, expert first)
        dims = tuple(m.layout.part_shape(state[ours].shape, args)
                     if isinstance(m.layout, Part) else   # (DeepSeek's attn_k_b, attn_v_b)
                     m.layout.stored_shape(tuple(state[n].shape for n in m.ours)))
        plan.append(PlannedTensor(m.theirs, ours, dims, tensor_type(
            ours, dims, qtype, args.n_layers, args.tie_embeddings,
            args.n_heads // args.n_kv_heads)))

    def order(t: PlannedTensor) -> tuple[int, int]:
        layer = _LAYER.match(t.ours)
        if layer:
            return 1, int(layer.group(1))
        return (0, 0) if t.ours == "tok_embeddings.weight" else (2, 0)
    return sorted(plan, key=order)                 # stable: table order within a layer


# ---------------------------------------------------------------------------------------------
# Random blocks
# ---------------------------------------------------------------------------------------------

def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """(n,) float → (n, 2) uint8: each as little-endian IEEE half."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _k4_scales(sc: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit sub-block scales → (n, 12) uint8: Q4_K's and Q5_K's packed scales and
    minimums, with every minimum equal to its scale (ggml-common.h `get_scale_min_k4`)."""
    out = np.empty((len(sc), 12), dtype=np.uint8)
    lo, hi = sc[:, :4], sc[:, 4:]
    out[:, 0:4] = (lo & 0x3F) | ((hi >> 4) << 6)                # sc[0..3] + sc[4..7] bits 4-5
    out[:, 4:8] = (lo & 0x3F) | ((hi >> 4) << 6)                # m[0..3]  + m[4..7] bits 4-5
    out[:, 8:12] = (hi & 0x0F) | ((hi & 0x0F) << 4)             # sc[4..7], m[4..7] bits 0-3
    return out


def _q4_k_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 144) uint8: random valid Q4_K blocks of values ~ WEIGHT_STD spread, zero mean.

    Layout (ggml-common.h block_q4_K; `gguf.quants.Q4_K.dequantize_blocks`): f16 d, f16 dmin,
    12 bytes of eight 6-bit sub-block scales sc and minimums m, 128 bytes of 4-bit codes q;
    value = d·sc·q − dmin·m. With m = sc and dmin = 7.5·d, value = d·sc·(q − 7.5), zero mean;
    q uniform on 0..15 has std 4.61, sc uniform on 32..63 has rms 48.6, so d = 0.02 / (4.61 ·
    48.6) (± 10 % per block).
    """
    out = np.empty((n, 144), dtype=np.uint8)
    d = WEIGHT_STD / (4.61 * 48.6) * rng.uniform(0.9, 1.1, n)
    out[:, 0:2] = _f16_bytes(d)
    out[:, 2:4] = _f16_bytes(7.5 * d)
    out[:, 4:16] = _k4_scales(rng.integers(32, 64, (n, 8), dtype=np.uint8))   # m = sc
    out[:, 16:] = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    return out


def _q5_k_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 176) uint8: random valid Q5_K blocks of values ~ WEIGHT_STD spread, zero mean.

    Layout (ggml-common.h block_q5_K): f16 d, f16 dmin, 12 bytes of scales and minimums as
    Q4_K's, 32 bytes qh of the codes' 5th bits, 128 bytes qs of their low 4 bits; value =
    d·sc·q − dmin·m. With m = sc and dmin = 15.5·d, value = d·sc·(q − 15.5); q uniform on
    0..31 has std 9.23, sc uniform on 32..63 rms 48.6, so d = 0.02 / (9.23 · 48.6) ≈ 4.5e-5
    (± 10 % per block; an f16 subnormal, as llama.cpp's own Q5_K d of such weights, ~5e-5).
    """
    out = np.empty((n, 176), dtype=np.uint8)
    d = WEIGHT_STD / (9.23 * 48.6) * rng.uniform(0.9, 1.1, n)
    out[:, 0:2] = _f16_bytes(d)
    out[:, 2:4] = _f16_bytes(15.5 * d)
    out[:, 4:16] = _k4_scales(rng.integers(32, 64, (n, 8), dtype=np.uint8))   # m = sc
    out[:, 16:] = rng.integers(0, 256, (n, 160), dtype=np.uint8)              # qh, qs
    return out


def _signed_scales(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Random 6-bit stored scales ls = 32 + sc, sc = ±(16..31) with a random sign (|sc| rms
    23.95): the signed sub-scales of Q3_K and IQ4_XS, symmetric so the values' mean is 0."""
    magnitude = rng.integers(16, 32, shape, dtype=np.uint8)
    return np.where(rng.integers(0, 2, shape, dtype=np.uint8) == 1, 32 + magnitude,
                    32 - magnitude).astype(np.uint8)


def _q3_k_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 110) uint8: random valid Q3_K blocks of values ~ WEIGHT_STD spread, zero mean.

    Layout (ggml-common.h block_q3_K): 32 bytes hmask (the codes' 3rd bits), 64 bytes qs
    (their low 2 bits), 12 bytes of sixteen 6-bit scales ls (low 4 bits: nibble s // 8 of
    byte s % 8; high 2 bits: bits 2·(s // 4) of byte 8 + s % 4), f16 d; value = d·(ls −
    32)·q with q on −4..3 (rms 2.345). Signed sub-scales ±(16..31) (`_signed_scales`, rms
    23.95), so d = 0.02 / (23.95 · 2.345) (± 10 % per block).
    """
    out = np.empty((n, 110), dtype=np.uint8)
    out[:, :96] = rng.integers(0, 256, (n, 96), dtype=np.uint8)                # hmask, qs
    ls = _signed_scales(rng, (n, 16))                                          # (n, 16)
    out[:, 96:104] = (ls[:, :8] & 0x0F) | ((ls[:, 8:] & 0x0F) << 4)
    high = ls >> 4                                                             # (n, 16) 2-bit
    out[:, 104:108] = high[:, 0:4] | (high[:, 4:8] << 2) | (high[:, 8:12] << 4) | (
        high[:, 12:16] << 6)
    out[:, 108:110] = _f16_bytes(WEIGHT_STD / (23.95 * 2.345) * rng.uniform(0.9, 1.1, n))
    return out


def _q2_k_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 84) uint8: random valid Q2_K blocks of values ~ WEIGHT_STD spread, zero mean.

    Layout (ggml-common.h block_q2_K): 16 bytes of sub-block scale sc (low nibble) and
    minimum m (high nibble), 64 bytes of 2-bit codes q, f16 d, f16 dmin; value = d·sc·q −
    dmin·m. With m = sc and dmin = 1.5·d, value = d·sc·(q − 1.5); q uniform on 0..3 has std
    1.118, sc uniform on 8..15 rms 11.73, so d = 0.02 / (1.118 · 11.73) (± 10 % per block).
    """
    out = np.empty((n, 84), dtype=np.uint8)
    sc = rng.integers(8, 16, (n, 16), dtype=np.uint8)
    out[:, 0:16] = sc | (sc << 4)                                              # m = sc
    out[:, 16:80] = rng.integers(0, 256, (n, 64), dtype=np.uint8)
    d = WEIGHT_STD / (1.118 * 11.73) * rng.uniform(0.9, 1.1, n)
    out[:, 80:82] = _f16_bytes(d)
    out[:, 82:84] = _f16_bytes(1.5 * d)
    return out


#: ggml-common.h kvalues_iq4nl: the codebook of IQ4_NL and IQ4_XS (rms 67.44).
_IQ4_RMS = 67.44


def _iq4_xs_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 136) uint8: random valid IQ4_XS blocks of values ~ WEIGHT_STD spread, zero mean.

    Layout (ggml-common.h block_iq4_xs): f16 d, uint16 scales_h (2 high bits of sub-block
    ib's 6-bit scale ls at bits 2·ib), 4 bytes scales_l (its low 4 bits, nibble ib % 2 of
    byte ib // 2), 128 bytes of 4-bit indices into kvalues_iq4nl (rms 67.44); value =
    d·(ls − 32)·kvalues[idx]. Signed sub-scales ±(16..31) (`_signed_scales`, rms 23.95), so
    d = 0.02 / (23.95 · 67.44) ≈ 1.2e-5 (± 10 % per block; llama.cpp's own: ~1.5e-5).
    """
    out = np.empty((n, 136), dtype=np.uint8)
    out[:, 0:2] = _f16_bytes(WEIGHT_STD / (23.95 * _IQ4_RMS) * rng.uniform(0.9, 1.1, n))
    ls = _signed_scales(rng, (n, 8))                                           # (n, 8)
    high = (ls >> 4).astype("<u2") << (2 * np.arange(8, dtype="<u2"))          # (n, 8)
    out[:, 2:4] = np.bitwise_or.reduce(high, axis=1).astype("<u2").view(np.uint8).reshape(n, 2)
    out[:, 4:8] = (ls[:, 0::2] & 0x0F) | ((ls[:, 1::2] & 0x0F) << 4)
    out[:, 8:] = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    return out


def _iq4_nl_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 18) uint8: random valid IQ4_NL blocks of values ~ WEIGHT_STD spread, zero mean.

    Layout (ggml-common.h block_iq4_nl): f16 d, 16 bytes of 4-bit indices into
    kvalues_iq4nl (rms 67.44); value = d·kvalues[idx]. The codebook leans negative (mean
    −5.9), so d takes a random sign (as llama.cpp's own does, half the time): |d| = 0.02 /
    67.44 (± 10 % per block).
    """
    out = np.empty((n, 18), dtype=np.uint8)
    sign = rng.integers(0, 2, n) * 2 - 1
    out[:, 0:2] = _f16_bytes(sign * WEIGHT_STD / _IQ4_RMS * rng.uniform(0.9, 1.1, n))
    out[:, 2:] = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    return out


def _q4_0_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 18) uint8: random valid Q4_0 blocks of values ~ WEIGHT_STD spread, zero mean.

    Layout (ggml-common.h block_q4_0): f16 d, 16 bytes of 4-bit codes q; value = d·(q − 8).
    q uniform on 0..15 has std 4.61, so d = 0.02 / 4.61 (± 10 % per block).
    """
    out = np.empty((n, 18), dtype=np.uint8)
    out[:, 0:2] = _f16_bytes(WEIGHT_STD / 4.61 * rng.uniform(0.9, 1.1, n))
    out[:, 2:] = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    return out


def _q6_k_blocks(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 210) uint8: random valid Q6_K blocks of values ~ WEIGHT_STD spread.

    Layout (ggml-common.h block_q6_K; `gguf.quants.Q6_K.dequantize_blocks`): 128 bytes of low
    4 bits, 64 bytes of high 2 bits of the 6-bit codes q, 16 int8 sub-block scales sc, f16 d;
    value = d·sc·(q − 32). q uniform on 0..63 has std 18.5, sc uniform on 64..127 rms 97.8,
    so d = 0.02 / (18.5 · 97.8) (± 10 % per block), as small as llama.cpp's own Q6_K scales
    of such weights.
    """
    out = np.empty((n, 210), dtype=np.uint8)
    out[:, :192] = rng.integers(0, 256, (n, 192), dtype=np.uint8)
    out[:, 192:208] = rng.integers(64, 128, (n, 16), dtype=np.uint8)    # int8 scales > 0
    out[:, 208:210] = _f16_bytes(WEIGHT_STD / (18.5 * 97.8) * rng.uniform(0.9, 1.1, n))
    return out


#: The types written as random blocks: (rng, n) → (n, type size) uint8 blocks.
RANDOM_BLOCKS = {T.Q2_K: _q2_k_blocks, T.Q3_K: _q3_k_blocks, T.Q4_K: _q4_k_blocks,
                 T.Q5_K: _q5_k_blocks, T.Q6_K: _q6_k_blocks, T.IQ4_NL: _iq4_nl_blocks,
                 T.IQ4_XS: _iq4_xs_blocks}


def random_tensor(rng: np.random.Generator, t: PlannedTensor) -> np.ndarray:
    """The data of one planned tensor: float32 ~1 for a norm (its shape), else (rows, row
    bytes) uint8 blocks of ~N(0, WEIGHT_STD) values, made CHUNK_VALUES at a time ((experts,
    rows, row bytes) for experts' 3-D tensors)."""
    if t.type == T.F32:
        return (1.0 + WEIGHT_STD * rng.standard_normal(t.shape, dtype=np.float32))
    *lead, cols = t.shape
    rows = int(np.prod(lead))
    block, size = gguf.GGML_QUANT_SIZES[t.type]
    out = np.empty((rows, cols // block * size), dtype=np.uint8)
    step = max(1, CHUNK_VALUES // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        if t.type == T.Q4_0 and len(lead) > 1:
            out[r:r + n] = _q4_0_blocks(rng, n * cols // block).reshape(n, -1)
        elif t.type in (T.Q4_0, T.Q8_0, T.Q5_0, T.Q5_1):
            x = rng.standard_normal((n, cols), dtype=np.float32)            # (n, cols)
            x *= WEIGHT_STD
            out[r:r + n] = gguf.quants.quantize(x, t.type)
        elif t.type in RANDOM_BLOCKS:
            out[r:r + n] = RANDOM_BLOCKS[t.type](rng, n * cols // block).reshape(n, -1)
        else:
            raise ValueError(f"no random blocks for {t.type.name}")
    return out.reshape(*lead, -1)


# ---------------------------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------------------------

def spec_string(shape: Shape, qtype: str, seed: int) -> str:
    """What a file is made from, as stored under SPEC_KEY: generator version, shape, type and
    seed (JSON)."""
    fields = {k: v for k, v in asdict(shape).items() if k != "preset" or v is not None}
    return json.dumps({"generator": GENERATOR_VERSION, "shape": fields, "type": qtype,
                       "seed": seed}, sort_keys=True)


@functools.lru_cache(maxsize=1)
def _tokenizer_fields() -> list[tuple[str, object, gguf.GGUFValueType, Optional[gguf.GGUFValueType]]]:
    """SmolLM2's `tokenizer.*` metadata (key, value, type, array item type), read from the
    embedded SmolLM2-135M GGUF (located without importing its package)."""
    from torchllama.checkpoint.common import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = gguf.GGUFValueType(field.types[0])
            sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), vtype, sub))
    tokens = next(f[1] for f in fields if f[0] == "tokenizer.ggml.tokens")
    if len(tokens) != VOCAB_SIZE:
        raise ValueError(f"SmolLM2's tokenizer has {len(tokens)} tokens, expected {VOCAB_SIZE}")
    return fields


def _writer(path: Path, shape: Shape, qtype: str, plan: list[PlannedTensor], seed: int
            ) -> gguf.GGUFWriter:
    """A GGUFWriter on `path` with the shape's metadata (our Llama family's keys, the file
    type, SmolLM2's tokenizer, the spec) and the plan's tensor infos; header not yet written."""
    from torchllama.families import family_for_args

    args = model_args(shape)
    family = family_for_args(args, "gguf")
    writer = gguf.GGUFWriter(path, family.gguf_architecture)
    writer.add_string(SPEC_KEY, spec_string(shape, qtype, seed))       # 2nd key: _first_spec
    writer.add_name(f"torchllama random-weight {shape.name} ({shape.model} shape)")
    family.gguf_metadata(writer, args)
    writer.add_file_type(QUANT_TYPES[qtype][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub in _tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub)
    for t in plan:
        if t.type == T.F32:
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes)
        else:
            block, size = gguf.GGML_QUANT_SIZES[t.type]
            byte_shape = (*t.shape[:-1], t.shape[-1] // block * size)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes,
                                   raw_dtype=t.type)
    return writer


def write_shape_file(shape: Shape, qtype: str, path: Path, seed: int = 0,
                     progress: bool = True) -> None:
    """Write the random-weight GGUF of `shape` in the `qtype` mix to `path` directly (callers
    write to a temporary path and rename: `ensure_shape_file`), one tensor at a time.

    Each tensor's values come from NumPy's generator seeded with (seed, its index), so a spec
    always gives the same bytes.

    Raises:
        ArgumentError: an unknown qtype, or a shape whose rows do not divide into blocks.
    """
    from tqdm import tqdm

    plan = tensor_plan(shape, qtype)
    writer = _writer(path, shape, qtype, plan, seed)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with tqdm(total=sum(t.nbytes for t in plan), unit="B", unit_scale=True,
                  desc=f"writing {path.name}", disable=not progress, leave=False) as bar:
            for index, t in enumerate(plan):
                rng = np.random.default_rng([seed, index])
                writer.write_tensor_data(random_tensor(rng, t))
                bar.update(t.nbytes)
    finally:
        writer.close()


def shape_path(shape: Shape, qtype: str) -> Path:
    """Where the cached file of (shape, type) lives: $TORCHLLAMA_CACHE/shapes/<shape>-<type>.gguf
    (default cache ~/.cache/torchllama)."""
    from torchllama.checkpoint.common import model_cache_dir

    return model_cache_dir() / "shapes" / f"{shape.name}-{qtype}.gguf"


def _first_spec(path: Path) -> Optional[str]:
    """The SPEC_KEY string of a GGUF file when it is among its first two metadata keys (where
    `_writer` puts it), read from the header alone; None otherwise."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if head[:4] != b"GGUF":
        return None
    pos = 24                                     # magic, version, tensor count, key count
    for _ in range(2):
        (n,) = struct.unpack_from("<Q", head, pos)
        key = head[pos + 8:pos + 8 + n].decode(errors="replace")
        pos += 8 + n
        (vtype,) = struct.unpack_from("<I", head, pos)
        if vtype != gguf.GGUFValueType.STRING:
            return None
        (n,) = struct.unpack_from("<Q", head, pos + 4)
        value = head[pos + 12:pos + 12 + n].decode(errors="replace")
        pos += 12 + n
        if key == SPEC_KEY:
            return value
    return None


def is_current(path: Path, shape: Shape, qtype: str, seed: int = 0) -> bool:
    """Whether `path` is a shape file of this spec (its SPEC_KEY, read from the header) and
    at least as long as its tensors' data. Files are only ever renamed into place complete
    (`ensure_shape_file`), so this catches other specs and cut-off copies, cheaply (parsing the
    whole header with `gguf.GGUFReader` takes seconds: 100k tokenizer strings)."""
    if not path.is_file():
        return False
    try:
        if _first_spec(path) != spec_string(shape, qtype, seed):
            return False
    except (struct.error, OSError):
        return False
    data = sum(-(-t.nbytes // gguf.GGUF_DEFAULT_ALIGNMENT) * gguf.GGUF_DEFAULT_ALIGNMENT
               for t in tensor_plan(shape, qtype))
    return path.stat().st_size >= data


def ensure_shape_file(shape: str | Shape, qtype: str, *, seed: int = 0, progress: bool = True,
                      path: Optional[Path] = None) -> Path:
    """The random-weight GGUF of (shape, qtype): the cached file when it is current
    (`is_current`), else written anew (temporary file, then renamed).

    Args:
        shape: a `SHAPES` name or a `Shape`.
        qtype: a `QUANT_TYPES` name.
        seed: the random seed (part of the spec).
        progress: a progress bar while writing.
        path: where the file goes (default `shape_path`).

    Returns:
        The file's path.

    Raises:
        ArgumentError: an unknown shape or type.
        OSError: the cache folder cannot be written.
    """
    from torchllama.checkpoint.common import atomic_output

    shape = get_shape(shape) if isinstance(shape, str) else shape
    check_type(qtype)
    path = Path(path) if path is not None else shape_path(shape, qtype)
    if is_current(path, shape, qtype, seed):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path, folder=False, force=True) as tmp:
        write_shape_file(shape, qtype, tmp, seed, progress)
    return path
