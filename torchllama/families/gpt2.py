"""GPT-2 (Radford et al. 2019): pre-norm LayerNorm blocks with biases, learned absolute
positions, a GELU (tanh) MLP of 4·dim, biases on every projection, tied embeddings.

HF's `GPT2LMHeadModel` stores its projections as `Conv1D` weights, the transpose of
`nn.Linear`'s (in, out), and fuses q, k and v into one `c_attn` (`Fused`, `Transposed`).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from torchllama.config import ModelArgs
from torchllama.errors import MISSING, ArgumentError, ModelFileError, checked_field
from torchllama.families.base import Family, Fused, Tensors, Transposed, hf_key, unsupported_fields


def _qkv_sizes(args: ModelArgs) -> tuple[int, int, int]:
    return (args.n_heads * args.head_dim,) + (args.n_kv_heads * args.head_dim,) * 2


_QKV = Fused(_qkv_sizes, dim=0, transposed=True)
# llama.cpp's gpt2: the same fused q/k/v rows, as nn.Linear (out, in) (its converter transposes
# the Conv1D weights back)
_GGUF_QKV = Fused(_qkv_sizes, dim=0)
_H = "transformer.h.{i}."
_B = "blk.{i}."
_Q, _K, _V = ("layers.{i}.attention.wq", "layers.{i}.attention.wk", "layers.{i}.attention.wv")
TENSORS = (
    Tensors("tok_embeddings.weight", "transformer.wte.weight", "token_embd.weight"),
    Tensors("pos_embeddings.weight", "transformer.wpe.weight", "position_embd.weight"),
    Tensors("layers.{i}.attention_norm.weight", _H + "ln_1.weight", _B + "attn_norm.weight"),
    Tensors("layers.{i}.attention_norm.bias", _H + "ln_1.bias", _B + "attn_norm.bias"),
    Tensors((_Q + ".weight", _K + ".weight", _V + ".weight"), _H + "attn.c_attn.weight",
            _B + "attn_qkv.weight", hf_layout=_QKV, gguf_layout=_GGUF_QKV),
    Tensors((_Q + ".bias", _K + ".bias", _V + ".bias"), _H + "attn.c_attn.bias",
            _B + "attn_qkv.bias", hf_layout=_QKV, gguf_layout=_GGUF_QKV),
    Tensors("layers.{i}.attention.wo.weight", _H + "attn.c_proj.weight",
            _B + "attn_output.weight", hf_layout=Transposed()),
    Tensors("layers.{i}.attention.wo.bias", _H + "attn.c_proj.bias", _B + "attn_output.bias"),
    Tensors("layers.{i}.ffn_norm.weight", _H + "ln_2.weight", _B + "ffn_norm.weight"),
    Tensors("layers.{i}.ffn_norm.bias", _H + "ln_2.bias", _B + "ffn_norm.bias"),
    Tensors("layers.{i}.feed_forward.w1.weight", _H + "mlp.c_fc.weight", _B + "ffn_up.weight",
            hf_layout=Transposed()),
    Tensors("layers.{i}.feed_forward.w1.bias", _H + "mlp.c_fc.bias", _B + "ffn_up.bias"),
    Tensors("layers.{i}.feed_forward.w2.weight", _H + "mlp.c_proj.weight",
            _B + "ffn_down.weight", hf_layout=Transposed()),
    Tensors("layers.{i}.feed_forward.w2.bias", _H + "mlp.c_proj.bias", _B + "ffn_down.bias"),
    Tensors("norm.weight", "transformer.ln_f.weight", "output_norm.weight"),
    Tensors("norm.bias", "transformer.ln_f.bias", "output_norm.bias"),
    Tensors("output.weight", "lm_head.weight", "output.weight"),
)

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                "relu": "relu"}


def gpt2_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `GPT2LMHeadModel` config.json (transformers' GPT2Config defaults).

    Raises:
        ModelFileError: a required key missing or of the wrong type, or a feature we do not
            implement (attention scaled by the layer index, no attention scaling, cross
            attention, another activation).
    """
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False)):
        if hf_key(config, key, bool, source, ok) != ok:
            raise ModelFileError(f"{source}: {key}={not ok} is not supported")
    act = hf_key(config, "activation_function", str, source, "gelu_new")
    if act not in _ACTIVATIONS:
        raise ModelFileError(f"{source}: activation_function {act!r} is not supported "
                             f"(supported: {', '.join(_ACTIVATIONS)})")
    dim = hf_key(config, "n_embd", int, source, 768)
    try:
        return ModelArgs(
            dim=dim, n_layers=hf_key(config, "n_layer", int, source, 12),
            n_heads=hf_key(config, "n_head", int, source, 12),
            vocab_size=hf_key(config, "vocab_size", int, source, 50257),
            hidden_dim=hf_key(config, "n_inner", int, source, None) or 4 * dim,
            norm_eps=hf_key(config, "layer_norm_epsilon", float, source, 1e-5),
            max_seq_len=hf_key(config, "n_positions", int, source, 1024),
            tie_embeddings=hf_key(config, "tie_word_embeddings", bool, source, True),
            norm="layernorm", norm_bias=True, mlp=_ACTIVATIONS[act], position="learned",
            qkv_bias=True, out_bias=True, mlp_bias=True)
    except ArgumentError as e:
        raise ModelFileError(f"{source}: {e}") from e


def gpt2_hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of a `GPT2LMHeadModel`."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "n_embd": args.dim, "n_layer": args.n_layers, "n_head": args.n_heads,
            "n_inner": args.ffn_hidden_dim, "vocab_size": args.vocab_size,
            "n_positions": args.max_seq_len, "layer_norm_epsilon": args.norm_eps,
            "tie_word_embeddings": args.tie_embeddings,
            "activation_function": {"gelu_tanh": "gelu_new", "gelu": "gelu",
                                    "relu": "relu"}[args.mlp]}


def gpt2_args_from_gguf(metadata: dict[str, Any], tensor_names, source: str) -> ModelArgs:
    """`ModelArgs` from a GGUF file's `gpt2.*` metadata (llama.cpp's gpt2: LayerNorm with
    biases, learned positions, tanh-GELU MLP, biases everywhere; tied unless `output.weight`).

    Raises:
        ModelFileError: a missing required key, or values that do not form a valid model.
    """
    def need(key: str, kind: type = int, default=MISSING):
        return checked_field(metadata, f"gpt2.{key}", kind, source, default,
                             what="metadata key")

    n_vocab = need("vocab_size", int, None) or len(metadata.get("tokenizer.ggml.tokens") or [])
    if not n_vocab:
        raise ModelFileError(f"{source}: vocabulary size unknown (gpt2.vocab_size and "
                             "tokenizer.ggml.tokens are both missing)")
    n_heads = need("attention.head_count")
    try:
        return ModelArgs(
            dim=need("embedding_length"), n_layers=need("block_count"), n_heads=n_heads,
            n_kv_heads=need("attention.head_count_kv", int, n_heads),
            vocab_size=n_vocab, hidden_dim=need("feed_forward_length"),
            norm_eps=need("attention.layer_norm_epsilon", float),
            max_seq_len=need("context_length"),
            tie_embeddings="output.weight" not in tensor_names,
            norm="layernorm", norm_bias=True, mlp="gelu_tanh", position="learned",
            qkv_bias=True, out_bias=True, mlp_bias=True)
    except ArgumentError as e:
        raise ModelFileError(f"{source}: metadata does not describe a valid model: {e}") from e


def gpt2_gguf_metadata(writer, args: ModelArgs) -> None:
    """The `gpt2.*` keys llama.cpp's converter writes (and the vocabulary size)."""
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_hidden_dim)
    writer.add_head_count(args.n_heads)
    writer.add_layer_norm_eps(args.norm_eps)
    writer.add_vocab_size(args.vocab_size)


def _gpt2_unsupported(args: ModelArgs, fmt: str) -> Optional[str]:
    if fmt == "gguf" and args.mlp != "gelu_tanh":
        return "llama.cpp's gpt2 has the tanh GELU MLP (mlp: gelu_tanh)"
    needed = {"norm": "layernorm", "norm_bias": True, "position": "learned", "qkv_bias": True,
              "out_bias": True, "mlp_bias": True}
    for name, value in needed.items():
        if getattr(args, name) != value:
            return f"GPT-2 has {name}={value!r}"
    if args.n_kv_heads != args.n_heads or args.mlp not in ("gelu_tanh", "gelu", "relu"):
        return "GPT-2 has multi-head attention and a plain GELU/ReLU MLP"
    return unsupported_fields(args, {name: (lambda a: True) for name in (
        "norm", "norm_bias", "position", "qkv_bias", "out_bias", "mlp_bias", "mlp")})


GPT2 = Family(
    name="gpt2", tensors=TENSORS,
    hf_architectures=("GPT2LMHeadModel",), hf_model_type="gpt2", gguf_architecture="gpt2",
    args_from_hf=gpt2_args_from_hf, hf_config=gpt2_hf_config,
    args_from_gguf=gpt2_args_from_gguf, gguf_metadata=gpt2_gguf_metadata,
    unsupported=_gpt2_unsupported,
    hf_ignored=re.compile(r"transformer\.h\.\d+\.attn\.(masked_)?bias"),
)
