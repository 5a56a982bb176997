"""The decode products on transparent huge pages against the same products on 4 KiB pages, in
one process, round by round (the shared machine's bandwidth drifts by tens of percent).

The products of a decode step at batch 1 (one activation row) stream their weights from memory
once. Two copies of the same Q4 weights are made: one where torchllama packs them (on 2 MiB
pages, `torchllama.kernels.huge_pages`), one copied onto torch's own memory (4 KiB pages). The
shapes are a Llama 3.2 1B layer's (wqkv 3072 × 2048, wo 2048 × 2048, w13 16384 × 2048, w2
2048 × 8192), `--layers` of them, far more than the last-level cache. Printed per round: the
GB/s of weights each streams and of a 1 GiB `torch.sum` (a plain streaming read), then the
best and median of each and the per-round ratio.

    .venv/bin/python benchmarks/huge_pages.py [--layers 8] [--rounds 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from torchllama import kernels
from torchllama.kernels import huge_pages
from torchllama.blocks.linear import BlockLinear, Q4Linear
from torchllama.blocks.forms import Q4Blocks

LAYER = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]     # (N, K) of a 1B layer


def on_small_pages(linear: BlockLinear) -> BlockLinear:
    """The same module over copies of its buffers on torch's memory (4 KiB pages)."""
    copies = []
    for t in linear.packed():
        c = torch.empty_like(t)
        c.copy_(t)
        copies.append(c)
    return type(linear).from_packed(linear.out_features, linear.in_features, copies)


def anon_huge_bytes() -> int:
    """This process's anonymous memory the kernel backs with huge pages (/proc/self/smaps_rollup
    AnonHugePages): below the weights' size where it found no free 2 MiB of physical memory."""
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def streamed(products: list, nbytes: int) -> float:
    """GB/s of weights one pass over `products` streams (after a warm-up of three)."""
    for linear, x in products[:3]:
        linear(x)
    t0 = time.perf_counter()
    for linear, x in products:
        linear(x)
    return nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.available() or not huge_pages.supported():
        raise SystemExit("needs torchllama's kernels and transparent huge pages "
                         "(Linux, `enabled` always or madvise)")
    g = torch.Generator().manual_seed(0)
    sets: dict[str, list] = {"huge pages": [], "4 KiB pages": []}
    nbytes = 0
    for N, K in LAYER * args.layers:
        blocks = Q4Blocks.from_float(torch.randn(N, K, generator=g) * 0.02)
        linear = Q4Linear(Q4Blocks(blocks.codes, blocks.d.half().float(),
                                   -8 * blocks.d.half().float()))      # Q4_0's scales
        x = torch.randn(1, K)                                           # one activation row
        sets["huge pages"].append((linear, x))
        sets["4 KiB pages"].append((on_small_pages(linear), x))
        nbytes += sum(t.numel() * t.element_size() for t in linear.packed())
    assert all(lin.codes.data_ptr() % huge_pages.HUGE_PAGE == 0 for lin, _ in sets["huge pages"])
    backed = anon_huge_bytes()
    x = torch.ones(256 * 2**20)                                         # 1 GiB float32
    rates: dict[str, list[float]] = {"torch.sum": [], **{name: [] for name in sets}}
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, kernels {kernels.isa()}, "
          f"{args.threads} threads; {nbytes / 1e6:.0f} MB of Q4 weights a pass, "
          f"{backed / 1e6:.0f} MB of this process on huge pages (AnonHugePages)")
    for r in range(args.rounds):
        torch.sum(x)
        t0 = time.perf_counter()
        torch.sum(x)
        rates["torch.sum"].append(x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        for name, products in sets.items():
            rates[name].append(streamed(products, nbytes))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f} GB/s" for k, v in rates.items()))
    for name, v in rates.items():
        print(f"{name:>12}: best {max(v):.1f} GB/s, median {sorted(v)[len(v) // 2]:.1f}")
    ratios = [a / b for a, b in zip(rates["huge pages"], rates["4 KiB pages"])]
    print(f"huge / 4 KiB pages per round: {' '.join(f'{q:.2f}' for q in ratios)} "
          f"(median {sorted(ratios)[len(ratios) // 2]:.2f})")


if __name__ == "__main__":
    main()
