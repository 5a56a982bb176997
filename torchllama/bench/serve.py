"""`torchllama bench serve`: generated tokens/s of an OpenAI-compatible server (ours, started
in a process of its own, or any at --url) at 1, 4 and 8 concurrent streaming requests, and the
median time to first token (`run_serve_bench`). `serve_in_thread` and `stream_completion` are the
pieces the load test (torchllama.bench.load) and the server tests use too.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

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


@contextlib.contextmanager
def serve_in_subprocess(args: list[str], host: str = "127.0.0.1",
                        timeout: float = 180.0) -> Iterator[str]:
    """Run `torchllama serve ARGS` in a process of its own on a free port of `host`, as a user
    runs it: its clients (this process's threads) then share no interpreter lock with it.

    A context manager yielding the base URL once /health answers; on exit the server gets
    SIGTERM (its graceful shutdown) and is killed if it has not exited 30 s later.

    Raises:
        RuntimeError: the server exited or did not answer /health within `timeout` seconds
            (its last output lines quoted).
    """
    import socket
    import subprocess
    import sys
    import tempfile
    import urllib.request

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    url = f"http://{host}:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "torchllama", "serve", "--host", host,
                                 "--port", str(port), *args], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def tail() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")[-2000:]

        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"`torchllama serve` exited with {proc.returncode}:\n"
                                       f"{tail()}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"`torchllama serve` did not answer /health in "
                                       f"{timeout:.0f} s:\n{tail()}")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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
                    dtype: str = "float32", kv_cache_dtype: str = "auto",
                    concurrencies: tuple[int, ...] = (1, 4, 8),
                    prompts: Optional[list[str]] = None, stream: bool = True,
                    print_fn: Callable[[str], None] = print) -> list[ServeResult]:
    """Generated tokens/s of an OpenAI-compatible server at each concurrency, and the median
    time to first token; prints a table with the speedup over the first concurrency.

    Every level sends the same prompts (8 by default) with the same max_tokens, temperature 0,
    streaming completions (with stream=False: whole answers, whose "first token" arrives with
    the last), `concurrency` requests in flight at a time; tokens/s is the sum of
    the completion tokens (the servers' usage counts) over the level's wall time. One warm-up
    request runs first. Without `url`, the model (`model_path`, default the embedded
    SmolLM2-135M-Instruct) is served by `torchllama serve` in a process of its own
    (`serve_in_subprocess`) on a free loopback port, with a batch of max(concurrencies) rows
    and a KV cache of `kv_cache_dtype`, and stopped at the end: clients in the server's own
    process would take its interpreter lock for every event they parse, as no real client does.
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

        path = str(resolve_model_path(model_path))
        parse_dtype(dtype)
        batch = max(concurrencies)
        args = ["--model", path, "--dtype", dtype, "--kv-cache-dtype", kv_cache_dtype,
                "--max-batch-size", str(batch), "--max-queue", "64"]
        with serve_in_subprocess(args) as base_url:
            where = (f"{base_url} (`torchllama serve` in a process of its own, as a user runs "
                     f"it: {path}, {dtype}, KV cache {kv_cache_dtype}, "
                     f"{torch.get_num_threads()} threads, batch {batch})")
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


def result_runs(results: list[ServeResult], model: str):
    """The figures of `run_serve_bench` as `torchllama.bench.results` runs: tokens/s and
    median time to first token at each concurrency (no peer: each level's tokens/s ÷ one
    request's is in the figure's name)."""
    from torchllama.bench.results import Figure, Run

    one = results[0].tok_s if results else 0.0
    figures = []
    for r in results:
        scale = f" ({r.tok_s / one:.2f}× one)" if one and r.concurrency > 1 else ""
        figures += [Figure(f"{r.concurrency} concurrent{scale}", "tok/s", r.tok_s),
                    Figure(f"median TTFT at {r.concurrency}", "ms", r.ttft_median_s * 1e3,
                           higher_is_better=False)]
    return [Run(model, figures)]

