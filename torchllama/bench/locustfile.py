"""The soak's users, for Locust (`torchllama bench soak` runs it headless; or by hand:
`locust -f torchllama/bench/locustfile.py --host http://127.0.0.1:8000`).

Never imported by torchllama itself: Locust runs it (under gevent). Each user picks, by
weight, one of the things people do with the server:

    chat             a question, streamed or not; the temperature-0 ones recorded (prompt,
                     answer) for the bench to compare with the same request alone
    completions      with logprobs (5 alternatives)
    tools            a forced function call (tool_choice "required")
    multi_turn       a conversation resent whole with each new turn (the prefix cache)
    adapter          a chat on LoRA adapter "a" or "b" (`--adapter a=… --adapter b=…`)
    embeddings       two inputs
    structured       response_format json_schema
    cancelled        a stream dropped after a few events
    responses, messages   the Responses and Anthropic Messages APIs

Failures are Locust's own: any status ≥ 400 but the 429s of a full queue (the load asks for
more than the server holds), and a stream that ends without its final event ("lost
stream"). Environment: TORCHLLAMA_SOAK_RECORD, the JSON-lines file for recorded answers;
TORCHLLAMA_SOAK_MODEL, the served model's name.
"""

from __future__ import annotations

import json
import os
import random

from locust import HttpUser, between, events, task

MODEL = os.environ.get("TORCHLLAMA_SOAK_MODEL", "SmolLM2-135M-Instruct")
RECORD = os.environ.get("TORCHLLAMA_SOAK_RECORD")

QUESTIONS = ["What is the capital of France?", "Name three fruits.", "Why is the sea salty?",
             "Write a haiku about rain.", "How do bees make honey?", "Say hello in Italian.",
             "What is 12 times 7?", "Give me a tip for sleeping well.", "What is a comet?",
             "Describe a cat in one sentence.", "What do plants need to grow?",
             "How many legs does a spider have?"]
SYSTEM = ("You are the assistant of a bakery in Lyon. You answer questions about bread, "
          "pastries, opening hours (7 am to 7 pm, closed on Mondays), prices and orders. ") * 6
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city"]}}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _record(kind: str, body: dict, answer: str) -> None:
    if RECORD:
        with open(RECORD, "a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": kind, "body": body, "answer": answer}) + "\n")


class Client(HttpUser):
    """One person using the server: a request, a short pause, the next."""

    wait_time = between(0.05, 0.5)

    def _json(self, path: str, body: dict, name: str):
        """POST a body; the parsed answer, or None (a 429 is no failure: the load is over
        the queue's size on purpose)."""
        with self.client.post(path, json=body, name=name, catch_response=True,
                              timeout=600) as response:
            return None if _refused(response) else response.json()

    def _stream(self, path: str, body: dict, name: str, drop_after: int | None = None,
                final: tuple[bytes, ...] = (b"data: [DONE]",)) -> str | None:
        """Stream a body; the text of its deltas, or None. A stream that ends without one of
        its final events (`final`: the prefixes of their lines) is a failure ("lost
        stream"); `drop_after` events: close it."""
        with self.client.post(path, json={**body, "stream": True}, name=name, stream=True,
                              catch_response=True, timeout=600) as response:
            if _refused(response):
                return None
            text, seen, complete = [], 0, False
            for line in response.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                seen += 1
                if line.startswith(final):
                    complete = True
                    break
                if b'"error"' in line[:40]:
                    response.failure(f"error event: {line[:200]!r}")
                    return None
                if drop_after is not None and seen >= drop_after:
                    response.success()
                    response.close()              # the client goes away mid-stream
                    return None
                text.append(_delta(json.loads(line[6:])))
            if not complete:
                response.failure("lost stream: it ended without its final event")
                return None
            response.success()
            return "".join(text)

    @task(6)
    def chat(self):
        body = {"model": MODEL, "messages": [{"role": "user",
                                              "content": random.choice(QUESTIONS)}],
                "max_tokens": random.randint(8, 48), "temperature": 0}
        if random.random() < 0.5:
            answer = self._stream("/v1/chat/completions", body, "chat (stream)")
        else:
            data = self._json("/v1/chat/completions", body, "chat")
            answer = data["choices"][0]["message"]["content"] if data else None
        if answer is not None:
            _record("chat", body, answer)

    @task(2)
    def completions(self):
        self._json("/v1/completions", {"model": MODEL, "prompt": random.choice(QUESTIONS),
                                       "max_tokens": 16, "logprobs": 5, "temperature": 0.7},
                   "completions + logprobs")

    @task(2)
    def tools(self):
        self._json("/v1/chat/completions", {
            "model": MODEL, "max_tokens": 64, "temperature": 0, "tools": WEATHER,
            "tool_choice": "required",
            "messages": [{"role": "user", "content": "What is the weather in Oslo?"}]},
            "tool call")

    @task(2)
    def multi_turn(self):
        messages = [{"role": "system", "content": SYSTEM}]
        for question in random.sample(QUESTIONS, 3):
            messages.append({"role": "user", "content": question})
            data = self._json("/v1/chat/completions", {
                "model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0},
                "multi-turn")
            if data is None:
                return
            messages.append({"role": "assistant",
                             "content": data["choices"][0]["message"]["content"]})

    @task(2)
    def adapter(self):
        body = {"model": random.choice(["a", "b"]), "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": random.choice(QUESTIONS)}]}
        answer = self._stream("/v1/chat/completions", body, "adapter (stream)")
        if answer is not None:
            _record("chat", body, answer)

    @task(1)
    def embeddings(self):
        self._json("/v1/embeddings", {"model": MODEL, "input": random.sample(QUESTIONS, 2)},
                   "embeddings")

    @task(1)
    def structured(self):
        self._json("/v1/chat/completions", {
            "model": MODEL, "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": "Invent a person."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": PERSON}}},
            "structured output")

    @task(2)
    def cancelled(self):
        self._stream("/v1/chat/completions", {
            "model": MODEL, "max_tokens": 200, "temperature": 0.8,
            "messages": [{"role": "user", "content": "Tell me a long story."}]},
            "cancelled stream", drop_after=random.randint(2, 6))

    @task(1)
    def responses(self):
        self._stream("/v1/responses", {"model": MODEL, "input": random.choice(QUESTIONS),
                                       "max_output_tokens": 16, "temperature": 0,
                                       "store": False},
                     "responses (stream)", final=(b'data: {"type": "response.completed"',
                                                  b'data: {"type": "response.incomplete"'))

    @task(1)
    def messages(self):
        self._json("/v1/messages", {"model": MODEL, "max_tokens": 16, "temperature": 0,
                                    "messages": [{"role": "user",
                                                  "content": random.choice(QUESTIONS)}]},
                   "messages")


def _refused(response) -> bool:
    """Whether the answer is not a 200: a 429 (the queue full: the load asks for more than
    the server holds on purpose) counts as a success, any other status as a failure."""
    if response.status_code == 429:
        response.success()
        return True
    if response.status_code != 200:
        response.failure(f"{response.status_code}: {response.text[:200]}")
        return True
    return False


def _delta(event: dict) -> str:
    """The text of a chat chunk (other events: '')."""
    choices = event.get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


@events.quitting.add_listener
def _exit_code(environment, **kwargs):
    """Locust's exit status: 1 when anything failed."""
    environment.process_exit_code = 1 if environment.stats.total.num_failures else 0
