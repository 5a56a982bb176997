"""`POST /v1/completions`: OpenAI's (legacy) Completions API over the one request path.

The prompt is continued as it is (BOS added when the model expects it); the answer is each
choice's text (whole) or `data: {...}` chunks of it ending with `data: [DONE]`, with OpenAI's
completion log-probabilities (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

Source: OpenAI's API reference, "Completions" (legacy).
"""

from __future__ import annotations

import contextlib
import json
from typing import AsyncIterator, Optional

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import Field

from torchllama.generation.session import encode_prompt
from torchllama.serving.api.core import (APIError, Choice, Generation, Output, Run, SamplingBody,
                                         Service, body_constraint, body_sampling,
                                         openai_error_event, stop_strings)
from torchllama.serving.request import TokenEvent


class CompletionBody(SamplingBody):
    prompt: str
    max_tokens: Optional[int] = Field(16, ge=1)          # OpenAI's default for completions
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False


def generation(body: CompletionBody, service: Service) -> Generation:
    """The body in the engine's terms.

    Raises:
        APIError: 400 naming the field.
    """
    if body.echo:
        raise APIError(400, "echo is not supported", "echo")
    prompt = encode_prompt(service.tokenizer, body.prompt)
    return Generation([prompt], body_sampling(body, service.tokenizer.vocab_size),
                      body.max_tokens, body.n, stop_strings(body.stop), logprobs=body.logprobs,
                      constraint=body_constraint(body), model=body.model)


async def create(body: CompletionBody, http: HTTPRequest):
    """POST /v1/completions: the text completion object, or a stream of its chunks."""
    service: Service = http.app.state.service
    run = await service.start(generation(body, service), "cmpl-")
    if not body.stream:
        return whole(run, await run.whole(http), body.logprobs)
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(stream(run, body.logprobs, include_usage),
                             media_type="text/event-stream")


def logprobs_of(choice: Choice, events: list[TokenEvent]) -> dict:
    """The legacy completions `logprobs` object of these tokens."""
    return {"tokens": [choice.token_text(e.token_id) for e in events],
            "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{choice.token_text(t): lp for t, lp in (e.top_logprobs or [])}
                             for e in events],
            "text_offset": []}


def whole(run: Run, outputs: list[Output], logprobs: Optional[int]) -> dict:
    """The text completion object."""
    choices = [{"index": c.index, "finish_reason": out.finish_reason, "text": out.text,
                "logprobs": logprobs_of(c, c.token_events) if logprobs is not None else None}
               for c, out in zip(run.choices, outputs)]
    return {"id": run.rid, "object": "text_completion", "created": run.created,
            "model": run.model, "choices": choices, "usage": run.usage()}


def chunk(run: Run, payloads: list[dict], extra: Optional[dict] = None) -> str:
    """One server-sent event of a streamed answer."""
    data = {"id": run.rid, "object": "text_completion", "created": run.created,
            "model": run.model, "choices": payloads, **(extra or {})}
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream(run: Run, logprobs: Optional[int], include_usage: bool) -> AsyncIterator[str]:
    """The chunks: each choice's text as it comes, its finish reason, the usage (if asked),
    [DONE]."""
    async with contextlib.aclosing(run.updates()) as updates:
        async for choice, update in updates:
            if update.final and choice.error is not None:
                yield openai_error_event(choice.error)
                return
            if update.final:
                yield chunk(run, [{"index": choice.index, "finish_reason": choice.finish_reason,
                                   "text": ""}])
            elif update.text or update.event is not None:
                payload = {"index": choice.index, "finish_reason": None, "text": update.text}
                if logprobs is not None and update.event is not None:
                    payload["logprobs"] = logprobs_of(choice, [update.event])
                yield chunk(run, [payload])
    if include_usage:
        yield chunk(run, [], {"usage": run.usage()})
    yield "data: [DONE]\n\n"
