"""The roofline of decode: the machine's memory read bandwidth, measured in the process that
measures the engines, and each engine's decode as a fraction of it.

A decode step at batch 1 reads every weight once (the KV cache besides), so bytes per token ×
tokens per second is the bandwidth an engine draws, and no engine draws more than the memory
gives one reader. That ceiling is measured here, not looked up: by a read kernel as fast as the
CPU reads (`torchllama::read_bytes`, csrc/bandwidth.cpp: the widest loads, several streams a
thread, chunks shared by the threads). `torch.sum` over a fresh tensor reads less (torch's 4 KiB
pages, always all its threads). Without the kernels, numpy's `bitwise_xor.reduce` reads the
buffer instead (slower; `ReadBandwidth.method` says which).

Units: GB is 10⁹ bytes, GB/s 10⁹ bytes per second (as `bytes_per_token` × tokens/s gives).

The figure moves with the machine (on a shared host the other guests share its memory, and a
second thread whose core another process holds starts late), so it is measured in the same
process and near in time to the decode it divides, on huge pages like the packed weights, and
each pass tries one thread and all of torch's; the best pass counts (`torchllama bench shapes`
prints it beside each engine's fraction).
"""

from __future__ import annotations

import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

#: Bytes read per pass by default: far beyond any last-level cache (32 MiB here).
DEFAULT_BYTES = 1 << 30
LEVELS = {0: "scalar 64-bit", 1: "AVX2 32-byte", 2: "AVX-512 64-byte"}


@dataclass
class ReadBandwidth:
    """One `measure_read_bandwidth`: every timed pass and the best.

    Attributes:
        best_gbs: the fastest pass, GB/s (10⁹ bytes/s): the machine's read bandwidth.
        passes_gbs: every timed pass's GB/s, in the order taken.
        pass_threads: the threads of each pass (same order).
        bytes: bytes read per pass.
        threads: the threads of the fastest pass.
        method: what read the bytes (the kernel and its loads, or numpy's fallback).
    """
    best_gbs: float
    passes_gbs: list[float] = field(default_factory=list)
    pass_threads: list[int] = field(default_factory=list)
    bytes: int = 0
    threads: int = 1
    method: str = ""

    def summary(self) -> str:
        """One line for a report, e.g. 'memory read bandwidth 83.2 GB/s (best of 10 passes
        over 1.07 GB, 2 threads; torchllama::read_bytes, AVX-512 64-byte loads)'."""
        return (f"memory read bandwidth {self.best_gbs:.1f} GB/s (best of "
                f"{len(self.passes_gbs)} passes over {self.bytes / 1e9:.2f} GB, {self.threads} "
                f"thread{'s' if self.threads > 1 else ''}; {self.method})")


def _read_op():
    """`torch.ops.torchllama.read_bytes` where the kernels are built with it, else None (the
    kernels are imported here: building them takes a minute, and the fallback needs none)."""
    from torchllama import kernels

    if kernels.available() and hasattr(torch.ops.torchllama, "read_bytes"):
        return torch.ops.torchllama.read_bytes
    return None


def _allocate(size_bytes: int) -> torch.Tensor:
    """(size_bytes,) uint8 on the memory the packed weights live on (transparent huge pages
    where the system gives them: `kernels.huge_pages`), every page written: a page never
    written reads as the kernel's shared zero page, from cache, and would give a fake figure."""
    from torchllama.kernels import huge_pages

    buf = huge_pages.empty((size_bytes,), torch.uint8)
    buf.fill_(0x5A)
    return buf


def _numpy_reader(buf: torch.Tensor, pool: ThreadPoolExecutor):
    """A function(threads) reading buf's whole 64-bit words by numpy's `bitwise_xor.reduce`,
    split over `threads` pool threads (numpy's reductions release the GIL)."""
    words = buf.numpy()[:buf.numel() // 8 * 8].view(np.uint64)

    def read(threads: int) -> int:
        parts = np.array_split(words, threads)
        x = 0
        for part in pool.map(np.bitwise_xor.reduce, parts):
            x ^= int(part)
        return x

    return read


def measure_read_bandwidth(size_bytes: int = DEFAULT_BYTES, passes: int = 5,
                           threads: int | None = None) -> ReadBandwidth:
    """The machine's memory read bandwidth: the best of `passes` timed reads of a buffer of
    `size_bytes`, by `torchllama::read_bytes` where the kernels are available, else numpy.

    The buffer is allocated once, written (so its pages exist), read once untimed (threads
    started, pages mapped), then read `passes` times per thread count, the thread counts
    interleaved within each pass; it is freed before returning.

    Args:
        size_bytes: bytes per pass (default 1 GiB: far beyond the last-level cache; a buffer
            that fits in cache measures the cache).
        passes: timed passes per thread count.
        threads: reading threads; None tries both 1 and `torch.get_num_threads()` in every pass
            and keeps the best (where another process holds a core, one thread alone reads
            faster than two that wait for it). At most torch's thread count run at once.

    Returns:
        A `ReadBandwidth` (GB/s = 10⁹ bytes/s).

    Raises:
        ValueError: size_bytes < 8, passes < 1 or threads < 1.
    """
    if size_bytes < 8 or passes < 1 or (threads is not None and threads < 1):
        raise ValueError(f"size_bytes ≥ 8, passes ≥ 1 and threads ≥ 1 needed, got "
                         f"{size_bytes}, {passes}, {threads}")
    counts = ([threads] if threads is not None
              else sorted({1, max(1, torch.get_num_threads())}))
    op = _read_op()
    buf = _allocate(size_bytes)
    pool, read = None, None
    try:
        if op is not None:
            read = functools.partial(op, buf)                        # read(threads)
            nbytes = size_bytes
            method = (f"torchllama::read_bytes, "
                      f"{LEVELS[int(torch.ops.torchllama.read_level())]} loads")
        else:
            pool = ThreadPoolExecutor(max(counts))
            read = _numpy_reader(buf, pool)
            nbytes = size_bytes // 8 * 8
            method = "numpy bitwise_xor.reduce of uint64 words (kernels unavailable)"
        for t in counts:
            read(t)                                                  # untimed warm-up
        rates, used = [], []
        for _ in range(passes):
            for t in counts:
                start = time.perf_counter()
                read(t)
                seconds = time.perf_counter() - start
                rates.append(nbytes / seconds / 1e9)
                used.append(t)
    finally:
        if pool is not None:
            pool.shutdown()
        buf = read = None                  # the last references: the buffer is unmapped here
    best = max(range(len(rates)), key=rates.__getitem__)
    return ReadBandwidth(best_gbs=rates[best], passes_gbs=rates, pass_threads=used,
                         bytes=nbytes, threads=used[best], method=method)


def decode_fraction(bytes_per_token: float, tokens_per_s: float, bandwidth_gbs: float) -> float:
    """The share of the memory read bandwidth a decode draws: bytes_per_token × tokens_per_s
    over bandwidth_gbs × 10⁹ (1.0: the decode reads as fast as the read kernel).

    Args:
        bytes_per_token: bytes read per decoded token (the weights', plus the KV cache's where
            the caller counts it), bytes.
        tokens_per_s: decoded tokens per second (at batch B: steps per second, since a step
            reads the weights once for all B rows).
        bandwidth_gbs: the read bandwidth, GB/s (`ReadBandwidth.best_gbs`).

    Raises:
        ValueError: bandwidth_gbs not positive and finite.
    """
    if not (bandwidth_gbs > 0 and math.isfinite(bandwidth_gbs)):
        raise ValueError(f"bandwidth_gbs must be positive and finite, got {bandwidth_gbs}")
    return bytes_per_token * tokens_per_s / (bandwidth_gbs * 1e9)


def _product_modules(model) -> list:
    """The modules a decode step multiplies by, one per weight storage: block linears and float
    linears (a fused q/k/v or gate/up module rather than its parts, which are views of it), the
    output projection included; embeddings, which a step reads one row of, left out."""
    from torch import nn

    from torchllama.blocks.linear import BlockLinear
    from torchllama.nn.linear import Linear

    chosen: dict[int, object] = {}
    for module in model.modules():
        if isinstance(module, BlockLinear):
            key, rows = module.codes.untyped_storage().data_ptr(), module.out_features
        elif isinstance(module, (nn.Linear, Linear)) and module.weight.device.type != "meta":
            key, rows = module.weight.untyped_storage().data_ptr(), module.weight.shape[0]
        else:
            continue
        if key not in chosen or rows > chosen[key][0]:
            chosen[key] = (rows, module)
    return [module for _, module in chosen.values()]


def weight_bytes_per_token(model) -> int:
    """Bytes of the weights one decode step reads (the `_product_modules`' tensors, each
    storage once, by their elements: a huge-page mapping's alignment slack is address space,
    never read): the numerator of `decode_fraction` for our model."""
    seen, total = set(), 0
    for module in _product_modules(model):
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            key = t.untyped_storage().data_ptr()
            if key not in seen and t.dim() > 0:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def gguf_bytes_per_token(path) -> int:
    """Bytes of a GGUF file's weights a decode step reads: every matrix but an untied token
    embedding (of which a step reads one row): llama.cpp's numerator of `decode_fraction`."""
    from torchllama.checkpoint.gguf import open_gguf

    reader = open_gguf(path)
    names = {t.name for t in reader.tensors}
    return sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) > 1 and not (
        t.name == "token_embd.weight" and "output.weight" in names))


@torch.inference_mode()
def product_seconds(model, passes: int = 5) -> float:
    """Seconds of one pass over every `_product_modules` product at one activation row (the
    products of a batch-1 decode step, each weight streamed once, in model order), best of
    `passes`: the step's time minus this is its non-product time (attention, norms, dispatch,
    Python)."""
    modules = _product_modules(model)
    inputs = [torch.randn(1, getattr(m, "in_features", None) or m.weight.shape[1])
              for m in modules]
    best = math.inf
    for _ in range(passes + 1):                                       # the first: warm-up
        start = time.perf_counter()
        for module, x in zip(modules, inputs):
            module(x)
        best = min(best, time.perf_counter() - start)
    return best
