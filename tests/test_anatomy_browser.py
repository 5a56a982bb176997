"""The anatomy page in a real browser: headless Chromium (Debian package `chromium`) through
Playwright renders index.html from disk, offline; every figure must decode and the console
must stay clean. Skipped, with the reason, where Playwright or Chromium is missing."""

from __future__ import annotations

import pytest

from torchllama import anatomy
from torchllama.anatomy.browser import check_page, find_chromium

pytest.importorskip("playwright", reason="Playwright is not installed (pip install playwright)")
if find_chromium() is None:
    pytest.skip("no Chromium: apt-get install chromium (or set $CHROMIUM)",
                allow_module_level=True)


def test_report_renders_in_chromium(smollm2, tmp_path):
    report = anatomy.run(only="attention,sampling,logit-lens", loaded=smollm2)
    index = anatomy.write_report(report, tmp_path / "report")
    shot = tmp_path / "shot.png"
    check = check_page(index, screenshot=shot)
    n_figures = sum(len(s.figures) for s in report.sections)
    assert check.images == n_figures == 7
    assert check.decoded == check.images, "a figure did not decode"
    assert check.errors == []
    assert check.sections == ["attention", "sampling", "logit-lens"]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_broken_figure_is_caught(smollm2, tmp_path):
    report = anatomy.run(only="sampling", loaded=smollm2)
    index = anatomy.write_report(report, tmp_path / "report")
    page = index.read_text()
    start = page.index("base64,") + len("base64,")
    index.write_text(page[:start] + "AAAA" + page[start + 4:])       # corrupt the first PNG
    check = check_page(index)
    assert check.decoded == check.images - 1 and not check.ok
