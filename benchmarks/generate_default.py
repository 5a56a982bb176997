"""`torchllama generate`'s decode rate with its default sampling, next to llama.cpp's, in one run.

`torchllama bench decode --peer llama.cpp` times greedy decoding; users of `torchllama generate` get
temperature 0.6 and top-p 0.9 (Meta's defaults), so sampling is part of every token. This
script decodes the same prompt, interleaved, medians of --repeats:

- torchllama, default sampling (Session.generate, seeds 0..R-1) and greedy;
- llama.cpp through its C API, greedy (torchllama.bench.peer.DecodeRun, as the bench);
- llama-cpp-python's own `Llama.generate` with the same sampling (top-k off, top-p 0.9,
  temperature 0.6, min-p off, no repetition penalty).

No stop token ends a run early. Needs llama-cpp-python (`make bench-peer`).

    .venv/bin/python benchmarks/generate_default.py [--model PATH] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from torchllama import kernels
from torchllama.bench import peer
from torchllama.checkpoint import load
from torchllama.checkpoint.common import resolve_model_path
from torchllama.generation.session import SamplingParams, Session, encode_prompt

PROMPT = "Once upon a time, a little robot"


def ours(model, tokenizer, ids, n, sampling) -> float:
    """Tokens/s of decode steps after the first token (the prefill is not counted)."""
    tokens = Session(model, tokenizer).generate(ids, n, sampling, stop_ids=frozenset())
    next(tokens)
    t0 = time.perf_counter()
    count = sum(1 for _ in tokens)
    return count / (time.perf_counter() - t0)


def llama_cpp_sampled(llm, ids, n) -> float:
    tokens = llm.generate(ids, top_k=0, top_p=0.9, min_p=0.0, temp=0.6, repeat_penalty=1.0,
                          reset=True)
    next(tokens)
    t0 = time.perf_counter()
    for count, _ in enumerate(tokens, start=1):
        if count == n - 1:
            break
    return count / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the embedded one)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    path = str(resolve_model_path(args.model))
    model, tokenizer = load(path, dtype="auto", progress=False)
    ids = encode_prompt(tokenizer, PROMPT, chat=False)
    llama_cpp = peer.import_llama_cpp()
    c_api = peer.DecodeRun(peer.LlamaCpp(path, torch.get_num_threads()), [ids], args.new_tokens)
    llm = llama_cpp.Llama(model_path=path, n_threads=torch.get_num_threads(),
                          n_threads_batch=torch.get_num_threads(), n_ctx=512, verbose=False)
    runs = {
        "torchllama generate, default sampling": lambda r: ours(
            model, tokenizer, ids, args.new_tokens, SamplingParams(0.6, 0, 0.9, seed=r)),
        "torchllama, greedy": lambda r: ours(
            model, tokenizer, ids, args.new_tokens, SamplingParams(temperature=0)),
        "llama.cpp C API, greedy": lambda r: (lambda n, s: n / s)(*c_api()),
        "llama-cpp-python generate, same sampling": lambda r: llama_cpp_sampled(
            llm, ids, args.new_tokens),
    }
    rates = {name: [] for name in runs}
    for r in range(args.repeats):
        for name, run in runs.items():
            rates[name].append(run(r))
            time.sleep(1.0)        # llama.cpp's OpenMP workers spin for a while after a call
    print(f"{path}\n{args.new_tokens} new tokens after a {len(ids)}-token prompt, "
          f"{torch.get_num_threads()} threads, CPU {torch.backends.cpu.get_cpu_capability()}, "
          f"torchllama kernels {kernels.isa()}, median of {args.repeats}")
    for name, values in rates.items():
        print(f"{name:44s} {statistics.median(values):7.1f} tok/s")


if __name__ == "__main__":
    main()
