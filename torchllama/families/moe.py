"""The mixture-of-experts families (`torchllama.nn.moe`): Mixtral (Mistral's decoder with 8
experts per layer), Qwen3-MoE (Qwen3's decoder with many small experts) and OLMoE (QK-norm
over the whole projections, 64 experts, the top-k weights not renormalized), read from and
written to Hugging Face folders as transformers saves them: one tensor per expert
(`experts.{e}.w1` / `gate_proj` …) and the router as `gate`. Our names are Meta-style:
`feed_forward.gate` the router, `feed_forward.experts.{e}.w1/w2/w3` (Mistral's reference names).

Sources: transformers' models/mixtral and models/qwen3_moe (configurations, and the per-expert
checkpoint names its weight conversion reads).
"""

from __future__ import annotations

from typing import Any, Optional

from torchllama.config import ModelArgs
from torchllama.errors import ModelFileError
from torchllama.families.base import (Family, RopePermuted, Stacked, Tensors, hf_key,
                                      unsupported_fields)
from torchllama.families.llama import (_HF_ROPE, _ROPE_FREQS, QWEN2_TENSORS, TENSORS, _common_hf_args,
                                       _common_hf_config, _gguf_args, args_from_gguf,
                                       gguf_metadata, gguf_rope_unsupported, qwen_hf_config)
from torchllama.families.qwen3 import QWEN3_TENSORS, qwen3_args

_E = "layers.{i}.feed_forward."


def _moe_rows(prefix: str, names: tuple[str, str, str]) -> tuple[Tensors, ...]:
    """The router and the experts' w1/w2/w3 under an HF prefix, with the experts' own names;
    in GGUF (llama.cpp) `ffn_gate_inp` and the 3-D `ffn_{gate,down,up}_exps`, expert first."""
    return (Tensors(_E + "gate.weight", prefix + "gate.weight", "blk.{i}.ffn_gate_inp.weight"),
            ) + tuple(
        Tensors(_E + f"experts.{{e}}.{ours}.weight", prefix + f"experts.{{e}}.{theirs}.weight",
                f"blk.{{i}}.ffn_{gguf}_exps.weight", gguf_layout=Stacked())
        for ours, theirs, gguf in zip(("w1", "w2", "w3"), names, ("gate", "down", "up")))


MIXTRAL_TENSORS = TENSORS + _moe_rows("model.layers.{i}.block_sparse_moe.", ("w1", "w2", "w3"))
QWEN3_MOE_TENSORS = QWEN3_TENSORS + _moe_rows("model.layers.{i}.mlp.",
                                              ("gate_proj", "down_proj", "up_proj"))
# OLMoE: Llama's names, QK-norm gains over the whole q and k projections (HF's rotate_half row
# order within each head, as the projections' rows), Qwen3-MoE's expert names. llama.cpp's
# `olmoe` keeps HF's rotate_half rows (NeoX RoPE), as its qwen2: the GGUF layouts are HF's.
OLMOE_TENSORS = tuple(t for t in QWEN2_TENSORS if ".bias" not in t.our_names[0]) + (
    Tensors("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight",
            "blk.{i}.attn_q_norm.weight", hf_layout=RopePermuted("n_heads"),
            gguf_layout=RopePermuted("n_heads")),
    Tensors("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight",
            "blk.{i}.attn_k_norm.weight", hf_layout=RopePermuted("n_kv_heads"),
            gguf_layout=RopePermuted("n_kv_heads")),
) + _moe_rows("model.layers.{i}.mlp.", ("gate_proj", "down_proj", "up_proj"))


def _moe_unsupported(args: ModelArgs, what: str, extra: dict) -> Optional[str]:
    if not args.n_experts or args.moe_router != "softmax" or args.n_shared_experts or \
            args.first_dense_layers:
        return f"{what} has softmax-routed experts in every layer, none shared"
    return unsupported_fields(args, {
        "n_experts": lambda a: True, "n_experts_per_token": lambda a: True,
        "rope_scaling": lambda a: a.rope_scaling["type"] in _HF_ROPE, **extra})


# ---- Mixtral -----------------------------------------------------------------------------------

def mixtral_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `MixtralForCausalLM` config.json: Mistral's keys (its sliding window,
    null in Mixtral's own configs) and num_local_experts / num_experts_per_tok, the top k
    renormalized.

    Raises:
        ModelFileError: a required key missing or of the wrong type.
    """
    return _common_hf_args(config, source,
                           sliding_window=hf_key(config, "sliding_window", int, source, None),
                           n_experts=hf_key(config, "num_local_experts", int, source),
                           n_experts_per_token=hf_key(config, "num_experts_per_tok", int, source))


def mixtral_hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of a `MixtralForCausalLM`."""
    return {**_common_hf_config(args), "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral", "sliding_window": args.sliding_window,
            "num_local_experts": args.n_experts, "num_experts_per_tok": args.n_experts_per_token}


def _mixtral_unsupported(args: ModelArgs, fmt: str) -> Optional[str]:
    if fmt == "gguf" and (args.sliding_window is not None or gguf_rope_unsupported(args)):
        return gguf_rope_unsupported(args) or "GGUF llama files with experts have no window"
    if not args.moe_norm_topk or args.moe_hidden_dim not in (None, args.ffn_hidden_dim):
        return "Mixtral renormalizes its top k and its experts are the MLP's width"
    if args.layer_types and "global" in args.layer_types:
        return "Mixtral's sliding window, if any, is on every layer"
    return _moe_unsupported(args, "Mixtral", {"sliding_window": lambda a: True,
                                              "layer_types": lambda a: True})


# GGUF: llama.cpp writes Mixtral as a `llama` file with experts (read through `LLAMA`).
MIXTRAL = Family(
    name="mixtral", tensors=MIXTRAL_TENSORS,
    hf_architectures=("MixtralForCausalLM",), hf_model_type="mixtral",
    gguf_architecture="llama",
    args_from_hf=mixtral_args_from_hf, hf_config=mixtral_hf_config,
    args_from_gguf=args_from_gguf, gguf_metadata=gguf_metadata,
    unsupported=_mixtral_unsupported, gguf_ignored=_ROPE_FREQS,
)


# ---- Qwen3-MoE ---------------------------------------------------------------------------------

def qwen3_moe_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `Qwen3MoeForCausalLM` config.json: Qwen3's keys (QK-norm, head_dim 128
    by default) and num_experts (or num_local_experts), num_experts_per_tok,
    moe_intermediate_size, norm_topk_prob.

    Raises:
        ModelFileError: a required key missing or of the wrong type; dense layers among the
            sparse ones (mlp_only_layers, decoder_sparse_step ≠ 1), which we do not read.
    """
    if config.get("mlp_only_layers") or hf_key(config, "decoder_sparse_step", int, source, 1) != 1:
        raise ModelFileError(f"{source}: mlp_only_layers / decoder_sparse_step (dense layers "
                             "among the experts) are not supported")
    return _common_hf_args(
        {"head_dim": 128, **config}, source, **qwen3_args(config, source),
        n_experts=hf_key(config, "num_experts", int, source, None) or   # (transformers 5
        hf_key(config, "num_local_experts", int, source),                 # writes this one)
        n_experts_per_token=hf_key(config, "num_experts_per_tok", int, source),
        moe_hidden_dim=hf_key(config, "moe_intermediate_size", int, source),
        moe_norm_topk=hf_key(config, "norm_topk_prob", bool, source, False))


def qwen3_moe_hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of a `Qwen3MoeForCausalLM`."""
    return {**qwen_hf_config(args, "Qwen3MoeForCausalLM", "qwen3_moe"),
            "attention_bias": args.qkv_bias, "num_experts": args.n_experts,
            "num_experts_per_tok": args.n_experts_per_token,
            "moe_intermediate_size": args.expert_hidden_dim,
            "norm_topk_prob": args.moe_norm_topk, "decoder_sparse_step": 1,
            "mlp_only_layers": []}


def _qwen3_moe_unsupported(args: ModelArgs, fmt: str) -> Optional[str]:
    if fmt == "gguf" and (not args.moe_norm_topk or args.sliding_window is not None or
                          gguf_rope_unsupported(args)):
        return gguf_rope_unsupported(args) or "llama.cpp's qwen3moe renormalizes the top k " \
            "(norm_topk_prob) and has no sliding window"
    if not args.qk_norm:
        return "Qwen3-MoE normalizes queries and keys (qk_norm: true)"
    return _moe_unsupported(args, "Qwen3-MoE", {
        "head_dim": lambda a: True, "qk_norm": lambda a: True,
        "qkv_bias": lambda a: a.out_bias == a.qkv_bias,
        "out_bias": lambda a: a.out_bias == a.qkv_bias, "moe_hidden_dim": lambda a: True,
        "moe_norm_topk": lambda a: True, "sliding_window": lambda a: True,
        "layer_types": lambda a: True})


def qwen3_moe_args_from_gguf(metadata: dict[str, Any], tensor_names, source: str
                             ) -> ModelArgs:
    """`ModelArgs` from a GGUF file's `qwen3moe.*` metadata: Qwen3's, and expert_count,
    expert_used_count, expert_feed_forward_length (llama.cpp renormalizes the top k)."""
    from torchllama.errors import checked_field

    def need(key: str):
        return checked_field(metadata, f"qwen3moe.{key}", int, source, what="metadata key")

    return _gguf_args("qwen3moe", metadata, tensor_names, source, qk_norm=True,
                      n_experts=need("expert_count"), n_experts_per_token=need("expert_used_count"),
                      moe_hidden_dim=need("expert_feed_forward_length"), moe_norm_topk=True)


def qwen3_moe_gguf_metadata(writer, args: ModelArgs) -> None:
    """Qwen3's keys and the experts' (`qwen3_moe_args_from_gguf`)."""
    gguf_metadata(writer, args)                          # (the expert counts too)
    writer.add_expert_feed_forward_length(args.expert_hidden_dim)


QWEN3_MOE = Family(
    name="qwen3_moe", tensors=QWEN3_MOE_TENSORS,
    hf_architectures=("Qwen3MoeForCausalLM",), hf_model_type="qwen3_moe",
    gguf_architecture="qwen3moe",
    args_from_hf=qwen3_moe_args_from_hf, hf_config=qwen3_moe_hf_config,
    args_from_gguf=qwen3_moe_args_from_gguf, gguf_metadata=qwen3_moe_gguf_metadata,
    unsupported=_qwen3_moe_unsupported, gguf_ignored=_ROPE_FREQS,
)


# ---- OLMoE -------------------------------------------------------------------------------------

def olmoe_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of an `OlmoeForCausalLM` config.json: Llama's keys, QK-norm over the whole
    projections, num_experts (or num_local_experts) experts of intermediate_size,
    num_experts_per_tok, norm_topk_prob (false in OLMoE's own config).

    Raises:
        ModelFileError: a required key missing or of the wrong type; clip_qkv (not supported).
    """
    if config.get("clip_qkv") is not None:
        raise ModelFileError(f"{source}: clip_qkv {config['clip_qkv']!r} is not supported")
    return _common_hf_args(
        config, source, qk_norm=True, qk_norm_span="projection",
        n_experts=hf_key(config, "num_experts", int, source, None) or
        hf_key(config, "num_local_experts", int, source),
        n_experts_per_token=hf_key(config, "num_experts_per_tok", int, source),
        moe_norm_topk=hf_key(config, "norm_topk_prob", bool, source, False))


def olmoe_hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of an `OlmoeForCausalLM`."""
    return {**_common_hf_config(args), "architectures": ["OlmoeForCausalLM"],
            "model_type": "olmoe", "num_experts": args.n_experts,
            "num_experts_per_tok": args.n_experts_per_token,
            "norm_topk_prob": args.moe_norm_topk, "clip_qkv": None}


def _olmoe_unsupported(args: ModelArgs, fmt: str) -> Optional[str]:
    if fmt == "gguf" and (args.moe_norm_topk or args.n_kv_heads != args.n_heads or
                          args.head_dim != args.dim // args.n_heads or
                          gguf_rope_unsupported(args)):
        return gguf_rope_unsupported(args) or "llama.cpp's olmoe keeps the top-k weights " \
            "(norm_topk_prob: false), as many key/value heads as query heads and head_dim = " \
            "dim / n_heads"
    if not args.qk_norm or args.qk_norm_span != "projection":
        return "OLMoE normalizes the whole q and k projections (qk_norm_span: projection)"
    if args.moe_hidden_dim not in (None, args.ffn_hidden_dim):
        return "OLMoE's experts are the MLP's width"
    return _moe_unsupported(args, "OLMoE", {"qk_norm": lambda a: True,
                                            "qk_norm_span": lambda a: True,
                                            "moe_norm_topk": lambda a: True})


def olmoe_args_from_gguf(metadata: dict[str, Any], tensor_names, source: str) -> ModelArgs:
    """`ModelArgs` from a GGUF file's `olmoe.*` metadata (llama.cpp's converter of
    `OlmoeForCausalLM`): Llama's keys, expert_count and expert_used_count; the experts are
    feed_forward_length wide, their top-k weights kept (llama.cpp's `build_olmoe`).

    Raises:
        ModelFileError: a required key missing or of the wrong type.
    """
    from torchllama.errors import checked_field

    def need(key: str):
        return checked_field(metadata, f"olmoe.{key}", int, source, what="metadata key")

    return _gguf_args("olmoe", metadata, tensor_names, source, qk_norm=True,
                      qk_norm_span="projection", n_experts=need("expert_count"),
                      n_experts_per_token=need("expert_used_count"), moe_norm_topk=False)


OLMOE = Family(
    name="olmoe", tensors=OLMOE_TENSORS,
    hf_architectures=("OlmoeForCausalLM",), hf_model_type="olmoe",
    gguf_architecture="olmoe",
    args_from_hf=olmoe_args_from_hf, hf_config=olmoe_hf_config,
    args_from_gguf=olmoe_args_from_gguf, gguf_metadata=gguf_metadata,
    unsupported=_olmoe_unsupported, gguf_ignored=_ROPE_FREQS,
)
