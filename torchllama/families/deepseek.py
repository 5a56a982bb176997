"""DeepSeek-V3 (and V2) with dense MLPs: multi-head latent attention (MLA, DeepSeek-V2 §2.1) in
a pre-norm RMSNorm / SwiGLU decoder. Our MLA names are those of DeepSeek's own reference
(inference/model.py); HF's `DeepseekV3ForCausalLM` names them `q_a_proj`, `kv_a_proj_with_mqa`,
... With `rope_interleave` (DeepSeek-V3's configs) the RoPE dims are stored in Meta's interleaved
layout, ours.

Its mixture of experts (DeepSeek-V3 §2.1.2: sigmoid scores, a correction bias, group-limited
choice, routed scaling, shared experts; `torchllama.nn.moe`) loads from Hugging Face folders,
one tensor per expert as saved, and from and to GGUF (llama.cpp's `deepseek2` with its expert
keys: DeepSeek-V2's softmax router too, V3's sigmoid one with `exp_probs_b` and groups).

llama.cpp's deepseek2 computes the mixture as we do (`build_moe_ffn`): softmax (V2) or
sigmoid (V3) scores; `exp_probs_b` added for the choice only; group-limited choice ranking each
group by the sum of its two best biased scores (DeepSeek-V3's noaux_tc; present in the
llama.cpp of llama-cpp-python 0.3.36, and tested with groups); the k weights renormalized if
expert_weights_norm, then × expert_weights_scale; plus the shared experts. Two limits of
its files: they must hold shared experts (llama.cpp requires `ffn_*_shexp`), so a model
without is refused for GGUF; and a softmax router with groups (DeepSeek-V2's
group_limited_greedy, which ranks a group by its best score, llama.cpp by its two best) is
refused when read, as our softmax router has no groups.

DeepSeek-V3's multi-token-prediction module (§2.2; HF: the layer past num_hidden_layers,
`model.layers.61.*` in its release; GGUF: `blk.{i}.nextn.*`, which llama.cpp's deepseek2
converter leaves out) is not read: a training objective and, at inference, a draft model for
speculative decoding; the main model's next-token logits do not use it. Loading an HF folder
skips those tensors (`Family.hf_extra_layers_ignored`), loading a GGUF file its `nextn`
tensors (`Family.gguf_ignored`); a file whose block_count also counts the MTP blocks
(`deepseek2.nextn_predict_layers`) loads the blocks before them. MTP blocks that also hold a
layer's tensors (attention, experts: as llama.cpp's DeepSeek-V3.2 converter writes them) are
refused, naming those tensors: the GGUF weight loader cannot skip them yet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

from torchllama.config import ModelArgs
from torchllama.errors import MISSING, ArgumentError, ModelFileError, checked_field
from torchllama.families.base import (Family, Part, Stacked, Tensors, hf_key, hf_max_positions,
                                      hf_rope, hf_rope_parameters, unsupported_fields)

@dataclass(frozen=True)
class _KVBPart(Part):
    """llama.cpp's split of wkv_b (H·(dn + dv), r) for its absorbed MLA: attn_k_b holds each
    head's k_nope rows transposed, (H, r, dn); attn_v_b each head's v rows, (H, dv, r)."""

    value: bool          # False: attn_k_b, True: attn_v_b

    def part_shape(self, shape, args):
        H, dn, dv = args.n_heads, args.qk_nope_head_dim, args.v_head_dim
        r = shape[1]
        return torch.Size((H, dv, r) if self.value else (H, r, dn))

    def load(self, t, args):
        return (t if self.value else t.transpose(1, 2),)   # (H, dv, r) | (H, dn, r)

    def join(self, parts, args):
        k, v = parts                                       # (H, dn, r), (H, dv, r)
        return torch.cat([k, v], dim=1).reshape(-1, k.shape[-1]).contiguous()

    def save(self, ts, args):
        H, dn, dv = args.n_heads, args.qk_nope_head_dim, args.v_head_dim
        k, v = ts[0].reshape(H, dn + dv, -1).split([dn, dv], dim=1)
        return (v if self.value else k.transpose(1, 2)).contiguous()


_L = "model.layers.{i}."
_A = "layers.{i}.attention."
_B = "blk.{i}."
_MLP = (("w1", "gate_proj", "gate"), ("w2", "down_proj", "down"), ("w3", "up_proj", "up"))
TENSORS = (
    Tensors("tok_embeddings.weight", "model.embed_tokens.weight", "token_embd.weight"),
    Tensors("norm.weight", "model.norm.weight", "output_norm.weight"),
    Tensors("output.weight", "lm_head.weight", "output.weight"),
    Tensors("layers.{i}.attention_norm.weight", _L + "input_layernorm.weight",
            _B + "attn_norm.weight"),
    Tensors(_A + "wq.weight", _L + "self_attn.q_proj.weight", _B + "attn_q.weight"),
    Tensors(_A + "wq_a.weight", _L + "self_attn.q_a_proj.weight", _B + "attn_q_a.weight"),
    Tensors(_A + "q_norm.weight", _L + "self_attn.q_a_layernorm.weight",
            _B + "attn_q_a_norm.weight"),
    Tensors(_A + "wq_b.weight", _L + "self_attn.q_b_proj.weight", _B + "attn_q_b.weight"),
    Tensors(_A + "wkv_a.weight", _L + "self_attn.kv_a_proj_with_mqa.weight",
            _B + "attn_kv_a_mqa.weight"),
    Tensors(_A + "kv_norm.weight", _L + "self_attn.kv_a_layernorm.weight",
            _B + "attn_kv_a_norm.weight"),
    # llama.cpp (since its absorbed MLA) writes wkv_b as attn_k_b + attn_v_b; older files hold
    # it whole as attn_kv_b, which we read (and do not write: the rows above come first)
    Tensors(_A + "wkv_b.weight", _L + "self_attn.kv_b_proj.weight", _B + "attn_k_b.weight",
            gguf_layout=_KVBPart(False)),
    Tensors(_A + "wkv_b.weight", None, _B + "attn_v_b.weight", gguf_layout=_KVBPart(True)),
    Tensors(_A + "wkv_b.weight", None, _B + "attn_kv_b.weight"),
    Tensors(_A + "wo.weight", _L + "self_attn.o_proj.weight", _B + "attn_output.weight"),
    Tensors("layers.{i}.ffn_norm.weight", _L + "post_attention_layernorm.weight",
            _B + "ffn_norm.weight"),
    Tensors("layers.{i}.feed_forward.w1.weight", _L + "mlp.gate_proj.weight",
            _B + "ffn_gate.weight"),
    Tensors("layers.{i}.feed_forward.w2.weight", _L + "mlp.down_proj.weight",
            _B + "ffn_down.weight"),
    Tensors("layers.{i}.feed_forward.w3.weight", _L + "mlp.up_proj.weight",
            _B + "ffn_up.weight"),
    # the mixture of experts' layers (after first_k_dense_replace): router, its correction
    # bias, each routed expert, the shared experts as one MLP
    # (GGUF: llama.cpp's ffn_gate_inp, exp_probs_b, 3-D ffn_*_exps expert first, ffn_*_shexp)
    Tensors("layers.{i}.feed_forward.gate.weight", _L + "mlp.gate.weight",
            _B + "ffn_gate_inp.weight"),
    Tensors("layers.{i}.feed_forward.e_score_correction_bias",
            _L + "mlp.gate.e_score_correction_bias", _B + "exp_probs_b.bias"),
) + tuple(
    Tensors(f"layers.{{i}}.feed_forward.experts.{{e}}.{ours}.weight",
            _L + f"mlp.experts.{{e}}.{theirs}.weight", _B + f"ffn_{gguf}_exps.weight",
            gguf_layout=Stacked())
    for ours, theirs, gguf in _MLP) + tuple(
    Tensors(f"layers.{{i}}.feed_forward.shared_experts.{ours}.weight",
            _L + f"mlp.shared_experts.{theirs}.weight", _B + f"ffn_{gguf}_shexp.weight")
    for ours, theirs, gguf in _MLP)


def _moe_args_from_hf(config: dict[str, Any], source: str, n_layers: int) -> dict[str, Any]:
    """ModelArgs fields of DeepSeek-V3's mixture of experts ({} for a dense model).

    Raises:
        ModelFileError: a router other than V3's (scoring_func sigmoid, topk_method noaux_tc).
    """
    dense = hf_key(config, "first_k_dense_replace", int, source, 3)
    experts = hf_key(config, "n_routed_experts", int, source, 256)
    if dense >= n_layers or not experts:
        return {}
    scoring = hf_key(config, "scoring_func", str, source, "sigmoid")
    method = hf_key(config, "topk_method", str, source, "noaux_tc")
    if scoring != "sigmoid" or method != "noaux_tc":
        raise ModelFileError(f"{source}: scoring_func {scoring!r} / topk_method {method!r}: "
                             "only DeepSeek-V3's router (sigmoid, noaux_tc) is supported")
    return dict(n_experts=experts, first_dense_layers=dense, moe_router="sigmoid",
                n_experts_per_token=hf_key(config, "num_experts_per_tok", int, source, 8),
                moe_hidden_dim=hf_key(config, "moe_intermediate_size", int, source),
                n_shared_experts=hf_key(config, "n_shared_experts", int, source, 1),
                moe_groups=hf_key(config, "n_group", int, source, 8),
                moe_group_topk=hf_key(config, "topk_group", int, source, 4),
                moe_norm_topk=hf_key(config, "norm_topk_prob", bool, source, True),
                moe_scale=hf_key(config, "routed_scaling_factor", float, source, 2.5))


def deepseek_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `DeepseekV3ForCausalLM` config.json, its mixture of experts too.

    Raises:
        ModelFileError: a router other than V3's, rope_interleave false, attention biases, or
            a required key missing or of the wrong type.
    """
    n_layers = hf_key(config, "num_hidden_layers", int, source)
    moe = _moe_args_from_hf(config, source, n_layers)
    if not hf_key(config, "rope_interleave", bool, source, True):
        raise ModelFileError(f"{source}: rope_interleave=false is not supported")
    if hf_key(config, "attention_bias", bool, source, False):
        raise ModelFileError(f"{source}: attention_bias=true is not supported")
    n_heads = hf_key(config, "num_attention_heads", int, source)
    theta, scaling, max_seq_len = hf_rope(
        config.get("rope_parameters") or config.get("rope_scaling"),
        hf_key(config, "rope_theta", float, source, None),
        hf_key(config, "max_position_embeddings", int, source, 4096), source)
    try:
        return ModelArgs(
            dim=hf_key(config, "hidden_size", int, source), n_layers=n_layers,
            n_heads=n_heads, n_kv_heads=hf_key(config, "num_key_value_heads", int, source,
                                               n_heads),
            vocab_size=hf_key(config, "vocab_size", int, source),
            hidden_dim=hf_key(config, "intermediate_size", int, source),
            norm_eps=hf_key(config, "rms_norm_eps", float, source, 1e-6),
            rope_theta=theta, rope_scaling=scaling, max_seq_len=max_seq_len,
            tie_embeddings=hf_key(config, "tie_word_embeddings", bool, source, False),
            attention="mla", q_lora_rank=hf_key(config, "q_lora_rank", int, source, None),
            kv_lora_rank=hf_key(config, "kv_lora_rank", int, source),
            qk_nope_head_dim=hf_key(config, "qk_nope_head_dim", int, source),
            qk_rope_head_dim=hf_key(config, "qk_rope_head_dim", int, source),
            v_head_dim=hf_key(config, "v_head_dim", int, source), **moe)
    except ArgumentError as e:
        raise ModelFileError(f"{source}: {e}") from e


def deepseek_hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of a `DeepseekV3ForCausalLM`."""
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_heads, "vocab_size": args.vocab_size,
            "rms_norm_eps": args.norm_eps, "max_position_embeddings": hf_max_positions(args),
            "rope_parameters": hf_rope_parameters(args), "rope_interleave": True,
            "tie_word_embeddings": args.tie_embeddings, "q_lora_rank": args.q_lora_rank,
            "kv_lora_rank": args.kv_lora_rank, "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim, "v_head_dim": args.v_head_dim,
            "first_k_dense_replace": args.n_layers, "n_routed_experts": 0,
            "hidden_act": "silu", "attention_bias": False}
    if args.n_experts:
        config.update(
            first_k_dense_replace=args.first_dense_layers, n_routed_experts=args.n_experts,
            num_experts_per_tok=args.n_experts_per_token,
            moe_intermediate_size=args.expert_hidden_dim,
            n_shared_experts=args.n_shared_experts, n_group=args.moe_groups,
            topk_group=args.moe_group_topk, norm_topk_prob=args.moe_norm_topk,
            routed_scaling_factor=args.moe_scale, scoring_func="sigmoid",
            topk_method="noaux_tc")
    return config


# ---- GGUF (llama.cpp's deepseek2) ---------------------------------------------------------------

#: llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType) → our moe_router.
_GATING = {1: "softmax", 2: "sigmoid"}


def _gguf_moe_args(need, n_layers: int, source: str) -> dict[str, Any]:
    """ModelArgs fields of a deepseek2 GGUF's mixture of experts ({} for a dense model):
    llama.cpp's keys leading_dense_block_count, expert_count, expert_used_count,
    expert_feed_forward_length, expert_shared_count, expert_gating_func (1 softmax: V2,
    llama.cpp's default when absent; 2 sigmoid: V3), expert_weights_norm (default false),
    expert_weights_scale (default 1), expert_group_count / expert_group_used_count (V3's
    group-limited choice; default 1, none).

    Raises:
        ModelFileError: a gating function other than softmax or sigmoid, an expert used count
            not in 1..expert_count, a group count that does not divide expert_count or is
            below its used count, or groups with the softmax router (each naming its key).
    """
    arch = "deepseek2"
    dense = need("leading_dense_block_count", int, 0)
    experts = need("expert_count", int, 0)
    if dense >= n_layers or not experts:
        return {}
    gating = need("expert_gating_func", int, 1)
    if gating not in _GATING:
        raise ModelFileError(f"{source}: {arch}.expert_gating_func is {gating}; expected 1 "
                             "(softmax) or 2 (sigmoid)")
    used = need("expert_used_count")
    if not 1 <= used <= experts:
        raise ModelFileError(f"{source}: {arch}.expert_used_count is {used}; expected 1 to "
                             f"{arch}.expert_count ({experts})")
    groups = need("expert_group_count", int, 1) or 1
    group_used = need("expert_group_used_count", int, 1) or 1
    if groups > 1 and (experts % groups or not 1 <= group_used <= groups):
        raise ModelFileError(f"{source}: {arch}.expert_group_count ({groups}) must divide "
                             f"{arch}.expert_count ({experts}) and be ≥ "
                             f"{arch}.expert_group_used_count ({group_used})")
    if groups > 1 and _GATING[gating] == "softmax":
        raise ModelFileError(f"{source}: {arch}.expert_group_count is {groups} with softmax "
                             "gating (DeepSeek-V2's group-limited choice): not supported "
                             "(groups are supported with sigmoid gating)")
    return dict(n_experts=experts, first_dense_layers=dense, moe_router=_GATING[gating],
                n_experts_per_token=used,
                moe_hidden_dim=need("expert_feed_forward_length"),
                n_shared_experts=need("expert_shared_count", int, 0),
                moe_norm_topk=need("expert_weights_norm", bool, False),
                moe_scale=need("expert_weights_scale", float, 1.0),
                moe_groups=groups, moe_group_topk=group_used if groups > 1 else 1)


#: GGUF tensors of a multi-token-prediction block (gguf-py's NEXTN_* names), not read.
_NEXTN = re.compile(r"blk\.\d+\.nextn\.\w+\.(weight|bias)")


def _main_block_count(need, tensor_names, source: str) -> int:
    """The main model's blocks: block_count less nextn_predict_layers (files that count the
    MTP blocks in block_count, as llama.cpp's DeepSeek-V3.2 converter writes).

    Raises:
        ModelFileError: tensors other than `nextn` ones in those MTP blocks (naming them):
            the weight loader cannot skip them.
    """
    blocks, mtp = need("block_count"), need("nextn_predict_layers", int, 0)
    if not 0 <= mtp < blocks:
        raise ModelFileError(f"{source}: deepseek2.nextn_predict_layers is {mtp}; expected 0 "
                             f"to block_count - 1 ({blocks - 1})")
    n_layers = blocks - mtp
    extra = sorted(n for n in tensor_names if not _NEXTN.fullmatch(n) and
                   (m := re.match(r"blk\.(\d+)\.", n)) and int(m.group(1)) >= n_layers)
    if extra:
        raise ModelFileError(
            f"{source}: tensors of the multi-token-prediction block(s) past the main model's "
            f"{n_layers} (deepseek2.nextn_predict_layers {mtp}) are not supported: "
            + ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else ""))
    return n_layers


def deepseek_args_from_gguf(metadata: dict[str, Any], tensor_names, source: str) -> ModelArgs:
    """`ModelArgs` from a GGUF file's `deepseek2.*` metadata, its experts too
    (`_gguf_moe_args`).

    Head sizes: files of llama.cpp's absorbed MLA (key_length_mla present) state the per-head
    q/k width as key_length_mla and v as value_length_mla (key_length, value_length are then
    the latent's); older files state them as key_length, value_length. YaRN: the softmax
    scale's mscale(s, mscale_all_dim)² comes from yarn_log_multiplier = 0.1·mscale_all_dim,
    and llama.cpp's deepseek2 leaves q and k unscaled (attention factor 1).

    Raises:
        ModelFileError: a missing required key, expert keys that do not fit
            (`_gguf_moe_args`), MTP blocks with more than their `nextn` tensors
            (`_main_block_count`), RoPE scaling other than YaRN, or values that do not form a
            valid model.
    """
    arch = "deepseek2"

    def need(key: str, kind: type = int, default=MISSING):
        return checked_field(metadata, f"{arch}.{key}", kind, source, default,
                             what="metadata key")

    n_layers = _main_block_count(need, tensor_names, source)
    moe = _gguf_moe_args(need, n_layers, source)
    rope = need("rope.dimension_count")
    if f"{arch}.attention.key_length_mla" in metadata:
        qk, v = need("attention.key_length_mla"), need("attention.value_length_mla")
    else:
        qk, v = need("attention.key_length"), need("attention.value_length")
    n_vocab = need("vocab_size", int, None) or len(metadata.get("tokenizer.ggml.tokens") or [])
    if not n_vocab:
        raise ModelFileError(f"{source}: vocabulary size unknown ({arch}.vocab_size and "
                             "tokenizer.ggml.tokens are both missing)")
    kind = need("rope.scaling.type", str, "none")
    scaling = None
    if kind == "yarn":
        mscale = need("rope.scaling.yarn_log_multiplier", float, 0.0) / 0.1
        scaling = {"type": "yarn", "factor": need("rope.scaling.factor", float),
                   "original_max_seq_len": need("rope.scaling.original_context_length")}
        for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if need(f"rope.scaling.{theirs}", float, None) is not None:
                scaling[ours] = need(f"rope.scaling.{theirs}", float)
        if mscale > 0:
            scaling.update(mscale=mscale, mscale_all_dim=mscale)
        else:
            scaling["attention_factor"] = 1.0
    elif kind != "none":
        raise ModelFileError(f"{source}: RoPE scaling {kind!r} ({arch}.rope.scaling.type) is "
                             "not supported (supported: none, yarn)")
    n_heads = need("attention.head_count")
    try:
        return ModelArgs(
            dim=need("embedding_length"), n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=n_heads, vocab_size=n_vocab, hidden_dim=need("feed_forward_length"),
            norm_eps=need("attention.layer_norm_rms_epsilon", float),
            rope_theta=need("rope.freq_base", float, 10000.0), rope_scaling=scaling,
            max_seq_len=need("context_length"),
            tie_embeddings="output.weight" not in tensor_names,
            attention="mla", q_lora_rank=need("attention.q_lora_rank", int, None) or None,
            kv_lora_rank=need("attention.kv_lora_rank"), qk_nope_head_dim=qk - rope,
            qk_rope_head_dim=rope, v_head_dim=v, **moe)
    except ArgumentError as e:
        raise ModelFileError(f"{source}: metadata does not describe a valid model: {e}") from e


def _gguf_moe_metadata(writer, args: ModelArgs) -> None:
    """The expert keys (`_gguf_moe_args`); a dense model: every block a leading dense block
    and the expert keys llama.cpp requires saying no experts."""
    import gguf

    moe = bool(args.n_experts)
    writer.add_leading_dense_block_count(args.first_dense_layers if moe else args.n_layers)
    writer.add_expert_feed_forward_length(args.expert_hidden_dim if moe else 0)
    writer.add_expert_count(args.n_experts)
    writer.add_expert_used_count(args.n_experts_per_token if moe else 0)
    writer.add_expert_shared_count(args.n_shared_experts)
    writer.add_expert_weights_scale(args.moe_scale if moe else 1.0)
    if moe:
        writer.add_expert_weights_norm(args.moe_norm_topk)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID
                                      if args.moe_router == "sigmoid" else
                                      gguf.ExpertGatingFuncType.SOFTMAX)
        if args.moe_groups > 1 and args.moe_router == "sigmoid":   # (softmax: no groups)
            writer.add_uint32(f"{writer.arch}.expert_group_count", args.moe_groups)
            writer.add_uint32(f"{writer.arch}.expert_group_used_count", args.moe_group_topk)


def deepseek_gguf_metadata(writer, args: ModelArgs) -> None:
    """The `deepseek2.*` keys of llama.cpp's converter (absorbed-MLA convention: one KV head
    of the latent's width), and its experts' (`_gguf_moe_metadata`)."""
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_hidden_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_vocab_size(args.vocab_size)
    if args.q_lora_rank:
        writer.add_q_lora_rank(args.q_lora_rank)
    writer.add_kv_lora_rank(args.kv_lora_rank)
    writer.add_key_length(args.kv_lora_rank + args.qk_rope_head_dim)
    writer.add_value_length(args.kv_lora_rank)
    writer.add_key_length_mla(args.qk_nope_head_dim + args.qk_rope_head_dim)
    writer.add_value_length_mla(args.v_head_dim)
    _gguf_moe_metadata(writer, args)
    writer.add_rope_dimension_count(args.qk_rope_head_dim)
    scaling = args.rope_scaling
    if scaling:
        arch = writer.arch
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", scaling["factor"])
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length",
                          scaling["original_max_seq_len"])
        writer.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier",
                           0.1 * (scaling.get("mscale_all_dim") or 0.0))
        for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if scaling.get(ours) is not None:
                writer.add_float32(f"{arch}.rope.scaling.{theirs}", scaling[ours])


def _gguf_rope_unsupported(args: ModelArgs) -> Optional[str]:
    scaling = args.rope_scaling
    if not scaling:
        return None
    if scaling["type"] != "yarn":
        return "llama.cpp's deepseek2 has YaRN RoPE scaling only"
    m, m_all = scaling.get("mscale") or 0.0, scaling.get("mscale_all_dim") or 0.0
    if m_all and m != m_all:
        return "llama.cpp's deepseek2 leaves q and k unscaled (YaRN mscale = mscale_all_dim)"
    if not m_all and scaling.get("attention_factor") != 1.0:
        return ("llama.cpp's deepseek2 leaves q and k unscaled (YaRN attention_factor 1, or "
                "mscale = mscale_all_dim)")
    return None


def _deepseek_unsupported(args: ModelArgs, fmt: str) -> Optional[str]:
    if args.attention != "mla":
        return "DeepSeek-V3 has attention: mla"
    if fmt == "gguf" and _gguf_rope_unsupported(args):
        return _gguf_rope_unsupported(args)
    moe = ()
    if args.n_experts:
        if fmt == "hf" and args.moe_router != "sigmoid":
            return "DeepSeek-V3's experts are routed by sigmoid scores (moe_router: sigmoid)"
        if fmt == "gguf" and not args.n_shared_experts:
            return "llama.cpp's deepseek2 requires shared experts (n_shared_experts ≥ 1)"
        moe = ("n_experts", "n_experts_per_token", "moe_hidden_dim", "n_shared_experts",
               "moe_router", "moe_norm_topk", "moe_scale", "moe_groups", "moe_group_topk",
               "first_dense_layers")
    return unsupported_fields(args, {name: (lambda a: True) for name in (
        "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "v_head_dim", "rope_scaling", "head_dim") + moe})


DEEPSEEK_V3 = Family(
    name="deepseek_v3", tensors=TENSORS,
    hf_architectures=("DeepseekV3ForCausalLM",), hf_model_type="deepseek_v3",
    gguf_architecture="deepseek2",
    args_from_hf=deepseek_args_from_hf, hf_config=deepseek_hf_config,
    args_from_gguf=deepseek_args_from_gguf, gguf_metadata=deepseek_gguf_metadata,
    unsupported=_deepseek_unsupported, hf_extra_layers_ignored=True, gguf_ignored=_NEXTN,
)
