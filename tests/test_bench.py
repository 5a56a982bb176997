"""`torchllama bench decode` (torchllama.bench.decode, .peer) on a tiny random GGUF written here:
the batched decode of ours yields, row by row, the greedy tokens of the same prompt alone (and of
a cache-free oracle); the table has its three figures and ratios; `--peer llama.cpp` without
llama-cpp-python exits 1 naming `make bench-peer`; with it, llama.cpp runs on the same file and
gives positive figures. Speed is printed, never asserted."""

from __future__ import annotations

import json

import sys

import pytest
import torch

import torchllama
from torchllama.bench.decode import OursDecodeRun, Throughput, _prompt_ids, format_table, run_bench
from torchllama.checkpoint import save
from torchllama.cli import main
from torchllama.config import ModelArgs
from torchllama.model import Transformer

from conftest import LLAMA_SPM_VOCAB


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer GQA Llama with random weights and Llama 2's vocabulary, as an F32 GGUF file
    that llama.cpp can load too."""
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32000,
                     hidden_dim=176, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=256)
    model = Transformer(args).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5 if p.ndim == 1 else 0.08)
    path = tmp_path_factory.mktemp("bench") / "tiny.gguf"
    save(model, torchllama.load_tokenizer(LLAMA_SPM_VOCAB), path, "gguf", progress=False)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    model, _ = torchllama.load(tiny_gguf, progress=False)
    return model


@torch.inference_mode()
def greedy_without_cache(model, prompt: torch.Tensor, n: int) -> list[int]:
    """The oracle: n greedy tokens, each from a full forward pass over the whole sequence."""
    model.clear_caches()
    ids = prompt.tolist()
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_every_decode_run_of_a_sliding_window_model_is_the_first_one():
    """A ring cache cannot rewind past its window: the run puts the prefill's state back, so a
    second run decodes what the first did, appending as generation does (a rewinding run
    attended over overwritten slots and took the slow concatenating path)."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                                  max_seq_len=128, sliding_window=4,
                                  layer_types=["local", "global"])).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5 if p.ndim == 1 else 0.3)
    prompt = _prompt_ids(256, 8)                                                # (1, 8)
    run = OursDecodeRun(model, prompt, 80)          # 8 + 80 slots > the ring's 4 + 64
    run()
    first = run.tokens.clone()
    run()
    assert torch.equal(run.tokens, first)
    assert first[0].tolist() == greedy_without_cache(model, prompt[0], 81)[1:]


def test_batched_decode_gives_each_row_its_batch_one_tokens(tiny):
    prompts = _prompt_ids(tiny.args.vocab_size, 12, rows=3)                     # (3, 12)
    new = 5
    batched = OursDecodeRun(tiny, prompts, new)
    n, seconds = batched()
    assert n == 3 * new and seconds > 0
    tokens = batched.tokens.clone()                                             # (3, new)
    batched()                        # a second run from the same prompts, slots overwritten
    assert torch.equal(batched.tokens, tokens)
    for row in range(3):
        alone = OursDecodeRun(tiny, prompts[row:row + 1], new)
        alone()
        assert alone.tokens[0].tolist() == tokens[row].tolist(), row
        oracle = greedy_without_cache(tiny, prompts[row], new + 1)   # prefill's token first
        assert tokens[row].tolist() == oracle[1:], row


def test_prompt_rows_share_the_batch_one_prompt():
    assert torch.equal(_prompt_ids(500, 7, rows=3)[:1], _prompt_ids(500, 7))


def test_run_bench_without_peer_reports_three_positive_figures(tiny_gguf):
    lines: list[str] = []
    results = run_bench(str(tiny_gguf), "float32", prompt_tokens=10, new_tokens=3, repeats=1,
                        peer="none", batch=3, print_fn=lines.append)
    assert [r.name for r in results] == ["torchllama"]
    ours = results[0]
    assert ours.prefill_tok_s > 0 and ours.decode_tok_s > 0 and ours.batch_decode_tok_s > 0
    text = "\n".join(lines)
    assert "prefill tok/s (10)" in text and "decode tok/s (batch 1, 3)" in text
    assert "decode tok/s (batch 3, 3)" in text and "batch 3 / batch 1" in text
    assert "threads" in text and "CPU capability" in text


def test_table_has_ratio_column_and_batch_speedup_row():
    lines = format_table([Throughput("torchllama", 600.0, 25.0, 100.0),
                          Throughput("llama.cpp", 300.0, 100.0, 400.0)], 512, 128, 8)
    assert lines[0].split() == ["torchllama", "llama.cpp", "ratio"]
    assert lines[1].split() == ["prefill", "tok/s", "(512)", "600.0", "300.0", "2.00x"]
    assert lines[2].split()[-3:] == ["25.0", "100.0", "0.25x"]
    assert lines[3].startswith("decode tok/s (batch 8, 128)")
    assert lines[4].split()[-2:] == ["4.00x", "4.00x"]


def test_bench_cli_no_hf_alias_and_bad_values(tiny_gguf, capsys, tmp_path):
    common = ["bench", "decode", "--model", str(tiny_gguf), "--prompt-tokens", "8",
              "--new-tokens", "2", "--repeats", "1", "--batch", "2", "--results",
              str(tmp_path)]
    assert main(common + ["--no-hf"]) == 0                 # the old spelling of --peer none
    out = capsys.readouterr().out
    assert "decode tok/s (batch 2, 2)" in out and "transformers" not in out
    (written,) = tmp_path.glob("*.json")                   # the results file: data
    data = json.loads(written.read_text())
    assert f"results written to {written}" in out and data["benchmark"] == "decode"
    assert data["command"].startswith("torchllama bench decode") and data["machine"]["cores"]
    (run,) = data["runs"]
    assert [f["name"] for f in run["figures"]] == ["prefill 8", "decode b1", "decode b2"]
    assert all(f["ours"] > 0 and f["peer"] is None for f in run["figures"])
    assert main(common + ["--no-hf", "--peer", "llama.cpp"]) == 1
    assert "--no-hf" in capsys.readouterr().err
    assert main(common + ["--peer", "llama"]) == 1
    assert "--peer 'llama'" in capsys.readouterr().err
    assert main(common + ["--batch", "0", "--peer", "none"]) == 1
    assert "--batch" in capsys.readouterr().err


def test_peer_llama_cpp_without_llama_cpp_python_names_make_bench_peer(tiny_gguf, capsys,
                                                                       monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)        # `import llama_cpp` fails
    assert main(["bench", "decode", "--model", str(tiny_gguf), "--peer", "llama.cpp",
                 "--repeats", "1"]) == 1
    err = capsys.readouterr().err
    assert "make bench-peer" in err and "llama-cpp-python" in err


def test_the_peer_is_compared_at_its_faster_setting():
    """llama.cpp measured with flash attention on and off: each figure the faster one (on a
    CPU, off decodes faster and on can prefill faster), both settings printed."""
    from torchllama.bench.decode import _fastest_setting

    lines: list[str] = []
    got = _fastest_setting([Throughput("torchllama", 600.0, 50.0, 200.0),
                            Throughput("llama.cpp fa=on", 300.0, 54.0, 150.0),
                            Throughput("llama.cpp fa=off", 280.0, 96.0, 160.0)], lines.append)
    assert got == [Throughput("torchllama", 600.0, 50.0, 200.0),
                   Throughput("llama.cpp", 300.0, 96.0, 160.0)]
    assert lines == ["  llama.cpp fa=on: prefill 300.0, decode 54.0, batch decode 150.0 tok/s",
                     "  llama.cpp fa=off: prefill 280.0, decode 96.0, batch decode 160.0 tok/s"]


def test_llama_cpp_peer_runs_on_the_same_file(tiny_gguf, tiny):
    pytest.importorskip("llama_cpp")
    from torchllama.bench import peer

    prompts = _prompt_ids(tiny.args.vocab_size, 16, rows=3).tolist()
    with peer.LlamaCpp(str(tiny_gguf), torch.get_num_threads()) as llm:
        tokens, seconds = peer.PrefillRun(llm, prompts[0], True)()
        assert tokens == 16 and seconds > 0
        batched = peer.DecodeRun(llm, prompts, 5, False)
        assert batched()[0] == 15 and batched()[1] > 0
        for row in range(3):                        # llama.cpp's own batch-1 oracle
            alone = peer.DecodeRun(llm, prompts[row:row + 1], 5, True)
            alone()
            assert alone.tokens[0].tolist() == batched.tokens[row].tolist(), row
    assert "llama-cpp-python" in peer.peer_version()

    lines: list[str] = []
    results = run_bench(str(tiny_gguf), "float32", prompt_tokens=16, new_tokens=4, repeats=1,
                        peer="llama.cpp", batch=2, print_fn=lines.append)
    assert [r.name for r in results] == ["torchllama", "llama.cpp"]
    for r in results:
        assert r.prefill_tok_s > 0 and r.decode_tok_s > 0 and r.batch_decode_tok_s > 0
    assert any(line.startswith("peer llama-cpp-python") for line in lines)
    assert any(line.startswith("  llama.cpp fa=on: prefill") for line in lines)
    assert any(line.startswith("  llama.cpp fa=off: prefill") for line in lines)


def test_interleaved_rates_warm_up_once_then_alternate(monkeypatch):
    """Each setting warms up once (dropped), then the timed runs alternate A, B, A, B; the
    rates are tokens / seconds of each timed run, in order; `measure` is their median."""
    from torchllama.bench import timing

    monkeypatch.setattr(timing, "PAUSE_S", 0.0)
    calls: list[str] = []
    seconds = {"a": iter([9.0, 1.0, 2.0, 4.0]), "b": iter([9.0, 0.5, 0.25, 1.0])}

    def run(name):
        def go():
            calls.append(name)
            return 8, next(seconds[name])
        return go

    rates = timing.interleaved_rates({"a": run("a"), "b": run("b")}, repeats=3)
    assert calls == ["a", "b", "a", "b", "a", "b", "a", "b"]
    assert rates == {"a": [8.0, 4.0, 2.0], "b": [16.0, 32.0, 8.0]}
    seconds = {"a": iter([9.0, 1.0, 2.0, 4.0]), "b": iter([9.0, 0.5, 0.25, 1.0])}
    assert timing.measure({"a": run("a"), "b": run("b")}, repeats=3) == {"a": 4.0, "b": 16.0}
