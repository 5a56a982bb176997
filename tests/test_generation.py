"""Sampling functions, the KV-cached Session (prefix reuse, stop/length), streaming text, BOS
handling."""

import copy

import pytest
import torch

import torchllama
from torchllama.config import get_preset
from torchllama.errors import ArgumentError, ContextLengthError
from torchllama.generation.session import Session, StreamDecoder, encode_chat, encode_prompt
from torchllama.generation.sampling import SamplingParams, sample, sample_top_p, top_k_filter
from torchllama.model import Transformer

from conftest import LLAMA_SPM_VOCAB


# ---- sampling ---------------------------------------------------------------------------------

def test_temperature_zero_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 4.99]])
    assert sample(logits, SamplingParams(temperature=0)).tolist() == [1, 0]


def test_top_k_filter_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    kept = top_k_filter(logits, 2)
    assert torch.isfinite(kept).tolist() == [[False, True, True, False, False]]
    assert torch.equal(top_k_filter(logits, 0), logits)


def sampled_set(probs, p, n=400):
    g = torch.Generator().manual_seed(0)
    batch = probs.expand(n, -1)
    return set(sample_top_p(batch, p, g).tolist())


def test_top_p_has_metas_semantics():
    probs = torch.tensor([[0.2, 0.5, 0.3]])        # sorted: 0.5 (id 1), 0.3 (id 2), 0.2 (id 0)
    # Mass *before* each sorted token: 0, 0.5, 0.8. Tokens whose preceding mass exceeds p drop.
    assert sampled_set(probs, 0.6) == {1, 2}
    assert sampled_set(probs, 0.4) == {1}          # the top token is always kept...
    assert sampled_set(probs, 1e-6) == {1}         # ...even when p is below its probability
    assert sampled_set(probs, 0.85) == {0, 1, 2}


def test_sampling_follows_the_distribution_and_the_seed():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]])).expand(6000, -1)
    params = SamplingParams(temperature=1.0, seed=3)
    a = sample(logits, params, params.make_generator())
    b = sample(logits, params, params.make_generator())
    assert torch.equal(a, b)                                         # same seed, same draws
    freq = torch.bincount(a, minlength=3).float() / len(a)
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.6, 0.3]), atol=0.03, rtol=0)
    low_t = sample(logits, SamplingParams(temperature=0.1, seed=3),
                   SamplingParams(seed=3).make_generator())
    assert (low_t == 1).float().mean() > 0.99                       # low temperature sharpens


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=-0.1), "temperature must be ≥ 0"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=-1), "top_k must be an integer ≥ 0"),
])
def test_sampling_values_out_of_range(kwargs, words):
    with pytest.raises(ArgumentError) as e:
        SamplingParams(**kwargs)
    assert words in str(e.value)


# ---- Session: prefill once, decode with the cache -----------------------------------------------

class StubTokenizer:
    stop_ids = frozenset({7})


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return Transformer(get_preset("debug")).eval()


def full_recompute_greedy(model, ids, n):
    model = copy.deepcopy(model)       # the session's KV cache lives in the model: keep it intact
    model.clear_caches()
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[-n:]


def test_session_greedy_equals_full_recompute(tiny_model):
    session = Session(tiny_model, StubTokenizer())
    prompt = [3, 14, 15, 92, 65, 35]
    got = list(session.generate(prompt, 20, stop_ids=frozenset()))
    assert got == full_recompute_greedy(tiny_model, prompt, 20)
    assert session.stats.new_tokens == 20 and session.stats.finish_reason == "length"
    assert session.stats.decode_steps == 19


def test_session_reuses_the_cached_prefix(tiny_model):
    session = Session(tiny_model, StubTokenizer())
    first = [3, 14, 15, 92, 65, 35]
    answer = list(session.generate(first, 5, stop_ids=frozenset()))
    follow_up = first + answer + [11, 12, 13]
    got = list(session.generate(follow_up, 10, stop_ids=frozenset()))
    # Only the tokens not yet in the cache were prefilled: the last answer token and 3 new ones.
    assert session.stats.prompt_tokens == len(follow_up)
    assert session.stats.prefilled_tokens == 4
    assert got == full_recompute_greedy(tiny_model, follow_up, 10)
    # A prompt that diverges early re-prefills from the divergence point.
    other = [3, 14, 99, 1, 2]
    got = list(session.generate(other, 6, stop_ids=frozenset()))
    assert session.stats.prefilled_tokens == 3
    assert got == full_recompute_greedy(tiny_model, other, 6)


def test_session_stops_on_stop_ids(tiny_model):
    session = Session(tiny_model, StubTokenizer())
    prompt = [3, 14, 15]
    free = list(session.generate(prompt, 12, stop_ids=frozenset()))
    stop = free[4]
    got = list(session.generate(prompt, 12, stop_ids=frozenset({stop})))
    assert got == free[:free.index(stop)]                  # the stop token is not yielded
    assert session.stats.finish_reason == "stop"


def test_session_context_limits(tiny_model):
    session = Session(tiny_model, StubTokenizer(), max_seq_len=16)
    got = list(session.generate(list(range(1, 13)), 100, stop_ids=frozenset()))
    assert len(got) == 4 and session.stats.finish_reason == "length"   # 12 + 4 = 16 positions
    with pytest.raises(ContextLengthError, match="16 tokens.*at most 15"):
        list(session.generate(list(range(16)), 1))
    with pytest.raises(ArgumentError, match="max_new_tokens must be ≥ 1"):
        list(session.generate([1, 2], 0))
    with pytest.raises(ArgumentError, match="empty"):
        list(session.generate([], 3))


def test_seeded_sampling_is_reproducible(tiny_model):
    session = Session(tiny_model, StubTokenizer())
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=1234)
    a = list(session.generate([5, 6, 7], 30, params, stop_ids=frozenset()))
    b = list(session.generate([5, 6, 7], 30, params, stop_ids=frozenset()))
    c = list(session.generate([5, 6, 7], 30, SamplingParams(1.0, 50, 0.95, seed=99),
                              stop_ids=frozenset()))
    assert a == b and a != c


# ---- text: streaming and BOS ----------------------------------------------------------------------

STREAM_TEXTS = [" Hello world, this is   spaced\n\tout.", " héllo wörld — naïve café 日本語 🙂👍🏽",
                " def f(x):\n    return x ** 2  # 12345"]


@pytest.fixture(scope="module")
def spm_tokenizer():
    return torchllama.load_tokenizer(LLAMA_SPM_VOCAB)


def check_stream(tokenizer, context, text):
    context_ids = tokenizer.encode(context)
    ids = tokenizer.encode(text)
    stream = StreamDecoder(tokenizer, context_ids)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tokenizer.decode(context_ids + ids)[len(tokenizer.decode(context_ids)):]
    assert all("\ufffd" not in p for p in pieces)             # no half characters printed
    return pieces


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_decoder_sentencepiece(spm_tokenizer, text):
    pieces = check_stream(spm_tokenizer, "Say:", text)
    assert "".join(pieces).startswith(" ")                    # SentencePiece's leading space kept


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_decoder_byte_level_bpe(smollm2, text):
    _, tokenizer = smollm2
    check_stream(tokenizer, "Say:", text)


def test_bos_added_once(spm_tokenizer, smollm2):
    ids = encode_prompt(spm_tokenizer, "Hello world")
    assert ids == [1, 15043, 3186]                            # Llama 2 expects BOS
    _, smol = smollm2
    assert encode_prompt(smol, "Hello")[0] != smol.bos_id     # SmolLM2: add_bos_token = false
    # A template that already starts with BOS text must not get a second BOS.
    spm_tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        ids = encode_chat(spm_tokenizer, [{"role": "user", "content": "Hello"}])
    finally:
        spm_tokenizer.chat_template = None
    assert ids.count(1) == 1 and ids[0] == 1


def test_generate_api_on_the_real_model(smollm2):
    model, tokenizer = smollm2
    text = torchllama.generate(model, tokenizer, "The capital of France is", max_new_tokens=8)
    assert "Paris" in text
    answer = torchllama.generate(model, tokenizer, "What is the capital of France?",
                                 max_new_tokens=32, chat=True)
    assert "Paris" in answer and "<|im_end|>" not in answer


def test_session_notices_when_its_cache_was_replaced(tiny_model):
    from torchllama.serving.batch import generate_batch

    model = copy.deepcopy(tiny_model)
    session = Session(model, StubTokenizer())
    first = [3, 14, 15, 92]
    answer = list(session.generate(first, 4, stop_ids=frozenset()))
    # Something else reallocates the model's cache with the very same shape (1, context)...
    generate_batch(model, [[7, 7, 7, 7, 7]], model.args.max_seq_len)
    follow_up = first + answer + [11, 12]
    got = list(session.generate(follow_up, 6, stop_ids=frozenset()))
    assert session.stats.prefilled_tokens == len(follow_up)       # ...so nothing is reused
    assert got == full_recompute_greedy(tiny_model, follow_up, 6)
