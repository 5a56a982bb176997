"""GGUF checkpoints: metadata, hyperparameters and weights, read with the `gguf` library.

GGUF (llama.cpp's file format) holds three things we need:

- metadata key/values: hyperparameters under ``{arch}.*`` (``llama.block_count``, ...), the
  tokenizer under ``tokenizer.ggml.*`` and the chat template under ``tokenizer.chat_template``;
- tensors named ``token_embd``, ``blk.N.attn_q`` ... ``output_norm``, ``output``, each possibly
  quantized (Q4_1, Q8_0, ...). ``gguf.quants.dequantize`` turns them back into float32 arrays.
- for Llama, q/k projection weights already in Meta's *interleaved* RoPE layout (llama.cpp's
  converter permutes HF's rotate_half layout back), so they load into our model as they are;
  other architectures differ (qwen2 keeps HF's rotate_half rows, gpt2 fuses q/k/v, deepseek2
  splits wkv_b in two), which their family's table says.

`general.architecture` picks the family adapter (`torchllama.families`: llama, qwen2, gpt2,
deepseek2, ...), which turns the ``{arch}.*`` keys into `ModelArgs` (it may read tensors that
are hyperparameters, as llama's rope_freqs) and gives each tensor's GGUF name and layout.

Loading (`load_gguf_state_dict` with `modules`, as `torchllama.load` does) reads the file
through its memory mapping, tensor by tensor, on a few threads. A matrix kept in its blocks
whose rows load as stored (a layer's q/k/v and w1/w3 together, as one fused module; the token
embeddings' table too) is converted and packed a chunk of rows at a time
(`torchllama.blocks.chunked.pack_in_chunks`: `convert_blocks`, one C++ pass, into a few MB of
arrays, then the kernels' packed layout, copied into the module's buffers), each chunk's file
pages handed back as it is read (`_release_file_pages`). Other matrices are converted whole
into the arrays of their blocks (`read_blocks`) and their module built from them at once
(`quantized_linear`, `fused_linears`), then their pages and the freed temporaries handed back
(`_release_freed_heap`). So the peak holds the finished modules plus a few chunks in flight,
never a whole matrix's arrays beside its module (a 7B Q5_K_M: 5.29 GB peak to the first
forward for 4.9 GB of file, llama.cpp's mapping 5.29; it was 5.95 with whole matrices, 11 GB
at first).

Damaged files raise `ModelFileError` before any forward (a string that is not UTF-8 names its
key; a tensor type the `gguf` library cannot dequantize names the tensor, its type and the
supported types; a tensor whose data runs past the end of the file, whose row length is not a
multiple of its block size, or whose block scales are not finite names the tensor).

Shapes in GGUF are listed innermost-first (ggml order): a (out, in) matrix is listed as [in, out].
The numpy arrays that ``GGUFReader`` exposes are already in row-major (out, in) order.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import torch

from torchllama.checkpoint.common import meta_model
from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError, ModelFileError
from torchllama.families import Family, family_for_args, family_for_gguf
from torchllama.families.base import Fused, Layout, Mapping, Part, RopePermuted, Stacked
from torchllama.blocks import block_type, convert_blocks
from torchllama.blocks.chunked import pack_in_chunks
from torchllama.blocks.forms import HalfMatrix, Q4Blocks, Q8Blocks
from torchllama.blocks.linear import BlockLinear
from torchllama.transforms.quantize import (Scheme, fits, quantize_weight, quantized_linear,
                                            scheme_for)
from torchllama.transforms.fuse import fused_linears, fusion_groups
from torchllama.tokenizers import tokenizer_from_gguf_metadata


class _TensorInfoError(ValueError):
    """A tensor whose info the `gguf` reader refused (its name and the reader's reason)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(reason)
        self.name = name


class _ArrayField(gguf.ReaderField):
    """A metadata array as `_Reader` keeps it: numbers in one view of the file (parts[-1]),
    strings as one view of their bytes and their (start, length) arrays (parts[-3:]); its
    `contents` are the library's (a list of Python values, or one of them)."""

    __slots__ = ()

    @property
    def stored(self) -> np.ndarray:
        """The array's bytes as a view of the file: the numbers, or the strings' region."""
        return self.parts[-3] if self.types[-1] == gguf.GGUFValueType.STRING else self.parts[-1]

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        if self.types[-1] != gguf.GGUFValueType.STRING:           # numbers, or empty
            return self.parts[-1][index_or_slice].tolist()
        region, starts, lengths = self.parts[-3:]
        if isinstance(index_or_slice, int):
            s, n = int(starts[index_or_slice]), int(lengths[index_or_slice])
            return str(region[s:s + n].tobytes(), encoding="utf-8")
        return [str(region[s:s + n].tobytes(), encoding="utf-8") for s, n in
                zip(starts[index_or_slice].tolist(), lengths[index_or_slice].tolist())]


class _Reader(gguf.GGUFReader):
    """`gguf.GGUFReader` that says which tensor it refused. The library checks each tensor's
    info while mapping it (a row length that is not a multiple of its type's block size, data
    that runs past the end of the file) but names only the type; when it refuses a file, each
    tensor is mapped again on its own, so the error can name it."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        """The library's `_get` (count values of dtype at offset, in the file's byte order),
        sliced from a plain ndarray view of the mapping: slicing the `numpy.memmap` itself
        costs Python code per call (its `__getitem__` and `__array_finalize__`), and a
        49k-token vocabulary with its merges takes ~200k calls (5 s of a 1B model's load on a
        2-core machine; 0.5 s this way)."""
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)      # same memory, no copy
        dtype = np.dtype(dtype)
        count = int(count)
        arr = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        """The library's (size, parts, data indices, types) of a metadata value, but arrays of
        strings or numbers (a vocabulary's tokens, merges, scores, types: ~150k elements) kept
        compact for `_ArrayField`: numbers as one view of the file, strings as one view of
        their bytes with each one's (start, length) in two int64 arrays. The library's parts
        (a view per element, two per string) were ~250k Python objects for a 49k vocabulary,
        44 MB that stayed with the process after they were freed (pymalloc's arenas, shared with
        the tokenizer's strings), and one recursive call each."""
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I" or \
                self.__dict__.get("_nested"):             # inside an array: the library's way
            return super()._get_field_parts(orig_offs, raw_type)
        itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        sub = gguf.GGUFValueType(int(itype[0]))
        if sub == gguf.GGUFValueType.ARRAY:                # arrays of arrays: the library's way
            self._nested = True
            try:
                return super()._get_field_parts(orig_offs, raw_type)
            finally:
                self._nested = False
        n, start = int(alen[0]), orig_offs + 12
        if sub == gguf.GGUFValueType.STRING:
            starts, lengths, end = self._string_offsets(start, n)
            parts = [itype, alen, self._plain[start:end], starts, lengths]
        elif sub in self.gguf_scalar_to_np:
            dtype = np.dtype(self.gguf_scalar_to_np[sub])
            end = start + n * dtype.itemsize
            if end > len(self._plain):
                raise ValueError(f"an array of {n} {sub.name} runs past the end of the file")
            parts = [itype, alen, self._plain[start:end].view(dtype)]          # (n,)
        else:                                             # a type the library refuses
            return super()._get_field_parts(orig_offs, raw_type)
        self._compact = True                              # for `_push_field`, next
        return (end - orig_offs, parts, [len(parts) - 1],
                [gguf.GGUFValueType.ARRAY] + ([sub] if n else []))    # the library's types

    def _push_field(self, field, skip_sum: bool = False) -> int:
        """The library's, with a field `_get_field_parts` kept compact as an `_ArrayField`."""
        if self.__dict__.pop("_compact", False):
            field = _ArrayField._make(field)
        return super()._push_field(field, skip_sum)

    def _string_offsets(self, offs: int, n: int) -> tuple[np.ndarray, np.ndarray, int]:
        """n GGUF strings (each a little-endian uint64 length, then its bytes) from offs: their
        (n,) int64 starts relative to offs + 8 … and lengths, and the offset after them."""
        plain, size = self._plain, len(self._plain)
        first, starts, lengths = offs, [], []
        for _ in range(n):
            if offs + 8 > size:
                raise ValueError(f"an array of {n} strings runs past the end of the file")
            length = struct.unpack_from("<Q", plain, offs)[0]
            if offs + 8 + length > size:
                raise ValueError(f"a string of {length} bytes runs past the end of the file")
            starts.append(offs + 8 - first)
            lengths.append(length)
            offs += 8 + length
        return np.array(starts, np.int64), np.array(lengths, np.int64), offs

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        try:
            super()._build_tensors(start_offs, fields)
        except (ValueError, KeyError):              # find which tensor it was (bad files only)
            for field in fields:
                self._build_one(start_offs, field)
            raise

    def _build_one(self, start_offs: int, field) -> None:
        """Map one tensor; `_TensorInfoError` naming it where the library refuses it."""
        name = bytes(field.parts[1]).decode("utf-8", "replace")
        data_offset, n_bytes = _tensor_extent(start_offs, field)
        if data_offset + n_bytes > len(self.data):
            raise _TensorInfoError(name, f"its bytes {data_offset:,}–{data_offset + n_bytes:,} "
                                         f"run past the end of the file ({len(self.data):,} "
                                         "bytes)")
        try:
            super()._build_tensors(start_offs, [field])
        except (ValueError, KeyError) as e:
            raise _TensorInfoError(name, str(e)) from e


def _tensor_extent(start_offs: int, field) -> tuple[int, int]:
    """(first byte, length in bytes) of a tensor's data from its info field, ggml's sizes:
    elements × type size / block size (the library's own formula)."""
    _, _, _, dims, raw_type, offset = field.parts
    try:
        block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
    except (ValueError, KeyError):                     # an unknown type: the library says so
        return 0, 0
    n_elements = int(np.prod(dims.astype(np.float64)))  # no integer overflow on damaged dims
    return int(start_offs + int(offset[0])), n_elements * type_size // block_size


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Open a GGUF file for reading (memory-mapped; nothing is copied).

    Raises:
        ModelFileError: the file is missing, unreadable, not GGUF, or truncated; a tensor whose
            data runs past the end of the file or whose row length is not a multiple of its
            type's block size (naming the tensor).
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
        return _Reader(path, "c")     # copy-on-write: writable views (torch.from_numpy)
        # of the file's pages, which nothing writes; the file itself is never changed
    except _TensorInfoError as e:
        raise ModelFileError(f"{path}: truncated or corrupt GGUF file: tensor {e.name!r}: {e}"
                             ) from e
    except OSError as e:  # mapping the file failed: not a truncation
        raise ModelFileError(f"{path}: cannot read the file ({e.strerror or e})") from e
    except UnicodeDecodeError as e:  # a key or tensor name (decoded while parsing the header)
        raise ModelFileError(f"{path}: corrupt GGUF file: a metadata key or tensor name is not "
                             f"valid UTF-8 ({e.reason})") from e
    except Exception as e:  # the library raises ValueError/IndexError/... on truncated headers
        raise ModelFileError(
            f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})"
        ) from e


def read_metadata(reader: gguf.GGUFReader, source: str | None = None) -> dict[str, Any]:
    """All metadata key/values of a GGUF file as plain Python values (str, int, float, bool, list).

    The tokenizer's large arrays (tokens, scores, merges) are decoded too; expect ~0.1 s for a
    50k vocabulary.

    Raises:
        ModelFileError: a value that cannot be decoded (a string that is not UTF-8, a damaged
            array), naming the key.
    """
    source = source or str(getattr(reader.data, "filename", None) or "GGUF file")
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # header fields (version, counts), not metadata
            continue
        try:
            metadata[key] = field.contents()
        except UnicodeDecodeError as e:
            raise ModelFileError(f"{source}: metadata key {key!r} holds a string that is not "
                                 f"valid UTF-8 ({e.reason} at byte {e.start})") from e
        except Exception as e:  # a damaged value the library cannot decode
            raise ModelFileError(f"{source}: metadata key {key!r} cannot be read "
                                 f"({type(e).__name__}: {e})") from e
    return metadata


def _release_file_pages(reader: gguf.GGUFReader, tensor: Any, first: int = 0,
                        end: int | None = None) -> None:
    """Drop the file pages of a tensor we have copied out of the read-only file mapping: all of
    them, or those of its bytes [first, end).

    Touched pages of a memory-mapped file count in the process's resident memory until unmapped;
    without this, loading would peak at the file's size plus the loaded weights. The mapping is
    read-only and shared with the page cache, so MADV_DONTNEED loses nothing: a later read of
    those bytes (a part of a page the range ends in) faults them in again.
    """
    end = tensor.n_bytes if end is None else end
    _release_bytes(reader, tensor.data_offset + first, tensor.data_offset + end)


def _release_bytes(reader: gguf.GGUFReader, first: int, end: int) -> None:
    """MADV_DONTNEED over the pages that hold the file's bytes [first, end) (see
    `_release_file_pages`); nothing where the mapping cannot be advised."""
    file_map = getattr(reader.data, "_mmap", None)      # numpy.memmap's mmap.mmap
    if file_map is None or not hasattr(file_map, "madvise") or end <= first:
        return
    start = first // mmap.PAGESIZE * mmap.PAGESIZE
    file_map.madvise(mmap.MADV_DONTNEED, start, end - start)


def _release_metadata_arrays(reader: gguf.GGUFReader) -> list[str]:
    """Drop the metadata arrays (`_ArrayField`: a vocabulary's tokens, merges, scores, types)
    from `reader.fields` and hand back their file pages, once the tokenizer has been built from
    them: the strings' offset arrays (16 bytes a string: 6.5 MB for Llama 3's 128k tokens and
    280k merges) and the pages of the bytes themselves (~5 MB) stayed with the process until
    the file was closed, at the end of the weights' load, where its memory peaks. Returns the
    keys dropped. The mapping is read-only, so MADV_DONTNEED loses nothing (see
    `_release_file_pages`)."""
    plain = reader.__dict__.get("_plain")                # `_Reader._get`'s view of the file
    dropped = [key for key, field in reader.fields.items() if isinstance(field, _ArrayField)]
    for key in dropped:
        view = reader.fields.pop(key).stored
        if plain is not None:
            first = view.ctypes.data - plain.ctypes.data        # its offset in the file
            _release_bytes(reader, first, first + view.nbytes)
    return dropped


def _libc_malloc_trim():
    """glibc's `malloc_trim`, or None (another C library, or none found)."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_malloc_trim() if sys.platform.startswith("linux") else None


def _release_freed_heap() -> None:
    """Hand the pages of freed heap memory back to the system (glibc `malloc_trim(0)`: every
    arena, every run of whole free pages; malloc_trim(3)). A conversion's temporary arrays
    (each tensor's blocks before packing) are freed into the allocator's free lists, and glibc
    keeps memory below its mmap threshold, which rises to 32 MB after the first large block is
    freed: without this, a 1B model's load peaked ~170 MB higher (1.35 vs 1.18 GB), above
    llama.cpp's. A no-op elsewhere."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


# Tensor types we dequantize (with gguf.quants.dequantize) and test: every type gguf 0.19 can
# dequantize (not Q8_1, Q8_K, Q1_0, the integer types or F64).
SUPPORTED_TYPES = frozenset(
    getattr(gguf.GGMLQuantizationType, name)
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                 "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                 "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4")
    if hasattr(gguf.GGMLQuantizationType, name))

# Unquantized tensor types: numpy dtype of the stored bytes and the torch dtype they hold.
_FLOAT_TYPES = {
    gguf.GGMLQuantizationType.F32: (np.float32, torch.float32),
    gguf.GGMLQuantizationType.F16: (np.float16, torch.float16),
    gguf.GGMLQuantizationType.BF16: (np.uint16, torch.bfloat16),
}


def read_gguf(path: Path, dtype: torch.dtype, progress: bool = True, quant=None,
              modules: bool = False):
    """(args, state dict in our names and `dtype`, tokenizer) of a GGUF file; the family adapter
    of its `general.architecture` gives the hyperparameters and tensor names.

    With `quant` ("auto" or a `torchllama.transforms.quantize.Scheme`), the matrices of linear layers and
    the token embeddings come as `Q4Blocks` / `Q8Blocks` instead of float tensors, and with
    `modules` those of linear layers as their modules, built tensor by tensor (see
    `load_gguf_state_dict`).

    Raises:
        ModelFileError: see `open_gguf`, the family's `args_from_gguf`, `load_gguf_state_dict`
            and `torchllama.tokenizers.tokenizer_from_gguf_metadata`.
    """
    source = str(path)
    reader = open_gguf(path)
    metadata = read_metadata(reader, source)
    family = family_for_gguf(metadata, source)
    args = family.args_from_gguf(metadata, tensor_index(reader, source), source)
    tokenizer = tokenizer_from_gguf_metadata(metadata, source)
    if tokenizer.chat_template is None and family.chat_template is not None:
        tokenizer.chat_template = family.chat_template      # the family's built-in format
    del metadata                        # its vocabulary lists: not held while weights load
    _release_metadata_arrays(reader)
    state = load_gguf_state_dict(reader, family, args, dtype, source, progress, quant,
                                 modules)
    return args, state, tokenizer


def _dequantize(t: Any, source: str) -> torch.Tensor:
    """The values of one GGUF tensor in our (out, in) row-major shape: float types as stored
    (no float32 detour), quantized ones dequantized to float32 by the `gguf` library.

    Raises:
        ModelFileError: a type we do not read (one line: tensor, type, the supported types), or
            data that is cut short or damaged.
    """
    if t.tensor_type not in SUPPORTED_TYPES:
        raise ModelFileError(
            f"{source}: tensor {t.name!r} has quantization type {t.tensor_type.name}, which is "
            "not supported (supported: "
            f"{', '.join(q.name for q in sorted(SUPPORTED_TYPES, key=lambda q: q.value))})")
    # ggml lists dims innermost first: (in, out) for a matrix whose rows are `out`.
    shape = torch.Size(reversed([int(d) for d in t.shape]))
    try:
        if t.tensor_type in _FLOAT_TYPES:   # F32/F16/BF16: the stored values, no fp32 detour
            np_dtype, stored = _FLOAT_TYPES[t.tensor_type]
            raw = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)
            values = raw.view(np_dtype).reshape(shape).copy()     # out of the file mapping
            return torch.from_numpy(values).view(stored)
        with np.errstate(all="ignore"):               # a damaged scale: reported below
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        values = torch.from_numpy(values.reshape(shape))
    except (ValueError, IndexError, TypeError) as e:
        raise ModelFileError(f"{source}: tensor {t.name!r}: data cut short or damaged ({e})") from e
    if not bool(torch.isfinite(values).all()):      # finite codes × a damaged block scale
        n = int((~torch.isfinite(values)).sum())
        raise ModelFileError(f"{source}: tensor {t.name!r} ({t.tensor_type.name}) dequantizes "
                             f"to {n} values that are not finite numbers (a block scale is "
                             "damaged)")
    return values


class TensorIndex(dict):
    """The tensors of a GGUF file for a family's `args_from_gguf`: name → a function giving that
    tensor's values (float32 torch tensor in our row-major shape). `in` works as on the set of
    names; llama reads its `rope_freqs` factors through it."""


def tensor_index(reader: gguf.GGUFReader, source: str) -> TensorIndex:
    """A `TensorIndex` of the tensors of an open GGUF file."""
    return TensorIndex({t.name: (lambda t=t: _dequantize(t, source).float())
                        for t in reader.tensors})


def load_gguf_state_dict(reader: gguf.GGUFReader, family: Family, args: ModelArgs,
                         dtype: torch.dtype, source: str, progress: bool = True, quant=None,
                         modules: bool = False) -> dict[str, Any]:
    """Every tensor of a GGUF file in our names, shapes checked: dequantized, or with `quant`
    the matrices kept quantized.

    Args:
        reader: an open GGUF file.
        family: its family adapter (GGUF names and layouts).
        args: the model's hyperparameters (from the file's metadata).
        dtype: dtype of the returned float tensors.
        source: file path, for error messages.
        progress: show a tqdm progress bar of the bytes read.
        quant: None (dequantize everything), "auto" (the file's own blocks for the types the
            kernels take, `torchllama.blocks.TYPES`, in their kernel form (`Q4Blocks`,
            `Q8Blocks`), exactly; other quantized types dequantized, reported in one line;
            float matrices stay float) or a `torchllama.transforms.quantize.Scheme` (every matrix in that
            scheme). See `_quantized`.
        modules: the matrices kept quantized of linear layers without a bias come as their
            finished modules (`torchllama.transforms.quantize.quantized_linear`), each built as
            soon as its tensor is read: the blocks of one tensor at a time are in memory beside
            the modules, not the blocks of all of them (a 7B model: 4 GB less at the peak).

    Returns:
        our name → tensor (dtype), quantized weight or (with `modules`) module.
        `output.weight` is absent for tied embeddings.

    Raises:
        ModelFileError: an unknown or missing tensor, a shape mismatch, an unsupported
            quantization type, tensor data cut short, or a block scale that is not finite.
    """
    from tqdm import tqdm

    model = meta_model(args, source)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    mappings = family.mappings("gguf", args.n_layers, set(expected))
    parts = _Parts(mappings)
    state: dict[str, Any] = {}
    linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    quantizable = linears | {"tok_embeddings.weight"} if quant else set()
    built = {n for n in linears if n.removesuffix("weight") + "bias" not in expected and not (
        n == "output.weight" and args.tie_embeddings)} if modules else set()
    by_name = {m.theirs: m for m in mappings}
    stored = {n for t in reader.tensors if t.name in by_name for n in by_name[t.name].ours}
    tied_output = modules and args.tie_embeddings and "output.weight" not in stored and \
        "output.bias" not in expected
    job = _Job(reader, family, args, source, quant, expected, by_name, quantizable, built,
               tied_output, set())
    if quant == "auto":                # a first build (~1 min) before the bar, not inside it
        from torchllama import kernels
        kernels.available()
    bar = tqdm(total=sum(int(t.n_bytes) for t in reader.tensors), desc="loading weights",
               unit="B", unit_scale=True, unit_divisor=1024, disable=not progress, leave=False)
    with bar, _conversion_pool() as pool:
        for t, converting in job.submit(pool):         # in file order; first error raised
            mapping = job.mapping_of(t)
            if mapping is not None and converting is not _IN_GROUP:
                loaded = None if converting is None else converting.result()
                if loaded is None:
                    loaded = _dequantized(t, mapping, args, dtype, source, parts)
                    _release_file_pages(reader, t)
                state.update(loaded)
            bar.update(int(t.n_bytes))
    no_kernel = job.no_kernel
    _check_none_missing(state, expected, family, args, source)
    if no_kernel:
        print(f"note: {source}: no kernel for {', '.join(sorted(no_kernel))} tensors; they are "
              f"dequantized to {str(dtype).removeprefix('torch.')}", file=sys.stderr)
    if isinstance(quant, Scheme):     # float matrices of the file, or ones a layout reshaped
        _quantize_float_matrices(state, quantizable, quant)
    return state


def _check_stored_shape(t: Any, mapping: Mapping, expected: dict[str, torch.Size],
                        args: ModelArgs, source: str) -> None:
    """Raise `ModelFileError` unless GGUF tensor `t` has the shape its mapping stores (a `Part`
    layout: its part of our tensor)."""
    shape = torch.Size(reversed([int(d) for d in t.shape]))
    if isinstance(mapping.layout, Part):
        want = mapping.layout.part_shape(expected[mapping.ours[0]], args)
    else:
        want = mapping.layout.stored_shape(tuple(expected[n] for n in mapping.ours))
    if shape != want:
        raise ModelFileError(
            f"{source}: tensor {t.name!r} has shape {tuple(shape)}, expected "
            f"{tuple(want)} for {', '.join(mapping.ours)}")


#: Most tensors converted at once (`_conversion_pool`): each holds one tensor's blocks.
MAX_LOAD_THREADS = 4


@contextmanager
def _conversion_pool() -> Iterator[ThreadPoolExecutor]:
    """Threads that convert tensors side by side (numpy and torch release the GIL), as many as
    torch's threads (at most `MAX_LOAD_THREADS`), each running its torch ops on one thread
    (torch's thread count is 1 meanwhile, and restored after). Conversions are short copies
    and casts: split inside each op, they cost more in thread wake-ups and barriers than they
    gain (a 7B model's matrices on 2 busy cores: 12 s with 2 torch threads per op, 7 s with
    one, 6 s with two tensors at a time on one thread each)."""
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(max(1, min(threads, MAX_LOAD_THREADS)),
                              thread_name_prefix="torchllama-load")
    torch.set_num_threads(1)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(threads)


#: `_Job.submit`'s mark of a tensor that the conversion of its fusion group's first reads.
_IN_GROUP = object()


@dataclass
class _Job:
    """What `load_gguf_state_dict` converts, and how: the file, the names and shapes it maps
    to, which matrices stay quantized (`quantizable`) and which come as modules (`built`;
    `tied_output`: the output projection from the token embeddings' table too); `no_kernel`
    collects the types loaded as float for want of a kernel."""

    reader: gguf.GGUFReader
    family: Family
    args: ModelArgs
    source: str
    quant: Any
    expected: dict[str, torch.Size]
    by_name: dict[str, Mapping]
    quantizable: set[str]
    built: set[str]
    tied_output: bool
    no_kernel: set[str]

    def mapping_of(self, t: Any) -> Mapping | None:
        """The mapping of GGUF tensor `t` (its shape checked), None for one the family ignores.

        Raises:
            ModelFileError: a tensor of no mapping, or of another shape than its mapping stores.
        """
        mapping = self.by_name.get(t.name)
        if mapping is None:
            ignored = self.family.gguf_ignored
            if ignored is not None and ignored.fullmatch(t.name):
                return None
            raise ModelFileError(f"{self.source}: unexpected tensor {t.name!r}")
        _check_stored_shape(t, mapping, self.expected, self.args, self.source)
        return mapping

    def submit(self, pool: ThreadPoolExecutor) -> list[tuple[Any, Any]]:
        """(tensor, its conversion) for every tensor, in file order: a future of the matrices
        kept quantized (`kept_quantized`; a fusion group's first tensor: `fused_group`, its
        others `_IN_GROUP`), None for the rest (converted by the caller). A tensor whose name
        or shape is wrong gets None; the caller's `mapping_of` raises in file order."""
        mappings = {}
        for t in self.reader.tensors:
            try:
                mappings[t.name] = self.mapping_of(t)
            except ModelFileError:
                mappings[t.name] = None
        groups = self._fusion_groups(mappings)
        jobs = []
        for t in self.reader.tensors:
            mapping, group = mappings[t.name], groups.get(t.name)
            if group is not None:
                first = group[0] is t
                jobs.append((t, pool.submit(self.fused_group, group) if first else _IN_GROUP))
            elif mapping is not None and set(mapping.ours) <= self.quantizable and \
                    _rows_only(mapping.layout):
                jobs.append((t, pool.submit(self.kept_quantized, t, mapping)))
            else:
                jobs.append((t, None))
        return jobs

    def _fusion_groups(self, mappings: dict[str, Mapping | None]) -> dict[str, list]:
        """GGUF name → the tensors of its fusion group (`fusion_groups`) in row order, for the
        groups read as one (`fused_group`): modules of the file's blocks under "auto", each
        tensor ours as it is, all of one block form."""
        if self.quant != "auto":
            return {}
        ours = {}                                      # our name → its tensor, as it is
        for t in self.reader.tensors:
            m = mappings[t.name]
            if m is not None and type(m.layout) is Layout and len(m.ours) == 1:
                ours[m.ours[0]] = t
        groups = {}
        for names in fusion_groups(set(ours) & self.built):
            tensors = [ours[n] for n in names]
            layouts = {_arrays_layout(t.tensor_type) for t in tensors}
            if len(layouts) == 1 and None not in layouts:
                groups.update((t.name, tensors) for t in tensors)
        return groups

    def kept_quantized(self, t: Any, mapping: Mapping) -> dict | None:
        """A matrix kept quantized (`_quantized`): our name → its rows after the mapping's
        layout, as a module for the names in `built` (`quantized_linear`); its file pages
        released. None to load it as float (no kernel for its type under "auto", or our shapes
        do not fit the blocks). Runs in `_conversion_pool`'s threads."""
        chunked = self.chunked(t, mapping)
        if chunked is not None:
            return chunked
        quant = self.quant if self.quant == "auto" else scheme_for(mapping.ours[0], self.quant)
        q = _quantized(t, quant, self.source, self.no_kernel)
        if q is None or not all(fits(torch.Size((self.expected[n][0], q.shape[1])),
                                     _scheme_of(q)) for n in mapping.ours):
            return None
        rows = _layout_rows(mapping, q, self.args)
        stacked = isinstance(mapping.layout, Stacked) and set(mapping.ours) <= self.built
        linears = fused_linears(q, [w.shape[0] for w in rows]) if stacked else None
        del q                                          # the rows are views or copies of it
        if linears is not None:                        # experts: views of one packed module
            loaded = dict(zip(mapping.ours, linears[1:]))  # (`stack_experts` finds them so)
        else:
            loaded = {n: quantized_linear(w) if n in self.built else w
                      for n, w in zip(mapping.ours, rows)}
        if self.tied_output and mapping.ours == ("tok_embeddings.weight",):
            output = quantized_linear(loaded["tok_embeddings.weight"])
            if isinstance(output, BlockLinear):       # its table serves the embeddings too,
                loaded["output.weight"] = output      # so the blocks are not kept (a 128k
                loaded["tok_embeddings.weight"] = output  # vocabulary: ~330 MB at the peak)
        _release_file_pages(self.reader, t)
        _release_freed_heap()
        return loaded

    def chunked(self, t: Any, mapping: Mapping) -> dict | None:
        """A matrix of a block type whose rows load as stored, packed a chunk at a time
        (`packed_modules`): our name → its module (the token embeddings' table too: a tied
        output's, or its own `BlockEmbedding`'s); None to load it otherwise (another layout or
        type, no kernels, chunks that chose different packed forms)."""
        name = mapping.ours[0]
        if self.quant != "auto" or type(mapping.layout) is not Layout or \
                block_type(t.tensor_type) is None or len(t.shape) != 2 or \
                (name not in self.built and name != "tok_embeddings.weight"):
            return None
        linears = self.packed_modules([t])
        if linears is None:
            return None
        loaded = {name: linears[0]}
        if self.tied_output and name == "tok_embeddings.weight":
            loaded["output.weight"] = linears[0]
        return loaded

    def packed_modules(self, tensors: list) -> list[BlockLinear] | None:
        """[the module of all rows, each tensor's module over views of its buffers] of matrices
        of one block type, converted and packed a chunk of rows at a time
        (`torchllama.blocks.chunked.pack_in_chunks`: a chunk's arrays, never the whole
        matrix's, beside the packed buffers), each chunk's file pages released once read, then
        the freed temporaries (`_release_freed_heap`). None
        without the kernels, with parts not whole groups of 8 rows, or where the chunks chose
        different packed forms (the caller packs the whole matrix).

        Raises:
            ModelFileError: data cut short, or a block scale that is not finite."""
        from torchllama import kernels

        sizes = [int(t.shape[1]) for t in tensors]
        if not kernels.available() or (len(sizes) > 1 and any(n % 8 for n in sizes)):
            return None
        stored = [_stored_blocks(t, self.source) for t in tensors]         # (rows, blocks)

        def read(part: int, a: int, b: int, out: list[np.ndarray]) -> None:
            t, blocks = tensors[part], stored[part]
            _convert_checked(t, blocks[a:b], out, self.source)
            row_bytes = blocks.shape[1] * blocks.itemsize
            _release_file_pages(self.reader, t, a * row_bytes, b * row_bytes)

        kind = block_type(tensors[0].tensor_type)
        linears = pack_in_chunks(kind, int(tensors[0].shape[0]), sizes, read)
        for t in tensors:                    # and the pages a fault mapped around a chunk's
            _release_file_pages(self.reader, t)     # (the kernel's fault-around: up to 64 KiB)
        _release_freed_heap()
        return linears

    def fused_group(self, tensors: list) -> dict:
        """The matrices of one fusion group (`fusion_groups`, e.g. a layer's q, k, v) as modules
        over views of one module's buffers, packed a chunk at a time (`packed_modules`), else
        read into one stacked block weight and packed once (`fused_linears`), or built apart
        from its rows where they cannot be fused. Runs in `_conversion_pool`'s threads."""
        linears = self.packed_modules(tensors)
        if linears is not None:
            return {self.by_name[t.name].ours[0]: lin for t, lin in zip(tensors, linears[1:])}
        sizes, K = [int(t.shape[1]) for t in tensors], int(tensors[0].shape[0])
        kind = block_type(tensors[0].tensor_type)
        stacked = kind.arrays(sum(sizes), K)
        start = 0
        for t, n in zip(tensors, sizes):
            read_blocks(t, self.source, [x[start:start + n] for x in stacked])
            _release_file_pages(self.reader, t)
            start += n
        weight = kind.weight(stacked)
        linears = fused_linears(weight, sizes)
        if linears is None:
            linears = [None] + [quantized_linear(w) for w in weight.split_rows(sizes)]
        del weight, stacked
        _release_freed_heap()
        return {self.by_name[t.name].ours[0]: lin for t, lin in zip(tensors, linears[1:])}


class _Parts:
    """Our tensors that GGUF stores in several parts (`Part` layouts): the parts loaded so far,
    joined once the last one of a tensor arrives."""

    def __init__(self, mappings: list[Mapping]) -> None:
        self.groups: dict[str, list[Mapping]] = {}   # our name → its mappings, in table order
        for m in mappings:
            if isinstance(m.layout, Part):
                self.groups.setdefault(m.ours[0], []).append(m)
        self.loaded: dict[str, dict[str, torch.Tensor]] = {}    # our name → their name → part

    def add(self, mapping: Mapping, part: torch.Tensor, args: ModelArgs) -> torch.Tensor | None:
        """Record one loaded part; the joined tensor if it was the last of its group, else None."""
        name = mapping.ours[0]
        got = self.loaded.setdefault(name, {})
        got[mapping.theirs] = part
        group = self.groups[name]
        if not all(m.theirs in got for m in group):
            return None
        return group[0].layout.join([got[m.theirs] for m in group], args)


def _dequantized(t: Any, mapping: Mapping, args: ModelArgs, dtype: torch.dtype, source: str,
                 parts: _Parts) -> dict[str, torch.Tensor]:
    """GGUF tensor `t` dequantized into our names and `dtype` by its mapping's layout (a part of
    a tensor stored in parts: nothing until its last part, then the joined tensor)."""
    loaded = mapping.layout.load(_dequantize(t, source), args)
    if not isinstance(mapping.layout, Part):
        return {name: x.to(dtype) for name, x in zip(mapping.ours, loaded)}
    joined = parts.add(mapping, loaded[0], args)
    return {} if joined is None else {mapping.ours[0]: joined.to(dtype)}


def _check_none_missing(state: dict, expected: dict[str, torch.Size], family: Family,
                        args: ModelArgs, source: str) -> None:
    """Raise `ModelFileError` naming (up to five of) the tensors a GGUF file lacks; the output
    projection may be absent for tied embeddings."""
    missing = [f"{family.their_name('gguf', n, args.n_layers)} ({n})" for n in expected
               if n not in state and not (n == "output.weight" and args.tie_embeddings)]
    if missing:
        raise ModelFileError(
            f"{source}: missing tensors for {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _quantize_float_matrices(state: dict, names: set[str], quant: Scheme) -> None:
    """Quantize in place, in `quant` (per name, `scheme_for`), the matrices among `names` that
    are still float tensors of a shape the scheme fits."""
    for name in names & state.keys():
        w, scheme = state[name], scheme_for(name, quant)
        if isinstance(w, torch.Tensor) and fits(w.shape, scheme):
            state[name] = quantize_weight(w, scheme)


# ---------------------------------------------------------------------------------------------
# Quantized tensors kept quantized (torchllama.blocks: the types the kernels take as stored)
# ---------------------------------------------------------------------------------------------

def _arrays_layout(typ) -> tuple | None:
    """What a type's blocks are converted into (the dtypes and widths of its arrays), so
    matrices of types converted alike can share one stacked buffer; None for a type that is
    not kept in blocks."""
    kind = block_type(typ)
    if kind is None:
        return None
    return kind.form, tuple((x.dtype, x.shape) for x in kind.arrays(1, 256))


def read_blocks(t: Any, source: str, out: list[np.ndarray] | None = None
                ) -> Q4Blocks | Q8Blocks:
    """A quantized GGUF matrix of a type in `torchllama.blocks.TYPES` as its kernel form,
    exactly as stored: converted from the file mapping straight into the arrays of the result
    (`convert_blocks`), then its block scales checked (a non-finite f16 d, m or dmin in the file
    is the only way one of them can be non-finite).

    Args:
        out: the arrays to convert into (its type's `arrays` of its shape, e.g. rows of a
            larger one); new ones by default.

    Raises:
        ModelFileError: data cut short, or a block scale that is not finite (naming the tensor).
    """
    kind = block_type(t.tensor_type)
    b = _stored_blocks(t, source)                                           # (rows, blocks)
    out = kind.arrays(b.shape[0], int(t.shape[0])) if out is None else out
    _convert_checked(t, b, out, source)
    return kind.weight(out)


def _stored_blocks(t: Any, source: str) -> np.ndarray:
    """A quantized matrix's blocks as stored: (rows, blocks) of its type's block dtype, a view
    of the file mapping (3-D: experts' rows one after another).

    Raises:
        ModelFileError: data cut short (naming the tensor)."""
    rows = int(np.prod([int(d) for d in t.shape[1:]]))
    try:
        return np.asarray(t.data).reshape(rows, -1).view(block_type(t.tensor_type).block)
    except ValueError as e:
        raise ModelFileError(f"{source}: tensor {t.name!r}: data cut short or damaged ({e})") from e


def _convert_checked(t: Any, b: np.ndarray, out: list[np.ndarray], source: str) -> None:
    """`convert_blocks` of rows `b` of tensor `t` into `out`.

    Raises:
        ModelFileError: a block scale that is not finite (naming the tensor)."""
    n = convert_blocks(b, t.tensor_type, out)
    if n:
        raise ModelFileError(f"{source}: tensor {t.name!r} ({t.tensor_type.name}) has {n} block "
                             "scale(s) that are not finite numbers: the file is damaged")


def _quantized(t: Any, quant, source: str, no_kernel: set):
    """A quantized GGUF matrix as `Q4Blocks` / `Q8Blocks`, or None to load it as float.

    quant="auto": the file's own blocks for the types our kernels take (`torchllama.blocks.TYPES`);
    float matrices and other types load as float (their type is added to
    `no_kernel`, which the caller reports in one line). A `Scheme`: the file's blocks when they
    are already that scheme (a type of the Q4 form for int4 with G = 32, Q8_0 for int8), otherwise
    dequantized by the `gguf` library and quantized (`torchllama.transforms.quantize.quantize_weight`).
    """
    typ, kind = t.tensor_type, block_type(t.tensor_type)
    if quant == "auto":
        if kind is not None:
            return read_blocks(t, source)
        if typ in _HALF_TYPES and len(t.shape) == 2:
            return _half_matrix(t, source)
        if typ not in _FLOAT_TYPES:
            no_kernel.add(typ.name)
        return None
    if (kind is not None and kind.form == "q4" and not kind.high and quant == Scheme(4, 32)) or \
            (typ == gguf.GGMLQuantizationType.Q8_0 and quant == Scheme(8)):
        return read_blocks(t, source)
    return quantize_weight(_dequantize(t, source).reshape(-1, int(t.shape[0])), quant)


#: Float types whose matrices `dtype="auto"` keeps as stored (`HalfMatrix`, on f32_linear).
_HALF_TYPES = (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def _half_matrix(t: Any, source: str) -> HalfMatrix | None:
    """An F16 / BF16 matrix as stored (a copy out of the file mapping), or None without
    torchllama's kernels (then it loads as float32).

    Raises:
        ModelFileError: data cut short.
    """
    from torchllama import kernels

    if not kernels.available():
        return None
    dtype = torch.float16 if t.tensor_type == gguf.GGMLQuantizationType.F16 else torch.bfloat16
    try:
        raw = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), 2 * int(t.shape[0]))
    except ValueError as e:
        raise ModelFileError(f"{source}: tensor {t.name!r}: data cut short or damaged ({e})") from e
    values = torch.from_numpy(raw.view(np.uint16).copy()).view(dtype)          # (N, K)
    return HalfMatrix(values)


def _scheme_of(w) -> Scheme:
    return Scheme(8) if isinstance(w, Q8Blocks) else Scheme(4, 32)


def _rows_only(layout) -> bool:
    """Whether a layout only reorders or splits rows, so it applies to quantized rows as they
    are (as is, HF's RoPE row order, a fused q/k/v split along rows, experts' matrices stacked
    expert first: llama.cpp's 3-D `ffn_*_exps`, read as one matrix of every expert's rows)."""
    return type(layout) in (Layout, RopePermuted, Stacked) or \
        (isinstance(layout, Fused) and layout.dim == 0 and not layout.transposed)


def _layout_rows(mapping: Mapping, q, args) -> tuple:
    """The mapping's `layout.load` applied to the rows of a quantized weight: a stacked one
    (`Stacked`) split into its experts' matrices (views of one block weight, no copy)."""
    layout = mapping.layout
    if isinstance(layout, Fused):
        return q.split_rows(layout.sizes(args))
    if isinstance(layout, Stacked):
        return q.split_rows([q.shape[0] // len(mapping.ours)] * len(mapping.ours))
    return (q.map_rows(lambda x: layout.load(x, args)[0]),)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

# Tensor types we write: float types, and Q8_0, Q5_0, Q5_1, Q4_0 or Q4_1 for the matrices (norms
# stay F32, as llama.cpp), quantized by the `gguf` library (the types it quantizes).
WRITE_TYPES = {name: gguf.GGMLQuantizationType[name]
               for name in ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1")}

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


def written_mappings(mappings: list[Mapping]) -> list[Mapping]:
    """The mappings a GGUF file is written with: a tensor several rows hold (DeepSeek's wkv_b,
    as attn_k_b + attn_v_b parts and as a whole attn_kv_b) by the first of them only."""
    out, written = [], set()
    for m in mappings:
        if not isinstance(m.layout, Part) and all(n in written for n in m.ours):
            continue
        written.update(m.ours)
        out.append(m)
    return out


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
    """Write our model as a llama.cpp GGUF file, in the GGUF architecture of its family.

    Hyperparameters go to `{arch}.*` metadata (the family's `gguf_metadata`), the tokenizer to
    `tokenizer.*`, tensors under the family's GGUF names and layouts (Llama: q/k as they are,
    GGUF uses Meta's interleaved RoPE layout; Qwen2: HF's rotate_half rows; GPT-2: fused q/k/v;
    DeepSeek: wkv_b as attn_k_b + attn_v_b), plus what the family's `gguf_metadata` adds
    (Llama 3.1's rope_freqs). A tied output projection is not written (llama.cpp ties when
    `output` is absent).

    Args:
        model: a `Transformer`.
        tokenizer_fields: GGUF `tokenizer.*` keys → values (`Tokenizer.gguf_fields()`).
        path: output file; written directly (callers write to a temporary path and rename).
        qtype: 'F32', 'F16', 'BF16', 'Q8_0', 'Q5_0', 'Q5_1', 'Q4_0' or 'Q4_1' for the
            matrices (quantized with the `gguf` library); 1-D norms are always F32.
        name: general.name.
        progress: show a progress bar.

    Raises:
        ArgumentError: unknown qtype, or a model no GGUF architecture can hold.
    """
    from tqdm import tqdm

    if qtype not in WRITE_TYPES:
        raise ArgumentError(f"GGUF tensor type {qtype!r} is not supported for writing; "
                            f"use one of {', '.join(WRITE_TYPES)}")
    args = model.args
    family = family_for_args(args, "gguf")
    writer = gguf.GGUFWriter(os.fspath(path), family.gguf_architecture)
    writer.add_name(name)
    family.gguf_metadata(writer, args)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else
                         gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    for key, value in tokenizer_fields.items():
        if key == "tokenizer.ggml.add_space_prefix":
            writer.add_bool(key, bool(value))
        elif value is not None and key in _TOKENIZER_WRITERS:
            getattr(writer, _TOKENIZER_WRITERS[key])(value)

    try:
        state = model.state_dict()
        if args.tie_embeddings:
            state.pop("output.weight", None)
        mappings = written_mappings(family.mappings("gguf", args.n_layers, set(state)))
        for m in tqdm(mappings, desc="writing GGUF", unit="tensor", disable=not progress,
                      leave=False):
            tensor = m.layout.save(tuple(state[n].detach() for n in m.ours), args)
            t = gguf_tensor_type(tensor.shape, qtype)
            data = tensor.float().contiguous().numpy()
            if t == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(m.theirs, data)
            elif t == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(m.theirs, data.astype(np.float16))
            else:
                writer.add_tensor(m.theirs, gguf.quants.quantize(data, t), raw_dtype=t)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
    finally:
        writer.close()


# ---------------------------------------------------------------------------------------------
# Which kernel each tensor runs on (`torchllama info`)
# ---------------------------------------------------------------------------------------------

@dataclass
class TensorPlan:
    """How `dtype="auto"` runs one GGUF tensor: its name, GGML type, shape (ggml order), bytes
    in the file, and where its products run."""

    name: str
    type: str
    shape: tuple[int, ...]
    n_bytes: int
    runs_on: str


def kernel_plan(path: str | os.PathLike) -> list[TensorPlan]:
    """Every tensor of a GGUF file with where `torchllama.load(path)` (dtype "auto") runs it,
    from the tensor list alone (no weights read): a type of `torchllama.blocks.TYPES` on its
    kernel (e.g. "q4_rows, avx512_vnni: 5-bit codes"), float matrices on f32_linear, vectors as
    float32, any other quantized type "dequantized (no kernel)". Without torchllama's kernels
    the block types name torch's int4/int8 fallback.

    Raises:
        ModelFileError: as `open_gguf`.
    """
    from torchllama import kernels

    reader = open_gguf(path)
    levels = kernels.kernel_levels() if kernels.available() else {}
    plans = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in t.shape)
        kind = block_type(t.tensor_type)
        if len(shape) == 1:
            runs_on = "float32 vector"
        elif kind is not None:
            runs_on = (f"{kind.kernel} ({levels[kind.kernel]}): {kind.storage}" if levels else
                       "torch's int4/int8 kernels (torchllama's kernels unavailable)")
        elif t.tensor_type in _FLOAT_TYPES:
            kept = "as stored" if t.tensor_type in _HALF_TYPES else "float32"
            runs_on = (f"f32_linear ({levels['linear_rows']}): {kept}" if levels else
                       "torch's float32 matmul")
        else:
            runs_on = "dequantized to float32 (no kernel for this type)"
        plans.append(TensorPlan(t.name, t.tensor_type.name, shape, int(t.n_bytes), runs_on))
    return plans
