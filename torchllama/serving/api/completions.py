"""`POST /v1/completions`: OpenAI's (legacy) Completions API over the one request path.

`prompt` takes OpenAI's four forms: a string (BOS added when the model expects it), a list of
strings, a list of token ids, or a list of token-id lists (taken as they are); each prompt gets
`n` choices (index prompt·n + j), all submitted to the engine at once. The answer is each
choice's text (whole) or `data: {...}` chunks of it ending with `data: [DONE]`, with OpenAI's
completion log-probabilities (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`: each
token's character offset in the choice's `text`).

`echo: true` puts the prompt before the generated text; with `logprobs` the prompt's tokens come
first in the log-probabilities too — the first token's log-probability and alternatives `null`
(nothing predicts it), each other's computed from the logits of the position before it — then
the generated ones. `max_tokens: 0` with `echo` scores a prompt without generating. This is
what EleutherAI's lm-evaluation-harness sends for loglikelihood tasks (`echo: true,
logprobs: 1, max_tokens: 1`, token-id prompts): the sum of a continuation's token
log-probabilities. A scored prompt is prefilled whole (the prefix cache is not used for it).

Source: OpenAI's API reference, "Completions" (legacy); vLLM's `serving_completion.py` for echo
with prompt log-probabilities.
"""

from __future__ import annotations

import contextlib
from typing import Annotated, AsyncIterator, Optional, Union

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from pydantic import Field

from torchllama.generation.session import encode_prompt
from torchllama.serving.api.core import (APIError, Choice, Generation, Output, Run, SamplingBody,
                                         Service, body_constraint, body_sampling,
                                         openai_chunk, openai_error_event,
                                         stop_strings)
from torchllama.serving.api.schemas import TokenIds
from torchllama.serving.request import TokenEvent

#: the object of a streamed answer's chunks
KIND = "text_completion"


class CompletionBody(SamplingBody):
    prompt: Union[Annotated[str, Field(min_length=1)],
                  Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)],
                  TokenIds, Annotated[list[TokenIds], Field(min_length=1)]]
    max_tokens: Optional[int] = Field(16, ge=0)          # OpenAI's default for completions
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False


def prompts_of(body: CompletionBody, service: Service) -> list[list[int]]:
    """The token ids of each prompt (strings encoded with BOS if the model expects it, token
    ids as given).

    Raises:
        APIError: 400 (param "prompt") for no prompt, an empty one, or a token id outside the
            vocabulary.
    """
    items = body.prompt
    if isinstance(items, str) or (items and isinstance(items[0], int)):
        items = [items]
    if not items:
        raise APIError(400, "prompt: give a string, strings, token ids or lists of them",
                       "prompt")
    service.check_texts([item for item in items if isinstance(item, str)], "prompt")
    tokenizer = service.tokenizer
    prompts = []
    vocab = tokenizer.vocab_size
    for i, item in enumerate(items):
        ids = encode_prompt(tokenizer, item) if isinstance(item, str) else list(item)
        if not ids:
            raise APIError(400, f"prompt[{i}] is empty (no tokens)", "prompt")
        if min(ids) < 0 or max(ids) >= vocab:
            raise APIError(400, f"prompt[{i}]: token ids must be in [0, {vocab})", "prompt")
        prompts.append(ids)
    return prompts


def generation(body: CompletionBody, service: Service) -> Generation:
    """The body in the engine's terms.

    Raises:
        APIError: 400 naming the field.
    """
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens: 0 generates nothing; it scores the prompt with "
                            "echo: true", "max_tokens")
    scored = body.echo and body.logprobs is not None
    return Generation(
        prompts_of(body, service), body_sampling(body, service.tokenizer.vocab_size),
        body.max_tokens, body.n, stop_strings(body.stop), logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if scored else (0 if body.max_tokens == 0 else None),
        constraint=body_constraint(body), model=body.model)


async def create(body: CompletionBody, http: HTTPRequest):
    """POST /v1/completions: the text completion object, or a stream of its chunks."""
    service: Service = http.app.state.service
    run = await service.start(generation(body, service), "cmpl-")
    echo = _Echo(body, service.tokenizer)
    if not body.stream:
        return whole(run, await run.whole(http), body.logprobs, echo)
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(stream(run, body.logprobs, include_usage, echo),
                             media_type="text/event-stream")


# --------------------------------------------------------------------------------------------
# The answer
# --------------------------------------------------------------------------------------------

class _Echo:
    """What `echo` puts before a choice's text: its prompt, and with logprobs the prompt
    tokens' log-probabilities (None for the first)."""

    def __init__(self, body: CompletionBody, tokenizer):
        self.on = body.echo
        self.texts = None
        if body.echo and isinstance(body.prompt, (str, list)):
            items = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            if items and all(isinstance(x, str) for x in items):
                self.texts = items                     # a string prompt is echoed as given
        self.tokenizer = tokenizer

    def text(self, choice: Choice) -> str:
        """The prompt's text of a choice."""
        if not self.on:
            return ""
        if self.texts is not None:
            return self.texts[choice.prompt_index]
        return self.tokenizer.decode(choice.prompt_ids)

    def logprobs(self, choice: Choice) -> dict:
        """The prompt tokens' part of a choice's `logprobs`."""
        if not self.on:
            return {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        scores = choice.prompt_scores
        return {"tokens": [choice.token_text(t) for t in choice.prompt_ids],
                "token_logprobs": [None] + [lp for lp, _ in scores],
                "top_logprobs": [None] + [{choice.token_text(t): v for t, v in top}
                                          for _, top in scores]}


def logprobs_of(choice: Choice, events: list[TokenEvent], offset: int = 0,
                before: Optional[dict] = None) -> dict:
    """The legacy completions `logprobs` object of these tokens (after `before`, the echoed
    prompt's), their text offsets counted from `offset`."""
    before = before or {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    tokens = before["tokens"] + [choice.token_text(e.token_id) for e in events]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens,
            "token_logprobs": before["token_logprobs"] + [e.logprob for e in events],
            "top_logprobs": before["top_logprobs"] +
            [{choice.token_text(t): lp for t, lp in (e.top_logprobs or [])} for e in events],
            "text_offset": offsets}


def whole(run: Run, outputs: list[Output], logprobs: Optional[int], echo: _Echo) -> dict:
    """The text completion object."""
    choices = []
    for c, out in zip(run.choices, outputs):
        entry = {"index": c.index, "finish_reason": out.finish_reason,
                 "text": echo.text(c) + out.text, "logprobs": None}
        if logprobs is not None:
            entry["logprobs"] = logprobs_of(c, c.token_events, 0, echo.logprobs(c))
        choices.append(entry)
    return {"id": run.rid, "object": "text_completion", "created": run.created,
            "model": run.model, "choices": choices, "usage": run.usage()}


async def stream(run: Run, logprobs: Optional[int], include_usage: bool,
                 echo: _Echo) -> AsyncIterator[str]:
    """The chunks: each choice's echoed prompt (if asked) before its first text, its text as
    it comes, its finish reason, the usage (if asked), [DONE]."""
    offsets: dict[int, int] = {}                   # choice → its next token's text offset
    async with contextlib.aclosing(run.updates()) as updates:
        async for choice, update in updates:
            if update.final and choice.error is not None:
                yield openai_error_event(choice.error)
                return
            if echo.on and choice.index not in offsets:
                yield openai_chunk(run, KIND, [_echoed(choice, echo, logprobs, offsets)])
            if update.final:
                yield openai_chunk(run, KIND, [{"index": choice.index, "text": "",
                                                "finish_reason": choice.finish_reason}])
            elif update.text or update.event is not None:
                payload = {"index": choice.index, "finish_reason": None, "text": update.text}
                if logprobs is not None and update.event is not None:
                    start = offsets.get(choice.index, 0)
                    payload["logprobs"] = logprobs_of(choice, [update.event], start)
                    offsets[choice.index] = start + len(choice.token_text(update.event.token_id))
                yield openai_chunk(run, KIND, [payload])
    if include_usage:
        yield openai_chunk(run, KIND, [], {"usage": run.usage()})
    yield "data: [DONE]\n\n"


def _echoed(choice: Choice, echo: _Echo, logprobs: Optional[int],
            offsets: dict[int, int]) -> dict:
    """A streamed choice's first payload with `echo`: its prompt (and the prompt's
    log-probabilities)."""
    payload = {"index": choice.index, "finish_reason": None, "text": echo.text(choice)}
    offsets[choice.index] = 0
    if logprobs is not None:
        payload["logprobs"] = logprobs_of(choice, [], 0, echo.logprobs(choice))
        offsets[choice.index] = sum(len(t) for t in payload["logprobs"]["tokens"])
    return payload
