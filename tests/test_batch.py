"""Batched generation of prompts of different lengths: left padding with the padding mask, per-row
RoPE positions, each sequence stopping on its own; at temperature 0 a batch gives exactly the
tokens each prompt gives alone."""

import copy
import json

import pytest
import torch

from torchllama.cli import main
from torchllama.config import get_preset
from torchllama.errors import ArgumentError, ContextLengthError
from torchllama.generation.session import SamplingParams, Session, encode_prompt
from torchllama.serving.batch import generate_batch
from torchllama.model import Transformer

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30], [40, 41, 42, 43, 44]]


class StubTokenizer:
    stop_ids = frozenset()


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return Transformer(get_preset("debug")).eval()


def alone(model, prompt, n, **kwargs):
    return list(Session(copy.deepcopy(model), StubTokenizer()).generate(
        prompt, n, stop_ids=frozenset(), **kwargs))


def test_padded_forward_equals_each_row_alone(tiny_model):
    T = max(map(len, PROMPTS))
    pad = torch.tensor([T - len(p) for p in PROMPTS])
    tokens = torch.tensor([[0] * (T - len(p)) + p for p in PROMPTS])
    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        batch = model(tokens, pad=pad)                               # no cache: (B, T, V)
        for b, p in enumerate(PROMPTS):
            torch.testing.assert_close(batch[b, T - len(p):], tiny_model(torch.tensor([p]))[0],
                                       atol=1e-5, rtol=0)


def test_greedy_batch_equals_one_at_a_time(tiny_model):
    results = generate_batch(copy.deepcopy(tiny_model), PROMPTS, 12)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == alone(tiny_model, prompt, 12)
        assert result.finish_reason == "length" and result.prompt_tokens == len(prompt)


def test_padding_content_never_matters(tiny_model):
    a = generate_batch(copy.deepcopy(tiny_model), PROMPTS, 8, pad_id=0)
    b = generate_batch(copy.deepcopy(tiny_model), PROMPTS, 8, pad_id=200)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_each_sequence_stops_on_its_own(tiny_model):
    free = [alone(tiny_model, p, 10) for p in PROMPTS]
    stop = free[1][3]                               # the 4th token of prompt 1 becomes a stop
    results = generate_batch(copy.deepcopy(tiny_model), PROMPTS, 10, stop_ids=frozenset({stop}))
    for tokens, result in zip(free, results):
        if stop in tokens:
            assert result.token_ids == tokens[:tokens.index(stop)]
            assert result.finish_reason == "stop"
        else:
            assert result.token_ids == tokens and result.finish_reason == "length"
    assert results[1].finish_reason == "stop"


def test_per_prompt_seeds_are_independent_of_the_batch(tiny_model):
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3, 4)]
    batch = generate_batch(copy.deepcopy(tiny_model), PROMPTS, 10, params)
    for prompt, p, result in zip(PROMPTS, params, batch):
        assert result.token_ids == alone(tiny_model, prompt, 10, sampling=p)


def test_context_limit_and_errors(tiny_model):
    model = copy.deepcopy(tiny_model)                   # debug preset: 128 positions
    results = generate_batch(model, [list(range(1, 121)), [1, 2]], 50)
    # 120 + 8 = 128 slots; the short prompt's row is its own: 50 tokens, as alone
    assert [len(r.token_ids) for r in results] == [8, 50]
    assert all(r.finish_reason == "length" for r in results)
    with pytest.raises(ContextLengthError, match="at most 127"):
        generate_batch(model, [list(range(128))], 1)
    with pytest.raises(ArgumentError, match="empty"):
        generate_batch(model, [[1], []], 1)
    with pytest.raises(ArgumentError, match="2 sampling settings for 3 prompts"):
        generate_batch(model, [[1], [2], [3]], 1, [SamplingParams()] * 2)


REAL_PROMPTS = ["The capital of France is", "def add(a, b):",
                "Once upon a time, in a small village by the sea, there lived an old fisherman"]


def test_real_model_batch_equals_alone(smollm2):
    model, tokenizer = smollm2
    ids = [encode_prompt(tokenizer, p) for p in REAL_PROMPTS] + \
        [encode_prompt(tokenizer, "What is 2+2?", chat=True)]
    results = generate_batch(model, ids, 20, stop_ids=tokenizer.stop_ids)
    for prompt_ids, result in zip(ids, results):
        session = Session(model, tokenizer)
        assert result.token_ids == list(session.generate(prompt_ids, 20))
        assert result.finish_reason == session.stats.finish_reason


def test_prompt_file_cli(smollm2_gguf, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(REAL_PROMPTS[:2]) + "\n\n" + REAL_PROMPTS[2] + "\n")
    assert main(["generate", "--prompt-file", str(path), "--temperature", "0",
                 "--max-new-tokens", "12", "--batch-size", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == REAL_PROMPTS      # blank lines skipped
    assert [line["index"] for line in lines] == [0, 1, 2]
    assert lines[0]["text"].startswith(" Paris")
    for line in lines:
        assert line["completion_tokens"] == 12 and line["finish_reason"] == "length"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["generate", "--prompt-file", str(empty)]) == 1
    assert "no prompts" in capsys.readouterr().err


def test_logprobs_of_chosen_tokens_and_alternatives(tiny_model):
    model = copy.deepcopy(tiny_model)
    params = SamplingParams(logprobs=3)
    result = generate_batch(model, [PROMPTS[0]], 4, params)[0]
    assert len(result.logprobs) == 4
    # Oracle: log_softmax of a full forward pass over prompt + generated tokens.
    ids = PROMPTS[0] + result.token_ids
    with torch.no_grad():
        logp = torch.log_softmax(tiny_model(torch.tensor([ids]))[0], dim=-1)
    for i, (chosen, top) in enumerate(result.logprobs):
        row = logp[len(PROMPTS[0]) - 1 + i]
        assert abs(chosen - row[result.token_ids[i]]) < 1e-4
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
        assert top[0][0] == result.token_ids[i]                    # greedy picks the top one
    assert generate_batch(model, [PROMPTS[0]], 2)[0].logprobs is None


def test_stop_strings_in_the_cli(smollm2_gguf, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("1, 2, 3, 4,\nThe capital of France is\n")
    assert main(["generate", "--prompt-file", str(path), "--temperature", "0",
                 "--max-new-tokens", "20", "--stop", " 8", "--stop", "."]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["text"] for line in lines] == [" 5, 6, 7,", " Paris"]
    assert all(line["finish_reason"] == "stop" for line in lines)
    assert lines[0]["completion_tokens"] < 20
    assert main(["generate", "--prompt", "1, 2, 3, 4,", "--temperature", "0",
                 "--max-new-tokens", "30", "--stop", " 8"]) == 0
    assert capsys.readouterr().out == "1, 2, 3, 4, 5, 6, 7,\n"
