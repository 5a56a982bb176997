"""Decode at batch 1 against the machine's memory bandwidth, ours and llama.cpp in one process.

A decode step reads every weight once, so its rate is bound by memory: tokens/s × bytes read per
token is the bandwidth a step reaches. This script measures, in one process and interleaved
round by round (the shared machine's bandwidth drifts by tens of percent within minutes), a
1 GiB `torch.sum` (the bandwidth a plain streaming read gets here), our decode and llama.cpp's
(flash attention off, its faster decode setting), both from the loaders of `torchllama bench
shapes` after a 480-token prompt, 32 greedy steps a run, and our step's block products alone
(every layer's and the output head's, one activation row, nothing else: the rate a step would
reach with attention, norms and dispatch free). Bytes per token: the file's tensor bytes (a
tied embedding is read whole as the output projection; an untied one only a row). Printed:
each one's best tok/s, its GB/s and that as a fraction of the sum's, and the fraction 1.3×
llama.cpp would need (issue 28's decode target).

    .venv/bin/python benchmarks/decode_roofline.py ~/.cache/torchllama/shapes/1b-q4_0.gguf [--rounds 4]
"""

from __future__ import annotations

import argparse
import time

import gguf
import torch

from torchllama.bench.decode import _prompt_ids
from torchllama.bench.shapes_bench import ShapesConfig, load_llama_cpp, load_torchllama


def bytes_per_token(path: str) -> int:
    """Bytes of weights a decode step reads: every tensor but an untied embedding table."""
    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors
               if tied or t.name != "token_embd.weight")


def sum_bandwidth(x: torch.Tensor) -> float:
    """GB/s of the best of three `torch.sum(x)` (after one warm-up)."""
    torch.sum(x)
    best = min(_timed(lambda: torch.sum(x)) for _ in range(3))
    return x.numel() * x.element_size() / best / 1e9


def products_alone(model):
    """A run closure like the engines': four passes over the model's block products (each
    layer's q/k/v, o, w1/w3, w2 modules and the output head) on one random row → (4, seconds)."""
    products = []
    for layer in model.layers:
        a, f = layer.attention, layer.feed_forward
        qkv = [a.wqkv] if getattr(a, "wqkv", None) is not None else [a.wq, a.wk, a.wv]
        w13 = [f.w13] if getattr(f, "w13", None) is not None else [f.w1, f.w3]
        products += [m for m in qkv + [a.wo] + w13 + [f.w2] if m is not None]
    products.append(model.output)
    xs = {m.in_features: torch.randn(1, m.in_features) for m in products}

    @torch.inference_mode()
    def run():
        t0 = time.perf_counter()
        for _ in range(4):
            for m in products:
                m(xs[m.in_features])
        return 4, time.perf_counter() - t0
    return run


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ShapesConfig(threads=args.threads, new_tokens=32)
    ours_runs, _, _ = load_torchllama(args.path, cfg)
    peer_runs, _, _ = load_llama_cpp(args.path, cfg)
    prompts = _prompt_ids(ours_runs.vocab_size, 480, 1).tolist()
    runs = {"torchllama": ours_runs.decode(None, prompts),
            "llama.cpp fa=off": peer_runs.decode(False, prompts),
            "our products alone": products_alone(ours_runs.model)}
    x = torch.ones(256 * 2**20)                                   # 1 GiB float32
    for run in runs.values():
        run()                                                     # prefill + warm-up
    rates: dict[str, list[float]] = {"sum": [], **{name: [] for name in runs}}
    for _ in range(args.rounds):
        rates["sum"].append(sum_bandwidth(x))
        for name, run in runs.items():
            time.sleep(0.3)
            tokens, seconds = run()
            rates[name].append(tokens / seconds)
    peer_runs.close()
    per_token, bw = bytes_per_token(args.path), max(rates["sum"])
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; "
          f"{args.path}: {per_token / 1e6:.0f} MB read per token; torch.sum {bw:.1f} GB/s "
          f"(rounds: {', '.join(f'{v:.1f}' for v in rates['sum'])})")
    for name in runs:
        tps = max(rates[name])
        print(f"  {name}: {tps:.1f} tok/s (rounds: {', '.join(f'{v:.1f}' for v in rates[name])})"
              f" = {tps * per_token / 1e9:.1f} GB/s = {tps * per_token / 1e9 / bw:.2f} of the sum")
    need = 1.3 * max(rates["llama.cpp fa=off"]) * per_token / 1e9 / bw
    print(f"  1.3x llama.cpp would need {need:.2f} of the sum's bandwidth")


if __name__ == "__main__":
    main()
