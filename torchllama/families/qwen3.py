"""Qwen3 (dense): Qwen2's decoder without the q/k/v biases, with QK-norm — an RMSNorm over each
head's queries and keys before RoPE (`ModelArgs.qk_norm`, as Gemma 3's but with plain gains) —
and its own head width (`head_dim`, 128 in every released size). HF's `Qwen3ForCausalLM` and
llama.cpp's `qwen3` architecture keep HF's rotate_half row order for q/k and for the QK-norm
gains (`RopePermuted`).

Sources: transformers' models/qwen3 (modeling_qwen3.py: Qwen3Attention, q_norm/k_norm over
head_dim; configuration_qwen3.py: keys and defaults); llama.cpp's gguf-py constants
(`qwen3` architecture, attn_q_norm / attn_k_norm).
"""

from __future__ import annotations

from typing import Any, Optional

from torchllama.config import ModelArgs
from torchllama.families.base import Family, RopePermuted, Tensors, hf_key, unsupported_fields
from torchllama.families.llama import (_HF_ROPE, _ROPE_FREQS, QWEN2_TENSORS, _common_hf_args,
                                       _gguf_args, gguf_metadata, gguf_rope_unsupported,
                                       qwen_hf_config, qwen_window_args)

# Qwen2's table (its bias rows apply only to a model with biases) and the QK-norm gains.
QWEN3_TENSORS = QWEN2_TENSORS + (
    Tensors("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight",
            "blk.{i}.attn_q_norm.weight", hf_layout=RopePermuted(1),
            gguf_layout=RopePermuted(1)),
    Tensors("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight",
            "blk.{i}.attn_k_norm.weight", hf_layout=RopePermuted(1),
            gguf_layout=RopePermuted(1)),
)


def qwen3_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `Qwen3ForCausalLM` config.json: QK-norm, `head_dim` (default 128, as
    transformers'), attention_bias (q, k, v and o) and Qwen2's sliding-window keys.

    Raises:
        ModelFileError: a required key missing or of the wrong type, or a feature we do not
            implement (named).
    """
    return _common_hf_args({"head_dim": 128, **config}, source, **qwen3_args(config, source))


def qwen3_args(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelArgs fields Qwen3 and Qwen3-MoE configs share beyond Llama's: QK-norm, the
    attention bias (q, k, v and o) and the sliding-window keys."""
    bias = hf_key(config, "attention_bias", bool, source, False)
    return dict(qk_norm=True, qkv_bias=bias, out_bias=bias, **qwen_window_args(config, source))


def qwen3_hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of a `Qwen3ForCausalLM`."""
    return {**qwen_hf_config(args, "Qwen3ForCausalLM", "qwen3"), "attention_bias": args.qkv_bias}


def _qwen3_unsupported(args: ModelArgs, fmt: str) -> Optional[str]:
    if not args.qk_norm:
        return "Qwen3 normalizes queries and keys (qk_norm: true)"
    if fmt == "gguf":
        return gguf_rope_unsupported(args) or unsupported_fields(args, {
            "head_dim": lambda a: True, "qk_norm": lambda a: True,
            "rope_scaling": lambda a: True})
    return unsupported_fields(args, {
        "head_dim": lambda a: True, "qk_norm": lambda a: True,
        "qkv_bias": lambda a: a.out_bias == a.qkv_bias,
        "out_bias": lambda a: a.out_bias == a.qkv_bias,
        "rope_scaling": lambda a: a.rope_scaling["type"] in _HF_ROPE,
        "sliding_window": lambda a: True, "layer_types": lambda a: True})


def qwen3_args_from_gguf(metadata: dict[str, Any], tensor_names, source: str) -> ModelArgs:
    """`ModelArgs` from a GGUF file's `qwen3.*` metadata (as the llama reader's; QK-norm)."""
    return _gguf_args("qwen3", metadata, tensor_names, source, qk_norm=True)


QWEN3 = Family(
    name="qwen3", tensors=QWEN3_TENSORS,
    hf_architectures=("Qwen3ForCausalLM",), hf_model_type="qwen3",
    gguf_architecture="qwen3",
    args_from_hf=qwen3_args_from_hf, hf_config=qwen3_hf_config,
    args_from_gguf=qwen3_args_from_gguf, gguf_metadata=gguf_metadata,
    unsupported=_qwen3_unsupported, gguf_ignored=_ROPE_FREQS,
)
