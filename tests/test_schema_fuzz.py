"""Property-based fuzzing of every operation in the server's /openapi.json with schemathesis
(as vLLM does in tests/entrypoints/openai/test_openai_schema.py).

Each operation gets bodies generated from its schema, valid ones (positive) and invalid
ones (negative), sent to a live server over HTTP; every answer must be no server error, a
status the schema documents, its documented content type and a body matching the
documented schema — the schema is the oracle, and it must describe what the endpoints
accept and answer. Generation is kept short: the token counts a case asks for are capped
(`bounded`), so a case never generates for long. `make test` runs a bounded number of
examples per operation; `make test-slow` many more.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import (content_type_conformance, not_a_server_error,  # noqa: E402
                                 response_schema_conformance, status_code_conformance)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]

#: the most tokens a fuzzed case may ask for, per field (the server's own caps are larger)
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8, "n": 2,
        "best_of": 2, "top_logprobs": 3, "logprobs": 3}


@pytest.fixture(scope="module")
def fuzzed_server(smollm2_gguf, tmp_path_factory):
    """SmolLM2 served in this process with every feature on (runtime adapter loading inside
    an empty root, a small queue): its base URL."""
    from torchllama.bench.serve import serve_in_thread
    from torchllama.serving.app import create_app, load_for_engine

    model, tokenizer = load_for_engine(str(smollm2_gguf), "auto", progress=False)
    root = tmp_path_factory.mktemp("adapter_root")
    app = create_app(model, tokenizer, "m", allow_adapter_loading=True, adapter_root=str(root),
                     max_queue=8, prefix_cache_mb=16)
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(f"{fuzzed_server}/openapi.json")


def operations() -> list[str]:
    from torchllama.serving.app import ROUTES

    return [f"{method} {path}" for method, path, _, _ in ROUTES]


#: the field that limits each generating operation's output
LIMIT_FIELD = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_tokens",
               "/v1/responses": "max_output_tokens", "/v1/messages": "max_tokens"}

#: the longest prompt text a fuzzed case sends, characters
TEXT_CAP = 200


def bounded(body, path: str):
    """The body with its token counts capped (`CAPS`, only where they are numbers above the
    cap: an invalid value stays invalid), an output limit where it has none (the server's
    default is the context), at most 4 prompts and short prompt texts."""
    if not isinstance(body, dict):
        return body
    for key, cap in CAPS.items():
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    limit = LIMIT_FIELD.get(path)
    if limit is not None and body.get(limit) is None and \
            body.get("max_completion_tokens") is None:
        body[limit] = CAPS[limit]
    for key in ("prompt", "input", "instructions", "system"):
        value = body.get(key)
        if isinstance(value, list) and len(value) > 4:
            body[key] = value = value[:4]
        if isinstance(value, str):
            body[key] = value[:TEXT_CAP]
        elif isinstance(value, list):
            body[key] = [v[:TEXT_CAP] if isinstance(v, (str, list)) else v for v in value]
    return body


def fuzz(api_schema, operation: str, examples: int) -> None:
    """`examples` positive and `examples` negative cases of one operation, each checked."""
    from schemathesis import GenerationMode

    method, path = operation.split(" ", 1)
    target = api_schema[path][method]
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        @given(case=target.as_strategy(generation_mode=mode))
        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            case.body = bounded(case.body, path)
            case.call_and_validate(checks=CHECKS, timeout=120)

        try:
            check()
        except Unsatisfiable:
            if mode is GenerationMode.POSITIVE:   # (nothing invalid to generate: an
                raise                             # operation without a body or a parameter
                                                  # that can be wrong)


@pytest.mark.parametrize("operation", operations())
def test_every_operation_answers_by_its_schema(api_schema, operation):
    fuzz(api_schema, operation, 10)


@pytest.mark.slow
@pytest.mark.parametrize("operation", operations())
def test_every_operation_answers_by_its_schema_at_length(api_schema, operation):
    fuzz(api_schema, operation, 150)
