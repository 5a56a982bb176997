"""`torchllama bench load`: many clients against an OpenAI-compatible server at once.

N clients each send R chat requests one after another: a mix of short questions and long
shared system prompts (a few ~400-token "system" texts, so a prefix cache is hit), follow-up
turns (the client's previous conversation resent with the answer it got and a new question),
tool-calling requests (`bench.tool_sets`, "required" or "auto"), streaming and not, a fraction
of the streams dropped mid-way (the client closes the connection). Printed:
throughput (completion tokens/s over the wall time), p50/p99 time to first token, p50/p99
inter-token latency, errors; for torchllama's own server also the prefix cache's hit rate, the
process's RSS after warm-up and after the run, and (at temperature 0) whether every finished
answer equals the same request sent alone afterwards. With llama-cpp-python installed (and its
server's extras), `llama_cpp.server` runs the same load on the same file with the same threads.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit

SYSTEMS = [
    "You are the assistant of a bakery in Lyon. You answer questions about bread, pastries, "
    "opening hours (7 am to 7 pm, closed on Mondays), prices, allergens and orders for "
    "weddings, birthdays and company events. Be brief, friendly and precise. ",
    "You are a travel guide for the Italian lakes. You know the ferries of Lake Como and Lake "
    "Maggiore, the villas and their gardens, the walks above Bellagio and Varenna, and the "
    "restaurants by the water. Give short practical answers with times and prices. ",
    "You are a support agent for a small web hosting company. You help customers with domain "
    "names, e-mail accounts, SSL certificates, backups and the control panel. Ask for the "
    "domain name when you need it and never ask for passwords. ",
    "You are a tutor of elementary mathematics for children of ten. You explain fractions, "
    "decimals, areas and simple equations with everyday examples, one step at a time, and "
    "end with a small exercise. ",
]
QUESTIONS = ["What time do you open?", "Can I order a cake for Saturday?", "How long is it?",
             "Is there a ferry in the evening?", "My e-mail does not work.", "What is 3/4?",
             "Do you have gluten-free bread?", "Where should I walk?", "How do I renew SSL?",
             "Why is 0.5 equal to 1/2?", "How much is a croissant?", "What should I eat?"]
SHORT = ["Write a haiku about rain.", "Name three colors.", "Say hello in French.",
         "What is the capital of Italy?", "Count to five.", "Give me a fruit."]


@dataclass
class Job:
    messages: list[dict]
    max_tokens: int
    stream: bool
    drop_after: Optional[int] = None            # close the stream after this many events
    tools: Optional[list] = None                # with tool_choice: a tool-calling request
    tool_choice: Optional[str] = None
    follow_up: bool = False                     # messages continue the previous conversation

    def key(self) -> str:
        return json.dumps([self.messages, self.max_tokens, self.tools, self.tool_choice])

    def body(self, model: str) -> dict:
        body = {"model": model, "messages": self.messages, "max_tokens": self.max_tokens,
                "temperature": 0, "stream": self.stream}
        if self.tools:
            body.update(tools=self.tools, tool_choice=self.tool_choice)
        return body

    def after(self, previous: "Outcome") -> "Job":
        """This follow-up turn's job: the previous job's messages, the answer it got and this
        job's question (itself if it is not a follow-up or the previous one failed)."""
        if not self.follow_up or previous.error is not None or previous.dropped or \
                previous.job.tools:
            return self
        messages = previous.job.messages + [{"role": "assistant", "content": previous.text}]
        return dataclasses.replace(self, messages=messages + self.messages, follow_up=False)


@dataclass
class Outcome:
    job: Job
    text: str = ""
    tokens: int = 0
    ttft: Optional[float] = None
    itl: list[float] = field(default_factory=list)
    error: Optional[str] = None
    dropped: bool = False


def load_plan(clients: int, requests: int, drop: float, max_tokens: int = 32,
              system_repeat: int = 8, seed: int = 0, tools: float = 0.15,
              follow_ups: float = 0.25) -> list[list[Job]]:
    """Each client's jobs: a fraction `tools` tool-calling requests (a tool set's question with
    its tools, "required" or "auto"); of the rest, a fraction `follow_ups` (after a client's
    first job) next turns of the client's previous conversation (`Job.after`), 3 in 4 of the
    others a shared system prompt (~400 tokens: one of SYSTEMS repeated `system_repeat` times)
    + a question, else a short prompt alone; 3 in 4 streaming; a fraction `drop` of the streams
    dropped after a few events; max_tokens 8..max_tokens (tool calls: 64..96)."""
    from torchllama.bench.tool_sets import TOOL_SETS

    rng = random.Random(seed)
    plan = []
    for _ in range(clients):
        jobs = []
        for i in range(requests):
            stream = rng.random() < 0.75
            drop_after = rng.randint(2, 5) if stream and rng.random() < drop / 0.75 else None
            if rng.random() < tools:
                tool_set = rng.choice(TOOL_SETS)
                jobs.append(Job([{"role": "user", "content": rng.choice(tool_set.questions)}],
                                rng.randint(64, 96), stream, drop_after, tool_set.tools,
                                rng.choice(["required", "auto"])))
                continue
            if i and rng.random() < follow_ups:
                messages = [{"role": "user", "content": rng.choice(QUESTIONS)}]
                jobs.append(Job(messages, rng.randint(8, max_tokens), stream, drop_after,
                                follow_up=True))
                continue
            if rng.random() < 0.75:
                messages = [{"role": "system", "content": rng.choice(SYSTEMS) * system_repeat},
                            {"role": "user", "content": rng.choice(QUESTIONS)}]
            else:
                messages = [{"role": "user", "content": rng.choice(SHORT)}]
            jobs.append(Job(messages, rng.randint(8, max_tokens), stream, drop_after))
        plan.append(jobs)
    return plan


def _connection(url: str, timeout: float = 600.0):
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname, parts.port, timeout=timeout), parts.path.rstrip("/")


def send(url: str, job: Job, model: str, api_key: Optional[str] = None) -> Outcome:
    """One chat completion at temperature 0; streaming responses are read event by event."""
    out = Outcome(job)
    conn, prefix = _connection(url)
    body = job.body(model)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = last = time.perf_counter()
    try:
        conn.request("POST", prefix + "/v1/chat/completions", json.dumps(body), headers)
        response = conn.getresponse()
        if response.status != 200:
            out.error = f"HTTP {response.status}"
            return out
        if not job.stream:
            data = json.loads(response.read())
            message = data["choices"][0]["message"]
            out.text = (message.get("content") or "") + "".join(
                c["function"]["name"] + c["function"]["arguments"]
                for c in message.get("tool_calls") or ())
            out.tokens = data["usage"]["completion_tokens"]
            out.ttft = time.perf_counter() - t0
            return out
        events = 0
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                out.error = f"error event: {event['error']}"
                return out
            content = "".join(_delta_text(c.get("delta") or {})
                              for c in event.get("choices", ()))
            if content:
                now = time.perf_counter()
                if out.ttft is None:
                    out.ttft = now - t0
                else:
                    out.itl.append(now - last)
                last = now
                out.text += content
                out.tokens += 1
                events += 1
            if job.drop_after is not None and events >= job.drop_after:
                out.dropped = True
                return out
    except (OSError, ValueError, http.client.HTTPException) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return out


def _delta_text(delta: dict) -> str:
    """A stream delta's text: its content, or its tool calls' names and arguments."""
    calls = [c.get("function") or {} for c in delta.get("tool_calls") or ()]
    return (delta.get("content") or "") + "".join(
        (f.get("name") or "") + (f.get("arguments") or "") for f in calls)


@dataclass
class LoadResult:
    name: str
    outcomes: list[Outcome]
    seconds: float
    rss_mb: Optional[tuple[float, float]] = None      # after warm-up, after the run
    exact: Optional[tuple[int, int]] = None           # (equal alone, checked)
    prefix_hit_rate: Optional[float] = None

    def percentile(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))]

    def row(self) -> str:
        done = [o for o in self.outcomes if o.error is None]
        ttft = [o.ttft for o in done if o.ttft is not None and not o.dropped]
        itl = [x for o in done for x in o.itl]
        tokens = sum(o.tokens for o in done)
        cells = [f"{self.name:<12}", f"{len(self.outcomes):>5}",
                 f"{sum(o.dropped for o in done):>5}",
                 f"{sum(o.error is not None for o in self.outcomes):>4}",
                 f"{tokens / self.seconds:>7.1f}",
                 f"{self.percentile(ttft, 0.5) * 1e3:>7.0f}",
                 f"{self.percentile(ttft, 0.99) * 1e3:>7.0f}",
                 f"{self.percentile(itl, 0.5) * 1e3:>6.1f}",
                 f"{self.percentile(itl, 0.99) * 1e3:>6.1f}"]
        extra = []
        if self.prefix_hit_rate is not None:
            extra.append(f"prefix-cache hits {self.prefix_hit_rate:.0%}")
        if self.rss_mb is not None:
            a, b = self.rss_mb
            extra.append(f"RSS {a:.0f} → {b:.0f} MB ({(b - a) / a:+.1%})")
        if self.exact is not None:
            extra.append(f"equal alone {self.exact[0]}/{self.exact[1]}")
        return " ".join(cells) + ("   " + ", ".join(extra) if extra else "")


HEADER = (f"{'server':<12} {'reqs':>5} {'drop':>5} {'err':>4} {'tok/s':>7} {'TTFT50':>7} "
          f"{'TTFT99':>7} {'ITL50':>6} {'ITL99':>6}   (ms)")


def run_load(url: str, plan: list[list[Job]], model: str, api_key: Optional[str] = None
             ) -> tuple[list[Outcome], float]:
    """Every client (a thread) sends its jobs one after another; all clients at once."""
    outcomes: list[list[Outcome]] = [[] for _ in plan]

    def client(i: int) -> None:
        for job in plan[i]:
            if outcomes[i]:
                job = job.after(outcomes[i][-1])
            outcomes[i].append(send(url, job, model, api_key))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(plan))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [o for per in outcomes for o in per], time.perf_counter() - t0


def check_alone(url: str, outcomes: list[Outcome], model: str,
                api_key: Optional[str] = None) -> tuple[int, int]:
    """Send each finished request's job again, alone (one at a time, not streaming): how many
    answers equal what the client got under load, of how many checked."""
    alone: dict[str, str] = {}
    equal = checked = 0
    for o in outcomes:
        if o.error is not None or o.dropped:
            continue
        key = o.job.key()
        if key not in alone:
            job = dataclasses.replace(o.job, stream=False, drop_after=None)
            alone[key] = send(url, job, model, api_key).text
        checked += 1
        equal += alone[key] == o.text
    return equal, checked


def _rss_mb(pid: Optional[int] = None) -> float:
    status = Path(f"/proc/{pid or 'self'}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _warm_up(url: str, model: str, concurrency: int, system_repeat: int,
             api_key: Optional[str]) -> None:
    """Every system prompt once, then `concurrency` long requests at once (every cache row
    used to the load's depth)."""
    jobs = [Job([{"role": "system", "content": s * system_repeat},
                 {"role": "user", "content": QUESTIONS[0]}], 32, False) for s in SYSTEMS]
    for job in jobs:
        send(url, job, model, api_key)
    run_load(url, [[jobs[i % len(jobs)]] for i in range(concurrency)], model, api_key)


def _metric(url: str, name: str, api_key: Optional[str]) -> float:
    conn, prefix = _connection(url, 30)
    conn.request("GET", prefix + "/metrics",
                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    text = conn.getresponse().read().decode()
    conn.close()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def run_ours(path: str, dtype: str, plan: list[list[Job]], batch: int, check: bool,
             system_repeat: int) -> LoadResult:
    """The load against torchllama's server, in this process."""
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(path, dtype, progress=False)
    app = create_app(model, tokenizer, "torchllama", max_batch_size=batch,
                     max_queue=max(64, 2 * len(plan)))
    with serve_in_thread(app) as url:
        _warm_up(url, "torchllama", batch, system_repeat, None)
        hits0 = _metric(url, "torchllama_prefix_cache_hits_total", None)
        misses0 = _metric(url, "torchllama_prefix_cache_misses_total", None)
        rss0 = _rss_mb()
        outcomes, seconds = run_load(url, plan, "torchllama")
        time.sleep(1.0)                          # dropped streams: their rows are freed
        rss1 = _rss_mb()
        hits = _metric(url, "torchllama_prefix_cache_hits_total", None) - hits0
        misses = _metric(url, "torchllama_prefix_cache_misses_total", None) - misses0
        exact = check_alone(url, outcomes, "torchllama") if check else None
    return LoadResult("torchllama", outcomes, seconds, (rss0, rss1), exact,
                      hits / (hits + misses) if hits + misses else None)


def run_llama_cpp_server(path: str, plan: list[list[Job]], threads: int, context: int,
                         system_repeat: int) -> Optional[LoadResult]:
    """The same load against llama-cpp-python's server (`python -m llama_cpp.server`) on the
    same file and threads, or None when it is not installed."""
    import importlib.util
    import socket

    if importlib.util.find_spec("llama_cpp") is None or \
            importlib.util.find_spec("sse_starlette") is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", path, "--host", "127.0.0.1",
         "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
         "--n_ctx", str(context), "--verbose", "False",
         "--interrupt_requests", "False"],       # queue concurrent requests, do not cut them
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                conn, _ = _connection(url, 2)
                conn.request("GET", "/v1/models")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("llama_cpp.server did not start") from None
                time.sleep(0.5)
        _warm_up(url, "peer", 1, system_repeat, None)
        rss0 = _rss_mb(proc.pid)
        outcomes, seconds = run_load(url, plan, "peer")
        time.sleep(1.0)
        rss1 = _rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    return LoadResult("llama.cpp", outcomes, seconds, (rss0, rss1))


def prefix_cache_ttft(path: str, dtype: str, questions: int = 10, system_repeat: int = 8
                      ) -> tuple[float, float, int]:
    """Median time to first token of chat requests sharing a ~400-token system prompt (each
    with another question, one at a time, after one warm-up request with the same system
    prompt), on our server with its prefix cache and without (prefix_cache_mb=0): (with,
    without, prompt tokens) in seconds."""
    from torchllama.bench.serve import serve_in_thread
    from torchllama.generation.session import encode_chat
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(path, dtype, progress=False)
    system = SYSTEMS[0] * system_repeat
    jobs = [Job([{"role": "system", "content": system}, {"role": "user", "content": q}], 8, True)
            for q in (QUESTIONS * 2)[:questions + 1]]
    medians = []
    for budget in (512, 0):
        app = create_app(model, tokenizer, "torchllama", max_batch_size=1,
                         prefix_cache_mb=budget)
        with serve_in_thread(app) as url:
            send(url, jobs[0], "torchllama")                       # warm-up: fills the cache
            medians.append(statistics.median(send(url, j, "torchllama").ttft for j in jobs[1:]))
        model.clear_caches()
    return medians[0], medians[1], len(encode_chat(tokenizer, jobs[1].messages))


#: The JSON schema of the structured-output cost line.
PERSON_SCHEMA = {"type": "object",
                 "properties": {"name": {"type": "string"},
                                "age": {"type": "integer", "minimum": 0},
                                "tags": {"type": "array", "items": {"type": "string"},
                                         "maxItems": 3}},
                 "required": ["name", "age"], "additionalProperties": False}


def _tool_grammar(choice: str) -> tuple[str, str]:
    """("grammar", the Lark grammar) of the first tool set's tools under `choice`."""
    from torchllama.bench.tool_sets import TOOL_SETS
    from torchllama.serving.tools import tool_grammar, tools_of

    return "grammar", tool_grammar(tools_of(TOOL_SETS[0].tools, choice, None))


#: Constraints whose per-token cost the load bench prints: a JSON schema (structured output),
#: tool calls ("required": only calls) and "auto" tool calling (free text until a call).
JSON_PERSON = ("json_schema", PERSON_SCHEMA)
TOOLS_REQUIRED = _tool_grammar("required")
TOOLS_AUTO = _tool_grammar("auto")


def grammar_mask_cost(tokenizer, steps: int = 300, seed: int = 0,
                      spec: tuple[str, object] = JSON_PERSON) -> tuple[float, float, float]:
    """Seconds of one structured-output step — a constraint's allowed-token mask and its −inf
    logits (`Constraint.mask_logits`) — over `steps` tokens drawn among the allowed ones (a new
    document every 60 tokens or when one is complete): (median, p99, median of a document's
    first step, which includes compiling the grammar). `spec`: (kind, spec) as
    `Grammars.compile` takes it."""
    import torch

    from torchllama.generation.grammar import Grammars

    grammars, rng = Grammars(tokenizer), random.Random(seed)
    grammars.compile(*spec)                                 # the vocabulary's table, once
    logits = torch.zeros(1, tokenizer.vocab_size)
    times: list[float] = []
    firsts: list[float] = []
    while len(times) < steps:
        t0 = time.perf_counter()
        constraint = grammars.compile(*spec)
        constraint.mask_logits(logits)
        firsts.append(time.perf_counter() - t0)
        for _ in range(60):
            t0 = time.perf_counter()
            masked = constraint.mask_logits(logits)                       # (1, V)
            times.append(time.perf_counter() - t0)
            allowed = [t for t in torch.isfinite(masked[0]).nonzero().flatten().tolist()
                       if t not in tokenizer.stop_ids]
            if not allowed:
                break
            constraint.accept(rng.choice(allowed))
            if constraint.finished:
                break
    times.sort()
    return times[len(times) // 2], times[int(0.99 * len(times))], statistics.median(firsts)


def run_load_bench(model_path: Optional[str] = None, dtype: str = "auto", clients: int = 64,
                   requests: int = 10, drop: float = 0.1, max_tokens: int = 32, batch: int = 8,
                   peer: str = "llama.cpp", check: bool = True,
                   print_fn: Callable[[str], None] = print) -> list[LoadResult]:
    """Run the load (see the module docstring) against torchllama's server and, with
    peer="llama.cpp" where installed, llama-cpp-python's; print the table.

    Raises:
        ArgumentError: sizes below 1, drop outside [0, 0.75].
    """
    import torch

    from torchllama.checkpoint import parse_dtype, resolve_model_path
    from torchllama.errors import ArgumentError

    if clients < 1 or requests < 1 or batch < 1 or max_tokens < 8 or not 0 <= drop <= 0.75:
        raise ArgumentError("--clients, --requests, --batch ≥ 1, --new-tokens ≥ 8 and "
                            "0 ≤ --drop ≤ 0.75 expected")
    path = str(resolve_model_path(model_path))
    parse_dtype(dtype)
    system_repeat = 8
    plan = load_plan(clients, requests, drop, max_tokens, system_repeat)
    results = [run_ours(path, dtype, plan, batch, check, system_repeat)]
    if peer == "llama.cpp" and path.endswith(".gguf"):
        other = run_llama_cpp_server(path, plan, torch.get_num_threads(), 4096, system_repeat)
        if other is not None:
            results.append(other)
    print_fn(f"{path} ({dtype}), {clients} clients × {requests} chat requests, {drop:.0%} of "
             f"requests dropped mid-stream, max_tokens 8-{max_tokens}, temperature 0, "
             f"{torch.get_num_threads()} threads, torchllama batch {batch}; CPU "
             f"{torch.backends.cpu.get_cpu_capability()}")
    print_fn(HEADER)
    for r in results:
        print_fn(r.row())
    from torchllama.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(path)
    for label, spec in (("a JSON schema's", JSON_PERSON), ("tool calls' (required)",
                        TOOLS_REQUIRED), ("auto tool calling's (free text)", TOOLS_AUTO)):
        median, p99, first = grammar_mask_cost(tokenizer, spec=spec)
        print_fn(f"structured output: {label} token mask and −inf logits per token: "
                 f"{median * 1e6:.0f} µs median, {p99 * 1e6:.0f} µs p99; compiling it and the "
                 f"first mask {first * 1e3:.1f} ms (vocabulary of {tokenizer.vocab_size})")
    with_cache, without, n = prefix_cache_ttft(path, dtype)
    print_fn(f"prefix cache: a {n}-token chat prompt sharing its ~400-token system prompt with "
             f"the previous one, time to first token (median of 10, one at a time): "
             f"{with_cache * 1e3:.0f} ms with the cache, {without * 1e3:.0f} ms without "
             f"({without / with_cache:.1f}× lower)")
    return results


def result_runs(results: list[LoadResult], model: str):
    """The figures of `run_load_bench` as `torchllama.bench.results` runs: ours beside the
    llama.cpp server's where it ran (tokens/s, p50/p99 time to first token and inter-token
    latency)."""
    from torchllama.bench.results import Figure, Run

    def figures_of(r: LoadResult) -> list[tuple[str, str, float, bool]]:
        done = [o for o in r.outcomes if o.error is None]
        ttft = [o.ttft for o in done if o.ttft is not None and not o.dropped]
        itl = [x for o in done for x in o.itl]
        return [("throughput", "tok/s", sum(o.tokens for o in done) / r.seconds, True),
                ("TTFT p50", "ms", r.percentile(ttft, 0.5) * 1e3, False),
                ("TTFT p99", "ms", r.percentile(ttft, 0.99) * 1e3, False),
                ("ITL p50", "ms", r.percentile(itl, 0.5) * 1e3, False),
                ("ITL p99", "ms", r.percentile(itl, 0.99) * 1e3, False)]

    ours = figures_of(results[0])
    peer = figures_of(results[1]) if len(results) > 1 else None
    figures = [Figure(name, unit, value, peer[i][2] if peer else None, better)
               for i, (name, unit, value, better) in enumerate(ours)]
    return [Run(model, figures, results[1].name if peer else None,
                "its server (llama_cpp.server), the same file and threads" if peer else None)]

