"""GGUF load time and peak memory, ours against llama.cpp: from the load call to the end of a
one-token forward, each run in a fresh process, the file already in the page cache.

Ours: `torchllama.load(path)` (the default path: the file's own blocks on torchllama's
kernels), then a cached one-token forward. llama.cpp (llama-cpp-python): `Llama(path,
n_ctx=512, n_threads=T)` then `eval` of one token. Peak RSS: the child's
`resource.getrusage(RUSAGE_SELF).ru_maxrss` (file pages of a memory-mapped model count once
touched). Printed per file and engine: best and spread of the runs, the peak RSS, the load
average seen, and the CPU capability.

    .venv/bin/python benchmarks/gguf_load.py FILE.gguf [FILE.gguf ...] [--runs 3] [--threads 2]

Issue 28's target: 7B Q4_0 loads to its first forward in ≤ 2x llama.cpp's time, with a peak
RSS ≤ llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
engine, path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
if engine == "torchllama":
    import torch, torchllama
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model, _ = torchllama.load(path)
    with torch.inference_mode():
        model.setup_caches(1, 8)
        model(torch.tensor([[100]]), 0)
else:
    import llama_cpp
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=512, n_threads=threads, verbose=False)
    llm.eval([100])
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def measure(engine: str, path: Path, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, engine, str(path), str(threads)],
                         capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    from torchllama import kernels
    from torchllama.bench.shapes_bench import read_through

    kernels.available()            # built (or found built) here: a build is not load time

    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, "
          f"best of {args.runs} fresh processes each")
    print(f"{'file':18}{'engine':12}{'best s':>8}{'spread s':>16}{'peak RSS GB':>13}"
          f"{'load avg':>10}")
    for path in args.files:
        read_through(path)                              # into the page cache
        best = {}
        for engine in ("torchllama", "llama.cpp"):
            runs = [measure(engine, path, args.threads) for _ in range(args.runs)]
            seconds = sorted(r["seconds"] for r in runs)
            best[engine] = seconds[0]
            load = os.getloadavg()[0]
            print(f"{path.name:18}{engine:12}{seconds[0]:8.2f}{seconds[0]:8.2f}–"
                  f"{seconds[-1]:<7.2f}{max(r['rss'] for r in runs) / 1e9:13.2f}{load:10.1f}")
        print(f"{'':18}{'ratio':12}{best['torchllama'] / best['llama.cpp']:8.2f}x llama.cpp's "
              "time")


if __name__ == "__main__":
    main()
