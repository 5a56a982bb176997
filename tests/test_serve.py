"""The OpenAI-compatible server end to end: `torchllama serve` runs in a subprocess on a free
loopback port with the embedded SmolLM2-135M-Instruct, and is driven by the official `openai`
client (raw HTTP with http.client where the test needs the bytes: errors, disconnects).

At temperature 0 every answer must be the tokens `Session` (one request, no batching) generates
in this process for the same prompt — also with 8 clients streaming at once, which the engine
decodes as one batch. Token counts in `usage` are checked against our tokenizer.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai")

from torchllama.generation.session import (SamplingParams, Session, StreamDecoder,  # noqa: E402
                                   encode_chat, encode_prompt)

REPO = Path(__file__).resolve().parents[1]
KEY = "testkey"
SECOND_KEY = "another-key"
MODEL = "SmolLM2-135M-Instruct"
LOG_LINE = re.compile(r"prompt_tokens=(\d+) completion_tokens=(\d+) latency=[\d.]+s "
                      r"tok/s=[\d.]+")


# --------------------------------------------------------------------------------------------
# Servers and clients
# --------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Server:
    port: int
    proc: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def http_json(port: int, method: str, path: str, body=None, key: str | None = KEY,
              timeout: float = 60.0) -> tuple[int, dict]:
    """One request over plain http.client: (status, parsed JSON body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn.request(method, path, None if body is None else json.dumps(body), headers)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(data) if data else {}
    except ValueError:                                  # e.g. a plain "Internal Server Error"
        return response.status, {"raw": data.decode(errors="replace")}


def start_server(tmp: Path, name: str, *args: str) -> Server:
    port = free_port()
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchllama", "serve", "--host", "127.0.0.1", "--port",
             str(port), *args],        # the default dtype: tests compare with Session
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Server(port, proc, log)


def wait_healthy(server: Server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"the server exited with {server.proc.returncode}:\n"
                        f"{server.log_text()[-3000:]}")
        try:
            status, body = http_json(server.port, "GET", "/health", key=None, timeout=2)
            if status == 200 and body.get("status") == "ok":
                return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"the server did not answer /health in {timeout} s:\n{server.log_text()[-3000:]}")


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def servers(smollm2_gguf, tmp_path_factory):
    """Two servers started together (their loads overlap): "main" with an API key and a batch
    of 8; "small" without a key, one row and a queue of one (to see 429)."""
    tmp = tmp_path_factory.mktemp("serve")
    started: dict[str, Server] = {}
    try:
        keys = tmp / "keys"
        keys.write_text(f"# the test keys\n{KEY}\n{SECOND_KEY}\n")
        started["main"] = start_server(tmp, "main", "--api-key-file", str(keys))
        started["small"] = start_server(tmp, "small", "--max-batch-size", "1", "--max-queue", "1")
        for server in started.values():
            wait_healthy(server)
        yield started
    finally:
        for server in started.values():
            stop(server)


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers["main"]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """(model, tokenizer) of SmolLM2 as the server loads it: the default dtype (the file's Q4_1
    blocks on torchllama's kernels). Every answer of the server, batched, chunked or under
    load, must equal this model's answer alone: the kernels are batch-invariant."""
    import torchllama

    return torchllama.load(smollm2_gguf, progress=False)


def greedy(smollm2, prompt_ids: list[int], max_tokens: int) -> tuple[str, list[int], str]:
    """What one request alone gets at temperature 0: (text, token ids, finish reason)."""
    model, tokenizer = smollm2
    session = Session(model, tokenizer)
    ids = list(session.generate(prompt_ids, max_tokens, SamplingParams(temperature=0.0)))
    stream = StreamDecoder(tokenizer, prompt_ids)
    text = "".join(stream.push(i) for i in ids) + stream.flush()
    return text, ids, session.stats.finish_reason


def stream_completion(client, **kwargs) -> tuple[str, str | None, list]:
    """Streamed completion: (concatenated text, last finish_reason, chunks)."""
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    return text, reasons[-1], chunks


def wait_idle(server: Server, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status, body = http_json(server.port, "GET", "/health", key=None)
        if status == 200 and body["active"] == 0:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"/health still reports {body} after {timeout} s")
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# Endpoints and outputs
# --------------------------------------------------------------------------------------------

def test_health_and_models(server, client):
    assert http_json(server.port, "GET", "/health", key=None) == (200, {"status": "ok",
                                                                       "active": 0,
                                                                       "waiting": 0})
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_equals_session_with_usage(client, smollm2):
    tokenizer = smollm2[1]
    for prompt, max_tokens in [("The capital of France is", 16), ("def fibonacci(n):", 12)]:
        ids = encode_prompt(tokenizer, prompt)
        text, new_ids, reason = greedy(smollm2, ids, max_tokens)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                      temperature=0)
        assert r.object == "text_completion" and r.model == MODEL and len(r.choices) == 1
        assert r.choices[0].text == text
        assert r.choices[0].finish_reason == reason
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == len(new_ids)
        assert r.usage.total_tokens == len(ids) + len(new_ids)


def test_completion_equals_cli_generate(client, smollm2_gguf):
    prompt = "The three primary colors are"
    out = subprocess.run(
        [sys.executable, "-m", "torchllama", "generate", "--prompt", prompt, "--temperature", "0",
         "--max-new-tokens", "12"], cwd=REPO, capture_output=True,
        text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert out.stdout == prompt + r.choices[0].text + "\n"


def test_streamed_completion_equals_non_streamed(client):
    kwargs = dict(prompt="Once upon a time", max_tokens=16, temperature=0)
    whole = client.completions.create(model=MODEL, **kwargs)
    text, reason, chunks = stream_completion(client, stream_options={"include_usage": True},
                                             **kwargs)
    assert text == whole.choices[0].text
    assert reason == whole.choices[0].finish_reason == "length"
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == \
        {**whole.usage.model_dump()}


def test_chat_completion_streamed_and_not(client, smollm2):
    tokenizer = smollm2[1]
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = encode_chat(tokenizer, messages)
    text, new_ids, reason = greedy(smollm2, ids, 24)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                       temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(new_ids))

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stop_strings_are_never_emitted(client):
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 4]          # a few characters mid-answer,
    expected = full[:full.index(stop)]                      # across token boundaries
    assert stop.strip() and expected

    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  stop=["<never appears>", stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16

    text, reason, chunks = stream_completion(client, prompt=prompt, max_tokens=16,
                                             temperature=0, stop=stop)
    assert text == expected and reason == "stop"
    emitted = ""
    for c in chunks:                              # at no point does the text reach the stop
        emitted += c.choices[0].text
        assert stop not in emitted and expected.startswith(emitted)


def test_n_choices(client):
    r = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=8,
                                  temperature=1, n=3, seed=11)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert 1 <= r.usage.completion_tokens <= 24

    chunks = list(client.completions.create(model=MODEL, prompt="My favourite animal is",
                                            max_tokens=6, temperature=1, n=2, seed=11,
                                            stream=True))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason is not None}
    assert set(finished) == {0, 1}


def test_seed_reproducibility(client):
    def sample(prompt, seed):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                         temperature=1, seed=seed).choices[0].text

    prompts = ["Once upon a time", "The weather today is", "My favourite food is"]
    first = [sample(p, 1234) for p in prompts]
    assert sample(prompts[0], 1234) == first[0]
    assert any(sample(p, 1235) != text for p, text in zip(prompts, first))


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
        r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 2 and all(v <= 0 for v in top.values())
        assert chosen == pytest.approx(max(top.values()))         # greedy: the most likely

    r = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2,
                                       messages=[{"role": "user", "content": "Say hello"}])
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and 1 <= len(t.top_logprobs) <= 2
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)


def test_max_tokens_beyond_the_context_is_not_an_error(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=10**6, temperature=0,
                                       messages=[{"role": "user", "content": "Say hi"}])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 64


def test_max_tokens_is_capped_by_the_context(smollm2):
    """The cap itself, on an in-process server whose model claims a 64-token context (a prompt
    near SmolLM2's real 8192 would take a minute to prefill on this machine)."""
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app

    model, tokenizer = smollm2

    class ShortContext:                      # the same model, with a 64-token context
        def __init__(self, model):
            self._model = model
            self.args = dataclasses.replace(model.args, max_seq_len=64)

        def __getattr__(self, name):
            return getattr(self._model, name)

        def __call__(self, *args, **kwargs):
            return self._model(*args, **kwargs)

    prompt = "one two three four five six seven eight nine ten " * 5
    ids = encode_prompt(tokenizer, prompt)
    assert 40 < len(ids) < 60
    app = create_app(ShortContext(model), tokenizer, MODEL, max_batch_size=2)
    with serve_in_thread(app) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as c:
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1000, temperature=0)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 64 - len(ids)
        status, body = http_json(int(url.rsplit(":", 1)[1]), "POST", "/v1/completions",
                                 {"prompt": prompt * 2, "max_tokens": 4})
        assert status == 400 and body["error"]["param"] == "prompt"


# --------------------------------------------------------------------------------------------
# Concurrency
# --------------------------------------------------------------------------------------------

CONCURRENT_PROMPTS = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):",
    "The best way to learn a language is", "Water boils at", "My favourite color is",
    "In 1492, Columbus", "The quick brown fox", "import numpy as np", "Dear John,",
    "Photosynthesis is", "The meaning of life is", "SELECT * FROM", "Hello, my name is",
    "The Eiffel Tower is", "Rain falls when",
]


def test_eight_concurrent_streams_equal_single_answers(client, smollm2):
    tokenizer = smollm2[1]
    jobs = [(p, 8 + (5 * i) % 9) for i, p in enumerate(CONCURRENT_PROMPTS)]   # 8..16 tokens
    expected = {job: greedy(smollm2, encode_prompt(tokenizer, job[0]), job[1])[::2]
                for job in jobs}

    def run(job):
        text, reason, _ = stream_completion(client, prompt=job[0], max_tokens=job[1],
                                            temperature=0)
        return job, (text, reason)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:     # 8 clients × 2 requests each
        results = dict(pool.map(run, jobs))
    assert results == expected


def test_chunked_and_batched_prefill_equal_single_answers(smollm2):
    """An in-process server prefilling at most 16 prompt tokens per engine iteration: a long
    prompt goes in chunks while short ones are admitted and decode; every answer is still the
    one `Session` gives alone. Also the non-streaming `bench serve` figures."""
    from torchllama.bench.serve import run_serve_bench, serve_in_thread
    from torchllama.serving.app import create_app

    model, tokenizer = smollm2
    prompts = ["The history of the printing press begins with " * 8] + CONCURRENT_PROMPTS[:3]
    assert len(encode_prompt(tokenizer, prompts[0])) > 4 * 16
    expected = [greedy(smollm2, encode_prompt(tokenizer, p), 6)[0] for p in prompts]
    app = create_app(model, tokenizer, MODEL, max_batch_size=4, prefill_chunk=16)
    with serve_in_thread(app) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as c:
        def run(prompt):
            return c.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                        temperature=0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(run, prompts)) == expected
        lines = []
        results = run_serve_bench(url, new_tokens=2, concurrencies=(1, 2), prompts=prompts[1:],
                                  stream=False, print_fn=lines.append)
        assert [(r.concurrency, r.requests, r.tokens) for r in results] == [(1, 3, 6), (2, 3, 6)]
        assert "non-streaming completions" in lines[0]


def test_bench_serve_starts_its_own_server_process_and_reports_its_exit(tmp_path):
    """Without --url, `bench serve` runs `torchllama serve` in a process of its own: it
    answers /health, and one that exits (a model file that is not there) is reported with its
    own error, not waited on."""
    from torchllama.bench.serve import serve_in_subprocess, stream_completion

    with serve_in_subprocess(["--max-batch-size", "2"]) as url:
        tokens, ttft, total = stream_completion(url, "The capital of France is", 4)
        assert tokens == 4 and 0 < ttft <= total
    with pytest.raises(RuntimeError, match=r"exited with 1:(.|\n)*missing\.gguf"):
        with serve_in_subprocess(["--model", str(tmp_path / "missing.gguf")]):
            pass


def test_queue_full_gives_429_and_no_key_needed_without_api_key(servers):
    small = servers["small"]                       # one row, one waiting request, no API key

    def post(i):
        return http_json(small.port, "POST", "/v1/completions", key=None,
                         body={"prompt": f"Story number {i}:", "max_tokens": 16,
                               "temperature": 0})

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(post, range(6)))
    statuses = [status for status, _ in results]
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses
    error = next(body for status, body in results if status == 429)["error"]
    assert error["type"] == "rate_limit_error" and error["message"]
    wait_idle(small)
    assert post(99)[0] == 200                     # and it serves again once the queue drains


# --------------------------------------------------------------------------------------------
# Errors, disconnects, robustness, logging
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"²": 1}}, "logit_bias"),
    ({"prompt": "hello " * 8300, "max_tokens": 3}, "prompt"),
])
def test_invalid_completion_requests(server, body, param):
    status, answer = http_json(server.port, "POST", "/v1/completions", body)
    assert status == 400
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param in error["message"] or "context" in error["message"]


def test_invalid_chat_requests(server):
    for body, param in [({"max_tokens": 3}, "messages"), ({"messages": []}, "messages"),
                        ({"messages": [{"role": "user", "content": "hi " * 8300}]},
                         "messages")]:
        status, answer = http_json(server.port, "POST", "/v1/chat/completions", body)
        assert status == 400 and answer["error"]["param"] == param


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello " * 8300, max_tokens=2)
    assert "8192" in e.value.body["message"]


def test_api_key_is_required(server):
    for key in (None, "wrong"):
        status, body = http_json(server.port, "POST", "/v1/completions",
                                 {"prompt": "x", "max_tokens": 1}, key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error"
    assert http_json(server.port, "GET", "/v1/models", key=None)[0] == 401
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.models.list()
        assert e.value.status_code == 401
    assert http_json(server.port, "GET", "/v1/models", key=SECOND_KEY)[0] == 200
    assert "shows the key" not in server.log_text()          # (a key file: no warning)


def open_stream(server: Server, body: dict, events: int, path: str = "/v1/completions") -> None:
    """Start a streaming request, read `events` SSE events, then drop the connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", path, json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    assert response.status == 200
    seen = 0
    while seen < events:
        if response.readline().startswith(b"data:"):
            seen += 1
    if conn.sock is not None:
        conn.sock.shutdown(socket.SHUT_RDWR)
    response.close()
    conn.close()


def test_client_disconnects_free_their_rows(server, client):
    # Streaming: gone after a few events.
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0}  # no EOS soon
    open_stream(server, body, events=3)
    wait_idle(server)
    # Not streaming: the client gives up waiting.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=1.0)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with pytest.raises(TimeoutError):
        conn.getresponse()
    conn.close()
    wait_idle(server)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_a_failing_request_does_not_stop_the_engine(server, client):
    # 1e-40 overflows logits / temperature to inf: the sampler fails for this request only.
    status, body = http_json(server.port, "POST", "/v1/completions",
                             {"prompt": "Hello", "max_tokens": 3, "temperature": 1e-40})
    assert status == 200 or (status == 500 and body["error"]["type"] == "server_error")
    wait_idle(server)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_bench_serve_cli(server, capsys, tmp_path):
    from torchllama.cli import main

    assert main(["bench", "serve", "--url", server.url, "--api-key", KEY,
                 "--new-tokens", "4", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
    assert [row[0] for row in rows] == ["1", "4", "8"]
    assert all(0 < int(row[1]) <= 8 * 4 and row[4].endswith("x") for row in rows)
    assert "median TTFT" in out
    (written,) = tmp_path.glob("*.json")
    assert len(json.loads(written.read_text())["runs"][0]["figures"]) == 6
    with pytest.raises(SystemExit) as exit_info:                  # --url is bench serve's
        main(["bench", "decode", "--url", server.url])
    assert exit_info.value.code == 2 and "--url" in capsys.readouterr().err


def test_one_log_line_per_request(server, client, smollm2):
    assert LOG_LINE.search(server.log_text())         # the earlier tests' requests
    prompt = "A log line for this request:"
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                      stream=stream)
        rid = list(r)[0].id if stream else r.id
        deadline = time.monotonic() + 5
        while True:                      # a stream logs once its last event is sent
            lines = [line for line in server.log_text().splitlines() if rid in line]
            if lines or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(lines) == 1, lines
        match = LOG_LINE.search(lines[0])
        assert match, lines[0]
        assert int(match.group(1)) == len(encode_prompt(smollm2[1], prompt))
        assert int(match.group(2)) == 5


# --------------------------------------------------------------------------------------------
# Structured output (response_format, grammar, regex), /metrics, the prefix cache under load
# --------------------------------------------------------------------------------------------

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"enum": ["Paris", "London", "Rome"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                  "maxItems": 3}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ORDER = {"type": "object",
         "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2,
                                  "items": {"type": "object",
                                            "properties": {"sku": {"type": "string",
                                                                   "pattern": "^[A-Z]{3}$"},
                                                           "qty": {"type": "integer",
                                                                   "minimum": 1}},
                                            "required": ["sku", "qty"],
                                            "additionalProperties": False}},
                        "paid": {"type": "boolean"}},
         "required": ["items", "paid"], "additionalProperties": False}


def test_json_schema_output_always_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    asks = [("Describe Ada, 36, who lives in Rome, as JSON.", PERSON),
            ("Give a person record as JSON.", PERSON),
            ("An order of two things, paid, as JSON.", ORDER)]
    done = 0
    for ask, schema, stream in [(*a, False) for a in asks] + [(*asks[0], True)]:
        if True:
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=120,
                          temperature=0.7, seed=1, n=2 if not stream else 1,
                          response_format={"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": schema}})
            if stream:
                chunks = list(client.chat.completions.create(stream=True, **kwargs))
                outs = [("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                         [c.choices[0].finish_reason for c in chunks if c.choices][-1])]
            else:
                r = client.chat.completions.create(**kwargs)
                outs = [(c.message.content, c.finish_reason) for c in r.choices]
            for text, reason in outs:
                if reason == "stop":
                    jsonschema.validate(json.loads(text), schema)
                    done += 1
                else:
                    assert reason == "length"
    assert done >= 4


def test_embeddings_are_the_models_pooled_hidden_states(client, server, smollm2):
    model, tok = smollm2
    texts = ["Hello world", "The cat sat on the mat and looked at the dog."]
    r = client.embeddings.create(model=MODEL, input=texts)
    got = torch.tensor([d.embedding for d in r.data])                  # (2, 576)
    ids = [tok.encode(t, bos=False) for t in texts]
    with torch.inference_mode():
        model.clear_caches()
        mean = torch.stack([model(torch.tensor([i]), hidden=True)[0].float().mean(0)
                            for i in ids])                             # each alone
        last = torch.stack([model(torch.tensor([i]), hidden=True)[0, -1].float() for i in ids])
    assert got.shape == (2, model.args.dim) and [d.index for d in r.data] == [0, 1]
    assert torch.equal(got, mean)                                      # float32 JSON round-trips
    assert r.usage.prompt_tokens == sum(map(len, ids))
    b64 = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="base64",
                                   extra_body={"pooling": "last"})
    vector = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")
    assert torch.equal(torch.from_numpy(vector.copy()), last[1])
    status, body = http_json(server.port, "POST", "/v1/embeddings",
                             {"input": "hi", "dimensions": 8})
    assert status == 400 and body["error"]["param"] == "dimensions"
    status, body = http_json(server.port, "POST", "/v1/embeddings", {"input": [[1, 10 ** 9]]})
    assert status == 400 and body["error"]["param"] == "input"
    status, body = http_json(server.port, "POST", "/v1/embeddings", {"input": ""})
    assert status == 400 and body["error"]["param"] == "input"


def test_embeddings_between_decode_steps_change_no_answer(client, smollm2):
    tokenizer = smollm2[1]
    prompts = ["The capital of France is", "def fibonacci(n):"]
    expected = [greedy(smollm2, encode_prompt(tokenizer, p), 48)[0] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(client.completions.create, model=MODEL, prompt=p, max_tokens=48,
                            temperature=0) for p in prompts]
        vectors = [pool.submit(client.embeddings.create, model=MODEL,
                               input=["a river", "the sea " * 40]) for _ in range(3)]
        texts = [r.result().choices[0].text for r in runs]
        got = [torch.tensor([d.embedding for d in v.result().data]) for v in vectors]
    assert texts == expected                       # the rows' caches were left alone
    assert all(torch.equal(g, got[0]) for g in got)


def test_json_grammars_bound_the_whitespace_between_tokens(smollm2):
    from llguidance import LLMatcher

    from torchllama.generation.grammar import Grammars, grammar_of

    _, tok = smollm2
    lltok = Grammars(tok).lltokenizer
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    def accepts(text: str) -> bool:
        matcher = LLMatcher(lltok, grammar_of("json_schema", schema), log_level=0)
        ids = tok.encode(text, bos=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    assert accepts('{"city":"Oslo"}') and accepts('{ "city": "Oslo" }')
    assert accepts('{\n  "city": "Oslo"\n}') and accepts('{\n\t"city": "Oslo"}')
    assert not accepts('{\n\n"city": "Oslo"}')                          # a blank line
    assert not accepts('{\n' + " " * 21 + '"city": "Oslo"}')             # a long indent
    assert not accepts('{"city": "Oslo"  }')


CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "country": {"type": "string", "maxLength": 24},
                       "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "country", "population"], "additionalProperties": False}


def test_json_schema_at_high_temperature_never_runs_away(client):
    jsonschema = pytest.importorskip("jsonschema")
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A European city as JSON."}],
        max_tokens=200, temperature=1.0, seed=3, n=8,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}})
    for choice in r.choices:                  # unbounded whitespace ran to max_tokens here
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), CITY)
        assert "\n\n" not in choice.message.content


def test_json_object_regex_and_grammars(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name, age as JSON, short."}],
        response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.lstrip().startswith("{")
    r = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0,
                                  extra_body={"regex": "[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].text)
    assert r.choices[0].finish_reason == "stop"
    for grammar in ('root ::= "yes" | "no"',                         # llama.cpp's GBNF
                    'start: "yes" | "no"'):                           # Lark
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
            max_tokens=10, temperature=0, extra_body={"grammar": grammar})
        assert r.choices[0].message.content in ("yes", "no")


def test_a_schema_cut_short_is_length_never_valid(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=5,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "p", "schema": PERSON}})
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


@pytest.mark.parametrize("extra,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"regex": "(("}, "regex", "unclosed group"),
    ({"grammar": "root ::= ("}, "grammar", ""),
    ({"regex": "a", "grammar": 'start: "a"'}, "response_format", "one of"),
])
def test_grammars_the_engine_cannot_compile_are_400(server, extra, param, message):
    status, body = http_json(server.port, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "x"}], **extra})
    assert status == 400, body
    assert body["error"]["param"] == param and message in body["error"]["message"]


def metric_values(server) -> dict[str, float]:
    """/metrics parsed by prometheus-client's own parser: {sample name{labels}: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/plain")
    text = response.read().decode()
    conn.close()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k in ("endpoint", "finish_reason"))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_count_requests_tokens_and_latencies(server, client):
    wait_idle(server)
    before = metric_values(server)
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=7,
                                  temperature=0)
    r2 = client.completions.create(model=MODEL, prompt="One two three", max_tokens=5,
                                   temperature=0, stream=True)
    streamed = sum(1 for c in r2 if c.choices and c.choices[0].text) >= 1
    after = metric_values(server)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert streamed
    assert delta("torchllama_requests_total{endpoint=completions,finish_reason=length}") == 2
    assert delta("torchllama_generation_tokens_total") == 7 + 5
    assert delta("torchllama_prompt_tokens_total") == r.usage.prompt_tokens + \
        len(encode_prompt(client_tokenizer(), "One two three"))
    assert delta("torchllama_time_to_first_token_seconds_count") == 2
    assert delta("torchllama_inter_token_latency_seconds_count") == 6 + 4
    assert after["torchllama_requests_running"] == 0 and after["torchllama_requests_waiting"] == 0
    assert "torchllama_prefix_cache_hits_total" in after
    e = client.embeddings.create(model=MODEL, input=["a river", "the sea"])
    later = metric_values(server)
    assert later["torchllama_requests_total{endpoint=embeddings,finish_reason=stop}"] - \
        after.get("torchllama_requests_total{endpoint=embeddings,finish_reason=stop}", 0) == 1
    assert later["torchllama_prompt_tokens_total"] - after["torchllama_prompt_tokens_total"] \
        == e.usage.prompt_tokens


def client_tokenizer():
    from torchllama.checkpoint.io import load_tokenizer
    from torchllama.checkpoint.common import resolve_model_path

    return load_tokenizer(resolve_model_path(None))


SYSTEM_PROMPTS = [
    "You are a careful assistant for a bakery in Lyon. You answer questions about bread, "
    "pastries, opening hours (7 am to 7 pm, closed on Mondays) and orders for events. " * 3,
    "You are a travel guide for the Italian lakes. You know the ferries of Lake Como, the "
    "villas, the walks and the restaurants, and you give short practical answers. " * 3]
QUESTIONS = ["What time do you open?", "Do you have croissants?", "Can I order a cake?",
             "Is there a ferry to Bellagio?", "Where can I walk?", "What should I eat?",
             "How much is a baguette?", "Are you open on Sunday?"]


@pytest.mark.parametrize("n_jobs", [24, pytest.param(72, marks=pytest.mark.slow)])
def test_load_with_shared_prefixes_and_dropped_streams_equals_alone(server, smollm2, n_jobs):
    """24 clients, 24 chat requests (72 in test-all: three each) on two shared system prompts,
    every tenth stream dropped mid-way: each finished answer is the answer alone (greedy), the
    prefix cache is hit, and the server answers normally afterwards."""
    model, tokenizer = smollm2
    jobs = [(SYSTEM_PROMPTS[i % 2], QUESTIONS[i % len(QUESTIONS)], 6 + i % 11, i % 10 == 9)
            for i in range(n_jobs)]
    messages = {job: [{"role": "system", "content": job[0]}, {"role": "user", "content": job[1]}]
                for job in jobs}
    before = metric_values(server)

    def run(job):
        body = {"messages": messages[job], "max_tokens": job[2], "temperature": 0,
                "stream": True}
        if job[3]:                                      # a client that goes away mid-stream
            open_stream(server, body, events=3, path="/v1/chat/completions")
            return job, None
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                           timeout=120) as c:
            chunks = list(c.chat.completions.create(model=MODEL, **body))
        return job, "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        results = dict(pool.map(run, jobs))
    expected = {}
    for job, text in results.items():
        if text is not None:
            key = (job[0], job[1], job[2])
            if key not in expected:
                expected[key] = greedy(smollm2, encode_chat(tokenizer, messages[job]), job[2])[0]
            assert text == expected[key], job
    after = metric_values(server)
    hits = n_jobs - 2 - n_jobs // 10      # all but the first of each system prompt (measured:
    #                                        23 of 24 and 72 of 72, ≈ 120 tokens each)
    assert after["torchllama_prefix_cache_hits_total"] - \
        before.get("torchllama_prefix_cache_hits_total", 0) >= hits * 3 // 4
    assert after["torchllama_prefix_cache_tokens_reused_total"] - \
        before.get("torchllama_prefix_cache_tokens_reused_total", 0) > hits * 3 // 4 * 100
    wait_idle(server, timeout=30)
    status, _ = http_json(server.port, "GET", "/health", key=None)
    assert status == 200


def test_constrained_and_free_requests_share_a_batch(client, smollm2):
    """Masks are per request: free requests decoded next to grammar-constrained ones get the
    answer they get alone."""
    tokenizer = smollm2[1]
    free = [("The capital of France is", 12), ("Water boils at", 10)]
    expected = [greedy(smollm2, encode_prompt(tokenizer, p), n)[0] for p, n in free]

    def run(i):
        if i < 2:
            return client.completions.create(model=MODEL, prompt=free[i][0],
                                             max_tokens=free[i][1], temperature=0
                                             ).choices[0].text
        return client.completions.create(model=MODEL, prompt="A code:", max_tokens=12,
                                         temperature=0, extra_body={"regex": "[A-Z]{2}[0-9]{3}"}
                                         ).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        out = list(pool.map(run, range(4)))
    assert out[:2] == expected
    assert all(re.fullmatch("[A-Z]{2}[0-9]{3}", text) for text in out[2:])
