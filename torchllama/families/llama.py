"""Llama (1, 2, TinyLlama, SmolLM, ...): Meta's names are ours; HF's `LlamaForCausalLM` and
llama.cpp's `llama` architecture name them differently, and HF stores q/k rows permuted for its
rotate_half RoPE (`RopePermuted`).

Sources: Meta's llama/model.py (names, fairscale split dims); transformers'
convert_llama_weights_to_hf.py and LlamaConfig (HF names, permutation, config keys and defaults);
llama.cpp's gguf-py constants (GGUF names and `llama.*` keys).
"""

from __future__ import annotations

from typing import Any

from torchllama.config import ModelArgs
from torchllama.errors import MISSING, ArgumentError, ModelFileError, checked_field
from torchllama.families.base import Family, RopePermuted, Tensors

# ours, HF LlamaForCausalLM, GGUF `llama`, layout in HF files, Meta's model-parallel split dim:
# ColumnParallelLinear splits output features (dim 0 of (out, in)), RowParallelLinear input
# features (dim 1), ParallelEmbedding the embedding dimension (dim 1); norms are replicated.
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
    Tensors("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight",
            "blk.{i}.ffn_norm.weight"),
    Tensors("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight",
            "blk.{i}.ffn_gate.weight", meta_shard_dim=0),
    Tensors("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight",
            "blk.{i}.ffn_down.weight", meta_shard_dim=1),
    Tensors("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight",
            "blk.{i}.ffn_up.weight", meta_shard_dim=0),
)


# ---- config.json -------------------------------------------------------------------------------

def _key(config: dict[str, Any], key: str, typ: type, source: str, default: Any = MISSING) -> Any:
    return checked_field(config, key, typ, source, default, what="key")


def _rope_theta(config: dict[str, Any], source: str) -> float:
    """θ from `rope_theta` (transformers 4) or `rope_parameters` (transformers 5); scaling
    schemes (linear, dynamic, yarn, llama3, ...) are refused."""
    theta = _key(config, "rope_theta", float, source, None)
    for key in ("rope_scaling", "rope_parameters"):
        params = config.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ModelFileError(f"{source}: {key!r} is {params!r}, expected an object or null")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise ModelFileError(
                f"{source}: {key} of type {kind!r} is not supported yet (only plain RoPE, "
                "rope_type 'default')")
        if "rope_theta" in params:
            theta = _key(params, "rope_theta", float, f"{source}: {key}")
    return 10000.0 if theta is None else theta


def args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `LlamaForCausalLM` config.json.

    Keys transformers' `LlamaConfig` gives defaults to get the same defaults here
    (num_key_value_heads = num_attention_heads, rms_norm_eps 1e-6, rope_theta 10000,
    max_position_embeddings 2048, tie_word_embeddings false, hidden_act silu); `torch_dtype` /
    `dtype` are ignored (the caller picks the dtype).

    Raises:
        ModelFileError: a required key missing or of the wrong type, or a feature we do not
            implement (RoPE scaling, biases, a head_dim other than hidden_size /
            num_attention_heads, an activation other than SiLU).
    """
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ModelFileError(f"{source}: {key}=true is not supported (Llama has no biases)")
    act = _key(config, "hidden_act", str, source, "silu")
    if act not in ("silu", "swish"):
        raise ModelFileError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    dim = _key(config, "hidden_size", int, source)
    n_heads = _key(config, "num_attention_heads", int, source)
    head_dim = _key(config, "head_dim", int, source, None)
    if head_dim is not None and n_heads > 0 and head_dim * n_heads != dim:
        raise ModelFileError(
            f"{source}: head_dim {head_dim} other than hidden_size / num_attention_heads "
            f"({dim} / {n_heads}) is not supported")
    try:
        return ModelArgs(
            dim=dim,
            n_layers=_key(config, "num_hidden_layers", int, source),
            n_heads=n_heads,
            n_kv_heads=_key(config, "num_key_value_heads", int, source, n_heads),
            vocab_size=_key(config, "vocab_size", int, source),
            hidden_dim=_key(config, "intermediate_size", int, source),
            norm_eps=_key(config, "rms_norm_eps", float, source, 1e-6),
            rope_theta=_rope_theta(config, source),
            max_seq_len=_key(config, "max_position_embeddings", int, source, 2048),
            tie_embeddings=_key(config, "tie_word_embeddings", bool, source, False),
        )
    except ArgumentError as e:  # inconsistent sizes, found by ModelArgs.__post_init__
        raise ModelFileError(f"{source}: {e}") from e


def hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of a `LlamaForCausalLM` with these hyperparameters (transformers' names;
    the caller adds dtype and token ids)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


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
    name="llama",
    tensors=TENSORS,
    hf_architectures=("LlamaForCausalLM",),
    hf_model_type="llama",
    gguf_architecture="llama",
    args_from_hf=args_from_hf,
    hf_config=hf_config,
    args_from_gguf=args_from_gguf,
    gguf_metadata=gguf_metadata,
)
