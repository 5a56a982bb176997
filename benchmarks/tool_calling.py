"""Tool calling against `torchllama serve`: do the calls parse and validate, do streamed calls
equal the non-streamed ones, how often does "auto" call a tool.

Serves the model (the embedded SmolLM2 unless --model, e.g. gemma3-270m) in this process on a
free loopback port (`bench.serve.serve_in_thread`), and with the `openai` client:
1. --per-set requests for each of the six tool sets of `torchllama.bench.tool_sets` (nested
   objects, enums, arrays, optional fields), tool_choice alternating "required" and each
   function by name, temperatures cycling 0.7–1.0 with a seed each; every request sent twice,
   streamed and not: every call must parse and validate against its function's schema
   (`jsonschema`), and the streamed calls (names, arguments) and finish reasons must equal the
   non-streamed ones. Odd requests set parallel_tool_calls false. A call cut by max_tokens
   (finish "length") is counted apart ("cut"): its arguments are a prefix of valid ones.
2. "auto" at temperature 0 on every set's questions: how many answers call a tool, and whether
   those calls validate.
3. The grammar's cost per token (`bench.load.grammar_mask_cost`): the "required" grammar
   (calls) and the "auto" grammar (free text before any marker).
Issue 30's target: 100% parse and validate, streamed = non-streamed. --objects unsaid sends
ordinary schemas (no object says "additionalProperties"), which the server closes by default
(`grammar.closed_schema`); --objects open says "additionalProperties": true everywhere (JSON
Schema's own default, the server's behaviour before it closed objects): issue 46's measure.

    .venv/bin/python benchmarks/tool_calling.py [--model PATH|gemma3-270m] [--per-set 10]
        [--max-tokens 256] [--objects closed|unsaid|open]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def streamed(client, **kwargs) -> tuple[list[tuple[str, str]], str, str]:
    """(calls as (name, arguments), content, finish reason) of a streamed answer, put
    together from OpenAI's tool_calls deltas as clients do."""
    calls: dict[int, list[str]] = {}
    content, reason = "", None
    for event in client.chat.completions.create(stream=True, **kwargs):
        choice = event.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    return [tuple(calls[i]) for i in sorted(calls)], content, reason


def required_and_named(client, per_set: int, max_tokens: int, objects: str = "closed",
                       tool_sets=None) -> list[int]:
    """[requests, complete calls, valid ones, calls cut by max_tokens, streamed answers equal
    to the whole ones]. Odd requests set parallel_tool_calls false (one call). The schemas
    are sent with their objects written as `objects` says (`tool_sets.OBJECT_MODES`); a call
    is valid if it validates against the schema as `tool_sets` writes it (closed objects: an
    invented key is invalid)."""
    from torchllama.bench.tool_sets import TOOL_SETS, check_call, tool_set_with_objects

    totals = [0] * 5
    print(f"{'tool set':10}{'requests':>9}{'calls':>7}{'valid':>7}{'cut':>5}{'stream=whole':>14}"
          f"  (cut: with parallel_tool_calls / without)")
    for tool_set in tool_sets or TOOL_SETS:
        sent = tool_set_with_objects(tool_set, objects)
        names = [t["function"]["name"] for t in tool_set.tools]
        row, cut_single = [0] * 5, 0
        for i in range(per_set):
            pick = i % (len(names) + 1)                   # "required", then each by name
            choice = "required" if pick == 0 else {"type": "function",
                                                   "function": {"name": names[pick - 1]}}
            kwargs = dict(model="m", tools=sent.tools, tool_choice=choice,
                          messages=[{"role": "user",
                                     "content": tool_set.questions[i % len(tool_set.questions)]}],
                          max_tokens=max_tokens, temperature=(0.7, 0.8, 0.9, 1.0)[i % 4], seed=i,
                          parallel_tool_calls=i % 2 == 0)
            whole = client.chat.completions.create(**kwargs).choices[0]
            calls = whole.message.tool_calls or []
            cut = whole.finish_reason == "length" and bool(calls)   # the last call unfinished
            row[0] += 1
            row[1] += len(calls) - cut
            row[3] += cut
            cut_single += cut and i % 2 == 1
            for call in calls[:len(calls) - cut]:
                try:
                    check_call(tool_set, call)
                    row[2] += 1
                except Exception as e:                    # noqa: BLE001 - counted, shown
                    print(f"  invalid: {call.function.name} {call.function.arguments!r}: {e}")
            stream_calls, _, reason = streamed(client, **kwargs)
            row[4] += (stream_calls == [(c.function.name, c.function.arguments) for c in calls]
                       and reason == whole.finish_reason)
        print(f"{tool_set.name:10}{row[0]:>9}{row[1]:>7}{row[2]:>7}{row[3]:>5}{row[4]:>14}"
              f"  ({row[3] - cut_single} / {cut_single})", flush=True)
        totals = [a + b for a, b in zip(totals, row)]
    print(f"{'all':10}{totals[0]:>9}{totals[1]:>7}{totals[2]:>7}{totals[3]:>5}{totals[4]:>14}")
    return totals


def auto_rate(client, max_tokens: int) -> None:
    """How often "auto" calls a tool at temperature 0, per question."""
    from torchllama.bench.tool_sets import TOOL_SETS, check_call

    asked = called = valid = 0
    for tool_set in TOOL_SETS:
        for question in tool_set.questions:
            r = client.chat.completions.create(
                model="m", tools=tool_set.tools, max_tokens=max_tokens, temperature=0,
                messages=[{"role": "user", "content": question}]).choices[0]
            asked += 1
            calls = r.message.tool_calls or []
            called += bool(calls)
            ok = True
            cut = r.finish_reason == "length" and bool(calls)    # the last call unfinished
            for call in calls[:len(calls) - cut]:
                try:
                    check_call(tool_set, call)
                except Exception:                        # noqa: BLE001 - counted
                    ok = False
            valid += bool(calls) and ok
            shown = (json.dumps([(c.function.name, c.function.arguments) for c in calls])
                     if calls else repr((r.message.content or "")[:70]))
            print(f"  {question[:48]:50}{r.finish_reason:11}{shown[:110]}")
    print(f'"auto": {called} of {asked} answers called a tool ({valid} with every complete '
          'call valid)')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--per-set", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--objects", choices=("closed", "unsaid", "open"), default="closed",
                    help="how the schemas' objects speak of other keys: closed (false, as "
                         "written), unsaid (nothing: the server closes them), open (true)")
    args = ap.parse_args()
    from openai import OpenAI

    from torchllama.bench.load import TOOLS_AUTO, TOOLS_REQUIRED, grammar_mask_cost
    from torchllama.bench.serve import serve_in_thread
    from torchllama.checkpoint import resolve_model_path
    import torch
    from torchllama.serving.app import create_app, load_for_engine

    path = str(resolve_model_path(args.model))
    model, tokenizer = load_for_engine(path, "auto", progress=False)
    print(f"{Path(path).name}; CPU capability {torch.backends.cpu.get_cpu_capability()}")
    with serve_in_thread(create_app(model, tokenizer, Path(path).name)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        if args.per_set:
            required_and_named(client, args.per_set, args.max_tokens, args.objects)
            from torchllama.bench.tool_sets import PLOT
            print(f"issue 46's plot tool, {args.per_set} requests:")
            required_and_named(client, args.per_set, args.max_tokens, args.objects, [PLOT])
        auto_rate(client, args.max_tokens)
    for label, spec in (("required (calls)", TOOLS_REQUIRED), ("auto (free text)", TOOLS_AUTO)):
        median, p99, first = grammar_mask_cost(tokenizer, spec=spec)
        print(f"grammar per token, {label}: median {median * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} "
              f"ms; first step (compiling) {first * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
