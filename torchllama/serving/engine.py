"""Continuous batching: many requests share one model and one batched decode step.

The engine owns the model and a KV cache of `max_batch_size` rows, and runs one loop in a
background thread (or, offline, in its caller's: `torchllama.serving.batch`):

    prefill: the next chunk of each prompt being prefilled, then waiting requests admitted
             into free rows, up to `prefill_chunk` prompt tokens in all per iteration
    one decode step for all decoding rows at once  ─▶ one token for every running request
    retire finished or cancelled requests           ─▶ their rows are free for the next ones

A request joins at the next decode step and leaves as soon as it is done, so concurrent requests
share the weights' memory traffic (decode is bound by it) and total throughput grows with the
number of requests. The loop ties four roles together (vLLM v1's shape, small):

    scheduler   who runs: the waiting queue, the rows, each iteration's prefill budget
    cache_rows  where their keys live: a cache row per request from slot 0, the prefix cache
    runner      one model forward (a prefill chunk, a batched decode step, a speculative
                round) and the sampling of its logits
    output      sampled tokens → token events (log-probs, text), stop strings, finished rows

Each row is at its own position: the decode step gives the model one position per row
(`Transformer.forward` with a (B,) start_pos; −1 for rows not decoding), and every row attends
to its own slots only, so a request computes what it would alone, whatever else runs (the same
bits with torchllama's kernels).

Speculative decoding (`Engine(draft=...)`, `torchllama serve --draft`): while exactly one request
is decoding, each step is a speculative round for it (`torchllama.generation.speculative`): the
drafter proposes up to k tokens and the model checks them in one forward pass over its cache
row, the row's position moving past the accepted ones only (the rejected drafts' slots are
written over later). With two or more requests decoding, steps are plain batched decode steps:
batching already shares each step's weight traffic between the requests, which is what
speculation buys a lone request. Either way a request gets its exact output distribution (the
same tokens at temperature 0). Requests with a grammar decode plainly.

Scoring a prompt (`Request.prompt_logprobs`, what lm-evaluation-harness's loglikelihood asks
through /v1/completions' echo): its chunks are prefilled with every position's logits, and
each position's log-softmax gives the next prompt token's log-probability (and the most likely
alternatives) in `Request.prompt_scores`; such a prompt is prefilled whole (a prefix taken from
the cache would have no logits), and with max_tokens 0 it ends when its prefill does.

Prefix cache (`torchllama.serving.prefix_cache`): when a prompt's prefill completes and when its
request ends, its row's keys and values are kept by blocks of tokens (within a memory budget,
least recently used first out); a later prompt that starts with the same tokens gets those
blocks put in its row and is prefilled from where they end — the same bits as prefilling it
whole, since a token's keys and values are the same bits from a prefill chunk or a decode step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import threading
from typing import Any, Callable, Optional

import torch

from torchllama.errors import ArgumentError, ContextLengthError, TorchLlamaError
from torchllama.generation.sampling import token_logprobs
from torchllama.generation.speculative import DEFAULT_DRAFT_TOKENS, SpeculativeDecoder
from torchllama.nn.kv_cache import check_kv_cache_dtype
from torchllama.serving.cache_rows import CacheRows
from torchllama.serving.output import OutputProcessor
from torchllama.serving.request import QueueFull, Request, TokenEvent, _Row, notify
from torchllama.serving.runner import ModelRunner
from torchllama.serving.scheduler import Scheduler

__all__ = ["Engine", "Request", "TokenEvent", "QueueFull", "EngineStopped"]


class EngineStopped(TorchLlamaError):
    """The engine takes no more requests: shut down, or failed (HTTP 503)."""


def check_finite(logits: torch.Tensor, n: int) -> None:
    """Refuse logits (1, V) with a NaN or +inf: sampling from them would pick garbage. One
    reduction: their sum is NaN or +inf exactly when one is (logits are far too small for a
    finite sum to overflow; a −inf alone gives −inf, which is allowed).

    Raises:
        FloatingPointError: naming the token index n.
    """
    total = float(logits.sum())
    if math.isnan(total) or total == math.inf:
        raise FloatingPointError(f"the model's logits for token {n} are not finite (NaN or "
                                 "+inf): the weights or an adapter hold non-finite values")

log = logging.getLogger("torchllama.serving.engine")


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
        draft: a `torchllama.generation.speculative.Drafter`: when one request is decoding alone
            (and has no grammar), its steps are speculative rounds; with several decoding, plain
            batched steps (see the module docstring). None: never speculative.
        draft_tokens: the most tokens drafted per round (adapted to the acceptance).
        max_seq_len: cache slots per row: a request's prompt and output together (default and
            at most: the model's context, `model.args.max_seq_len`).
        kv_cache_dtype: what the cache stores: auto, float32, float16, bfloat16 or q8_0
            (`torchllama.nn.kv_cache`; default: the model's `kv_cache_dtype`).

    Raises:
        ArgumentError: a size below 1 (below 0 for the prefix cache); a draft model whose
            vocabulary size differs from the model's; an unknown kv_cache_dtype.
    """

    def __init__(self, model, max_batch_size: int = 8, max_queue: int = 64, pad_id: int = 0,
                 prefill_chunk: int = 512, prefix_cache_bytes: int = 0, draft=None,
                 draft_tokens: int = DEFAULT_DRAFT_TOKENS, max_seq_len: Optional[int] = None,
                 kv_cache_dtype: Optional[str] = None):
        if kv_cache_dtype is not None:
            check_kv_cache_dtype(kv_cache_dtype)
        if max_batch_size < 1 or max_queue < 1 or prefill_chunk < 1 or prefix_cache_bytes < 0:
            raise ArgumentError("max_batch_size, max_queue and prefill_chunk must be ≥ 1 and "
                                "prefix_cache_bytes ≥ 0")
        speculator = SpeculativeDecoder(model, draft, draft_tokens) \
            if draft is not None else None
        self.model = model
        self.max_batch_size = max_batch_size
        self.context = min(max_seq_len or model.args.max_seq_len, model.args.max_seq_len)
        self.device = model.device
        self.scheduler = Scheduler(max_batch_size, max_queue, prefill_chunk)
        self.cache = CacheRows(model, max_batch_size, self.context, prefix_cache_bytes,
                               kv_cache_dtype)
        self.runner = ModelRunner(model, pad_id, speculator)
        self.output = OutputProcessor(self.scheduler, self.context, self._released)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._calls: collections.deque = collections.deque()   # (fn, Future) for the thread
        #: why the engine thread stopped, if it failed (`_run`); None while it works
        self.failed: Optional[str] = None
        #: called (engine thread) with `failed` when the engine fails
        self.on_failure: Optional[Callable[[str], None]] = None
        #: test-only fault injection: called as fault(request, n) before a request's token n
        #: is sampled, in that row's guarded work (an exception fails that request only)
        self.fault: Optional[Callable[[Request, int], None]] = None

    def _released(self, b: int, row: _Row) -> None:
        """Row b's request ended: what its cache row holds (slots 0..pos-1: the prompt and the
        generated tokens fed so far) is offered to the prefix cache."""
        self.cache.finished(b, (row.request.prompt_ids + row.generated)[:row.pos],
                            row.request.salt)

    def _adapter_id(self, request: Request) -> int:
        """The id of the request's LoRA adapter (−1: the base model).

        Raises:
            TorchLlamaError: the adapter is not loaded.
        """
        if request.adapter is None:
            return -1
        ids = getattr(getattr(self.model, "adapter_set", None), "ids", {})
        if request.adapter not in ids:
            raise TorchLlamaError(f"no LoRA adapter {request.adapter!r} is loaded")
        return ids[request.adapter]

    # ---- public ------------------------------------------------------------------------------

    def allocate(self) -> "Engine":
        """Allocate the KV cache: `max_batch_size` rows of `context` slots (`start` does it;
        a caller that drives `step` itself calls it first)."""
        self.cache.allocate()
        return self

    def start(self) -> "Engine":
        """Allocate the cache and start the engine thread."""
        self.allocate()
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
            raise EngineStopped("the engine has been shut down" if self.failed is None else
                                f"the engine failed ({self.failed})")
        if not request.prompt_ids:
            raise ArgumentError("the prompt is empty (no tokens)")
        if request.max_tokens < (0 if request.prompt_logprobs is not None else 1):
            raise ArgumentError(f"max_tokens must be ≥ 1 (≥ 0 scoring the prompt), got "
                                f"{request.max_tokens}")
        if len(request.prompt_ids) >= self.context:
            raise ContextLengthError(
                f"the prompt has {len(request.prompt_ids)} tokens but the context holds "
                f"{self.context}; shorten it to at most {self.context - 1} tokens")
        self.scheduler.add(request)
        self._wake.set()
        return request

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn()` in the engine thread (`start`) between two steps, with the model's KV
        caches taken off (a forward of its own sees no cache and leaves the rows' caches
        untouched), and return the Future of its result (or exception). The server's
        /v1/embeddings runs its forwards so: the model is never used by two threads at once."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stop.is_set():
            future.set_exception(TorchLlamaError("the engine has been shut down"))
            return future
        self._calls.append((fn, future))
        self._wake.set()
        return future

    def _run_calls(self) -> None:
        """Run the queued `call`s (the caches off while they run)."""
        while self._calls:
            fn, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            caches = self.model.caches
            self.model.use_caches(None)
            try:
                future.set_result(fn())
            except Exception as e:                    # noqa: BLE001 - the caller's to see
                future.set_exception(e)
            finally:
                self.model.use_caches(caches)

    @property
    def active(self) -> int:
        """Requests holding a row now."""
        return self.scheduler.active

    @property
    def waiting(self) -> int:
        """Requests waiting for a row."""
        return self.scheduler.waiting

    @property
    def prefix_cache(self):
        """The `PrefixCache`, or None."""
        return self.cache.prefix_cache

    @property
    def speculator(self) -> Optional[SpeculativeDecoder]:
        """The `SpeculativeDecoder` of a draft, or None."""
        return self.runner.speculator

    @property
    def steps(self) -> int:
        """Decode steps (and speculative rounds) run."""
        return self.runner.steps

    @property
    def prefills(self) -> int:
        """Prefill forward passes run (chunks)."""
        return self.runner.prefills

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens prefilled (not taken from the prefix cache)."""
        return self.runner.prefill_tokens

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> bool:
        """One iteration of the engine loop (in inference mode, with the caches allocated):
        prefill work, then a decode step or speculative round for the decoding rows. An
        exception fails the requests running, never the engine. Returns False when there was
        nothing to do (no request holds a row)."""
        try:
            self._prefill_step()
            decoding = self.scheduler.decoding()
            if not decoding:
                return self.active > 0
            if self.scheduler.speculates(decoding, self.speculator is not None):
                self._speculative_step(decoding[0])
            else:
                self._decode_step(decoding)
        except Exception as e:                        # never let the thread die: fail
            for b in self.scheduler.running():        # what was running, go on
                self.output.fail(b, "an engine step", e)
        return True

    def _run(self) -> None:
        """The engine thread: steps until `shutdown`. Should anything escape `step` (a
        BaseException, a bug outside a request's guarded work), the engine is failed: every
        request ends in error, `failed` says why and `on_failure` is told (the server then
        reports 503 on /health and exits non-zero), never a thread that died silently."""
        reason = "cancelled"
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    self._run_calls()
                    if not self.step() and not self._calls:
                        self._wake.wait(timeout=0.1)
                        self._wake.clear()
        except BaseException as e:                    # noqa: BLE001 - reported, then ended
            self.failed = f"{type(e).__name__}: {e}"
            log.critical("the engine thread failed: %s", self.failed, exc_info=e)
            self._stop.set()
            reason = "error"
            if self.on_failure is not None:
                self.on_failure(self.failed)
        self._end_all(reason)

    def _end_all(self, reason: str) -> None:
        """End every request (running, waiting) and queued call: the engine stops."""
        for b in self.scheduler.running():
            if reason == "error":
                self.scheduler.rows[b].request.error = f"the engine failed ({self.failed})"
            self.output.finish(b, reason)
        for request in self.scheduler.drain():        # and those still waiting for a row
            if reason == "error":
                request.error = f"the engine failed ({self.failed})"
            notify(request.on_finish, reason)
        while self._calls:
            self._calls.popleft()[1].set_exception(TorchLlamaError("the engine shut down"))

    def abort_all(self, cause: str) -> int:
        """End every running and waiting request in error (503, `cause`), e.g. at shutdown
        once the drain timeout has passed (any thread). Returns how many."""
        requests = [row.request for row in list(self.scheduler.rows) if row is not None]
        requests += self.scheduler.queued()
        for request in requests:
            request.abort(cause)
        self._wake.set()
        return len(requests)

    # ---- prefill -----------------------------------------------------------------------------

    def _prefill_step(self) -> None:
        """One iteration's prefill work, at most `prefill_chunk` prompt tokens: the next chunks
        of the prompts being prefilled (oldest row first), then new requests in free rows."""
        scheduler = self.scheduler
        scheduler.new_iteration()
        for b in scheduler.continuing():
            scheduler.spend(self._guarded(b))
        for request in scheduler.admissions():
            b = self._admit(request)
            if b is not None:
                scheduler.spend(self._guarded(b))

    def _guarded(self, b: int) -> int:
        """Prefill the next chunk of row b; if it fails, its request fails and the other rows
        go on. Returns the tokens prefilled."""
        try:
            return self._prefill_chunk(b)
        except Exception as e:
            if self.scheduler.rows[b] is not None:
                self.output.fail(b, "prefill", e)
            return 0

    def _admit(self, request: Request) -> Optional[int]:
        """Give the lowest free row to a request, its prompt's cached prefix (if any) put in
        it. Returns the row, or None if the request failed here."""
        b = self.scheduler.free_row()
        try:
            generator = request.sampling.make_generator(self.device)
            self._adapter_id(request)
            reused = self.cache.claim(b, request.prompt_ids, request.salt,
                                      reuse=request.prompt_logprobs is None)
        except Exception as e:
            log.error("request %s failed at admission: %s: %s", request.id or "?",
                      type(e).__name__, e, exc_info=e)
            request.failed(e)
            notify(request.on_finish, "error")
            return None
        request.cached_tokens = reused
        self.scheduler.place(b, _Row(request, generator, pos=reused))
        return b

    def _prefill_chunk(self, b: int) -> int:
        """Prefill the next prompt tokens of row b (`Scheduler.chunk`) in its cache row at its
        own positions; after the last chunk, sample its first token. Returns the tokens."""
        row = self.scheduler.rows[b]
        if row.request.cancelled.is_set():
            self.output.finish(b, "cancelled")
            return 0
        request = row.request
        tokens = self.scheduler.chunk(b)
        scoring = request.prompt_logprobs is not None
        logits = self.runner.prefill(b, tokens, row.pos, self._adapter_id(request),
                                     every=scoring)                    # (1, V) or (n, V)
        if scoring:
            self._score_prompt(request, row.pos, logits)
            logits = logits[-1:]                                                 # (1, V)
        row.pos += len(tokens)
        self.cache.written(b, row.pos)
        if not row.prefilling:
            self.cache.prefilled(b, request.prompt_ids, request.salt)
            if request.max_tokens == 0:                   # scored, nothing to generate
                self.output.finish(b, "length")
            else:
                self._take(b, logits)
        return len(tokens)

    @staticmethod
    def _score_prompt(request: Request, pos: int, logits: torch.Tensor) -> None:
        """Append to `request.prompt_scores` the log-probabilities of the prompt tokens that
        the logits (n, V) of its positions pos..pos+n-1 predict (positions pos+1..), with the
        `prompt_logprobs` most likely alternatives each."""
        targets = request.prompt_ids[pos + 1:pos + 1 + len(logits)]      # the next tokens
        if not targets:
            return
        chosen, top_ids, top_lp = token_logprobs(logits[:len(targets)], torch.tensor(targets),
                                                 request.prompt_logprobs)
        request.prompt_scores += [(lp, list(zip(ids, lps))) for lp, ids, lps in
                                  zip(chosen.tolist(), top_ids.tolist(), top_lp.tolist())]

    # ---- decode ------------------------------------------------------------------------------

    def _take(self, b: int, logits: torch.Tensor) -> None:
        """Sample row b's next token from its logits (1, V) and report it or finish."""
        row = self.scheduler.rows[b]
        if row.request.cancelled.is_set():
            self.output.finish(b, "cancelled")
            return
        try:
            if self.fault is not None:
                self.fault(row.request, len(row.generated))
            check_finite(logits, len(row.generated))
            token, logits = self.runner.sample(row, logits)
        except Exception as e:
            self.output.fail(b, "sampling", e)
            return
        self.output.emit(b, token, logits)

    def _decode_step(self, decoding: list[int]) -> None:
        """One token for every decoding row: rows 0..B-1 (B = last decoding row + 1) at their
        own positions, the others idle (−1)."""
        B = decoding[-1] + 1
        pos, adapters = [-1] * B, [-1] * B
        tokens = [self.runner.pad_id] * B
        for b in decoding:
            row = self.scheduler.rows[b]
            pos[b], tokens[b] = row.pos, row.pending
            adapters[b] = self._adapter_id(row.request)
        self.cache.make_finite(decoding, max(pos) + 1)
        logits = self.runner.decode(tokens, pos, adapters)                       # (B, V)
        for b in decoding:
            row = self.scheduler.rows[b]
            row.pos += 1
            self.cache.written(b, row.pos)
            self._take(b, logits[b:b + 1])

    def _speculative_step(self, b: int) -> None:
        """One speculative round for row b, the only one decoding: the drafts the model
        accepts and one token of its own, each reported as a decode step's token would be
        (the same tokens at temperature 0)."""
        row = self.scheduler.rows[b]
        request = row.request
        if request.cancelled.is_set():
            self.output.finish(b, "cancelled")
            return
        left = min(request.max_tokens - len(row.generated),
                   self.context - len(request.prompt_ids) - len(row.generated))
        try:
            step = self.runner.speculate(b, row, left, self._adapter_id(request))
        except Exception as e:
            self.output.fail(b, "a speculative round", e)
            return
        self.cache.written(b, row.pos + step.drafted + 1)
        row.pos += step.accepted + 1           # its token and the accepted drafts are cached
        for i, token in enumerate(step.tokens):
            if not self.output.emit(b, token, step.logits[i:i + 1]):
                break
