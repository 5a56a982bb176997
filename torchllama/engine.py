"""Continuous batching: many requests share one model and one batched decode step.

The engine owns the model and a KV cache of `max_batch_size` rows, and runs one loop in a
background thread:

    admit waiting requests into free rows (one prefill each, into its own cache row)
    one decode step for all rows at once            ─▶ one token for every active request
    retire finished or cancelled requests           ─▶ their rows are free for the next ones

A request joins at the next decode step and leaves as soon as it is done, so concurrent requests
share the weights' memory traffic (decode is bound by it) and total throughput grows with the
number of requests.

Cache layout: all rows write their next token at the same slot `cur`; row b's sequence occupies
slots [pad[b], cur) and its first pad[b] slots are padding, never attended (the model's
left-padding support, `Transformer.forward(pad=...)`, which also gives each row its own RoPE
positions). A new request with a P-token prompt is prefilled into slots [cur − P, cur) of its row;
if P > cur, every row is first shifted right by P − cur slots (their pads grow by as much). When
`cur` reaches the end of the cache, rows are shifted left by the smallest pad; a row with no pad
left has used the whole context and finishes with "length".
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from torchllama.errors import ArgumentError, ContextLengthError, TorchLlamaError
from torchllama.sampling import SamplingParams, sample, token_logprobs

log = logging.getLogger("torchllama.engine")


class QueueFull(TorchLlamaError):
    """The engine's waiting queue is full; try again later (HTTP 429)."""


@dataclass
class TokenEvent:
    """One generated token, with its log-probability and the top alternatives if asked."""

    token_id: int
    logprob: Optional[float] = None
    top_logprobs: Optional[list[tuple[int, float]]] = None


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
    """

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    on_token: Callable[[TokenEvent], None]
    on_finish: Callable[[str], None]
    logprobs: Optional[int] = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating for this request (e.g. its client went away); frees its row."""
        self.cancelled.set()


@dataclass
class _Row:
    request: Request
    generator: torch.Generator
    generated: list[int]
    pending: int                      # the sampled token to feed at the next decode step


class Engine:
    """Continuous-batching generator over one model (see the module docstring).

    Args:
        model: a `Transformer` (eval mode). The engine allocates its KV cache.
        max_batch_size: rows decoded together.
        max_queue: requests that may wait for a row; beyond it `submit` raises QueueFull.
        pad_id: token fed to idle rows (never attended).
    """

    def __init__(self, model, max_batch_size: int = 8, max_queue: int = 64, pad_id: int = 0):
        if max_batch_size < 1 or max_queue < 1:
            raise ArgumentError("max_batch_size and max_queue must be ≥ 1")
        self.model = model
        self.max_batch_size = max_batch_size
        self.context = model.args.max_seq_len
        self.pad_id = pad_id
        self.device = model.tok_embeddings.weight.device
        self._waiting: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self._rows: list[Optional[_Row]] = [None] * max_batch_size
        self._pad = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        self._cur = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.steps = 0                    # decode steps run (for tests and stats)

    # ---- public ------------------------------------------------------------------------------

    def start(self) -> "Engine":
        """Allocate the cache and start the engine thread."""
        with torch.inference_mode(False):
            self.model.setup_caches(self.max_batch_size, self.context)
        self._thread = threading.Thread(target=self._run, name="torchllama-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop the engine thread (requests still running are finished as "cancelled")."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def submit(self, request: Request) -> Request:
        """Queue a request; it joins the batch at the next step with a free row.

        Raises:
            ArgumentError: empty prompt or max_tokens < 1.
            ContextLengthError: the prompt leaves no room for a new token.
            QueueFull: too many requests waiting.
        """
        if self._stop.is_set():
            raise TorchLlamaError("the engine has been shut down")
        if not request.prompt_ids:
            raise ArgumentError("the prompt is empty (no tokens)")
        if request.max_tokens < 1:
            raise ArgumentError(f"max_tokens must be ≥ 1, got {request.max_tokens}")
        if len(request.prompt_ids) >= self.context:
            raise ContextLengthError(
                f"the prompt has {len(request.prompt_ids)} tokens but the context holds "
                f"{self.context}; shorten it to at most {self.context - 1} tokens")
        try:
            self._waiting.put_nowait(request)
        except queue.Full:
            raise QueueFull(f"too many requests waiting ({self._waiting.maxsize}); "
                            "try again later") from None
        self._wake.set()
        return request

    @property
    def active(self) -> int:
        """Requests holding a row now."""
        return sum(row is not None for row in self._rows)

    # ---- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                try:
                    self._admit()
                    if not self.active:
                        self._cur = 0                         # nothing cached: start over
                        self._wake.wait(timeout=0.1)
                        self._wake.clear()
                        continue
                    self._decode_step()
                except Exception:                             # never let the thread die: fail
                    log.exception("engine step failed")       # what was running, start over
                    for b, row in enumerate(self._rows):
                        if row is not None:
                            self._finish(b, "error")
        for b, row in enumerate(self._rows):
            if row is not None:
                self._finish(b, "cancelled")
        while True:                                   # and those still waiting for a row
            try:
                _notify(self._waiting.get_nowait().on_finish, "cancelled")
            except queue.Empty:
                break

    def _admit(self) -> None:
        for b in range(self.max_batch_size):
            if self._rows[b] is not None:
                continue
            try:
                request = self._waiting.get_nowait()
            except queue.Empty:
                return
            if request.cancelled.is_set():
                _notify(request.on_finish, "cancelled")
                continue
            try:
                self._prefill(b, request)
            except Exception:                   # this request fails; the other rows go on
                log.exception("prefill failed")
                if self._rows[b] is not None:
                    self._finish(b, "error")
                else:
                    _notify(request.on_finish, "error")

    def _shift(self, d: int) -> None:
        """Move every row's cached slots by d (right if d > 0, left if d < 0); slots uncovered
        by a right shift are zeroed, so the new padding is finite (see _prefill)."""
        self.model.shift_caches(d, self._cur)
        self._pad += d
        self._cur += d

    def _prefill(self, b: int, request: Request) -> None:
        P = len(request.prompt_ids)
        if P > self._cur:
            self._shift(P - self._cur)
        start = self._cur - P
        self._pad[b] = start
        # The padding slots are masked out, but attention still multiplies their values by a
        # zero weight: they must be finite, and this row's may never have been written.
        self.model.zero_cache_slots(slice(b, b + 1), 0, start)
        tokens = torch.tensor([request.prompt_ids], device=self.device)          # (1, P)
        logits = self.model(tokens, start, last_only=True, pad=self._pad[b:b + 1],
                            cache_rows=slice(b, b + 1))[:, -1]                  # (1, V)
        row = _Row(request, request.sampling.make_generator(self.device), [], self.pad_id)
        self._rows[b] = row
        self._take(b, logits)

    def _take(self, b: int, logits: torch.Tensor) -> None:
        """Sample row b's next token from its logits (1, V) and report or finish."""
        row = self._rows[b]
        request = row.request
        if request.cancelled.is_set():
            self._finish(b, "cancelled")
            return
        params = request.sampling
        try:            # a request's own settings can fail (e.g. a tiny temperature: inf/NaN)
            token = sample(logits, params, row.generator, [request.prompt_ids + row.generated],
                           [row.generated])                                      # (1,)
            if int(token) in request.stop_ids:
                self._finish(b, "stop")
                return
            event = TokenEvent(int(token))
            if request.logprobs is not None:
                chosen, top_ids, top_lp = token_logprobs(logits, token, request.logprobs)
                event.logprob = float(chosen[0])
                event.top_logprobs = list(zip(top_ids[0].tolist(), top_lp[0].tolist()))
        except Exception:
            log.exception("sampling failed")
            self._finish(b, "error")
            return
        row.generated.append(event.token_id)
        row.pending = event.token_id
        if not _notify(request.on_token, event):   # its consumer broke: end it, not the batch
            self._finish(b, "error")
            return
        # Like Session: prompt + output never exceed the context.
        if len(row.generated) >= request.max_tokens or \
                len(request.prompt_ids) + len(row.generated) >= self.context:
            self._finish(b, "length")

    def _finish(self, b: int, reason: str) -> None:
        row, self._rows[b] = self._rows[b], None
        self._pad[b] = self._cur                    # idle: all of its slots are padding
        _notify(row.request.on_finish, reason)

    def _decode_step(self) -> None:
        if self._cur >= self.context:               # cache full: drop the common padding
            active = [b for b, row in enumerate(self._rows) if row is not None]
            d = int(self._pad[active].min())
            if d == 0:                              # these rows used the whole context
                for b in active:
                    if int(self._pad[b]) == 0:
                        self._finish(b, "length")
                return
            self._shift(-d)
        # Rows are filled lowest first, so the active ones sit in rows 0..B-1: decode just those
        # (B = last active row + 1), idle rows among them fed padding.
        B = max(b for b, row in enumerate(self._rows) if row is not None) + 1
        for b, row in enumerate(self._rows):        # idle rows stay all padding
            if row is None:
                self._pad[b] = self._cur
        tokens = torch.tensor([[row.pending if row is not None else self.pad_id]
                               for row in self._rows[:B]], device=self.device)  # (B, 1)
        logits = self.model(tokens, self._cur, pad=self._pad[:B])[:, -1]         # (B, V)
        self._cur += 1
        self.steps += 1
        for b, row in enumerate(self._rows[:B]):
            if row is not None:
                self._take(b, logits[b:b + 1])


def _notify(callback: Callable, value) -> bool:
    """Call a request's callback; its failure is logged, never the engine's. True if it worked."""
    try:
        callback(value)
        return True
    except Exception:
        log.exception("request callback failed")
        return False
