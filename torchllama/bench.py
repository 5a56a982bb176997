"""`torchllama bench`: prefill and decode throughput of our model, side by side with HF
transformers on the same weights and dtype, in the same process. `torchllama bench --serve`:
the OpenAI-compatible server's throughput at 1, 4 and 8 concurrent requests (`run_serve_bench`).

Both models run the same loop: a prefill of a `prompt_tokens`-long prompt computing only the last
position's logits (what generation needs; HF: `logits_to_keep=1`), then `new_tokens` greedy
decode steps of batch 1 with each library's KV cache. Each figure is the median of `repeats`
runs after one warm-up run. The machine is shared and noisy: compare the ratios, which are
measured in the same run, rather than the absolute numbers.
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


def run_bench(model_path: Optional[str] = None, dtype: str = "float32",
              prompt_tokens: int = 512, new_tokens: int = 128, repeats: int = 3,
              with_hf: bool = True, print_fn: Callable[[str], None] = print) -> list[Throughput]:
    """Measure and print the side-by-side table. Returns the measurements."""
    from torchllama.checkpoint import load, resolve_dtype, resolve_model_path

    path = str(resolve_model_path(model_path))
    torch_dtype = resolve_dtype(dtype)
    model, _ = load(path, dtype=torch_dtype, progress=False)
    prompt = _prompt_ids(model.args.vocab_size, prompt_tokens)
    print_fn(f"model {path}\ndtype {dtype}, {torch.get_num_threads()} threads, prompt "
             f"{prompt_tokens} tokens, {new_tokens} new tokens, batch 1, median of {repeats}, "
             "interleaved")
    runs = {"torchllama": ours_runs(model, prompt, new_tokens)}
    if with_hf:
        try:
            runs["transformers"] = hf_runs(load_hf(path, torch_dtype), prompt, new_tokens)
        except ImportError:
            print_fn("(transformers is not installed: no side-by-side figures)")
        except Exception as e:                  # its loader's problem, not the benchmark's
            print_fn(f"(transformers could not load {path}: {e}; no side-by-side figures)")
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
        from torchllama.checkpoint import resolve_dtype, resolve_model_path
        from torchllama.serve import create_app, load_for_engine

        path = str(resolve_model_path(model_path))
        resolve_dtype(dtype)
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
