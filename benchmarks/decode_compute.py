"""Decode's products: compute-bound or memory-bound? One activation row (a batch-1 decode step's
product) against a weight of each GGUF type, on torchllama's kernels, at three rates in GB/s of
the weight's packed bytes (what the kernel reads), in one process:

- **cache**: a weight whose share per thread fits in L2 (768 KiB a thread), read again and
  again: the rate the kernel's arithmetic allows (unpacking, dot products, the float epilogue)
  when memory costs nothing;
- **memory**: distinct 8192 × 2048 weights, ≥ 1 GiB in all (past any last-level cache), each
  read once a pass, as a decode step reads its layers;
- **read**: the machine's read bandwidth (`bench.roofline.measure_read_bandwidth`, the figure
  `torchllama bench shapes` divides by).

Each product's fixed cost (the Python call, quantizing the row, waking the threads: the time of a
64-row product) is subtracted from both kernel rates, best of many calls. Where cache is not far
above read, the arithmetic and the memory take turns rather than overlapping, and memory stays
below read however the loads are scheduled.

    .venv/bin/python benchmarks/decode_compute.py [--types Q4_0,Q4_K,...] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

from block_products import random_linear

K = 2048                       # the 1B shape's hidden size
CACHE_BYTES_PER_THREAD = 768 << 10


def best_seconds(calls, x, rounds: int) -> float:
    """Best time of one pass over `calls` (each applied to x), divided by len(calls)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for linear in calls:
            linear(x)
        best = min(best, (time.perf_counter() - start) / len(calls))
    return best


def rates(name: str, threads: int, stream_bytes: int, rng) -> tuple[float, float]:
    """(cache GB/s, memory GB/s) of one activation row against type `name`'s weights."""
    import torch

    from torchllama.bench.roofline import weight_bytes_per_token as packed_bytes

    x = torch.randn(1, K)
    tiny = random_linear(name, 64, K, rng)
    row_bytes = packed_bytes(tiny) / 64
    n_hot = max(64, int(CACHE_BYTES_PER_THREAD * threads / row_bytes) // 64 * 64)
    hot = random_linear(name, n_hot, K, rng)
    fixed = best_seconds([tiny], x, 300)
    cache = packed_bytes(hot) / (best_seconds([hot], x, 300) - fixed) / 1e9
    first = random_linear(name, 8192, K, rng)
    count = max(2, -(-stream_bytes // packed_bytes(first)))
    weights = [first] + [random_linear(name, 8192, K, rng) for _ in range(count - 1)]
    best_seconds(weights, x, 1)                                          # pages touched
    memory = packed_bytes(first) / (best_seconds(weights, x, 5) - fixed) / 1e9
    return cache, memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_0,Q4_K,Q5_K,IQ4_XS,Q6_K,Q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stream-gib", type=float, default=1.0,
                    help="GiB of distinct weights a memory pass reads")
    args = ap.parse_args()
    import numpy as np
    import torch

    from torchllama import blocks, kernels

    known = {t.name for t in blocks.TYPES}
    unknown = [name for name in args.types.split(",") if name not in known]
    if unknown:
        ap.error(f"--types: no block kernel for {', '.join(unknown)}; "
                 f"one of {', '.join(sorted(known))}")
    from torchllama.bench.roofline import measure_read_bandwidth

    torch.set_num_threads(args.threads)
    read = measure_read_bandwidth(threads=args.threads).best_gbs
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, kernels {kernels.isa()}, "
          f"{args.threads} threads, K = {K}; read bandwidth {read:.1f} GB/s")
    print("| type | cache GB/s | memory GB/s | cache / read | memory / read |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name in args.types.split(","):
        cache, memory = rates(name, args.threads, int(args.stream_gib * 2**30), rng)
        print(f"| {name} | {cache:.1f} | {memory:.1f} | {cache / read:.2f} | {memory / read:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
