"""/v1/completions scoring a prompt (echo with logprobs, max_tokens 0), OpenAI's four prompt
forms, and vLLM's tokenizer endpoints — what lm-evaluation-harness's loglikelihood tasks and
its remote tokenizer send — driven by the official `openai` client on an in-process server of
the embedded SmolLM2 in float32.

Oracles: the prompt's log-probabilities are the model's own full forward over the prompt
(log_softmax of each position's logits, the next token's entry; the model equals transformers'
to 1e-4, `test_parity_real`); token ids are HF's tokenizer's (`hf_smollm2_tokenizer`);
`tests/test_lm_eval.py` (slow) compares lm-eval's own scores against its `hf` backend.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
TEXT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    """(base URL, model, tokenizer): a float32 server in this process, chunked prefill of 8
    tokens (a scored prompt spans chunks)."""
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(str(smollm2_gguf), "float32", progress=False)
    app = create_app(model, tokenizer, MODEL, max_batch_size=4, prefill_chunk=8)
    with serve_in_thread(app) as url:
        yield url, model, tokenizer


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0,
                       timeout=120) as c:
        yield c


def post(url: str, path: str, body=None) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, None if body is None else
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def reference_scores(model, ids: list[int], k: int) -> tuple[list[float], list[list[int]]]:
    """Each token's log-probability after the first, and the k most likely ids at its
    position, from one forward pass over the whole prompt without a cache."""
    with torch.inference_mode():
        caches = model.caches
        model.use_caches(None)
        try:
            logits = model(torch.tensor([ids]))[0].float()                  # (T, V)
        finally:
            model.use_caches(caches)
    logprobs = torch.log_softmax(logits[:-1], -1)                            # (T-1, V)
    chosen = logprobs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return chosen.tolist(), logprobs.topk(k, -1).indices.tolist()


def test_echo_scores_the_prompt_and_then_generates(served, client):
    _, model, tokenizer = served
    ids = tokenizer.encode(TEXT)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=3,
                                  temperature=0)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected, top_ids = reference_scores(model, ids, 3)
    assert lp.token_logprobs[1:-1] == pytest.approx(expected, abs=1e-4)
    for top, ref in zip(lp.top_logprobs[1:-1], top_ids):
        assert list(top) == [tokenizer.decode([i]) for i in ref]
    # the generated token: the greedy one, its log-probability the best of its alternatives
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    assert choice.text == TEXT + lp.tokens[-1] and r.usage.completion_tokens == 1
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # lm-eval's reading: the continuation's sum and whether greedy would have written it
    ctx = len(tokenizer.encode("The capital of France is"))
    assert sum(lp.token_logprobs[ctx:-1]) == pytest.approx(sum(expected[ctx - 1:]), abs=1e-3)


def test_prompt_forms_give_one_choice_per_prompt(served, client):
    _, _, tokenizer = served
    texts = ["Once upon a time", "The weather today is"]
    alone = [client.completions.create(model=MODEL, prompt=t, max_tokens=6, temperature=0)
             .choices[0].text for t in texts]
    for prompt in (texts, [tokenizer.encode(t) for t in texts]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                      n=2)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        assert [c.text for c in r.choices] == [alone[0], alone[0], alone[1], alone[1]]
        assert r.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts)
    single = client.completions.create(model=MODEL, prompt=tokenizer.encode(texts[1]),
                                       max_tokens=6, temperature=0)
    assert single.choices[0].text == alone[1]


def test_max_tokens_zero_with_echo_scores_without_generating(served, client):
    _, model, tokenizer = served
    prompts = [tokenizer.encode(TEXT), tokenizer.encode("Hello there, how are you?")]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True,
                                  logprobs=0, temperature=0)
    assert r.usage.completion_tokens == 0
    for choice, ids in zip(r.choices, prompts):
        assert choice.finish_reason == "length" and choice.text == tokenizer.decode(ids)
        assert choice.logprobs.token_logprobs[1:] == \
            pytest.approx(reference_scores(model, ids, 1)[0], abs=1e-4)
        assert choice.logprobs.top_logprobs[1:] == [{}] * (len(ids) - 1)
    # scored twice (the prefix cache holds it after the first): the same numbers
    again = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=0, echo=True,
                                      logprobs=0, temperature=0)
    assert again.choices[0].logprobs.token_logprobs == r.choices[0].logprobs.token_logprobs


def test_streamed_echo_equals_whole(client):
    kwargs = dict(model=MODEL, prompt=TEXT, max_tokens=5, echo=True, logprobs=2, temperature=0)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)
              if c.choices]
    assert "".join(c.text for c in chunks) == whole.text and whole.text.startswith(TEXT)
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    scores = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    offsets = [v for c in chunks if c.logprobs for v in c.logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and scores == whole.logprobs.token_logprobs
    assert offsets == whole.logprobs.text_offset
    assert chunks[-1].finish_reason == whole.finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [], "max_tokens": 1}, "prompt"),
    ({"prompt": [[1, 2], []], "max_tokens": 1}, "prompt"),
    ({"prompt": [1, 10 ** 9], "max_tokens": 1}, "prompt"),
    ({"prompt": [1, -1], "max_tokens": 1}, "prompt"),
    ({"prompt": [["a"]], "max_tokens": 1}, "prompt"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
])
def test_bad_prompts_are_400_naming_the_field(served, body, param):
    status, answer = post(served[0], "/v1/completions", body)
    assert status == 400 and answer["error"]["param"].startswith(param), answer


def test_tokenizer_endpoints_are_the_models_tokenizer(served, hf_smollm2_tokenizer):
    url, _, tokenizer = served
    text = "Hello world<|im_end|>\nde l'été"
    status, body = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200 and body["tokens"] == hf_smollm2_tokenizer.encode(
        text, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 8192
    status, back = post(url, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == tokenizer.decode(body["tokens"])
    status, info = post(url, "/tokenizer_info")
    assert info["eos_token"] == hf_smollm2_tokenizer.eos_token
    assert info["chat_template"] == tokenizer.chat_template
    messages = [{"role": "user", "content": "Hi!"}]
    status, chat = post(url, "/tokenize", {"messages": messages})
    assert chat["tokens"] == hf_smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert post(url, "/detokenize", {"tokens": [10 ** 9]})[0] == 400
    assert post(url, "/tokenize", {"prompt": "a", "messages": messages})[0] == 400
