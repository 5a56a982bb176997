"""Continuous batching: many requests share one model and one batched decode step.

The engine owns the model and a KV cache of `max_batch_size` rows, and runs one loop in a
background thread:

    prefill: the next chunk of each long prompt being prefilled, then the requests waiting
             for a free row, admitted together: one left-padded batched prefill per run of
             adjacent rows (a long prompt's first chunk alone)
    one decode step for all decoding rows at once  ─▶ one token for every running request
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

Chunked prefill: a prompt longer than `prefill_chunk` tokens is prefilled in K = ⌈P / chunk⌉
chunks, one per loop iteration, so the running rows get a decode step between two chunks instead
of waiting for the whole prompt. Its row is laid out for the cursor its last chunk will see: the
prompt takes slots [pad, pad + P) with pad + P = cur + K − 1 (K − 1 decode steps to come). Each
chunk writes the next prompt tokens at their slots, but never past `cur`: the decode steps in
between write slot `cur` of every row in the batch, the prefilling row's included (fed padding,
attending only itself, as idle rows are), and that slot is one its later chunks overwrite. With
gap = pad + P − cur (decode steps still to come) a chunk takes min(chunk, remaining − gap)
tokens, so the prompt is complete exactly when gap reaches 0; only then is the row sampled and
fed its tokens. Shifts move its slots and pad with every other row's, so the gap is unchanged.
When no row is decoding, the cursor advances without a forward pass.
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
    generated: list[int] = field(default_factory=list)
    pending: int = 0                  # the sampled token to feed at the next decode step
    prefilled: int = 0                # prompt tokens in the cache so far
    chunk: int = 0                    # prompt tokens per prefill chunk (≤ prefill_chunk)

    @property
    def prefilling(self) -> bool:
        """Still being prefilled: not sampled, not fed its tokens."""
        return self.prefilled < len(self.request.prompt_ids)


class Engine:
    """Continuous-batching generator over one model (see the module docstring).

    Args:
        model: a `Transformer` (eval mode). The engine allocates its KV cache.
        max_batch_size: rows decoded together.
        max_queue: requests that may wait for a row; beyond it `submit` raises QueueFull.
        pad_id: token fed to idle rows (never attended).
        prefill_chunk: prompt tokens prefilled per loop iteration: a longer prompt is
            prefilled in chunks with decode steps in between, and the requests admitted
            together stop at this many prompt tokens (the others wait for the next iteration).

    Raises:
        ArgumentError: a size below 1.
    """

    def __init__(self, model, max_batch_size: int = 8, max_queue: int = 64, pad_id: int = 0,
                 prefill_chunk: int = 512):
        if max_batch_size < 1 or max_queue < 1 or prefill_chunk < 1:
            raise ArgumentError("max_batch_size, max_queue and prefill_chunk must be ≥ 1")
        self.model = model
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        self.context = model.args.max_seq_len
        self.pad_id = pad_id
        self.device = model.device
        self._waiting: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self._held: Optional[Request] = None     # taken from the queue, waits for a budget
        self._rows: list[Optional[_Row]] = [None] * max_batch_size
        self._pad = torch.zeros(max_batch_size, dtype=torch.long, device=self.device)
        self._cur = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.steps = 0                    # decode steps run (for tests and stats)
        self.prefills = 0                 # prefill forward passes run (batches and chunks)

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
                    self._prefill_step()
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
        if self._held is not None:
            _notify(self._held.on_finish, "cancelled")
        while True:                                   # and those still waiting for a row
            try:
                _notify(self._waiting.get_nowait().on_finish, "cancelled")
            except queue.Empty:
                break

    # ---- prefill -----------------------------------------------------------------------------

    def _prefill_step(self) -> None:
        """One iteration's prefill work: the next chunk of each prompt being prefilled, then the
        waiting requests admitted into free rows (see the module docstring)."""
        for b, row in enumerate(self._rows):
            if row is not None and row.prefilling:
                self._guarded(self._prefill_chunk, [b])
        new = self._admit()
        whole = [b for b in new if self._gap(b) == 0]          # the whole prompt now
        for rows in _adjacent_runs(whole):
            self._guarded(self._prefill_batch, rows)
        for b in new:
            if b not in whole:
                self._guarded(self._prefill_chunk, [b])

    def _guarded(self, prefill: Callable[[list[int]], None], rows: list[int]) -> None:
        """Run a prefill of these rows; if it fails, their requests fail, the other rows go on."""
        try:
            prefill(rows)
        except Exception:
            log.exception("prefill failed")
            for b in rows:
                if self._rows[b] is not None:
                    self._finish(b, "error")

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

    def _admit(self) -> list[int]:
        """Give free rows (lowest first) to waiting requests and lay out their slots.

        The requests admitted in one call bring at most `prefill_chunk` prompt tokens in all (a
        long prompt counts its first chunk; the first request always fits); the next one is
        held for the next call. Every row is shifted right first if a new prompt needs more
        slots before its end than `cur` leaves; a prompt whose shift would push the end of a
        prompt being prefilled past the context waits for it. Nothing is written into the new
        rows yet.

        Returns:
            the new rows, in increasing order.
        """
        new: list[int] = []
        budget = self.prefill_chunk
        reach = max((self._gap(b) for b, row in enumerate(self._rows)
                     if row is not None and row.prefilling), default=0)   # slots after cur
        for b in range(self.max_batch_size):
            if self._rows[b] is not None:
                continue
            request = self._next_request()
            if request is None:
                break
            P = len(request.prompt_ids)
            cost = min(P, self.prefill_chunk)
            K = -(-P // self.prefill_chunk)
            if (new and cost > budget) or max(P - (K - 1), self._cur) + reach > self.context:
                self._held = request
                break
            try:
                generator = request.sampling.make_generator(self.device)
            except Exception:
                log.exception("admission failed")
                _notify(request.on_finish, "error")
                continue
            budget -= cost
            self._rows[b] = _Row(request, generator)
            new.append(b)
        if not new:
            return new
        chunks = {b: -(-len(self._rows[b].request.prompt_ids) // self.prefill_chunk)
                  for b in new}                                 # K chunks per prompt
        # The prompt ends where `cur` will be after its K − 1 decode steps: slots before its
        # start must exist.
        need = max(len(self._rows[b].request.prompt_ids) - (chunks[b] - 1) for b in new)
        if need > self._cur:
            self._shift(need - self._cur)
        for b in new:
            row = self._rows[b]
            P = len(row.request.prompt_ids)
            gap = min(chunks[b] - 1, self.context - self._cur)  # decode steps before its end
            row.chunk = -(-P // (gap + 1))                      # ≤ prefill_chunk
            start = self._cur + gap - P
            self._pad[b] = start
            # The padding slots are masked out, but attention still multiplies their values by
            # a zero weight: they must be finite, and this row's may never have been written.
            self.model.zero_cache_slots(slice(b, b + 1), 0, start)
        return new

    def _gap(self, b: int) -> int:
        """Decode steps until row b's prompt ends at `cur` (0: it ends there now)."""
        return int(self._pad[b]) + len(self._rows[b].request.prompt_ids) - self._cur

    def _prefill_batch(self, rows: list[int]) -> None:
        """Prefill the whole prompts of adjacent new rows in one left-padded forward pass (each
        ends at slot cur), and sample their first tokens."""
        b0, b1 = rows[0], rows[-1] + 1
        prompts = [self._rows[b].request.prompt_ids for b in rows]
        T = max(len(p) for p in prompts)
        tokens = torch.tensor([[self.pad_id] * (T - len(p)) + p for p in prompts],
                              device=self.device)                      # (b1 − b0, T)
        logits = self.model(tokens, self._cur - T, last_only=True, pad=self._pad[b0:b1],
                            cache_rows=slice(b0, b1))[:, -1]           # (b1 − b0, V)
        self.prefills += 1
        for i, b in enumerate(rows):
            self._rows[b].prefilled = len(prompts[i])
            self._take(b, logits[i:i + 1])

    def _prefill_chunk(self, rows: list[int]) -> None:
        """Prefill the next chunk of row b's prompt (rows = [b]): as many tokens as fit before
        `cur`, at most row.chunk; the last chunk ends at cur and samples the first token."""
        (b,) = rows
        row = self._rows[b]
        if row.request.cancelled.is_set():
            self._finish(b, "cancelled")
            return
        prompt = row.request.prompt_ids
        n = min(row.chunk, len(prompt) - row.prefilled - self._gap(b))
        if n <= 0:                  # a decode step was skipped: the slots are not there yet
            return
        start_pos = int(self._pad[b]) + row.prefilled
        tokens = torch.tensor([prompt[row.prefilled:row.prefilled + n]],
                              device=self.device)                      # (1, n)
        logits = self.model(tokens, start_pos, last_only=True, pad=self._pad[b:b + 1],
                            cache_rows=slice(b, b + 1))[:, -1]         # (1, V)
        self.prefills += 1
        row.prefilled += n
        if not row.prefilling:
            self._take(b, logits)

    # ---- decode ------------------------------------------------------------------------------

    def _shift(self, d: int) -> None:
        """Move every row's cached slots by d (right if d > 0, left if d < 0); slots uncovered
        by a right shift are zeroed, so the new padding is finite (see _admit)."""
        self.model.shift_caches(d, self._cur)
        self._pad += d
        self._cur += d

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
            held = [b for b, row in enumerate(self._rows) if row is not None]
            d = int(self._pad[held].min())
            if d == 0:                              # these rows used the whole context
                for b in held:
                    if int(self._pad[b]) == 0:
                        self._finish(b, "length")
                return
            self._shift(-d)
        decoding = [b for b, row in enumerate(self._rows)
                    if row is not None and not row.prefilling]
        if not decoding:           # only rows mid-prefill: move on as a decode step would
            self._cur += 1
            return
        # Rows are filled lowest first, so the decoding ones sit in rows 0..B-1: decode just
        # those (B = last decoding row + 1). Idle and prefilling rows among them are fed padding
        # and attend only their own new slot (finite; a prefilling row's later chunks overwrite
        # it).
        B = decoding[-1] + 1
        live = [row is not None and not row.prefilling for row in self._rows[:B]]
        tokens = torch.tensor([[row.pending if ok else self.pad_id]
                               for row, ok in zip(self._rows[:B], live)],
                              device=self.device)                                # (B, 1)
        pad = torch.where(torch.tensor(live, device=self.device), self._pad[:B],
                          self._cur)                                             # (B,)
        logits = self.model(tokens, self._cur, pad=pad)[:, -1]                   # (B, V)
        self._cur += 1
        self.steps += 1
        for b in decoding:
            self._take(b, logits[b:b + 1])


def _adjacent_runs(rows: list[int]) -> list[list[int]]:
    """Split increasing row indices into runs of adjacent ones: [0, 1, 3] → [[0, 1], [3]]."""
    runs: list[list[int]] = []
    for b in rows:
        if runs and runs[-1][-1] == b - 1:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


def _notify(callback: Callable, value) -> bool:
    """Call a request's callback; its failure is logged, never the engine's. True if it worked."""
    try:
        callback(value)
        return True
    except Exception:
        log.exception("request callback failed")
        return False
