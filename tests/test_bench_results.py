"""Benchmark results as data (`torchllama.bench.results`): the file a bench command writes and
the benchmarks page rendered from the committed files (docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

from torchllama.bench.results import (Figure, Run, document, load_results, render, save,
                                      write)


def test_a_results_file_round_trips_and_renders_by_machine(tmp_path):
    runs = [Run("SmolLM2 (auto)", [Figure("decode b1", "tok/s", 200.0, 160.0),
                                   Figure("load", "s", 2.0, 1.0, higher_is_better=False)],
                "llama.cpp", "flash attention on and off, the faster")]
    first = document("decode", runs, "llama-cpp-python 0.3.36", argv=["bench", "decode"])
    second = document("decode", [Run("SmolLM2 (auto)", [Figure("decode b1", "tok/s", 210.0,
                                                               140.0)], "llama.cpp")])
    second["date"] = "2999-01-01T00:00:00+00:00"                  # (written later)
    paths = [write(first, tmp_path), write(second, tmp_path)]
    assert paths[0] != paths[1] and all(p.suffix == ".json" for p in paths)
    docs = load_results(tmp_path)
    assert [d["runs"] for d in docs] == [first["runs"], second["runs"]]
    page = render(docs)
    machine = first["machine"]
    assert f"## {machine['cpu']}, {machine['cores']} cores" in page
    assert "| decode b1 (tok/s) | 200.0 | 160.0 | **1.25×** |" in page
    assert "| load (s) | 2.00 | 1.00 | **0.50×** |" in page            # lower is better
    assert "`torchllama bench decode`" in page
    assert "| decode | SmolLM2 (auto) | decode b1 | 2 | 1.25× – 1.50× |" in page   # noise band


def test_save_none_writes_nothing_and_bad_files_are_named(tmp_path, capsys):
    assert save("serve", [], "none") is None and not list(tmp_path.iterdir())
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="other.json"):
        load_results(tmp_path)
    assert "No results" in render([])


def test_the_committed_results_render_and_the_readme_shows_them():
    from pathlib import Path

    from torchllama.bench.results import END, START, summary

    repo = Path(__file__).resolve().parents[1]
    docs = load_results(repo / "benchmarks" / "results")
    assert docs, "benchmarks/results/ holds the results the benchmarks page shows"
    page = render(docs)
    assert "llama.cpp" in page and "×" in page
    readme = (repo / "README.md").read_text()
    table = readme.split(START, 1)[1].split(END, 1)[0]
    assert table.strip() == summary(docs).strip(), \
        "the README's speed table is stale: python -m torchllama.bench.results README.md"


def test_the_summary_keeps_each_figures_latest_ratio():
    """A later run that measured other figures of a model (a 2048-token prefill) updates the
    figures it measured and keeps the earlier run's others."""
    from torchllama.bench.results import summary

    first = document("shapes", [Run("1B", [Figure("prefill 512", "tok/s", 500.0, 250.0),
                                           Figure("decode b1", "tok/s", 80.0, 50.0)],
                                    "llama.cpp")])
    later = document("shapes", [Run("1B", [Figure("prefill 2048", "tok/s", 300.0, 200.0),
                                           Figure("decode b1", "tok/s", 60.0, 50.0)],
                                    "llama.cpp")])
    cpu = summary([first]).splitlines()[2].split(" | ")[2]
    row = summary([first, later]).splitlines()[2]
    assert row == (f"| 1B | llama.cpp | {cpu} | prefill 512 **2.00×** · decode b1 **1.20×** · "
                   "prefill 2048 **1.50×** |"), row


def test_the_summary_has_a_row_per_cpu():
    """The same model measured on two CPUs (or kernel levels): a row each, so one's figures
    never stand in for the other's."""
    from torchllama.bench.results import summary

    amd = document("shapes", [Run("1B", [Figure("prefill 512", "tok/s", 500.0, 250.0)],
                                  "llama.cpp")])
    amd["machine"].update(cpu="AMD EPYC", kernels="avx512_vnni")
    intel = document("shapes", [Run("1B", [Figure("prefill 512", "tok/s", 300.0, 250.0)],
                                    "llama.cpp")])
    intel["machine"].update(cpu="Intel(R) Xeon(R) Processor", kernels="avx2")
    rows = summary([amd, intel]).splitlines()[2:]
    assert rows == ["| 1B | llama.cpp | AMD EPYC, avx512_vnni | prefill 512 **2.00×** |",
                    "| 1B | llama.cpp | Intel Xeon, avx2 | prefill 512 **1.20×** |"], rows
