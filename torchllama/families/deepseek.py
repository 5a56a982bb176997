"""DeepSeek-V3 (and V2) with dense MLPs: multi-head latent attention (MLA, DeepSeek-V2 §2.1) in
a pre-norm RMSNorm / SwiGLU decoder. Our MLA names are those of DeepSeek's own reference
(inference/model.py); HF's `DeepseekV3ForCausalLM` names them `q_a_proj`, `kv_a_proj_with_mqa`,
... With `rope_interleave` (DeepSeek-V3's configs) the RoPE dims are stored in Meta's interleaved
layout, ours.

Mixture-of-experts layers are not implemented: configs whose MLPs are all dense
(first_k_dense_replace ≥ num_hidden_layers) load; others are refused.
"""

from __future__ import annotations

from typing import Any, Optional

from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError, ModelFileError
from torchllama.families.base import (Family, Tensors, hf_key, hf_max_positions, hf_rope,
                                      hf_rope_parameters, unsupported_fields)

_L = "model.layers.{i}."
_A = "layers.{i}.attention."
TENSORS = (
    Tensors("tok_embeddings.weight", "model.embed_tokens.weight"),
    Tensors("norm.weight", "model.norm.weight"),
    Tensors("output.weight", "lm_head.weight"),
    Tensors("layers.{i}.attention_norm.weight", _L + "input_layernorm.weight"),
    Tensors(_A + "wq.weight", _L + "self_attn.q_proj.weight"),
    Tensors(_A + "wq_a.weight", _L + "self_attn.q_a_proj.weight"),
    Tensors(_A + "q_norm.weight", _L + "self_attn.q_a_layernorm.weight"),
    Tensors(_A + "wq_b.weight", _L + "self_attn.q_b_proj.weight"),
    Tensors(_A + "wkv_a.weight", _L + "self_attn.kv_a_proj_with_mqa.weight"),
    Tensors(_A + "kv_norm.weight", _L + "self_attn.kv_a_layernorm.weight"),
    Tensors(_A + "wkv_b.weight", _L + "self_attn.kv_b_proj.weight"),
    Tensors(_A + "wo.weight", _L + "self_attn.o_proj.weight"),
    Tensors("layers.{i}.ffn_norm.weight", _L + "post_attention_layernorm.weight"),
    Tensors("layers.{i}.feed_forward.w1.weight", _L + "mlp.gate_proj.weight"),
    Tensors("layers.{i}.feed_forward.w2.weight", _L + "mlp.down_proj.weight"),
    Tensors("layers.{i}.feed_forward.w3.weight", _L + "mlp.up_proj.weight"),
)


def deepseek_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `DeepseekV3ForCausalLM` config.json with dense MLP layers only.

    Raises:
        ModelFileError: mixture-of-experts layers, rope_interleave false, attention biases, or
            a required key missing or of the wrong type.
    """
    n_layers = hf_key(config, "num_hidden_layers", int, source)
    dense = hf_key(config, "first_k_dense_replace", int, source, 3)
    if dense < n_layers and hf_key(config, "n_routed_experts", int, source, 256):
        raise ModelFileError(
            f"{source}: mixture-of-experts layers (first_k_dense_replace {dense} < "
            f"num_hidden_layers {n_layers}) are not supported; only dense DeepSeek models load")
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
            v_head_dim=hf_key(config, "v_head_dim", int, source))
    except ArgumentError as e:
        raise ModelFileError(f"{source}: {e}") from e


def deepseek_hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of a dense `DeepseekV3ForCausalLM`."""
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
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


def _deepseek_unsupported(args: ModelArgs, fmt: str) -> Optional[str]:
    if fmt == "gguf":
        return "no GGUF writer for deepseek2 yet"
    if args.attention != "mla":
        return "DeepSeek-V3 has attention: mla"
    return unsupported_fields(args, {name: (lambda a: True) for name in (
        "attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "v_head_dim", "rope_scaling", "head_dim")})


DEEPSEEK_V3 = Family(
    name="deepseek_v3", tensors=TENSORS,
    hf_architectures=("DeepseekV3ForCausalLM",), hf_model_type="deepseek_v3",
    args_from_hf=deepseek_args_from_hf, hf_config=deepseek_hf_config,
    unsupported=_deepseek_unsupported,
)
