"""GGUF checkpoints: metadata, hyperparameters and weights, read with the `gguf` library.

GGUF (llama.cpp's file format) holds three things we need:

- metadata key/values: hyperparameters under ``{arch}.*`` (``llama.block_count``, ...), the
  tokenizer under ``tokenizer.ggml.*`` and the chat template under ``tokenizer.chat_template``;
- tensors named ``token_embd``, ``blk.N.attn_q`` ... ``output_norm``, ``output``, each possibly
  quantized (Q4_1, Q8_0, ...). ``gguf.quants.dequantize`` turns them back into float32 arrays.
- q/k projection weights already in Meta's *interleaved* RoPE layout (llama.cpp's converter permutes
  HF's rotate_half layout back), so they load into our model as they are.

Shapes in GGUF are listed innermost-first (ggml order): a (out, in) matrix is listed as [in, out].
The numpy arrays that ``GGUFReader`` exposes are already in row-major (out, in) order.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import gguf
import numpy as np
import torch

from torchllama.errors import MISSING, ModelFileError, checked_field


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Open a GGUF file for reading (memory-mapped; nothing is copied).

    Raises:
        ModelFileError: the file is missing, unreadable, not GGUF, or truncated.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelFileError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelFileError(f"{path}: is a directory, expected a .gguf file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:  # permission denied, I/O error, ...
        raise ModelFileError(f"{path}: cannot read the file ({e.strerror or e})") from e
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (expected magic b'GGUF', found {magic!r})")
    try:
        return gguf.GGUFReader(path, "r")
    except OSError as e:  # mapping the file failed: not a truncation
        raise ModelFileError(f"{path}: cannot read the file ({e.strerror or e})") from e
    except Exception as e:  # the library raises ValueError/IndexError/... on truncated headers
        raise ModelFileError(
            f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})"
        ) from e


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All metadata key/values of a GGUF file as plain Python values (str, int, float, bool, list).

    The tokenizer's large arrays (tokens, scores, merges) are decoded too; expect ~0.1 s for a
    50k vocabulary.
    """
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # header fields (version, counts), not metadata
            continue
        metadata[key] = field.contents()
    return metadata


def _release_file_pages(reader: gguf.GGUFReader, tensor: Any) -> None:
    """Drop the file pages of a tensor we have copied out of the read-only file mapping.

    Touched pages of a memory-mapped file count in the process's resident memory until unmapped;
    without this, loading would peak at the file's size plus the loaded weights. The mapping is
    read-only and shared with the page cache, so MADV_DONTNEED loses nothing: a later read of
    those bytes faults them in again.
    """
    file_map = getattr(reader.data, "_mmap", None)      # numpy.memmap's mmap.mmap
    if file_map is None or not hasattr(file_map, "madvise"):
        return
    start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    file_map.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)


# GGUF tensor name → ours. `{i}` is the block index.
TENSOR_NAMES: dict[str, str] = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.attention_norm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.attention.wq.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.attention.wk.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.attention.wv.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.attention.wo.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.ffn_norm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.feed_forward.w1.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.feed_forward.w2.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.feed_forward.w3.weight",
}

# Tensor types we dequantize (with gguf.quants.dequantize) and test.
SUPPORTED_TYPES = frozenset(
    getattr(gguf.GGMLQuantizationType, name)
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"))

SUPPORTED_ARCHITECTURES = ("llama",)

# Unquantized tensor types: numpy dtype of the stored bytes and the torch dtype they hold.
_FLOAT_TYPES = {
    gguf.GGMLQuantizationType.F32: (np.float32, torch.float32),
    gguf.GGMLQuantizationType.F16: (np.float16, torch.float16),
    gguf.GGMLQuantizationType.BF16: (np.uint16, torch.bfloat16),
}


def gguf_tensor_name(our_name: str) -> str:
    """The GGUF name of one of our parameters (inverse of `our_tensor_name`)."""
    for gguf_template, our_template in TENSOR_NAMES.items():
        parts = our_name.split(".")
        if "{i}" in our_template and len(parts) > 2 and parts[1].isdigit():
            if our_template.format(i=parts[1]) == our_name:
                return gguf_template.format(i=parts[1])
        elif our_template == our_name:
            return gguf_template
    return our_name


def our_tensor_name(gguf_name: str) -> str | None:
    """Our parameter name for a GGUF tensor name, or None if it is not one we know."""
    if gguf_name in TENSOR_NAMES:
        return TENSOR_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)          # "blk", "N", "attn_q.weight"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        template = TENSOR_NAMES.get(f"blk.{{i}}.{parts[2]}")
        if template is not None:
            return template.format(i=int(parts[1]))
    return None


def model_args_from_metadata(metadata: dict[str, Any], tensor_names: set[str], source: str):
    """`ModelArgs` from a GGUF file's `{arch}.*` metadata.

    Args:
        metadata: from `read_metadata`.
        tensor_names: names of the tensors in the file (an absent `output.weight` means tied
            embeddings).
        source: file path, for error messages.

    Raises:
        ModelFileError: unsupported architecture or RoPE scaling, a missing required key, or
            values that do not form a valid model.
    """
    from torchllama.config import ModelArgs
    from torchllama.errors import ArgumentError

    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(
            f"{source}: architecture {arch!r} (general.architecture) is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def need(key: str, kind: type = int, default=MISSING):
        return checked_field(metadata, f"{arch}.{key}", kind, source, default,
                             what="metadata key")

    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        raise ModelFileError(f"{source}: RoPE scaling ({scaling!r}) is not supported yet")

    n_heads = need("attention.head_count")
    n_vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", []))
    if not n_vocab:
        raise ModelFileError(
            f"{source}: vocabulary size unknown ({arch}.vocab_size and tokenizer.ggml.tokens "
            "are both missing)")
    try:
        args = ModelArgs(
            dim=need("embedding_length"),
            n_layers=need("block_count"),
            n_heads=n_heads,
            n_kv_heads=need("attention.head_count_kv", int, n_heads),
            vocab_size=n_vocab,
            hidden_dim=need("feed_forward_length"),
            norm_eps=need("attention.layer_norm_rms_epsilon", float),
            rope_theta=need("rope.freq_base", float, 10000.0),
            max_seq_len=need("context_length"),
            tie_embeddings="output.weight" not in tensor_names,
        )
    except ArgumentError as e:
        raise ModelFileError(f"{source}: metadata does not describe a valid model: {e}") from e
    rope_dims = metadata.get(f"{arch}.rope.dimension_count", args.head_dim)
    if rope_dims != args.head_dim:
        raise ModelFileError(
            f"{source}: partial RoPE ({arch}.rope.dimension_count={rope_dims}, head_dim="
            f"{args.head_dim}) is not supported")
    return args


def load_gguf_state_dict(reader: gguf.GGUFReader, expected: dict[str, torch.Size],
                         dtype: torch.dtype, source: str, progress: bool = True
                         ) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of a GGUF file into our names, shapes checked.

    Args:
        reader: an open GGUF file.
        expected: our parameter name → shape (from the model built on the meta device).
        dtype: dtype of the returned tensors.
        source: file path, for error messages.
        progress: show a tqdm progress bar.

    Returns:
        our name → tensor (dtype). `output.weight` is absent for tied embeddings.

    Raises:
        ModelFileError: an unknown or missing tensor, a shape mismatch, an unsupported
            quantization type, or tensor data cut short.
    """
    from tqdm import tqdm

    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="loading weights", unit="tensor", disable=not progress,
                  leave=False):
        name = our_tensor_name(t.name)
        if name is None or name not in expected:
            raise ModelFileError(f"{source}: unexpected tensor {t.name!r}")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelFileError(
                f"{source}: tensor {t.name!r} has quantization type {t.tensor_type.name}, which "
                f"is not supported (supported: {', '.join(q.name for q in SUPPORTED_TYPES)})")
        # ggml lists dims innermost first: (in, out) for a matrix whose rows are `out`.
        shape = torch.Size(reversed([int(d) for d in t.shape]))
        if shape != expected[name]:
            raise ModelFileError(
                f"{source}: tensor {t.name!r} has shape {tuple(shape)}, expected "
                f"{tuple(expected[name])} for {name}")
        try:
            if t.tensor_type in _FLOAT_TYPES:   # F32/F16/BF16: the stored values, no fp32 detour
                np_dtype, stored = _FLOAT_TYPES[t.tensor_type]
                raw = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
                values = raw.view(np_dtype).reshape(shape).copy()     # out of the file mapping
                tensor = torch.from_numpy(values).view(stored)
            else:
                tensor = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)
                                          .reshape(shape))
        except ValueError as e:
            raise ModelFileError(f"{source}: tensor {t.name!r}: data cut short ({e})") from e
        state[name] = tensor.to(dtype)
        _release_file_pages(reader, t)
    missing = [f"{gguf_tensor_name(n)} ({n})" for n in expected
               if n not in state and n != "output.weight"]
    if missing:
        raise ModelFileError(
            f"{source}: missing tensors for {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return state


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

# Tensor types we write: float types, and Q8_0 for the matrices (norms stay F32, as llama.cpp).
WRITE_TYPES = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
               "BF16": gguf.GGMLQuantizationType.BF16, "Q8_0": gguf.GGMLQuantizationType.Q8_0}

# GGUF tokenizer key → GGUFWriter method (each writes the value with the type llama.cpp expects).
_TOKENIZER_WRITERS = {
    "tokenizer.ggml.model": "add_tokenizer_model",
    "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list",
    "tokenizer.ggml.scores": "add_token_scores",
    "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.merges": "add_token_merges",
    "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id",
    "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id",
    "tokenizer.ggml.eot_token_id": "add_eot_token_id",
    "tokenizer.ggml.eom_token_id": "add_eom_token_id",
    "tokenizer.ggml.add_bos_token": "add_add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_add_eos_token",
    "tokenizer.chat_template": "add_chat_template",
}


def gguf_tensor_type(shape: torch.Size, qtype: str) -> gguf.GGMLQuantizationType:
    """The tensor type to write a tensor of this shape with: `qtype` for matrices whose rows fit its blocks,
    F32 for norms (1-D) and for rows that do not divide into blocks."""
    t = WRITE_TYPES[qtype]
    block, _ = gguf.GGML_QUANT_SIZES[t]
    if len(shape) == 1 or shape[-1] % block:
        return gguf.GGMLQuantizationType.F32
    return t


def save_gguf(model, tokenizer_fields: dict[str, Any], path: str | os.PathLike,
              qtype: str = "F32", name: str = "torchllama", progress: bool = True) -> None:
    """Write our model as a llama.cpp GGUF file (architecture 'llama').

    Hyperparameters go to `llama.*` metadata, the tokenizer to `tokenizer.*`, tensors under
    llama.cpp's names. q/k weights are written as they are: GGUF uses Meta's interleaved RoPE
    layout. A tied output projection is not written (llama.cpp ties when `output` is absent).

    Args:
        model: a `Transformer`.
        tokenizer_fields: GGUF `tokenizer.*` keys → values (`Tokenizer.gguf_fields()`).
        path: output file; written directly (callers write to a temporary path and rename).
        qtype: 'F32', 'F16', 'BF16' or 'Q8_0' for the matrices (quantized with the `gguf`
            library); 1-D norms are always F32.
        name: general.name.
        progress: show a progress bar.

    Raises:
        ArgumentError: unknown qtype.
    """
    from tqdm import tqdm

    from torchllama.errors import ArgumentError

    if qtype not in WRITE_TYPES:
        raise ArgumentError(f"GGUF tensor type {qtype!r} is not supported for writing; "
                            f"use one of {', '.join(WRITE_TYPES)}")
    args = model.args
    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    writer.add_name(name)
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_hidden_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_vocab_size(args.vocab_size)
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                          "BF16": gguf.LlamaFileType.MOSTLY_BF16,
                          "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
    for key, value in tokenizer_fields.items():
        if key == "tokenizer.ggml.add_space_prefix":
            writer.add_bool(key, bool(value))
        elif value is not None and key in _TOKENIZER_WRITERS:
            getattr(writer, _TOKENIZER_WRITERS[key])(value)

    try:
        state = model.state_dict()
        if args.tie_embeddings:
            state.pop("output.weight", None)
        for ours, tensor in tqdm(state.items(), desc="writing GGUF", unit="tensor",
                                 disable=not progress, leave=False):
            t = gguf_tensor_type(tensor.shape, qtype)
            data = tensor.detach().float().contiguous().numpy()
            if t == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(gguf_tensor_name(ours), data)
            elif t == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(gguf_tensor_name(ours), data.astype(np.float16))
            else:
                writer.add_tensor(gguf_tensor_name(ours), gguf.quants.quantize(data, t),
                                  raw_dtype=t)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
    finally:
        writer.close()
