"""torchllama's own CPU kernels: matrix products of GGUF block weights (the types of
torchllama.blocks' registry, in two kernel forms: 4- or 5-bit unsigned codes with a scale and
an offset; int8 codes, stored in 8, 6 or 4 bits, with a scale) with activations quantized to
int8 per block of 32, computed by integer dot products (csrc/blocks.cpp explains the method and its sources).

The C++ source is built once by `torch.utils.cpp_extension` (the system C++ compiler and the
`ninja` package) into a cache folder keyed by the sources, the torch version and the flags:
`$TORCHLLAMA_CACHE/kernels/<key>` (default `~/.cache/torchllama`). The instruction set is
chosen at run time, kernel by kernel (csrc/kernels.h: AVX-512 VNNI for the block products,
AVX-512 F/VL/BW for the float32 ops, AVX2 + FMA, or a scalar path that gives the same bits);
TORCHLLAMA_KERNELS_ISA = scalar | avx2 | avx512 | vnni caps it (the tests force each level).

Where the build is impossible (no compiler, no ninja) or `TORCHLLAMA_KERNELS=0` is set, one
warning is printed and the callers (`torchllama.transforms.quantize`) use torch's own int4/int8 kernels.

Ops, once `available()` returned True (shapes: x (M, K) float32; y (M, N) float32):
    torch.ops.torchllama.q4_linear(x, codes (N/8, K/32, 128) uint8 or (N/8, K/32, 160) (5-bit
                                   codes), d (N/8, K/32, 8), m (same))
    torch.ops.torchllama.q8_linear(x, codes (N/8, K/32, 256) int8 or (N/8, K/32, 192) (6-bit
                                   codes in [−32, 31]) or (N/8, K/32, 128) (4-bit indices),
                                   d (N/8, K/32 or K/16, 8), small (a bool scalar, or the
                                   (16,) int8 table of 4-bit indices))
    (weights in the packed layout: csrc/blocks_impl.h; torchllama.blocks packs them)
    torch.ops.torchllama.pack_six(codes (N, K) int8 in [−32, 31]) → (N/8, K/32, 192): the
        6-bit packed codes in one pass (blocks.packing.pack_six is the readable form)
    torch.ops.torchllama.gguf_blocks(raw (rows, bytes) uint8, GGML type, out arrays) → the count
        of non-finite block scales: a GGUF matrix's blocks from the file's bytes into the
        loader's arrays in place (checkpoint.gguf.convert_blocks; its numpy form the reference)
    torch.ops.torchllama.quantize_act(x) → (q (M, K) int8, d (M, K/32) f32, s (M, K/32) f32)
and the float32 layer ops of csrc/layers.cpp (batch-invariant, see its header):
    torch.ops.torchllama.rms_norm(x (..., D), w (D,), eps, unit_offset) → (..., D)
    torch.ops.torchllama.rope(x (B, T, H, hd), cs (T | B·T, pairs, 2)) → (B, T, H, hd)
    torch.ops.torchllama.attention(q (B, H, T, hd), k (B, KV, S, hd), v (B, KV, S, dv),
                                   mask (T, S) | (B|1, 1, T, S) bool | None, scale, softcap,
                                   key_start (B,) int64 | None: keys visited from that index on,
                                   wrapping — a sliding-window ring oldest slot first)
    torch.ops.torchllama.f32_linear(x (M, K), w (N, K)) → (M, N) = x·wᵀ, w row-major or the
        transpose of a contiguous (K, N) (the loaders' float32 layout): each output the same
        16-lane dot product whatever M, so a row's result is the same bits alone or batched
        (csrc/linear_impl.h; `torchllama.nn.linear.Linear` calls it)
    torch.ops.torchllama.decoder_layer(x (B, T, D), …) → (B, T, D): a whole Llama or Gemma
        layer, or a Mixtral / Qwen3-MoE / OLMoE one (softmax router, stacked experts), with
        block weights, the same kernels in one call (csrc/decoder.cpp)
    torch.ops.torchllama.read_bytes(buf (n,) uint8, threads=0, streams=2, prefetch=0, nt=False,
        level=-1, chunk=4 MiB) → int64 XOR of buf's 64-bit words: the memory read kernel that
        bench.roofline times (csrc/bandwidth.cpp); read_level() → 2 AVX-512, 1 AVX2, 0 scalar
    torch.ops.torchllama.isa() → "scalar", "avx2", "avx512" (F/VL/BW: its block products on
        AVX2), "avx512_vnni", …: one row of csrc/dispatch.cpp's ISAS; isa_names() → every row's
    torch.ops.torchllama.kernel_levels(isa) → ["q4_rows=avx2", …] (see kernel_levels())
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
from pathlib import Path
from typing import Iterator, Optional

try:
    import fcntl
except ImportError:                                   # not POSIX: no build lock
    fcntl = None  # type: ignore[assignment]

import torch

CSRC = Path(__file__).parent / "csrc"
#: kernels.h: the table and the CPU features; dispatch.cpp: the CPU scored once, the table built;
#: arch/*.cpp: one table per instruction set (the *_impl.h SIMD code compiled for it);
#: blocks.cpp, layers.cpp, decoder.cpp: the ATen glue and the ops (ops.h); gguf_blocks.cpp: the
#: GGUF loader's conversion of a matrix's blocks; bandwidth.cpp: the memory read kernel of
#: bench.roofline.
ARCH = tuple(sorted(f"arch/{p.name}" for p in (CSRC / "arch").glob("*.cpp")))
#: types/*.cpp: the GGUF block types' conversions, one file per type family (torchllama.blocks).
TYPES = tuple(sorted(f"types/{p.name}" for p in (CSRC / "types").glob("*.cpp")))
COMPILED = ("dispatch.cpp",) + ARCH + ("blocks.cpp", "layers.cpp", "decoder.cpp",
                                      "gguf_blocks.cpp", "bandwidth.cpp") + TYPES
SOURCES = ("kernels.h", "ops.h", "blocks_impl.h", "layers_impl.h", "linear_impl.h",
           "types/types.h") + COMPILED
#: -ffp-contract=off: no implicit FMA, so every instruction set rounds the same way.
CFLAGS = ("-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_loaded: Optional[bool] = None
_reason: str = ""


def enabled_by_env() -> bool:
    """False when TORCHLLAMA_KERNELS is 0/off/false/no (the tests' switch to torch's kernels)."""
    return os.environ.get("TORCHLLAMA_KERNELS", "1").strip().lower() not in ("0", "off", "false",
                                                                               "no")


#: The built library's name: `build_dir()`/LIBRARY.so.
LIBRARY = "torchllama_blocks"


def build_key() -> str:
    """Hash of the sources, the torch version and the flags: the cache folder's name."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((CSRC / name).read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    root = Path(os.environ.get("TORCHLLAMA_CACHE", Path.home() / ".cache" / "torchllama"))
    return root / "kernels" / build_key()


def _build() -> None:
    import shutil

    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} not found)")
    ninja_dir = _ninja_dir()
    if ninja_dir is None:
        raise RuntimeError("ninja is not installed (pip install ninja)")
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    _say_building(out)
    with _build_lock(out), _path_first(ninja_dir):
        cpp_extension.load(name=LIBRARY, sources=[str(CSRC / name) for name in COMPILED],
                           extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                           build_directory=str(out), is_python_module=False, verbose=False)
    _register_fakes()


def _say_building(out: Path) -> None:
    """One line on a terminal's stderr when the kernels are about to be compiled (not found
    built in `out`): the first load on a machine otherwise sits silent for about a minute.
    Nothing when stderr is not a terminal (a log, a test's capture)."""
    if not (out / f"{LIBRARY}.so").exists() and sys.stderr.isatty():
        print(f"building torchllama's CPU kernels for this machine (once, about a minute; kept "
              f"in {out})", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """Hold `out`/build.lock around cpp_extension.load: an flock, which the OS releases when its
    process dies (even by kill -9). cpp_extension's own `lock` file, on which it waits forever
    while it exists, found while this lock is held was left by a killed build: it is removed.

    Raises:
        OSError: `out` is not writable.
    """
    with open(out / "build.lock", "a") as held:
        if fcntl is not None:
            fcntl.flock(held, fcntl.LOCK_EX)           # one build of `out` at a time
            (out / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(held, fcntl.LOCK_UN)


def _ninja_dir() -> Optional[str]:
    """The folder of the ninja every build runs: the one beside this Python (the `ninja`
    package, a dependency of torchllama), else the first on PATH. Always the same one: two
    versions (a venv's 1.13, a system's 1.11) each read the other's build log as foreign and
    rebuild every file, a minute or more each time the caller's PATH differs."""
    import shutil

    beside = Path(sys.executable).parent / "ninja"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside.parent)
    found = shutil.which("ninja")
    return str(Path(found).parent) if found else None


@contextlib.contextmanager
def _path_first(folder: str) -> Iterator[None]:
    """PATH with `folder` first while the block runs (cpp_extension runs `ninja` from PATH)."""
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = folder + os.pathsep + before
    try:
        yield
    finally:
        os.environ["PATH"] = before


def _register_fakes() -> None:
    """Shapes for torch.compile and the meta device (no data is read)."""
    @torch.library.register_fake("torchllama::q4_linear")
    def _(x, codes, d, m):
        return x.new_empty((x.shape[0], 8 * codes.shape[0]))

    @torch.library.register_fake("torchllama::q8_linear")
    def _(x, codes, d, small=False):
        return x.new_empty((x.shape[0], 8 * codes.shape[0]))

    @torch.library.register_fake("torchllama::q4_linear_experts")
    def _(x, tokens, experts, n_experts, codes, d, m):
        return x.new_empty((tokens.shape[0], 8 * codes.shape[0] // n_experts))

    @torch.library.register_fake("torchllama::q8_linear_experts")
    def _(x, tokens, experts, n_experts, codes, d, small=False):
        return x.new_empty((tokens.shape[0], 8 * codes.shape[0] // n_experts))

    @torch.library.register_fake("torchllama::rms_norm")
    def _(x, w, eps, unit_offset):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("torchllama::rope")
    def _(x, cs):
        return x.new_empty(x.shape)

    @torch.library.register_fake("torchllama::attention")
    def _(q, k, v, mask, scale, softcap, key_start=None):
        B, H, T, _ = q.shape
        return q.new_empty((B, T, H, v.shape[-1])).transpose(1, 2)

    @torch.library.register_fake("torchllama::f32_linear")
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("torchllama::decoder_layer")
    def _(x, *args):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("torchllama::quantize_act")
    def _(x):
        M, K = x.shape
        return (x.new_empty((M, K), dtype=torch.int8), x.new_empty((M, K // 32)),
                x.new_empty((M, K // 32)))


def available() -> bool:
    """Whether the kernels are built and loaded (building them on the first call, ~1 min).

    Never raises: a failed build prints one warning line to stderr (naming the reason) and returns False, and so does
    TORCHLLAMA_KERNELS=0 (silently)."""
    global _loaded, _reason
    if not enabled_by_env():
        return False
    with _lock:
        if _loaded is None:
            try:
                _build()
                _loaded = True
            except Exception as e:                     # noqa: BLE001 — any build failure
                last = (str(e).strip().splitlines() or [""])[-1]
                _loaded, _reason = False, f"{type(e).__name__}: {last}"
                print(f"warning: torchllama's CPU kernels could not be built ({_reason}); "
                      "quantized weights use torch's int4/int8 kernels", file=sys.stderr)
        return _loaded


def layer_ops_apply(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether the float32 layer ops (rms_norm, rope, attention, f32_linear) serve this call: x
    float32 on the CPU, inference (no gradient to track through x or params, no CPU autocast)
    and the kernels available. Training keeps torch's differentiable ops."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return False
    if torch.is_autocast_enabled("cpu"):
        return False
    return _loaded if _loaded is not None else available()


def isa() -> str:
    """The instruction set the kernels run with ('avx512_vnni', 'avx512', 'avx2', 'scalar', …:
    `isa_names()`), or 'none' when they are unavailable."""
    return str(torch.ops.torchllama.isa()) if available() else "none"


def isa_names() -> list[str]:
    """Every instruction set the kernels know (csrc/dispatch.cpp's rows), lowest first. Needs
    the kernels available."""
    return list(torch.ops.torchllama.isa_names())


def kernel_levels(isa_name: Optional[str] = None) -> dict[str, str]:
    """Which instruction set each kernel of the table comes from, for `isa_name` (one of
    `isa_names()`; default: the one in use), e.g. {'q4_rows': 'avx2', 'linear_rows':
    'avx512', …} for 'avx512'. The table is only assembled, so any level can be asked on any
    CPU. Needs the kernels available."""
    return dict(e.split("=") for e in torch.ops.torchllama.kernel_levels(isa_name or isa()))


def unavailable_reason() -> str:
    return _reason or ("disabled by TORCHLLAMA_KERNELS" if not enabled_by_env() else "")
