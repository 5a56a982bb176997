"""MPT (MosaicML): pre-norm LayerNorm blocks without biases, ALiBi instead of position embeddings
(with alibi_bias_max 8 its slopes are Press et al.'s), a GELU MLP of expansion_ratio·dim, a fused
q/k/v projection (`Wqkv`, nn.Linear rows q, k, v), tied embeddings.

Names from transformers' modeling_mpt.py.
"""

from __future__ import annotations

from typing import Any, Optional

from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError, ModelFileError
from torchllama.families.base import Family, Fused, Tensors, hf_key, unsupported_fields

_B = "transformer.blocks.{i}."
_QKV = Fused(lambda a: (a.dim, a.dim, a.dim), dim=0)
TENSORS = (
    Tensors("tok_embeddings.weight", "transformer.wte.weight"),
    Tensors("layers.{i}.attention_norm.weight", _B + "norm_1.weight"),
    Tensors(("layers.{i}.attention.wq.weight", "layers.{i}.attention.wk.weight",
             "layers.{i}.attention.wv.weight"), _B + "attn.Wqkv.weight", hf_layout=_QKV),
    Tensors("layers.{i}.attention.wo.weight", _B + "attn.out_proj.weight"),
    Tensors("layers.{i}.ffn_norm.weight", _B + "norm_2.weight"),
    Tensors("layers.{i}.feed_forward.w1.weight", _B + "ffn.up_proj.weight"),
    Tensors("layers.{i}.feed_forward.w2.weight", _B + "ffn.down_proj.weight"),
    Tensors("norm.weight", "transformer.norm_f.weight"),
    Tensors("output.weight", "lm_head.weight"),
)


def mpt_args_from_hf(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of an `MptForCausalLM` config.json (transformers' MptConfig defaults).

    Raises:
        ModelFileError: biases, no ALiBi or a bias maximum other than 8, clipped or normalized
            q/k/v, multi-query attention, a logit scale, or a required key of the wrong type.
    """
    attn = config.get("attn_config") or {}
    if not isinstance(attn, dict):
        raise ModelFileError(f"{source}: attn_config must be an object")
    checks = ((config, "no_bias", True), (attn, "alibi", True), (attn, "alibi_bias_max", 8),
              (attn, "clip_qkv", None), (attn, "qk_ln", False),
              (attn, "attn_type", "multihead_attention"), (config, "logit_scale", None))
    for where, key, want in checks:
        if key in where and where[key] != want:
            raise ModelFileError(f"{source}: {key}={where[key]!r} is not supported (only "
                                 f"{want!r})")
    dim = hf_key(config, "d_model", int, source, 2048)
    scale = attn.get("softmax_scale")
    try:
        return ModelArgs(
            dim=dim, n_layers=hf_key(config, "n_layers", int, source, 24),
            n_heads=hf_key(config, "n_heads", int, source, 16),
            vocab_size=hf_key(config, "vocab_size", int, source, 50368),
            hidden_dim=hf_key(config, "expansion_ratio", int, source, 4) * dim,
            norm_eps=hf_key(config, "layer_norm_epsilon", float, source, 1e-5),
            max_seq_len=hf_key(config, "max_seq_len", int, source, 2048),
            tie_embeddings=True, norm="layernorm", mlp="gelu", position="alibi",
            attn_scale=float(scale) if scale is not None else None)
    except ArgumentError as e:
        raise ModelFileError(f"{source}: {e}") from e


def mpt_hf_config(args: ModelArgs) -> dict[str, Any]:
    """config.json keys of an `MptForCausalLM`."""
    return {"architectures": ["MptForCausalLM"], "model_type": "mpt", "d_model": args.dim,
            "n_layers": args.n_layers, "n_heads": args.n_heads,
            "expansion_ratio": args.ffn_hidden_dim // args.dim, "vocab_size": args.vocab_size,
            "max_seq_len": args.max_seq_len, "layer_norm_epsilon": args.norm_eps,
            "no_bias": True, "attn_config": {"alibi": True, "alibi_bias_max": 8,
                                             "softmax_scale": args.attn_scale}}


def _mpt_unsupported(args: ModelArgs, fmt: str) -> Optional[str]:
    if fmt == "gguf":
        return "no GGUF writer for mpt yet"
    needed = {"norm": "layernorm", "position": "alibi", "mlp": "gelu", "tie_embeddings": True}
    for name, value in needed.items():
        if getattr(args, name) != value:
            return f"MPT has {name}={value!r}"
    if args.n_kv_heads != args.n_heads or args.ffn_hidden_dim % args.dim:
        return "MPT has multi-head attention and an MLP of an integer multiple of dim"
    return unsupported_fields(args, {name: (lambda a: True) for name in (
        "norm", "position", "mlp", "attn_scale")})


MPT = Family(
    name="mpt", tensors=TENSORS,
    hf_architectures=("MptForCausalLM",), hf_model_type="mpt",
    args_from_hf=mpt_args_from_hf, hf_config=mpt_hf_config,
    unsupported=_mpt_unsupported,
)
