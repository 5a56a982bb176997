"""Structured output under sampling: `json_schema` requests at temperatures 0.7–1.0 over six
schemas against `torchllama serve`, counting how each finishes and whether it validates.

Serves the model (the embedded SmolLM2 unless --model) in this process on a free loopback
port (`bench.serve.serve_in_thread`, as `torchllama bench --serve` does), sends
--per-schema requests per schema with the `openai` client (temperatures cycling 0.7, 0.8, 0.9,
1.0; one seed each), and prints per schema: finished "stop", valid JSON against the schema
(`jsonschema`), finished "length" (ran to max_tokens), and the largest share of whitespace in
one answer. --objects: every object says "additionalProperties": false (closed, the default,
as OpenAI's strict mode requires), nothing (unsaid: the server closes objects that list their
properties, `grammar.closed_schema`), or true (open: JSON Schema's own default, what the
server did before; then an answer may add keys until max_tokens). Validity is checked against
the closed schemas. Issue 30's target: every request finishes "stop" with valid JSON, no
whitespace runaway (grammar.JSON_WHITESPACE bounds it).

    .venv/bin/python benchmarks/structured_output.py [--model PATH] [--per-schema 10]
        [--max-tokens 200] [--objects closed|unsaid|open]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SCHEMAS = {
    "city": ({"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
              "required": ["city"]}, "Name a city in Norway as JSON."),
    "person": ({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40}},
        "required": ["name", "age"], "additionalProperties": False},
        "Describe a person as JSON."),
    "enum": ({"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"enum": ["S", "M", "L"]}}, "required": ["color", "size"]},
        "Pick a T-shirt as JSON."),
    "nested": ({"type": "object", "properties": {
        "book": {"type": "object", "properties": {
            "title": {"type": "string", "maxLength": 40},
            "author": {"type": "object", "properties": {"name": {"type": "string",
                                                                 "maxLength": 30}},
                       "required": ["name"]}}, "required": ["title", "author"]}},
        "required": ["book"]}, "A book and its author as JSON."),
    "array": ({"type": "object", "properties": {
        "fruits": {"type": "array", "items": {"type": "string", "maxLength": 15},
                   "minItems": 1, "maxItems": 4}}, "required": ["fruits"]},
        "List some fruits as JSON."),
    "numbers": ({"type": "object", "properties": {
        "temperature": {"type": "number"}, "humidity": {"type": "integer", "minimum": 0,
                                                        "maximum": 100},
        "raining": {"type": "boolean"}}, "required": ["temperature", "humidity", "raining"]},
        "Today's weather as JSON."),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--per-schema", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--show", action="store_true", help="print every answer cut at max_tokens")
    ap.add_argument("--objects", choices=("closed", "unsaid", "open"), default="closed",
                    help="how objects speak of other keys: false (closed), nothing (unsaid: "
                         "the server closes them), true (open)")
    args = ap.parse_args()
    import jsonschema
    from openai import OpenAI

    from torchllama.bench.serve import serve_in_thread
    from torchllama.bench.tool_sets import with_objects
    from torchllama.checkpoint import resolve_model_path
    from torchllama.serving.app import create_app, load_for_engine

    path = str(resolve_model_path(args.model))
    model, tokenizer = load_for_engine(path, "auto", progress=False)
    with serve_in_thread(create_app(model, tokenizer, Path(path).name)) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        totals = [0, 0, 0]
        print(f"{'schema':10}{'stop':>6}{'valid':>7}{'length':>8}{'max ws share':>14}")
        for name, (schema, ask) in SCHEMAS.items():
            schema = with_objects(schema, "closed")
            sent = with_objects(schema, args.objects)
            stop = valid = length = 0
            worst = 0.0
            for i in range(args.per_schema):
                r = client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": ask}],
                    max_tokens=args.max_tokens, temperature=(0.7, 0.8, 0.9, 1.0)[i % 4],
                    seed=i, response_format={"type": "json_schema",
                                             "json_schema": {"name": name, "schema": sent}})
                text, reason = r.choices[0].message.content, r.choices[0].finish_reason
                worst = max(worst, sum(c.isspace() for c in text) / max(len(text), 1))
                stop += reason == "stop"
                length += reason == "length"
                if args.show and reason == "length":
                    print(f"  {name} T={(0.7, 0.8, 0.9, 1.0)[i % 4]} seed {i}: {text[:160]!r}")
                try:
                    jsonschema.validate(json.loads(text), schema)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
            totals = [totals[0] + stop, totals[1] + valid, totals[2] + length]
            print(f"{name:10}{stop:>6}{valid:>7}{length:>8}{worst:>14.2f}", flush=True)
        n = args.per_schema * len(SCHEMAS)
        print(f"{'all':10}{totals[0]:>6}{totals[1]:>7}{totals[2]:>8}   of {n} requests")


if __name__ == "__main__":
    main()
