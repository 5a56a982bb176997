"""A chat resent in full every turn against the real SmolLM2 server, with the openai client:
with the block prefix cache each turn prefills at most its new tokens + one block (the server's
/metrics counts), and every answer equals the answer of a server without a prefix cache (the
oracle: every turn prefilled whole)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")


def test_each_turn_prefills_its_new_tokens_and_answers_as_without_the_cache(smollm2_gguf):
    from torchllama.bench.multi_turn import replay_chat, system_prompt
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine
    from torchllama.serving.prefix_cache import BLOCK_SIZE

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    system = system_prompt(tokenizer, 300)
    runs = {}
    for budget in (64, 0):
        with serve_in_thread(create_app(model, tokenizer, "m", prefix_cache_mb=budget)) as url:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
                runs[budget] = replay_chat(client, url, system, turns=6, max_tokens=12)
        model.clear_caches()
    cached, plain = runs[64], runs[0]
    assert [t.answer for t in cached] == [t.answer for t in plain]
    assert [t.prefilled for t in plain] == [t.prompt_tokens for t in plain]
    assert cached[0].prefilled == cached[0].prompt_tokens > 300
    for turn in cached[1:]:
        assert turn.prefilled <= turn.new_tokens + BLOCK_SIZE, turn
    for before, turn in zip(cached, cached[1:]):  # every whole block of the last prompt and
        fed = before.prompt_tokens + before.completion_tokens - 1   # the answer fed is reused
        assert turn.prompt_tokens - turn.prefilled >= fed // BLOCK_SIZE * BLOCK_SIZE, turn
