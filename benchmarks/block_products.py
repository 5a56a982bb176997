"""One block product per GGUF type on torchllama's kernels: an N × K weight of random valid blocks
(`torchllama.blocks`' registry) against M activation rows, the best of several runs, in GFLOP/s
(2·M·N·K per product). M = 1 is a decode step's product (the weight, 10–20 MB here, may sit in
the last-level cache: `torchllama bench shapes` measures decode at real sizes); M = 128 and 512
are prefill's.

    .venv/bin/python benchmarks/block_products.py [--types Q4_0,Q4_K,...] [--n 8192] [--k 2048]
        [--threads 2] [--rows 1,128,512]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_0,Q4_K,Q5_K,Q5_1,IQ4_XS,IQ4_NL,Q2_K,Q3_K,Q6_K,Q8_0,Q5_0")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,128,512",
                    help="activation rows M of each product (2-8: batched decode's)")
    args = ap.parse_args()
    import numpy as np
    import torch

    from torchllama import kernels

    torch.set_num_threads(args.threads)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, kernels {kernels.isa()}, "
          f"{args.threads} threads, N = {args.n}, K = {args.k}")
    rng = np.random.default_rng(0)
    N, K = args.n, args.k
    for name in args.types.split(","):
        linear = random_linear(name, N, K, rng)
        cells = []
        for M in (int(v) for v in args.rows.split(",")):
            x = torch.randn(M, K)
            linear(x)                                                   # warm-up
            best = min(_timed(linear, x) for _ in range(50 if M == 1 else 5))
            cells.append(f"M={M}: {2 * M * N * K / best / 1e9:7.1f}")
        print(f"{name:7} " + "  ".join(cells) + " GFLOP/s", flush=True)


def random_linear(name: str, N: int, K: int, rng):
    """An N × K block Linear of GGUF type `name` (e.g. "Q4_K") on the kernels: random valid
    blocks (random bytes, float16 scales drawn in [1e-3, 2e-2]), packed by the registry's
    conversion. Raises KeyError for a type the registry lacks."""
    import numpy as np

    from torchllama import blocks
    from torchllama.transforms.quantize import quantized_linear

    kind = blocks.TYPES[blocks.registry.GGMLType[name]]
    raw = rng.integers(0, 256, (N, K // kind.weights * kind.block.itemsize), dtype=np.uint8)
    b = raw.view(kind.block)
    for field in kind.block.names:
        if kind.block.fields[field][0] == np.float16:
            b[field] = rng.uniform(1e-3, 2e-2, b.shape)
    arrays = kind.arrays(N, K)
    kind.convert(b, arrays)
    return quantized_linear(kind.weight(arrays))


def _timed(linear, x) -> float:
    start = time.perf_counter()
    linear(x)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
