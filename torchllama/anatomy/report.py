"""The anatomy report: sections, the context they share, and the page they are written into.

Each section is a function `section(ctx: AnatomyContext) -> Section` in a module of this
package (`SECTIONS` maps its name to "module:function"). A Section carries a paragraph saying
what to look for, matplotlib figures, its headline numbers, and every number behind its figures
as JSON-able data; `tensors` holds the raw tensors for notebooks (not written to disk).

Every section is three steps that its function composes in a few lines: measure (ctx → a
dataclass of the numbers, no matplotlib), plot (that dataclass → Figures) and prose (that
dataclass → a `Prose`: the paragraph, headline, tables and the anatomy.json entry).

`write_report` writes DIR/index.html (one self-contained page: figures embedded as base64
PNG, the explorers' data as JSON and their JavaScript inline; no network),
DIR/figures/<section>-<figure>.png and DIR/anatomy.json, each atomically (temp file, then
rename). It records what it wrote in DIR/.anatomy-manifest.json and refuses to overwrite any
other file unless force=True.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from torchllama.errors import ArgumentError

#: section name → "module:function" in torchllama.anatomy, in page order
SECTIONS: dict[str, str] = {
    "attention": "attention:attention_section",
    "heads": "attention:heads_section",
    "rope": "rope:rope_section",
    "extrapolation": "rope:extrapolation_section",
    "norms": "norms:norms_section",
    "sampling": "temperature:sampling_section",
    "logit-lens": "logit_lens:logit_lens_section",
    "landscape": "landscape:landscape_section",
}
#: sections left out of the default report: `extrapolation` runs the model on 4 × 2 context
#: lengths of text (minutes to hours), `landscape` needs a training run (`--model RUN`)
OPT_IN = ("extrapolation",)

MANIFEST = ".anatomy-manifest.json"

#: The default text: the opening of Dickens' "A Tale of Two Cities" (1859, public domain):
#: real English with repeated phrases, where previous-token and induction heads show.
DEFAULT_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was "
    "the season of Light, it was the season of Darkness, it was the spring of hope, it was the "
    "winter of despair, we had everything before us, we had nothing before us, we were all "
    "going direct to Heaven, we were all going direct the other way."
)


@dataclass
class Figure:
    """One figure of a section: `name` (file-name safe), a caption, the matplotlib figure."""

    name: str
    caption: str
    figure: Any


@dataclass
class Explorer:
    """An interactive view of a section (`explorers.js`, run in the reader's browser from the
    page on disk): `kind` names its JavaScript ("sampling", "rope", "attention", "lens"),
    `data` is what it draws from (JSON-able; large float arrays as `float32_blob`s), embedded
    in the page only (not in anatomy.json)."""

    name: str
    kind: str
    caption: str
    data: dict


@dataclass
class Table:
    """A small table of a section: a caption, column names, rows of cells (str or numbers)."""

    caption: str
    header: list[str]
    rows: list[list]


@dataclass
class Section:
    """What one analysis produced.

    Attributes:
        name: the section's name in SECTIONS.
        title: heading on the page.
        look_for: one paragraph (plain text) on what the figures show and what to look for.
        figures: the figures, in page order.
        tables: small tables shown after the figures.
        headline: short sentences with the key measured numbers (shown as a list).
        data: every number behind the figures, JSON-able (lists, floats, strings).
        tensors: raw tensors for notebooks (not written).
        seconds: wall time the section took.
        explorers: interactive views shown after the figures (JavaScript on the page).
    """

    name: str
    title: str
    look_for: str
    figures: list[Figure] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    headline: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)
    seconds: float = 0.0
    explorers: list[Explorer] = field(default_factory=list)


@dataclass
class Prose:
    """What a section says about its measurements: the words of the page and the JSON entry.

    Each section is measure → plot → prose: `measure_*` returns a dataclass of numbers,
    `plot_*` draws Figures from it, `*_prose` returns this; `section` puts them together.

    Attributes:
        look_for: the "what to look for" paragraph (plain text).
        headline: short sentences with the key measured numbers.
        data: the section's entry in anatomy.json (JSON-able after `_jsonable`).
        tables: small tables shown after the figures.
    """

    look_for: str
    headline: list[str]
    data: dict
    tables: list[Table] = field(default_factory=list)

    def section(self, name: str, title: str, figures: list[Figure],
                tensors: Optional[dict] = None) -> Section:
        """The Section of these words with the section's figures and raw tensors."""
        return Section(name, title, self.look_for, figures, self.tables, self.headline,
                       self.data, tensors if tensors is not None else {})


@dataclass
class AnatomyContext:
    """What every section may use.

    Attributes:
        model: the model in float32, eval mode, no KV cache.
        tokenizer: its tokenizer.
        model_name: how the page names the model (path or packaged name).
        text: the analysed text (after truncation).
        tokens: (1, T) int64 ids of text (with BOS where the tokenizer adds one).
        labels: the T tokens as printable strings (axis labels).
        notes: things the page must state (e.g. the text was truncated).
        run_dir: the training run folder when --model named one, else None.
        seed: seed of every random choice (induction sequences, random directions).
        options: section options from the caller (e.g. "long_text_file" and
            "extrapolation_factor" for the extrapolation section).
        progress: called with a short status line as work advances.
    """

    model: Any
    tokenizer: Any
    model_name: str
    text: str
    tokens: torch.Tensor
    labels: list[str]
    notes: list[str] = field(default_factory=list)
    run_dir: Optional[Path] = None
    seed: int = 0
    options: dict = field(default_factory=dict)
    progress: Callable[[str], None] = lambda message: None


@dataclass
class Report:
    """A finished report: the context it ran on and its sections in page order."""

    ctx: AnatomyContext
    sections: list[Section]
    seconds: float = 0.0

    def __getitem__(self, name: str) -> Section:
        for section in self.sections:
            if section.name == name:
                return section
        raise KeyError(name)


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """Printable labels of token ids for axes: each decoded alone, spaces shown as '·',
    newlines as '⏎', empty pieces by their id."""
    labels = []
    special = set(tokenizer.special_tokens.values()) | {tokenizer.bos_id, tokenizer.eos_id}
    for i in ids:
        if i in special:
            piece = tokenizer.id_to_piece(i)
        else:
            piece = tokenizer.decode([i])
        piece = piece.replace(" ", "·").replace("\n", "⏎")
        labels.append(piece or f"<{i}>")
    return labels


def parse_only(only: Optional[str | list[str]]) -> list[str]:
    """The section names to run: `only` as a comma-separated string or a list, in page order;
    None gives every section not in OPT_IN.

    Raises:
        ArgumentError: a name not in SECTIONS (the message lists the valid ones).
    """
    if only is None:
        return [name for name in SECTIONS if name not in OPT_IN]
    names = [n.strip() for n in (only.split(",") if isinstance(only, str) else only) if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise ArgumentError(f"--only: unknown section {', '.join(map(repr, unknown)) or '(none)'}; "
                            f"valid: {', '.join(SECTIONS)}")
    return [name for name in SECTIONS if name in names]


def run_sections(ctx: AnatomyContext, names: list[str]) -> Report:
    """Run the named sections (see `parse_only`) on ctx, in page order, with a progress bar."""
    from tqdm import tqdm

    start = time.perf_counter()
    sections = []
    with tqdm(total=len(names), desc="anatomy", unit="section", leave=False) as bar:
        ctx.progress = lambda message: bar.set_postfix_str(message, refresh=True)
        for name in names:
            bar.set_description(f"anatomy: {name}")
            module, function = SECTIONS[name].split(":")
            fn = getattr(importlib.import_module(f"torchllama.anatomy.{module}"), function)
            t0 = time.perf_counter()
            section = fn(ctx)
            section.seconds = time.perf_counter() - t0
            sections.append(section)
            bar.update(1)
    return Report(ctx, sections, time.perf_counter() - start)


# ---- writing ---------------------------------------------------------------------------------

def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None       # JSON has no inf/nan
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _cell(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def float32_blob(t: torch.Tensor) -> dict:
    """A tensor's values for an explorer: {"f32": base64 of its float32 little-endian bytes,
    "shape": [...]} (explorers.js `floats`; a third of JSON's size, and the exact float32)."""
    a = t.detach().to(torch.float32).contiguous().numpy().astype("<f4")
    return {"f32": base64.b64encode(a.tobytes()).decode("ascii"), "shape": list(t.shape)}


def _script_json(data: dict) -> str:
    """`data` as JSON safe inside a <script> element (no "</script>", no HTML parsing)."""
    text = json.dumps(_jsonable(data), allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def explorers_script() -> str:
    """The explorers' JavaScript (torchllama/anatomy/explorers.js), inlined into the page."""
    return (Path(__file__).with_name("explorers.js")).read_text(encoding="utf-8")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>Anatomy of {{ model_name }}</title>
<style>
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }
h1 { margin-bottom: .2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
.meta, .caption, .time { color: #666; font-size: .9em; }
.look { background: #f5f7fb; border-left: 4px solid #4a7bd0; padding: .6em 1em; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
nav a { margin-right: 1em; }
table { border-collapse: collapse; margin: 1em 0; font-size: .9em; }
th, td { border: 1px solid #ddd; padding: .2em .6em; text-align: right; }
caption { text-align: left; color: #666; padding-bottom: .3em; } code { background: #f2f2f2; padding: 0 .2em; }
.notes { color: #8a5300; }
.explorer { border: 1px solid #dde3ee; border-radius: 6px; padding: .6em; background: #fbfcfe; }
.explorer label { margin-right: 1.2em; font-size: .9em; white-space: nowrap; }
.explorer canvas { display: block; margin: .5em 0; max-width: 100%; }
.explorer .readout { font-family: ui-monospace, monospace; font-size: .85em; }
</style></head><body>
<h1>Anatomy of {{ model_name }}</h1>
<p class="meta">{{ arch }} · generated by <code>torchllama anatomy</code> in {{ "%.0f"|format(seconds) }} s ·
text: {{ n_tokens }} tokens</p>
{% if notes %}<ul class="notes">{% for n in notes %}<li>{{ n }}</li>{% endfor %}</ul>{% endif %}
<p class="meta">Text: “{{ text_preview }}”</p>
<nav>{% for s in sections %}<a href="#{{ s.name }}">{{ s.title }}</a>{% endfor %}</nav>
{% for s in sections %}
<section id="{{ s.name }}" class="section">
<h2>{{ s.title }}</h2>
<p class="look"><b>What to look for.</b> {{ s.look_for }}</p>
{% if s.headline %}<ul class="headline">{% for h in s.headline %}<li>{{ h }}</li>{% endfor %}</ul>{% endif %}
{% for f in s.figures %}
<figure id="{{ s.name }}-{{ f.name }}"><img alt="{{ f.caption }}" src="data:image/png;base64,{{ f.b64 }}">
<figcaption class="caption">{{ f.caption }}</figcaption></figure>
{% endfor %}
{% for e in s.explorers %}
<figure class="explorer-box"><div class="explorer" id="explorer-{{ s.name }}-{{ e.name }}" data-kind="{{ e.kind }}">
<script type="application/json">{{ e.json|safe }}</script></div>
<figcaption class="caption">{{ e.caption }}</figcaption></figure>
{% endfor %}
{% for t in s.tables %}
<table class="table"><caption>{{ t.caption }}</caption>
<tr>{% for h in t.header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for r in t.rows %}<tr>{% for c in r %}<td>{{ c }}</td>{% endfor %}</tr>{% endfor %}
</table>
{% endfor %}
<p class="time">{{ "%.1f"|format(s.seconds) }} s · numbers in anatomy.json under "{{ s.name }}"</p>
</section>
{% endfor %}
{% if explorers_js %}<script>
{{ explorers_js|safe }}
</script>{% endif %}
</body></html>
"""


def _manifest_files(out: Path) -> set[str]:
    try:
        return set(json.loads((out / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def check_out_folder(out: str | os.PathLike, targets: tuple[str, ...] = ("index.html",
                     "anatomy.json"), *, force: bool = False) -> None:
    """Raise ArgumentError, before any work, if `out` is not a folder or already holds one of
    the report's files (`targets`) that an earlier report did not write (and not force)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ArgumentError(f"--out {out}: exists and is not a folder")
    ours = _manifest_files(out)
    clash = [t for t in targets if (out / t).exists() and t not in ours]
    if clash and not force:
        raise ArgumentError(f"--out {out}: would overwrite {', '.join(clash[:3])}"
                            f"{' …' if len(clash) > 3 else ''}, which an earlier report did not "
                            f"write; choose another folder or pass --force")


def write_report(report: Report, out: str | os.PathLike, *, force: bool = False) -> Path:
    """Write the report into folder `out` (created if missing) and return index.html's path.

    Raises:
        ArgumentError: `out` exists and is not a folder, or a file the report would write is
            already there and was not written by an earlier report (pass force=True to
            overwrite it). Other files in the folder are never touched.
    """
    import jinja2
    import matplotlib.pyplot as plt

    out = Path(out)
    pngs = {f"figures/{s.name}-{f.name}.png": (s, f) for s in report.sections for f in s.figures}
    targets = ["index.html", "anatomy.json", *pngs]
    check_out_folder(out, tuple(targets), force=force)
    ours = _manifest_files(out)
    manifest_path = out / MANIFEST
    (out / "figures").mkdir(parents=True, exist_ok=True)

    ctx = report.ctx
    views = []
    for s in report.sections:
        figures = []
        for f in s.figures:
            data = _png(f.figure)
            plt.close(f.figure)
            _write_atomic(out / f"figures/{s.name}-{f.name}.png", data)
            figures.append({"name": f.name, "caption": f.caption,
                            "b64": base64.b64encode(data).decode("ascii")})
        views.append({"name": s.name, "title": s.title, "look_for": s.look_for,
                      "headline": s.headline, "figures": figures, "seconds": s.seconds,
                      "explorers": [{"name": e.name, "kind": e.kind, "caption": e.caption,
                                     "json": _script_json(e.data)} for e in s.explorers],
                      "tables": [{"caption": t.caption, "header": t.header,
                                  "rows": [[_cell(c) for c in r] for r in t.rows]}
                                 for t in s.tables]})
    args = ctx.model.args
    arch = (f"{args.n_layers} layers · dim {args.dim} · {args.n_heads} heads · "
            f"{args.n_kv_heads} KV heads · {args.norm} · {args.position}")
    preview = ctx.text if len(ctx.text) <= 300 else ctx.text[:300] + " …"
    page = jinja2.Environment(autoescape=True).from_string(_PAGE).render(
        model_name=ctx.model_name, arch=arch, seconds=report.seconds, notes=ctx.notes,
        n_tokens=ctx.tokens.shape[1], text_preview=preview, sections=views,
        explorers_js=explorers_script() if any(s.explorers for s in report.sections) else "")
    data = {"model": ctx.model_name, "text": ctx.text, "tokens": ctx.tokens[0].tolist(),
            "labels": ctx.labels, "notes": ctx.notes, "seconds": report.seconds,
            **{s.name: {"headline": s.headline, "seconds": s.seconds, **_jsonable(s.data),
                        **({"tables": [{"caption": t.caption, "header": t.header,
                                        "rows": _jsonable(t.rows)} for t in s.tables]}
                           if s.tables else {})}
               for s in report.sections}}
    _write_atomic(out / "anatomy.json", json.dumps(data, indent=1, allow_nan=False).encode())
    _write_atomic(out / "index.html", page.encode("utf-8"))
    _write_atomic(manifest_path, json.dumps({"files": sorted(ours | set(targets))}).encode())
    return out / "index.html"
