"""Gemma 2 and Gemma 3 (text): Llama's shape with sandwich norms ((1 + w) RMSNorm before and
after each sublayer), GeGLU with the tanh GELU, √dim embedding scale, a softmax scale of
query_pre_attn_scalar^-½, local (sliding-window) and global layers; Gemma 2 soft-caps attention
logits and final logits, Gemma 3 normalizes q and k per head instead (QK-norm) and uses RoPE base
10,000 on local layers.

HF names (transformers' modeling_gemma2.py / modeling_gemma3.py): note that Gemma's
`post_attention_layernorm` is the norm *after* attention (Llama's of the same name is the norm
before the MLP). q/k rows, and Gemma 3's q/k norm gains, are in HF's rotate_half order.

GGUF (llama.cpp's `gemma2` / `gemma3` architectures, convert_hf_to_gguf.py): the same rotate_half
order (llama.cpp applies Gemma's RoPE in its NEOX mode, so q/k are not permuted as for Llama),
and every norm gain stored as 1 + w, since ggml multiplies by the gain as it is (`UnitOffset`).
The local layers' RoPE base (10,000), the layer pattern (every 6th layer global in Gemma 3,
every 2nd in Gemma 2) and query_pre_attn_scalar are not in the file: llama.cpp's
llama-model.cpp hard-codes them, and so do we (`gemma_args_from_gguf`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torchllama.config import ModelArgs
from torchllama.errors import MISSING, ArgumentError, ModelFileError, checked_field
from torchllama.families.base import (Family, Layout, RopePermuted, Tensors, gguf_sizes, hf_key,
                                      hf_rope, hf_rope_parameters, unsupported_fields)
from torchllama.families.llama import _our_layer_types, hf_layer_types


@dataclass(frozen=True)
class UnitOffset(Layout):
    """A (1 + w) RMSNorm gain stored as the full gain 1 + w (llama.cpp's Gemma GGUF files), and,
    for QK-norm gains, in rotate_half order within the head (`heads`=1; see `RopePermuted`)."""

    heads: int | None = None

    def load(self, t, args):
        if self.heads:
            t = RopePermuted(self.heads).load(t, args)[0]
        return (t.float() - 1,)                      # in float32, as transformers' GGUF loader

    def save(self, ts, args):
        t = ts[0].float() + 1
        return RopePermuted(self.heads).save((t,), args) if self.heads else t


_L = "model.layers.{i}."
_B = "blk.{i}."
_GAIN = UnitOffset()
TENSORS = (
    Tensors("tok_embeddings.weight", "model.embed_tokens.weight", "token_embd.weight"),
    Tensors("norm.weight", "model.norm.weight", "output_norm.weight", gguf_layout=_GAIN),
    Tensors("output.weight", "lm_head.weight", "output.weight"),
    Tensors("layers.{i}.attention_norm.weight", _L + "input_layernorm.weight",
            _B + "attn_norm.weight", gguf_layout=_GAIN),
    Tensors("layers.{i}.attention.wq.weight", _L + "self_attn.q_proj.weight",
            _B + "attn_q.weight", hf_layout=RopePermuted("n_heads"),
            gguf_layout=RopePermuted("n_heads")),
    Tensors("layers.{i}.attention.wk.weight", _L + "self_attn.k_proj.weight",
            _B + "attn_k.weight", hf_layout=RopePermuted("n_kv_heads"),
            gguf_layout=RopePermuted("n_kv_heads")),
    Tensors("layers.{i}.attention.wv.weight", _L + "self_attn.v_proj.weight",
            _B + "attn_v.weight"),
    Tensors("layers.{i}.attention.wo.weight", _L + "self_attn.o_proj.weight",
            _B + "attn_output.weight"),
    Tensors("layers.{i}.attention.q_norm.weight", _L + "self_attn.q_norm.weight",
            _B + "attn_q_norm.weight", hf_layout=RopePermuted(1), gguf_layout=UnitOffset(1)),
    Tensors("layers.{i}.attention.k_norm.weight", _L + "self_attn.k_norm.weight",
            _B + "attn_k_norm.weight", hf_layout=RopePermuted(1), gguf_layout=UnitOffset(1)),
    Tensors("layers.{i}.post_attention_norm.weight", _L + "post_attention_layernorm.weight",
            _B + "post_attention_norm.weight", gguf_layout=_GAIN),
    Tensors("layers.{i}.ffn_norm.weight", _L + "pre_feedforward_layernorm.weight",
            _B + "ffn_norm.weight", gguf_layout=_GAIN),
    Tensors("layers.{i}.post_ffn_norm.weight", _L + "post_feedforward_layernorm.weight",
            _B + "post_ffw_norm.weight", gguf_layout=_GAIN),
    Tensors("layers.{i}.feed_forward.w1.weight", _L + "mlp.gate_proj.weight",
            _B + "ffn_gate.weight"),
    Tensors("layers.{i}.feed_forward.w2.weight", _L + "mlp.down_proj.weight",
            _B + "ffn_down.weight"),
    Tensors("layers.{i}.feed_forward.w3.weight", _L + "mlp.up_proj.weight",
            _B + "ffn_up.weight"),
)

#: Gemma 3's chat format (Google's chat_template of the instruction-tuned Gemma 3 checkpoints,
#: tokenizer_config.json), for text: a system message is folded into the first user turn, the
#: assistant's role is called "model", each turn ends with <end_of_turn> (a stop token).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
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


# ---- GGUF metadata -----------------------------------------------------------------------------

#: llama.cpp's block counts of the 27B models, whose softmax scale is (dim / n_heads)^-½ instead
#: of head_dim^-½ (query_pre_attn_scalar 144 and 168; llama-model.cpp, LLM_ARCH_GEMMA2/3).
_GGUF_27B_LAYERS = {2: 46, 3: 62}


def gemma_args_from_gguf(metadata: dict[str, Any], tensor_names: set[str], source: str,
                         version: int) -> ModelArgs:
    """`ModelArgs` of a llama.cpp `gemma2` / `gemma3` GGUF file.

    The keys are `{arch}.*` as llama.cpp's converter writes them (key_length is head_dim). What
    the file does not say is taken as llama.cpp's llama-model.cpp takes it: every 2nd (Gemma 2)
    or 6th (Gemma 3) layer global, the others local with the file's sliding window (or its
    `attention.sliding_window_pattern`); RoPE base 10,000 on Gemma 3's local layers (or
    `rope.freq_base_swa`); softmax scale head_dim^-½ (27B models: (dim / n_heads)^-½).

    Raises:
        ModelFileError: a required key missing or of the wrong type, RoPE scaling other than
            linear, or sizes that do not form a valid model.
    """
    arch = f"gemma{version}"

    def need(key: str, kind: type = int, default=MISSING):
        return checked_field(metadata, f"{arch}.{key}", kind, source, default,
                             what="metadata key")

    n_layers = need("block_count")
    n_heads = need("attention.head_count")
    dim = need("embedding_length")
    head_dim = need("attention.key_length", int, 256)
    if need("attention.value_length", int, head_dim) != head_dim:
        raise ModelFileError(f"{source}: {arch}.attention.value_length differs from key_length "
                             "(Gemma's values are as wide as its keys)")
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", 2 if version == 2 else 6)
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        types = ["global" if (i + 1) % pattern == 0 else "local" for i in range(n_layers)]
    elif isinstance(pattern, list) and len(pattern) == n_layers and \
            all(isinstance(p, bool) for p in pattern):
        types = ["local" if p else "global" for p in pattern]
    else:
        raise ModelFileError(f"{source}: metadata key {arch}.attention.sliding_window_pattern is "
                             f"{pattern!r}, expected a positive integer or {n_layers} booleans")
    scaling = None
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = need("rope.scaling.factor", float, 1.0)
    if kind == "linear" and factor != 1.0:
        scaling = {"type": "linear", "factor": factor}
    elif kind not in ("none", "linear", None):
        raise ModelFileError(f"{source}: {arch}.rope.scaling.type {kind!r} is not supported for "
                             "Gemma (supported: none, linear)")
    theta = need("rope.freq_base", float, 10000.0)
    local_theta = need("rope.freq_base_swa", float, 10000.0) if version == 3 else None
    scale_width = dim / n_heads if n_layers == _GGUF_27B_LAYERS[version] else head_dim
    n_vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", []))
    try:
        return ModelArgs(
            dim=dim, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=need("attention.head_count_kv", int, n_heads), head_dim=head_dim,
            vocab_size=n_vocab, hidden_dim=need("feed_forward_length"),
            norm_eps=need("attention.layer_norm_rms_epsilon", float),
            max_seq_len=need("context_length"), rope_theta=theta, rope_scaling=scaling,
            rope_local_theta=local_theta if local_theta != theta or scaling else None,
            tie_embeddings="output.weight" not in tensor_names,
            norm_unit_offset=True, norm_placement="sandwich", mlp="geglu_tanh",
            embed_scale=True, attn_scale=scale_width ** -0.5,
            attn_logit_softcap=need("attn_logit_softcapping", float, None),
            final_logit_softcap=need("final_logit_softcapping", float, None),
            qk_norm=version == 3,
            sliding_window=need("attention.sliding_window") if "local" in types else None,
            layer_types=types if "local" in types else None)
    except ArgumentError as e:
        raise ModelFileError(f"{source}: metadata does not describe a valid model: {e}") from e


def gemma_gguf_metadata(writer, args: ModelArgs, version: int) -> None:
    """Write the `gemma2.*` / `gemma3.*` hyperparameter keys llama.cpp reads."""
    gguf_sizes(writer, args)
    writer.add_key_length(args.head_dim)
    writer.add_value_length(args.head_dim)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_rope_freq_base(args.rope_theta)
    if args.rope_scaling:
        writer.add_rope_scaling_type(gguf_rope_scaling_type(args.rope_scaling["type"]))
        writer.add_rope_scaling_factor(args.rope_scaling["factor"])
    if args.sliding_window is not None:
        writer.add_sliding_window(args.sliding_window)
    if version == 2:
        if args.attn_logit_softcap is not None:
            writer.add_attn_logit_softcapping(args.attn_logit_softcap)
        if args.final_logit_softcap is not None:
            writer.add_final_logit_softcapping(args.final_logit_softcap)
    writer.add_vocab_size(args.vocab_size)


def gguf_rope_scaling_type(kind: str):
    """The gguf library's RopeScalingType of ours ("linear")."""
    import gguf

    return {"linear": gguf.RopeScalingType.LINEAR, "yarn": gguf.RopeScalingType.YARN}[kind]


def _gemma_gguf_unsupported(args: ModelArgs, version: int) -> Optional[str]:
    """Why a llama.cpp gemma GGUF file cannot hold this Gemma-shaped model (what llama.cpp
    hard-codes must hold), or None."""
    pattern = 2 if version == 2 else 6
    want = ["global" if (i + 1) % pattern == 0 else "local" for i in range(args.n_layers)]
    if args.sliding_window is None or args.layer_types != want:
        return (f"llama.cpp's gemma{version} has a sliding window and every {pattern}th layer "
                "global")
    if version == 3 and (args.rope_local_theta or args.rope_theta) != 10000.0:
        return "llama.cpp's gemma3 has RoPE base 10,000 on local layers"
    width = args.dim / args.n_heads if args.n_layers == _GGUF_27B_LAYERS[version] \
        else args.head_dim
    if abs(args.attn_scale - width ** -0.5) > 1e-9 * width ** -0.5:
        return f"llama.cpp's gemma{version} has the softmax scale {width:g}^-1/2"
    if args.mlp != "geglu_tanh":
        return "llama.cpp's Gemma has GeGLU with the tanh GELU"
    if args.rope_scaling and args.rope_scaling["type"] != "linear":
        return "llama.cpp's Gemma has only linear RoPE scaling"
    if version == 3 and (args.attn_logit_softcap or args.final_logit_softcap):
        return "llama.cpp's gemma3 has no soft-capping"
    return None


def _number(x: float) -> int | float:
    """x as an int when it is one (to rounding), for config keys typed int."""
    return int(round(x)) if abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else x


def _gemma_unsupported(args: ModelArgs, fmt: str, version: int) -> Optional[str]:
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
    why = unsupported_fields(args, allowed)
    if why is None and fmt == "gguf":
        why = _gemma_gguf_unsupported(args, version)
    return why


GEMMA2 = Family(
    name="gemma2", tensors=TENSORS,
    hf_architectures=("Gemma2ForCausalLM",), hf_model_type="gemma2",
    gguf_architecture="gemma2",
    args_from_hf=gemma2_args_from_hf, hf_config=lambda a: _gemma_hf_config(a, 2),
    args_from_gguf=lambda m, names, src: gemma_args_from_gguf(m, names, src, 2),
    gguf_metadata=lambda w, a: gemma_gguf_metadata(w, a, 2),
    unsupported=lambda a, fmt: _gemma_unsupported(a, fmt, 2),
    chat_template=GEMMA_CHAT_TEMPLATE,
)

GEMMA3 = Family(
    name="gemma3", tensors=TENSORS,
    hf_architectures=("Gemma3ForCausalLM",), hf_model_type="gemma3_text",
    gguf_architecture="gemma3",
    args_from_hf=gemma3_args_from_hf, hf_config=lambda a: _gemma_hf_config(a, 3),
    args_from_gguf=lambda m, names, src: gemma_args_from_gguf(m, names, src, 3),
    gguf_metadata=lambda w, a: gemma_gguf_metadata(w, a, 3),
    unsupported=lambda a, fmt: _gemma_unsupported(a, fmt, 3),
    chat_template=GEMMA_CHAT_TEMPLATE,
)
