"""Meta's checkpoint format (meta-llama/llama): ``params.json`` + ``consolidated.NN.pth`` + ``tokenizer.model``.

A Meta download is a folder per model::

    llama-2-13b/
        params.json            {"dim": 5120, "multiple_of": 256, "n_heads": 40, "n_layers": 40,
                                "norm_eps": 1e-05, "vocab_size": -1}
        consolidated.00.pth    model-parallel shard 0 (a torch.save'd dict: name -> tensor)
        consolidated.01.pth    model-parallel shard 1
    tokenizer.model            SentencePiece model, in the folder or (as Meta ships it) its parent

Llama 3 folders look the same, with a tiktoken ``tokenizer.model`` in the folder (text lines
``base64(token) rank``; `torchllama.tokenizers.TiktokenTokenizer` adds Meta's special tokens and
chat format) and params.json fields such as ``"rope_theta": 500000.0, "vocab_size": 128256,
"ffn_dim_multiplier": 1.3, "multiple_of": 1024`` (8B) and, from Llama 3.1 on,
``"use_scaled_rope": true``.

**params.json** holds the fields of Meta's ``ModelArgs``, which ours keeps one to one: dim,
n_layers, n_heads, n_kv_heads (absent = n_heads), vocab_size (-1 = the tokenizer's), multiple_of,
ffn_dim_multiplier (absent/null = none), norm_eps, rope_theta (absent = 10000), use_scaled_rope
(Llama 3.1+: Meta's ``apply_scaling`` of the RoPE frequencies, with constants fixed in Meta's
code; read as our ``rope_scaling`` `META_ROPE_SCALING`, type "llama3"). There is no hidden size:
the SwiGLU width follows Meta's rule (`ModelArgs.ffn_hidden_dim`) and is checked against the
weights. Nor is there usually a context
length: ``max_seq_len`` is taken from params.json when present, else `DEFAULT_MAX_SEQ_LEN` (4096,
Llama 2's); `torchllama.load(max_seq_len=...)` overrides either. Fields known to change the
architecture in ways we do not implement (`UNSUPPORTED_FIELDS`: MoE, quantization, LoRA, vision,
QK-norm, ...) are refused when set; fields that do not affect the weights (`IGNORED_FIELDS`) are
ignored; any other field is ignored with a `UserWarning` naming it.

**torchllama's extension.** A model of the variant zoo (LayerNorm, ALiBi, MLA, ...) has no Meta
params.json of its own: `meta_params` then writes Meta's fields plus the zoo fields that differ
from Llama 2's (`ModelArgs` names, e.g. ``"position": "alibi"``) and an explicit ``hidden_dim``,
and the reader accepts them. A Llama's params.json stays exactly Meta's: Meta's RoPE scaling is
written as ``"use_scaled_rope": true``, any other ``rope_scaling`` (another type, or llama3 with
other constants, e.g. Llama 3.2's factor 32 from a Hugging Face config) as our ``rope_scaling``
field, which Meta's code ignores. This is how training run checkpoints of any variant are
written and loaded.

**Shards.** Llama 2 7B ships 1 shard, 13B 2, 70B 8: the ranks of fairscale's model parallelism,
each holding its slice of every parallel layer under the full model's names. Merging undoes the
split each layer type makes:

- ``ColumnParallelLinear`` splits the output features, dim 0 of the (out, in) weight:
  ``attention.wq/wk/wv``, ``feed_forward.w1/w3``, ``output`` → concatenate along dim 0;
- ``RowParallelLinear`` splits the input features, dim 1: ``attention.wo``, ``feed_forward.w2``
  → concatenate along dim 1;
- ``ParallelEmbedding`` splits the embedding dimension, dim 1 of (vocab, dim):
  ``tok_embeddings`` → concatenate along dim 1;
- RMSNorm gains (``attention_norm``, ``ffn_norm``, ``norm``) are replicated: every shard holds the
  whole vector. We take shard 0's after checking the others agree (within 1 %, so a one-ulp
  difference passes but shards from different checkpoints do not);
- ``rope.freqs`` (RoPE inverse frequencies, replicated, recomputed by the model) is dropped.

All shards hold the same names with the same shapes (fairscale splits evenly); anything else is
reported. Because wk/wv are split by rows, n_kv_heads must be a multiple of the shard count
(70B: 8 kv heads over 8 shards, one each).

**Safety and memory.** Shards are read with ``torch.load(weights_only=True, mmap=True)`` only: a
pickle that would call anything but tensor constructors is refused, never run. Memory-mapping
makes loading a shard cheap (its tensors stay in the file until touched), so names and shapes are
all checked before any data is read. Tensors are then produced one at a time in the target dtype:
a single shard already in that dtype is used as it is (the file's pages, no copy); otherwise each
merged tensor is allocated once and the shards' slices are converted straight into it. Peak memory
is one copy of the model plus file pages the OS can drop.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from torchllama.checkpoint.common import expected_shapes, names_list
from torchllama.config import ZOO_FIELDS as _ZOO_FIELDS
from torchllama.config import ModelArgs
from torchllama.errors import MISSING, ArgumentError, ModelFileError, checked_field
from torchllama.families import LLAMA
from torchllama.tokenizers import load_tokenizer_file

#: Context length used when params.json has no ``max_seq_len`` (Llama 2's; Meta's params.json
#: leaves it to the caller).
DEFAULT_MAX_SEQ_LEN = 4096

#: params.json fields that must be present.
REQUIRED_FIELDS = ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "norm_eps")

#: Optional params.json fields we read.
OPTIONAL_FIELDS = ("n_kv_heads", "ffn_dim_multiplier", "rope_theta", "max_seq_len",
                   "use_scaled_rope", "hidden_dim")

#: Fields of Meta's reference ModelArgs that do not describe the weights (runtime settings);
#: ignored without a warning.
IGNORED_FIELDS = ("max_batch_size",)

#: Fields (of Meta's llama-models ModelArgs) that change the architecture in ways torchllama does
#: not implement: refused when set to anything but null/false/0/{}.
UNSUPPORTED_FIELDS = {
    "moe_args": "mixture of experts",
    "quantization_args": "quantized weights",
    "lora_args": "LoRA adapters",
    "vision_chunk_size": "a vision encoder",
    "vision_max_num_chunks": "a vision encoder",
    "vision_num_cross_attention_layers": "vision cross-attention layers",
    "use_qk_norm": "QK-norm",
    "attention_chunk_size": "chunked attention",
    "nope_layer_interval": "layers without RoPE",
}

#: RoPE scaling of ``"use_scaled_rope": true``: Meta's ``apply_scaling`` (llama-models
#: ``models/llama3/model.py``) with its constants scale_factor 8, low_freq_factor 1,
#: high_freq_factor 4, old_context_len 8192 (Llama 3's context), as a `ModelArgs.rope_scaling`.
META_ROPE_SCALING = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_seq_len": 8192}

#: torchllama's own params.json fields beyond Meta's: the architecture choices of the variant
#: zoo (`ModelArgs`), written only when they differ from Llama 2's (`ModelArgs.variant_fields`),
#: so that a Llama's params.json stays Meta's.
ZOO_FIELDS = _ZOO_FIELDS

DROPPED_TENSORS = ("rope.freqs",)

_SHARD_NAME = re.compile(r"consolidated\.(\d+)\.pth\Z")


def shard_dim(name: str) -> Optional[int]:
    """Dimension along which Meta's model parallelism splits tensor `name` (0 or 1), or None for
    a replicated tensor (norms) or a name Meta's layers do not split (from the Llama family's
    table, `torchllama.families.llama`)."""
    return LLAMA.meta_shard_dim(name)


# ------------------------------------------------------------------------------------------------
# params.json
# ------------------------------------------------------------------------------------------------


def read_params(path: Path) -> dict[str, Any]:
    """The JSON object in a params.json file.

    Raises:
        ModelFileError: unreadable file, invalid JSON, or not a JSON object.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: cannot read the file ({e})") from e
    try:
        params = json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(params, dict):
        raise ModelFileError(f"{path}: expected a JSON object of hyperparameters, found a "
                             f"{type(params).__name__}")
    return params


def _field(params: dict[str, Any], name: str, kind: type, source: str,
           default: Any = MISSING) -> Any:
    """params[name] checked to be of `kind`; null counts as absent."""
    return checked_field(params, name, kind, source, default, what="field")


def model_args_from_params(params: dict[str, Any], vocab_size_from_tokenizer: Optional[int],
                           source: str, max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> ModelArgs:
    """`ModelArgs` from the fields of a Meta params.json.

    Args:
        params: the parsed JSON object.
        vocab_size_from_tokenizer: the tokenizer's vocabulary size, used when vocab_size is -1
            (Llama 1/2 write -1) and checked against an explicit vocab_size (the model may have
            more rows than the tokenizer has ids, never fewer); None if unknown.
        source: the params.json path, for error messages.
        max_seq_len: context length when params has no ``max_seq_len``.

    Returns:
        ModelArgs with hidden_dim None (Meta's rule), tie_embeddings False, rope_scaling
        `META_ROPE_SCALING` if use_scaled_rope is true, else None (unless torchllama's own
        fields say otherwise).

    Raises:
        ModelFileError: a missing required field or a value of the wrong type (both name the
            field), an unsupported feature set, use_scaled_rope together with our rope_scaling
            field, vocab_size -1 with no tokenizer size, or values that do not form a valid
            model.
    """
    for name, feature in UNSUPPORTED_FIELDS.items():
        value = params.get(name)
        if value not in (None, False, 0, {}, []):
            raise ModelFileError(f"{source}: {name}={json.dumps(value)} asks for {feature}, which "
                                 "is not supported yet")
    known = set(REQUIRED_FIELDS) | set(OPTIONAL_FIELDS) | set(IGNORED_FIELDS) | \
        set(UNSUPPORTED_FIELDS) | set(ZOO_FIELDS)
    unknown = sorted(set(params) - known)
    if unknown:
        warnings.warn(f"{source}: ignoring unknown field(s) {', '.join(map(repr, unknown))}",
                      UserWarning, stacklevel=2)

    dim = _field(params, "dim", int, source)
    n_layers = _field(params, "n_layers", int, source)
    n_heads = _field(params, "n_heads", int, source)
    vocab_size = _field(params, "vocab_size", int, source)
    multiple_of = _field(params, "multiple_of", int, source)
    norm_eps = _field(params, "norm_eps", float, source)
    n_kv_heads = _field(params, "n_kv_heads", int, source, None)
    ffn_dim_multiplier = _field(params, "ffn_dim_multiplier", float, source, None)
    rope_theta = _field(params, "rope_theta", float, source, 10000.0)
    hidden_dim = _field(params, "hidden_dim", int, source, None)
    max_seq_len = _field(params, "max_seq_len", int, source, max_seq_len)
    use_scaled_rope = _field(params, "use_scaled_rope", bool, source, False)

    if vocab_size == -1:
        if vocab_size_from_tokenizer is None:
            raise ModelFileError(f"{source}: vocab_size is -1 (the tokenizer's) but no tokenizer "
                                 "vocabulary size is known")
        vocab_size = vocab_size_from_tokenizer
    elif vocab_size_from_tokenizer is not None and 0 < vocab_size < vocab_size_from_tokenizer:
        raise ModelFileError(
            f"{source}: vocab_size is {vocab_size} but the tokenizer has "
            f"{vocab_size_from_tokenizer} tokens (the model needs a row for every token id)")
    zoo = _zoo_fields(params, source)
    if use_scaled_rope:
        if "rope_scaling" in zoo:
            raise ModelFileError(f"{source}: both use_scaled_rope (Meta's RoPE scaling) and "
                                 "rope_scaling are set; keep one")
        zoo["rope_scaling"] = dict(META_ROPE_SCALING)
    try:
        return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                         vocab_size=vocab_size, multiple_of=multiple_of,
                         ffn_dim_multiplier=ffn_dim_multiplier, norm_eps=norm_eps,
                         rope_theta=rope_theta, max_seq_len=max_seq_len,
                         hidden_dim=hidden_dim, **zoo)
    except ArgumentError as e:
        raise ModelFileError(f"{source}: does not describe a valid model: {e}") from e


def _zoo_fields(params: dict[str, Any], source: str) -> dict[str, Any]:
    """The variant-zoo fields of a params.json (torchllama's own), type-checked."""
    import typing

    hints = typing.get_type_hints(ModelArgs)
    out = {}
    for name in ZOO_FIELDS:
        if params.get(name) is None:
            continue
        kinds = [k for k in (typing.get_args(hints[name]) or (hints[name],))
                 if k is not type(None)]
        kind = typing.get_origin(kinds[0]) or kinds[0]
        out[name] = _field(params, name, kind, source)
    return out


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------


def find_tokenizer(folder: Path) -> Path:
    """The tokenizer of a Meta checkpoint folder: tokenizer.model in the folder, else in its
    parent (Meta's download puts one tokenizer.model next to the llama-2-7b/, llama-2-13b/ ...
    folders); else the folder's tokenizer.json, which `torchllama convert --to meta` writes for
    byte-level BPE vocabularies (Meta's format has no file for those).

    Raises:
        ModelFileError: none exists.
    """
    for candidate in (folder / "tokenizer.model", folder.parent / "tokenizer.model",
                      folder / "tokenizer.json"):
        if candidate.is_file():
            return candidate
    raise ModelFileError(f"{folder}: no tokenizer.model in {folder} or its parent")


# ------------------------------------------------------------------------------------------------
# Shards
# ------------------------------------------------------------------------------------------------


def find_shards(folder: Path) -> list[Path]:
    """consolidated.00.pth ... consolidated.NN.pth of a folder, in rank order.

    Raises:
        ModelFileError: none, or a gap in the numbering (a missing shard is named).
    """
    found: dict[int, Path] = {}
    for p in folder.iterdir():
        m = _SHARD_NAME.match(p.name)
        if m and p.is_file():
            found[int(m.group(1))] = p
    if not found:
        raise ModelFileError(f"{folder}: no consolidated.*.pth weight files (a Meta checkpoint "
                             "folder has params.json and consolidated.00.pth ...)")
    missing = [i for i in range(max(found) + 1) if i not in found]
    if missing:
        raise ModelFileError(
            f"{folder}: shard consolidated.{missing[0]:02d}.pth is missing (found "
            f"{len(found)} shards numbered up to {max(found):02d})")
    return [found[i] for i in sorted(found)]


def load_shard(path: Path) -> dict[str, torch.Tensor]:
    """name → tensor of one consolidated.NN.pth, memory-mapped (no data read yet).

    Only ``torch.load(weights_only=True, mmap=True)`` is used: pickles that reference anything
    but tensors and plain containers are refused without running them.

    Raises:
        ModelFileError: empty, truncated or non-zip file, a refused pickle, or content that is
            not a dict of tensors.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the file ({e.strerror or e})") from e
    if not magic:
        raise ModelFileError(f"{path}: empty file")
    if magic != b"PK\x03\x04":
        raise ModelFileError(
            f"{path}: not a PyTorch checkpoint in torch.save's zip format (the format of Meta's "
            f"checkpoints; starts with {magic!r}, expected b'PK\\x03\\x04')")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise ModelFileError(
            f"{path}: refused to load: the pickle references objects other than tensors (loading "
            f"it would run code / not plain tensors): {str(e).splitlines()[-1][:300]}") from e
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the file ({e.strerror or e})") from e
    except Exception as e:  # torch raises RuntimeError for a zip archive cut short
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ModelFileError(f"{path}: truncated or corrupt checkpoint ({first})") from e
    if not isinstance(state, dict):
        raise ModelFileError(f"{path}: expected a dict of tensor name → tensor, found a "
                             f"{type(state).__name__}")
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise ModelFileError(f"{path}: entry {name!r} is not a tensor under a str name "
                                 f"(found {type(value).__name__})")
    return state


def _shape(t: torch.Size | tuple) -> tuple[int, ...]:
    return tuple(int(d) for d in t)


def _merged_shape(name: str, shards: list[dict[str, torch.Tensor]], files: list[Path]
                  ) -> tuple[int, ...]:
    """Shape of tensor `name` once its shards are merged; checks the shards agree."""
    shapes = [_shape(s[name].shape) for s in shards]
    for f, shape in zip(files[1:], shapes[1:]):
        if shape != shapes[0]:
            raise ModelFileError(
                f"shards of different sizes: tensor {name} has shape {shapes[0]} in "
                f"{files[0]} but {shape} in {f}")
    dim = shard_dim(name)
    if len(shards) == 1 or dim is None:
        return shapes[0]
    if dim >= len(shapes[0]):
        raise ModelFileError(f"{files[0]}: tensor {name} has shape {shapes[0]}, but shards are "
                             f"merged along its dim {dim}")
    merged = list(shapes[0])
    merged[dim] *= len(shards)
    return tuple(merged)


def _checknames_list(shards: list[dict[str, torch.Tensor]], files: list[Path],
                 expected: dict[str, torch.Size], source: str) -> None:
    names = [set(s) - set(DROPPED_TENSORS) for s in shards]
    for f, n in zip(files[1:], names[1:]):
        if n != names[0]:
            only0, onlyf = sorted(names[0] - n), sorted(n - names[0])
            parts = ([f"{names_list(only0)} only in {files[0].name}"] if only0 else []) + \
                    ([f"{names_list(onlyf)} only in {f.name}"] if onlyf else [])
            raise ModelFileError(f"{f.parent}: shards hold different tensors: {'; '.join(parts)}")
    missing = [n for n in expected if n not in names[0]]
    unexpected = sorted(n for n in names[0] if n not in expected)
    if missing or unexpected:
        parts = ([f"missing tensors {names_list(missing)}"] if missing else []) + \
                ([f"unexpected tensors {names_list(unexpected)}"] if unexpected else [])
        raise ModelFileError(f"{source}: {'; '.join(parts)}")



def _check_shapes(shards: list[dict[str, torch.Tensor]], files: list[Path],
                  expected: dict[str, torch.Size], args: ModelArgs, params_source: str,
                  source: str) -> None:
    for name, want in expected.items():
        got = _merged_shape(name, shards, files)
        want = _shape(want)
        if got == want:
            continue
        merged = f" (merged from {len(shards)} shards)" if len(shards) > 1 else ""
        if name.endswith("feed_forward.w1.weight") and got[1:] == want[1:]:
            raise ModelFileError(
                f"{source}: tensor {name} has {got[0]} rows{merged}, but {params_source} gives a "
                f"SwiGLU hidden size of {want[0]} (Meta's rule from dim={args.dim}, "
                f"multiple_of={args.multiple_of}, ffn_dim_multiplier={args.ffn_dim_multiplier}): "
                "params.json does not match the weights")
        raise ModelFileError(
            f"{source}: tensor {name} has shape {got}{merged}, expected {want} from "
            f"{params_source}: params.json does not match the weights")


def merge_tensor(name: str, pieces: list[torch.Tensor], dtype: torch.dtype,
                 files: list[Path]) -> torch.Tensor:
    """One tensor of the full model from its model-parallel pieces, in `dtype`.

    A single piece already in `dtype` is returned as it is (no copy). Replicated tensors are
    taken from shard 0 after checking the others agree within 1 %. Split tensors are written
    into one new tensor, each piece converted as it is copied (no temporaries).

    Raises:
        ModelFileError: replicated pieces that disagree.
    """
    dim = shard_dim(name)
    if len(pieces) == 1 or dim is None:
        first = pieces[0]
        if len(pieces) > 1:
            ref = first.float()
            for f, p in zip(files[1:], pieces[1:]):
                if not torch.allclose(p.float(), ref, rtol=1e-2, atol=1e-6):
                    raise ModelFileError(
                        f"replicated tensor {name} differs between {files[0]} and {f} (by up to "
                        f"{(p.float() - ref).abs().max().item():.3g}): the shards are not from "
                        "the same checkpoint")
        return first if first.dtype == dtype else first.to(dtype)
    size = pieces[0].shape[dim]
    shape = list(pieces[0].shape)
    shape[dim] *= len(pieces)
    out = torch.empty(shape, dtype=dtype)
    for i, p in enumerate(pieces):
        out.narrow(dim, i * size, size).copy_(p)
    return out


def read_meta(path: Path | str, dtype: torch.dtype, progress: bool = True
              ) -> tuple[ModelArgs, dict[str, torch.Tensor], Any]:
    """(args, state dict, tokenizer) of a Meta checkpoint folder.

    Reads params.json, the tokenizer.model (folder or parent; SentencePiece or tiktoken), and merges the model-parallel
    shards consolidated.00.pth ... into one state dict (see the module docstring for the rules).

    Args:
        path: the folder holding params.json and consolidated.*.pth.
        dtype: dtype of the returned tensors (float32, bfloat16, float16); Meta's weights are
            bfloat16 on disk and are cast exactly as ``tensor.to(dtype)`` casts.
        progress: show a tqdm progress bar while producing the tensors.

    Returns:
        args: `ModelArgs` (hidden size by Meta's rule, max_seq_len from params.json or
            `DEFAULT_MAX_SEQ_LEN`, vocab_size -1 resolved from the tokenizer).
        state: Meta's parameter names (those of `torchllama.model.Transformer`) → tensors in
            `dtype` with the full model's shapes, e.g. ``tok_embeddings.weight`` (vocab, dim),
            ``layers.N.attention.wq.weight`` (n_heads·head_dim, dim); ``rope.freqs`` dropped.
            A single shard already in `dtype` yields the memory-mapped tensors themselves.
        tokenizer: a `SentencePieceTokenizer` (add_bos True), or for Llama 3's tiktoken
            tokenizer.model a `TiktokenTokenizer` (see `torchllama.tokenizers.load_tokenizer_file`).

    Raises:
        ModelFileError: naming the file and the problem: params.json unreadable, invalid, missing
            a field or asking for an unsupported feature; no tokenizer.model; no or missing
            shards; a shard truncated, not a torch zip file, or holding a pickle that would run
            code (refused, never executed); shards with different tensors or sizes; a missing
            or unexpected tensor; a shape that does not match params.json.
    """
    from tqdm import tqdm

    folder = Path(path)
    params_path = folder / "params.json"
    params = read_params(params_path)
    tokenizer = load_tokenizer_file(find_tokenizer(folder))
    args = model_args_from_params(params, tokenizer.vocab_size, str(params_path))
    expected = expected_shapes(args, str(params_path))

    files = find_shards(folder)
    shards = [load_shard(f) for f in files]
    source = str(files[0]) if len(files) == 1 else \
        f"{folder} (consolidated.00.pth ... {files[-1].name})"
    _checknames_list(shards, files, expected, source)
    _check_shapes(shards, files, expected, args, str(params_path), source)

    state: dict[str, torch.Tensor] = {}
    for name in tqdm(expected, desc="loading weights", unit="tensor", disable=not progress,
                     leave=False):
        pieces = [s.pop(name) for s in shards]   # drop the shards' references as we go
        state[name] = merge_tensor(name, pieces, dtype, files)
    return args, state, tokenizer


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------


def meta_params(args: ModelArgs) -> dict[str, Any]:
    """params.json fields describing `args`, readable by Meta's code (for a Llama) and by
    `read_meta`. A model of the variant zoo also gets its zoo fields (`ModelArgs` names) and an
    explicit hidden_dim: such a params.json is torchllama's own.

    Meta's format has no hidden size: it is derived from dim, multiple_of and ffn_dim_multiplier.
    RoPE scaling equal to Meta's (`META_ROPE_SCALING`) is written as Meta writes it,
    ``"use_scaled_rope": true``; any other stays torchllama's ``rope_scaling`` zoo field.

    When `args.hidden_dim` is not what Meta's rule gives for args' own multiple_of and
    ffn_dim_multiplier, we choose multiple_of = hidden_dim, plus ffn_dim_multiplier < 1 when
    the rule's unrounded size 8·dim/3 is larger, so that the rule rounds up to exactly
    hidden_dim.
    """
    hidden = args.ffn_hidden_dim
    multiple_of, multiplier = args.multiple_of, args.ffn_dim_multiplier
    variant = args.variant_fields()
    scaled = variant.get("rope_scaling") == META_ROPE_SCALING
    if scaled:
        del variant["rope_scaling"]
    explicit = None
    if variant:                     # not a Llama: torchllama's params.json states the width
        explicit = hidden
    elif ModelArgs(dim=args.dim, n_heads=args.n_heads, multiple_of=multiple_of,
                   ffn_dim_multiplier=multiplier).ffn_hidden_dim != hidden:
        base = int(2 * (4 * args.dim) / 3)
        multiple_of, multiplier = hidden, (hidden / base if base > hidden else None)
    params = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads,
              "n_kv_heads": args.n_kv_heads, "vocab_size": args.vocab_size,
              "multiple_of": multiple_of, "ffn_dim_multiplier": multiplier,
              "hidden_dim": explicit, "norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
              "max_seq_len": args.max_seq_len, "use_scaled_rope": True if scaled else None}
    params = {k: v for k, v in params.items() if v is not None}
    return {**params, **variant}


def save_meta(model, folder: Path, dtype: Optional[torch.dtype] = None) -> None:
    """Write `model` as Meta's format: params.json and a single consolidated.00.pth.

    Tied embeddings are written as a separate `output.weight` (Meta's format has no tying).
    The tokenizer is written by the caller (`checkpoint.save`: tokenizer.model, or
    `Tokenizer.save_hf` files for vocabularies Meta's format cannot hold).

    Args:
        model: a `Transformer`.
        folder: an existing, empty folder (callers write to a temporary folder and rename).
        dtype: dtype of the saved tensors (default: the model's).
    """
    folder = Path(folder)
    (folder / "params.json").write_text(json.dumps(meta_params(model.args), indent=2) + "\n")
    state = {name: t.detach().to(dtype or t.dtype).contiguous()
             for name, t in model.state_dict().items()}
    torch.save(state, folder / "consolidated.00.pth")
