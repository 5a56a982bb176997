"""Hugging Face `LlamaForCausalLM` layout ↔ ours (Meta's): key names and the q/k permutation.

HF's `convert_llama_weights_to_hf.py` permutes the rows of wq and wk so that RoPE can be applied
with `rotate_half` (first half of each head rotated against the second half) instead of Meta's
interleaved pairs (2i, 2i+1). Within one head of width hd, Meta row 2i+c (c ∈ {0, 1}) becomes
HF row c·hd/2 + i. Undoing it needs the number of heads *of that matrix*: n_heads for wq,
n_kv_heads for wk (using n_heads for wk silently breaks every grouped-query model).

`read_hf` loads a `save_pretrained` folder: config.json → `ModelArgs`, model.safetensors (or the
shards listed in model.safetensors.index.json) → our state dict, read tensor by tensor with the
`safetensors` library, and the tokenizer (tokenizer.json or tokenizer.model, see
`torchllama.tokenizer.load_hf_tokenizer`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch

from torchllama.config import ModelArgs
from torchllama.errors import MISSING, checked_field, ArgumentError, ModelFileError


def permute_meta_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection from Meta's interleaved RoPE layout to HF's rotate_half layout.

    Args:
        w: (n_heads·head_dim, dim) weight of wq (n_heads) or wk (n_kv_heads).
        n_heads: number of heads of *this* matrix.

    Returns:
        (n_heads·head_dim, dim) tensor (a new tensor; w is unchanged).
    """
    rows, cols = w.shape
    hd = rows // n_heads
    return (w.view(n_heads, hd // 2, 2, cols)   # (heads, hd/2 pairs, 2 members, dim)
             .transpose(1, 2)                   # (heads, 2 members, hd/2 pairs, dim)
             .reshape(rows, cols))


def permute_hf_to_meta(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_meta_to_hf`: HF rotate_half rows back to Meta's interleaved pairs.

    Args:
        w: (n_heads·head_dim, dim) HF q_proj (n_heads) or k_proj (n_kv_heads) weight.
        n_heads: number of heads of *this* matrix.
    """
    rows, cols = w.shape
    hd = rows // n_heads
    return (w.view(n_heads, 2, hd // 2, cols)   # (heads, 2 halves, hd/2, dim)
             .transpose(1, 2)                   # (heads, hd/2, 2, dim)
             .reshape(rows, cols))


def hf_to_meta_state_dict(hf: dict[str, torch.Tensor], args: ModelArgs
                          ) -> dict[str, torch.Tensor]:
    """Rename and un-permute a `LlamaForCausalLM` state dict into our (Meta's) names.

    A missing `lm_head.weight` (tied embeddings) becomes `output.weight` = the embedding.
    Keys other than the listed ones (e.g. `rotary_emb.inv_freq`) are ignored.
    """
    out = {
        "tok_embeddings.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        "output.weight": hf.get("lm_head.weight", hf["model.embed_tokens.weight"]),
    }
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        q = f"layers.{i}."
        out[q + "attention.wq.weight"] = permute_hf_to_meta(
            hf[p + "self_attn.q_proj.weight"], args.n_heads)
        out[q + "attention.wk.weight"] = permute_hf_to_meta(
            hf[p + "self_attn.k_proj.weight"], args.n_kv_heads)
        out[q + "attention.wv.weight"] = hf[p + "self_attn.v_proj.weight"]
        out[q + "attention.wo.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[q + "feed_forward.w1.weight"] = hf[p + "mlp.gate_proj.weight"]
        out[q + "feed_forward.w2.weight"] = hf[p + "mlp.down_proj.weight"]
        out[q + "feed_forward.w3.weight"] = hf[p + "mlp.up_proj.weight"]
        out[q + "attention_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[q + "ffn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
    return out


SUPPORTED_ARCHITECTURE = "LlamaForCausalLM"

#: HF tensor name → ours, outside the layers.
_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
#: HF name inside `model.layers.N.` → ours inside `layers.N.`.
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OUR_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
#: Keys some checkpoints carry that hold no weights (RoPE frequencies, recomputed by us).
_IGNORED_RE = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
#: safetensors dtypes we convert from.
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


def meta_name(hf_name: str) -> Optional[str]:
    """Our (Meta's) parameter name for a `LlamaForCausalLM` tensor name, or None if it has none.

    >>> meta_name("model.layers.3.self_attn.k_proj.weight")
    'layers.3.attention.wk.weight'
    """
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    m = _LAYER_RE.fullmatch(hf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    return None


def hf_name(our_name: str) -> str:
    """Inverse of `meta_name` (for error messages)."""
    for hf, ours in _TOP_NAMES.items():
        if ours == our_name:
            return hf
    m = _OUR_LAYER_RE.fullmatch(our_name)
    if m:
        for hf, ours in _LAYER_NAMES.items():
            if ours == m.group(2):
                return f"model.layers.{m.group(1)}.{hf}"
    return our_name


# ---- config.json ---------------------------------------------------------------------------------

def _config_value(config: dict[str, Any], key: str, typ: type, source: str,
                  default: Any = MISSING) -> Any:
    return checked_field(config, key, typ, source, default, what="key")


def _rope_theta(config: dict[str, Any], source: str) -> float:
    """θ from `rope_theta` (transformers 4) or `rope_parameters` (transformers 5); scaling
    schemes (linear, dynamic, yarn, llama3, ...) are refused."""
    theta = _config_value(config, "rope_theta", float, source, None)
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
            theta = _config_value(params, "rope_theta", float, f"{source}: {key}")
    return 10000.0 if theta is None else theta


def model_args_from_config(config: dict[str, Any], source: str) -> ModelArgs:
    """`ModelArgs` of a `LlamaForCausalLM` config.json.

    Keys transformers' `LlamaConfig` gives defaults to get the same defaults here
    (num_key_value_heads = num_attention_heads, rms_norm_eps 1e-6, rope_theta 10000,
    max_position_embeddings 2048, tie_word_embeddings false, hidden_act silu); `torch_dtype` /
    `dtype` are ignored (the caller picks the dtype).

    Args:
        config: the parsed config.json.
        source: the config file's path, for error messages.

    Raises:
        ModelFileError: another architecture, a required key missing or of the wrong type, or a
            feature we do not implement (RoPE scaling, biases, a head_dim other than
            hidden_size / num_attention_heads, an activation other than SiLU, quantization).
    """
    archs = config.get("architectures")
    if archs is not None and not (
            isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ModelFileError(f"{source}: 'architectures' is {archs!r}, expected a list of names")
    if SUPPORTED_ARCHITECTURE not in (archs or []) and not (
            not archs and config.get("model_type") == "llama"):
        found = ", ".join(archs) if archs else f"model_type {config.get('model_type')!r}"
        raise ModelFileError(
            f"{source}: unsupported architecture {found} (supported: {SUPPORTED_ARCHITECTURE})")
    if config.get("quantization_config") is not None:
        method = config["quantization_config"]
        method = method.get("quant_method", "?") if isinstance(method, dict) else method
        raise ModelFileError(
            f"{source}: quantized checkpoints ({method}) are not supported; use a float16/bfloat16/"
            "float32 checkpoint or a GGUF file")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ModelFileError(f"{source}: {key}=true is not supported (Llama has no biases)")
    act = _config_value(config, "hidden_act", str, source, "silu")
    if act not in ("silu", "swish"):
        raise ModelFileError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")

    dim = _config_value(config, "hidden_size", int, source)
    n_heads = _config_value(config, "num_attention_heads", int, source)
    head_dim = _config_value(config, "head_dim", int, source, None)
    if head_dim is not None and n_heads > 0 and head_dim * n_heads != dim:
        raise ModelFileError(
            f"{source}: head_dim {head_dim} other than hidden_size / num_attention_heads "
            f"({dim} / {n_heads}) is not supported")
    try:
        return ModelArgs(
            dim=dim,
            n_layers=_config_value(config, "num_hidden_layers", int, source),
            n_heads=n_heads,
            n_kv_heads=_config_value(config, "num_key_value_heads", int, source, n_heads),
            vocab_size=_config_value(config, "vocab_size", int, source),
            hidden_dim=_config_value(config, "intermediate_size", int, source),
            norm_eps=_config_value(config, "rms_norm_eps", float, source, 1e-6),
            rope_theta=_rope_theta(config, source),
            max_seq_len=_config_value(config, "max_position_embeddings", int, source, 2048),
            tie_embeddings=_config_value(config, "tie_word_embeddings", bool, source, False),
        )
    except ArgumentError as e:  # inconsistent sizes, found by ModelArgs.__post_init__
        raise ModelFileError(f"{source}: {e}") from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError as e:
        raise ModelFileError(f"{path}: no such file") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(value, dict):
        raise ModelFileError(f"{path}: expected a JSON object, got a {type(value).__name__}")
    return value


# ---- weights -------------------------------------------------------------------------------------

def weight_files(path: Path) -> dict[Path, Optional[list[str]]]:
    """The safetensors files of a folder → the tensor names to read from each (None: all).

    `model.safetensors` if present (as transformers prefers it), else the shards named by
    `model.safetensors.index.json`'s weight_map.

    Raises:
        ModelFileError: no safetensors weights (the message says if PyTorch .bin files are there),
            a malformed index, or a shard it names that is missing.
    """
    single = path / "model.safetensors"
    if single.is_file():
        return {single: None}
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ModelFileError(
                f"{index_path}: 'weight_map' must be a non-empty object of tensor name → "
                "file name")
        files: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(path / file, []).append(name)
        for file in files:
            if not file.is_file():
                raise ModelFileError(f"{file}: no such file (a shard named in {index_path.name})")
        return dict(files)
    if any(path.glob("pytorch_model*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise ModelFileError(
            f"{path}: only PyTorch .bin/.pt weights found; only safetensors checkpoints "
            "(model.safetensors or model.safetensors.index.json) are supported — convert them, "
            "e.g. save_pretrained(..., safe_serialization=True)")
    raise ModelFileError(
        f"{path}: no weights found (expected model.safetensors or model.safetensors.index.json)")


def load_hf_state_dict(files: dict[Path, Optional[list[str]]], args: ModelArgs,
                       dtype: torch.dtype, progress: bool = True) -> dict[str, torch.Tensor]:
    """Read safetensors files tensor by tensor into our names and `dtype`, q/k un-permuted.

    Shapes are checked from the file headers before any data is read. `rotary_emb.inv_freq`
    keys are skipped; `lm_head.weight` may be absent when args.tie_embeddings.

    Returns:
        our name → tensor (dtype).

    Raises:
        ModelFileError: an unreadable or truncated file, a tensor listed in the index but absent
            from its shard, an unknown tensor, a non-float dtype, a shape that does not match
            config.json, or a missing tensor (the message names the file and the HF tensor name).
    """
    from tqdm import tqdm

    from torchllama.model import Transformer

    with torch.device("meta"):
        expected = {name: p.shape for name, p in Transformer(args).state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    files = dict(files)
    for file, names in files.items():
        if names is None:  # a single model.safetensors: all its tensors
            with _open(file) as f:
                files[file] = sorted(f.keys())
    bar = tqdm(total=sum(map(len, files.values())), desc="loading weights", unit="tensor",
               disable=not progress, leave=False)
    with bar:
        for file, names in files.items():
            with _open(file) as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise ModelFileError(
                            f"{file}: tensor {name!r} is listed in model.safetensors.index.json "
                            "but not in this file")
                    ours = _check_tensor(f, file, name, expected, where)
                    if ours is not None:
                        state[ours] = _read_tensor(f, name, args, dtype)
                        where[ours] = file
                    bar.update()
    missing = [hf_name(n) for n in expected if n not in state
               and not (n == "output.weight" and args.tie_embeddings)]
    if missing:
        shown = ", ".join(missing[:5])
        if len(missing) > 5:
            shown += f" and {len(missing) - 5} more"
        first = next(iter(files))
        source = first if len(files) == 1 else first.parent / "model.safetensors.index.json"
        raise ModelFileError(f"{source}: missing tensors {shown}")
    return state


@contextmanager
def _open(file: Path) -> Iterator[Any]:
    """The safetensors file opened with `safe_open`; read errors (also while reading tensors in
    the with block) → ModelFileError naming the file."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except ModelFileError:
        raise
    except Exception as e:  # SafetensorError (bad header, file shorter than it says), OSError, ...
        raise ModelFileError(f"{file}: not a readable safetensors file, or truncated ({e})") from e


def _check_tensor(f: Any, file: Path, name: str, expected: dict[str, torch.Size],
                  where: dict[str, Path]) -> Optional[str]:
    """Our name for HF tensor `name` of open file `f` after checking it; None to skip it."""
    if _IGNORED_RE.fullmatch(name):
        return None
    ours = meta_name(name)
    if ours is None or ours not in expected:
        raise ModelFileError(
            f"{file}: unexpected tensor {name!r} (not part of a {SUPPORTED_ARCHITECTURE} with "
            "the sizes in config.json)")
    if ours in where:
        raise ModelFileError(f"{file}: tensor {name!r} also appears in {where[ours].name}")
    view = f.get_slice(name)
    if view.get_dtype() not in _FLOAT_DTYPES:
        raise ModelFileError(
            f"{file}: tensor {name!r} has dtype {view.get_dtype()}, expected a float type "
            f"({', '.join(sorted(_FLOAT_DTYPES))})")
    shape = torch.Size(view.get_shape())
    if shape != expected[ours]:
        raise ModelFileError(
            f"{file}: tensor {name!r} has shape {tuple(shape)}, expected {tuple(expected[ours])} "
            "from config.json")
    return ours


def _read_tensor(f: Any, name: str, args: ModelArgs, dtype: torch.dtype) -> torch.Tensor:
    t = f.get_tensor(name).to(dtype)
    if name.endswith("self_attn.q_proj.weight"):
        t = permute_hf_to_meta(t, args.n_heads)
    elif name.endswith("self_attn.k_proj.weight"):
        t = permute_hf_to_meta(t, args.n_kv_heads)
    return t


def read_hf(path: Path, dtype: torch.dtype, progress: bool = True):
    """(args, state dict, tokenizer) of a Hugging Face `LlamaForCausalLM` folder.

    Args:
        path: the folder (config.json, model.safetensors or model.safetensors.index.json +
            shards, tokenizer.json or tokenizer.model, tokenizer_config.json, ...).
        dtype: dtype of the returned tensors (whatever the file stores).
        progress: show a tqdm progress bar while reading tensors.

    Returns:
        (ModelArgs, our name → tensor, Tokenizer). `output.weight` is absent for tied
        embeddings without an `lm_head.weight`.

    Raises:
        ModelFileError: see `model_args_from_config`, `weight_files`, `load_hf_state_dict` and
            `torchllama.tokenizer.load_hf_tokenizer`; also a tokenizer with more tokens than the
            model's vocab_size.
    """
    from torchllama.tokenizer import load_hf_tokenizer

    path = Path(path)
    config_path = path / "config.json"
    args = model_args_from_config(_read_json(config_path), str(config_path))
    files = weight_files(path)
    tokenizer = load_hf_tokenizer(path)  # before the weights: a missing tokenizer fails fast
    if tokenizer.vocab_size > args.vocab_size:
        raise ModelFileError(
            f"{tokenizer.source}: the tokenizer has {tokenizer.vocab_size} tokens but "
            f"{config_path} says vocab_size {args.vocab_size}")
    return args, load_hf_state_dict(files, args, dtype, progress), tokenizer


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(args: ModelArgs, dtype: torch.dtype, bos_id: Optional[int],
              eos_id: Optional[int]) -> dict[str, Any]:
    """config.json of a `LlamaForCausalLM` with our hyperparameters (transformers' names)."""
    return {
        "architectures": [SUPPORTED_ARCHITECTURE],
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
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


def save_hf(model, folder: Path, dtype: Optional[torch.dtype] = None, bos_id: Optional[int] = None,
            eos_id: Optional[int] = None) -> None:
    """Write `model` as a Hugging Face `LlamaForCausalLM` folder: config.json,
    generation_config.json and model.safetensors (HF names, q/k permuted to HF's rotate_half
    layout with n_heads and n_kv_heads). A tied output projection is not written, as
    transformers does. The tokenizer is written by the caller (`Tokenizer.save_hf`).

    Args:
        model: a `Transformer`.
        folder: an existing, empty folder (callers write to a temporary folder and rename).
        dtype: dtype of the saved tensors (default: the model's).
        bos_id, eos_id: the tokenizer's, for config.json and generation_config.json.
    """
    from safetensors.torch import save_file

    args = model.args
    dtype = dtype or model.tok_embeddings.weight.dtype
    folder = Path(folder)
    (folder / "config.json").write_text(
        json.dumps(hf_config(args, dtype, bos_id, eos_id), indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": eos_id}, indent=2) + "\n")
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "output.weight" and args.tie_embeddings:
            continue
        t = t.detach().to(dtype)
        if name.endswith("attention.wq.weight"):
            t = permute_meta_to_hf(t, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            t = permute_meta_to_hf(t, args.n_kv_heads)
        tensors[hf_name(name)] = t.contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
