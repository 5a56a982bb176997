"""Where one decode step's time goes: eager tokens/s after a 512-token prefill, then a
torch.profiler table of 16 decode steps (ops by self time).

    .venv/bin/python benchmarks/decode_profile.py [--model PATH] [--dtype auto]
    TORCHLLAMA_KERNELS=0 .venv/bin/python benchmarks/decode_profile.py   # torch's kernels
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import profile

from torchllama import kernels
from torchllama.checkpoint import load
from torchllama.generation.session import decode_one_token, prefill

PROMPT_TOKENS = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded one)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, _ = load(args.model, dtype=args.dtype, progress=False)
    model.setup_caches(1, 1024)
    prompt = torch.tensor([[1] + list(range(100, 100 + PROMPT_TOKENS - 1))])   # (1, 512)
    token = torch.tensor([[5]])                                              # (1, 1)
    with torch.inference_mode():
        t0 = time.perf_counter()
        prefill(model, prompt)
        prefill_s = time.perf_counter() - t0
        pos = PROMPT_TOKENS
        for pos in range(pos, pos + 5):                                      # warm-up
            decode_one_token(model, token, pos)
        t0 = time.perf_counter()
        for pos in range(pos + 1, pos + 1 + args.steps):
            decode_one_token(model, token, pos)
        step_s = (time.perf_counter() - t0) / args.steps
        with profile() as prof:
            for pos in range(pos + 1, pos + 17):
                decode_one_token(model, token, pos)
    print(f"{args.dtype}, {torch.get_num_threads()} threads, CPU "
          f"{torch.backends.cpu.get_cpu_capability()}, torchllama kernels {kernels.isa()}")
    print(f"prefill {PROMPT_TOKENS}: {PROMPT_TOKENS / prefill_s:.1f} tok/s; decode at "
          f"≈{PROMPT_TOKENS + 40}: {step_s * 1e3:.2f} ms/token ({1 / step_s:.1f} tok/s)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
