"""`torchllama bench load`: the load plan, the run against our in-process server (every
finished answer equals the request alone, dropped streams counted), the structured-output cost
and the prefix cache's time to first token — small sizes, the real SmolLM2."""

import pytest

from torchllama.bench.load import (HEADER, grammar_mask_cost, load_plan, prefix_cache_ttft,
                                   run_load_bench)


def test_load_plan_mixes_prompts_tools_follow_ups_streams_and_drops():
    from torchllama.bench.load import Outcome

    plan = load_plan(40, 10, drop=0.1, max_tokens=32, seed=1)
    jobs = [j for client in plan for j in client]
    assert len(plan) == 40 and len(jobs) == 400
    tools = [j for j in jobs if j.tools]
    follow = [j for j in jobs if j.follow_up]
    system = sum(len(j.messages) == 2 for j in jobs) / 400
    stream = sum(j.stream for j in jobs) / 400
    dropped = sum(j.drop_after is not None for j in jobs) / 400
    assert 0.1 < len(tools) / 400 < 0.2 and 0.15 < len(follow) / 400 < 0.25
    assert {j.tool_choice for j in tools} == {"required", "auto"}
    assert not any(client[0].follow_up for client in plan)
    assert 0.4 < system < 0.6 and 0.65 < stream < 0.85 and 0.05 < dropped < 0.15
    assert all(8 <= j.max_tokens <= 32 for j in jobs if not j.tools)
    assert all(j.stream for j in jobs if j.drop_after is not None)
    assert load_plan(40, 10, 0.1, 32, seed=1)[3][4].key() == plan[3][4].key()   # reproducible
    # a follow-up continues the conversation the client had, with the answer it got
    first = jobs[0]
    turn = follow[0].after(Outcome(first, text="Hi."))
    assert turn.messages == first.messages + [{"role": "assistant", "content": "Hi."}] + \
        follow[0].messages
    assert follow[0].after(Outcome(first, text="Hi.", dropped=True)) is follow[0]


# The two runs of the bench (≈ 45 s, mostly its warm-up and checks) are in `make test-slow`; the
# server under the same kind of load is test_serve's test_load_with_shared_prefixes_…
@pytest.mark.slow
@pytest.mark.usefixtures("shared_cli_models")          # one load of the model for the file
def test_load_bench_runs_and_answers_are_exact(smollm2_gguf, monkeypatch):
    import torchllama.bench.load as lb

    monkeypatch.setattr(lb, "prefix_cache_ttft", lambda path, dtype: (0.01, 0.1, 447))
    monkeypatch.setattr(lb, "grammar_mask_cost", lambda tokenizer, spec: (4e-5, 1e-4, 1e-3))
    lines = []
    results = run_load_bench(str(smollm2_gguf), clients=4, requests=2, drop=0.5, max_tokens=10,
                             batch=4, peer="none", print_fn=lines.append)
    (ours,) = results
    assert len(ours.outcomes) == 8 and not any(o.error for o in ours.outcomes)
    assert sum(o.dropped for o in ours.outcomes) >= 1
    equal, checked = ours.exact
    assert equal == checked == sum(not o.dropped for o in ours.outcomes)
    assert ours.prefix_hit_rate is not None and ours.prefix_hit_rate > 0
    assert lines[1] == HEADER and lines[2].startswith("torchllama")
    assert "prefix cache" in lines[-1] and "10.0× lower" in lines[-1]


@pytest.mark.slow
@pytest.mark.usefixtures("shared_cli_models")
def test_grammar_cost_and_prefix_cache_ttft(smollm2_gguf):
    from torchllama.checkpoint import load_tokenizer

    median, p99, first = grammar_mask_cost(load_tokenizer(smollm2_gguf), steps=40)
    assert 0 < median <= p99 and first > 0
    with_cache, without, n = prefix_cache_ttft(str(smollm2_gguf), "auto", questions=1)
    assert n > 400 and with_cache > 0 and without > 0     # (speed: the bench, not a test)
