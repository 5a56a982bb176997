"""Peak memory while loading a checkpoint, per format: is there ever a second copy of the weights?

Writes a random ~1.1B-parameter Llama (the `tinyllama-1.1b` preset: 22 layers, dim 2048, GQA,
Llama 2's 32000-token vocabulary) as a Meta folder, a Hugging Face folder and a GGUF file, then
loads each with `torchllama.load` in a fresh process, reads every weight once (as a first forward
pass would: memory-mapped weights cost memory only once touched), and reports the peak resident
set size (VmHWM, which counts anonymous memory and touched file-mapped pages) against the
weights' size in the target dtype.

    .venv/bin/python benchmarks/load_memory.py [--dtype bfloat16] [--preset tinyllama-1.1b]
        [--formats meta,hf,gguf] [--workdir /tmp/torchllama-load-memory]

Target (issue 3): peak RSS while loading ≤ 1.3 × the weights' bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = REPO.parent / "shared" / "testdata" / "ggml-vocab-llama-spm.gguf"

CHILD = r"""
import json, sys, time
import torch, torchllama
def status(key):  # from /proc/self/status, in bytes
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))
def peak():  # VmHWM: this process's peak resident set (new at exec, unlike ru_maxrss)
    return status("VmHWM")
base = peak()
t0 = time.perf_counter()
model, _ = torchllama.load(sys.argv[1], dtype=sys.argv[2], progress=False)
with torch.no_grad():  # read every weight once, as the first forward pass does: mmapped
    for p in model.parameters():  # weights only count once their pages are touched
        p.sum()
seconds = time.perf_counter() - t0
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"base": base, "peak": peak(), "weights": weights, "seconds": seconds,
                  "anon": status("RssAnon"), "file": status("RssFile")}))
"""


def write_checkpoints(workdir: Path, dtype: str, preset: str, formats: list[str]
                      ) -> dict[str, Path]:
    import torch

    import torchllama
    from torchllama.checkpoint import save

    paths = {"meta": workdir / "meta", "hf": workdir / "hf", "gguf": workdir / "model.gguf"}
    paths = {fmt: p for fmt, p in paths.items() if fmt in formats}
    if all(p.exists() for p in paths.values()):
        return paths
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = torchllama.load_tokenizer(VOCAB)
    args = torchllama.get_preset(preset)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torchllama.Transformer(args)
    model = model.to(getattr(torch, dtype)).to_empty(device="cpu")   # allocate in dtype only
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.tie_weights()
    for fmt, path in paths.items():
        save(model, tokenizer, path, fmt, dtype, force=True, progress=False)
    return paths


def measure(path: Path, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), dtype], capture_output=True,
                         text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--workdir", default="/tmp/torchllama-load-memory")
    parser.add_argument("--preset", default="tinyllama-1.1b")
    parser.add_argument("--formats", default="meta,hf,gguf")
    args = parser.parse_args()
    paths = write_checkpoints(Path(args.workdir) / f"{args.preset}-{args.dtype}", args.dtype,
                              args.preset, args.formats.split(","))
    print(f"random {args.preset} checkpoint, saved and loaded as {args.dtype}")
    print(f"{'format':8}{'weights GB':>12}{'peak RSS GB':>13}{'peak/weights':>14}"
          f"{'(peak-start)/weights':>22}{'anon/file GB after':>20}{'load s':>8}")
    for fmt, path in paths.items():
        r = measure(path, args.dtype)
        gb = 1e9
        print(f"{fmt:8}{r['weights'] / gb:12.2f}{r['peak'] / gb:13.2f}"
              f"{r['peak'] / r['weights']:14.2f}{(r['peak'] - r['base']) / r['weights']:22.2f}"
              f"{r['anon'] / gb:12.2f} / {r['file'] / gb:5.2f}{r['seconds']:8.1f}")


if __name__ == "__main__":
    main()
