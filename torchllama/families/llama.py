"""The Llama-shaped families: Llama (1, 2, 3.x, TinyLlama, SmolLM, ...), Qwen2 (biases on q/k/v)
and Mistral (a sliding window on every layer). Meta's names are ours; HF's `LlamaForCausalLM`,
`Qwen2ForCausalLM`, `MistralForCausalLM` and llama.cpp's `llama` architecture name them
differently, and HF stores q/k rows (and q/k biases) permuted for its rotate_half RoPE
(`RopePermuted`).

Sources: Meta's llama/model.py (names, fairscale split dims); transformers'
convert_llama_weights_to_hf.py and the Llama/Qwen2/Mistral configs (HF names, permutation,
config keys and defaults); llama.cpp's gguf-py constants (GGUF names and `llama.*` keys).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any, Optional

import torch

from torchllama.config import ModelArgs
from torchllama.errors import MISSING, ArgumentError, ModelFileError, checked_field
from torchllama.families.base import (Family, RopePermuted, Stacked, Tensors, gguf_sizes, hf_key,
                                      hf_max_positions, hf_rope, hf_rope_parameters,
                                      unsupported_fields)

# ours, HF, GGUF `llama`, layout in HF files, Meta's model-parallel split dim:
# ColumnParallelLinear splits output features (dim 0 of (out, in)), RowParallelLinear input
# features (dim 1), ParallelEmbedding the embedding dimension (dim 1); norms are replicated.
# Bias rows apply only to models that have those biases (Qwen2; Llama with attention_bias).
TENSORS = (
    Tensors("tok_embeddings.weight", "model.embed_tokens.weight", "token_embd.weight",
            meta_shard_dim=1),
    Tensors("norm.weight", "model.norm.weight", "output_norm.weight"),
    Tensors("output.weight", "lm_head.weight", "output.weight", meta_shard_dim=0),
    Tensors("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight",
            "blk.{i}.attn_norm.weight"),
    Tensors("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight",
            "blk.{i}.attn_q.weight", hf_layout=RopePermuted("n_heads"), meta_shard_dim=0),
    Tensors("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight",
            "blk.{i}.attn_k.weight", hf_layout=RopePermuted("n_kv_heads"), meta_shard_dim=0),
    Tensors("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight",
            "blk.{i}.attn_v.weight", meta_shard_dim=0),
    Tensors("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight",
            "blk.{i}.attn_output.weight", meta_shard_dim=1),
    Tensors("layers.{i}.attention.wq.bias", "model.layers.{i}.self_attn.q_proj.bias",
            "blk.{i}.attn_q.bias", hf_layout=RopePermuted("n_heads")),
    Tensors("layers.{i}.attention.wk.bias", "model.layers.{i}.self_attn.k_proj.bias",
            "blk.{i}.attn_k.bias", hf_layout=RopePermuted("n_kv_heads")),
    Tensors("layers.{i}.attention.wv.bias", "model.layers.{i}.self_attn.v_proj.bias",
            "blk.{i}.attn_v.bias"),
    Tensors("layers.{i}.attention.wo.bias", "model.layers.{i}.self_attn.o_proj.bias",
            "blk.{i}.attn_output.bias"),
    Tensors("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight",
            "blk.{i}.ffn_norm.weight"),
    Tensors("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight",
            "blk.{i}.ffn_gate.weight", meta_shard_dim=0),
    Tensors("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight",
            "blk.{i}.ffn_down.weight", meta_shard_dim=1),
    Tensors("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight",
            "blk.{i}.ffn_up.weight", meta_shard_dim=0),
    Tensors("layers.{i}.feed_forward.w1.bias", "model.layers.{i}.mlp.gate_proj.bias"),
    Tensors("layers.{i}.feed_forward.w2.bias", "model.layers.{i}.mlp.down_proj.bias"),
    Tensors("layers.{i}.feed_forward.w3.bias", "model.layers.{i}.mlp.up_proj.bias"),
)


# ---- config.json -------------------------------------------------------------------------------

def _common_hf_args(config: dict[str, Any], source: str, **extra) -> ModelArgs:
    """ModelArgs from the keys Llama, Qwen2 and Mistral configs share (transformers' defaults
    for absent keys: num_key_value_heads = num_attention_heads, rms_norm_eps 1e-6, rope_theta
    10000, max_position_embeddings 2048, tie_word_embeddings false, hidden_act silu; `dtype`
    is ignored: the caller picks the dtype)."""
    act = hf_key(config, "hidden_act", str, source, "silu")
    if act not in ("silu", "swish"):
        raise ModelFileError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    n_heads = hf_key(config, "num_attention_heads", int, source)
    theta, scaling, max_seq_len = hf_rope(
        config.get("rope_parameters") or config.get("rope_scaling"),
        hf_key(config, "rope_theta", float, source, None),
        hf_key(config, "max_position_embeddings", int, source, 2048), source,
        "rope_parameters" if config.get("rope_parameters") else "rope_scaling")
    try:
        return ModelArgs(
            dim=hf_key(config, "hidden_size", int, source),
            n_layers=hf_key(config, "num_hidden_layers", int, source),
            n_heads=n_heads,
            n_kv_heads=hf_key(config, "num_key_value_heads", int, source, n_heads),
            head_dim=hf_key(config, "head_dim", int, source, None),
            vocab_size=hf_key(config, "vocab_size", int, source),
            hidden_dim=hf_key(config, "intermediate_size", int, source),
            norm_eps=hf_key(config, "rms_norm_eps", float, source, 1e-6),
            rope_theta=theta, rope_scaling=scaling, max_seq_len=max_seq_len,
            tie_embeddings=hf_key(config, "tie_word_embeddings", bool, source, False),
            **extra)
    except ArgumentError as e:  # inconsistent sizes, found by ModelArgs.__post_init__
        raise ModelFileError(f"{source}: {e}") from e


def llama_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `LlamaForCausalLM` config.json (attention_bias: biases on q, k, v and o;
    mlp_bias; RoPE scaling linear / dynamic / yarn / llama3).

    Raises:
        ModelFileError: a required key missing or of the wrong type, or a feature we do not
            implement (named).
    """
    bias = hf_key(config, "attention_bias", bool, source, False)
    return _common_hf_args(config, source, qkv_bias=bias, out_bias=bias,
                           mlp_bias=hf_key(config, "mlp_bias", bool, source, False))


def llama_hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of a `LlamaForCausalLM` with these hyperparameters."""
    return {**_common_hf_config(args), "architectures": ["LlamaForCausalLM"],
            "model_type": "llama", "attention_bias": args.qkv_bias, "mlp_bias": args.mlp_bias}


def _common_hf_config(args: ModelArgs) -> dict[str, Any]:
    return {
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": hf_rope_parameters(args),
        "max_position_embeddings": hf_max_positions(args),
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
    }


_HF_ROPE = ("linear", "dynamic", "yarn", "llama3")


def _llama_unsupported(args: ModelArgs, fmt: str) -> Optional[str]:
    if fmt == "gguf":
        return gguf_rope_unsupported(args) or unsupported_fields(args, {
            "head_dim": lambda a: True, "rope_scaling": lambda a: True})
    return unsupported_fields(args, {
        "head_dim": lambda a: True,
        "qkv_bias": lambda a: a.out_bias == a.qkv_bias,
        "out_bias": lambda a: a.out_bias == a.qkv_bias,
        "mlp_bias": lambda a: True,
        "rope_scaling": lambda a: a.rope_scaling["type"] in _HF_ROPE,
    })


def qwen2_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `Qwen2ForCausalLM` config.json: Llama's with biases on q, k and v, and
    sliding-window layers from `layer_types` (or use_sliding_window + max_window_layers).

    Raises:
        ModelFileError: as `llama_args_from_hf`.
    """
    return _common_hf_args(config, source, qkv_bias=True, **qwen_window_args(config, source))


def qwen_window_args(config: dict[str, Any], source: str) -> dict[str, Any]:
    """sliding_window and layer_types of a Qwen2/Qwen3(-MoE) config.json: `layer_types`, or
    use_sliding_window with the window on the layers from max_window_layers on."""
    if not hf_key(config, "use_sliding_window", bool, source, False):
        return {}
    n_layers = hf_key(config, "num_hidden_layers", int, source)
    first = hf_key(config, "max_window_layers", int, source, 28)
    types = config.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    return dict(sliding_window=hf_key(config, "sliding_window", int, source),
                layer_types=_our_layer_types(types, source))


def qwen_hf_config(args: ModelArgs, architecture: str, model_type: str) -> dict[str, Any]:
    """config.json keys of a Qwen2/Qwen3(-MoE) model: Llama's and the sliding-window keys."""
    config = {**_common_hf_config(args), "architectures": [architecture],
              "model_type": model_type, "use_sliding_window": args.sliding_window is not None,
              "sliding_window": args.sliding_window}
    if args.sliding_window is not None:
        config["layer_types"] = hf_layer_types(args)
        config["max_window_layers"] = 0
    return config


def qwen2_hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of a `Qwen2ForCausalLM`."""
    return qwen_hf_config(args, "Qwen2ForCausalLM", "qwen2")


def _qwen2_unsupported(args: ModelArgs, fmt: str) -> Optional[str]:
    if not args.qkv_bias:
        return "Qwen2 has biases on q, k and v (qkv_bias: true)"
    if fmt == "gguf":
        return gguf_rope_unsupported(args) or unsupported_fields(args, {
            "head_dim": lambda a: True, "qkv_bias": lambda a: True,
            "rope_scaling": lambda a: True})
    return unsupported_fields(args, {
        "head_dim": lambda a: True, "qkv_bias": lambda a: True,
        "rope_scaling": lambda a: a.rope_scaling["type"] in _HF_ROPE,
        "sliding_window": lambda a: True, "layer_types": lambda a: True})


def mistral_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `MistralForCausalLM` config.json: Llama's with a sliding window on every
    layer (`sliding_window`; null: full attention).

    Raises:
        ModelFileError: as `llama_args_from_hf`.
    """
    return _common_hf_args(config, source,
                           sliding_window=hf_key(config, "sliding_window", int, source, None))


def mistral_hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of a `MistralForCausalLM`."""
    return {**_common_hf_config(args), "architectures": ["MistralForCausalLM"],
            "model_type": "mistral", "sliding_window": args.sliding_window}


def _mistral_unsupported(args: ModelArgs, fmt: str) -> Optional[str]:
    if args.sliding_window is None:
        return "Mistral has a sliding window"
    if args.layer_types and "global" in args.layer_types:
        return "Mistral's sliding window is on every layer (layer_types all local)"
    if fmt == "gguf" and gguf_rope_unsupported(args):
        return gguf_rope_unsupported(args)
    return unsupported_fields(args, {
        "head_dim": lambda a: True, "sliding_window": lambda a: True,
        "layer_types": lambda a: True,
        "rope_scaling": lambda a: a.rope_scaling["type"] in _HF_ROPE})


def _our_layer_types(types: Optional[list], source: str) -> Optional[list[str]]:
    """HF layer_types ("full_attention" / "sliding_attention") as ours ("global" / "local")."""
    if types is None:
        return None
    names = {"full_attention": "global", "sliding_attention": "local"}
    if not isinstance(types, list) or any(t not in names for t in types):
        raise ModelFileError(f"{source}: layer_types must be a list of 'full_attention' / "
                             f"'sliding_attention', got {types!r}")
    return [names[t] for t in types]


def hf_layer_types(args: ModelArgs) -> list[str]:
    """Our per-layer kinds as HF's layer_types."""
    return ["sliding_attention" if s.kind == "local" else "full_attention"
            for s in args.layer_specs()]


# ---- GGUF metadata -----------------------------------------------------------------------------
#
# llama.cpp's `llama` architecture (also Mistral: its converter writes MistralForCausalLM as
# `llama`) stores q/k rows in Meta's interleaved RoPE layout (its converter permutes HF's back),
# `qwen2` keeps HF's rotate_half rows (llama.cpp rotates them NeoX-style), hence the permuted
# layouts of the Qwen2 table. RoPE scaling: `{arch}.rope.scaling.type` linear / yarn with its
# keys; Llama 3.1's rule has no type key but a `rope_freqs` tensor of per-frequency divisors.

ROPE_FREQS = "rope_freqs.weight"
_ROPE_FREQS = re.compile(re.escape(ROPE_FREQS))
#: llama.cpp's converter computes rope_freqs with these when a config does not say (factor,
#: low_freq_factor, high_freq_factor, original context: Llama 3.1's values).
LLAMA3_DEFAULTS = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_seq_len": 8192}


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """llama.cpp's `rope_freqs` for Llama 3.1's rule (its converter's `generate_extra_tensors`):
    per frequency θ_i the divisor 1 (short wavelengths), factor (long ones) or
    1 / ((1 − smooth)/factor + smooth) in between; float32 (head_dim/2,)."""
    s, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    L = scaling["original_max_seq_len"]
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < L / high:
            out.append(1.0)
        elif wavelen > L / low:
            out.append(s)
        else:
            smooth = (L / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / s + smooth))
    return torch.tensor(out, dtype=torch.float32)


def llama3_from_rope_factors(factors: torch.Tensor, head_dim: int, theta: float,
                             original: int) -> Optional[dict[str, Any]]:
    """A Llama 3.1 rope_scaling whose `llama3_rope_factors` equal `factors` (rtol 1e-4), with
    the given original context: factor = the largest divisor; low/high_freq_factor 1 and 4, or
    solved from two divisors of the smooth band. {} when every divisor is 1 (no scaling); None
    when no such rule gives them."""
    factors = factors.float().flatten()
    if factors.shape != (head_dim // 2,) or not torch.isfinite(factors).all():
        return None
    if torch.all(factors == 1):
        return {}
    s = float(factors.max())
    candidates = [{"type": "llama3", "factor": s, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_seq_len": original}]
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    band = [(original * float(f) / (2 * math.pi), (1 / float(x) - 1 / s) / (1 - 1 / s))
            for f, x in zip(freqs, factors) if 1.0001 < float(x) < s / 1.0001]
    if len(band) >= 2 and s > 1:                 # smooth = (L/λ − low) / (high − low)
        (r0, m0), (r1, m1) = band[0], band[-1]
        if abs(m1 - m0) > 1e-6:
            width = (r1 - r0) / (m1 - m0)
            low = r0 - m0 * width
            if low > 0 and width > 0:
                candidates.append({**candidates[0], "low_freq_factor": low,
                                   "high_freq_factor": low + width})
    for scaling in candidates:
        if torch.allclose(llama3_rope_factors(head_dim, theta, scaling), factors, rtol=1e-4,
                          atol=0):
            return scaling
    return None


def _gguf_rope_scaling(arch: str, metadata: dict[str, Any], tensors, source: str,
                       head_dim: int, theta: float) -> Optional[dict[str, Any]]:
    """ModelArgs.rope_scaling from `{arch}.rope.scaling.*` keys and a `rope_freqs` tensor."""
    def key(name: str, kind: type, default=MISSING):
        return checked_field(metadata, f"{arch}.rope.scaling.{name}", kind, source, default,
                             what="metadata key")

    kind = key("type", str, "none")
    attn = key("attn_factor", float, 1.0)
    if attn != 1.0:
        raise ModelFileError(f"{source}: {arch}.rope.scaling.attn_factor={attn} is not supported")
    if ROPE_FREQS in tensors:
        if kind != "none":
            raise ModelFileError(f"{source}: RoPE scaling {kind!r} together with a "
                                 f"{ROPE_FREQS} tensor is not supported")
        original = key("original_context_length", int, LLAMA3_DEFAULTS["original_max_seq_len"])
        get = tensors.get(ROPE_FREQS) if isinstance(tensors, dict) else None
        if get is None:    # names only (read_model_args): llama.cpp's converter's defaults
            return {"type": "llama3", **LLAMA3_DEFAULTS, "original_max_seq_len": original}
        factors = get()
        scaling = llama3_from_rope_factors(factors, head_dim, theta, original)
        if scaling is None:
            shown = ", ".join(f"{x:.4g}" for x in factors.flatten()[:8].tolist())
            raise ModelFileError(
                f"{source}: {ROPE_FREQS} ({shown}, ...) does not follow Llama 3.1's RoPE rule "
                f"(factor = its largest value, low_freq_factor 1, high_freq_factor 4, original "
                f"context {original}); other per-frequency RoPE factors are not supported")
        return scaling or None
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise ModelFileError(f"{source}: RoPE scaling {kind!r} ({arch}.rope.scaling.type) is "
                             "not supported (supported: none, linear, yarn, and Llama 3.1's "
                             f"{ROPE_FREQS})")
    factor = key("factor", float)
    if factor < 1:
        raise ModelFileError(f"{source}: {arch}.rope.scaling.factor={factor} must be ≥ 1")
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    ext = key("yarn_ext_factor", float, 1.0)
    if ext != 1.0:
        raise ModelFileError(f"{source}: {arch}.rope.scaling.yarn_ext_factor={ext} is not "
                             "supported (only 1)")
    scaling: dict[str, Any] = {"type": "yarn", "factor": factor,
                               "original_max_seq_len": key("original_context_length", int)}
    for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                         ("attention_factor", "yarn_attn_factor")):
        value = key(theirs, float, None)
        if value is not None:
            scaling[ours] = value
    return scaling


def _write_gguf_rope_scaling(writer, args: ModelArgs) -> None:
    """`{arch}.rope.scaling.*` keys (linear, yarn) or llama.cpp's rope_freqs tensor (llama3),
    as llama.cpp's converter writes them."""
    scaling = args.rope_scaling
    if not scaling:
        return
    arch = writer.arch
    if scaling["type"] == "llama3":
        writer.add_tensor(ROPE_FREQS, llama3_rope_factors(
            args.head_dim, args.rope_theta, scaling).numpy())
        # not a key llama.cpp reads for llama3 (only YaRN does): it tells our reader the rule's
        # original context; a factor key would make llama.cpp scale linearly too
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length",
                          scaling["original_max_seq_len"])
        return
    writer.add_string(f"{arch}.rope.scaling.type", scaling["type"])
    writer.add_float32(f"{arch}.rope.scaling.factor", scaling["factor"])
    if scaling["type"] == "yarn":
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length",
                          scaling["original_max_seq_len"])
        for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                             ("attention_factor", "yarn_attn_factor")):
            if scaling.get(ours) is not None:
                writer.add_float32(f"{arch}.rope.scaling.{theirs}", scaling[ours])


def gguf_rope_unsupported(args: ModelArgs) -> Optional[str]:
    """Why args.rope_scaling cannot go to a llama-shaped GGUF file, or None."""
    scaling = args.rope_scaling
    if not scaling:
        return None
    if scaling["type"] == "yarn" and (scaling.get("mscale") or scaling.get("mscale_all_dim")):
        return "GGUF llama/qwen2/mistral files hold YaRN without mscale / mscale_all_dim"
    if scaling["type"] == "llama3":
        factors = llama3_rope_factors(args.head_dim, args.rope_theta, scaling)
        if llama3_from_rope_factors(factors, args.head_dim, args.rope_theta,
                                    scaling["original_max_seq_len"]) is None:
            return "these llama3 RoPE parameters cannot be read back from a rope_freqs tensor"
        return None
    if scaling["type"] not in ("linear", "yarn"):
        return f"GGUF has no {scaling['type']!r} RoPE scaling (linear, yarn, llama3 only)"
    return None


def _gguf_args(arch: str, metadata: dict[str, Any], tensors, source: str,
               **extra) -> ModelArgs:
    """`ModelArgs` from the `{arch}.*` keys llama.cpp's llama-shaped architectures share."""
    def need(key: str, kind: type = int, default=MISSING):
        return checked_field(metadata, f"{arch}.{key}", kind, source, default,
                             what="metadata key")

    n_heads = need("attention.head_count")
    n_vocab = need("vocab_size", int, None) or len(metadata.get("tokenizer.ggml.tokens") or [])
    if not n_vocab:
        raise ModelFileError(
            f"{source}: vocabulary size unknown ({arch}.vocab_size and tokenizer.ggml.tokens "
            "are both missing)")
    dim = need("embedding_length")
    head_dim = need("attention.key_length", int, None)
    value_dim = need("attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise ModelFileError(f"{source}: {arch}.attention.value_length={value_dim} differs from "
                             f"{arch}.attention.key_length={head_dim}; not supported")
    theta = need("rope.freq_base", float, 10000.0)
    try:
        args = ModelArgs(
            dim=dim,
            n_layers=need("block_count"),
            n_heads=n_heads,
            n_kv_heads=need("attention.head_count_kv", int, n_heads),
            head_dim=head_dim,
            vocab_size=n_vocab,
            hidden_dim=need("feed_forward_length"),
            norm_eps=need("attention.layer_norm_rms_epsilon", float),
            rope_theta=theta,
            max_seq_len=need("context_length"),
            tie_embeddings="output.weight" not in tensors,
            **extra)
    except ArgumentError as e:
        raise ModelFileError(f"{source}: metadata does not describe a valid model: {e}") from e
    rope_dims = need("rope.dimension_count", int, args.head_dim)
    if rope_dims != args.head_dim:
        raise ModelFileError(
            f"{source}: partial RoPE ({arch}.rope.dimension_count={rope_dims}, head_dim="
            f"{args.head_dim}) is not supported")
    scaling = _gguf_rope_scaling(arch, metadata, tensors, source, args.head_dim, theta)
    try:
        return args.replace(rope_scaling=scaling) if scaling else args
    except ArgumentError as e:
        raise ModelFileError(f"{source}: metadata does not describe a valid model: {e}") from e


def args_from_gguf(metadata: dict[str, Any], tensor_names, source: str) -> ModelArgs:
    """`ModelArgs` from a GGUF file's `llama.*` metadata: Llama, with RoPE scaling (linear, yarn
    or Llama 3.1's rope_freqs), and Mistral when `llama.attention.sliding_window` is set.

    Args:
        metadata: all key/values of the file.
        tensor_names: names of the tensors in the file (an absent `output.weight` means tied
            embeddings); a mapping name → values getter (`checkpoint.gguf.TensorIndex`) lets
            the rope_freqs factors be checked against Llama 3.1's rule.
        source: file path, for error messages.

    Raises:
        ModelFileError: unsupported RoPE scaling, a missing required key, or values that do not
            form a valid model.
    """
    window = checked_field(metadata, "llama.attention.sliding_window", int, source, None,
                           what="metadata key")
    experts = checked_field(metadata, "llama.expert_count", int, source, 0, what="metadata key")
    moe = dict(n_experts=experts, n_experts_per_token=checked_field(
        metadata, "llama.expert_used_count", int, source, what="metadata key")) if experts else {}
    return _gguf_args("llama", metadata, tensor_names, source, sliding_window=window or None,
                      **moe)


def qwen2_args_from_gguf(metadata: dict[str, Any], tensor_names, source: str) -> ModelArgs:
    """`ModelArgs` from a GGUF file's `qwen2.*` metadata (as `args_from_gguf`; q/k/v biases)."""
    return _gguf_args("qwen2", metadata, tensor_names, source, qkv_bias=True)


def gguf_metadata(writer, args: ModelArgs) -> None:
    """Write the `{arch}.*` hyperparameter keys llama.cpp reads (arch: the writer's), the
    RoPE scaling, and Mistral's sliding window."""
    gguf_sizes(writer, args)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_rope_dimension_count(args.head_dim)
    if args.head_dim != args.dim // args.n_heads:
        writer.add_key_length(args.head_dim)
        writer.add_value_length(args.head_dim)
    writer.add_vocab_size(args.vocab_size)
    if args.n_experts:                                  # Mixtral, Qwen3-MoE
        writer.add_expert_count(args.n_experts)
        writer.add_expert_used_count(args.n_experts_per_token)
    if args.sliding_window is not None:
        writer.add_uint32(f"{writer.arch}.attention.sliding_window", args.sliding_window)
    _write_gguf_rope_scaling(writer, args)


# Mixtral's GGUF files are `llama` files with experts (llama.cpp's converter): the router and
# 3-D expert tensors, read through this table (`families.moe.MIXTRAL` writes them).
GGUF_EXPERT_ROWS = (
    Tensors("layers.{i}.feed_forward.gate.weight", None, "blk.{i}.ffn_gate_inp.weight"),
) + tuple(Tensors(f"layers.{{i}}.feed_forward.experts.{{e}}.{ours}.weight", None,
                  f"blk.{{i}}.ffn_{gguf}_exps.weight", gguf_layout=Stacked())
          for ours, gguf in (("w1", "gate"), ("w2", "down"), ("w3", "up")))

LLAMA = Family(
    name="llama", tensors=TENSORS + GGUF_EXPERT_ROWS,
    hf_architectures=("LlamaForCausalLM",), hf_model_type="llama",
    gguf_architecture="llama",
    args_from_hf=llama_args_from_hf, hf_config=llama_hf_config,
    args_from_gguf=args_from_gguf, gguf_metadata=gguf_metadata,
    unsupported=_llama_unsupported, gguf_ignored=_ROPE_FREQS,
)

# llama.cpp's qwen2 keeps HF's rotate_half q/k rows (and biases): the GGUF layouts are HF's.
QWEN2_TENSORS = tuple(replace(t, gguf_layout=t.hf_layout) if isinstance(t.hf_layout, RopePermuted)
                      else t for t in TENSORS)

QWEN2 = Family(
    name="qwen2", tensors=QWEN2_TENSORS,
    hf_architectures=("Qwen2ForCausalLM",), hf_model_type="qwen2",
    gguf_architecture="qwen2",
    args_from_hf=qwen2_args_from_hf, hf_config=qwen2_hf_config,
    args_from_gguf=qwen2_args_from_gguf, gguf_metadata=gguf_metadata,
    unsupported=_qwen2_unsupported, gguf_ignored=_ROPE_FREQS,
)

# Mistral's GGUF files are `llama` files (llama.cpp's converter writes MistralForCausalLM so);
# `llama.attention.sliding_window` holds the window, which llama.cpp's llama architecture and
# transformers' GGUF loader do not apply (the same model up to the window). Read through LLAMA
# (the same architecture and reader).
MISTRAL = Family(
    name="mistral", tensors=TENSORS,
    hf_architectures=("MistralForCausalLM",), hf_model_type="mistral",
    gguf_architecture="llama",
    args_from_hf=mistral_args_from_hf, hf_config=mistral_hf_config,
    args_from_gguf=args_from_gguf, gguf_metadata=gguf_metadata,
    unsupported=_mistral_unsupported, gguf_ignored=_ROPE_FREQS,
)
