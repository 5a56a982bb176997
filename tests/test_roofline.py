"""bench.roofline and its read kernel (csrc/bandwidth.cpp): the kernel's checksum is numpy's
XOR of the same 64-bit words (so it read every byte, at every level, stream count, thread
split and alignment), the bandwidth figures are positive and finite with the kernel and with
the numpy fallback. No timed assertions: the figures depend on the machine's load."""

import math

import numpy as np
import pytest
import torch

from torchllama import kernels
from torchllama.bench import roofline
from torchllama.kernels import CFLAGS, CSRC, LDFLAGS


@pytest.fixture(scope="module")
def read_bytes(tmp_path_factory):
    """torch.ops.torchllama.read_bytes: the project's build where it has the op, else
    csrc/bandwidth.cpp built alone (a few seconds) into a temporary folder."""
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    if not hasattr(torch.ops.torchllama, "read_bytes"):
        from torch.utils import cpp_extension

        cpp_extension.load(name="tl_bandwidth_test", sources=[str(CSRC / "bandwidth.cpp")],
                           extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                           build_directory=str(tmp_path_factory.mktemp("bandwidth")),
                           is_python_module=False, verbose=False)
    return torch.ops.torchllama.read_bytes


def xor_words(a: np.ndarray) -> int:
    """The oracle: XOR of a's little-endian 64-bit words, the last n % 8 bytes zero-padded,
    as a signed int64 (what the op returns)."""
    padded = np.zeros(-(-len(a) // 8) * 8, np.uint8)
    padded[:len(a)] = a
    return int(np.bitwise_xor.reduce(padded.view(np.uint64), initial=np.uint64(0))
               .view(np.int64))


def random_bytes(n: int, offset: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """n random bytes, and a tensor over them starting `offset` bytes into its allocation (an
    address that is not 64-byte aligned for offset 1 or 8)."""
    a = np.random.default_rng(seed).integers(0, 256, n + offset, dtype=np.uint8)
    return a[offset:], torch.from_numpy(a)[offset:]


SIZES = [0, 1, 7, 8, 9, 63, 255, 256, 257, 4095, 4097, 65536 + 13, (1 << 20) + 4100,
         (9 << 20) + 777]                       # the last: more than two 4 MiB chunks


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 1, 8])
def test_checksum_is_numpys_xor_at_every_setting(read_bytes, n, offset):
    a, t = random_bytes(n, offset, seed=n)
    want = xor_words(a)
    assert read_bytes(t) == want                                   # the defaults
    for level in (0, 1, 2, -1):                                    # capped at the CPU's
        for streams in (1, 2, 4, 8):
            for nt in (False, True):
                for threads, chunk in ((1, 0), (2, 0), (3, 0), (2, 4096), (3, 1 << 20)):
                    got = read_bytes(t, threads, streams, 512 * streams, nt, level, chunk)
                    assert got == want, (level, streams, nt, threads, chunk)


def test_every_byte_counts(read_bytes):
    """One byte changed anywhere (first, last, across stream, chunk and thread boundaries)
    changes the checksum by exactly its bits."""
    n = (9 << 20) + 77
    a, t = random_bytes(n, 0, seed=1)
    base = xor_words(a)
    for i in (0, 1, 255, 256, 4095, 4096, n // 4, n // 2 - 1, n // 2, 4 << 20, n - 78, n - 1):
        old = t[i].item()
        t[i] = old ^ 0x81
        delta = 0x81 << (8 * (i % 8))
        want = np.array([base], np.int64).view(np.uint64)[0] ^ np.uint64(delta)
        try:
            for threads in (1, 2):
                assert read_bytes(t, threads) == int(want.view(np.int64)), (i, threads)
        finally:
            t[i] = old


def test_read_bytes_rejects_bad_input(read_bytes):
    with pytest.raises(RuntimeError, match="uint8"):
        read_bytes(torch.zeros(16, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="contiguous"):
        read_bytes(torch.zeros(16, 2, dtype=torch.uint8).t())
    with pytest.raises(RuntimeError, match="streams"):
        read_bytes(torch.zeros(16, dtype=torch.uint8), 1, 3)


def test_read_level_is_a_level(read_bytes):
    assert int(torch.ops.torchllama.read_level()) in roofline.LEVELS


def _check(bw: roofline.ReadBandwidth, passes: int, size: int) -> None:
    assert bw.best_gbs > 0 and math.isfinite(bw.best_gbs)
    assert bw.best_gbs == max(bw.passes_gbs)
    assert all(r > 0 and math.isfinite(r) for r in bw.passes_gbs)
    counts = sorted(set(bw.pass_threads))
    assert len(bw.passes_gbs) == len(bw.pass_threads) == passes * len(counts)
    assert bw.threads in counts and size - 8 < bw.bytes <= size
    assert "GB/s" in bw.summary()


def test_measure_with_the_kernel(read_bytes):
    bw = roofline.measure_read_bandwidth(16 << 20, passes=2)
    _check(bw, 2, 16 << 20)
    assert "read_bytes" in bw.method
    assert set(bw.pass_threads) == {1, max(1, torch.get_num_threads())}
    bw = roofline.measure_read_bandwidth((4 << 20) + 3, passes=1, threads=2)
    _check(bw, 1, (4 << 20) + 3)
    assert bw.pass_threads == [2]


def test_measure_falls_back_to_numpy_without_kernels(monkeypatch):
    monkeypatch.setenv("TORCHLLAMA_KERNELS", "0")
    assert not kernels.available()
    bw = roofline.measure_read_bandwidth(8 << 20, passes=2)
    _check(bw, 2, 8 << 20)
    assert "numpy" in bw.method
    bw = roofline.measure_read_bandwidth((2 << 20) + 5, passes=1, threads=2)
    _check(bw, 1, (2 << 20) + 5)
    assert bw.bytes == (2 << 20) and bw.threads == 2


def test_numpy_reader_is_the_xor_of_the_words():
    a, t = random_bytes((1 << 20) + 13, 0, seed=2)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        read = roofline._numpy_reader(t, pool)
        want = xor_words(a[:len(a) // 8 * 8]) & ((1 << 64) - 1)
        assert read(1) == read(3) == want


def test_measure_rejects_bad_arguments():
    for args in ((4, 1), (1 << 20, 0), (1 << 20, 1, 0)):
        with pytest.raises(ValueError):
            roofline.measure_read_bandwidth(*args)


def test_decode_fraction():
    # 1 GB per token at 40 tokens/s draws 40 GB/s: half of 80 GB/s
    assert roofline.decode_fraction(1e9, 40.0, 80.0) == pytest.approx(0.5)
    assert roofline.decode_fraction(0.0, 40.0, 80.0) == 0.0
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            roofline.decode_fraction(1e9, 40.0, bad)
