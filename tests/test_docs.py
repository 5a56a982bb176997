"""The documentation: every code block of README.md and docs/ runs, the site builds strictly, and
the built site renders in Chromium from disk.

Code blocks, page by page:
- ```python blocks run in order in one namespace per page (a page's examples build on each
  other), on the embedded model;
- ```sh blocks run each in bash (-e) in a scratch folder, `torchllama` from this environment;
- a block whose first line is `--8<--` is a listing of the source (pymdownx.snippets), not run;
  other languages (text, yaml, json) are not code to run;
- the line before a fence may say `<!-- docs: skip (why) -->` — not run, the reason in the
  page — or `<!-- docs: slow -->` — run by `make test-slow` only;
- examples that talk to a server at http://127.0.0.1:8000 get one: the embedded model served in
  this process with the API key "KEY", its address put in their place.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))
SERVER = "http://127.0.0.1:8000"
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```",
                    re.M | re.S)
_MARK = re.compile(r"<!--\s*docs:\s*(skip|slow)\b[^>]*-->\s*$")


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    code: str
    mark: str | None            # "skip", "slow" or None

    @property
    def runnable(self) -> bool:
        return self.lang in ("python", "sh") and not self.code.lstrip().startswith("--8<--")


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page, with the marker of the line before each."""
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        code = "\n".join(line[len(m.group("indent")):] for line in m.group("body").splitlines())
        out.append(Block(page, text[:m.start()].count("\n") + 1, m.group("lang"), code,
                         mark.group(1) if mark else None))
    return out


def _id(page: Path) -> str:
    return str(page.relative_to(REPO))


def test_the_collector_finds_blocks_and_markers(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("x\n\n```python\na = 1\n```\n\n<!-- docs: skip (slow) -->\n```sh\nfalse\n```\n"
                    "\n```python\n--8<-- \"torchllama/model.py:block\"\n```\n  ```text\nhi\n  ```\n")
    found = blocks(page)
    assert [(b.lang, b.mark, b.runnable) for b in found] == [
        ("python", None, True), ("sh", "skip", True), ("python", None, False),
        ("text", None, False)]
    assert found[0].code == "a = 1" and found[0].line == 3


@pytest.fixture(scope="module")
def server_url(smollm2_gguf):
    """The embedded model served in this process (API key KEY), started on first use."""
    import contextlib

    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    stack = contextlib.ExitStack()
    started: list[str] = []

    def url() -> str:
        if not started:
            model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
            started.append(stack.enter_context(serve_in_thread(
                create_app(model, tokenizer, "SmolLM2-135M-Instruct", api_key="KEY"))))
        return started[0]
    with stack:
        yield url


def _todo(page: Path, lang: str, slow: bool) -> list[Block]:
    """The blocks of `lang` to run: all runnable ones but those marked skip, and those marked
    slow only in the slow run (which runs the page's other blocks too: they build on each
    other)."""
    found = [b for b in blocks(page) if b.lang == lang and b.runnable and b.mark != "skip"]
    if not slow:
        return [b for b in found if b.mark != "slow"]
    return found if any(b.mark == "slow" for b in found) else []


def _pages(lang: str, slow: bool) -> list:
    return [pytest.param(p, id=_id(p), marks=[pytest.mark.slow] if slow else [])
            for p in PAGES if _todo(p, lang, slow)]


@pytest.mark.parametrize("page", _pages("python", False) + _pages("python", True))
def test_every_python_block_runs(page, server_url, request, monkeypatch):
    todo = _todo(page, "python", request.node.get_closest_marker("slow") is not None)
    monkeypatch.chdir(REPO)
    namespace: dict = {"__name__": "__docs__"}
    for block in todo:
        code = block.code
        if SERVER in code:
            code = code.replace(SERVER, server_url())
        try:
            exec(compile(code, f"{_id(page)}:{block.line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{_id(page)}, the block at line {block.line} failed: "
                                 f"{type(e).__name__}: {e}") from e


@pytest.mark.parametrize("page", _pages("sh", False) + _pages("sh", True))
def test_every_shell_block_runs(page, server_url, request, tmp_path):
    todo = _todo(page, "sh", request.node.get_closest_marker("slow") is not None)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "REPO": str(REPO)}
    for block in todo:
        code = block.code.replace(SERVER, server_url()) if SERVER in block.code else block.code
        done = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, env=env,  # no stdin:
                              stdin=subprocess.DEVNULL,  # a REPL block ends at EOF, never waits
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (f"{_id(page)}, the block at line {block.line} failed "
                                      f"({done.returncode}):\n{done.stderr[-2000:]}")


# --------------------------------------------------------------------------------------------
# The site: built strictly, offline, rendered in Chromium from disk
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """`mkdocs build --strict` of the repository's docs into a scratch folder."""
    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "-d", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_the_site_builds_strictly_and_loads_nothing_from_the_network(site):
    pages = list(site.rglob("*.html"))
    assert len(pages) > 25
    remote = re.compile(r'<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)="(https?:)?//', re.I)
    for page in pages:
        assert not remote.search(page.read_text(errors="replace")), page
    rope = (site / "path" / "rope.html").read_text()
    assert "precompute_freqs_cis" in rope and "apply_rotary_emb" in rope   # the real code
    assert "<math" in rope and "explorers/rope/index.html" in rope
    assert (site / "explorers" / "rope" / "index.html").is_file()
    assert "torchllama generate" in (site / "guides" / "cli.html").read_text()  # --help
    assert "ours vs llama.cpp" in (site / "benchmarks.html").read_text()
    assert (site / "search" / "search_index.js").is_file()                 # offline search


def test_a_missing_snippet_section_fails_the_build(tmp_path):
    """Pages pull the code by section markers in the source: a marker that is gone is an
    error, not an empty listing."""
    pytest.importorskip("mkdocs")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text('```python\n--8<-- "torchllama/model.py:no-such-section"\n```\n')
    (tmp_path / "mkdocs.yml").write_text(
        f"site_name: t\ndocs_dir: {docs}\nmarkdown_extensions:\n  - pymdownx.snippets:\n"
        f"      base_path: [{REPO}]\n      check_paths: true\n")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f",
                           str(tmp_path / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no-such-section" in done.stderr


def test_the_site_renders_in_chromium_from_disk(site):
    pytest.importorskip("playwright")
    from torchllama.anatomy.browser import find_chromium, open_page

    if find_chromium() is None:
        pytest.skip("no Chromium: apt-get install chromium (or set $CHROMIUM)")
    for name in ("index.html", "path/rmsnorm.html", "reference/model.html",
                 "guides/server.html"):
        with open_page(site / name) as (page, errors):
            assert page.locator("h1").first.inner_text(), name
            assert errors == [], (name, errors)
    with open_page(site / "path" / "rope.html") as (page, errors):
        page.locator("iframe[title='RoPE explorer on SmolLM2']").scroll_into_view_if_needed()
        page.wait_for_function("() => window.frames.length > 0")
        frame = next(f for f in page.frames if f.url.endswith("explorers/rope/index.html"))
        frame.wait_for_function("() => { const e = document.querySelector('div.explorer'); "
                                "return e && e.dataset.ready === '1'; }", timeout=30_000)
        assert page.locator("math").count() > 3                   # the equations, as MathML
        assert errors == [], errors
    with open_page(site / "reference" / "model.html") as (page, errors):
        assert page.get_by_text("class Transformer", exact=False).count() > 0
        assert errors == [], errors
