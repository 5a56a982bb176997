"""Tensors on transparent huge pages (Linux), for what the kernels stream once per token.

A decode step reads every weight once: the 1B shape's 630 MB at batch 1. On 4 KiB pages that
stream crosses a page every 32 Q4 blocks, and the CPU's hardware prefetchers stop at page
boundaries (and each page costs a TLB walk). `benchmarks/huge_pages.py` measures the gain (a
1B layer's decode products, the same weights on both page sizes in one process, round by
round).

The kernel gives an anonymous mapping huge pages when the process asks (`madvise(2)`
MADV_HUGEPAGE) and `/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`
(most distributions' default); it falls back to 4 KiB pages by itself when it has no free
2 MiB of physical memory. So `empty` maps its own memory (Python's `mmap`: one private anonymous
mapping a tensor, aligned to 2 MiB, advised before anything touches it, unmapped when the last
tensor on it is freed; its last, partial huge page left on small pages) and `adopt` moves a
large tensor there. The packed block weights live there (`blocks.packing.pack_rows`,
`pack_rows_six`). The KV caches do not (yet): a cache is backed as its slots fill, on huge pages
2 MiB at a time, which a long `max_seq_len` with short prompts would pay for in memory; not
measured against its gain. Elsewhere (another OS, huge pages `never`, a tensor under 2 MiB, or
`TORCHLLAMA_HUGE_PAGES=0` in the environment when this module is first imported) both return
what torch gives.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

#: The x86-64 transparent huge page (bytes).
HUGE_PAGE = 2 << 20
#: Tensors smaller than this stay on torch's memory (at most one huge page to gain).
MIN_BYTES = 2 << 20


def _thp_mode() -> str:
    """The kernel's transparent huge page setting (`always`, `madvise`, `never`), or "" where
    there is none (not Linux, no THP)."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


_SUPPORTED = (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
              and _thp_mode() in ("always", "madvise")
              and os.environ.get("TORCHLLAMA_HUGE_PAGES", "1") != "0")


_THREAD = threading.local()


@contextmanager
def small_pages() -> Iterator[None]:
    """Within it, `empty` and `adopt` on this thread give torch's memory: for scratch tensors
    made and freed many times (a packed chunk on its way into a module's buffers,
    blocks.chunked), which the allocator then reuses, where fresh huge pages are zeroed by the
    kernel at every first touch (on this project's VMs ~0.5 GB/s: most of a 7B load)."""
    before = getattr(_THREAD, "small", False)
    _THREAD.small = True
    try:
        yield
    finally:
        _THREAD.small = before


def _applies() -> bool:
    return _SUPPORTED and not getattr(_THREAD, "small", False)


def supported() -> bool:
    """Whether `empty` places tensors on huge pages here (Linux, THP `always` or `madvise`,
    and not turned off by `TORCHLLAMA_HUGE_PAGES=0`)."""
    return _SUPPORTED


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of `shape` and `dtype`, on memory advised for
    transparent huge pages and aligned to 2 MiB; `torch.empty(shape, dtype=dtype)` where huge
    pages are not `supported()` or the tensor is under `MIN_BYTES`. The mapping lives as long
    as a tensor viewing it."""
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not _applies() or nbytes < MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    # One huge page more than needed, so the tensor can start on a 2 MiB boundary: the slack is
    # address space only (pages never touched are never backed).
    size = nbytes + HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)     # keeps `region` mapped while it lives
    start = -raw.data_ptr() % HUGE_PAGE
    whole = start + nbytes // HUGE_PAGE * HUGE_PAGE       # the end of the whole huge pages
    region.madvise(mmap.MADV_HUGEPAGE, start, whole - start)
    if whole < size:       # the partial last one on small pages: a whole 2 MiB would be backed
        region.madvise(mmap.MADV_NOHUGEPAGE, whole, size - whole)
    return raw[start:start + nbytes].view(dtype).view(shape)


def adopt(t: torch.Tensor) -> torch.Tensor:
    """`t` copied onto huge pages (`empty`) when that applies (a CPU tensor of at least
    `MIN_BYTES`, huge pages `supported()`, not already on a 2 MiB boundary: `empty`'s tensors
    are, torch's never are — glibc puts a large block 16 bytes past a page), else `t` itself.
    The values, shape and dtype are `t`'s; the copy is contiguous."""
    if (not _applies() or t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES
            or t.data_ptr() % HUGE_PAGE == 0):
        return t
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out
