"""kernels.huge_pages: the packed block weights on transparent huge pages (Linux),
checked against what the kernel reports for the process's own mappings (/proc/self/smaps)."""

import gc
import os
import subprocess
import sys

import pytest
import torch

from torchllama.kernels import huge_pages
from torchllama.blocks.forms import Q4Blocks
from torchllama.blocks.linear import Q4Linear
from torchllama.blocks.packing import pack_rows

needs_thp = pytest.mark.skipif(not huge_pages.supported(),
                               reason="no transparent huge pages here (not Linux, or `never`)")


def mapping_of(address: int) -> dict | None:
    """The /proc/self/smaps entry (field → value) of the mapping holding `address`, or None."""
    entry = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            if entry is not None:
                return entry
            entry = {"range": (lo, hi)} if lo <= address < hi else None
        elif entry is not None and ":" in line:
            key, value = line.split(":", 1)
            entry[key] = value.strip()
    return entry


@needs_thp
def test_empty_is_aligned_advised_and_mapped_while_a_view_lives():
    t = huge_pages.empty((3, 1 << 20), torch.float32)                  # 12 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert mapping_of(t.data_ptr())["THPeligible"] == "1"
    # the last, partial huge page is left on small pages (a whole 2 MiB would be backed)
    u = huge_pages.empty(((5 << 20) // 4,), torch.float32)              # 2.5 huge pages
    assert mapping_of(u.data_ptr())["THPeligible"] == "1"
    assert mapping_of(u.data_ptr() + (4 << 20))["THPeligible"] == "0"
    view = t[1]                                                         # the mapping lives on
    address = t.data_ptr()
    del t
    gc.collect()
    view.fill_(2.5)
    assert view.sum().item() == 2.5 * (1 << 20)
    assert mapping_of(address) is not None
    del view
    gc.collect()
    assert mapping_of(address) is None                                  # unmapped with it


@needs_thp
def test_adopt_moves_large_tensors_only_and_keeps_their_values():
    big = torch.randn(1024, 1024)                                       # 4 MiB on torch's heap
    assert big.data_ptr() % huge_pages.HUGE_PAGE != 0
    moved = huge_pages.adopt(big)
    assert moved.data_ptr() % huge_pages.HUGE_PAGE == 0 and torch.equal(moved, big)
    assert huge_pages.adopt(moved) is moved                            # already there
    small = torch.randn(64, 64)
    assert huge_pages.adopt(small) is small


@needs_thp
def test_packed_weights_are_on_huge_pages():
    w = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))
    linear = Q4Linear(Q4Blocks.from_float(w))                           # codes: 2 MiB
    assert linear.codes.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert mapping_of(linear.codes.data_ptr())["THPeligible"] == "1"
    # the packed layout is the plain permuted copy's, bit for bit
    codes = Q4Blocks.from_float(w).codes
    G = codes.shape[0] // 8
    expected = codes.reshape(G, 8, 32, 4, 4).permute(0, 2, 3, 1, 4).reshape(G, 32, 128)
    assert torch.equal(pack_rows(codes, 32, 4), expected)


@needs_thp
def test_fused_projections_copied_together_are_on_huge_pages():
    """Parts packed apart (not side by side in one buffer) are copied into the fused
    product's buffer, which is streamed as theirs were: on huge pages too (an OLMoE file's
    q, k, v were fused onto 4 KiB pages)."""
    from torchllama import kernels
    from torchllama.transforms.fuse import fuse_rows

    if not kernels.available():
        pytest.skip("needs torchllama's kernels")
    g = torch.Generator().manual_seed(1)
    parts = [Q4Linear(Q4Blocks.from_float(torch.randn(n, 1024, generator=g))) for n in (4096, 2048)]
    fused = fuse_rows(parts)
    assert fused.codes.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert mapping_of(fused.codes.data_ptr())["THPeligible"] == "1"
    x = torch.randn(3, 1024, generator=g)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_the_environment_turns_them_off():
    code = ("import torch; from torchllama.kernels import huge_pages as h; "
            "t = h.empty((4 << 20,), torch.uint8); "
            "print(h.supported(), t.data_ptr() % h.HUGE_PAGE == 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TORCHLLAMA_HUGE_PAGES": "0"}, check=True)
    assert out.stdout.split() == ["False", "False"]


@needs_thp
def test_small_pages_holds_for_its_thread_only_and_loaded_modules_end_on_huge_pages():
    """Scratch tensors made within `small_pages` (a chunk's packing on its way into a module)
    are torch's; another thread's, and those made after it, are on huge pages; a module packed
    a chunk at a time (`pack_in_chunks`) has its buffers on huge pages."""
    import threading

    from torchllama import blocks, kernels
    from torchllama.blocks.chunked import pack_in_chunks

    elsewhere = []
    with huge_pages.small_pages():
        inside = huge_pages.empty((4 << 20,), torch.uint8)
        thread = threading.Thread(
            target=lambda: elsewhere.append(huge_pages.empty((4 << 20,), torch.uint8)))
        thread.start()
        thread.join()
    after = huge_pages.empty((4 << 20,), torch.uint8)
    assert inside.data_ptr() % huge_pages.HUGE_PAGE != 0
    assert elsewhere[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert after.data_ptr() % huge_pages.HUGE_PAGE == 0
    if not kernels.available():
        return
    import gguf
    import numpy as np

    kind = blocks.TYPES[gguf.GGMLQuantizationType.Q4_0]
    rng = np.random.default_rng(0)
    b = rng.integers(0, 256, (4096, 32 * kind.block.itemsize), dtype=np.uint8).view(kind.block)
    b["d"] = np.float16(0.01)
    whole, = pack_in_chunks(kind, 1024, [4096], lambda _, a, e, out: kind.convert(b[a:e], out),
                            rows=512)[:1]
    assert whole.codes.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert mapping_of(whole.codes.data_ptr())["THPeligible"] == "1"
