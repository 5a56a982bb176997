"""`torchllama bench`: prefill and decode throughput of our model, side by side with HF
transformers on the same weights and dtype, in the same process.

Both models run the same loop: a prefill of a `prompt_tokens`-long prompt computing only the last
position's logits (what generation needs; HF: `logits_to_keep=1`), then `new_tokens` greedy
decode steps of batch 1 with each library's KV cache. Each figure is the median of `repeats`
runs after one warm-up run. The machine is shared and noisy: compare the ratios, which are
measured in the same run, rather than the absolute numbers.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class Throughput:
    """Median tokens/s of prefill (prompt tokens per second) and decode (new tokens per second)."""

    name: str
    prefill_tok_s: float
    decode_tok_s: float


def _measure(runs: dict[str, Callable[[], tuple[int, float]]], repeats: int) -> dict[str, float]:
    """Median tokens/s of each run. Runs are interleaved (A, B, A, B, ...) after one warm-up
    each, so that both see the same machine noise."""
    for run in runs.values():
        run()  # warm-up (allocations, kernel selection)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            tokens, seconds = run()
            rates[name].append(tokens / seconds)
    return {name: statistics.median(r) for name, r in rates.items()}


def _prompt_ids(vocab_size: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab_size, (1, n), generator=g)   # (1, n) fixed random ids


def ours_runs(model, prompt: torch.Tensor, new_tokens: int):
    """(prefill, decode) closures for our Transformer with its preallocated KV cache."""
    from torchllama.generation import decode_one_token, prefill

    T = prompt.shape[1]
    model.setup_caches(1, T + new_tokens)

    @torch.inference_mode()
    def run_prefill():
        t0 = time.perf_counter()
        prefill(model, prompt, 0)
        return T, time.perf_counter() - t0

    @torch.inference_mode()
    def run_decode():
        token = prefill(model, prompt, 0).argmax(-1, keepdim=True)      # (1, 1)
        t0 = time.perf_counter()
        for pos in range(T, T + new_tokens):
            token = decode_one_token(model, token, pos).argmax(-1, keepdim=True)
        return new_tokens, time.perf_counter() - t0

    return run_prefill, run_decode


def hf_runs(hf_model, prompt: torch.Tensor, new_tokens: int):
    """The same loops with transformers' model and its DynamicCache."""
    from transformers import DynamicCache

    T = prompt.shape[1]

    @torch.inference_mode()
    def run_prefill():
        t0 = time.perf_counter()
        hf_model(prompt, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        return T, time.perf_counter() - t0

    @torch.inference_mode()
    def run_decode():
        cache = DynamicCache()
        out = hf_model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            out = hf_model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        return new_tokens, time.perf_counter() - t0

    return run_prefill, run_decode


def load_hf_gguf(path: str, dtype: torch.dtype):
    """transformers' own GGUF loader (it dequantizes with the `gguf` library, like ours)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path),
        dtype=dtype, attn_implementation="sdpa").eval()


def run_bench(model_path: Optional[str] = None, dtype: str = "float32",
              prompt_tokens: int = 512, new_tokens: int = 128, repeats: int = 3,
              with_hf: bool = True, print_fn: Callable[[str], None] = print) -> list[Throughput]:
    """Measure and print the side-by-side table. Returns the measurements."""
    from torchllama.checkpoint import default_model_path, load, resolve_dtype

    path = str(model_path or default_model_path())
    torch_dtype = resolve_dtype(dtype)
    model, _ = load(path, dtype=torch_dtype, progress=False)
    prompt = _prompt_ids(model.args.vocab_size, prompt_tokens)
    print_fn(f"model {path}\ndtype {dtype}, {torch.get_num_threads()} threads, prompt "
             f"{prompt_tokens} tokens, {new_tokens} new tokens, batch 1, median of {repeats}, interleaved")
    runs = {"torchllama": ours_runs(model, prompt, new_tokens)}
    if with_hf:
        try:
            runs["transformers"] = hf_runs(load_hf_gguf(path, torch_dtype), prompt, new_tokens)
        except ImportError:
            print_fn("(transformers is not installed: no side-by-side figures)")
    prefill_rates = _measure({name: r[0] for name, r in runs.items()}, repeats)
    decode_rates = _measure({name: r[1] for name, r in runs.items()}, repeats)
    results = [Throughput(name, prefill_rates[name], decode_rates[name]) for name in runs]
    print_fn(f"{'':14}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for r in results:
        print_fn(f"{r.name:14}{r.prefill_tok_s:15.1f}{r.decode_tok_s:15.1f}")
    if len(results) == 2:
        ours, hf = results
        print_fn(f"{'ratio':14}{ours.prefill_tok_s / hf.prefill_tok_s:14.2f}x"
                 f"{ours.decode_tok_s / hf.decode_tok_s:14.2f}x")
    return results
