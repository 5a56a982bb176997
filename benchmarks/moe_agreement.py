"""The same mixture-of-experts GGUF file in torchllama and in llama.cpp: logits and top-1
tokens over 256 positions, at real widths (Issue 31's agreement target).

Files: `torchllama bench shapes`' random-weight Q4_0 files (`torchllama.bench.shapes`, SmolLM2's
vocabulary; the experts' 3-D tensors Q4_0, routers float32): OLMoE-1B-7B whole, Qwen3-30B-A3B
and Mixtral 8x7B with 2 of their layers (real widths, head sizes and expert counts; fewer
layers to fit both engines in memory); `--shapes deepseek-v2-lite` adds DeepSeek-V2-Lite whole
(an 8.8 GB file; llama.cpp knows a model without query compression only by its 27 layers). For each: ours on the file's blocks (`--dtype auto`)
against llama.cpp (llama-cpp-python, `make bench-peer`, 2 threads): max and mean |Δlogit|,
top-1 agreement; llama.cpp with flash attention on against off (the same weights and
activation rounding, another attention summation order: how far llama.cpp moves from itself);
and, where memory allows (`--float`), the exact float32 computation of the same
weights (ours, dequantized) against llama.cpp's Q4_0 run: the gap llama.cpp's own int8
activation rounding leaves, for scale.

    .venv/bin/python benchmarks/moe_agreement.py [--shapes olmoe-1b-7b,qwen3-30b-a3b-2l,...]
        [--positions 256] [--float]
"""

from __future__ import annotations

import argparse
import gc


def _ours(path: str, dtype: str, ids: list[int]):
    import torch

    import torchllama

    model, _ = torchllama.load(path, dtype=dtype, progress=False)
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0].float().numpy()
    del model
    gc.collect()
    return logits


def _theirs(path: str, ids: list[int], flash_attn: bool = False):
    import numpy as np
    import llama_cpp

    llm = llama_cpp.Llama(path, n_ctx=len(ids) + 16, n_batch=len(ids), logits_all=True,
                          verbose=False, n_threads=2, n_threads_batch=2, flash_attn=flash_attn)
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)])
    llm.close()
    return logits


def _compare(a, b) -> str:
    import numpy as np

    d = np.abs(a - b)
    same = (a.argmax(-1) == b.argmax(-1)).mean()
    return f"max |Δ| {d.max():.4f}, mean |Δ| {d.mean():.5f}, top-1 {100 * same:.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="olmoe-1b-7b,qwen3-30b-a3b-2l,mixtral-8x7b-2l")
    args = parse_common(ap)
    from torchllama.bench.shapes import ensure_shape_file

    ids = random_ids(args.positions, "")
    for name in args.shapes.split(","):
        report(str(ensure_shape_file(name, "q4_0")), ids, f"{name} Q4_0", args.float)


def parse_common(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The agreement benchmarks' shared options (--positions, --float), parsed."""
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--float", action="store_true",
                    help="also our float32 computation of the dequantized weights")
    return ap.parse_args()


def random_ids(positions: int, kernels: str) -> list[int]:
    """The prompt both engines read (random token ids, seed 0), after a line naming the CPU
    (and `kernels`, our kernels' level, where given)."""
    import torch

    from torchllama.bench.shapes import VOCAB_SIZE

    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}{kernels}, 2 threads, "
          f"{positions} positions of random token ids")
    return torch.randint(0, VOCAB_SIZE, (positions,),
                         generator=torch.Generator().manual_seed(0)).tolist()


def report(path: str, ids: list[int], label: str, with_float: bool) -> None:
    """Print ours (dtype auto) against llama.cpp on one file, llama.cpp's flash-on/off floor,
    and with `with_float` the float32 computation of the same weights against both."""
    theirs = _theirs(path, ids)
    ours = _ours(path, "auto", ids)
    print(f"{label} (logit std {float(theirs.std()):.3f}): ours vs llama.cpp: "
          f"{_compare(ours, theirs)}")
    print(f"{label}: llama.cpp flash attention on vs off (its own floor): "
          f"{_compare(_theirs(path, ids, flash_attn=True), theirs)}", flush=True)
    if with_float:
        exact = _ours(path, "float32", ids)
        print(f"{label}: float32 of the same weights vs llama.cpp: "
              f"{_compare(exact, theirs)}; vs ours: {_compare(exact, ours)}", flush=True)


if __name__ == "__main__":
    main()
