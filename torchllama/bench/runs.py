"""`torchllama bench`: prefill, decode and batched-decode throughput of our model, side by side
with a peer on the same weights in the same process: HF transformers (default) or llama.cpp
(`--peer llama.cpp`, through llama-cpp-python: torchllama.bench.peer). `torchllama bench --serve`:
the OpenAI-compatible server's throughput at 1, 4 and 8 concurrent requests (`run_serve_bench`).
`torchllama bench --speculative`: the exact float32 answer decoded plainly, drafted by the
checkpoint's own int4 weights and by prompt lookup (`run_speculative_bench`).

Every library runs the same loops on the same token ids (random ids, fixed seed):

- prefill: a `prompt_tokens`-long prompt into an empty KV cache, computing only the last
  position's logits (what generation needs; HF: `logits_to_keep=1`);
- decode: `new_tokens` greedy steps (argmax of the logits) with each library's KV cache, at
  batch 1 and at batch `batch` (that many different prompts of the same length decoded
  together, one token per sequence per step). The prompts are prefilled once, untimed; each
  run then drops the cache past the prompt and decodes the same steps again.

Each figure is the median of `repeats` runs after one warm-up run, the libraries interleaved.
The machine is shared and noisy: compare the ratios, which are measured in the same run,
rather than the absolute numbers.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

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


#: Seconds between two timed runs (see `_measure`).
PAUSE_S = 0.5


def _measure(runs: dict[str, Callable[[], tuple[int, float]]], repeats: int) -> dict[str, float]:
    """Median tokens/s of each run. Runs are interleaved (A, B, A, B, ...) after one warm-up
    each, so that both see the same machine noise, with a pause before each: the worker threads
    of the run before (OpenMP's, ggml's thread pool) poll for work a while after it ends, and on
    a 2-core machine they would take the next run's cores (measured: torchllama's decode
    99 tok/s right after llama.cpp's, 141 alone)."""
    for run in runs.values():
        run()  # warm-up (allocations, kernel selection)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            time.sleep(PAUSE_S)
            tokens, seconds = run()
            rates[name].append(tokens / seconds)
    return {name: statistics.median(r) for name, r in rates.items()}


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


def _weight_dtypes(model) -> str:
    """'float32', 'bfloat16 + int32 + uint8', ...: the dtypes of the model's 2-D parameters and
    buffers (packed quantized weights show as their integer storage), KV caches excluded."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    found = {str(t.dtype).removeprefix("torch.") for name, t in tensors
             if t.ndim >= 2 and "cache" not in name}
    return " + ".join(sorted(found))


def _peer_runs(peer: str, path: str, dtype: str, prompts: torch.Tensor, new_tokens: int,
               batch: int, print_fn: Callable[[str], None]):
    """(name, prefill run, batch-1 decode run, batch-N decode run or None, header note) of the
    peer, or None when it cannot run (the reason printed)."""
    from torchllama.checkpoint.common import DTYPES, resolve_dtype

    prompt, T = prompts[:1], prompts.shape[1]
    if peer == "llama.cpp":
        from torchllama.bench import peer as llama_cpp_peer

        peer_model = llama_cpp_peer.LlamaCpp(path, torch.get_num_threads())
        ids = prompts.tolist()
        runs = (llama_cpp_peer.PrefillRun(peer_model, ids[0]),
                llama_cpp_peer.DecodeRun(peer_model, ids[:1], new_tokens),
                llama_cpp_peer.DecodeRun(peer_model, ids, new_tokens) if batch > 1 else None)
        return ("llama.cpp", *runs, f"peer {llama_cpp_peer.peer_version()}, same file, "
                f"n_threads = n_threads_batch = {torch.get_num_threads()}"), peer_model
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
    return ("transformers", run_prefill, run_decode, run_batch,
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
              compile: bool = False) -> list[Throughput]:
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
    model, _ = load(path, dtype=dtype, progress=False)
    from torchllama.kernels import isa as kernels_isa
    prompts = _prompt_ids(model.args.vocab_size, prompt_tokens, batch)      # (batch, T)
    print_fn(f"model {path}")
    print_fn(f"dtype {dtype} (weights: {_weight_dtypes(model)}), {torch.get_num_threads()} "
             f"threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
             f"torchllama kernels {kernels_isa()}, torch {torch.__version__}")
    if compile:
        _compile(model, print_fn)
    run_prefill, run_decode = ours_runs(model, prompts[:1], new_tokens)
    runs = {"torchllama": (run_prefill, run_decode,
                           OursDecodeRun(model, prompts, new_tokens) if batch > 1 else None)}
    peer_model = None
    try:
        if peer != "none":
            spec, peer_model = _peer_runs(peer, path, dtype, prompts, new_tokens, batch,
                                          print_fn)
            if spec is not None:
                name, *peer_run, note = spec
                runs[name] = tuple(peer_run)
                print_fn(note)
        print_fn(f"prompt {prompt_tokens} tokens, {new_tokens} new tokens (greedy), median of "
                 f"{repeats} after a warm-up, interleaved")
        prefill_rates = _measure({name: r[0] for name, r in runs.items()}, repeats)
        decode_rates = _measure({name: r[1] for name, r in runs.items()}, repeats)
        batch_rates = (_measure({name: r[2] for name, r in runs.items()}, repeats)
                       if batch > 1 else {})
    finally:
        if peer_model is not None:
            peer_model.close()
    results = [Throughput(name, prefill_rates[name], decode_rates[name], batch_rates.get(name))
               for name in runs]
    for line in format_table(results, prompt_tokens, new_tokens, batch):
        print_fn(line)
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


# --------------------------------------------------------------------------------------------
# `torchllama bench --serve`: throughput of the HTTP server at several concurrencies
# --------------------------------------------------------------------------------------------

SERVE_PROMPTS = [
    "The history of the printing press begins",
    "Once upon a time, in a small village by the sea,",
    "The three most important ideas in physics are",
    "Here is a short guide to growing tomatoes at home:",
    "def quicksort(items):",
    "The city of Lyon is known for",
    "A good night's sleep matters because",
    "In the year 2050, most people will travel",
]


@dataclass
class ServeResult:
    """One concurrency level of `run_serve_bench`: generated tokens/s over the whole run (all
    clients together) and the median time to first token (seconds)."""

    concurrency: int
    requests: int
    tokens: int
    seconds: float
    ttft_median_s: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1") -> Iterator[str]:
    """Run an ASGI app with uvicorn in a background thread on a free port of `host`.

    A context manager yielding the base URL ("http://127.0.0.1:PORT"); on exit the server is
    stopped (its lifespan shutdown runs) and the thread joined.
    """
    import socket
    import threading

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="torchllama-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def stream_completion(url: str, prompt: str, max_tokens: int, api_key: Optional[str] = None,
                      timeout: float = 600.0, stream: bool = True) -> tuple[int, float, float]:
    """One /v1/completions request at temperature 0 over plain http.client, streaming or not.

    Returns (completion tokens from the usage object, seconds to the first text chunk — the
    whole answer when not streaming —, total seconds).

    Raises:
        RuntimeError: an HTTP error status or an error event in the stream.
    """
    import http.client
    import json
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    connection = (http.client.HTTPSConnection if parts.scheme == "https"
                  else http.client.HTTPConnection)
    conn = connection(parts.hostname, parts.port, timeout=timeout)
    fields = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    ttft, tokens = None, None
    try:
        conn.request("POST", parts.path.rstrip("/") + "/v1/completions", body, headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        if not stream:
            tokens = json.loads(response.read())["usage"]["completion_tokens"]
        for raw in response if stream else ():
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            if ttft is None and any(c.get("text") for c in event.get("choices", ())):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    finally:
        conn.close()
    total = time.perf_counter() - t0
    if tokens is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return tokens, (ttft if ttft is not None else total), total


def _serve_level(url: str, concurrency: int, prompts: list[str], new_tokens: int,
                 api_key: Optional[str], stream: bool = True) -> ServeResult:
    """All prompts, `concurrency` requests in flight at a time."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(
            lambda p: stream_completion(url, p, new_tokens, api_key, stream=stream), prompts))
    seconds = time.perf_counter() - t0
    return ServeResult(concurrency, len(prompts), sum(r[0] for r in results), seconds,
                       statistics.median(r[1] for r in results))


def run_serve_bench(url: Optional[str] = None, api_key: Optional[str] = None,
                    new_tokens: int = 64, model_path: Optional[str] = None,
                    dtype: str = "float32", concurrencies: tuple[int, ...] = (1, 4, 8),
                    prompts: Optional[list[str]] = None, stream: bool = True,
                    print_fn: Callable[[str], None] = print) -> list[ServeResult]:
    """Generated tokens/s of an OpenAI-compatible server at each concurrency, and the median
    time to first token; prints a table with the speedup over the first concurrency.

    Every level sends the same prompts (8 by default) with the same max_tokens, temperature 0,
    streaming completions (with stream=False: whole answers, whose "first token" arrives with
    the last), `concurrency` requests in flight at a time; tokens/s is the sum of
    the completion tokens (the servers' usage counts) over the level's wall time. One warm-up
    request runs first. Without `url`, the model (`model_path`, default the embedded
    SmolLM2-135M-Instruct) is served in this process on a free loopback port, with a batch of
    max(concurrencies) rows, and stopped at the end.
    """
    prompts = list(prompts or SERVE_PROMPTS)

    def measure(base_url: str) -> list[ServeResult]:
        stream_completion(base_url, prompts[0], min(new_tokens, 8), api_key)      # warm-up
        return [_serve_level(base_url, c, prompts, new_tokens, api_key, stream)
                for c in concurrencies]

    if url is not None:
        where = url
        results = measure(url.rstrip("/"))
    else:
        from torchllama.checkpoint import parse_dtype, resolve_model_path
        from torchllama.serving.app import create_app, load_for_engine

        path = str(resolve_model_path(model_path))
        parse_dtype(dtype)
        model, tokenizer = load_for_engine(path, dtype, progress=False)
        app = create_app(model, tokenizer, Path(path).name, api_key,
                         max_batch_size=max(concurrencies), max_queue=64)
        with serve_in_thread(app) as base_url:
            where = (f"{base_url} (in this process: {path}, {dtype}, "
                     f"{torch.get_num_threads()} threads, batch {max(concurrencies)})")
            results = measure(base_url)
    print_fn(f"server {where}\n{len(prompts)} requests per level, max_tokens {new_tokens}, "
             f"temperature 0, {'streaming' if stream else 'non-streaming'} completions")
    print_fn(f"{'concurrency':>11}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'speedup':>9}"
             f"{'median TTFT':>13}")
    base = results[0].tok_s
    for r in results:
        print_fn(f"{r.concurrency:11d}{r.tokens:8d}{r.seconds:9.2f}{r.tok_s:9.1f}"
                 f"{r.tok_s / base if base else 0.0:8.2f}x{r.ttft_median_s * 1000:10.0f} ms")
    return results


# --------------------------------------------------------------------------------------------
# `torchllama bench --speculative`: exact float32 output, drafted
# --------------------------------------------------------------------------------------------

#: A paragraph to summarise with quotes: the answer repeats its context (prompt lookup's case).
SPECULATIVE_PARAGRAPH = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
    "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the "
    "coast of Queensland, Australia. It can be seen from outer space and is the world's "
    "biggest single structure made by living organisms. This reef structure is composed of and "
    "built by billions of tiny organisms, known as coral polyps.")
#: (name, chat prompt) of the speculative bench: an open answer, and one that quotes its input.
SPECULATIVE_PROMPTS = (
    ("story", "Write a short story about a robot who learns to paint."),
    ("summary", SPECULATIVE_PARAGRAPH + "\n\nSummarise the paragraph above, quoting its key "
                                        "sentences word for word."),
)


@dataclass
class SpeculativeResult:
    """One (prompt, method) of `run_speculative_bench`: median decode tokens/s and median
    seconds from the prompt to the last token (prefill, a draft model's included), the last
    run's acceptance rate and tokens per target forward, and whether its tokens were plain
    decoding's."""

    prompt: str
    method: str
    decode_tok_s: float
    total_s: float
    acceptance: Optional[float]
    tokens_per_pass: float
    same_tokens: bool


class SessionRun:
    """`run()` → (decode tokens/s, prefill + decode seconds) of one greedy `Session.generate`
    from empty caches (the drafter's too). A draft model's prefill of the prompt counts as
    prefill (`Session.generate` runs it there), the drafting as decoding. `stats` and
    `tokens`: the last run's."""

    def __init__(self, model, tokenizer, prompt_ids: list[int], new_tokens: int, drafter=None,
                 draft_tokens: int = 12):
        self.model, self.tokenizer, self.prompt_ids = model, tokenizer, prompt_ids
        self.new_tokens, self.drafter, self.draft_tokens = new_tokens, drafter, draft_tokens
        self.stats, self.tokens = None, []

    def __call__(self) -> tuple[float, float]:
        from torchllama.generation.session import Session
        from torchllama.generation.sampling import SamplingParams

        if self.drafter is not None:
            self.drafter.reset()
        session = Session(self.model, self.tokenizer, draft=self.drafter,
                          draft_tokens=self.draft_tokens)
        self.tokens = list(session.generate(self.prompt_ids, self.new_tokens,
                                            SamplingParams(temperature=0)))
        self.stats = session.stats
        return self.stats.decode_tokens_per_s, self.stats.prefill_s + self.stats.decode_s


def _measure_sessions(runs: dict[str, SessionRun], repeats: int) -> dict[str, tuple]:
    """Median (decode tok/s, total seconds) of each run: one warm-up each, then `repeats`
    rounds interleaved, with `_measure`'s pause before each run."""
    for run in runs.values():
        run()
    figures: dict[str, list] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            time.sleep(PAUSE_S)
            figures[name].append(run())
    return {name: (statistics.median(f[0] for f in fs), statistics.median(f[1] for f in fs))
            for name, fs in figures.items()}


def run_speculative_bench(model_path: Optional[str] = None, new_tokens: int = 128,
                          repeats: int = 3, draft: str = "int4", draft_tokens: int = 12,
                          print_fn: Callable[[str], None] = print) -> list[SpeculativeResult]:
    """Greedy decoding of the float32 model (the exact answer) plain, drafted by a draft
    model (`draft`, default the checkpoint's own int4 weights) and by prompt lookup, on an open
    chat answer and on a summary that quotes its paragraph; prints decode tokens/s and the
    time from prompt to last token, each with its speedup over plain float32, the acceptance
    rate, tokens per target pass, and whether the tokens were plain decoding's (they must be).

    Args:
        model_path: the checkpoint (default: the embedded SmolLM2-135M-Instruct).
        new_tokens: the most tokens generated per answer (the chat's end token stops sooner).
        repeats: measurements per figure after a warm-up, interleaved (the median is shown).
        draft: the draft model: int4, int8, auto (the checkpoint's own weights in that
            format) or a path (`torchllama.generation.speculative.make_drafter`).
        draft_tokens: the most tokens drafted per step.

    Raises:
        ArgumentError, ModelFileError: as `make_drafter` and `load`.
    """
    from torchllama.checkpoint import load, resolve_model_path
    from torchllama.generation.session import encode_prompt
    from torchllama.kernels import isa as kernels_isa
    from torchllama.generation.speculative import PromptLookupDrafter, make_drafter

    path = str(resolve_model_path(model_path))
    model, tokenizer = load(path, dtype="float32", progress=False)
    drafter = make_drafter(draft, model_path)
    print_fn(f"model {path}: target float32 (exact), draft {draft} (weights: "
             f"{_weight_dtypes(drafter.model)}) or prompt lookup, at most {draft_tokens} "
             f"drafted tokens per step")
    print_fn(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torchllama kernels "
             f"{kernels_isa()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
             f"greedy, at most {new_tokens} new tokens, median of {repeats} after a warm-up, "
             "interleaved")
    methods = (("plain float32", None), (f"draft {draft}", drafter),
               ("prompt lookup", PromptLookupDrafter()))
    results = []
    for name, text in SPECULATIVE_PROMPTS:
        ids = encode_prompt(tokenizer, text, chat=True)
        runs = {method: SessionRun(model, tokenizer, ids, new_tokens, d, draft_tokens)
                for method, d in methods}
        figures = _measure_sessions(runs, repeats)
        plain = runs["plain float32"].tokens
        for method, run in runs.items():
            results.append(SpeculativeResult(
                f"{name} ({len(ids)}+{len(plain)})", method, *figures[method],
                run.stats.acceptance_rate if run.drafter is not None else None,
                run.stats.decode_tokens / max(run.stats.decode_steps, 1), run.tokens == plain))
    for line in format_speculative_table(results):
        print_fn(line)
    return results


def format_speculative_table(results: list[SpeculativeResult]) -> list[str]:
    """One row per (prompt, method): decode tok/s and its speedup over the prompt's plain row,
    seconds from prompt to last token and that speedup, acceptance, tokens per target pass,
    same tokens as plain."""
    width = max(len(r.prompt) for r in results) + 2
    lines = [f"{'prompt (in+out)':{width}}{'method':<16}{'decode tok/s':>13}{'speedup':>9}"
             f"{'total s':>9}{'speedup':>9}{'accepted':>10}{'tok/pass':>10}{'same tokens':>13}"]
    base: dict[str, SpeculativeResult] = {}
    for r in results:
        b = base.setdefault(r.prompt, r)
        accepted = f"{r.acceptance:.0%}" if r.acceptance is not None else "-"
        lines.append(f"{r.prompt:{width}}{r.method:<16}{r.decode_tok_s:13.1f}"
                     f"{r.decode_tok_s / b.decode_tok_s:8.2f}x{r.total_s:9.2f}"
                     f"{b.total_s / r.total_s:8.2f}x{accepted:>10}{r.tokens_per_pass:10.2f}"
                     f"{'yes' if r.same_tokens else 'NO':>13}")
    return lines
