"""The anatomy page's explorers in headless Chromium (Playwright), offline: each starts without a
console error, and what it shows after an input equals what Python computes from the same
numbers (torchllama.generation.sampling for the sampling explorer). Skipped, with the reason,
where Playwright or Chromium is missing."""

from __future__ import annotations

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
