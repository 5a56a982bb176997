"""Hugging Face checkpoints: a `save_pretrained` folder ↔ our model.

`read_hf` loads config.json (its `architectures` picks the family adapter, which turns the config
into `ModelArgs`), the weights — model.safetensors, or the shards listed in
model.safetensors.index.json — tensor by tensor with the `safetensors` library, under the names
and layouts of the family's table (Llama: q/k rows un-permuted from HF's rotate_half layout, see
`torchllama.families.base.permute_hf_to_meta`), and the tokenizer (tokenizer.json or
tokenizer.model, see `torchllama.tokenizers.load_hf_tokenizer`). `save_hf` writes the reverse.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Mapping as MappingType, Optional

import torch

from torchllama.checkpoint.common import expected_shapes, names_list
from torchllama.config import ModelArgs
from torchllama.errors import ModelFileError
from torchllama.families import Family, family_for_args, family_for_hf
from torchllama.tokenizers import load_hf_tokenizer

#: Keys some checkpoints carry that hold no weights (RoPE frequencies, recomputed by us).
_IGNORED_RE = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
#: safetensors dtypes we convert from.
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in a file (config.json, an index).

    Raises:
        ModelFileError: missing, unreadable, not JSON or not an object.
    """
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
        weight_map = read_json(index_path).get("weight_map")
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


def _past_last_layer(name: str, family: Family, args: ModelArgs) -> bool:
    """Whether HF tensor `name` is of a layer past the model's last, which the family skips
    (`Family.hf_extra_layers_ignored`: DeepSeek-V3's multi-token-prediction module)."""
    layer = _LAYER_RE.match(name)
    return family.hf_extra_layers_ignored and layer is not None and \
        int(layer.group(1)) >= args.n_layers


def load_hf_state_dict(files: dict[Path, Optional[list[str]]], family: Family, args: ModelArgs,
                       dtype: torch.dtype, progress: bool = True,
                       source: str = "config.json") -> dict[str, torch.Tensor]:
    """Read safetensors files tensor by tensor into our names, layouts and `dtype`.

    `rotary_emb.inv_freq` keys are skipped; `lm_head.weight` may be absent when
    args.tie_embeddings.

    Returns:
        our name → tensor (dtype).

    Raises:
        ModelFileError: an unreadable or truncated file, a tensor listed in the index but absent
            from its shard, an unknown tensor, a non-float dtype, a shape that does not match
            config.json, or a missing tensor (the message names the file and the HF tensor name);
            sizes in config.json that describe no buildable model (`source` is named).
    """
    from tqdm import tqdm

    expected = expected_shapes(args, source)
    by_name = {m.theirs: m for m in family.mappings("hf", args.n_layers, set(expected))}
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
                    bar.update()
                    if _IGNORED_RE.fullmatch(name) or (
                            family.hf_ignored and family.hf_ignored.fullmatch(name)) or \
                            _past_last_layer(name, family, args):
                        continue
                    mapping = by_name.get(name)
                    if mapping is None:
                        raise ModelFileError(
                            f"{file}: unexpected tensor {name!r} (not part of a "
                            f"{family.hf_architectures[0]} with the sizes in config.json)")
                    if name in where:
                        raise ModelFileError(f"{file}: tensor {name!r} also appears in "
                                             f"{where[name].name}")
                    where[name] = file
                    view = f.get_slice(name)
                    if view.get_dtype() not in _FLOAT_DTYPES:
                        raise ModelFileError(
                            f"{file}: tensor {name!r} has dtype {view.get_dtype()}, expected a "
                            f"float type ({', '.join(sorted(_FLOAT_DTYPES))})")
                    shape = torch.Size(view.get_shape())
                    want = mapping.layout.stored_shape(tuple(expected[n] for n in mapping.ours))
                    if shape != want:
                        raise ModelFileError(
                            f"{file}: tensor {name!r} has shape {tuple(shape)}, expected "
                            f"{tuple(want)} from config.json")
                    stored = f.get_tensor(name)
                    state.update(zip(mapping.ours, (t.to(dtype) for t in
                                                    mapping.layout.load(stored, args))))
    missing = [family.their_name("hf", n, args.n_layers) for n in expected if n not in state
               and not (n == "output.weight" and args.tie_embeddings)]
    if missing:
        first = next(iter(files))
        source = first if len(files) == 1 else first.parent / "model.safetensors.index.json"
        raise ModelFileError(f"{source}: missing tensors {names_list(missing)}")
    return state


def from_hf_state_dict(family: Family, hf_state: MappingType[str, torch.Tensor],
                       args: ModelArgs) -> dict[str, torch.Tensor]:
    """An in-memory HF state dict (e.g. a transformers model's `state_dict()`) in our names and
    layouts. A missing `lm_head.weight` of a tied model becomes `output.weight` = the embedding;
    HF keys the table does not list (rotary buffers) are ignored.

    Raises:
        KeyError: a tensor the table lists for this model is missing.
    """
    out: dict[str, torch.Tensor] = {}
    for m in family.mappings("hf", args.n_layers, set(expected_shapes(args))):
        if m.theirs not in hf_state and m.ours == ("output.weight",) and args.tie_embeddings:
            continue
        out.update(zip(m.ours, m.layout.load(hf_state[m.theirs], args)))
    if args.tie_embeddings and "output.weight" not in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def to_hf_state_dict(model, family: Optional[Family] = None, *, dtype: Optional[torch.dtype] = None,
                     tied_output: bool = True) -> dict[str, torch.Tensor]:
    """Our model's state dict in the HF names and layouts of its family (by default the first
    one that can hold it), tensors converted to `dtype`. With tied_output False a tied output
    matrix is left out (as `save_pretrained` does)."""
    args = model.args
    family = family or family_for_args(args, "hf")
    state = model.state_dict()
    if args.tie_embeddings and not tied_output:
        state.pop("output.weight", None)
    out = {}
    for m in family.mappings("hf", args.n_layers, set(state)):
        ours = tuple(state[n].detach().to(dtype or state[n].dtype) for n in m.ours)
        out[m.theirs] = m.layout.save(ours, args)
    return out


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


def read_hf(path: Path, dtype: torch.dtype, progress: bool = True):
    """(args, state dict, tokenizer) of a Hugging Face model folder.

    Args:
        path: the folder (config.json, model.safetensors or model.safetensors.index.json +
            shards, tokenizer.json or tokenizer.model, tokenizer_config.json, ...).
        dtype: dtype of the returned tensors (whatever the file stores).
        progress: show a tqdm progress bar while reading tensors.

    Returns:
        (ModelArgs, our name → tensor, Tokenizer). `output.weight` is absent for tied
        embeddings without an `lm_head.weight`.

    Raises:
        ModelFileError: see `torchllama.families.family_for_hf` and the family's
            `args_from_hf`, `weight_files`, `load_hf_state_dict` and
            `torchllama.tokenizers.load_hf_tokenizer`; also a tokenizer with more tokens than the
            model's vocab_size.
    """
    path = Path(path)
    config_path = path / "config.json"
    config = read_json(config_path)
    family = family_for_hf(config, str(config_path))
    args = family.args_from_hf(config, str(config_path))
    files = weight_files(path)
    tokenizer = load_hf_tokenizer(path)  # before the weights: a missing tokenizer fails fast
    if tokenizer.chat_template is None and family.chat_template is not None:
        tokenizer.chat_template = family.chat_template      # the family's built-in format
    if tokenizer.vocab_size > args.vocab_size:
        raise ModelFileError(
            f"{tokenizer.source}: the tokenizer has {tokenizer.vocab_size} tokens but "
            f"{config_path} says vocab_size {args.vocab_size}")
    return args, load_hf_state_dict(files, family, args, dtype, progress, str(config_path)), \
        tokenizer


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(args: ModelArgs, dtype: torch.dtype, bos_id: Optional[int],
              eos_id: Optional[int], family: Optional[Family] = None) -> dict[str, Any]:
    """config.json of our hyperparameters in the family's transformers class (by default the
    first family that can hold them), with dtype and special token ids."""
    family = family or family_for_args(args, "hf")
    return {**family.hf_config(args), "bos_token_id": bos_id, "eos_token_id": eos_id,
            "torch_dtype": _DTYPE_NAMES[dtype]}


def save_hf(model, folder: Path, dtype: Optional[torch.dtype] = None, bos_id: Optional[int] = None,
            eos_id: Optional[int] = None) -> None:
    """Write `model` as a Hugging Face folder of its family's transformers class: config.json,
    generation_config.json and model.safetensors (the family's names and layouts, e.g. Llama's
    q/k permuted to HF's rotate_half layout with n_heads and n_kv_heads). A tied output
    projection is not written, as transformers does. The tokenizer is written by the caller
    (`Tokenizer.save_hf`).

    Args:
        model: a `Transformer`.
        folder: an existing, empty folder (callers write to a temporary folder and rename).
        dtype: dtype of the saved tensors (default: the model's).
        bos_id, eos_id: the tokenizer's, for config.json and generation_config.json.

    Raises:
        ArgumentError: no transformers architecture can hold this model.
    """
    from safetensors.torch import save_file

    args = model.args
    dtype = dtype or model.tok_embeddings.weight.dtype
    family = family_for_args(args, "hf")
    folder = Path(folder)
    (folder / "config.json").write_text(
        json.dumps(hf_config(args, dtype, bos_id, eos_id, family), indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": eos_id}, indent=2) + "\n")
    tensors = to_hf_state_dict(model, family, dtype=dtype, tied_output=False)
    save_file({k: t.contiguous() for k, t in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
