"""What the engine's roles pass between them: a request, its row, the events it reports.

    Request    what a caller submits (prompt, limits, sampling, callbacks, its TextStream)
    _Row       a request holding a cache row: its position, generated tokens, generator
    TokenEvent one generated token as the caller sees it (id, log-probs, text delta)
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from torchllama.errors import TorchLlamaError
from torchllama.generation.sampling import SamplingParams
from torchllama.generation.text import TextStream

log = logging.getLogger("torchllama.serving.engine")


class QueueFull(TorchLlamaError):
    """The engine's waiting queue is full; try again later (HTTP 429)."""


@dataclass
class TokenEvent:
    """One generated token, with its log-probability and the top alternatives if asked.

    text: the text this token adds to the request's output (its `TextStream` delta; '' while a
    character is incomplete or a stop string may be starting, and without a TextStream).
    stopped: this token completed a stop string (`text` is what came before it); the request
    finishes with it ("stop").
    """

    token_id: int
    logprob: Optional[float] = None
    top_logprobs: Optional[list[tuple[int, float]]] = None
    text: str = ""
    stopped: bool = False


@dataclass
class Request:
    """A generation request.

    Attributes:
        prompt_ids: the prompt's token ids (BOS included if wanted), non-empty.
        max_tokens: at most this many new tokens.
        sampling: temperature, top-k/p, min-p, penalties, logit bias, seed, logprobs.
        stop_ids: token ids that end the request (not reported).
        logprobs: None = no log-probabilities; n ≥ 0 = the chosen token's and the n most
            likely alternatives' (OpenAI's logprobs / top_logprobs).
        on_token: called from the engine thread with each `TokenEvent`.
        on_finish: called from the engine thread once, with "stop", "length", "cancelled" or
            "error" (sampling or the model failed for this request; the engine goes on).
        constraint: a `torchllama.generation.grammar.Constraint`: only tokens its grammar allows are
            sampled, and the request stops ("stop") when the grammar is complete.
        text: a `torchllama.generation.text.TextStream` of this request: each token's text
            delta rides on its `TokenEvent`, and the request finishes ("stop") in the step
            whose token completes one of its stop strings. None: token ids only.
        tail: set by the engine before `on_finish`: the text the TextStream still held back
            at the end ('' after a stop string, or without a TextStream).
        adapter: the name of a LoRA adapter loaded on the engine (`Engine.load_adapter`) to
            generate with, or None for the base model.
        prompt_logprobs: None, or n ≥ 0: score the prompt — each prompt token after the first
            gets its log-probability and the n most likely alternatives at its position, in
            `prompt_scores` (set by the engine before the first token or the finish is
            reported). The prompt is then prefilled whole (no prefix cache reuse), and
            max_tokens may be 0 (score only, nothing generated).
        prompt_scores: [(logprob, [(token id, logprob), ...]), ...], one per prompt token
            from the second on (`prompt_logprobs`).
        cached_tokens: set by the engine when the request gets a row: the prompt tokens taken
            from the prefix cache (not prefilled).
        error: why it ended in error ("error" finish, or cancelled by `abort`): the cause,
            e.g. "ValueError: non-finite logits at token 12"; None otherwise.
        error_status: the HTTP status that cause deserves (500: it failed; 503: the server
            shut down before it finished).
        id: the API request's id and choice (e.g. "chatcmpl-…#0"), for the log.
    """

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    on_token: Callable[[TokenEvent], None]
    on_finish: Callable[[str], None]
    logprobs: Optional[int] = None
    constraint: Optional[Any] = None
    text: Optional[TextStream] = None
    tail: str = ""
    adapter: Optional[str] = None
    prompt_logprobs: Optional[int] = None
    prompt_scores: list = field(default_factory=list)
    cached_tokens: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None
    error_status: int = 500
    id: str = ""

    @property
    def salt(self) -> bytes:
        """What keys this request's prefix cache blocks besides its tokens: its adapter."""
        return self.adapter.encode() if self.adapter else b""

    def cancel(self) -> None:
        """Stop generating for this request (e.g. its client went away); frees its row."""
        self.cancelled.set()

    def abort(self, cause: str, status: int = 503) -> None:
        """Stop generating for this request and end it in error (its `error` the cause):
        the server is shutting down, or its client read too slowly."""
        if self.error is None:
            self.error, self.error_status = cause, status
        self.cancelled.set()

    def failed(self, error: BaseException) -> None:
        """Record why it fails (before the engine finishes it with "error")."""
        if self.error is None:
            self.error = f"{type(error).__name__}: {error}"


@dataclass
class _Row:
    """A request holding cache row `b`: its tokens occupy slots 0..pos-1 of that row."""

    request: Request
    generator: torch.Generator
    generated: list[int] = field(default_factory=list)
    pending: int = 0                  # the sampled token, written at slot `pos` next step
    pos: int = 0                      # slots of this row's cache holding its tokens

    @property
    def prefilling(self) -> bool:
        """Still being prefilled: not sampled, not fed its tokens."""
        return self.pos < len(self.request.prompt_ids)


def notify(callback: Callable, value) -> bool:
    """Call a request's callback; its failure is logged, never the engine's. True if it worked."""
    try:
        callback(value)
        return True
    except Exception:
        log.exception("request callback failed")
        return False
