"""What a request sees of its tokens: token events (log-probs, text) and the end of a request.

    sampled token ─▶ a stop id?                     ─▶ finish "stop" (the token not reported)
                  ─▶ grammar accepts it, log-probs, TextStream delta ─▶ TokenEvent ─▶ on_token
                  ─▶ a stop string completed?       ─▶ finish "stop" (text before it only)
                  ─▶ grammar complete?              ─▶ finish "stop" ("error" if it failed)
                  ─▶ max_tokens or context reached? ─▶ finish "length"

A request ends in the step that decides it, and its row is free for the next request at once.
At the end, the text its TextStream still held back is put in `Request.tail` before
`on_finish` is called.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from torchllama.generation.sampling import token_logprobs
from torchllama.serving.request import TokenEvent, _Row, notify
from torchllama.serving.scheduler import Scheduler

log = logging.getLogger("torchllama.serving.engine")


class GrammarStuck(RuntimeError):
    """A request's grammar cannot go on with this model's vocabulary (e.g. a character whose
    UTF-8 bytes no token spells): the request's own constraint, a 400."""

    @classmethod
    def of(cls, report: str) -> "GrammarStuck":
        """From llguidance's error report (many lines of parser state): its error line."""
        lines = report.splitlines() or [""]
        line = next((line for line in lines if line.startswith("Error:")), lines[0])[:300]
        return cls(f"the output cannot follow the request's grammar with this model's "
                   f"vocabulary: {line}")


class OutputProcessor:
    """Turns the rows' sampled tokens into their requests' events, and finishes requests.

    Args:
        scheduler: whose rows these are (a finished request's row is released there).
        context: cache slots per row: prompt + output never exceed it (as with `Session`).
    """

    def __init__(self, scheduler: Scheduler, context: int,
                 on_release: Optional[Callable[[int, _Row], None]] = None):
        self.scheduler, self.context = scheduler, context
        self.on_release = on_release         # (row b, what held it) when a request ends

    def emit(self, b: int, token: int, logits: torch.Tensor) -> bool:
        """Report row b's next token, chosen from `logits` (1, V) (its log-probs come from
        them), or finish the row: a stop token, a stop string, the grammar complete, the length
        reached. Returns whether the row goes on."""
        row = self.scheduler.rows[b]
        request = row.request
        constraint = request.constraint
        try:
            if token in request.stop_ids:
                self.finish(b, "stop")
                return False
            if constraint is not None:
                constraint.accept(token)
            event = self.event(request, token, logits)
        except Exception as e:
            self.fail(b, "sampling", e)
            return False
        row.generated.append(event.token_id)
        row.pending = event.token_id
        if not notify(request.on_token, event):   # its consumer broke: end it, not the batch
            self.fail(b, "reporting a token", RuntimeError("the request's consumer failed"))
            return False
        if event.stopped:                         # a stop string: its text ends here
            self.finish(b, "stop")
            return False
        if constraint is not None and constraint.finished:        # nothing more may follow
            if constraint.error is None:
                self.finish(b, "stop")
            else:
                self.fail(b, "the grammar", GrammarStuck.of(constraint.error), status=400)
            return False
        # Like Session: prompt + output never exceed the context.
        if len(row.generated) >= request.max_tokens or \
                len(request.prompt_ids) + len(row.generated) >= self.context:
            self.finish(b, "length")
            return False
        return True

    @staticmethod
    def event(request, token: int, logits: torch.Tensor) -> TokenEvent:
        """The TokenEvent of a request's token: its log-probs if asked (from `logits` (1, V)),
        its text delta and whether it completed a stop string (the request's TextStream)."""
        event = TokenEvent(token)
        if request.logprobs is not None:
            chosen, top_ids, top_lp = token_logprobs(logits, torch.tensor([token]),
                                                     request.logprobs)
            event.logprob = float(chosen[0])
            event.top_logprobs = list(zip(top_ids[0].tolist(), top_lp[0].tolist()))
        if request.text is not None:
            event.text = request.text.push(token)
            event.stopped = request.text.stopped
        return event

    def fail(self, b: int, stage: str, error: BaseException, status: int = 500) -> None:
        """End row b's request in error: `error` is its cause (`Request.error`, with the HTTP
        `status` it deserves: 400 when the request itself cannot be met), logged with the
        request's id; the other rows go on."""
        request = self.scheduler.rows[b].request
        log.error("request %s failed in %s: %s: %s", request.id or "?", stage,
                  type(error).__name__, error, exc_info=error if status >= 500 else None)
        request.failed(error)
        request.error_status = status
        self.finish(b, "error")

    def finish(self, b: int, reason: str) -> None:
        """End row b's request with this finish reason; its row is free at once."""
        row = self.scheduler.release(b)
        request = row.request
        if self.on_release is not None and reason != "error":
            try:
                self.on_release(b, row)
            except Exception:
                log.exception("releasing the row failed")
        if request.text is not None and reason != "error":
            try:
                request.tail = request.text.flush()
            except Exception:
                log.exception("detokenizing failed")
                reason = "error"
        notify(request.on_finish, reason)
