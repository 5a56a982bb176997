"""torchllama.generation.sampling: each logits processor against an independent oracle (HF's logits
processors, OpenAI's formulas by hand, Meta's reference code), the documented order, validation,
logprobs, seeded reproducibility and equivalence with Meta's sampler."""

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from torchllama.errors import ArgumentError
from torchllama.generation.sampling import (SamplingParams, apply_frequency_presence_penalties,
                                 apply_logit_bias, apply_repetition_penalty, apply_temperature,
                                 min_p_filter, process_logits, sample, sample_top_p,
                                 token_counts, token_logprobs, top_k_filter, top_p_filter)

NO_IDS = torch.zeros(1, 0, dtype=torch.long)    # HF processors take input_ids; unused by warpers


def random_logits(b=4, v=50, seed=0, scale=3.0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def kept(logits):
    return torch.isfinite(logits)


# ---- SamplingParams ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-0.1), "temperature must be ≥ 0"),
    (dict(temperature=float("nan")), "temperature must be ≥ 0"),
    (dict(temperature=float("inf")), "temperature must be ≥ 0 (0 = greedy) and finite"),
    (dict(temperature="1"), "temperature must be ≥ 0"),
    (dict(top_k=-1), "top_k must be an integer ≥ 0"),
    (dict(top_k=2.5), "top_k must be an integer ≥ 0"),
    (dict(top_k=True), "top_k must be an integer ≥ 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_p=float("nan")), "top_p must be in (0, 1]"),
    (dict(min_p=-0.01), "min_p must be in [0, 1]"),
    (dict(min_p=1.01), "min_p must be in [0, 1]"),
    (dict(min_p=float("nan")), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be in"),
    (dict(repetition_penalty=-1.2), "repetition_penalty must be in"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be in"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be in"),
    (dict(repetition_penalty=5e-324), "repetition_penalty must be in"),   # (logits → inf)
    (dict(frequency_penalty=2.01), "frequency_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be in [-2, 2]"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (dict(presence_penalty=-3), "presence_penalty must be in [-2, 2]"),
    (dict(logit_bias={5: 100.5}), "logit_bias values must be in [-100, 100]"),
    (dict(logit_bias={5: -101}), "logit_bias values must be in [-100, 100]"),
    (dict(logit_bias={5: float("nan")}), "logit_bias values must be in [-100, 100]"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token ids must be integers ≥ 0"),
    (dict(logit_bias={"5": 1.0}), "logit_bias token ids must be integers ≥ 0"),
    (dict(logit_bias={2.0: 1.0}), "logit_bias token ids must be integers ≥ 0"),
    (dict(logit_bias={True: 1.0}), "logit_bias token ids must be integers ≥ 0"),
    (dict(logit_bias=[(5, 1.0), (5, 2.0)]), "more than one bias"),
    (dict(logit_bias=[(5, 1.0, 3)]), "(token id, bias) pairs"),
    (dict(logit_bias="5:1"), "logit_bias must be a mapping"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(seed=2**64), "seed must be an integer"),
    (dict(logprobs=-1), "logprobs must be an integer in [0, 20]"),
    (dict(logprobs=21), "logprobs must be an integer in [0, 20]"),
    (dict(logprobs=1.0), "logprobs must be an integer in [0, 20]"),
])
def test_values_out_of_range(kwargs, words):
    with pytest.raises(ArgumentError) as e:
        SamplingParams(**kwargs)
    assert words in str(e.value)


def test_boundary_values_are_accepted():
    SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1e-3,
                   frequency_penalty=-2, presence_penalty=2, logit_bias={0: -100, 7: 100},
                   seed=0, logprobs=20)
    SamplingParams(top_p=1e-9, min_p=1.0, frequency_penalty=2.0, presence_penalty=-2.0,
                   logprobs=0, repetition_penalty=1000.0)


def test_logit_bias_is_stored_as_sorted_pairs_and_params_stay_hashable():
    a = SamplingParams(logit_bias={9: -1, 2: 0.5})
    b = SamplingParams(logit_bias=[(2, 0.5), (9, -1.0)])
    assert a.logit_bias == ((2, 0.5), (9, -1.0))
    assert a == b and hash(a) == hash(b)
    assert dict(a.logit_bias) == {2: 0.5, 9: -1.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={}) == SamplingParams()
    with pytest.raises(AttributeError):
        a.temperature = 1.0                          # frozen


def test_make_generator_is_seeded():
    params = SamplingParams(seed=123)
    a = torch.rand(5, generator=params.make_generator())
    b = torch.rand(5, generator=params.make_generator())
    c = torch.rand(5, generator=SamplingParams(seed=124).make_generator())
    assert torch.equal(a, b) and not torch.equal(a, c)


# ---- logit bias -------------------------------------------------------------------------------

def test_logit_bias_adds_to_the_listed_tokens():
    logits = random_logits()
    bias = {3: 5.0, 17: -100.0, 49: 0.25}
    out = apply_logit_bias(logits, bias)
    expected = logits.clone()
    for token, value in bias.items():              # plain arithmetic
        expected[:, token] += value
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    hf = SequenceBiasLogitsProcessor([[[t], v] for t, v in bias.items()])(NO_IDS, logits)
    torch.testing.assert_close(out, hf)
    assert torch.equal(apply_logit_bias(logits, None), logits)


def test_logit_bias_token_outside_the_vocabulary():
    with pytest.raises(ArgumentError, match=r"token id 50 is outside the vocabulary \[0, 50\)"):
        apply_logit_bias(random_logits(v=50), {50: 1.0})


# ---- repetition penalty ------------------------------------------------------------------------

@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    logits = random_logits(b=3, v=40)
    context = torch.randint(0, 40, (3, 25), generator=torch.Generator().manual_seed(1))
    ours = apply_repetition_penalty(logits, context, penalty)
    hf = RepetitionPenaltyLogitsProcessor(penalty)(context, logits.clone())
    torch.testing.assert_close(ours, hf, rtol=0, atol=0)
    assert not torch.equal(ours, logits)
    # Tokens outside the context are untouched; inside, positive logits shrink, negative grow.
    seen = token_counts(context, 3, 40) > 0
    assert torch.equal(ours[~seen], logits[~seen])
    if penalty > 1:
        positive, negative = seen & (logits > 0), seen & (logits < 0)
        assert (ours[positive] < logits[positive]).all() and (ours[positive] > 0).all()
        assert (ours[negative] < logits[negative]).all()


def test_repetition_penalty_by_hand_and_ragged_rows():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0],
                           [2.0, -1.0, 0.5, 3.0]])
    out = apply_repetition_penalty(logits, [[0, 1, 1], [3]], 2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0],
                            [2.0, -1.0, 0.5, 1.5]]
    # A 1-D context (or a flat list) is shared by every row.
    shared = apply_repetition_penalty(logits, torch.tensor([2]), 2.0)
    assert shared[:, 2].tolist() == [0.25, 0.25]
    assert torch.equal(apply_repetition_penalty(logits, [2], 2.0), shared)
    assert torch.equal(apply_repetition_penalty(logits, [[0, 1, 1], [3]], 1.0), logits)


@pytest.mark.parametrize("context, words", [
    ([[0, 4]], "context_ids holds 4, not a token id in [0, 4)"),
    (torch.tensor([[0, -1]]), "context_ids holds token ids outside the vocabulary"),
    ([[0], [1], [2]], "context_ids has 3 rows for a batch of 1"),
    (torch.zeros(2, 3, dtype=torch.long), "context_ids must have shape (1, L) or (L,)"),
    (torch.zeros(1, 3), "context_ids must hold integer token ids"),
])
def test_repetition_penalty_bad_context(context, words):
    with pytest.raises(ArgumentError) as e:
        apply_repetition_penalty(torch.zeros(1, 4), context, 1.5)
    assert words in str(e.value)


# ---- frequency and presence penalties ----------------------------------------------------------

def test_frequency_presence_penalties_follow_openais_formula():
    # mu[j] - c[j] * a_freq - 1[c[j] > 0] * a_pres, c = counts in the completion so far
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5],
                           [1.0, 2.0, 3.0, 0.5]])
    generated = [[2, 2, 0], []]
    out = apply_frequency_presence_penalties(logits, generated, frequency=0.5, presence=0.25)
    assert out.tolist() == [[1.0 - 1 * 0.5 - 0.25, 2.0, 3.0 - 2 * 0.5 - 0.25, 0.5],
                            [1.0, 2.0, 3.0, 0.5]]
    # Negative penalties encourage repeats.
    out = apply_frequency_presence_penalties(logits[:1], [2, 2, 0], frequency=-1.0, presence=-2)
    assert out.tolist() == [[1.0 + 1 + 2, 2.0, 3.0 + 2 + 2, 0.5]]


def test_frequency_presence_counts_equal_ids():
    logits = random_logits(b=2, v=30)
    ids = torch.randint(0, 30, (2, 40), generator=torch.Generator().manual_seed(2))
    counts = token_counts(ids, 2, 30)
    assert counts.sum().item() == 80
    a = apply_frequency_presence_penalties(logits, ids, 0.3, 0.7)
    b = apply_frequency_presence_penalties(logits, None, 0.3, 0.7, counts=counts)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    expected = logits - counts * 0.3 - (counts > 0).float() * 0.7
    torch.testing.assert_close(a, expected)
    with pytest.raises(ArgumentError, match="exactly one of generated_ids and counts"):
        apply_frequency_presence_penalties(logits, ids, 0.3, 0.7, counts=counts)
    with pytest.raises(ArgumentError, match="counts must have shape"):
        apply_frequency_presence_penalties(logits, None, 0.3, 0.7, counts=counts[:, :5])


# ---- temperature and truncation ----------------------------------------------------------------

@pytest.mark.parametrize("t", [0.3, 1.0, 1.7])
def test_temperature_matches_hf(t):
    logits = random_logits()
    torch.testing.assert_close(apply_temperature(logits, t),
                               TemperatureLogitsWarper(t)(NO_IDS, logits), rtol=0, atol=0)
    with pytest.raises(ArgumentError, match="temperature must be > 0"):
        apply_temperature(logits, 0.0)


@pytest.mark.parametrize("k", [1, 3, 10, 49])
def test_top_k_matches_hf(k):
    logits = random_logits()
    logits[0, :6] = 2.5                                  # ties at the cut are kept, as HF does
    ours = top_k_filter(logits, k)
    assert torch.equal(ours, TopKLogitsWarper(k)(NO_IDS, logits))
    assert (kept(ours).sum(-1) >= k).all()
    assert torch.equal(top_k_filter(logits, 0), logits)
    assert torch.equal(top_k_filter(logits, 50), logits)


def meta_top_p_keep(logits, p):
    """Meta's rule written out token by token: walk the tokens from most to least likely and
    keep a token while the mass before it is ≤ p."""
    probs = torch.softmax(logits, dim=-1)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    for b in range(logits.shape[0]):
        before = 0.0
        for j in sorted(range(logits.shape[1]), key=lambda j: -probs[b, j].item()):
            if before > p:
                break
            keep[b, j] = True
            before += probs[b, j].item()
    return keep


@pytest.mark.parametrize("p", [0.05, 0.3, 0.6, 0.9, 0.99])
def test_top_p_filter_follows_metas_rule(p):
    logits = random_logits(b=6, v=40, seed=int(p * 100), scale=1.5)
    ours = top_p_filter(logits, p)
    assert torch.equal(kept(ours), meta_top_p_keep(logits, p))
    assert torch.equal(ours[kept(ours)], logits[kept(ours)])      # survivors unchanged
    # Away from the boundary (no token's preceding mass within 1e-4 of p) HF agrees; HF drops a
    # token whose preceding mass equals p exactly, Meta keeps it.
    probs = torch.softmax(logits, -1).sort(-1, descending=True).values
    before = probs.cumsum(-1) - probs
    if not ((before - p).abs() < 1e-4).any():
        assert torch.equal(kept(ours), kept(TopPLogitsWarper(p)(NO_IDS, logits)))


def test_top_p_semantics_on_a_small_example():
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))    # sorted: 0.5 (1), 0.3 (2), 0.2 (0)
    # Mass before each sorted token: 0, 0.5, 0.8. Tokens whose preceding mass exceeds p drop.
    assert kept(top_p_filter(logits, 0.6)).tolist() == [[False, True, True]]
    assert kept(top_p_filter(logits, 0.4)).tolist() == [[False, True, False]]
    assert kept(top_p_filter(logits, 1e-6)).tolist() == [[False, True, False]]   # top kept
    assert kept(top_p_filter(logits, 0.85)).tolist() == [[True, True, True]]
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_top_p_boundary_differs_from_hf():
    # Four equal tokens: probabilities 0.25 exactly, mass before each 0, 0.25, 0.5, 0.75.
    # At p = 0.5 the third token's preceding mass equals p: Meta keeps it, HF drops it.
    logits = torch.zeros(1, 4)
    assert kept(top_p_filter(logits, 0.5)).sum().item() == 3
    assert kept(TopPLogitsWarper(0.5)(NO_IDS, logits)).sum().item() == 2
    params = SamplingParams(temperature=1.0, top_p=0.5, seed=0)
    drawn = sample(logits.expand(400, -1), params, params.make_generator())
    assert len(set(drawn.tolist())) == 3


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_hf(min_p):
    logits = random_logits(b=5, v=60)
    ours = min_p_filter(logits, min_p)
    assert torch.equal(ours, MinPLogitsWarper(min_p)(NO_IDS, logits))
    probs = torch.softmax(logits, -1)
    assert torch.equal(kept(ours), probs >= min_p * probs.amax(-1, keepdim=True))
    assert kept(ours).any(-1).all()
    assert torch.equal(min_p_filter(logits, 0.0), logits)


# ---- the pipeline and its order ----------------------------------------------------------------

def test_process_logits_is_hfs_chain_in_the_documented_order():
    V = 64
    logits = random_logits(b=3, v=V, seed=5)
    context = torch.randint(0, V, (3, 30), generator=torch.Generator().manual_seed(6))
    generated = context[:, 20:]                       # the completion: the last 10 tokens
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
                            repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.3,
                            logit_bias={1: 3.0, 2: -4.0})
    ours = process_logits(logits, params, context, generated)
    x = SequenceBiasLogitsProcessor([[[1], 3.0], [[2], -4.0]])(context, logits)
    x = RepetitionPenaltyLogitsProcessor(1.2)(context, x)
    counts = token_counts(generated, 3, V)
    x = x - counts * 0.4 - (counts > 0).float() * 0.3   # OpenAI's formula
    x = TemperatureLogitsWarper(0.8)(context, x)
    x = TopKLogitsWarper(20)(context, x)
    x = x.masked_fill(~meta_top_p_keep(x, 0.9), float("-inf"))
    x = MinPLogitsWarper(0.05)(context, x)
    assert torch.equal(kept(ours), kept(x))
    torch.testing.assert_close(ours[kept(ours)], x[kept(x)])


def test_logit_bias_lifts_a_token_above_the_top_k_cut():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_k=1, logit_bias={3: 10.0}, seed=0)
    assert kept(process_logits(logits, params)).tolist() == [[False, False, False, True]]
    drawn = sample(logits.expand(200, -1), params, params.make_generator())
    assert set(drawn.tolist()) == {3}


def test_penalties_apply_before_temperature():
    # (mu - c*a_f) / T, not mu / T - c*a_f: (2 - 1) / 0.5 = 2 = 1 / 0.5.
    logits = torch.tensor([[2.0, 1.0]])
    params = SamplingParams(temperature=0.5, frequency_penalty=1.0)
    assert process_logits(logits, params, generated_ids=[0]).tolist() == [[2.0, 2.0]]


def test_temperature_zero_is_argmax_of_penalised_logits():
    logits = torch.tensor([[3.0, 2.9, -1.0], [0.0, 5.0, 4.0]])
    assert sample(logits, SamplingParams()).tolist() == [0, 1]
    params = SamplingParams(logit_bias={2: 1.5}, repetition_penalty=2.0, top_k=1, top_p=0.1,
                            min_p=0.9)
    # Row 0: token 0 is in the context (3 → 1.5), token 2 gets +1.5 (→ 0.5): 2.9 wins.
    # Row 1: token 1 in the context (5 → 2.5), token 2: 4 + 1.5 = 5.5 wins.
    out = process_logits(logits, params, context_ids=[[0], [1]])
    torch.testing.assert_close(out, torch.tensor([[1.5, 2.9, 0.5], [0.0, 2.5, 5.5]]))
    # (not scaled by the temperature, not truncated by top-k/top-p/min-p)
    assert sample(logits, params, context_ids=[[0], [1]]).tolist() == [1, 2]


def test_missing_ids_for_active_penalties():
    logits = random_logits(b=1, v=8)
    with pytest.raises(ArgumentError, match="repetition_penalty needs context_ids"):
        sample(logits, SamplingParams(repetition_penalty=1.1))
    with pytest.raises(ArgumentError, match="need generated_ids"):
        process_logits(logits, SamplingParams(presence_penalty=0.5))
    # An empty completion is fine (the first step).
    assert torch.equal(process_logits(logits, SamplingParams(frequency_penalty=1.0),
                                      generated_ids=[]), logits)


def test_sampled_distribution_is_softmax_of_processed_logits():
    logits = random_logits(b=1, v=12, seed=9, scale=1.0)
    params = SamplingParams(temperature=0.7, top_k=9, top_p=0.8, min_p=0.2,
                            presence_penalty=0.5, seed=11)
    target = torch.softmax(process_logits(logits, params, generated_ids=[[0, 5]]), -1)[0]
    n = 40000
    drawn = sample(logits.expand(n, -1), params, params.make_generator(),
                   generated_ids=[0, 5])
    freq = torch.bincount(drawn, minlength=12).float() / n
    assert set(drawn.unique().tolist()) <= set(target.nonzero().flatten().tolist())
    assert (target > 0).sum() > 2                                  # a real choice was left
    torch.testing.assert_close(freq, target, atol=0.01, rtol=0)


def test_min_p_only_sampling_uses_the_cut():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(3000, -1)
    params = SamplingParams(temperature=1.0, min_p=0.25, seed=1)   # cut at 0.125: drops token 3
    drawn = sample(logits, params, params.make_generator())
    assert set(drawn.tolist()) == {0, 1, 2}


# ---- logprobs ----------------------------------------------------------------------------------

def test_token_logprobs_are_log_softmax_of_raw_logits():
    logits = random_logits(b=3, v=30)
    params = SamplingParams(temperature=1.0, logit_bias={4: 50.0}, seed=0)
    chosen = sample(logits, params, params.make_generator())
    assert chosen.tolist() == [4, 4, 4]                 # the bias decides...
    chosen_lp, top_ids, top_lp = token_logprobs(logits, chosen, 5)
    reference = torch.log_softmax(logits, dim=-1)
    # ...but the reported logprobs are the model's own, before bias/penalties/temperature.
    torch.testing.assert_close(chosen_lp, reference[:, 4])
    ref_top = reference.topk(5, dim=-1)
    assert torch.equal(top_ids, ref_top.indices)
    torch.testing.assert_close(top_lp, ref_top.values)
    assert (top_lp[:, :-1] >= top_lp[:, 1:]).all()
    assert chosen_lp.dtype == top_lp.dtype == torch.float32 and top_ids.dtype == torch.int64


def test_token_logprobs_shapes_and_errors():
    logits = random_logits(b=2, v=6).to(torch.bfloat16)
    chosen = torch.tensor([1, 5])
    lp, ids, vals = token_logprobs(logits, chosen, 0)
    assert lp.shape == (2,) and ids.shape == (2, 0) and vals.shape == (2, 0)
    torch.testing.assert_close(lp, torch.log_softmax(logits.float(), -1)[[0, 1], [1, 5]])
    assert token_logprobs(logits, chosen, 20)[1].shape == (2, 6)    # at most V
    with pytest.raises(ArgumentError, match="integer ≥ 0"):
        token_logprobs(logits, chosen, -1)
    with pytest.raises(ArgumentError, match=r"chosen must have shape \(2,\)"):
        token_logprobs(logits, chosen[:1], 3)


# ---- reproducibility and equivalence with Meta's sampler ----------------------------------------

def test_same_seed_same_tokens():
    logits = random_logits(b=64, v=100, scale=1.0)
    params = SamplingParams(temperature=1.1, top_k=40, top_p=0.9, min_p=0.02,
                            repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1,
                            logit_bias={7: 2.0}, seed=42)
    ctx = torch.randint(0, 100, (64, 10), generator=torch.Generator().manual_seed(3))
    a = sample(logits, params, params.make_generator(), ctx, ctx[:, 5:])
    b = sample(logits, params, params.make_generator(), ctx, ctx[:, 5:])
    c = sample(logits, params, SamplingParams(seed=43).make_generator(), ctx, ctx[:, 5:])
    assert torch.equal(a, b) and not torch.equal(a, c)


def meta_sample(logits, temperature, top_k, top_p, generator):
    """Meta's generate + sample_top_p (llama/generation.py), with top-k added: an independent
    copy, the oracle for the old fields."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)
        probs_sum = torch.cumsum(probs_sort, dim=-1)
        probs_sort[probs_sum - probs_sort > top_p] = 0.0
        probs_sort.div_(probs_sort.sum(dim=-1, keepdim=True))
        next_token = torch.multinomial(probs_sort, num_samples=1, generator=generator)
        return torch.gather(probs_idx, -1, next_token).squeeze(-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0, 1.5])
@pytest.mark.parametrize("top_k", [0, 1, 7])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.5, 0.01])
def test_same_tokens_as_metas_sampler(temperature, top_k, top_p):
    logits = random_logits(b=256, v=64, seed=7, scale=2.0)
    for seed in range(3):
        ours = sample(logits, SamplingParams(temperature, top_k, top_p),
                      torch.Generator().manual_seed(seed))
        meta = meta_sample(logits, temperature, top_k, top_p, torch.Generator().manual_seed(seed))
        assert torch.equal(ours, meta)


@pytest.mark.parametrize("ties", [False, True])
def test_a_real_vocabulary_samples_metas_tokens_without_sorting_it(ties, monkeypatch):
    # V = 49,152 (SmolLM2's): the nucleus is drawn from a top-k prefix instead of a full sort;
    # the tokens and the generator's state must stay Meta's. With ties inside the nucleus the
    # order among them is torch.sort's own, so the prefix path must step aside.
    import torchllama.generation.sampling as sampling
    taken = []
    prefix = sampling._sample_nucleus_prefix
    monkeypatch.setattr(sampling, "_sample_nucleus_prefix",
                        lambda *a: taken.append(prefix(*a)) or taken[-1])
    for seed in range(12):
        logits = random_logits(b=1 + seed % 3, v=49152, seed=seed, scale=2.0 + seed % 5)
        if ties:
            logits[:, :30] = logits.max() + 1.0               # 30 equal tokens on top
        for temperature, top_p in ((0.6, 0.9), (1.0, 0.95), (0.3, 0.5)):
            g_ours, g_meta = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            ours = sample(logits, SamplingParams(temperature, 0, top_p), g_ours)
            meta = meta_sample(logits, temperature, 0, top_p, g_meta)
            assert torch.equal(ours, meta)
            assert torch.equal(g_ours.get_state(), g_meta.get_state())
    used = sum(t is not None for t in taken)       # flat rows (nucleus > 4096 tokens) sort
    assert used == 0 if ties else used >= len(taken) // 2


def test_min_p_on_the_prefix_path_equals_the_sorted_path(monkeypatch):
    import torchllama.generation.sampling as sampling
    logits = random_logits(b=3, v=49152, seed=5, scale=4.0)
    params = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.05)
    fast = sample(logits, params, torch.Generator().manual_seed(0))
    monkeypatch.setattr(sampling, "_sample_nucleus_prefix", lambda *a: None)
    assert torch.equal(fast, sample(logits, params, torch.Generator().manual_seed(0)))


def test_sample_top_p_is_metas():
    logits = random_logits(b=128, v=32, seed=8)
    probs = torch.softmax(logits, -1)
    for p in (0.1, 0.5, 0.9):           # meta_sample at temperature 1, no top-k: Meta's code
        assert torch.equal(sample_top_p(probs, p, torch.Generator().manual_seed(1)),
                           meta_sample(logits, 1.0, 0, p, torch.Generator().manual_seed(1)))


def test_batch_rows_are_independent_of_batch_size():
    # Rows processed together equal rows processed one at a time (B-generic shapes).
    logits = random_logits(b=3, v=20)
    params = SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.1,
                            repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5,
                            logit_bias={0: 1.0})
    ctx = [[1, 2, 3], [4], []]
    gen = [[3], [4, 4], []]
    together = process_logits(logits, params, ctx, gen)
    for b in range(3):
        alone = process_logits(logits[b:b + 1], params, [ctx[b]], [gen[b]])
        assert torch.equal(kept(alone), kept(together[b:b + 1]))
        torch.testing.assert_close(alone[kept(alone)], together[b][kept(together[b])])


def test_low_precision_logits_keep_their_dtype():
    logits = random_logits(b=2, v=16).to(torch.bfloat16)
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05,
                            repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={3: 1.0},
                            seed=0)
    out = process_logits(logits, params, [1, 2], [[2], []])
    assert out.dtype == torch.bfloat16 and out.shape == (2, 16)
    assert sample(logits, params, params.make_generator(), [1, 2], [[2], []]).dtype == torch.int64
    assert not math.isnan(out[torch.isfinite(out)].float().sum().item())



def test_tiny_temperatures_are_greedy():
    from torchllama.generation.sampling import GREEDY_BELOW
    logits = torch.randn(4, 50)
    for t in (1e-40, GREEDY_BELOW / 2):
        params = SamplingParams(temperature=t, seed=0)
        assert torch.equal(sample(logits, params, params.make_generator()), logits.argmax(-1))
