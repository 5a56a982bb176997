"""`POST /v1/embeddings`: OpenAI's Embeddings API — pooled final hidden states
(`torchllama.serving.embeddings`), computed in the engine's thread between two decode steps.

Source: OpenAI's API reference, "Embeddings".
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal, Optional, Union

from fastapi import Request as HTTPRequest
from pydantic import BaseModel, Field

from torchllama.serving.api.core import APIError, Service
from torchllama.serving.api.schemas import TokenIds


class EmbeddingBody(BaseModel):
    """OpenAI's /v1/embeddings body; `pooling` ("mean" or "last") is an extension
    (`torchllama.serving.embeddings`)."""
    model: Optional[str] = None
    input: Union[Annotated[str, Field(min_length=1)],
                 Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)],
                 TokenIds, Annotated[list[TokenIds], Field(min_length=1)]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    pooling: Literal["mean", "last"] = "mean"


async def create(body: EmbeddingBody, http: HTTPRequest) -> dict:
    """POST /v1/embeddings: the list of embedding objects."""
    from torchllama.serving.embeddings import encoded, pooled

    service: Service = http.app.state.service
    engine = service.engine
    service.check_texts([x for x in ([body.input] if isinstance(body.input, str) else
                                     body.input) if isinstance(x, str)], "input")
    lists = embedding_inputs(service.tokenizer, body, engine.context,
                             engine.model.args.vocab_size)
    future = engine.call(lambda: pooled(engine.model, lists, body.pooling))
    vectors = await asyncio.wrap_future(future)                          # (N, dim) float32
    n = sum(len(ids) for ids in lists)
    service.metrics.requests.labels("embeddings", "stop").inc()
    service.metrics.prompt_tokens.inc(n)
    return {"object": "list", "model": service.model_name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": encoded(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}


def embedding_inputs(tokenizer, body: EmbeddingBody, context: int,
                     vocab_size: int) -> list[list[int]]:
    """The body's inputs as token-id lists (a string, strings, token ids, lists of them; no
    BOS added, as OpenAI's tokens are the text's).

    Raises:
        APIError: 400 (param "input") for an empty input, one longer than the context or a
            token id outside the vocabulary; (param "dimensions") for `dimensions`, which the
            model's hidden size fixes.
    """
    if body.dimensions is not None:
        raise APIError(400, "dimensions: this model's embeddings have its hidden size; "
                       "leave dimensions out", "dimensions")
    items = body.input
    if isinstance(items, str) or (items and isinstance(items[0], int)):
        items = [items]
    lists = [tokenizer.encode(x, bos=False) if isinstance(x, str) else list(x) for x in items]
    for i, ids in enumerate(lists):
        if not ids:
            raise APIError(400, f"input[{i}] is empty (no tokens)", "input")
        if len(ids) > context:
            raise APIError(400, f"input[{i}] has {len(ids)} tokens; the context holds "
                           f"{context}", "input")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise APIError(400, f"input[{i}]: token ids must be in [0, {vocab_size})", "input")
    if not lists:
        raise APIError(400, "input is empty", "input")
    return lists
