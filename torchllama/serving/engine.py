"""Continuous batching: many requests share one model and one batched decode step.

The engine owns the model and a KV cache of `max_batch_size` rows, and runs one loop in a
background thread:

    prefill: the next chunk of each prompt being prefilled, then waiting requests admitted
             into free rows, up to `prefill_chunk` prompt tokens in all per iteration
    one decode step for all decoding rows at once  ─▶ one token for every running request
    retire finished or cancelled requests           ─▶ their rows are free for the next ones

A request joins at the next decode step and leaves as soon as it is done, so concurrent requests
share the weights' memory traffic (decode is bound by it) and total throughput grows with the
number of requests.

Cache layout: a request owns one cache row from slot 0, as it would alone: its prompt fills
slots 0..P-1 (prefilled in that row by itself, in chunks of at most `prefill_chunk` tokens, with
decode steps of the other rows in between), and its n-th generated token is written at slot
P + n − 1. Each row is at its own position: the decode step gives the model one position per
row (`Transformer.forward` with a (B,) start_pos; −1 for rows not decoding, which write and
attend nothing), and every row attends to its own slots only. Nothing is shared between rows —
no common cursor, no padding, no shifts — so a request computes what it would alone, whatever
else runs: with torchllama's kernels (batch-invariant products, attention summed in slot order,
chunked prefill giving the same bits as whole) the very same bits, for every kind of cache
(full, sliding-window rings with a per-row furthest slot, MLA's latents).

Speculative decoding (`Engine(draft=...)`, `torchllama serve --draft`): while exactly one request
is decoding, each step is a speculative round for it (`torchllama.generation.speculative`): the drafter
proposes up to k tokens and the model checks them in one forward pass over its cache row, the
row's position moving past the accepted ones only (the rejected drafts' slots are written over
later). With two or more requests decoding, steps are plain batched decode steps: batching
already shares each step's weight traffic between the requests, which is what speculation buys
a lone request. Either way a request gets its exact output distribution (the same tokens at
temperature 0). Requests with a grammar decode plainly.

Prefix cache (`torchllama.serving.prefix_cache`): when a prompt's prefill completes, a copy of its
row's keys and values is kept (within a memory budget, least recently used first out); a later
prompt that starts with the same tokens gets that copy put in its row and is prefilled from
where they differ — the same bits as prefilling it whole, since chunked prefill is exact.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from torchllama.errors import ArgumentError, ContextLengthError, TorchLlamaError
from torchllama.serving.prefix_cache import PrefixCache
from torchllama.generation.sampling import SamplingParams, sample, token_logprobs
from torchllama.generation.speculative import DEFAULT_DRAFT_TOKENS, SpeculativeDecoder

log = logging.getLogger("torchllama.serving.engine")


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
        constraint: a `torchllama.generation.grammar.Constraint`: only tokens its grammar allows are
            sampled, and the request stops ("stop") when the grammar is complete.
    """

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    on_token: Callable[[TokenEvent], None]
    on_finish: Callable[[str], None]
    logprobs: Optional[int] = None
    constraint: Optional[Any] = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating for this request (e.g. its client went away); frees its row."""
        self.cancelled.set()


@dataclass
class _Row:
    request: Request
    generator: torch.Generator
    generated: list[int] = field(default_factory=list)
    pending: int = 0                  # the sampled token, written at slot `pos` next step
    pos: int = 0                      # slots of this row's cache holding its tokens

    @property
    def prefilling(self) -> bool:
        """Still being prefilled: not sampled, not fed its tokens."""
        return self.pos < len(self.request.prompt_ids)


class Engine:
    """Continuous-batching generator over one model (see the module docstring).

    Args:
        model: a `Transformer` (eval mode). The engine allocates its KV cache.
        max_batch_size: rows decoded together.
        max_queue: requests that may wait for a row; beyond it `submit` raises QueueFull.
        pad_id: token fed to idle rows (nothing written, nothing attended).
        prefill_chunk: prompt tokens prefilled per loop iteration, in all: a longer prompt is
            prefilled in chunks with decode steps in between, and waiting requests are admitted
            while the iteration has prompt tokens left (the first one always is).
        prefix_cache_bytes: memory for the prefix cache (0: none); see `PrefixCache`.
        draft: a `torchllama.generation.speculative.Drafter`: when one request is decoding alone (and
            has no grammar), its steps are speculative rounds; with several decoding, plain
            batched steps (see the module docstring). None: never speculative.
        draft_tokens: the most tokens drafted per round (adapted to the acceptance).

    Raises:
        ArgumentError: a size below 1 (below 0 for the prefix cache); a draft model whose
            vocabulary size differs from the model's.
    """

    def __init__(self, model, max_batch_size: int = 8, max_queue: int = 64, pad_id: int = 0,
                 prefill_chunk: int = 512, prefix_cache_bytes: int = 0, draft=None,
                 draft_tokens: int = DEFAULT_DRAFT_TOKENS):
        if max_batch_size < 1 or max_queue < 1 or prefill_chunk < 1 or prefix_cache_bytes < 0:
            raise ArgumentError("max_batch_size, max_queue and prefill_chunk must be ≥ 1 and "
                                "prefix_cache_bytes ≥ 0")
        self.speculator = SpeculativeDecoder(model, draft, draft_tokens) \
            if draft is not None else None
        self.model = model
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.context = model.args.max_seq_len
        self.pad_id = pad_id
        self.device = model.device
        self.prefix_cache = PrefixCache(model, prefix_cache_bytes) if prefix_cache_bytes \
            else None
        self._waiting: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self._held: Optional[Request] = None     # taken from the queue, waits for a budget
        self._rows: list[Optional[_Row]] = [None] * max_batch_size
        self._finite = [0] * max_batch_size      # per row: slots [0, n) hold finite numbers
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.steps = 0                    # decode steps run (for tests and stats)
        self.prefills = 0                 # prefill forward passes run (chunks)
        self.prefill_tokens = 0           # prompt tokens prefilled (not taken from the cache)

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

    @property
    def waiting(self) -> int:
        """Requests waiting for a row."""
        return self._waiting.qsize() + (self._held is not None)

    # ---- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                try:
                    self._prefill_step()
                    decoding = self._decoding()
                    if not decoding:
                        if not self.active:
                            self._wake.wait(timeout=0.1)
                            self._wake.clear()
                        continue
                    if self._speculates(decoding):
                        self._speculative_step(decoding[0])
                    else:
                        self._decode_step()
                except Exception:                             # never let the thread die: fail
                    log.exception("engine step failed")       # what was running, go on
                    for b, row in enumerate(self._rows):
                        if row is not None:
                            self._finish(b, "error")
        for b, row in enumerate(self._rows):
            if row is not None:
                self._finish(b, "cancelled")
        if self._held is not None:
            _notify(self._held.on_finish, "cancelled")
        while True:                                   # and those still waiting for a row
            try:
                _notify(self._waiting.get_nowait().on_finish, "cancelled")
            except queue.Empty:
                break

    def _decoding(self) -> list[int]:
        return [b for b, row in enumerate(self._rows) if row is not None and not row.prefilling]

    # ---- prefill -----------------------------------------------------------------------------

    def _prefill_step(self) -> None:
        """One iteration's prefill work, at most `prefill_chunk` prompt tokens: the next chunks
        of the prompts being prefilled (oldest row first), then new requests in free rows."""
        budget = self.prefill_chunk
        for b, row in enumerate(self._rows):
            if budget > 0 and row is not None and row.prefilling:
                budget -= self._guarded(b, budget)
        while budget > 0 and None in self._rows:
            request = self._next_request()
            if request is None:
                break
            b = self._admit(request)
            if b is not None:
                budget -= self._guarded(b, budget)

    def _guarded(self, b: int, budget: int) -> int:
        """Prefill the next chunk of row b (at most `budget` tokens); if it fails, its request
        fails and the other rows go on. Returns the tokens prefilled."""
        try:
            return self._prefill_chunk(b, budget)
        except Exception:
            log.exception("prefill failed")
            if self._rows[b] is not None:
                self._finish(b, "error")
            return 0

    def _next_request(self) -> Optional[Request]:
        """The oldest request waiting (cancelled ones are answered and skipped), or None."""
        while True:
            request, self._held = self._held, None
            if request is None:
                try:
                    request = self._waiting.get_nowait()
                except queue.Empty:
                    return None
            if not request.cancelled.is_set():
                return request
            _notify(request.on_finish, "cancelled")

    def _admit(self, request: Request) -> Optional[int]:
        """Give the lowest free row to a request, its prompt's cached prefix (if any) put in
        it. Returns the row, or None if the request failed here."""
        b = self._rows.index(None)
        try:
            generator = request.sampling.make_generator(self.device)
            self.model.caches.reset_rows(slice(b, b + 1))
            reused = 0
            if self.prefix_cache is not None:
                reused = self.prefix_cache.restore(request.prompt_ids, b)
        except Exception:
            log.exception("admission failed")
            _notify(request.on_finish, "error")
            return None
        self._rows[b] = _Row(request, generator, pos=reused)
        self._finite[b] = max(self._finite[b], reused)
        return b

    def _prefill_chunk(self, b: int, budget: int) -> int:
        """Prefill the next prompt tokens of row b, at most `budget`, in its cache row at its
        own positions; after the last chunk, sample its first token. Returns the tokens."""
        row = self._rows[b]
        if row.request.cancelled.is_set():
            self._finish(b, "cancelled")
            return 0
        prompt = row.request.prompt_ids
        n = min(len(prompt) - row.pos, budget)
        tokens = torch.tensor([prompt[row.pos:row.pos + n]], device=self.device)   # (1, n)
        logits = self.model(tokens, row.pos, last_only=True,
                            cache_rows=slice(b, b + 1))[:, -1]                     # (1, V)
        self.prefills += 1
        self.prefill_tokens += n
        row.pos += n
        self._finite[b] = max(self._finite[b], row.pos)
        if not row.prefilling:
            if self.prefix_cache is not None:
                self.prefix_cache.store(prompt, b)
            self._take(b, logits)
        return n

    # ---- decode ------------------------------------------------------------------------------

    def _take(self, b: int, logits: torch.Tensor) -> None:
        """Sample row b's next token from its logits (1, V) and report or finish."""
        row = self._rows[b]
        request = row.request
        if request.cancelled.is_set():
            self._finish(b, "cancelled")
            return
        try:            # a request's own settings can fail (e.g. a tiny temperature: inf/NaN)
            if request.constraint is not None:           # −inf where the grammar says no
                logits = request.constraint.mask_logits(logits)
            token = sample(logits, request.sampling, row.generator,
                           [request.prompt_ids + row.generated], [row.generated])   # (1,)
        except Exception:
            log.exception("sampling failed")
            self._finish(b, "error")
            return
        self._emit(b, int(token), logits)

    def _emit(self, b: int, token: int, logits: torch.Tensor) -> bool:
        """Report row b's next token, chosen from `logits` (1, V) (its log-probs come from
        them), or finish the row: a stop token, the grammar complete, the length reached.
        Returns whether the row goes on."""
        row = self._rows[b]
        request = row.request
        constraint = request.constraint
        try:
            if token in request.stop_ids:
                self._finish(b, "stop")
                return False
            if constraint is not None:
                constraint.accept(token)
            event = TokenEvent(token)
            if request.logprobs is not None:
                chosen, top_ids, top_lp = token_logprobs(logits, torch.tensor([token]),
                                                         request.logprobs)
                event.logprob = float(chosen[0])
                event.top_logprobs = list(zip(top_ids[0].tolist(), top_lp[0].tolist()))
        except Exception:
            log.exception("sampling failed")
            self._finish(b, "error")
            return False
        row.generated.append(event.token_id)
        row.pending = event.token_id
        if not _notify(request.on_token, event):   # its consumer broke: end it, not the batch
            self._finish(b, "error")
            return False
        if constraint is not None and constraint.finished:        # nothing more may follow
            self._finish(b, "stop" if constraint.error is None else "error")
            return False
        # Like Session: prompt + output never exceed the context.
        if len(row.generated) >= request.max_tokens or \
                len(request.prompt_ids) + len(row.generated) >= self.context:
            self._finish(b, "length")
            return False
        return True

    def _finish(self, b: int, reason: str) -> None:
        row, self._rows[b] = self._rows[b], None
        _notify(row.request.on_finish, reason)

    def _decode_step(self) -> None:
        """One token for every decoding row: rows 0..B-1 (B = last decoding row + 1) at their
        own positions, the others idle (−1)."""
        decoding = self._decoding()
        B = decoding[-1] + 1
        pos = [-1] * B
        tokens = [self.pad_id] * B
        for b in decoding:
            pos[b], tokens[b] = self._rows[b].pos, self._rows[b].pending
        self._make_finite(decoding, max(pos) + 1)
        logits = self.model(torch.tensor(tokens, device=self.device)[:, None],      # (B, 1)
                            torch.tensor(pos, device=self.device),
                            cache_rows=slice(0, B))[:, -1]                           # (B, V)
        self.steps += 1
        for b in decoding:
            row = self._rows[b]
            row.pos += 1
            self._finite[b] = max(self._finite[b], row.pos)
            self._take(b, logits[b:b + 1])

    def _speculates(self, decoding: list[int]) -> bool:
        """Whether this step is a speculative round: a draft is set, one request is decoding
        and it has no grammar (batched steps already share the weights' memory traffic)."""
        return self.speculator is not None and len(decoding) == 1 and \
            self._rows[decoding[0]].request.constraint is None

    def _speculative_step(self, b: int) -> None:
        """One speculative round for row b, the only one decoding (`SpeculativeDecoder.step`
        on its cache row): the drafts the model accepts and one token of its own, each
        reported as a decode step's token would be (the same tokens at temperature 0)."""
        row = self._rows[b]
        request = row.request
        if request.cancelled.is_set():
            self._finish(b, "cancelled")
            return
        context = request.prompt_ids + row.generated       # the last one is fed at row.pos
        left = min(request.max_tokens - len(row.generated), self.context - len(context))
        try:
            step = self.speculator.step(context, request.sampling, row.generator,
                                        row.generated, left, cache_rows=slice(b, b + 1))
        except Exception:
            log.exception("speculative step failed")
            self._finish(b, "error")
            return
        self.steps += 1
        self._finite[b] = max(self._finite[b], row.pos + step.drafted + 1)
        row.pos += step.accepted + 1           # its token and the accepted drafts are cached
        for i, token in enumerate(step.tokens):
            if not self._emit(b, token, step.logits[i:i + 1]):
                break

    def _make_finite(self, rows: list[int], end: int) -> None:
        """Make slots [0, end) of these cache rows finite: a row attends over the first `end`
        slots of the batch, masked past its own position, and torch's attention multiplies
        masked values by 0 (0 · NaN is NaN in slots never written). Zeroed 256 slots ahead,
        so that this costs a call every 256 steps, not every step."""
        for b in rows:
            if self._finite[b] < end:
                stop = min(max(end, self._finite[b] + 256), self.context)
                self.model.caches.zero(slice(b, b + 1), self._finite[b], stop)
                self._finite[b] = stop


def _notify(callback: Callable, value) -> bool:
    """Call a request's callback; its failure is logged, never the engine's. True if it worked."""
    try:
        callback(value)
        return True
    except Exception:
        log.exception("request callback failed")
        return False
