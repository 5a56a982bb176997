"""`torchllama bench decode`: prefill, decode and batched-decode throughput of our model, side by
side with a peer on the same weights in the same process: HF transformers (default) or llama.cpp
(`--peer llama.cpp`, through llama-cpp-python: torchllama.bench.peer).

Every library runs the same loops on the same token ids (random ids, fixed seed):

- prefill: a `prompt_tokens`-long prompt into an empty KV cache, computing only the last
  position's logits (what generation needs; HF: `logits_to_keep=1`);
- decode: `new_tokens` greedy steps (argmax of the logits) with each library's KV cache, at
  batch 1 and at batch `batch` (that many different prompts of the same length decoded
  together, one token per sequence per step). The prompts are prefilled once, untimed; each
  run then drops the cache past the prompt and decodes the same steps again.

Each figure is the median of `repeats` runs after one warm-up run, the libraries interleaved
(`torchllama.bench.timing.measure`). The machine is shared and noisy: compare the ratios, which
are measured in the same run, rather than the absolute numbers.
"""

from __future__ import annotations

import os
from pathlib import Path
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from torchllama.bench.timing import measure

PEERS = ("transformers", "llama.cpp", "none")


@dataclass
class Throughput:
    """Median tokens/s of one library: prefill (prompt tokens per second), decode at batch 1
    (new tokens per second) and decode at batch N (new tokens of all N sequences per second;
    None when not measured)."""

    name: str
    prefill_tok_s: float
    decode_tok_s: float
    batch_decode_tok_s: Optional[float] = None


def _prompt_ids(vocab_size: int, n: int, rows: int = 1) -> torch.Tensor:
    """(rows, n) fixed random ids in [100, vocab_size); row 0 is the same for every `rows`."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab_size, (rows, n), generator=g)


class OursDecodeRun:
    """`run()` → (B × new_tokens, seconds) of `new_tokens` greedy decode steps of our model on
    the B rows of `prompts` (B, T) together, with a KV cache of B rows.

    The cache is set up and the prompts prefilled on the first call (and again if something
    else replaced the model's caches), untimed; every call then decodes from position T again,
    overwriting the slots of the previous run. A sliding-window ring cache cannot rewind that
    far (its slots before T are overwritten by then), so its state after the prefill is kept
    and put back, untimed, before each call: every call decodes what the first did, and appends
    as generation does. `tokens` holds the ids the last call's decode steps chose, (B, new)
    (the prefill's token, which they start from, not included).
    """

    def __init__(self, model, prompts: torch.Tensor, new_tokens: int):
        self.model, self.prompts, self.new_tokens = model, prompts, new_tokens
        self._caches = None
        self._first: Optional[torch.Tensor] = None     # (B, 1) greedy token after each prompt
        self._rings: list = []                          # (ring cache, its state after prefill)
        self.tokens: Optional[torch.Tensor] = None

    @torch.inference_mode()
    def __call__(self) -> tuple[int, float]:
        from torchllama.generation.session import decode_one_token, prefill

        model, (B, T) = self.model, self.prompts.shape
        if self._caches is None or model.caches is not self._caches:
            model.setup_caches(B, T + self.new_tokens)
            self._caches = model.caches
            self._first = prefill(model, self.prompts, 0).argmax(-1, keepdim=True)   # (B, 1)
            self._rings = [(c, c.snapshot()) for c in model.caches if not c.in_slot_order]
        for cache, state in self._rings:                         # back to just after prefill
            cache.restore(state)
        token, out = self._first, []
        t0 = time.perf_counter()
        for pos in range(T, T + self.new_tokens):
            token = decode_one_token(model, token, pos).argmax(-1, keepdim=True)   # (B, 1)
            out.append(token)
        seconds = time.perf_counter() - t0
        self.tokens = torch.cat(out, dim=1)                                       # (B, new)
        return B * self.new_tokens, seconds


def ours_runs(model, prompt: torch.Tensor, new_tokens: int):
    """(prefill, decode) closures for our Transformer with its preallocated KV cache; prompt
    (1, T). The decode closure is an `OursDecodeRun` of one row."""
    from torchllama.generation.session import prefill

    T = prompt.shape[1]

    @torch.inference_mode()
    def run_prefill():
        if model.caches is None or model.caches.shape != (1, T + new_tokens):
            model.setup_caches(1, T + new_tokens)
        t0 = time.perf_counter()
        prefill(model, prompt, 0)
        return T, time.perf_counter() - t0

    return run_prefill, OursDecodeRun(model, prompt, new_tokens)


class HFDecodeRun:
    """`OursDecodeRun` for a transformers model: its DynamicCache, cropped back to the prompts'
    length (`DynamicCache.crop`) at every call. `tokens`: the last call's decode steps' ids."""

    def __init__(self, hf_model, prompts: torch.Tensor, new_tokens: int):
        self.hf_model, self.prompts, self.new_tokens = hf_model, prompts, new_tokens
        self._cache = None
        self._first: Optional[torch.Tensor] = None
        self.tokens: Optional[torch.Tensor] = None

    @torch.inference_mode()
    def __call__(self) -> tuple[int, float]:
        from transformers import DynamicCache

        B, T = self.prompts.shape
        if self._cache is None:
            self._cache = DynamicCache()
            out = self.hf_model(self.prompts, past_key_values=self._cache, use_cache=True,
                                logits_to_keep=1)
            self._first = out.logits[:, -1].argmax(-1, keepdim=True)               # (B, 1)
        cache = self._cache
        extra = cache.get_seq_length() - T
        if extra > 0:
            cache.crop(-extra)          # a negative count: tokens to drop, in every version
        token, out_ids = self._first, []
        t0 = time.perf_counter()
        for _ in range(self.new_tokens):
            out = self.hf_model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            out_ids.append(token)
        seconds = time.perf_counter() - t0
        self.tokens = torch.cat(out_ids, dim=1)
        return B * self.new_tokens, seconds


def hf_runs(hf_model, prompt: torch.Tensor, new_tokens: int):
    """The same (prefill, decode) with transformers' model and its DynamicCache."""
    from transformers import DynamicCache

    T = prompt.shape[1]

    @torch.inference_mode()
    def run_prefill():
        t0 = time.perf_counter()
        hf_model(prompt, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        return T, time.perf_counter() - t0

    return run_prefill, HFDecodeRun(hf_model, prompt, new_tokens)


def load_hf(path: str, dtype: torch.dtype):
    """The same checkpoint in transformers: its own GGUF loader (dequantizing with the `gguf`
    library, like ours) or, for a Hugging Face folder, from_pretrained. Meta folders have no
    transformers loader (ValueError)."""
    from torchllama.checkpoint import detect_format

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    fmt = detect_format(Path(path))
    if fmt == "meta":
        raise ValueError("transformers cannot read Meta's format (convert it with --to hf)")
    kwargs = dict(dtype=dtype, attn_implementation="sdpa")
    if fmt == "gguf":
        kwargs["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(os.path.abspath(path))
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def weight_dtypes(model) -> str:
    """'float32', 'bfloat16 + int32 + uint8', ...: the dtypes of the model's 2-D parameters and
    buffers (packed quantized weights show as their integer storage), KV caches excluded."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    found = {str(t.dtype).removeprefix("torch.") for name, t in tensors
             if t.ndim >= 2 and "cache" not in name}
    return " + ".join(sorted(found))


def _peer_runs(peer: str, path: str, dtype: str, prompts: torch.Tensor, new_tokens: int,
               batch: int, print_fn: Callable[[str], None]):
    """({setting: (prefill run, batch-1 decode run, batch-N decode run or None)}, header note)
    of the peer, and the llama.cpp model to close (or None); (None, None) when it cannot run
    (the reason printed). llama.cpp runs twice, flash attention on and off (settings
    "llama.cpp fa=on" / "llama.cpp fa=off"); `run_bench` keeps the faster of each figure."""
    from torchllama.checkpoint.common import DTYPES, resolve_dtype

    prompt, T = prompts[:1], prompts.shape[1]
    if peer == "llama.cpp":
        from torchllama.bench import peer as llama_cpp_peer

        peer_model = llama_cpp_peer.LlamaCpp(path, torch.get_num_threads())
        ids = prompts.tolist()
        settings = {}
        for fa in (True, False):
            settings[f"llama.cpp fa={'on' if fa else 'off'}"] = (
                llama_cpp_peer.PrefillRun(peer_model, ids[0], fa),
                llama_cpp_peer.DecodeRun(peer_model, ids[:1], new_tokens, fa),
                llama_cpp_peer.DecodeRun(peer_model, ids, new_tokens, fa) if batch > 1 else None)
        return (settings, f"peer {llama_cpp_peer.peer_version()}, same file, n_threads = "
                f"n_threads_batch = {torch.get_num_threads()}, flash attention on and off "
                "(each figure: the faster)"), peer_model
    # transformers: it holds float weights only
    hf_dtype = resolve_dtype(dtype) if dtype in DTYPES else torch.float32
    note = "" if dtype in DTYPES else (f" in float32 (it dequantizes: --dtype {dtype} is "
                                       "torchllama's only)")
    try:
        import transformers

        hf_model = load_hf(path, hf_dtype)
    except ImportError:
        print_fn("(transformers is not installed: no side-by-side figures)")
        return None, None
    except Exception as e:                  # its loader's problem, not the benchmark's
        print_fn(f"(transformers could not load {path}: {e}; no side-by-side figures)")
        return None, None
    run_prefill, run_decode = hf_runs(hf_model, prompt, new_tokens)
    run_batch = HFDecodeRun(hf_model, prompts, new_tokens) if batch > 1 else None
    return ({"transformers": (run_prefill, run_decode, run_batch)},
            f"peer transformers {transformers.__version__}{note}"), None


def _compile(model, print_fn: Callable[[str], None]) -> None:
    """`torchllama.generation.session.compile_decode(model)` when it exists; prints its seconds."""
    from torchllama.generation import session as generation

    if not hasattr(generation, "compile_decode"):
        print_fn("--compile: (compile_decode not available yet)")
        return
    seconds = generation.compile_decode(model)
    print_fn(f"--compile: decode step compiled and warmed up in {seconds:.1f} s")


def run_bench(model_path: Optional[str] = None, dtype: str = "auto",
              prompt_tokens: int = 512, new_tokens: int = 128, repeats: int = 3,
              with_hf: bool = True, print_fn: Callable[[str], None] = print, *,
              peer: Optional[str] = None, batch: int = 8,
              compile: bool = False, kv_cache_dtype: str = "auto") -> list[Throughput]:
    """Measure and print the side-by-side table: prefill tok/s, decode tok/s at batch 1 and at
    batch `batch` (all sequences' new tokens per second), and their ratios.

    Args:
        model_path: the checkpoint (default: the embedded SmolLM2-135M-Instruct GGUF).
        dtype: passed to `torchllama.checkpoint.load` (float32, bfloat16, float16, and the
            quantized choices it offers).
        prompt_tokens: prompt length of the prefill figure, and of each decoded sequence.
        new_tokens: greedy decode steps per measurement.
        repeats: measurements per figure, after one warm-up (the median is shown).
        with_hf: False is the same as peer="none" (the old --no-hf).
        peer: "transformers" (default), "llama.cpp" (a GGUF file only) or "none".
        batch: sequences of the batched-decode figure (1: no batched figure).
        compile: compile our decode step first (`generation.compile_decode`).
        kv_cache_dtype: what our KV cache stores (`torchllama.load`; llama.cpp keeps its
            default, float16).

    Returns:
        our Throughput first, then the peer's (if it ran).

    Raises:
        ArgumentError: an unknown peer, llama.cpp on a non-GGUF checkpoint or without
            llama-cpp-python, batch < 1, an unknown dtype.
    """
    from torchllama.checkpoint import detect_format, load, resolve_model_path
    from torchllama.errors import ArgumentError

    peer = peer if peer is not None else ("transformers" if with_hf else "none")
    if peer not in PEERS:
        raise ArgumentError(f"--peer {peer!r}: use one of {', '.join(PEERS)}")
    if batch < 1:
        raise ArgumentError(f"--batch must be ≥ 1, got {batch}")
    path = str(resolve_model_path(model_path))
    if peer == "llama.cpp":
        from torchllama.bench.peer import import_llama_cpp

        import_llama_cpp()                      # fail before loading anything
        if detect_format(Path(path)) != "gguf":
            raise ArgumentError(f"--peer llama.cpp reads GGUF files only; {path} is not one")
    model, _ = load(path, dtype=dtype, progress=False, kv_cache_dtype=kv_cache_dtype)
    from torchllama.kernels import isa as kernels_isa
    prompts = _prompt_ids(model.args.vocab_size, prompt_tokens, batch)      # (batch, T)
    print_fn(f"model {path}")
    print_fn(f"dtype {dtype} (weights: {weight_dtypes(model)}), {torch.get_num_threads()} "
             f"threads, KV cache {str(model.kv_cache_storage()).removeprefix('torch.')}, "
             f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
             f"torchllama kernels {kernels_isa()}, torch {torch.__version__}")
    if compile:
        _compile(model, print_fn)
    run_prefill, run_decode = ours_runs(model, prompts[:1], new_tokens)
    runs = {"torchllama": (run_prefill, run_decode,
                           OursDecodeRun(model, prompts, new_tokens) if batch > 1 else None)}
    peer_model = None
    try:
        if peer != "none":
            settings, peer_model = _peer_runs(peer, path, dtype, prompts, new_tokens, batch,
                                              print_fn)
            if settings is not None:
                settings, note = settings
                runs.update(settings)
                print_fn(note)
        print_fn(f"prompt {prompt_tokens} tokens, {new_tokens} new tokens (greedy), median of "
                 f"{repeats} after a warm-up, interleaved")
        measured = [Throughput(name, *rates) for name, rates in _measure_runs(runs, repeats,
                                                                              batch).items()]
    finally:
        if peer_model is not None:
            peer_model.close()
    results = _fastest_setting(measured, print_fn)
    for line in format_table(results, prompt_tokens, new_tokens, batch):
        print_fn(line)
    return results


def _measure_runs(runs: dict, repeats: int, batch: int) -> dict[str, tuple]:
    """{name: (prefill, decode, batch decode or None)} tokens/s of each (prefill, decode,
    batch decode) run triple, every figure measured interleaved across the names."""
    prefill = measure({name: r[0] for name, r in runs.items()}, repeats)
    decode = measure({name: r[1] for name, r in runs.items()}, repeats)
    batched = measure({name: r[2] for name, r in runs.items()}, repeats) if batch > 1 else {}
    return {name: (prefill[name], decode[name], batched.get(name)) for name in runs}


def _fastest_setting(measured: list[Throughput], print_fn: Callable[[str], None]
                     ) -> list[Throughput]:
    """One Throughput per library: a library measured under several settings ("llama.cpp
    fa=on", "llama.cpp fa=off") gets the faster of each figure (printed first, every setting)."""
    by_library: dict[str, list[Throughput]] = {}
    for t in measured:
        by_library.setdefault(t.name.split(" ")[0], []).append(t)
    results = []
    for library, group in by_library.items():
        if len(group) == 1:
            results.append(group[0])
            continue
        for t in group:
            batched = "" if t.batch_decode_tok_s is None else \
                f", batch decode {t.batch_decode_tok_s:.1f}"
            print_fn(f"  {t.name}: prefill {t.prefill_tok_s:.1f}, decode "
                     f"{t.decode_tok_s:.1f}{batched} tok/s")
        batch_rates = [t.batch_decode_tok_s for t in group if t.batch_decode_tok_s is not None]
        results.append(Throughput(library, max(t.prefill_tok_s for t in group),
                                  max(t.decode_tok_s for t in group),
                                  max(batch_rates) if batch_rates else None))
    return results


def format_table(results: list[Throughput], prompt_tokens: int, new_tokens: int,
                 batch: int) -> list[str]:
    """The table's lines: one row per figure, one column per library, then ours ÷ the peer's;
    a last row, batch-N decode ÷ batch-1 decode of each library."""
    rows = [(f"prefill tok/s ({prompt_tokens})", [r.prefill_tok_s for r in results]),
            (f"decode tok/s (batch 1, {new_tokens})", [r.decode_tok_s for r in results])]
    if batch > 1:
        rows.append((f"decode tok/s (batch {batch}, {new_tokens})",
                     [r.batch_decode_tok_s for r in results]))
    width = max(len(label) for label, _ in rows) + 2
    header = f"{'':{width}}" + "".join(f"{r.name:>14}" for r in results)
    lines = [header + (f"{'ratio':>10}" if len(results) == 2 else "")]
    for label, values in rows:
        line = f"{label:{width}}" + "".join(f"{v:14.1f}" for v in values)
        if len(values) == 2:
            line += f"{values[0] / values[1]:9.2f}x"
        lines.append(line)
    if batch > 1:
        lines.append(f"{f'batch {batch} / batch 1':{width}}" + "".join(
            f"{r.batch_decode_tok_s / r.decode_tok_s:13.2f}x" for r in results))
    return lines


def result_runs(results: list[Throughput], model: str, prompt_tokens: int, batch: int):
    """The figures of `run_bench` as `torchllama.bench.results` runs (one: ours beside the
    peer)."""
    from torchllama.bench.results import Figure, Run

    ours = results[0]
    peer = results[1] if len(results) > 1 else None
    rows = [(f"prefill {prompt_tokens}", "prefill_tok_s"), ("decode b1", "decode_tok_s")]
    if batch > 1:
        rows.append((f"decode b{batch}", "batch_decode_tok_s"))
    figures = [Figure(name, "tok/s", getattr(ours, key),
                      getattr(peer, key) if peer is not None else None) for name, key in rows]
    setting = {"llama.cpp": "flash attention on and off, the faster of each figure",
               "transformers": "the same weights in float32 (quantized files dequantized)"}
    return [Run(model, figures, peer.name if peer else None,
                setting.get(peer.name) if peer else None)]

