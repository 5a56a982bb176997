"""`torchllama bench soak`: the server under a long mixed load from many Locust users.

    1. two LoRA adapters for the model (random, small) are written to a scratch folder
    2. `torchllama serve` starts in its own process with them (`--adapter a=… --adapter b=…`)
    3. Locust runs headless (`locustfile.py`: chat, completions with logprobs, tool calls,
       multi-turn replays, both adapters, embeddings, structured output, cancelled streams,
       the Responses and Messages APIs) for `minutes` with `users` users, while the server's
       RSS is sampled every few seconds
    4. the temperature-0 answers the users recorded are sent again, one at a time, to the idle
       server: each must equal what it got under load (a row computes the same bits whatever
       else runs)

Reported: requests and failures (5xx and lost streams, from Locust's statistics), RSS at the
end of the warm-up and its range after it (flat: within ±10%, the prefix cache bounded by its
budget), and how many sampled answers equal their answers alone.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

LOCUSTFILE = Path(__file__).with_name("locustfile.py")

#: seconds between two RSS samples of the server
RSS_EVERY = 5.0


@dataclass
class SoakResult:
    """What a soak measured.

    Attributes:
        minutes, users: the run's length and its Locust users.
        requests, failures: Locust's counts (429s of a full queue are not failures).
        server_errors: answers with a 5xx status; lost_streams: streams that ended without
            their final event.
        rss: (seconds since start, server RSS MiB) samples.
        warmup: seconds of warm-up before RSS is judged.
        sampled, equal: temperature-0 answers re-sent alone, and how many were equal.
        failure_lines: Locust's failures (method, name, error, occurrences).
    """

    minutes: float
    users: int
    requests: int = 0
    failures: int = 0
    server_errors: int = 0
    lost_streams: int = 0
    rss: list[tuple[float, float]] = field(default_factory=list)
    warmup: float = 120.0
    sampled: int = 0
    equal: int = 0
    failure_lines: list[tuple[str, str, str, int]] = field(default_factory=list)

    @property
    def rss_after_warmup(self) -> tuple[float, float, float]:
        """(RSS at the end of the warm-up, lowest after it, highest after it), MiB."""
        after = [mb for t, mb in self.rss if t >= self.warmup] or [mb for _, mb in self.rss[-1:]]
        return after[0], min(after), max(after)

    @property
    def rss_flat(self) -> bool:
        """RSS after the warm-up stays within ±10% of its value at the warm-up's end."""
        start, low, high = self.rss_after_warmup
        return low >= 0.9 * start and high <= 1.1 * start

    def lines(self) -> list[str]:
        start, low, high = self.rss_after_warmup
        out = [f"soak: {self.users} users for {self.minutes:g} min: {self.requests} requests, "
               f"{self.failures} failures ({self.server_errors} 5xx, {self.lost_streams} lost "
               f"streams)",
               f"server RSS after {self.warmup:.0f} s: {start:.0f} MiB, then {low:.0f}–"
               f"{high:.0f} MiB ({'flat' if self.rss_flat else 'NOT flat'}: ±10%)",
               f"temperature-0 answers equal to the same request alone: {self.equal}/"
               f"{self.sampled}"]
        out += [f"  failure: {m} {n}: {e} ×{c}" for m, n, e, c in self.failure_lines]
        return out


def make_adapters(model_path: Optional[str], folder: Path) -> dict[str, Path]:
    """Two random LoRA adapters (rank 4, B ~ N(0, 0.02²)) for the model: {"a": dir, "b": dir}."""
    import torch

    from torchllama.checkpoint import load
    from torchllama.transforms.lora import LoRAConfig, apply_lora, lora_modules, save_adapter

    model, _ = load(model_path, dtype="float32", progress=False)
    out = {}
    for seed, (name, targets) in enumerate({"a": ("wq", "wv"), "b": ("w2",)}.items()):
        adapted = model if seed == 0 else load(model_path, dtype="float32", progress=False)[0]
        config = LoRAConfig(r=4, alpha=8, targets=targets)
        torch.manual_seed(seed)
        apply_lora(adapted, config)
        with torch.no_grad():
            for module in lora_modules(adapted).values():
                module.lora_B.normal_(0.0, 0.02)
        out[name] = folder / name
        out[name].mkdir()
        save_adapter(adapted, config, out[name])
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    """A process's resident set size, MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_server(model_path: Optional[str], adapters: dict[str, Path], log: Path,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`torchllama serve` on a free port with the adapters; (process, URL) once healthy.

    Raises:
        RuntimeError: it exited or did not answer /health within 120 s (its log's tail).
    """
    import urllib.request

    port = _free_port()
    args = [sys.executable, "-m", "torchllama", "serve", "--port", str(port),
            "--prefix-cache-mb", "64", *extra]
    args += ["--model", model_path] if model_path else []
    for name, folder in adapters.items():
        args += ["--adapter", f"{name}={folder}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health in 120 s: {log.read_text()[-2000:]}")


def run_locust(url: str, users: int, seconds: float, folder: Path, model: str,
               record: Path) -> Path:
    """Locust headless against `url`; the prefix of its CSV statistics files.

    Raises:
        RuntimeError: Locust is not installed or did not run.
    """
    prefix = folder / "locust"
    env = {**os.environ, "TORCHLLAMA_SOAK_RECORD": str(record),
           "TORCHLLAMA_SOAK_MODEL": model}
    args = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "--host", url, "-u", str(users), "-r", str(max(1, users // 4)),
            "-t", f"{int(seconds)}s", "--csv", str(prefix), "--only-summary",
            "--stop-timeout", "60", "--loglevel", "WARNING"]
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    if not (folder / "locust_stats.csv").exists():
        raise RuntimeError(f"locust did not run (pip install locust): "
                           f"{(done.stderr or done.stdout)[-2000:]}")
    return prefix


def read_locust(prefix: Path, result: SoakResult) -> None:
    """Fill requests, failures, 5xx and lost streams from Locust's CSV files."""
    with open(f"{prefix}_stats.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["Name"] == "Aggregated":
                result.requests = int(row["Request Count"])
                result.failures = int(row["Failure Count"])
    with open(f"{prefix}_failures.csv", newline="") as f:
        for row in csv.DictReader(f):
            error, count = row["Error"], int(row["Occurrences"])
            result.failure_lines.append((row["Method"], row["Name"], error, count))
            if "lost stream" in error:
                result.lost_streams += count
            if re.search(r"\(['\"]5\d\d[: ]", error):     # CatchResponseError('503: …')
                result.server_errors += count


def check_alone(url: str, record: Path, most: int, seed: int = 0) -> tuple[int, int]:
    """Re-send up to `most` recorded temperature-0 requests one at a time (the server idle);
    (sampled, equal to their answer under load)."""
    import urllib.request

    lines = record.read_text().splitlines() if record.exists() else []
    rows = [json.loads(line) for line in lines]
    random.Random(seed).shuffle(rows)
    equal = 0
    for row in rows[:most]:
        body = {**row["body"], "stream": False}
        request = urllib.request.Request(url + "/v1/chat/completions",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        equal += answer == row["answer"]
    return min(len(rows), most), equal


def run_soak(model_path: Optional[str] = None, minutes: float = 20.0, users: int = 16,
             warmup: float = 120.0, sample: int = 40,
             print_fn: Callable[[str], None] = print) -> SoakResult:
    """The soak (see the module docstring). Returns its `SoakResult`.

    Raises:
        RuntimeError: the server or Locust did not start.
    """
    result = SoakResult(minutes, users, warmup=warmup)
    with tempfile.TemporaryDirectory(prefix="torchllama-soak-") as tmp:
        folder = Path(tmp)
        print_fn("writing two LoRA adapters…")
        adapters = make_adapters(model_path, folder)
        proc, url = start_server(model_path, adapters, folder / "server.log")
        name = Path(model_path).name if model_path else "SmolLM2-135M-Instruct"
        stop = threading.Event()
        started = time.monotonic()

        def sample_rss() -> None:
            while not stop.is_set():
                result.rss.append((time.monotonic() - started, _rss_mib(proc.pid)))
                stop.wait(RSS_EVERY)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        try:
            print_fn(f"locust: {users} users for {minutes:g} min against {url}…")
            prefix = run_locust(url, users, minutes * 60, folder, name, folder / "record.jsonl")
            stop.set()
            sampler.join()
            read_locust(prefix, result)
            result.sampled, result.equal = check_alone(url, folder / "record.jsonl", sample)
        finally:
            stop.set()
            proc.terminate()
            proc.wait(timeout=60)
    for line in result.lines():
        print_fn(line)
    return result


def result_runs(result: SoakResult, model: str):
    """The soak as `torchllama.bench.results` runs (no peer: figures of ours alone)."""
    from torchllama.bench.results import Figure, Run

    start, low, high = result.rss_after_warmup
    figures = [Figure("requests", "", result.requests, None),
               Figure("failures", "", result.failures, None, higher_is_better=False),
               Figure("5xx", "", result.server_errors, None, higher_is_better=False),
               Figure("lost streams", "", result.lost_streams, None, higher_is_better=False),
               Figure("RSS after warm-up", "MiB", start, None, higher_is_better=False),
               Figure("RSS range after warm-up", "%", 100 * (high - low) / start, None,
                      higher_is_better=False),
               Figure("answers equal alone", "%", 100 * result.equal / max(result.sampled, 1),
                      None)]
    return [Run(f"{model}: soak, {result.users} users × {result.minutes:g} min", figures,
                settings={"users": result.users, "minutes": result.minutes,
                          "warmup_s": result.warmup, "sampled": result.sampled})]
