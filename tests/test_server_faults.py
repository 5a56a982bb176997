"""The server under faults: one request failing among eight, a parser that raises, an engine
thread that dies, a client that stops reading, keys from a file and the environment.

Oracles: the same requests sent alone (the engine's guarantee: a row computes the same bits
whatever else runs, so the seven untouched answers equal their answers alone); the error
bodies and events' own fields (status, the request id, the cause).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import logging
import signal
import threading
import time

import pytest

from torchllama.serving.request import Request

PROMPTS = [f"Story number {i}: once upon a time" for i in range(8)]


class Injected(RuntimeError):
    """The fault a test injects."""


class EngineCrash(BaseException):
    """What kills the engine thread (not an Exception: nothing per request catches it)."""


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    """SmolLM2 (default dtype) served in this process: (app, url)."""
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    app = create_app(model, tokenizer, "m")
    with serve_in_thread(app) as url:
        yield app, url


def post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of one request."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", path, json.dumps(body),
                     {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}"), dict(response.headers)
    finally:
        conn.close()


def stream(url: str, body: dict, path: str = "/v1/completions",
           reasons: list | None = None) -> tuple[str, list[dict]]:
    """A streamed completion over http.client: (text, the error events); the finish reasons
    seen are appended to `reasons`."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    text, errors = "", []
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            elif event.get("choices"):
                text += event["choices"][0].get("text") or ""
                if event["choices"][0].get("finish_reason") and reasons is not None:
                    reasons.append(event["choices"][0]["finish_reason"])
    finally:
        conn.close()
    return text, errors


def completion(i: int, max_tokens: int = 24) -> dict:
    return {"prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0}


def test_an_injected_failure_ends_one_request_and_the_other_seven_are_exact(server):
    """Step 5 of the request for prompt 3 raises: its stream ends with an error event naming
    the request and the cause; the other seven, decoded in the same batch, equal their
    answers alone; the engine goes on serving."""
    app, url = server
    engine = app.state.engine
    tokenizer = app.state.service.tokenizer
    alone = [post(url, "/v1/completions", completion(i))[1]["choices"][0]["text"]
             for i in range(8)]

    def fault(request: Request, n: int) -> None:
        if n == 5 and "number 3" in tokenizer.decode(request.prompt_ids):
            raise Injected("injected at token 5")

    engine.fault = fault
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda i: stream(url, completion(i)), range(8)))
    finally:
        engine.fault = None
    for i, (text, errors) in enumerate(together):
        if i == 3:
            assert len(errors) == 1 and errors[0]["type"] == "server_error", errors
            assert "cmpl-" in errors[0]["message"] and "Injected: injected at token 5" in \
                errors[0]["message"]
            assert alone[3].startswith(text)                  # what came before was right
        else:
            assert errors == [] and text == alone[i], i
    status, body, _ = post(url, "/v1/completions", completion(3))
    assert status == 200 and body["choices"][0]["text"] == alone[3]


def test_a_failure_without_streaming_is_a_500_naming_the_request(server):
    app, url = server
    app.state.engine.fault = lambda request, n: (_ for _ in ()).throw(Injected("boom"))
    try:
        status, body, _ = post(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    finally:
        app.state.engine.fault = None
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "chatcmpl-" in body["error"]["message"] and "Injected: boom" in \
        body["error"]["message"]


def test_non_finite_logits_fail_their_row(server):
    """A row whose logits hold NaN is refused before sampling (`check_finite`), named."""
    from torchllama.serving.engine import check_finite

    import torch

    logits = torch.zeros(1, 8)
    check_finite(logits, 0)
    logits[0, 3] = float("-inf")                   # a masked token is fine
    check_finite(logits, 0)
    for bad in (float("nan"), float("inf")):
        logits[0, 5] = bad
        with pytest.raises(FloatingPointError, match="token 7"):
            check_finite(logits, 7)


def test_a_parser_that_raises_fails_its_request_only(server, monkeypatch):
    """The tool-call parser raising: that request's 500 (and its stream's error event) names
    it; a plain request running at the same time is answered."""
    from torchllama.serving import tools

    app, url = server
    plain = post(url, "/v1/completions", completion(1))[1]["choices"][0]["text"]

    def broken(self, text):
        raise Injected("parser bug")

    monkeypatch.setattr(tools.ToolCallParser, "feed", broken)
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 16,
            "temperature": 0, "tools": [{"type": "function", "function": {
                "name": "weather", "parameters": {"type": "object", "properties": {
                    "city": {"type": "string"}}}}}]}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        whole = pool.submit(post, url, "/v1/chat/completions", body)
        streamed = pool.submit(stream, url, body, "/v1/chat/completions")
        other = pool.submit(post, url, "/v1/completions", completion(1))
    status, answer, _ = whole.result()
    assert status == 500 and "chatcmpl-" in answer["error"]["message"] and \
        "Injected: parser bug" in answer["error"]["message"]
    _, errors = streamed.result()
    assert len(errors) == 1 and "parser bug" in errors[0]["message"]
    assert other.result()[1]["choices"][0]["text"] == plain


def test_a_client_that_stops_reading_has_its_generation_stopped():
    """More than MAX_UNREAD_EVENTS tokens unread: the request is aborted (its row freed) and
    the queue stops growing."""
    from torchllama.generation.sampling import SamplingParams
    from torchllama.serving.api import core
    from torchllama.serving.request import TokenEvent

    async def main():
        choice = core.Choice(0, [1], None, asyncio.get_running_loop())
        choice.request = Request([1], 10**6, SamplingParams(), frozenset(), choice.on_token,
                                 choice.on_finish, id="cmpl-x")
        for _ in range(core.MAX_UNREAD_EVENTS + 50):    # (the engine thread's pace: each
            choice.on_token(TokenEvent(7))              # event queued before the next)
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        return choice

    choice = asyncio.run(main())
    assert choice.request.cancelled.is_set() and "read nothing" in choice.request.error
    assert choice.events.qsize() == core.MAX_UNREAD_EVENTS


def test_the_queue_full_answer_says_when_to_retry(smollm2_gguf):
    """429 with Retry-After (one row, a queue of one, six requests at once)."""
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    app = create_app(model, tokenizer, "m", max_batch_size=1, max_queue=1)
    with serve_in_thread(app) as url:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda i: post(url, "/v1/completions", completion(i, 16)),
                                    range(6)))
    refused = [a for a in answers if a[0] == 429]
    assert refused and all(a[2].get("retry-after") == "1" for a in refused)
    assert refused[0][1]["error"]["type"] == "rate_limit_error"


def test_an_engine_that_dies_turns_health_and_requests_503(smollm2_gguf):
    """Something escapes the engine's per-request guards (a BaseException in its thread):
    the running request ends with an error event, /health answers 503 "failed", new requests
    503 with Retry-After."""
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    app = create_app(model, tokenizer, "m")
    with serve_in_thread(app) as url:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(stream, url, completion(0, 2000))
            time.sleep(1.0)

            def crash():
                raise EngineCrash("the engine thread broke")
            app.state.engine.call(crash)
            text, errors = running.result(timeout=60)
        assert len(errors) == 1 and "the engine failed" in errors[0]["message"], errors
        health = _get(url, "/health")
        assert health[0] == 503 and health[1]["status"] == "failed" and \
            "EngineCrash" in health[1]["error"]
        for path, body in (("/v1/completions", completion(1, 4)),
                           ("/v1/embeddings", {"input": "x"})):
            status, answer, headers = post(url, path, body)
            assert status == 503 and "failed" in answer["error"]["message"] and \
                headers.get("retry-after"), (path, answer)


def test_the_server_exits_1_once_its_engine_failed(smollm2_gguf):
    """`shutdown.Server` stops by itself with exit code 1 when the engine fails (for its
    supervisor to restart it), where a drained server exits 0."""
    import socket

    import uvicorn

    from torchllama.serving.app import create_app, load_for_engine
    from torchllama.serving.shutdown import Server

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    app = create_app(model, tokenizer, "m")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server(uvicorn.Config(app, log_level="warning"), app.state.engine,
                    app.state.drain, drain_timeout=5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def crash():
        raise EngineCrash("the engine thread broke")
    app.state.engine.call(crash)
    thread.join(timeout=30)
    assert not thread.is_alive() and server.exit_code == 1
    sock.close()


def _get(url: str, path: str) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    except OSError:
        return 0, {}
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------

def test_keys_come_from_a_file_the_environment_and_the_command_line(tmp_path, caplog):
    from torchllama.errors import ArgumentError
    from torchllama.serving.guard import api_keys

    keys = tmp_path / "keys"
    keys.write_text("# team keys\nalpha\n\n  beta  \n")
    with caplog.at_level(logging.WARNING):
        assert api_keys(None, str(keys), {"TORCHLLAMA_API_KEY": "gamma"}) == \
            ["alpha", "beta", "gamma"]
        assert not caplog.records
        assert api_keys("delta", None, {}) == ["delta"]
    assert "ps" in caplog.text and "--api-key-file" in caplog.text
    assert api_keys(None, None, {}) == []
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    for path, says in ((empty, "no key"), (tmp_path / "missing", "cannot read")):
        with pytest.raises(ArgumentError, match=says):
            api_keys(None, str(path), {})
    with pytest.raises(ArgumentError, match="whitespace"):
        api_keys(None, None, {"TORCHLLAMA_API_KEY": "two words"})


def test_several_keys_each_open_the_server(smollm2_gguf):
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    app = create_app(model, tokenizer, "m", api_key=["alpha", "beta"])
    body = {"prompt": "Hi", "max_tokens": 1}
    with serve_in_thread(app) as url:
        for headers, status in (({"Authorization": "Bearer alpha"}, 200),
                                ({"x-api-key": "beta"}, 200),
                                ({"Authorization": "Bearer gamma"}, 401), ({}, 401),
                                ({"Authorization": "Bearer alphabeta"}, 401)):
            assert post(url, "/v1/completions", body, headers)[0] == status, headers


# --------------------------------------------------------------------------------------------
# Graceful shutdown (`torchllama serve` in a subprocess, SIGTERM)
# --------------------------------------------------------------------------------------------

def test_sigterm_lets_eight_streams_finish_refuses_new_requests_and_exits_0(tmp_path):
    from tests.test_serve import start_server, stop, wait_healthy

    server = start_server(tmp_path, "drain", "--drain-timeout", "120")
    try:
        wait_healthy(server)
        reasons: list = []
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            streams = [pool.submit(stream, server.url, {                 # (long answers)
                "prompt": f"Count from {i} to 999, separated by commas: {i}, {i + 1},",
                "max_tokens": 160, "temperature": 0}, reasons=reasons) for i in range(8)]
            time.sleep(1.5)                              # all eight are generating
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            status, body, headers = post(server.url, "/v1/completions", completion(0, 4))
            health = _get(server.url, "/health")
            results = [f.result(timeout=120) for f in streams]
        assert status == 503 and headers.get("retry-after") and \
            "shutting down" in body["error"]["message"]
        assert health[0] == 503 and health[1]["status"] == "draining"
        assert all(errors == [] and text for text, errors in results)
        assert reasons == ["length"] * 8                  # each ran to its max_tokens
        assert server.proc.wait(timeout=60) == 0
        assert "draining: 8 running" in server.log_text(), server.log_text()
    finally:
        stop(server)


def test_streams_past_the_drain_timeout_end_with_an_error_event(tmp_path):
    """SIGINT (Ctrl-C) drains as SIGTERM does; streams still running after --drain-timeout
    end with a 503 error event, and the exit status is 0."""
    from tests.test_serve import start_server, stop, wait_healthy

    server = start_server(tmp_path, "cut", "--drain-timeout", "1")
    try:
        wait_healthy(server)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(stream, server.url, completion(i, 4000)) for i in range(2)]
            time.sleep(1.5)
            server.proc.send_signal(signal.SIGINT)
            results = [f.result(timeout=60) for f in streams]
        for text, errors in results:
            assert text and len(errors) == 1 and errors[0]["type"] == "service_unavailable"
            assert "shut down before this request finished" in errors[0]["message"]
        assert server.proc.wait(timeout=30) == 0
    finally:
        stop(server)


def test_text_longer_than_the_context_can_hold_is_refused_before_tokenizing(server,
                                                                            monkeypatch):
    """Megabytes of prompt are a 400 without being tokenized (the tokenizer holds the GIL
    while it works: every stream would stall): each token spells at most the longest
    token's bytes, so more than (context − 1) × that many bytes cannot fit. Text within
    the bound still goes through (and is refused by its token count if it is too long)."""
    app, url = server
    service = app.state.service
    calls = []
    encode = service.tokenizer.encode
    monkeypatch.setattr(service.tokenizer, "encode",
                        lambda text, *a, **k: calls.append(len(text)) or encode(text, *a, **k))
    huge = "to be or not to be " * (service.text_limit // 19 + 1)
    for path, body in (("/v1/completions", {"prompt": huge, "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": huge}]}),
                       ("/v1/embeddings", {"input": [huge]}), ("/tokenize", {"prompt": huge})):
        status, answer, _ = post(url, path, body)
        assert status == 400 and "bytes of text" in answer["error"]["message"], (path, answer)
    assert calls == []
    within = "to be or not to be " * 2000                 # ~12,000 tokens: past the context
    status, answer, _ = post(url, "/v1/completions", {"prompt": within, "max_tokens": 1})
    assert status == 400 and "tokens but the context holds" in answer["error"]["message"]
    assert calls


def test_a_grammar_the_vocabulary_cannot_spell_is_the_requests_400(server):
    """SmolLM2 has no token for byte 0xF1, so no character U+40000–U+7FFFF: a regex of one
    is the request's fault (400 naming it), not a server error (found by the fuzzing)."""
    _, url = server
    status, answer, _ = post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Write it."}], "max_tokens": 4,
        "regex": "\U00067ae9"})
    assert status == 400 and "cannot follow the request's grammar" in \
        answer["error"]["message"] and "chatcmpl-" in answer["error"]["message"], answer
