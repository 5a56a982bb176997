"""Who runs: the waiting queue, the rows requests hold, each iteration's prefill budget.

    submit ─▶ waiting queue (at most max_queue; beyond: QueueFull)
    each iteration:  prefill budget = prefill_chunk prompt tokens
        1. the next chunk of each prompt being prefilled, oldest row first
        2. while budget is left and a row is free: the oldest waiting request is admitted
           (cancelled ones are answered and skipped) and its first chunk prefilled
        3. the decoding rows (prefill complete): one batched decode step, or a speculative
           round when one request decodes alone (`speculates`)

The scheduler decides only; the engine (`torchllama.serving.engine`) runs what it decides and
reports back (`spend`, `place`, `release`).
"""

from __future__ import annotations

import queue
from typing import Iterator, Optional

from torchllama.serving.request import QueueFull, Request, _Row, notify


class Scheduler:
    """The queue and the rows of one engine (see the module docstring).

    Args:
        max_batch_size: rows, i.e. requests running together.
        max_queue: requests that may wait for a row.
        prefill_chunk: prompt tokens prefilled per iteration, in all.

    Attributes:
        rows: per cache row, the request holding it (`_Row`) or None.
        budget: prompt tokens this iteration may still prefill.
    """

    def __init__(self, max_batch_size: int, max_queue: int, prefill_chunk: int):
        self.rows: list[Optional[_Row]] = [None] * max_batch_size
        self.prefill_chunk = prefill_chunk
        self.budget = prefill_chunk
        self._waiting: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self._held: Optional[Request] = None     # taken from the queue, waits for a budget

    # ---- the queue ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request (any thread).

        Raises:
            QueueFull: max_queue requests are waiting already.
        """
        try:
            self._waiting.put_nowait(request)
        except queue.Full:
            raise QueueFull(f"too many requests waiting ({self._waiting.maxsize}); "
                            "try again later") from None

    @property
    def waiting(self) -> int:
        """Requests waiting for a row."""
        return self._waiting.qsize() + (self._held is not None)

    def next_request(self) -> Optional[Request]:
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
            notify(request.on_finish, "cancelled")

    def queued(self) -> list[Request]:
        """The requests waiting now (a snapshot; they stay queued)."""
        with self._waiting.mutex:
            held = [self._held] if self._held is not None else []
            return held + list(self._waiting.queue)

    def drain(self) -> Iterator[Request]:
        """Every request still waiting, taken off the queue (at shutdown)."""
        if self._held is not None:
            request, self._held = self._held, None
            yield request
        while True:
            try:
                yield self._waiting.get_nowait()
            except queue.Empty:
                return

    # ---- the rows ----------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Requests holding a row now."""
        return sum(row is not None for row in self.rows)

    def running(self) -> list[int]:
        """The rows held by a request."""
        return [b for b, row in enumerate(self.rows) if row is not None]

    def prefilling(self) -> list[int]:
        """The rows whose prompt is still being prefilled, in row order."""
        return [b for b, row in enumerate(self.rows) if row is not None and row.prefilling]

    def decoding(self) -> list[int]:
        """The rows whose prompt is prefilled: each decodes a token this iteration."""
        return [b for b, row in enumerate(self.rows) if row is not None and not row.prefilling]

    def free_row(self) -> int:
        """The lowest free row (there must be one: see `admissions`)."""
        return self.rows.index(None)

    def place(self, b: int, row: _Row) -> None:
        """Row b now holds this request."""
        self.rows[b] = row

    def release(self, b: int) -> _Row:
        """Row b is free again; returns what held it."""
        row, self.rows[b] = self.rows[b], None
        return row

    # ---- one iteration's prefill budget ------------------------------------------------------

    def new_iteration(self) -> None:
        """Start an iteration: `prefill_chunk` prompt tokens to spend."""
        self.budget = self.prefill_chunk

    def spend(self, tokens: int) -> None:
        """The engine prefilled this many prompt tokens."""
        self.budget -= tokens

    def chunk(self, b: int) -> list[int]:
        """The prompt tokens row b prefills next: from its position, at most the budget."""
        row = self.rows[b]
        prompt = row.request.prompt_ids
        return prompt[row.pos:row.pos + min(len(prompt) - row.pos, self.budget)]

    def continuing(self) -> Iterator[int]:
        """The rows being prefilled whose next chunk fits this iteration, oldest row first."""
        for b in self.prefilling():
            if self.budget > 0 and self.rows[b] is not None:
                yield b

    def admissions(self) -> Iterator[Request]:
        """Waiting requests to admit now, oldest first: while budget is left and a row free."""
        while self.budget > 0 and None in self.rows:
            request = self.next_request()
            if request is None:
                return
            yield request

    def speculates(self, decoding: list[int], has_draft: bool) -> bool:
        """Whether this step is a speculative round: a draft is set, one request is decoding
        and it has no grammar (batched steps already share the weights' memory traffic)."""
        return has_draft and len(decoding) == 1 and \
            self.rows[decoding[0]].request.constraint is None
