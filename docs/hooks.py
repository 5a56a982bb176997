"""MkDocs hooks of the documentation site (mkdocs.yml `hooks:`): what a page shows that is
computed from the project itself, at build time, so that it cannot drift.

    <!-- cli-help -->          every `torchllama` command's --help (the CLI's own parser)
    <!-- benchmark-results --> the committed benchmark results (benchmarks/results/*.json),
                               one table per machine (`torchllama.bench.results.render`)
    math                       \\( … \\) and \\[ … \\] (pymdownx.arithmatex) rendered to MathML,
                               which browsers draw without a script: the site works offline
    explorers/                 the anatomy report's RoPE and sampling sections on the embedded
                               model (their interactive explorers), for the path's pages to embed

Run by `mkdocs build` / `mkdocs serve` (make docs, make docs-serve); nothing here is imported
by torchllama.
"""

from __future__ import annotations

import html
import io
import re
import sys
from contextlib import redirect_stdout
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: the anatomy sections written under site/explorers/NAME/index.html for the pages to embed
EXPLORERS = ("rope", "sampling")

_MATH = re.compile(r'<(span|div) class="arithmatex">\s*\\([(\[])(.*?)\\[)\]]\s*</\1>', re.S)


def _mathml(match: re.Match) -> str:
    from latex2mathml.converter import convert

    latex = html.unescape(match.group(3))
    display = "block" if match.group(2) == "[" else "inline"
    try:
        return convert(latex, display=display)
    except Exception as e:                      # noqa: BLE001 - the formula named, then raised
        raise ValueError(f"math that latex2mathml cannot convert: {latex!r} ({e!r})") from e


def cli_help() -> str:
    """Every command's --help, as the CLI prints it, one section each."""
    from torchllama.cli import BENCH, COMMANDS, build_parser

    parser = build_parser()
    out = []
    for name, fn in COMMANDS.items():
        commands = [(f"{name} {sub}", [name, sub]) for sub in BENCH] if isinstance(fn, dict) \
            else [(name, [name])]
        for title, argv in commands:
            text = io.StringIO()
            with redirect_stdout(text):
                try:
                    parser.parse_args(argv + ["--help"])
                except SystemExit:
                    pass
            out.append(f"### `torchllama {title}`\n\n```text\n{text.getvalue().rstrip()}\n```\n")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if "<!-- cli-help -->" in markdown:
        markdown = markdown.replace("<!-- cli-help -->", cli_help())
    if "<!-- benchmark-results -->" in markdown:
        from torchllama.bench.results import load_results, render

        markdown = markdown.replace("<!-- benchmark-results -->",
                                    render(load_results(REPO / "benchmarks" / "results")))
    return markdown


def on_page_content(content: str, page, config, files) -> str:
    return _MATH.sub(_mathml, content)


def on_post_build(config) -> None:
    """The anatomy sections with explorers, on the embedded model, under site/explorers/."""
    from torchllama import anatomy

    site = Path(config["site_dir"])
    for name in EXPLORERS:
        report = anatomy.run(only=name)
        anatomy.write_report(report, site / "explorers" / name, force=True)
