"""The anatomy report's attention capture, head scores, sampling and logit-lens sections, the
page writer and the `torchllama anatomy` command.

Oracles: transformers' eager attention (output_attentions) and hidden states
(output_hidden_states) for the capture, on a tiny random GQA Llama (the real SmolLM2's:
test_parity_real.py);
hand-built attention patterns whose scores are known; the model's own final logits for the
logit lens.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from torchllama import anatomy
from torchllama.anatomy import scores as S
from torchllama.anatomy.attention import attention_probs
from torchllama.anatomy.logit_lens import logit_lens
from torchllama.anatomy.temperature import distribution_stats
from torchllama.cli import main
from torchllama.errors import ArgumentError

transformers = pytest.importorskip("transformers")


# ---- scores on hand-built patterns -----------------------------------------------------------

def _pattern(T: int, rows: dict[int, dict[int, float]]) -> torch.Tensor:
    """(T, T) causal attention, row t = the given {key: prob}, else all on key 0."""
    p = torch.zeros(T, T)
    for t in range(T):
        for s, v in rows.get(t, {0: 1.0}).items():
            p[t, s] = v
    return p


def test_previous_token_self_and_sink_scores_of_pure_heads():
    T = 8
    prev = _pattern(T, {t: {t - 1: 1.0} for t in range(1, T)})
    diag = _pattern(T, {t: {t: 1.0} for t in range(T)})
    sink = _pattern(T, {})                                   # everything on token 0
    assert S.previous_token_score(prev) == 1 and S.self_score(prev) == 0
    assert S.self_score(diag) == 1 and S.previous_token_score(diag) == 0
    assert S.sink_score(sink) == 1 and S.previous_token_score(sink) == pytest.approx(1 / 7)
    half = 0.5 * prev + 0.5 * diag
    assert S.previous_token_score(half) == pytest.approx(0.5)
    # stacked (L, H, T, T) → (L, H)
    stack = torch.stack([torch.stack([prev, diag]), torch.stack([sink, half])])
    assert S.previous_token_score(stack).shape == (2, 2)
    assert S.classify_heads({"previous": S.previous_token_score(stack),
                             "self": S.self_score(stack), "sink": S.sink_score(stack),
                             "local": S.local_score(stack, 2),
                             "entropy_normalized": S.entropy(stack, normalized=True)}) == \
        [["previous-token", "self"], ["sink", "previous-token"]]


def test_uniform_head_has_maximal_normalized_entropy_and_local_mass():
    T = 10
    uniform = torch.tril(torch.ones(T, T))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    assert S.entropy(uniform, normalized=True) == pytest.approx(1.0, abs=1e-6)
    assert S.entropy(uniform) == pytest.approx(
        sum(math.log(t + 1) for t in range(1, T)) / (T - 1), abs=1e-5)
    # local mass within the last 4 keys at position t ≥ 4: 4 / (t + 1)
    assert S.local_score(uniform, 4) == pytest.approx(sum(4 / (t + 1) for t in range(4, T)) / 6)
    with pytest.raises(ValueError):
        S.local_score(uniform, T)


def test_induction_score_on_a_repeated_sequence():
    n = 5
    tokens = S.repeated_random_tokens(n, list(range(100, 200)), 1, prefix=[1],
                                      generator=torch.Generator().manual_seed(0))[0]
    assert tokens.shape == (1 + 2 * n,) and torch.equal(tokens[1:1 + n], tokens[1 + n:])
    assert len(set(tokens[1:1 + n].tolist())) == n      # (seed 0 draws no repeats)
    T = tokens.shape[0]
    # a perfect induction head: position i of the second copy attends i − n + 1
    ind = _pattern(T, {1 + n + j: {2 + j: 1.0} for j in range(n)})
    dup = _pattern(T, {1 + n + j: {1 + j: 1.0} for j in range(n)})   # earlier copy itself
    assert S.induction_score(ind, tokens) == 1 and S.duplicate_token_score(ind, tokens) == 0
    assert S.duplicate_token_score(dup, tokens) == 1 and S.induction_score(dup, tokens) == 0
    prev = _pattern(T, {t: {t - 1: 1.0} for t in range(1, T)})
    assert S.induction_score(prev, tokens) == 0
    # no repeated token: nothing to score
    assert S.induction_score(ind, torch.arange(T)) == 0


# ---- capture against transformers' eager attention ------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama():
    """A tiny random GQA Llama (4 query heads, 2 KV heads) in transformers and in torchllama."""
    from tests.test_zoo_oracles import ours_from, perturbed

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=300,
                                      max_position_embeddings=128, rope_theta=10000.0,
                                      attn_implementation="eager")
    torch.manual_seed(0)
    hf = perturbed(transformers.LlamaForCausalLM(config))
    return hf, ours_from(hf)


def test_captured_attention_equals_transformers_eager_attention(tiny_llama):
    hf, ours = tiny_llama
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(tokens, output_attentions=True, output_hidden_states=True)
        plain = ours(tokens)
        with anatomy.capture_attention(ours) as cap:
            captured = ours(tokens)
    probs = cap.probs                                                  # (L, B, H, T, T)
    assert probs.shape == (3, 2, 4, 24, 24)
    torch.testing.assert_close(probs, torch.stack(out.attentions), atol=1e-5, rtol=0)
    assert torch.equal(probs.triu(1), torch.zeros_like(probs))        # causal
    torch.testing.assert_close(captured, plain, atol=1e-5, rtol=0)    # same model outputs
    assert all(layer.attention.capture is None for layer in ours.layers)   # off again
    # residual stream: HF's hidden_states[0..L-1] are the embeddings and block outputs
    stream = anatomy.residual_stream(ours, tokens)                    # (L+1, B, T, D)
    torch.testing.assert_close(stream[:-1], torch.stack(out.hidden_states[:-1]),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.norm(stream[-1]), out.hidden_states[-1], atol=1e-5, rtol=0)


def test_capture_with_a_kv_cache_records_each_call(tiny_llama):
    _, ours = tiny_llama
    tokens = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(2))
    full = attention_probs(ours, tokens)                               # (L, 1, H, 10, 10)
    ours.setup_caches(1, 32)
    try:
        with torch.no_grad(), anatomy.capture_attention(ours) as cap:
            ours(tokens[:, :6])
            ours(tokens[:, 6:7], start_pos=6)
    finally:
        ours.clear_caches()
    decode = cap.probs                                                 # (L, 1, H, 1, S)
    assert len(cap.per_layer[0]) == 2 and cap.per_layer[0][0].shape == (1, 4, 6, 6)
    assert decode.shape[-1] >= 7 and decode[..., 7:].sum() == 0        # unwritten slots
    torch.testing.assert_close(decode[:, :, :, 0, :7], full[:, :, :, 6, :7], atol=1e-5, rtol=0)


def test_padded_batch_attention_equals_each_row_alone(smollm2):
    model, tok = smollm2
    report = anatomy.run(only="attention", loaded=smollm2)
    section = report["attention"]
    assert section.data["padded_vs_alone_max_abs_diff"] < 1e-4
    probs = section.tensors["padded_probs"]                            # (L, 2, H, W, W)
    pad = section.tensors["pad"]
    short = int(pad.argmax())
    assert pad[short] > 0
    assert probs[:, short, :, pad[short]:, :pad[short]].abs().max() == 0   # padding unseen
    assert len(section.figures) == 3


# ---- heads, sampling, logit lens on the real model --------------------------------------------

def test_smollm2_has_induction_heads_and_attention_sinks(smollm2):
    heads = anatomy.run(only="heads", loaded=smollm2)["heads"]
    induction = heads.tensors["induction"]
    assert induction.shape == (30, 9)
    # measured: 8 heads above 0.4, all in layers 17–23; previous-token heads exist
    assert heads.data["n_induction_heads"] >= 3
    assert heads.data["n_previous_token_heads"] >= 1
    assert induction[:10].max() < 0.4                  # no induction head in the first layers
    assert max(heads.data["sink_by_layer"][10:]) > 0.5
    json.dumps(heads.data)


def test_sampling_stats_are_the_temperature_scaled_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    for t in (0.5, 1.0, 2.0):
        s = distribution_stats(logits, t)
        p = torch.softmax(logits / t, -1)
        torch.testing.assert_close(s["probs"], p)
        assert s["entropy"] == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)
        # Meta's nucleus: keep a token while the mass before it is ≤ 0.9
        before = torch.cumsum(p, 0) - p
        assert s["top_p_kept"] == int((before <= 0.9).sum())
        assert s["min_p_kept"] == int((p >= 0.05 * p.max()).sum())


def test_logit_lens_last_layer_is_the_models_prediction(tiny_llama):
    _, ours = tiny_llama
    tokens = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(4))
    top_ids, top_probs = logit_lens(ours, tokens)                      # (L, T)
    with torch.no_grad():
        probs = torch.softmax(ours(tokens)[0], -1)                     # (T, V)
    assert top_ids.shape == (3, 12)
    assert torch.equal(top_ids[-1], probs.argmax(-1))
    torch.testing.assert_close(top_probs[-1], probs.max(-1).values, atol=1e-5, rtol=0)


# ---- the page, the command, bad input ----------------------------------------------------------

def test_report_page_json_and_overwrite_rules(smollm2, tmp_path):
    report = anatomy.run(only="sampling,logit-lens", loaded=smollm2,
                         text="word " * 400, max_tokens=64)
    assert any("first 64" in note for note in report.ctx.notes)       # truncation stated
    out = tmp_path / "report"
    index = anatomy.write_report(report, out)
    page = index.read_text()
    assert page.count("data:image/png;base64,") == 4 and "first 64" in page
    # self-contained: two explorers' data and one inline script, nothing fetched
    assert page.count("<script") == 3 and "<script src" not in page
    assert page.count('<script type="application/json">') == 2
    assert "http:" not in page and "https:" not in page       # (":" is not base64's)
    data = json.loads((out / "anatomy.json").read_text())
    assert set(data) >= {"sampling", "logit-lens", "tokens"} and len(data["tokens"]) == 64
    assert sorted(p.name for p in (out / "figures").iterdir()) == [
        "logit-lens-agreement.png", "logit-lens-grid.png", "sampling-entropy.png",
        "sampling-temperatures.png"]
    anatomy.write_report(report, out)                                  # its own files: fine
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "index.html").write_text("my page")
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ArgumentError, match="index.html"):
        anatomy.write_report(report, mine)
    assert (mine / "index.html").read_text() == "my page"
    anatomy.write_report(report, mine, force=True)
    assert (mine / "notes.txt").read_text() == "keep"


def test_cli_bad_input_is_one_line_and_exit_1(tmp_path, capsys):
    assert main(["anatomy", "--only", "attention,bogus", "--out", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert "bogus" in err and "logit-lens" in err and "Traceback" not in err
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text("")
    assert main(["anatomy", "--model", str(run), "--out", str(tmp_path / "b")]) == 1
    assert "without a checkpoint" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "anatomy.json").write_text("{}")
    assert main(["anatomy", "--out", str(taken)]) == 1
    assert "--force" in capsys.readouterr().err
    assert main(["anatomy", "--text", "a", "--text-file", "x", "--out", str(tmp_path / "c")]) == 1
    assert "not both" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_cli_writes_the_report(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["anatomy", "--only", "heads,sampling", "--out", str(out),
                 "--text", "The cat sat on the mat. The cat sat on the mat."]) == 0
    printed = capsys.readouterr().out
    assert "induction score" in printed and str(out / "index.html") in printed
    assert (out / "figures" / "heads-scores.png").stat().st_size > 10_000
