"""The anatomy page's explorers in headless Chromium (Playwright), offline: each starts without a
console error, and what it shows after an input equals what Python computes from the same
numbers (torchllama.generation.sampling for the sampling explorer). Skipped, with the reason,
where Playwright or Chromium is missing."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from torchllama import anatomy
from torchllama.anatomy.browser import find_chromium, open_page
from torchllama.generation.sampling import SamplingParams, process_logits

pytest.importorskip("playwright", reason="Playwright is not installed (pip install playwright)")
if find_chromium() is None:
    pytest.skip("no Chromium: apt-get install chromium (or set $CHROMIUM)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def sampling_page(smollm2, tmp_path_factory):
    report = anatomy.run(only="sampling", loaded=smollm2)
    index = anatomy.write_report(report, tmp_path_factory.mktemp("explorers") / "report")
    return report, index


def set_slider(page, root: str, name: str, value: float) -> None:
    """Move the explorer's slider `name` to `value` as a reader would (an input event)."""
    page.eval_on_selector(f"{root} input[data-name='{name}']",
                          "(e, v) => { e.value = v; e.dispatchEvent(new Event('input')); }",
                          str(value))


def test_the_sampling_explorer_keeps_what_the_sampler_keeps(sampling_page):
    report, index = sampling_page
    logits = report["sampling"].tensors["logits"]                       # (V,) float32
    root = "#explorer-sampling-kept-set"
    settings = [(1.0, 0.9, 0.05), (0.7, 0.5, 0.0), (1.8, 0.95, 0.02)]
    with open_page(index) as (page, errors):
        assert page.get_attribute(root, "data-ready") == "1"
        shown = []
        for T, top_p, min_p in settings:
            set_slider(page, root, "temperature", T)
            set_slider(page, root, "top-p", top_p)
            set_slider(page, root, "min-p", min_p)
            shown.append(int(page.get_attribute(f"{root} .sampling-kept", "data-kept")))
        assert errors == []
    expected = [int(torch.isfinite(process_logits(
        logits[None], SamplingParams(temperature=T, top_p=p, min_p=m))).sum())
        for T, p, m in settings]
    assert shown == expected
    assert len(set(expected)) == 3 and max(expected) > 20             # the settings differ


def rope_score(q, k, theta, m: int, n: int) -> float:
    """q_m·k_n with RoPE (RoFormer eq. 14; pairs (2i, 2i+1), the dims past them unturned), in
    float64 from the page's float32 numbers."""
    P = len(theta)
    qc = (q[0:2 * P:2] + 1j * q[1:2 * P:2]) * np.exp(1j * m * theta)
    kc = (k[0:2 * P:2] + 1j * k[1:2 * P:2]) * np.exp(1j * n * theta)
    return float((qc.real * kc.real + qc.imag * kc.imag).sum() + (q[2 * P:] * k[2 * P:]).sum())


def blob(b64: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64["f32"]), dtype="<f4").astype(np.float64)


def test_the_rope_explorer_reads_out_what_python_computes(smollm2, tmp_path):
    report = anatomy.run(only="rope", loaded=smollm2)
    index = anatomy.write_report(report, tmp_path / "report")
    data = report["rope"].explorers[0].data
    q, k, theta = blob(data["q"]), blob(data["k"]), blob(data["theta"])
    assert len(theta) == smollm2[0].args.head_dim // 2 and data["context"] == 8192
    np.testing.assert_allclose(q, report["rope"].tensors["q"][smollm2[0].args.n_heads].numpy())
    root = "#explorer-rope-rotation"
    with open_page(index) as (page, errors):
        canvas = f"{root} canvas"
        before = page.eval_on_selector(canvas, "c => c.toDataURL()")
        readouts = []
        for m, i, n, s in [(1234, 5, 37, 1000), (20000, 31, 8000, 4000)]:
            set_slider(page, root, "position m", m)
            set_slider(page, root, "pair i", i)
            set_slider(page, root, "key position n", n)
            set_slider(page, root, "shift s", s)
            readouts.append(page.eval_on_selector(f"{root} .rope-readout",
                                                  "e => Object.assign({}, e.dataset)"))
        after = page.eval_on_selector(canvas, "c => c.toDataURL()")
        assert errors == []
    assert before != after                                              # the view turned
    for got, (m, i, n, s) in zip(readouts, [(1234, 5, 37, 1000), (16384, 31, 8000, 4000)]):
        # the position slider stops at twice the trained context (16,384 for SmolLM2)
        assert (int(got["m"]), int(got["pair"]), int(got["n"]), int(got["shift"])) == (m, i, n, s)
        assert float(got["angle"]) == pytest.approx(m * theta[i], rel=1e-12)
        assert float(got["wavelength"]) == pytest.approx(2 * np.pi / theta[i], rel=1e-12)
        score = rope_score(q, k, theta, m, n)
        assert float(got["score"]) == pytest.approx(score, rel=1e-9)
        # the relative-position claim, by Python too: the same score s positions later
        assert rope_score(q, k, theta, m + s, n + s) == pytest.approx(score, rel=1e-6, abs=1e-6)
        assert float(got["shifted"]) == pytest.approx(score, rel=1e-6, abs=1e-6)


def test_the_attention_explorer_shows_the_selected_heads_probabilities(smollm2, tmp_path):
    report = anatomy.run(only="attention,heads", loaded=smollm2)
    index = anatomy.write_report(report, tmp_path / "report")
    saved = json.loads((index.parent / "anatomy.json").read_text())["attention"]
    layer, probs_layer = saved["layer"], saved["probs_layer"]          # (H, T, T) of one layer
    root = "#explorer-heads-heads"
    rows = {}
    with open_page(index) as (page, errors):
        heat = f"{root} canvas.attention-heatmap"
        pictures = []
        for head in (0, 3):
            page.select_option(f"{root} select[data-name='layer']", str(layer))
            page.select_option(f"{root} select[data-name='head']", str(head))
            page.hover(f"{root} .attention-tokens span[data-t='20']")
            pictures.append(page.eval_on_selector(heat, "c => c.toDataURL()"))
            rows[head] = page.eval_on_selector_all(
                f"{root} .attention-row span[data-p]", "s => s.map(e => Number(e.dataset.p))")
            shown = page.eval_on_selector(f"{root} .attention-readout",
                                          "e => Object.assign({}, e.dataset)")
            assert (int(shown["layer"]), int(shown["head"]), int(shown["row"])) == (layer, head, 20)
        # a click on the layer × head grid selects that cell's head (cells of `cell` pixels
        # from (30, 20), explorers.js)
        box = page.locator(f"{root} canvas.attention-grid").bounding_box()
        cell = page.evaluate("n => Math.max(8, Math.min(22, Math.floor(300 / n)))",
                             max(smollm2[0].args.n_layers, smollm2[0].args.n_heads))
        page.mouse.click(box["x"] + 30 + 1.5 * cell, box["y"] + 20 + 2.5 * cell)
        clicked = page.eval_on_selector(f"{root} .attention-readout",
                                        "e => [Number(e.dataset.layer), Number(e.dataset.head)]")
        assert errors == []
    assert clicked == [2, 1]
    assert pictures[0] != pictures[1]                                  # the heatmap changed
    for head, row in rows.items():
        np.testing.assert_allclose(row, probs_layer[head][20][:21], rtol=1e-5, atol=1e-7)
    assert rows[0] != rows[3]


def test_the_logit_lens_explorer_lists_every_blocks_top_tokens(smollm2, tmp_path):
    report = anatomy.run(only="logit-lens", loaded=smollm2)
    index = anatomy.write_report(report, tmp_path / "report")
    saved = json.loads((index.parent / "anatomy.json").read_text())["logit-lens"]
    root = "#explorer-logit-lens-positions"
    with open_page(index) as (page, errors):
        page.click(f"{root} .lens-tokens span[data-t='9']")
        cells = page.eval_on_selector_all(
            f"{root} .lens-table tr[data-block]",
            "rows => rows.map(r => Array.from(r.querySelectorAll('td[data-p]')).map("
            "c => [Number(c.dataset.id), Number(c.dataset.p)]))")
        shown = page.eval_on_selector(f"{root} .lens-readout", "e => Number(e.dataset.t)")
        assert errors == []
    L = smollm2[0].args.n_layers
    assert shown == 9 and len(cells) == L and all(len(r) == 5 for r in cells)
    for block, row in enumerate(cells):
        assert row[0][0] == saved["top_ids"][block][9]                  # the lens's best token
        assert row[0][1] == pytest.approx(saved["top_probs"][block][9], rel=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(row, row[1:]))           # best first
