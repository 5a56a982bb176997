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
from moe_agreement import parse_common, random_ids, report  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--types", default="q4_0,q4_k_m,q5_k_m,q3_k_m,q2_k,iq4_xs,iq4_nl,q5_1")
    args = parse_common(ap)
    from torchllama.bench.shapes import ensure_shape_file
    from torchllama.kernels import isa

    ids = random_ids(args.positions, f", kernels {isa()}")
    for qtype in args.types.split(","):
        report(str(ensure_shape_file(args.shape, qtype)), ids, f"{args.shape} {qtype}",
               args.float)


if __name__ == "__main__":
    main()
