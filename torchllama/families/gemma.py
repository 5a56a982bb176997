"""Gemma 2 and Gemma 3 (text): Llama's shape with sandwich norms ((1 + w) RMSNorm before and
after each sublayer), GeGLU with the tanh GELU, √dim embedding scale, a softmax scale of
query_pre_attn_scalar^-½, local (sliding-window) and global layers; Gemma 2 soft-caps attention
logits and final logits, Gemma 3 normalizes q and k per head instead (QK-norm) and uses RoPE base
10,000 on local layers.

HF names (transformers' modeling_gemma2.py / modeling_gemma3.py): note that Gemma's
`post_attention_layernorm` is the norm *after* attention (Llama's of the same name is the norm
before the MLP). q/k rows, and Gemma 3's q/k norm gains, are in HF's rotate_half order.
"""

from __future__ import annotations

from typing import Any, Optional

from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError, ModelFileError
from torchllama.families.base import (Family, RopePermuted, Tensors, hf_key, hf_rope,
                                      hf_rope_parameters, unsupported_fields)
from torchllama.families.llama import _our_layer_types, hf_layer_types

_L = "model.layers.{i}."
TENSORS = (
    Tensors("tok_embeddings.weight", "model.embed_tokens.weight"),
    Tensors("norm.weight", "model.norm.weight"),
    Tensors("output.weight", "lm_head.weight"),
    Tensors("layers.{i}.attention_norm.weight", _L + "input_layernorm.weight"),
    Tensors("layers.{i}.attention.wq.weight", _L + "self_attn.q_proj.weight",
            hf_layout=RopePermuted("n_heads")),
    Tensors("layers.{i}.attention.wk.weight", _L + "self_attn.k_proj.weight",
            hf_layout=RopePermuted("n_kv_heads")),
    Tensors("layers.{i}.attention.wv.weight", _L + "self_attn.v_proj.weight"),
    Tensors("layers.{i}.attention.wo.weight", _L + "self_attn.o_proj.weight"),
    Tensors("layers.{i}.attention.q_norm.weight", _L + "self_attn.q_norm.weight",
            hf_layout=RopePermuted(1)),
    Tensors("layers.{i}.attention.k_norm.weight", _L + "self_attn.k_norm.weight",
            hf_layout=RopePermuted(1)),
    Tensors("layers.{i}.post_attention_norm.weight", _L + "post_attention_layernorm.weight"),
    Tensors("layers.{i}.ffn_norm.weight", _L + "pre_feedforward_layernorm.weight"),
    Tensors("layers.{i}.post_ffn_norm.weight", _L + "post_feedforward_layernorm.weight"),
    Tensors("layers.{i}.feed_forward.w1.weight", _L + "mlp.gate_proj.weight"),
    Tensors("layers.{i}.feed_forward.w2.weight", _L + "mlp.down_proj.weight"),
    Tensors("layers.{i}.feed_forward.w3.weight", _L + "mlp.up_proj.weight"),
)

_ACTIVATIONS = {"gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh", "gelu": "geglu"}


def _gemma_args(config: dict[str, Any], source: str, version: int) -> ModelArgs:
    if config.get("use_bidirectional_attention"):
        raise ModelFileError(f"{source}: use_bidirectional_attention is not supported (a decoder "
                             "is causal)")
    if hf_key(config, "attention_bias", bool, source, False):
        raise ModelFileError(f"{source}: attention_bias=true is not supported for Gemma")
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ModelFileError(f"{source}: hidden_activation {act!r} is not supported "
                             f"(supported: {', '.join(_ACTIVATIONS)})")
    n_layers = hf_key(config, "num_hidden_layers", int, source)
    pattern = 2 if version == 2 else int(config.get("sliding_window_pattern") or 6)
    types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    max_positions = hf_key(config, "max_position_embeddings", int, source, 8192)
    params = config.get("rope_parameters")
    local_theta = None
    if version == 3 and isinstance(params, dict) and "full_attention" in params:
        theta, scaling, max_seq_len = hf_rope(params["full_attention"], None, max_positions,
                                              source, "rope_parameters.full_attention")
        local = params.get("sliding_attention") or {}
        local_theta, local_scaling, _ = hf_rope(local, 10000.0, max_positions, source,
                                                "rope_parameters.sliding_attention")
        if local_scaling is not None:
            raise ModelFileError(f"{source}: RoPE scaling on sliding-window layers is not "
                                 "supported")
    else:
        theta, scaling, max_seq_len = hf_rope(
            params or config.get("rope_scaling"),
            hf_key(config, "rope_theta", float, source, 10000.0), max_positions, source)
        if version == 3:
            local_theta = hf_key(config, "rope_local_base_freq", float, source, 10000.0)
    if version == 3 and local_theta == theta and scaling is None:
        local_theta = None
    window = hf_key(config, "sliding_window", int, source, None)
    try:
        return ModelArgs(
            dim=hf_key(config, "hidden_size", int, source),
            n_layers=n_layers,
            n_heads=hf_key(config, "num_attention_heads", int, source),
            n_kv_heads=hf_key(config, "num_key_value_heads", int, source, None),
            head_dim=hf_key(config, "head_dim", int, source, 256),
            vocab_size=hf_key(config, "vocab_size", int, source),
            hidden_dim=hf_key(config, "intermediate_size", int, source),
            norm_eps=hf_key(config, "rms_norm_eps", float, source, 1e-6),
            max_seq_len=max_seq_len, rope_theta=theta, rope_scaling=scaling,
            rope_local_theta=local_theta,
            tie_embeddings=hf_key(config, "tie_word_embeddings", bool, source, True),
            norm_unit_offset=True, norm_placement="sandwich", mlp=_ACTIVATIONS[act],
            embed_scale=True,
            attn_scale=hf_key(config, "query_pre_attn_scalar", float, source, 256) ** -0.5,
            attn_logit_softcap=hf_key(config, "attn_logit_softcapping", float, source, None),
            final_logit_softcap=hf_key(config, "final_logit_softcapping", float, source, None),
            qk_norm=version == 3,
            sliding_window=window if "sliding_attention" in types else None,
            layer_types=_our_layer_types(types, source) if window else None,
        )
    except ArgumentError as e:
        raise ModelFileError(f"{source}: {e}") from e


def gemma2_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `Gemma2ForCausalLM` config.json (transformers' Gemma2Config defaults).

    Raises:
        ModelFileError: a required key missing or of the wrong type, or a feature we do not
            implement (named).
    """
    return _gemma_args(config, source, 2)


def gemma3_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `Gemma3ForCausalLM` (text) config.json: per-layer-type RoPE from
    `rope_parameters` (or rope_theta, rope_local_base_freq and rope_scaling on global layers).

    Raises:
        ModelFileError: as `gemma2_args_from_hf`; also RoPE scaling on local layers.
    """
    return _gemma_args(config, source, 3)


def _gemma_hf_config(args: ModelArgs, version: int) -> dict[str, Any]:
    config = {
        "architectures": [f"Gemma{version}ForCausalLM"],
        "model_type": "gemma2" if version == 2 else "gemma3_text",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_activation": "gelu_pytorch_tanh" if args.mlp == "geglu_tanh" else "gelu",
        "query_pre_attn_scalar": _number(args.attn_scale ** -2),
        "attn_logit_softcapping": args.attn_logit_softcap,
        "final_logit_softcapping": args.final_logit_softcap,
        "sliding_window": args.sliding_window,
        "layer_types": hf_layer_types(args),
    }
    if version == 2:
        config["rope_parameters"] = hf_rope_parameters(args)
    else:
        local = args.rope_local_theta
        config["rope_parameters"] = {
            "full_attention": hf_rope_parameters(args),
            "sliding_attention": hf_rope_parameters(args, {} if local else None,
                                                    local or args.rope_theta)}
    return config


def _number(x: float) -> int | float:
    """x as an int when it is one (to rounding), for config keys typed int."""
    return int(round(x)) if abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else x


def _gemma_unsupported(args: ModelArgs, fmt: str, version: int) -> Optional[str]:
    if fmt == "gguf":
        return f"no GGUF writer for gemma{version} yet"
    needed = {"norm_unit_offset": True, "norm_placement": "sandwich", "embed_scale": True,
              "qk_norm": version == 3}
    for name, value in needed.items():
        if getattr(args, name) != value:
            return f"Gemma {version} has {name}={value!r}"
    if args.attn_scale is None or args.mlp not in ("geglu", "geglu_tanh"):
        return f"Gemma {version} has an explicit attn_scale and a GeGLU MLP"
    allowed = {name: (lambda a: True) for name in (
        "head_dim", "norm_unit_offset", "norm_placement", "qk_norm", "mlp", "embed_scale",
        "attn_scale", "attn_logit_softcap", "final_logit_softcap", "sliding_window",
        "layer_types")}
    allowed["rope_scaling"] = lambda a: a.rope_scaling["type"] in ("linear", "dynamic", "yarn",
                                                                   "llama3")
    if version == 3:
        allowed["rope_local_theta"] = lambda a: True
    return unsupported_fields(args, allowed)


GEMMA2 = Family(
    name="gemma2", tensors=TENSORS,
    hf_architectures=("Gemma2ForCausalLM",), hf_model_type="gemma2",
    args_from_hf=gemma2_args_from_hf, hf_config=lambda a: _gemma_hf_config(a, 2),
    unsupported=lambda a, fmt: _gemma_unsupported(a, fmt, 2),
)

GEMMA3 = Family(
    name="gemma3", tensors=TENSORS,
    hf_architectures=("Gemma3ForCausalLM",), hf_model_type="gemma3_text",
    args_from_hf=gemma3_args_from_hf, hf_config=lambda a: _gemma_hf_config(a, 3),
    unsupported=lambda a, fmt: _gemma_unsupported(a, fmt, 3),
)
