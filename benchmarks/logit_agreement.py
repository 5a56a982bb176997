"""The same GGUF file in torchllama and in llama.cpp, per quantization type: logits and top-1
tokens over a few hundred positions (issue 49's agreement target: every type on our kernels
agrees with llama.cpp as the existing ones do).

Files: `torchllama bench shapes`' random-weight files (`torchllama.bench.shapes`: llama.cpp's
mixes of each type at the shape, SmolLM2's vocabulary). For each: ours on the file's blocks
(`dtype="auto"`, our kernels: int8 activations per 32) against llama.cpp (llama-cpp-python,
`make bench-peer`, flash attention off): max and mean |Δlogit|, top-1 agreement; and llama.cpp
with flash attention on against off, the same weights and activation rounding in another
summation order: how far llama.cpp moves from itself (the floor the target is measured at).
With `--float`, the exact float32 computation of the same weights (ours, dequantized) against
both: which engine's activation rounding the gap comes from.

    .venv/bin/python benchmarks/logit_agreement.py [--shape 1b] [--types q4_0,q5_k_m,…]
        [--positions 256] [--float]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from moe_agreement import report  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--types", default="q4_0,q4_k_m,q5_k_m,q3_k_m,q2_k,iq4_xs,iq4_nl,q5_1")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--float", action="store_true",
                    help="also our float32 computation of the dequantized weights")
    args = ap.parse_args()
    import torch

    from torchllama.bench.shapes import VOCAB_SIZE, ensure_shape_file
    from torchllama.kernels import isa

    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, kernels {isa()}, "
          f"2 threads, {args.positions} positions of random token ids")
    ids = torch.randint(0, VOCAB_SIZE, (args.positions,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    for qtype in args.types.split(","):
        report(str(ensure_shape_file(args.shape, qtype)), ids, f"{args.shape} {qtype}",
               args.float)


if __name__ == "__main__":
    main()
