"""Benchmark results as data: what `torchllama bench …` measured, written to a JSON file, and
the documentation's benchmarks page rendered from the committed files.

One results file per run of a bench command (`write`, atomically, into `--results`, default
`benchmarks/results/`):

    {"schema": 1, "benchmark": "decode", "command": "torchllama bench decode --peer llama.cpp",
     "date": "2026-11-27T18:00:00+00:00",
     "machine": {"cpu": "AMD EPYC …", "cores": 2, "flags": ["avx2", "avx512f", …],
                 "torch_capability": "AVX512", "kernels": "avx512_vnni", "memory_gib": 23.5},
     "versions": {"torchllama": "<git commit>", "torch": "2.13.0+cpu", "python": "3.11.7",
                  "peer": "llama-cpp-python 0.3.36"},
     "runs": [{"model": "SmolLM2-135M-Instruct (Q4_1)", "peer": "llama.cpp",
               "peer_setting": "flash attention on and off, the faster",
               "settings": {...}, "figures": [{"name": "decode b1", "unit": "tok/s",
                                                "ours": 195.2, "peer": 141.0}, …]}]}

`render` turns every file into markdown: one section per machine (CPU, cores, torch's CPU
capability and our kernels' instruction set), one table per benchmark and model, each figure
ours / the peer / the ratio; where the same figure was measured in several files on one
machine, the spread of its ratio (the machine's noise band: these machines are shared, and a
single run's absolute numbers move by tens of percent from minute to minute).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

SCHEMA = 1
#: where `torchllama bench` writes results by default (relative to the working directory)
DEFAULT_FOLDER = "benchmarks/results"
#: CPU flags worth naming beside a figure (what our kernels and llama.cpp's dispatch on)
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
         "avx512_bf16", "amx_tile")


@dataclass
class Figure:
    """One measured number, ours beside the peer's (None: no peer)."""

    name: str
    unit: str
    ours: float
    peer: Optional[float] = None
    higher_is_better: bool = True

    @property
    def ratio(self) -> Optional[float]:
        """ours ÷ peer (for a lower-is-better figure, peer ÷ ours: > 1 means ours is better)."""
        if self.peer is None or not self.peer or not self.ours:
            return None
        return self.ours / self.peer if self.higher_is_better else self.peer / self.ours


@dataclass
class Run:
    """The figures of one model (or shape) in one bench command."""

    model: str
    figures: list[Figure]
    peer: Optional[str] = None
    peer_setting: Optional[str] = None
    settings: dict = field(default_factory=dict)


def machine() -> dict:
    """What the figures depend on: the CPU (model name, cores, flags), torch's CPU capability,
    our kernels' instruction set, the memory."""
    import torch

    from torchllama.kernels import isa

    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("", platform.machine(),
                                                         platform.processor()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"cpu": cpu, "cores": os.cpu_count(), "flags": [f for f in FLAGS if f in flags],
            "torch_capability": torch.backends.cpu.get_cpu_capability(), "kernels": isa(),
            "threads": torch.get_num_threads(),
            "memory_gib": round(pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 30, 1)}


def versions(peer: Optional[str] = None) -> dict:
    """torchllama's commit (when run from a git checkout), torch's, Python's, the peer's."""
    import torch

    out = {"torchllama": _commit(), "torch": torch.__version__,
           "python": platform.python_version()}
    if peer is not None:
        out["peer"] = peer
    return out


def _commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent, timeout=5)
        return commit.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def document(benchmark: str, runs: list[Run], peer_version: Optional[str] = None,
             argv: Optional[list[str]] = None) -> dict:
    """A results file's content: the runs, the command, the date, the machine, the versions."""
    argv = sys.argv[1:] if argv is None else argv
    return {"schema": SCHEMA, "benchmark": benchmark,
            "command": "torchllama " + " ".join(shlex.quote(a) for a in argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "versions": versions(peer_version),
            "runs": [asdict(r) for r in runs]}


def write(data: dict, folder: str | os.PathLike) -> Path:
    """Write a results document to a new file in `folder` (created if needed), atomically;
    returns its path: DATE-BENCHMARK.json (a counter appended if taken)."""
    from torchllama.checkpoint.common import atomic_output

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = data["date"][:19].replace(":", "").replace("-", "")
    path = folder / f"{stamp}-{data['benchmark'].replace(' ', '-')}.json"
    n = 1
    while path.exists():
        n += 1
        path = folder / f"{stamp}-{data['benchmark'].replace(' ', '-')}-{n}.json"
    with atomic_output(path, folder=False) as tmp:
        tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return path


def save(benchmark: str, runs: list[Run], folder: Optional[str],
         peer_version: Optional[str] = None, print_fn=print,
         argv: Optional[list[str]] = None) -> Optional[Path]:
    """`write` the runs of a bench command (its arguments `argv`) unless `folder` is None or
    "none"; says where."""
    if folder is None or str(folder).lower() in ("", "none"):
        return None
    path = write(document(benchmark, runs, peer_version, argv), folder)
    print_fn(f"results written to {path}")
    return path


def load_results(folder: str | os.PathLike) -> list[dict]:
    """Every results file of `folder` (*.json), oldest first.

    Raises:
        ValueError: a file that is not a results document of this schema (naming it).
    """
    out = []
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA or "runs" not in data:
            raise ValueError(f"{path}: not a torchllama results file (schema {SCHEMA})")
        data["file"] = path.name
        out.append(data)
    return sorted(out, key=lambda d: d["date"])


# --------------------------------------------------------------------------------------------
# The benchmarks page
# --------------------------------------------------------------------------------------------

def _machine_key(m: dict) -> str:
    return (f"{m['cpu']}, {m['cores']} cores ({m['threads']} threads), torch CPU capability "
            f"{m['torch_capability']}, torchllama kernels {m['kernels']}")


def _value(v: Optional[float], unit: str) -> str:
    if v is None:
        return "–"
    if not unit and float(v).is_integer():                  # counts: requests, failures
        return str(int(v))
    return f"{v:.2f}" if unit in ("s", "GiB", "GB", "ms") or v < 10 else f"{v:.1f}"


def _table(doc: dict, run: dict) -> list[str]:
    peer = run.get("peer")
    head = f"| figure | ours | {peer} | ours vs {peer} |" if peer else "| figure | ours |"
    lines = [head, "|---|---|---|---|" if peer else "|---|---|"]
    for f in run["figures"]:
        fig = Figure(**f)
        cells = [f"{fig.name} ({fig.unit})" if fig.unit else fig.name,
                 _value(fig.ours, fig.unit)]
        if peer:
            ratio = fig.ratio
            cells += [_value(fig.peer, fig.unit), f"**{ratio:.2f}×**" if ratio else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _noise(docs: list[dict]) -> list[str]:
    """The spread of each ratio measured more than once on one machine."""
    seen: dict[tuple, list[float]] = {}
    for doc in docs:
        for run in doc["runs"]:
            for f in run["figures"]:
                ratio = Figure(**f).ratio
                if ratio is not None:
                    seen.setdefault((doc["benchmark"], run["model"], f["name"]), []).append(ratio)
    rows = [(k, v) for k, v in seen.items() if len(v) > 1]
    if not rows:
        return []
    lines = ["", "The same figures in several runs on this machine (its noise band): ", "",
             "| benchmark | model | figure | runs | ratio, lowest – highest |",
             "|---|---|---|---|---|"]
    for (bench, model, name), ratios in rows:
        lines.append(f"| {bench} | {model} | {name} | {len(ratios)} | "
                     f"{min(ratios):.2f}× – {max(ratios):.2f}× |")
    return lines


def render(docs: list[dict]) -> str:
    """Markdown of every results document: a section per machine, a table per run."""
    if not docs:
        return "No results are committed yet: run `make bench` or `make bench-peer`.\n"
    machines: dict[str, list[dict]] = {}
    for doc in docs:
        machines.setdefault(_machine_key(doc["machine"]), []).append(doc)
    out = []
    for key, group in machines.items():
        out += [f"## {key}", ""]
        for doc in group:
            v = doc["versions"]
            peer = f", {v['peer']}" if "peer" in v else ""
            for run in doc["runs"]:
                out += [f"### {doc['benchmark']}: {run['model']}", "",
                        f"`{doc['command']}` — {doc['date'][:16].replace('T', ' ')} UTC, "
                        f"torchllama {v['torchllama']}, torch {v['torch']}{peer}"
                        + (f"; {run['peer']}: {run['peer_setting']}"
                           if run.get("peer_setting") else "") + "  ", "",
                        *_table(doc, run), ""]
        out += _noise(group) + [""]
    return "\n".join(out)


def summary(docs: list[dict]) -> str:
    """The README's speed table: for each (benchmark, model, CPU) measured against a peer, each
    figure's latest ratio, one row each (ours ÷ the peer; > 1: ours is faster). A figure keeps
    its latest value even where a later run measured other figures of the same model (a
    2048-token prefill run does not hide the 128- and 512-token ones); a model measured on two
    CPUs (or kernel levels) has a row for each (the machines are lent by chance: one run's CPU may differ from the
    last's)."""
    latest: dict[tuple, dict[str, dict]] = {}
    for doc in docs:                                       # oldest first: the last one wins
        cpu = _cpu_name(doc["machine"])
        for run in doc["runs"]:
            if run.get("peer"):
                key = (doc["benchmark"], run["model"], run["peer"], cpu)
                figures = latest.setdefault(key, {})
                for f in run["figures"]:
                    figures[f["name"]] = f
    lines = ["| model | against | CPU | ours ÷ theirs |", "|---|---|---|---|"]
    for (_, model, peer, cpu), figures in latest.items():
        cells = []
        for f in figures.values():
            ratio = Figure(**f).ratio
            if ratio is not None and f["unit"] == "tok/s":
                cells.append(f"{f['name']} **{ratio:.2f}×**")
        lines.append(f"| {model} | {peer} | {cpu} | {' · '.join(cells)} |")
    return "\n".join(lines) + "\n"


def _cpu_name(machine: dict) -> str:
    """The CPU and the kernels' instruction set: 'Intel Xeon, avx512_vnni' (a run capped at a
    lower level by TORCHLLAMA_KERNELS_ISA gets a row of its own)."""
    cpu = " ".join(machine["cpu"].replace("(R)", "").replace("(TM)", "")
                   .replace(" Processor", "").split())
    return f"{cpu}, {machine['kernels']}" if machine.get("kernels") else cpu


START, END = "<!-- speed-summary:start -->", "<!-- speed-summary:end -->"


def update_readme(readme: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Put `summary` of the results in `folder` between the README's speed-summary markers
    (atomically); returns whether the file changed.

    Raises:
        ValueError: the README has no markers.
    """
    from torchllama.checkpoint.common import atomic_output

    path = Path(readme)
    text = path.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{path}: no {START} … {END} markers")
    head, rest = text.split(START, 1)
    new = head + START + "\n" + summary(load_results(folder)) + END + rest.split(END, 1)[1]
    if new == text:
        return False
    with atomic_output(path, folder=False, force=True) as tmp:   # (the README is rewritten)
        tmp.write_text(new)
    return True


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m torchllama.bench.results README.md [FOLDER]`: rewrite the README's speed
    table from the results in FOLDER. Returns the exit status."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m torchllama.bench.results",
                                     description="Write a README's speed table (between "
                                     f"{START} and {END}) from benchmark results files.")
    parser.add_argument("readme", help="the Markdown file to update")
    parser.add_argument("folder", nargs="?", default=str(DEFAULT_FOLDER),
                        help=f"the results folder (default: {DEFAULT_FOLDER})")
    args = parser.parse_args(argv)
    try:
        changed = update_readme(args.readme, args.folder)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.readme}: {'updated' if changed else 'already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

