"""Speculative decoding keeps the target's output exactly: greedy output equals plain greedy
output token for token for every kind of draft (another model, the target's own weights
quantized, prompt lookup), with rejections, rollbacks and sliding-window rings generating past
their window; sampled output has the target's distribution (chi-square tests: the one-position
rejection sampler, and whole generations of a tiny model with penalties); a draft of another
vocabulary is refused; the engine and the server give the same greedy answers with a draft."""

from __future__ import annotations

import copy
import http.client
import json
import threading

import pytest
import torch

from torchllama import kernels

from torchllama.config import ModelArgs, get_preset
from torchllama.serving.engine import Engine, Request
from torchllama.errors import ArgumentError
from torchllama.generation.session import Session, StreamDecoder, encode_prompt
from torchllama.model import Transformer
from torchllama.transforms.quantize import quantize_model
from torchllama.generation.sampling import SamplingParams, process_logits
from torchllama.generation.speculative import (DraftLength, ModelDrafter, PromptLookupDrafter,
                                    SpeculativeDecoder, accept_or_resample, make_drafter,
                                    rewind_limit)

GREEDY = SamplingParams()
NO_STOP = frozenset()


class StubTokenizer:
    stop_ids = frozenset()


def plain(model, prompt, n, sampling=GREEDY, max_seq_len=None):
    """What plain decoding gives (a copy of the model: its cache is its own)."""
    session = Session(copy.deepcopy(model), StubTokenizer(), max_seq_len)
    return list(session.generate(prompt, n, sampling, stop_ids=NO_STOP))


def speculative(model, drafter, prompt, n, k=5, sampling=GREEDY, max_seq_len=None):
    session = Session(model, StubTokenizer(), max_seq_len, draft=drafter, draft_tokens=k)
    return list(session.generate(prompt, n, sampling, stop_ids=NO_STOP)), session.stats


def first_layers(model, n_layers: int) -> Transformer:
    """A smaller model with the same vocabulary: the model's first n_layers layers (and its
    embeddings, final norm and output), as self-speculative decoding's early exit does."""
    types = model.args.layer_types
    small = Transformer(model.args.replace(
        n_layers=n_layers, layer_types=types[:n_layers] if types else None)).eval()
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers}
    small.load_state_dict(state)
    return small


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Transformer(get_preset("debug")).eval()


DRAFTS = {
    "smaller model": lambda t: ModelDrafter(first_layers(t, 1)),
    "unrelated model": lambda t: ModelDrafter(Transformer(get_preset("debug")).eval()),
    "int4 of itself": lambda t: ModelDrafter(quantize_model(copy.deepcopy(t), "int4")),
    "int8 of itself": lambda t: ModelDrafter(quantize_model(copy.deepcopy(t), "int8")),
    "prompt lookup": lambda t: PromptLookupDrafter(),
}
PROMPTS = [[3, 14, 15, 92, 65, 35], list(range(10, 40)), [5, 6, 7, 5, 6, 7, 5, 6, 7, 5],
           [200, 1, 200, 1, 200]]


@pytest.mark.parametrize("kind", DRAFTS)
def test_greedy_output_equals_plain_greedy_for_every_draft(target, kind):
    torch.manual_seed(1)
    drafter = DRAFTS[kind](target)
    drafted = accepted = 0
    for prompt in PROMPTS:
        got, stats = speculative(target, drafter, prompt, 60)
        assert got == plain(target, prompt, 60), (kind, prompt)
        assert stats.new_tokens == 60 and stats.finish_reason == "length"
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        assert 0.0 <= stats.acceptance_rate <= 1.0
        assert f"draft acceptance {stats.acceptance_rate:.0%}" in stats.summary()
    assert drafted > 0
    if kind == "unrelated model":
        assert accepted < drafted / 4          # rejections and rollbacks all along
    elif kind != "prompt lookup":
        assert accepted > drafted / 2          # a draft that mostly agrees
    if kind in ("smaller model", "prompt lookup"):
        assert 0 < accepted < drafted          # both accepted and rejected drafts


def test_stop_token_inside_accepted_drafts_ends_generation(target):
    """Stop ids and budgets cut a round's tokens short; later generate calls go on from the
    cached conversation."""
    prompt = PROMPTS[2]
    full = plain(target, prompt, 40)
    stop = full[17]
    expected = full[:full.index(stop)]
    session = Session(target, StubTokenizer(), draft=ModelDrafter(
        quantize_model(copy.deepcopy(target), "int8")), draft_tokens=6)
    got = list(session.generate(prompt, 40, GREEDY, stop_ids=frozenset({stop})))
    assert got == expected and session.stats.finish_reason == "stop"
    follow_up = prompt + got + [9, 8, 7]
    again = list(session.generate(follow_up, 13, GREEDY, stop_ids=NO_STOP))
    assert again == plain(target, follow_up, 13) and session.stats.new_tokens == 13


SLIDING = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16,
                    max_seq_len=160, sliding_window=6, layer_types=["local", "global"],
                    rope_local_theta=1000.0)


@pytest.mark.parametrize("margin", [64, 2])
def test_sliding_window_model_generating_past_its_window(margin, monkeypatch):
    """Rings of window + margin slots: rejected drafts are rewound within the margin (k is
    capped so that a rewind never needs an overwritten slot), generating far past the ring."""
    import torchllama.nn.attention as attention

    monkeypatch.setattr(attention, "WINDOW_CACHE_MARGIN", margin)
    torch.manual_seed(2)
    model = Transformer(SLIDING).eval()
    prompt = [5, 9, 13, 2, 7, 7, 1, 3, 40, 41]
    expected = plain(model, prompt, 120)
    for drafter in (ModelDrafter(first_layers(model, 1)), PromptLookupDrafter()):
        got, stats = speculative(model, drafter, prompt, 120, k=8)
        assert got == expected, type(drafter).__name__
        assert 0 < stats.accepted < stats.drafted
    ring = model.caches[0]
    assert ring.capacity == 6 + margin < len(prompt) + 120           # the ring wrapped
    assert rewind_limit(model) == margin + 1


def test_vocabulary_mismatch_is_refused_naming_both_sizes(target):
    other = Transformer(get_preset("debug").replace(vocab_size=300)).eval()
    with pytest.raises(ArgumentError) as e:
        Session(target, StubTokenizer(), draft=ModelDrafter(other))
    assert "300" in str(e.value) and "256" in str(e.value)
    with pytest.raises(ArgumentError, match="target model itself"):
        SpeculativeDecoder(target, ModelDrafter(target))


def test_prompt_lookup_copies_what_followed_the_latest_match():
    lookup = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    assert lookup.propose(context, 2).tokens == [5, 6]          # latest "2 3" is at 5-6
    assert lookup.propose(context + [4], 3).tokens == [9, 2, 3]  # "2 3 4" (3-gram) at 1-3
    assert lookup.propose([1, 2, 3, 8], 4).tokens == []          # no earlier 8
    assert lookup.propose([7, 7], 4).tokens == [7]               # overlapping its own suffix
    assert lookup.propose(context, 0).tokens == []
    assert PromptLookupDrafter().propose([7, 7], 4).tokens == []    # pairs at least
    assert PromptLookupDrafter().propose(context, 3).tokens == [5, 6, 7]
    with pytest.raises(ArgumentError):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)


def test_draft_length_grows_on_full_acceptance_and_shrinks_on_rejection():
    length = DraftLength(6)
    assert length.k == 6
    length.update(6, 2)
    length.update(5, 0)
    assert length.k == 4
    length.update(4, 4)
    assert length.k == 6                        # +2, capped at the maximum
    length.update(0, 0)                         # nothing drafted: unchanged
    for _ in range(10):
        length.update(length.k, 0)
    assert length.k == 1                        # never below 1
    with pytest.raises(ArgumentError):
        DraftLength(0)


# ---- distributions ---------------------------------------------------------------------------

def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit p-value; cells expecting < 5 draws are pooled."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def test_one_position_rejection_sampler_emits_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, generator=g) * 1.5, dim=0)
    q = torch.softmax(torch.randn(8, generator=g) * 1.5, dim=0)
    n = 20000
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    counts, accepted = torch.zeros(8), 0
    for d in drafts:
        ok, token = accept_or_resample(p, q, d, g)
        counts[token] += 1
        accepted += ok
    assert chi_square_p_value(counts, p) > 1e-3
    beta = float(torch.minimum(p, q).sum())                  # Leviathan et al.'s acceptance
    assert abs(accepted / n - beta) < 5 * (beta * (1 - beta) / n) ** 0.5
    counts = torch.zeros(8)                                  # deterministic draft: q one-hot
    for _ in range(n // 2):
        counts[accept_or_resample(p, None, 3, g)[1]] += 1
    assert chi_square_p_value(counts, p) > 1e-3


TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=8, multiple_of=16,
                 max_seq_len=32)


def exact_joint(model, prompt, sampling, n_tokens):
    """P(t_1..t_n | prompt) of the target's processed distributions, by enumeration: (V,)*n."""
    V = model.args.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(V)] * (n_tokens - 1)).view(-1, n_tokens - 1)
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)   # (N, P+n−1)
    with torch.no_grad():
        logits = model(ids)[:, len(prompt) - 1:]                                 # (N, n, V)
    joint = torch.ones(len(seqs), V, dtype=torch.float64)
    for i in range(n_tokens):
        ctx = ids[:, :len(prompt) + i].tolist()
        gen = ids[:, len(prompt):len(prompt) + i].tolist()
        p = torch.softmax(process_logits(logits[:, i], sampling, ctx, gen), dim=-1)  # (N, V)
        if i < n_tokens - 1:
            joint *= p.double().gather(1, seqs[:, i:i + 1])
        else:
            joint *= p.double()
    return joint.view(*[V] * n_tokens)


@pytest.mark.parametrize("kind", ["sampled draft model", "prompt lookup"])
def test_sampled_generations_have_the_target_distribution(kind):
    """Whole generations of 4 tokens (the first from the prefill, then rounds of up to 3
    drafts): the joint distribution of tokens 2..4 equals the target's, with temperature,
    top-k and both kinds of penalty (so each position's context must include the drafts)."""
    torch.manual_seed(3)
    target = Transformer(TINY).eval()
    draft_model = copy.deepcopy(target)
    with torch.no_grad():
        for w in draft_model.parameters():
            w.add_(torch.randn_like(w) * 0.3)       # a draft that differs from the target
    drafter = ModelDrafter(draft_model) if kind == "sampled draft model" \
        else PromptLookupDrafter(max_ngram=2)
    prompt = [1, 2, 3, 1, 2, 4, 1]
    params = dict(temperature=0.9, top_k=6, repetition_penalty=1.3, presence_penalty=0.5)
    exact = exact_joint(target, prompt, SamplingParams(**params), 4).sum(dim=0).flatten()
    session = Session(target, StubTokenizer(), draft=drafter, draft_tokens=3)
    counts = torch.zeros(8 ** 3)
    for seed in range(2000):
        t = list(session.generate(prompt, 4, SamplingParams(**params, seed=seed), NO_STOP))
        counts[t[1] * 64 + t[2] * 8 + t[3]] += 1
    assert chi_square_p_value(counts, exact) > 1e-3
    assert session.speculator.drafted > 0
    assert 0 < session.speculator.acceptance_rate < 1


# ---- the engine and the server ----------------------------------------------------------------

def engine_answers(engine, prompts, n, sampling=GREEDY):
    """Submit all prompts at once; each request's tokens."""
    results = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    for i, p in enumerate(prompts):
        engine.submit(Request(p, n, sampling, NO_STOP,
                              on_token=lambda e, i=i: results[i].append(e.token_id),
                              on_finish=lambda r, i=i: done[i].set()))
    for event in done:
        assert event.wait(60), "request did not finish"
    return results


@pytest.mark.parametrize("args", [get_preset("debug"), SLIDING])
def test_engine_with_a_draft_gives_the_same_greedy_answers(args):
    """Alone, a request runs speculative rounds; together, plain batched steps; the tokens
    are those of plain decoding either way."""
    torch.manual_seed(4)
    model = Transformer(args).eval()
    prompts = [[5, 6, 7, 5, 6, 7, 5], list(range(10, 40)), [50, 51]]
    expected = [plain(model, p, 40) for p in prompts]
    drafter = ModelDrafter(quantize_model(copy.deepcopy(model), "int8"))
    engine = Engine(copy.deepcopy(model), max_batch_size=3, draft=drafter, draft_tokens=6)
    engine.start()
    try:
        for p, want in zip(prompts, expected):                  # one at a time: speculative
            assert engine_answers(engine, [p], 40) == [want]
        speculative_steps = engine.steps
        assert speculative_steps < 3 * 40 and engine.speculator.accepted > 0
        assert engine_answers(engine, prompts, 40) == expected  # together: batched
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def smollm2_auto(smollm2_gguf):
    """SmolLM2 in its default dtype (the file's Q4_1 blocks on torchllama's batch-invariant
    kernels), as `serve` and `generate` load it."""
    import torchllama

    return torchllama.load(smollm2_gguf, progress=False)


@pytest.mark.skipif(not kernels.available(), reason="exact only on batch-invariant products: "
                    "torch's int4 fallback rounds a k+1-position pass differently from one-token "
                    "steps")
def test_server_with_a_draft_answers_as_without(smollm2_auto):
    """The real SmolLM2 served with --draft lookup answers what plain decoding gives, alone
    and with concurrent requests."""
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app

    model, tokenizer = smollm2_auto
    para = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while "
            "the fox runs into the forest.")
    prompts = [para + " Repeat the first sentence: The quick", "The capital of France is"]
    expected = []
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt)
        new = list(Session(model, tokenizer).generate(ids, 24, GREEDY))
        stream = StreamDecoder(tokenizer, ids)
        expected.append("".join(stream.push(t) for t in new) + stream.flush())
    app = create_app(model, tokenizer, "m", max_batch_size=2, prefix_cache_mb=0,
                     draft=PromptLookupDrafter(), draft_tokens=6)

    def complete(url, prompt):
        conn = http.client.HTTPConnection(url.split("//")[1], timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": prompt, "max_tokens": 24, "temperature": 0}),
            {"Content-Type": "application/json"})
        body = json.loads(conn.getresponse().read())
        conn.close()
        return body["choices"][0]["text"]

    with serve_in_thread(app) as url:
        assert [complete(url, p) for p in prompts] == expected
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda p: complete(url, p), prompts)) == expected
        assert app.state.engine.speculator.accepted > 0


# ---- the real model ------------------------------------------------------------------------

def test_float32_smollm2_drafted_by_its_int4_weights(smollm2, smollm2_gguf):
    """The issue's case: the float32 model's greedy answer, drafted by the same file's Q4_1
    blocks on torchllama's kernels (`--draft int4`), token for token; most drafts accepted."""
    model, tokenizer = smollm2
    ids = encode_prompt(tokenizer, "Write a short paragraph about the history of Paris.",
                        chat=True)
    expected = list(Session(model, tokenizer).generate(ids, 48, GREEDY, NO_STOP))
    drafter = make_drafter("int4", smollm2_gguf)
    session = Session(model, tokenizer, draft=drafter, draft_tokens=8)
    assert list(session.generate(ids, 48, GREEDY, NO_STOP)) == expected
    assert session.stats.acceptance_rate > 0.7
    assert isinstance(make_drafter("lookup"), PromptLookupDrafter)


def test_cli_generate_with_a_draft_prints_the_same_text_and_the_acceptance(smollm2_auto,
                                                                           capsys,
                                                                           monkeypatch):
    import torchllama.checkpoint
    from torchllama.cli import main

    monkeypatch.setattr(torchllama.checkpoint, "load", lambda *a, **kw: smollm2_auto)
    args = ["generate", "--prompt", "One, two, three, four, one, two, three,",
            "--temperature", "0", "--max-new-tokens", "16"]
    assert main(args) == 0
    plain_out = capsys.readouterr().out
    assert main(args + ["--draft", "lookup", "--draft-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert out.out == plain_out
    assert "draft acceptance" in out.err
    assert main(args + ["--draft", "lookup", "--draft-tokens", "0"]) == 1
    assert "--draft-tokens must be ≥ 1" in capsys.readouterr().err
    assert main(args + ["--draft", "lookup", "--prompt-file", "prompts.txt"]) == 1
    assert "--draft speculates for one prompt" in capsys.readouterr().err


def test_bench_session_runs_and_table(target):
    """`bench speculative`'s pieces on the tiny model: runs report decode tok/s and seconds
    and the drafted run's tokens equal the plain run's; the table shows speedups over plain."""
    from torchllama.bench.speculative import SessionRun, SpeculativeResult, format_speculative_table

    prompt = PROMPTS[2]
    plain_run = SessionRun(target, StubTokenizer(), prompt, 30)
    drafted = SessionRun(target, StubTokenizer(), prompt, 30, PromptLookupDrafter(), 4)
    for run in (plain_run, drafted):
        tok_s, seconds = run()
        assert tok_s > 0 and seconds > 0
    assert drafted.tokens == plain_run.tokens and drafted.stats.drafted > 0
    lines = format_speculative_table([
        SpeculativeResult("p (6+30)", "plain float32", 50.0, 2.0, None, 1.0, True),
        SpeculativeResult("p (6+30)", "prompt lookup", 100.0, 1.0, 0.5, 2.5, True)])
    assert "2.00x" in lines[2] and "50%" in lines[2] and lines[2].endswith("yes")
    assert "-" in lines[1] and "1.00x" in lines[1]
