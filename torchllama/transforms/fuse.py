"""The fast path of a decoder layer, installed from outside the model: a whole block as one
call of `torch.ops.torchllama.decoder_layer` (kernels/csrc/decoder.cpp).

A decode step of a small model is mostly Python dispatch of ~40 small ops per layer (norms,
projections, RoPE, cache writes, attention, SwiGLU); the op runs the same kernels in the same
order from C++ and gives the same bits as the modules (tests/test_kernels.py proves it for a
Llama and a Gemma 3 layer). The model (`torchllama.model`) never knows: `install` turns each
block whose structure the op computes into a `FusedTransformerBlock` — the same module with
the same parameters, whose forward takes the op when the call allows it and the readable
forward otherwise. Learned from torchtitan's `ModelSpec.parallelize_fn` and gpt-fast's
`QuantHandler.convert_for_runtime`: the fast path is a transform, the model stays the reference.

What the op computes (checked once, at install): a pre-norm or sandwich block of RMSNorms
(Llama, Mistral, Gemma 2/3) with one eps and gain convention; attention with q/k/v block-weight
products (one fused product, `fuse_projections` below, where their types agree),
RoPE, optionally QK-norm (per head, or over all heads as OLMoE's) and soft-capping; a gated
feed-forward (SwiGLU, or GeGLU with tanh GELU) with w1/w3 block products (fused likewise), or a
softmax-routed mixture of such experts without shared experts (Mixtral, Qwen3-MoE, OLMoE: the
experts stacked by `stack_experts`, the router float32 or blocks); no biases. What a call
needs (checked per call): float32 inference on torchllama's kernels, a KV cache the op can
write in place (float32, float16, bfloat16 or q8_0: the op stores each key and value as the
cache does), RoPE rotations, no position bias, no attention capture, RoPE over the whole head
(not partial), and no MoE recording its routing for training.
"""

from __future__ import annotations

import operator
from typing import NamedTuple, Optional

import numpy as np

import torch
import torch.nn.functional as F
from torch import nn

from torchllama import kernels
from torchllama.model import Transformer, TransformerBlock
from torchllama.nn import linear as linear_module
from torchllama.nn.attention import Attention
from torchllama.nn.attention_inputs import AttentionInputs
from torchllama.nn.kv_cache import KVCache, SlidingWindowKVCache
from torchllama.nn.linear import Linear
from torchllama.nn.mlp import ACTIVATIONS, FeedForward
from torchllama.nn.moe import MoE
from torchllama.nn.norms import RMSNorm
from torchllama.blocks.forms import BlockWeight, Q4Blocks, Q8Blocks
from torchllama.blocks.linear import BlockLinear, Q4Linear, Q8Linear, _code_range, _six_bit, _small
from torchllama.blocks.packing import _form, _q4_forms
from torchllama.kernels import huge_pages
from torchllama.transforms import structure


#: The cache storages the op writes and reads (float32, float16, bfloat16, q8_0 records).
KERNEL_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)


class LayerWeights(NamedTuple):
    """A block's tensors as the op takes them. A block weight is [codes, d, m] (Q4 blocks) or
    [codes, d, small] (Q8 blocks), packed, from the module's own `kernel_weight()`."""
    norms: list[torch.Tensor]       # attention_norm, ffn_norm (, post_attention_norm,
                                    # post_ffn_norm): (D,) each
    wqkv: list[torch.Tensor]        # wq, wk, wv stacked: (H·hd + 2·KV·hd) rows, one weight
                                    # or three (3 tensors each)
    wo: list[torch.Tensor]          # (D) rows
    w13: list[torch.Tensor]         # w1, w3 stacked: (2·F) rows, one weight or two
    w2: list[torch.Tensor]          # (D) rows
    qk_norms: list[torch.Tensor]    # [] or [q_norm, k_norm]: (hd,) each, or (H·hd,)
                                    # and (KV·hd,) (over all heads: OLMoE)
    router: list[torch.Tensor] = []     # a mixture of experts' (w13, w2 empty): [W_g (E, D)]
                                        # float32, or a block weight
    experts: list[torch.Tensor] = []    # its experts' w1, w3, w2, each stacked (E·F or E·D
                                        # rows, `stack_experts`): 9 tensors


class LayerConfig(NamedTuple):
    """A block's scalars as the op takes them."""
    n_heads: int
    n_kv_heads: int
    eps: float                      # of every RMSNorm of the block
    scale: float                    # softmax scale (1/√hd unless the model says otherwise)
    softcap: float                  # attention logit soft-capping (0: none)
    unit_offset: bool               # RMSNorm gains 1 + w (Gemma)
    gelu_tanh: bool                 # GeGLU with tanh GELU instead of SwiGLU
    n_experts: int = 0              # a mixture of experts' (`torchllama.nn.moe.MoE`) routing
    top_k: int = 0
    norm_topk: bool = False
    moe_scale: float = 1.0


class CacheSlots(NamedTuple):
    """Where the op writes the T new keys and values and what it attends over: cache rows
    row0..row0+B-1 of k_cache/v_cache (R, KV, C, hd), written at indices write_pos.. (or row b
    at row_write_pos[b], −1: idle), attention over indices 0..n_keys-1."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    row0: int
    write_pos: int
    n_keys: int
    row_write_pos: Optional[torch.Tensor]   # (B,) int64, rows at their own positions


def decoder_layer(x: torch.Tensor, weights: LayerWeights, config: LayerConfig,
                  cache: CacheSlots, inputs: AttentionInputs) -> torch.Tensor:
    """One block as one op call: x (B, T, D) float32 → (B, T, D). The arguments are flattened
    into the op's schema here, and only here (kernels/csrc/decoder.cpp lists them)."""
    cs = inputs.freqs_cis
    cs = torch.view_as_real(cs) if cs.is_complex() else cs            # (…, T, hd/2, 2)
    return torch.ops.torchllama.decoder_layer(
        x, weights.norms, weights.wqkv, weights.wo, weights.w13, weights.w2, weights.qk_norms,
        cache.k_cache, cache.v_cache, cache.row0, cache.write_pos, cache.n_keys, cs,
        inputs.mask, config.n_heads, config.n_kv_heads, config.eps, config.scale,
        config.softcap, config.unit_offset, config.gelu_tanh, cache.row_write_pos,
        inputs.key_start, weights.router, weights.experts, config.n_experts, config.top_k,
        config.norm_topk, config.moe_scale)


def _block_weight(module: Optional[nn.Module]) -> Optional[list[torch.Tensor]]:
    """[codes, d, m] of a Q4 block linear, [codes, d, small] of a Q8 one (no bias), else None: the
    module says so itself (`kernel_weight`)."""
    kernel_weight = getattr(module, "kernel_weight", None)
    return kernel_weight() if callable(kernel_weight) else None


def _norms(block: TransformerBlock) -> list[RMSNorm]:
    names = ["attention_norm", "ffn_norm"] + \
        (["post_attention_norm", "post_ffn_norm"] if block.placement == "sandwich" else [])
    return [getattr(block, name) for name in names]


def _feed_forward_fits(block: TransformerBlock) -> bool:
    """A SwiGLU or tanh GeGLU `FeedForward`, or (pre-norm blocks) a softmax-routed `MoE` of
    such experts without shared experts (Mixtral, Qwen3-MoE, OLMoE)."""
    ffn = block.feed_forward
    if type(ffn) is MoE:
        if ffn.router != "softmax" or ffn.shared_experts is not None or block.placement != "pre":
            return False
        ffn = ffn.experts[0]
    return type(ffn) is FeedForward and (ffn.act is F.silu or
                                         ffn.act is ACTIVATIONS["geglu_tanh"])


def fits(block: TransformerBlock) -> bool:
    """Whether the op computes this block's structure (module docstring), whatever its
    weights: pre-norm or sandwich, RMSNorms alike, `Attention` with full RoPE, a SwiGLU or tanh
    GeGLU `FeedForward` or a softmax-routed mixture of them (`_feed_forward_fits`)."""
    attention = block.attention
    if block.placement not in ("pre", "sandwich") or type(attention) is not Attention or \
            not _feed_forward_fits(block) or not attention.rope or \
            attention.qk_norm_span not in ("head", "projection"):
        return False
    norms = _norms(block) + ([attention.q_norm, attention.k_norm]
                             if hasattr(attention, "q_norm") else [])
    return all(type(n) is RMSNorm and n.unit_offset == norms[0].unit_offset and
               n.eps == norms[0].eps for n in norms)


def _stacked_weight(fused: Optional[nn.Module], parts: list[nn.Module]
                    ) -> Optional[list[torch.Tensor]]:
    """The op's weight of a product whose outputs are `parts`' side by side: the fused
    module's, else every part's in turn (3 tensors each; parts of different block types, as
    llama.cpp's Q4_K_M mix gives wv in Q6_K, cannot be one weight); None if a part has none."""
    if fused is not None:
        return _block_weight(fused)
    weights = [_block_weight(m) for m in parts]
    return None if any(w is None for w in weights) else [t for w in weights for t in w]


def _moe_weights(moe: MoE) -> Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """(router, experts) of the op for a mixture of experts whose experts are stacked block
    weights (`stack_experts`, still serving: no adapter on an expert) and whose router is a
    float32 `Linear` on the f32_linear kernel or a block weight, without bias; else None."""
    if moe.stacked is None or not moe.stacked.serves(moe.experts):
        return None
    gate = moe.gate
    router = [gate.weight] if type(gate) is Linear and gate.bias is None and \
        gate.weight.dtype == torch.float32 and linear_module.use_kernel else _block_weight(gate)
    experts = [_block_weight(p.stacked) for p in (moe.stacked.w1, moe.stacked.w3, moe.stacked.w2)]
    if router is None or any(w is None for w in experts):
        return None
    return router, [t for w in experts for t in w]


def _feed_forward_weights(ffn: nn.Module) -> Optional[dict]:
    """The feed-forward's part of `LayerWeights` and `LayerConfig` (as keywords), or None."""
    if type(ffn) is not MoE:
        w13, w2 = _stacked_weight(ffn.w13, [ffn.w1, ffn.w3]), _block_weight(ffn.w2)
        return None if w13 is None or w2 is None else dict(w13=w13, w2=w2)
    moe = _moe_weights(ffn)
    if moe is None:
        return None
    return dict(w13=[], w2=[], router=moe[0], experts=moe[1], n_experts=ffn.n_experts,
                top_k=ffn.top_k, norm_topk=ffn.norm_topk, moe_scale=float(ffn.scale))


def layer_weights(block: TransformerBlock) -> Optional[tuple[LayerWeights, LayerConfig]]:
    """The op's weights and scalars for this block, or None unless it `fits` and its products
    are block weights (fused by `fuse_projections` where their types agree; a mixture of
    experts' stacked by `stack_experts`; an adapter or float weights: None)."""
    if not fits(block):
        return None
    attention, ffn = block.attention, block.feed_forward
    products = [_stacked_weight(attention.wqkv, [attention.wq, attention.wk, attention.wv]),
                _block_weight(attention.wo)]
    ff = _feed_forward_weights(ffn)
    if any(w is None for w in products) or ff is None:
        return None
    act = (ffn.experts[0] if type(ffn) is MoE else ffn).act
    norms = _norms(block)
    qk_norms = [attention.q_norm, attention.k_norm] if hasattr(attention, "q_norm") else []
    weights = LayerWeights([n.weight for n in norms], *products, ff["w13"], ff["w2"],
                           [n.weight for n in qk_norms], ff.get("router", []),
                           ff.get("experts", []))
    config = LayerConfig(attention.n_heads, attention.n_kv_heads, norms[0].eps,
                         attention.scale or attention.head_dim ** -0.5, attention.softcap or 0.0,
                         norms[0].unit_offset, act is ACTIVATIONS["geglu_tanh"],
                         ff.get("n_experts", 0), ff.get("top_k", 0), ff.get("norm_topk", False),
                         ff.get("moe_scale", 1.0))
    return weights, config


def _feed_forward_key(ffn: nn.Module) -> tuple:
    """What `layer_weights` read of the feed-forward, to compare by identity: its products'
    modules (an adapter or a new quantization replaces them)."""
    if type(ffn) is not MoE:
        return ffn.w13, ffn.w1, ffn.w2, ffn.w3
    return ffn.gate, ffn.stacked, ffn.stacked is not None and ffn.stacked.serves(ffn.experts)


class FusedTransformerBlock(TransformerBlock):
    """A `TransformerBlock` (same parameters, same names) whose forward is one
    `decoder_layer` op call where the call allows it (module docstring), else the readable
    forward. Made by `install`, never constructed directly."""

    def weights(self) -> Optional[tuple[LayerWeights, LayerConfig]]:
        """`layer_weights(self)`, remembered while no module, parameter or buffer was
        assigned anywhere (`structure.version`: an adapter or a new quantization replaces
        modules) and a mixture of experts keeps its `stacked` products; then read again,
        and kept while the products are the same modules."""
        version = structure.version()
        stacked = self._modules["feed_forward"].__dict__.get("stacked")
        cached = self.__dict__.get("_fused_cache")        # (version, stacked, key, weights)
        if cached is not None and cached[0] == version and cached[1] is stacked:
            return cached[3]
        a = self.attention
        key = (a.wqkv, a.wq, a.wk, a.wv, a.wo, self.attention_norm.weight,
               *_feed_forward_key(self.feed_forward))
        same = cached is not None and all(a is b for a, b in zip(cached[2], key))
        weights = cached[3] if same else layer_weights(self)
        self.__dict__["_fused_cache"] = (version, stacked, key, weights)
        return weights

    def cache_slots(self, x: torch.Tensor, inputs: AttentionInputs) -> Optional[CacheSlots]:
        """Where this call's keys and values go, if the op can run it, else None. A query: the
        cache learns of the write afterwards (`_record_write`)."""
        attention, cs = self.attention, inputs.freqs_cis
        cache = attention.kv_cache
        if cache is None or attention.capture is not None or cs is None or \
                inputs.bias is not None:
            return None
        k_cache, v_cache = cache.k_cache, cache.v_cache
        if k_cache.dtype not in KERNEL_KV_DTYPES:
            return None
        pairs = cs.shape[-1] if cs.is_complex() else cs.shape[-2]       # rotated pairs
        if 2 * pairs != attention.head_dim:                              # partial RoPE
            return None
        rows = inputs.cache_rows
        row0 = 0 if rows is None else (rows.start or 0)
        if inputs.row_pos is not None:                   # rows at their own positions
            if type(cache) not in (KVCache, SlidingWindowKVCache):
                return None
            return CacheSlots(k_cache, v_cache, row0, 0, inputs.n_keys, inputs.row_index)
        slots = cache.in_place_slots(inputs.start_pos, x.shape[1])
        if slots is None:
            return None
        return CacheSlots(k_cache, v_cache, row0, *slots, None)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        # x: (B, T, D) → (B, T, D)
        fused = self.weights()
        slots = None
        adapters = self.__dict__.get("adapters")           # `transforms.multi_lora`: a row
        if adapters is not None and adapters.active:       # with an adapter runs readable
            fused = None
        ffn = self._modules["feed_forward"]                # a MoE recording its routing
        if type(ffn) is MoE and ffn.training and (ffn.aux_coef or ffn.bias_speed):
            fused = None
        if fused is not None and kernels.layer_ops_apply(x, fused[0].norms[0]):
            slots = self.cache_slots(x, inputs)
        if slots is None:
            return super().forward(x, inputs)
        out = decoder_layer(x, *fused, slots, inputs)
        self._record_write(x, inputs, slots)
        return out

    def _record_write(self, x: torch.Tensor, inputs: AttentionInputs,
                      slots: CacheSlots) -> None:
        """Tell the cache which slots the op wrote (a ring moves its furthest slot)."""
        cache = self.attention.kv_cache
        B, T = x.shape[:2]
        if inputs.row_pos is not None:
            cache.count_row_writes(inputs.row_pos, inputs.cache_rows)
        else:
            cache.record_write(inputs.start_pos, T, range(slots.row0, slots.row0 + B))


def install(model: Transformer) -> int:
    """Make every block of `model` that `fits` a `FusedTransformerBlock` (in place: the same
    module objects, parameters and state-dict names); returns how many. Called where the
    projections are fused (`transforms.quantize.install_quantized`); calling it again is
    harmless."""
    n = 0
    for layer in getattr(model, "layers", ()):
        if isinstance(layer, TransformerBlock) and fits(layer):
            layer.__class__ = FusedTransformerBlock
            n += 1
    return n


def runs_one_op_layers(model: Transformer) -> bool:
    """Whether every layer of `model` runs as one `decoder_layer` op (installed, fused block
    weights, torchllama's kernels available on the model's device)."""
    if model.device.type != "cpu" or not kernels.available():
        return False
    return all(isinstance(layer, FusedTransformerBlock) and layer.weights() is not None
               for layer in model.layers)


# --------------------------------------------------------------------------------------------
# Products fused before the layer op: q/k/v and gate/up as one block linear each, and a mixture
# of experts' matrices stacked (`transforms.quantize.install_quantized` calls these)
# --------------------------------------------------------------------------------------------

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
    if isinstance(first, Q8Linear) and first.lut is not None:     # 4-bit: one table for all
        if not all(lin.lut is not None and torch.equal(lin.lut, first.lut) for lin in linears):
            return None
        parts.append(first.lut)
    elif isinstance(first, Q8Linear):                             # small where every part is
        if any(lin.lut is not None for lin in linears):
            return None
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
    spans = [] if q4 or weight.lut is not None else \
        [_code_range(weight.codes[a:b]) for a, b in bounds]                   # per part
    if len({_six_bit(span) for span in spans}) > 1:
        return None                           # codes in 6 bits and in 8
    fused = (Q4Linear if q4 else Q8Linear)(weight)                  # packed once
    parts = []
    for i, (a, b) in enumerate(bounds):
        packed = [t[a // 8:b // 8] if t.dim() else t                    # (G_i, ·, ·), or c
                  for t in fused.packed()[:3 if q4 else 2]]
        if not q4:                                    # as `Q8Linear` decides it, per part
            packed.append(fused.lut if fused.lut is not None else torch.tensor(_small(spans[i])))
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
