"""`torchllama bench shapes`: throughput, load time and peak memory at real model sizes, on the
random-weight GGUFs of `torchllama.bench.shapes`, ours side by side with llama.cpp.

Each engine loads the file in a process of its own (`python -m torchllama.bench.shapes_bench`),
so its load time and peak RSS are its own; the throughput figures are then taken in one more
process that holds both engines, their runs interleaved (ours, llama.cpp with flash attention
on, off, ours, …): the shared machine's memory bandwidth drifts by ±20–40% within minutes, and
only runs side by side in time give ratios that hold (without a peer, ours are taken in the
process that loaded it):

- load: seconds from the call that loads the file (ours: `torchllama.load(path)`, the default
  path; llama.cpp: `llama_model_load_from_file`, memory-mapped) to the end of the first forward
  (one token), and the process's peak RSS then (`resource.getrusage` ru_maxrss; llama.cpp's
  counts the file's pages it has touched);
- prefill: a T-token prompt into an empty KV cache, the last position's logits only;
- decode: `new_tokens` greedy steps after a prompt of C − new_tokens tokens (the cache holds C
  positions at the end), at batch 1 for every context C, at batch B > 1 for the smallest C
  (B different prompts decoded together; tokens of all rows per second).

The loops are `torchllama.bench.decode`'s (ours: `ours_runs`, `OursDecodeRun`) and
`torchllama.bench.peer`'s (llama.cpp: `PrefillRun`, `DecodeRun`), on the same token ids with the
same threads. llama.cpp runs with flash attention on and off, interleaved; the table shows the
faster of each figure (`bench.decode._fastest_setting`) and the verbose table both. Each figure
is the best of `runs` runs, each after a pause (`timing.PAUSE_S`), after one warm-up run.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from torchllama.bench.timing import interleaved_rates
from torchllama.errors import ArgumentError

ENGINES = ("torchllama", "llama.cpp")
PEERS = ("llama.cpp", "none")


@dataclass
class ShapesConfig:
    """What `torchllama bench shapes` measures (sizes in tokens).

    Attributes:
        prefill: prompt lengths of the prefill figures.
        contexts: cache lengths C of the decode figures (prompt C − new_tokens, then decode).
        batches: decode batch sizes (those > 1 at the smallest context only).
        threads: threads of both engines.
        runs: timed runs per figure (after one warm-up; the best is shown).
        new_tokens: greedy steps per decode run.
        load_only: a child process's load figures alone (the rates come from another).
    """

    prefill: tuple[int, ...] = (128, 512, 2048)
    contexts: tuple[int, ...] = (512, 4096)
    batches: tuple[int, ...] = (1, 8)
    threads: int = 2
    runs: int = 3
    new_tokens: int = 32
    load_only: bool = False

    def decode_figures(self) -> list[tuple[int, int]]:
        """(batch, context) of every decode figure, batch 1 first."""
        figures = [(1, c) for c in self.contexts] if 1 in self.batches else []
        return figures + [(b, min(self.contexts)) for b in self.batches if b > 1]


def decode_key(batch: int, context: int) -> str:
    """'b1@512': the name of a decode figure."""
    return f"b{batch}@{context}"


def parse_sizes(text: str, flag: str) -> tuple[int, ...]:
    """'128,512,2048' → (128, 512, 2048).

    Raises:
        ArgumentError: an item that is not an integer ≥ 1 (the flag named).
    """
    try:
        values = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ArgumentError(f"--{flag} {text!r}: expected a comma-separated list of integers "
                            "≥ 1, e.g. 128,512")
    return values


def split_names(values: list[str]) -> list[str]:
    """['1b,3b', '7b'] → ['1b', '3b', '7b'] (repeated flags and comma lists, in order, once
    each)."""
    names = [v.strip() for item in values for v in item.split(",") if v.strip()]
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------------------------
# The engines' runs, in the child processes
# ---------------------------------------------------------------------------------------------

def peak_rss_gb() -> float:
    """This process's peak resident set size so far, in GB (10⁹ bytes); Linux reports
    ru_maxrss in KiB, macOS in bytes."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9


@dataclass
class EngineRuns:
    """How one engine makes its runs: settings (name → option), `prefill(option, ids)` and
    `decode(option, rows of ids)` give run closures, `release(run)` frees what one holds;
    vocab_size: its token ids' range; close(): frees the engine's model; model: ours (for
    benchmarks that look inside it), else None."""

    settings: dict[str, object]
    prefill: Callable
    decode: Callable
    release: Callable = lambda run: None
    vocab_size: int = 0
    close: Callable = lambda: None
    model: object = None


def measure_figures(engine: EngineRuns, cfg: ShapesConfig) -> dict:
    """{setting: {"prefill": {T: [tok/s…]}, "decode": {"b1@512": [tok/s…]}}} of every figure
    of `cfg`, the settings interleaved figure by figure."""
    from torchllama.bench.decode import _prompt_ids

    out: dict = {name: {"prefill": {}, "decode": {}} for name in engine.settings}
    figures = [("prefill", str(T), T, None) for T in cfg.prefill] + [
        ("decode", decode_key(b, c), c, b) for b, c in cfg.decode_figures()]
    for kind, key, length, batch in figures:
        if kind == "prefill":
            ids = _prompt_ids(engine.vocab_size, length)[0].tolist()
            runs = {name: engine.prefill(opt, ids) for name, opt in engine.settings.items()}
        else:
            prompts = _prompt_ids(engine.vocab_size, length - cfg.new_tokens, batch).tolist()
            runs = {name: engine.decode(opt, prompts) for name, opt in engine.settings.items()}
        for name, rates in interleaved_rates(runs, cfg.runs).items():
            out[name][kind][key] = rates
            print(f"{name}: {kind} {key}: {max(rates):.2f} tok/s (runs: "
                  f"{', '.join(f'{r:.2f}' for r in rates)})", flush=True)
        for run in runs.values():
            engine.release(run)
    return out


def load_torchllama(path: str, cfg: ShapesConfig) -> tuple[EngineRuns, float, float]:
    """(its EngineRuns, load seconds, peak RSS GB then): `torchllama.load(path)` (the defaults)
    to the end of the first forward, then bench.decode's loops."""
    import torch

    torch.set_num_threads(cfg.threads)
    from torchllama.bench.decode import OursDecodeRun, ours_runs
    from torchllama.checkpoint import load
    from torchllama.generation.steps import prefill
    from torchllama import kernels

    kernels.available()             # built (or found built) first: a build is not load time
    t0 = time.perf_counter()
    model, _ = load(path, progress=False)
    with torch.inference_mode():
        model.setup_caches(1, 8)
        prefill(model, torch.tensor([[100]]), 0)                      # (1, 1) → (1, V)
    load_s, rss = time.perf_counter() - t0, peak_rss_gb()
    model.use_caches(None)
    engine = EngineRuns(
        {"torchllama": None},
        lambda _, ids: ours_runs(model, torch.tensor([ids]), cfg.new_tokens)[0],
        lambda _, prompts: OursDecodeRun(model, torch.tensor(prompts), cfg.new_tokens),
        lambda _: model.use_caches(None), model.args.vocab_size, model=model)
    return engine, load_s, rss


def load_llama_cpp(path: str, cfg: ShapesConfig) -> tuple[EngineRuns, float, float]:
    """(its EngineRuns: flash attention on and off, load seconds, peak RSS GB then):
    llama-cpp-python (`bench.peer`) to the end of the first forward; its `close()` frees the
    model."""
    from torchllama.bench import peer

    t0 = time.perf_counter()
    model = peer.LlamaCpp(path, cfg.threads)
    first = peer.PrefillRun(model, [100], True)
    first()
    load_s, rss = time.perf_counter() - t0, peak_rss_gb()
    model.free(first.ctx)
    engine = EngineRuns(
        {"llama.cpp fa=on": True, "llama.cpp fa=off": False},
        lambda fa, ids: peer.PrefillRun(model, ids, fa),
        lambda fa, prompts: peer.DecodeRun(model, prompts, cfg.new_tokens, fa),
        lambda run: model.free(run.ctx), model.n_vocab, model.close)
    return engine, load_s, rss


def _versions(engine: str) -> str:
    import torch

    from torchllama.bench import peer
    from torchllama.kernels import isa

    return (f"torch {torch.__version__}, kernels {isa()}" if engine == "torchllama"
            else peer.peer_version())


def read_bandwidth() -> dict:
    """The memory read bandwidth now (`bench.roofline.measure_read_bandwidth`), printed:
    {"gbs", "method"}."""
    from torchllama.bench.roofline import measure_read_bandwidth

    bw = measure_read_bandwidth()
    print(bw.summary(), flush=True)
    return {"gbs": bw.best_gbs, "method": bw.method}


def roofline_of(model, path: str, measure) -> dict:
    """`measure()`'s figures with the roofline around them, in this process: the read
    bandwidth before and after (the better kept), the bytes a decode step of each engine reads
    (ours: its product modules' tensors; llama.cpp: the file's matrices) and the seconds of our
    step's products alone (`bench.roofline`)."""
    from torchllama.bench.roofline import (gguf_bytes_per_token, product_seconds,
                                           weight_bytes_per_token)

    before = read_bandwidth()
    figures = measure()
    after = read_bandwidth()
    best = max(before, after, key=lambda r: r["gbs"])
    products = product_seconds(model)
    print(f"torchllama: a decode step's products alone {products * 1e3:.2f} ms", flush=True)
    return {"figures": figures, "roofline": {
        "read_gbs": best["gbs"], "read_method": best["method"],
        "read_gbs_before_after": [before["gbs"], after["gbs"]],
        "bytes_per_token": {"torchllama": weight_bytes_per_token(model),
                            "llama.cpp": gguf_bytes_per_token(path)},
        "product_s": products}}


def child_engine(engine: str, path: str, cfg: ShapesConfig) -> dict:
    """One engine's load figures on `path` and, unless `cfg.load_only`, its throughput figures
    (`measure_figures`, ours with the roofline: `roofline_of`) in the same process."""
    runs, load_s, rss = (load_torchllama if engine == "torchllama" else
                         load_llama_cpp)(path, cfg)
    print(f"{engine}: load to first forward {load_s:.1f} s, peak RSS {rss:.2f} GB", flush=True)
    roofline = None
    try:
        if cfg.load_only:
            figures = {}
        elif engine == "torchllama":
            measured = roofline_of(runs.model, path, lambda: measure_figures(runs, cfg))
            figures, roofline = measured["figures"], measured["roofline"]
        else:
            figures = measure_figures(runs, cfg)
    finally:
        runs.close()
    return {"engine": engine, "version": _versions(engine), "load_s": load_s,
            "rss_load_gb": rss, "rss_peak_gb": peak_rss_gb(), "settings": figures,
            "roofline": roofline}


def child_both(path: str, cfg: ShapesConfig) -> dict:
    """Both engines' throughput figures on `path` in this one process, every setting's runs
    interleaved (ours, llama.cpp fa=on, fa=off, ours, …): {"settings": {name: figures}}."""
    ours_runs, _, _ = load_torchllama(path, cfg)
    peer_runs, _, _ = load_llama_cpp(path, cfg)
    owner: dict[int, EngineRuns] = {}                 # id(run) → the engine that made it

    def make(kind: str):
        def run_of(setting, arg):
            engine, option = setting
            run = getattr(engine, kind)(option, arg)
            owner[id(run)] = engine
            return run
        return run_of

    settings = {name: (ours_runs, opt) for name, opt in ours_runs.settings.items()}
    settings.update({name: (peer_runs, opt) for name, opt in peer_runs.settings.items()})
    both = EngineRuns(settings, make("prefill"), make("decode"),
                      lambda run: owner.pop(id(run)).release(run), ours_runs.vocab_size)
    try:
        measured = roofline_of(ours_runs.model, path, lambda: measure_figures(both, cfg))
    finally:
        peer_runs.close()
    return {"engine": "both", "settings": measured["figures"], "roofline": measured["roofline"]}


def child_main(argv: list[str]) -> int:
    """`python -m torchllama.bench.shapes_bench ENGINE GGUF CONFIG_JSON OUT_JSON`: measure one
    engine (torchllama, llama.cpp) or both side by side (both) on one file and write its result
    (JSON) to OUT_JSON."""
    engine, path, config, out = argv
    cfg = ShapesConfig(**{k: tuple(v) if isinstance(v, list) else v
                          for k, v in json.loads(config).items()})
    result = child_both(path, cfg) if engine == "both" else child_engine(engine, path, cfg)
    Path(out).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------------------
# The parent: files, processes, tables
# ---------------------------------------------------------------------------------------------

def run_engine(engine: str, path: Path, cfg: ShapesConfig,
               print_fn: Callable[[str], None] = print) -> dict:
    """One engine's result on one file, measured in a new Python process (same interpreter,
    OMP_NUM_THREADS = threads), its progress lines passed to `print_fn` as they come;
    {"engine", "error"} when that process fails (its last stderr line kept)."""
    with tempfile.TemporaryDirectory(prefix="torchllama-shapes-") as tmp:
        out, err = Path(tmp) / "result.json", Path(tmp) / "stderr.txt"
        env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads), PYTHONUNBUFFERED="1")
        with open(err, "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "torchllama.bench.shapes_bench", engine, str(path),
                 json.dumps(asdict(cfg)), str(out)],
                env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
            for line in proc.stdout:
                print_fn("    " + line.rstrip())
            proc.wait()
        if proc.returncode != 0 or not out.exists():
            lines = [ln for ln in err.read_text(errors="replace").splitlines() if ln.strip()]
            return {"engine": engine, "error": f"exit code {proc.returncode}: "
                    f"{lines[-1] if lines else 'no message'}"}
        return json.loads(out.read_text())


def fastest(result: dict) -> dict:
    """{"prefill": {T: tok/s}, "decode": {key: tok/s}}: the best run of each figure over the
    engine's settings (llama.cpp: the faster of flash attention on and off)."""
    best: dict = {"prefill": {}, "decode": {}}
    for figures in result.get("settings", {}).values():
        for kind in best:
            for key, rates in figures[kind].items():
                best[kind][str(key)] = max(best[kind].get(str(key), 0.0), max(rates))
    return best


@dataclass
class ModelResult:
    """Both engines' results on one (shape, type) file."""

    shape: str
    qtype: str
    label: str
    path: str
    engines: dict[str, dict] = field(default_factory=dict)
    roofline: Optional[dict] = None



def _cell(ours: Optional[float], peer: Optional[float], fmt: str = ".1f") -> str:
    """'64.1 / 106.3 / 0.60×' (ours / peer / ours ÷ peer), 'ours' alone without a peer, '–'
    when ours is missing."""
    if ours is None:
        return "–"
    if peer is None:
        return f"{ours:{fmt}}"
    return f"{ours:{fmt}} / {peer:{fmt}} / {ours / peer:.2f}×"


def _figure_columns(cfg: ShapesConfig) -> list[tuple[str, str, str]]:
    """(kind, key, column title) of every throughput figure, in table order."""
    cols = [("prefill", str(T), f"prefill {T}") for T in cfg.prefill]
    return cols + [("decode", decode_key(b, c), f"decode b{b} @{c}")
                   for b, c in cfg.decode_figures()]


def markdown_table(results: list[ModelResult], cfg: ShapesConfig) -> list[str]:
    """The summary table: one row per model; tok/s of each figure, load seconds and peak RSS
    (GB), each 'ours / llama.cpp / ratio' when the peer ran (its faster setting)."""
    cols = _figure_columns(cfg)
    lines = ["| model | " + " | ".join(t for _, _, t in cols) + " | load s | peak RSS GB |",
             "|---" * (len(cols) + 3) + "|"]
    for r in results:
        ours, peer = r.engines.get("torchllama", {}), r.engines.get("llama.cpp")
        best_ours = fastest(ours)
        best_peer = fastest(peer) if peer and "error" not in peer else None
        cells = [_cell(best_ours[kind].get(key), best_peer[kind].get(key) if best_peer else None)
                 for kind, key, _ in cols]
        for name, fmt in (("load_s", ".1f"), ("rss_load_gb", ".2f")):
            cells.append(_cell(ours.get(name), best_peer and peer.get(name), fmt))
        lines.append(f"| {r.label} | " + " | ".join(cells) + " |")
    return lines


def verbose_table(results: list[ModelResult], cfg: ShapesConfig) -> list[str]:
    """Every engine setting's figures (best of its runs, tok/s), load seconds, peak RSS after
    loading and at the end (GB), and the errors of engines that failed."""
    cols = _figure_columns(cfg)
    lines = ["| model | engine | " + " | ".join(t for _, _, t in cols)
             + " | load s | RSS load / end GB |", "|---" * (len(cols) + 4) + "|"]
    for r in results:
        for engine, res in r.engines.items():
            if "error" in res:
                lines.append(f"| {r.label} | {engine}: failed ({res['error']}) |")
                continue
            for setting, figures in res["settings"].items():
                cells = [f"{max(figures[kind][key]):.1f}" if key in figures[kind] else "–"
                         for kind, key, _ in cols]
                lines.append(f"| {r.label} | {setting} | " + " | ".join(cells) +
                             f" | {res['load_s']:.1f} | {res['rss_load_gb']:.2f} / "
                             f"{res['rss_peak_gb']:.2f} |")
    return lines


def roofline_table(results: list[ModelResult], cfg: ShapesConfig) -> list[str]:
    """Decode at batch 1 against the memory read bandwidth measured in the same process (before
    and after the figures, the better): each engine's weight bytes per token, tokens/s at the
    smallest context, and the fraction bytes × tokens/s ÷ bandwidth; our step's products alone
    and the rest of the step (attention, norms, dispatch, Python)."""
    from torchllama.bench.roofline import decode_fraction

    key = decode_key(1, min(cfg.contexts))
    lines = [f"| model | read GB/s | engine | weights MB/token | decode b1 @{min(cfg.contexts)}"
             " tok/s | fraction | step ms: products + rest |", "|---" * 7 + "|"]
    for r in results:
        roof = r.roofline
        if not roof:
            continue
        for engine, res in r.engines.items():
            rate = fastest(res)["decode"].get(key) if "error" not in res else None
            if rate is None:
                continue
            nbytes = roof["bytes_per_token"][engine]
            split = "–"
            if engine == "torchllama":
                step = 1e3 / rate
                split = f"{step:.1f}: {roof['product_s'] * 1e3:.1f} + " \
                        f"{step - roof['product_s'] * 1e3:.1f}"
            lines.append(f"| {r.label} | {roof['read_gbs']:.1f} | {engine} | {nbytes / 1e6:.0f} "
                         f"| {rate:.1f} | {decode_fraction(nbytes, rate, roof['read_gbs']):.2f} "
                         f"| {split} |")
    return lines


def _header(cfg: ShapesConfig, peer: str) -> list[str]:
    """What every figure depends on: CPU capability, our kernels' ISA, threads, versions, the
    vocabulary, how figures are taken."""
    import torch

    from torchllama.kernels import isa

    lines = [f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torchllama kernels "
             f"{isa()}, {cfg.threads} threads, torch {torch.__version__}"]
    if peer == "llama.cpp":
        from torchllama.bench.peer import peer_version

        lines.append(f"peer {peer_version()}, flash attention on and off (each figure: the "
                     "faster; both in the verbose table)")
    lines.append("random weights, SmolLM2's tokenizer: vocabulary 49152 (Llama 3: 128256, "
                 "Llama 2: 32000)")
    where = ("both engines in one process, their runs interleaved" if peer == "llama.cpp"
             else "in one process")
    lines.append(f"best of {cfg.runs} runs after a warm-up, {where}; decode: "
                 f"{cfg.new_tokens} greedy steps ending at the context; load: load() to the "
                 "end of the first forward in a process of its own, the file in the page cache, "
                 "peak RSS then; cells: ours "
                 "/ llama.cpp / ours ÷ llama.cpp")
    return lines


def run_shapes_bench(shapes: list[str], types: list[str], cfg: ShapesConfig,
                     peer: str = "llama.cpp", json_path: Optional[str] = None,
                     print_fn: Callable[[str], None] = print, progress: bool = True
                     ) -> list[ModelResult]:
    """Write (or reuse) each shape × type file, measure each engine on it in a process of its
    own, print the markdown table and the verbose one, and write everything to `json_path`.

    Args:
        shapes: `bench.shapes.SHAPES` names.
        types: `bench.shapes.QUANT_TYPES` names.
        cfg: the figures (`ShapesConfig`).
        peer: "llama.cpp" or "none".
        json_path: a new file for the results (None: none written).
        print_fn: where lines go.
        progress: progress bars while writing files.

    Returns:
        One `ModelResult` per (shape, type), in order.

    Raises:
        ArgumentError: an unknown shape, type or peer; llama-cpp-python missing for the peer;
            an existing json_path; a context not above new_tokens or beyond a shape's.
    """
    from torchllama.bench import shapes as shape_files

    todo = [(shape_files.get_shape(s), shape_files.check_type(t)) for s in shapes for t in types]
    _check_args(cfg, peer, json_path, [s for s, _ in todo])
    for line in _header(cfg, peer):
        print_fn(line)
    results = []
    for shape, qtype in todo:
        path = shape_files.ensure_shape_file(shape, qtype, progress=progress)
        label = f"{shape.name.upper()} {qtype.upper()} ({shape.model})"
        results.append(measure_file(label, shape.name, qtype, path, cfg, peer, print_fn))
    for line in ["", *markdown_table(results, cfg), "", *verbose_table(results, cfg), "",
                 *roofline_table(results, cfg)]:
        print_fn(line)
    if json_path is not None:
        _write_json(Path(json_path), results, cfg, _header(cfg, peer))
    return results


def read_through(path: Path, chunk: int = 1 << 24) -> None:
    """Read the file once, discarding the bytes: it is then in the page cache (where memory
    allows), so the first engine to load it does not pay the disk for the second (a 4 GB file
    evicted by others took 70-90 s to read on this project's machines, against 0.6 s cached)."""
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def measure_file(label: str, shape: str, qtype: str, path: Path, cfg: ShapesConfig, peer: str,
                 print_fn: Callable[[str], None]) -> ModelResult:
    """Both engines' results on one file: with the peer, each engine's load figures in a
    process of its own, then the throughput figures of both in one process (`child_both`), split
    back by engine; without it, ours in one process."""
    result = ModelResult(shape, qtype, label, str(path))
    if peer != "llama.cpp":
        print_fn(f"{label}: torchllama …")
        result.engines["torchllama"] = run_engine("torchllama", path, cfg, print_fn)
        result.roofline = result.engines["torchllama"].get("roofline")
        return result
    read_through(path)                 # both loads start from the page cache, not the disk
    for engine in ENGINES:
        print_fn(f"{label}: {engine}, load …")
        result.engines[engine] = run_engine(engine, path, replace(cfg, load_only=True), print_fn)
    print_fn(f"{label}: both engines, runs interleaved …")
    both = run_engine("both", path, cfg, print_fn)
    result.roofline = both.get("roofline")
    for engine, res in result.engines.items():
        if "error" in both and "error" not in res:
            res["error"] = f"side-by-side runs: {both['error']}"
        elif "error" not in res:
            res["settings"] = {name: figures for name, figures in both["settings"].items()
                               if name.split(" ")[0] == engine}
    return result


def _check_args(cfg: ShapesConfig, peer: str, json_path: Optional[str], shapes: list) -> None:
    """ArgumentError for a bad peer, a missing llama-cpp-python, an existing --json file, or
    figures that do not fit (runs, new tokens, contexts)."""
    if peer not in PEERS:
        raise ArgumentError(f"--peer {peer!r}: use one of {', '.join(PEERS)}")
    if peer == "llama.cpp":
        from torchllama.bench.peer import import_llama_cpp

        import_llama_cpp()
    if json_path is not None and Path(json_path).exists():
        raise ArgumentError(f"--json {json_path}: already exists (choose a new file)")
    for name in ("runs", "new_tokens", "threads"):
        if getattr(cfg, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be ≥ 1")
    if min(cfg.contexts) <= cfg.new_tokens:
        raise ArgumentError(f"--context {min(cfg.contexts)}: must exceed --new-tokens "
                            f"{cfg.new_tokens} (decode ends at the context)")
    longest = max(max(cfg.contexts), max(cfg.prefill) + cfg.new_tokens)   # prefill's cache too
    for shape in shapes:
        if longest > shape.context_length:
            raise ArgumentError(f"--context/--prefill: {longest} positions are beyond the "
                                f"{shape.name} shape's context of {shape.context_length}")


def _write_json(path: Path, results: list[ModelResult], cfg: ShapesConfig,
                header: list[str]) -> None:
    """The results, config and header lines as JSON, written atomically."""
    from torchllama.checkpoint.common import atomic_output

    data = {"header": header, "config": asdict(cfg), "results": [asdict(r) for r in results]}
    with atomic_output(path, folder=False) as tmp:
        tmp.write_text(json.dumps(data, indent=1))



def _roofline_figures(r: ModelResult, cfg: ShapesConfig, best_ours: dict,
                      best_peer: Optional[dict]) -> list:
    """The roofline's figures of one file: the read bandwidth, and decode b1's fraction of it
    (ours beside llama.cpp's)."""
    from torchllama.bench.results import Figure
    from torchllama.bench.roofline import decode_fraction

    roof, key = r.roofline, decode_key(1, min(cfg.contexts))
    if not roof or key not in best_ours["decode"]:
        return []
    share = lambda engine, best: decode_fraction(                        # noqa: E731
        roof["bytes_per_token"][engine], best["decode"][key], roof["read_gbs"])
    peer = share("llama.cpp", best_peer) if best_peer and key in best_peer["decode"] else None
    return [Figure("memory read bandwidth", "GB/s", roof["read_gbs"], None),
            Figure(f"decode b1 @{min(cfg.contexts)}, fraction of the read bandwidth", "",
                   share("torchllama", best_ours), peer)]


def result_runs(results: list[ModelResult], cfg: ShapesConfig):
    """The summary table's figures as `torchllama.bench.results` runs, one per file: each
    throughput figure (llama.cpp's faster setting), the load seconds and the peak RSS."""
    from torchllama.bench.results import Figure, Run

    runs = []
    for r in results:
        ours, peer = r.engines.get("torchllama", {}), r.engines.get("llama.cpp")
        if "error" in ours:
            continue
        peer = peer if peer and "error" not in peer else None
        best_ours, best_peer = fastest(ours), fastest(peer) if peer else None
        figures = [Figure(title, "tok/s", best_ours[kind][key],
                          best_peer[kind].get(key) if best_peer else None)
                   for kind, key, title in _figure_columns(cfg) if key in best_ours[kind]]
        figures += [Figure("load", "s", ours["load_s"], peer and peer.get("load_s"), False),
                    Figure("peak RSS after loading", "GB", ours["rss_load_gb"],
                           peer and peer.get("rss_load_gb"), False)]
        figures += _roofline_figures(r, cfg, best_ours, best_peer)
        runs.append(Run(r.label, figures, "llama.cpp" if peer else None,
                        "flash attention on and off, the faster of each figure" if peer
                        else None, {"threads": cfg.threads, "runs": cfg.runs,
                                    "new_tokens": cfg.new_tokens}))
    return runs

if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
