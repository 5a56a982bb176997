"""`torchllama.bench.shapes` (random-weight GGUFs of real shapes) and `torchllama bench shapes`.

Oracles: the tensor-type counts llama.cpp's own loader prints for the published Q4_0 and Q4_K_M
files of the same architectures (TheBloke's Llama-2-7B GGUFs, bartowski's Llama 3.2 1B and
Llama 3.1 8B: rope_freqs, which we do not write, not counted); the `gguf` package's dequantizers
(blocks decode to finite ~N(0, 0.02) values); transformers' GGUF loader (the file of the tiny
shape gives its logits in our model); llama.cpp when installed; for the other mixes,
llama.cpp's rules (src/llama-quant.cpp, `llama_tensor_get_type_impl`) written out per layer,
and the `gguf` library's dequantization (a tiny file of each loads to the logits its float32
load gives). Speed is printed, never asserted.
"""

from __future__ import annotations

import json
from collections import Counter

import gguf
import numpy as np
import pytest
import torch

import torchllama
from torchllama.bench import shapes
from torchllama.bench.shapes_bench import ShapesConfig, parse_sizes, run_shapes_bench
from torchllama.cli import main
from torchllama.errors import ArgumentError


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    """The tiny shape's Q4_K_M file, written anew (the test suite's cache, conftest's
    TORCHLLAMA_CACHE, keeps the one the CLI tests reuse: the kernels' build lives there too)."""
    path = tmp_path_factory.mktemp("shapes") / "tiny-q4_k_m.gguf"
    return shapes.ensure_shape_file("tiny", "q4_k_m", progress=False, path=path)


# llama.cpp's "llama_model_loader: - type X: N tensors" lines of the published files.
PUBLISHED = {
    ("7b", "q4_0"): {"F32": 65, "Q4_0": 225, "Q6_K": 1},
    ("7b", "q4_k_m"): {"F32": 65, "Q4_K": 193, "Q6_K": 33},
    ("1b", "q4_k_m"): {"F32": 33, "Q4_K": 96, "Q6_K": 17},
    ("8b", "q4_k_m"): {"F32": 65, "Q4_K": 193, "Q6_K": 33},
}


@pytest.mark.parametrize("shape, qtype", PUBLISHED)
def test_tensor_types_match_llama_cpp_published_files(shape, qtype):
    plan = shapes.tensor_plan(shapes.SHAPES[shape], qtype)
    assert dict(Counter(t.type.name for t in plan)) == PUBLISHED[shape, qtype]


def test_q4_k_m_picks_llama_cpp_layers_and_heads():
    plan = {t.ours: t.type.name for t in shapes.tensor_plan(shapes.SHAPES["7b"], "q4_k_m")}
    # use_more_bits for 32 layers: 0-3, 28-31 and every third from 6 (llama-quant.cpp)
    more = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    for i in range(32):
        want = "Q6_K" if i in more else "Q4_K"
        assert plan[f"layers.{i}.attention.wv.weight"] == want, i
        assert plan[f"layers.{i}.feed_forward.w2.weight"] == want, i
        assert plan[f"layers.{i}.attention.wq.weight"] == "Q4_K"
    assert plan["output.weight"] == "Q6_K" and plan["tok_embeddings.weight"] == "Q4_K"
    tied = {t.ours: t.type.name for t in shapes.tensor_plan(shapes.SHAPES["1b"], "q4_0")}
    assert "output.weight" not in tied and tied["tok_embeddings.weight"] == "Q6_K"
    q8 = shapes.tensor_plan(shapes.SHAPES["1b"], "q8_0")
    assert {t.type.name for t in q8 if len(t.shape) == 2} == {"Q8_0"}


# use_more_bits for 32 layers: 0-3, 28-31 and every third from 6 (llama-quant.cpp)
MORE_32 = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}


def per_layer(special: str, layers, other: str) -> list[str]:
    """32 layers' types: `special` in `layers`, else `other`."""
    return [special if i in layers else other for i in range(32)]


# llama.cpp's picks at 7b (Llama 2: 32 layers, n_gqa 1, untied) and, where it differs, 8b
# (n_gqa 4): attn_v, ffn_down, attn_output, the other matrices (q, k, gate, up) and the
# untied token embedding; the output is Q6_K in every one of these mixes.
NEW_MIXES = {
    "q5_k_m": {"wv": per_layer("Q6_K", MORE_32, "Q5_K"),
               "w2": per_layer("Q6_K", MORE_32, "Q5_K"), "wo": "Q5_K", "rest": "Q5_K"},
    "q5_k_s": {"wv": "Q5_K", "w2": "Q5_K", "wo": "Q5_K", "rest": "Q5_K"},
    "q3_k_m": {"wv": per_layer("Q5_K", {0, 1}, "Q4_K"),
               "w2": per_layer("Q5_K", {0, 1}, "Q4_K"),            # layers < 32/16
               "wo": "Q4_K", "rest": "Q3_K"},
    "q2_k": {"wv": "Q3_K", "wv_8b": "Q4_K", "w2": "Q3_K", "wo": "Q3_K", "rest": "Q2_K"},
    "iq4_xs": {"wv": "IQ4_XS", "wv_8b": "Q5_K", "w2": per_layer("Q5_K", range(4), "IQ4_XS"),
               "wo": "IQ4_XS", "rest": "IQ4_XS"},                # ffn_down: layers < 32/8
    "iq4_nl": {"wv": "IQ4_NL", "wv_8b": "Q5_K", "w2": per_layer("Q5_K", range(4), "IQ4_NL"),
               "wo": "IQ4_NL", "rest": "IQ4_NL"},
    "q5_1": {"wv": "Q5_1", "w2": "Q5_1", "wo": "Q5_1", "rest": "Q5_1"},
    "q5_0": {"wv": "Q5_0", "w2": "Q5_0", "wo": "Q5_0", "rest": "Q5_0"},
}


@pytest.mark.parametrize("qtype", NEW_MIXES)
def test_new_mixes_pick_llama_cpp_types(qtype):
    want = NEW_MIXES[qtype]
    for shape in ("7b", "8b"):
        plan = {t.ours: t.type.name for t in shapes.tensor_plan(shapes.SHAPES[shape], qtype)}
        for kind in ("wv", "w2", "wo"):
            types = want.get(f"{kind}_{shape}", want[kind])
            types = types if isinstance(types, list) else [types] * 32
            part = "feed_forward" if kind == "w2" else "attention"
            assert [plan[f"layers.{i}.{part}.{kind}.weight"] for i in range(32)] == types, (
                shape, kind)
        for i in range(32):
            for name in ("attention.wq", "attention.wk", "feed_forward.w1", "feed_forward.w3"):
                assert plan[f"layers.{i}.{name}.weight"] == want["rest"], (shape, name, i)
        assert plan["output.weight"] == "Q6_K" and plan["tok_embeddings.weight"] == want["rest"]
        assert all(t == "F32" for n, t in plan.items() if "norm" in n)


def test_new_mixes_at_the_small_shapes():
    def plan(shape, qtype):
        return {t.ours: t.type.name for t in shapes.tensor_plan(shapes.SHAPES[shape], qtype)}

    q3 = plan("1b", "q3_k_m")                         # 16 layers: ffn_down Q5_K below 16/16
    assert [q3[f"layers.{i}.feed_forward.w2.weight"] for i in range(3)] == ["Q5_K", "Q4_K",
                                                                           "Q4_K"]
    assert [plan("tiny", "q3_k_m")[f"layers.{i}.feed_forward.w2.weight"] for i in (0, 1)] == [
        "Q4_K", "Q4_K"]                               # 2 layers: 2/16 = 0
    xs = plan("1b", "iq4_xs")                         # n_gqa 4; ffn_down Q5_K below 16/8
    assert {xs[f"layers.{i}.attention.wv.weight"] for i in range(16)} == {"Q5_K"}
    assert [xs[f"layers.{i}.feed_forward.w2.weight"] for i in range(3)] == ["Q5_K", "Q5_K",
                                                                           "IQ4_XS"]
    assert plan("3b", "iq4_xs")["layers.5.attention.wv.weight"] == "IQ4_XS"   # n_gqa 3
    assert plan("3b", "q2_k")["layers.5.attention.wv.weight"] == "Q3_K"
    assert plan("1b", "q2_k")["layers.5.attention.wv.weight"] == "Q4_K"
    assert plan("tiny", "q2_k")["layers.0.attention.wv.weight"] == "Q3_K"      # n_gqa 2
    with pytest.raises(ArgumentError, match="mixture of experts.*q4_0, q4_k_m, q8_0"):
        shapes.tensor_plan(shapes.SHAPES["olmoe-1b-7b"], "q5_k_m")
    with pytest.raises(ArgumentError, match="--type 'q5_k'"):
        shapes.tensor_plan(shapes.SHAPES["olmoe-1b-7b"], "q5_k")


T = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL,
                                   T.IQ4_XS], ids=lambda t: t.name)
def test_random_blocks_dequantize_to_realistic_values(qtype):
    blocks = shapes.RANDOM_BLOCKS[qtype](np.random.default_rng(0), 4096)  # (4096, type size)
    assert blocks.shape == (4096, gguf.GGML_QUANT_SIZES[qtype][1]) and blocks.dtype == np.uint8
    x = gguf.quants.dequantize(blocks, qtype)                           # (4096, block values)
    assert np.isfinite(x).all() and (np.abs(x).max(axis=1) > 0).all()  # no zero scales
    assert abs(float(x.mean())) < 1e-3 and 0.018 < float(x.std()) < 0.022
    assert float(np.abs(x).max()) < 0.1


@pytest.mark.parametrize("qtype", NEW_MIXES)
def test_tiny_file_of_each_new_mix_loads(qtype, tmp_path, capsys):
    path = shapes.ensure_shape_file("tiny", qtype, progress=False,
                                    path=tmp_path / f"tiny-{qtype}.gguf")
    plan = {t.ours: t.type for t in shapes.tensor_plan(shapes.SHAPES["tiny"], qtype)}
    base = shapes.QUANT_TYPES[qtype][0]
    assert base in plan.values() and "output.weight" not in plan
    assert plan["tok_embeddings.weight"] == T.Q6_K      # tied: the embedding is the output
    model, _ = torchllama.load(path, dtype="auto")
    note = capsys.readouterr().err
    assert "no kernel" not in note, note                # every type on the kernels
    ref, _ = torchllama.load(path, dtype="float32")   # the `gguf` library's dequantization
    ids = torch.arange(100, 132).unsqueeze(0)                           # (1, 32)
    with torch.inference_mode():
        ours = model(ids, 0)[0]                                          # (T, V)
        want = ref(ids, 0)[0]                                            # (T, V)
    assert torch.isfinite(ours).all() and 0.1 < float(want.std()) < 10
    # the default path quantizes activations to 8 bits: close, not equal
    assert float((ours - want).norm() / want.norm()) < 0.05


def test_tiny_file_matches_transformers_and_its_plan(tiny_q4_k_m):
    from transformers import AutoModelForCausalLM

    reader = gguf.GGUFReader(tiny_q4_k_m)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types == {t.name: t.type.name for t in shapes.tensor_plan(shapes.SHAPES["tiny"],
                                                                     "q4_k_m")}
    assert set(types.values()) == {"F32", "Q4_K", "Q6_K"}
    model, tokenizer = torchllama.load(tiny_q4_k_m, progress=False)
    assert tokenizer.vocab_size == 49152 and model.args.dim == 256 and model.args.n_kv_heads == 2
    ids = torch.tensor([tokenizer.encode("The capital of France is Paris, and")])
    hf = AutoModelForCausalLM.from_pretrained(tiny_q4_k_m.parent, gguf_file=tiny_q4_k_m.name,
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        ours = model(ids, 0)[0]                                          # (T, V)
        ref = hf(ids).logits[0]                                          # (T, V)
    assert torch.isfinite(ref).all() and 0.1 < float(ref.std()) < 10
    # our default path quantizes activations to 8 bits: close, not equal
    assert float((ours - ref).norm() / ref.norm()) < 0.05
    # random weights give flat logits: transformers' top token among our top 5 at every position
    assert (ours.topk(5, dim=-1).indices == ref.argmax(-1, keepdim=True)).any(-1).all()


def test_cached_file_is_reused_and_a_stale_one_rewritten(tiny_q4_k_m, tmp_path):
    stat = tiny_q4_k_m.stat()
    assert shapes.ensure_shape_file("tiny", "q4_k_m", progress=False,
                                    path=tiny_q4_k_m) == tiny_q4_k_m
    assert tiny_q4_k_m.stat().st_mtime_ns == stat.st_mtime_ns            # not rewritten
    tiny = shapes.SHAPES["tiny"]
    assert not shapes.is_current(tiny_q4_k_m, tiny, "q4_k_m", seed=1)
    assert not shapes.is_current(tiny_q4_k_m, tiny, "q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_q4_k_m.read_bytes()[:stat.st_size // 2])
    assert not shapes.is_current(cut, tiny, "q4_k_m")


def test_bench_shapes_cli_runs_on_the_tiny_shape(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "shapes", "--shape", "tiny", "--type", "q4_k_m", "--peer", "none",
                 "--prefill", "8,16", "--context", "24", "--batch", "1,2", "--runs", "1",
                 "--new-tokens", "4", "--threads", "1", "--json", str(out), "--results",
                 str(tmp_path / "results")]) == 0
    text = capsys.readouterr().out
    (written,) = (tmp_path / "results").glob("*.json")
    figures = json.loads(written.read_text())["runs"][0]["figures"]
    assert [f["name"] for f in figures] == ["prefill 8", "prefill 16", "decode b1 @24",
                                            "decode b2 @24", "load", "peak RSS after loading",
                                            "memory read bandwidth",
                                            "decode b1 @24, fraction of the read bandwidth"]
    # the roofline: bandwidth measured in the child, the fraction = bytes × tok/s ÷ bandwidth
    roof = json.loads(out.read_text())["results"][0]["roofline"]
    decode = figures[2]["ours"]
    ours_bytes = roof["bytes_per_token"]["torchllama"]
    assert figures[7]["ours"] == pytest.approx(ours_bytes * decode / (roof["read_gbs"] * 1e9))
    assert 0.5 < ours_bytes / roof["bytes_per_token"]["llama.cpp"] < 2    # the same matrices
    assert roof["read_gbs"] > 1 and 0 < roof["product_s"] < 1 / decode
    assert "memory read bandwidth" in text and "products + rest" in text
    assert "CPU capability" in text and "torchllama kernels" in text
    row = next(line for line in text.splitlines() if line.startswith("| TINY Q4_K_M"))
    assert len(row.split("|")) == 2 + 1 + 2 + 2 + 2          # model, 2 prefill, 2 decode, load, RSS
    result = json.loads(out.read_text())["results"][0]["engines"]["torchllama"]
    figures = result["settings"]["torchllama"]
    assert set(figures["prefill"]) == {"8", "16"} and set(figures["decode"]) == {"b1@24", "b2@24"}
    assert all(r > 0 for rates in [*figures["prefill"].values(), *figures["decode"].values()]
               for r in rates)
    assert result["load_s"] > 0 and result["rss_load_gb"] > 0.05


def test_bad_arguments_are_clear(tmp_path):
    cfg = ShapesConfig((8,), (24,), (1,), 1, 1, 4)
    with pytest.raises(ArgumentError, match="--shape '2b'"):
        run_shapes_bench(["2b"], ["q4_0"], cfg, peer="none")
    with pytest.raises(ArgumentError, match="--type 'q5_k'"):
        run_shapes_bench(["tiny"], ["q5_k"], cfg, peer="none")
    with pytest.raises(ArgumentError, match="--prefill"):
        parse_sizes("128,x", "prefill")
    with pytest.raises(ArgumentError, match="must exceed --new-tokens"):
        run_shapes_bench(["tiny"], ["q4_0"], ShapesConfig((8,), (4,), (1,), 1, 1, 4), "none")
    with pytest.raises(ArgumentError, match="beyond the 7b shape's context"):
        run_shapes_bench(["7b"], ["q4_0"], ShapesConfig((8,), (8192,), (1,), 1, 1, 4), "none")
    with pytest.raises(ArgumentError, match="4100 positions are beyond the 7b"):
        run_shapes_bench(["7b"], ["q4_0"], ShapesConfig((4096,), (512,), (1,), 1, 1, 4), "none")
    existing = tmp_path / "r.json"
    existing.write_text("{}")
    with pytest.raises(ArgumentError, match="already exists"):
        run_shapes_bench(["tiny"], ["q4_0"], cfg, peer="none", json_path=str(existing))
    assert existing.read_text() == "{}"


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_other_tiny_types_match_transformers(qtype):
    from transformers import AutoModelForCausalLM

    path = shapes.ensure_shape_file("tiny", qtype, progress=False)
    model, _ = torchllama.load(path, progress=False)
    ids = torch.arange(100, 132).unsqueeze(0)                           # (1, 32)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        ours = model(ids, 0)[0]                                          # (T, V)
        ref = hf(ids).logits[0]                                          # (T, V)
    assert float((ours - ref).norm() / ref.norm()) < 0.05


@pytest.mark.slow
def test_bench_shapes_with_llama_cpp(tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "r.json"
    assert main(["bench", "shapes", "--shape", "tiny", "--type", "q4_k_m", "--peer",
                 "llama.cpp", "--prefill", "16", "--context", "40", "--batch", "1,2",
                 "--runs", "1", "--new-tokens", "4", "--threads", "1", "--json",
                 str(out), "--results", "none"]) == 0
    engines = json.loads(out.read_text())["results"][0]["engines"]
    peer, ours = engines["llama.cpp"], engines["torchllama"]
    assert "error" not in peer and "error" not in ours, engines
    # each engine's load in a process of its own; the rates of both from one process, split
    assert set(peer["settings"]) == {"llama.cpp fa=on", "llama.cpp fa=off"}
    assert set(ours["settings"]) == {"torchllama"}
    for figures in [*peer["settings"].values(), *ours["settings"].values()]:
        assert min(figures["prefill"]["16"]) > 0 and min(figures["decode"]["b2@40"]) > 0
    assert peer["load_s"] > 0 and ours["load_s"] > 0 and ours["rss_load_gb"] > 0.05
    assert "runs interleaved" in capsys.readouterr().out
