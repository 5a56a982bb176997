"""`torchllama perplexity`: llama.cpp's method (tools/perplexity/perplexity.cpp) against an
independent computation by transformers on the same weights, its chunking and BOS rules, its
uncertainty formula, the CLI's errors and an end-to-end run; llama.cpp's own figure when
llama-cpp-python is installed (optional)."""

from __future__ import annotations

import math
import random

import pytest
import torch

import torchllama
from torchllama import cli
from torchllama.errors import ArgumentError
from torchllama.bench.perplexity import (llama_cpp_available, llama_cpp_perplexity, make_windows,
                                   perplexity, ppl_and_stderr, tokenize_text)

transformers = pytest.importorskip("transformers")

from test_hf_checkpoint import save_tiny, tiny_tokenizer  # noqa: E402,F401  (fixture)

CTX = 16


def make_text(n_words: int = 220, seed: int = 0) -> str:
    """Words the tiny BPE tokenizer knows, in a seeded random order (varied NLL per token)."""
    words = "Hello world! The quick brown fox jumps over the lazy dog. def f(x): return x + 1"
    words = words.split()
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(n_words))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_tokenizer):
    """(folder, HF model, our model, our tokenizer) of a tiny random Llama whose tokenizer adds
    BOS (<s> = 1)."""
    folder = tmp_path_factory.mktemp("tiny")
    hf = save_tiny(folder, tiny_tokenizer)
    model, tokenizer = torchllama.load(folder, progress=False)
    assert tokenizer.add_bos and tokenizer.bos_id == 1
    return folder, hf, model, tokenizer


def reference_nll(hf, ids: list[int], ctx: int, bos_id: int | None) -> torch.Tensor:
    """Per-token NLL by transformers, written out from llama.cpp's description: windows
    ids[i·ctx:(i+1)·ctx], BOS first, cross-entropy of positions ctx//2 .. ctx−2 against the
    next tokens."""
    nlls = []
    for i in range(len(ids) // ctx):
        window = torch.tensor(ids[i * ctx:(i + 1) * ctx])
        if bos_id is not None:
            window[0] = bos_id
        with torch.no_grad():
            logits = hf(window[None]).logits[0].float()               # (ctx, V)
        first = ctx // 2
        nlls.append(torch.nn.functional.cross_entropy(
            logits[first:ctx - 1], window[first + 1:], reduction="none").double())
    return torch.cat(nlls)


def test_perplexity_equals_transformers_on_the_same_windows(tiny):
    folder, hf, model, tokenizer = tiny
    text = make_text()
    hf_ids = transformers.AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    assert hf_ids[0] == 1 and hf_ids == tokenizer.encode(text, bos=True)   # same ids, BOS first
    nll = reference_nll(hf, hf_ids, CTX, bos_id=1)
    result = perplexity(model, tokenizer, text, ctx=CTX, batch_size=3)
    n = nll.numel()
    assert result.n_scored == n
    ppl = math.exp(nll.mean().item())
    stderr = ppl * (nll.std(unbiased=True) / math.sqrt(n)).item()   # = llama.cpp's expression
    assert result.ppl == pytest.approx(ppl, rel=1e-5)
    assert result.stderr == pytest.approx(stderr, rel=1e-4)
    assert result.nll_sum == pytest.approx(nll.sum().item(), rel=1e-5)
    # the running PPL after the last window is the final one; after window 1, window 1's own
    first = CTX // 2
    assert result.running[-1] == pytest.approx(result.ppl, rel=1e-12)
    assert result.running[0] == pytest.approx(math.exp(nll[:CTX - 1 - first].mean().item()),
                                              rel=1e-5)


def test_chunking_scores_the_second_half_of_each_window(tiny):
    _, _, model, tokenizer = tiny
    text = make_text()
    ids = tokenizer.encode(text, bos=True)
    for ctx in (CTX, 15):                                   # odd ctx: first = 7, 7 scored
        result = perplexity(model, tokenizer, text, ctx=ctx)
        n_chunk = len(ids) // ctx
        assert result.n_tokens == len(ids)
        assert result.chunks == n_chunk == len(result.running)
        assert result.n_scored == n_chunk * (ctx - 1 - ctx // 2)
    limited = perplexity(model, tokenizer, text, ctx=CTX, chunks=2)    # llama.cpp's --chunks
    assert (limited.chunks, limited.n_scored) == (2, 2 * (CTX - 1 - CTX // 2))
    assert limited.running == pytest.approx(perplexity(model, tokenizer, text, ctx=CTX)
                                            .running[:2], rel=1e-6)


def test_windows_start_with_bos_when_the_model_adds_it():
    ids = list(range(10, 60))                                # 50 tokens
    windows = make_windows(ids, 16, bos_id=1)
    assert windows.shape == (3, 16)                          # the 2-token tail is dropped
    assert windows[:, 0].tolist() == [1, 1, 1]
    assert windows[1, 1:].tolist() == ids[17:32]             # the rest is the text's
    plain = make_windows(ids, 16, bos_id=None)              # add_bos false (e.g. SmolLM2)
    assert plain[:, 0].tolist() == [10, 26, 42]
    assert make_windows(ids, 16, chunks=1, bos_id=1).shape == (1, 16)
    with pytest.raises(ArgumentError, match="--chunks"):
        make_windows(ids, 16, chunks=0)


def test_bos_replacement_changes_the_scored_tokens_context(tiny):
    """Without BOS in each window (a tokenizer that does not add it) the figure differs: the
    windows' first tokens are the text's."""
    _, hf, model, tokenizer = tiny
    text = make_text()
    ids = tokenizer.encode(text, bos=False)
    no_bos = torch.nn.Module()                              # a stand-in tokenizer
    no_bos.encode = tokenizer.encode
    no_bos.add_bos, no_bos.bos_id = False, tokenizer.bos_id
    result = perplexity(model, no_bos, text, ctx=CTX)
    nll = reference_nll(hf, ids, CTX, bos_id=None)
    assert result.n_tokens == len(ids)
    assert result.ppl == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)


def test_stderr_is_llama_cpps_formula_on_a_hand_made_list():
    nll = [1.0, 2.0, 3.0, 4.0]
    ppl, stderr = ppl_and_stderr(sum(nll), sum(x * x for x in nll), len(nll))
    # mean 2.5, E[x²] − mean² = 7.5 − 6.25 = 1.25; σ = sqrt(1.25 / 3); ± = PPL·σ
    assert ppl == pytest.approx(math.exp(2.5), rel=1e-15)
    assert stderr == pytest.approx(math.exp(2.5) * math.sqrt(1.25 / 3), rel=1e-15)
    assert ppl_and_stderr(6.0, 12.0, 3) == (pytest.approx(math.exp(2.0)), 0.0)   # constant
    ppl1, stderr1 = ppl_and_stderr(0.5, 0.25, 1)
    assert ppl1 == pytest.approx(math.exp(0.5)) and math.isnan(stderr1)
    with pytest.raises(ArgumentError):
        ppl_and_stderr(0.0, 0.0, 0)


def test_batch_size_does_not_change_the_figure(tiny):
    _, _, model, tokenizer = tiny
    text = make_text()
    one = perplexity(model, tokenizer, text, ctx=CTX, batch_size=1)
    many = perplexity(model, tokenizer, text, ctx=CTX, batch_size=5)
    assert many.ppl == pytest.approx(one.ppl, rel=1e-5)
    assert many.running == pytest.approx(one.running, rel=1e-5)


def test_text_shorter_than_two_windows_is_refused(tiny):
    _, _, model, tokenizer = tiny
    text = make_text(200)
    n = len(tokenizer.encode(text, bos=True))
    ctx = n // 2 + 1                                         # llama.cpp needs ≥ 2·ctx tokens
    with pytest.raises(ArgumentError, match=f"only {n} tokens.*at least {2 * ctx}"):
        tokenize_text(tokenizer, text, ctx)
    assert len(tokenize_text(tokenizer, text, n // 2)) == n
    with pytest.raises(ArgumentError, match="--ctx"):
        perplexity(model, tokenizer, text, ctx=model.args.max_seq_len + 1)
    with pytest.raises(ArgumentError, match="--batch-size"):
        perplexity(model, tokenizer, text, ctx=CTX, batch_size=0)


@pytest.mark.parametrize("case, words", [
    ("missing", "cannot read it"),
    ("short", "tokenizes to only"),
    ("ctx", "--ctx must be"),
])
def test_cli_bad_input_exits_1_with_one_clear_line(tiny, tmp_path, capsys, case, words):
    folder = tiny[0]
    short = tmp_path / "short.txt"
    short.write_text("Hello world!", encoding="utf-8")
    text_file = {"missing": tmp_path / "nope.txt", "short": short, "ctx": short}[case]
    extra = ["--ctx", "2" if case == "ctx" else str(CTX)]
    rc = cli.main(["perplexity", "--model", str(folder), "--text-file", str(text_file),
                   "--dtype", "float32", "--no-progress", *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert len(err.splitlines()) == 1 and err.startswith("torchllama: error: --")
    assert words in err and (str(text_file) in err or case == "ctx")


def test_cli_runs_end_to_end(tiny, tmp_path, capsys):
    folder, _, model, tokenizer = tiny
    text = make_text()
    text_file = tmp_path / "text.txt"
    text_file.write_text(text, encoding="utf-8")
    rc = cli.main(["perplexity", "--model", str(folder), "--text-file", str(text_file),
                   "--ctx", str(CTX), "--batch-size", "2", "--chunks", "4", "--dtype", "float32",
                   "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    expected = perplexity(model, tokenizer, text, ctx=CTX, chunks=4)
    assert f"[1]{expected.running[0]:.4f},[2]" in out and "[5]" not in out
    assert f"PPL = {expected.ppl:.4f} +/- {expected.stderr:.5f}" in out


@pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python is not installed "
                    "(optional peer: make bench-peer)")
def test_llama_cpp_peer_agrees_on_smollm2(smollm2, smollm2_gguf):
    """llama.cpp's own figure on the same Q4_1 file and text: same tokens, same windows; the
    PPL agrees to within llama.cpp's own arithmetic (its Q4_1 dot products quantize the
    activations to 8 bits; ours dequantize the weights to float32)."""
    model, tokenizer = smollm2
    text = ("Two households, both alike in dignity, in fair Verona, where we lay our scene, "
            "from ancient grudge break to new mutiny, where civil blood makes civil hands "
            "unclean. ") * 6
    ours = perplexity(model, tokenizer, text, ctx=64, chunks=3)
    theirs = llama_cpp_perplexity(smollm2_gguf, text, ctx=64, chunks=3)
    assert (theirs.n_tokens, theirs.chunks, theirs.n_scored) == (
        ours.n_tokens, ours.chunks, ours.n_scored)
    assert theirs.ppl == pytest.approx(ours.ppl, rel=0.03)
