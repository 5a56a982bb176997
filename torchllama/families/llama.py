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

from typing import Any, Optional

from torchllama.config import ModelArgs
from torchllama.errors import MISSING, ArgumentError, ModelFileError, checked_field
from torchllama.families.base import (Family, RopePermuted, Tensors, hf_key, hf_max_positions,
                                      hf_rope, hf_rope_parameters, unsupported_fields)

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
        return unsupported_fields(args, {})
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
    n_layers = hf_key(config, "num_hidden_layers", int, source)
    window = None
    types = None
    if hf_key(config, "use_sliding_window", bool, source, False):
        window = hf_key(config, "sliding_window", int, source)
        first = hf_key(config, "max_window_layers", int, source, 28)
        types = config.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    return _common_hf_args(config, source, qkv_bias=True, sliding_window=window,
                           layer_types=_our_layer_types(types, source))


def qwen2_hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of a `Qwen2ForCausalLM`."""
    config = {**_common_hf_config(args), "architectures": ["Qwen2ForCausalLM"],
              "model_type": "qwen2", "use_sliding_window": args.sliding_window is not None,
              "sliding_window": args.sliding_window}
    if args.sliding_window is not None:
        config["layer_types"] = hf_layer_types(args)
        config["max_window_layers"] = 0
    return config


def _qwen2_unsupported(args: ModelArgs, fmt: str) -> Optional[str]:
    if fmt == "gguf":
        return "no GGUF writer for qwen2 yet"
    if not args.qkv_bias:
        return "Qwen2 has biases on q, k and v (qkv_bias: true)"
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
    if fmt == "gguf":
        return "no GGUF writer for mistral yet"
    if args.sliding_window is None:
        return "Mistral has a sliding window"
    if args.layer_types and "global" in args.layer_types:
        return "Mistral's sliding window is on every layer (layer_types all local)"
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

def args_from_gguf(metadata: dict[str, Any], tensor_names: set[str], source: str) -> ModelArgs:
    """`ModelArgs` from a GGUF file's `llama.*` metadata.

    Args:
        metadata: all key/values of the file.
        tensor_names: names of the tensors in the file (an absent `output.weight` means tied
            embeddings).
        source: file path, for error messages.

    Raises:
        ModelFileError: RoPE scaling, a missing required key, or values that do not form a
            valid model.
    """
    arch = "llama"

    def need(key: str, kind: type = int, default=MISSING):
        return checked_field(metadata, f"{arch}.{key}", kind, source, default,
                             what="metadata key")

    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise ModelFileError(f"{source}: RoPE scaling ({scaling!r}) is not supported yet")
    n_heads = need("attention.head_count")
    n_vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", []))
    if not n_vocab:
        raise ModelFileError(
            f"{source}: vocabulary size unknown ({arch}.vocab_size and tokenizer.ggml.tokens "
            "are both missing)")
    try:
        args = ModelArgs(
            dim=need("embedding_length"),
            n_layers=need("block_count"),
            n_heads=n_heads,
            n_kv_heads=need("attention.head_count_kv", int, n_heads),
            vocab_size=n_vocab,
            hidden_dim=need("feed_forward_length"),
            norm_eps=need("attention.layer_norm_rms_epsilon", float),
            rope_theta=need("rope.freq_base", float, 10000.0),
            max_seq_len=need("context_length"),
            tie_embeddings="output.weight" not in tensor_names,
        )
    except ArgumentError as e:
        raise ModelFileError(f"{source}: metadata does not describe a valid model: {e}") from e
    rope_dims = metadata.get(f"{arch}.rope.dimension_count", args.head_dim)
    if rope_dims != args.head_dim:
        raise ModelFileError(
            f"{source}: partial RoPE ({arch}.rope.dimension_count={rope_dims}, head_dim="
            f"{args.head_dim}) is not supported")
    return args


def gguf_metadata(writer, args: ModelArgs) -> None:
    """Write the `llama.*` hyperparameter keys llama.cpp reads."""
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_hidden_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_vocab_size(args.vocab_size)


LLAMA = Family(
    name="llama", tensors=TENSORS,
    hf_architectures=("LlamaForCausalLM",), hf_model_type="llama",
    gguf_architecture="llama",
    args_from_hf=llama_args_from_hf, hf_config=llama_hf_config,
    args_from_gguf=args_from_gguf, gguf_metadata=gguf_metadata,
    unsupported=_llama_unsupported,
)

QWEN2 = Family(
    name="qwen2", tensors=TENSORS,
    hf_architectures=("Qwen2ForCausalLM",), hf_model_type="qwen2",
    args_from_hf=qwen2_args_from_hf, hf_config=qwen2_hf_config,
    unsupported=_qwen2_unsupported,
)

MISTRAL = Family(
    name="mistral", tensors=TENSORS,
    hf_architectures=("MistralForCausalLM",), hf_model_type="mistral",
    args_from_hf=mistral_args_from_hf, hf_config=mistral_hf_config,
    unsupported=_mistral_unsupported,
)
