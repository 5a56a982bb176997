"""Reasoning output: a thinking model's `<think>…</think>` kept apart from its answer.

Qwen3 (and DeepSeek-R1's distills, QwQ) write their reasoning first, between `<think>` and
`</think>`, then the answer. The server returns the reasoning as `reasoning_content` (the field
vLLM, SGLang, llama.cpp and DeepSeek's API use) and the rest as `content`, in a whole answer and
in a stream's deltas. Some templates open the `<think>` themselves at the end of the prompt (the
model's output then starts inside the reasoning: `ReasoningParser(inside=True)`); a model may
also skip it (with Qwen3's `enable_thinking: false` the template writes an empty pair).

`ReasoningParser` reads the text piece by piece, the same way for a stream and a whole answer
(so the two are equal by construction), holding back only what may still be a tag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_thinks(chat_template: Optional[str]) -> bool:
    """Whether a chat template is a thinking model's (it writes `<think>` and `</think>`)."""
    return bool(chat_template) and THINK_OPEN in chat_template and THINK_CLOSE in chat_template


def _partial(buf: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that `buf` ends with."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningParser:
    """Splits text fed piece by piece into ("reasoning", text) and ("content", text) events.

    Args:
        inside: the prompt opened `<think>` already (the output starts in the reasoning).

    Attributes:
        reasoning, content: all of each so far (the whitespace between `</think>` and the
            answer dropped).
    """

    inside: bool = False
    reasoning: str = ""
    content: str = ""
    _buffer: str = ""
    _state: str = ""                 # start | thinking | answer_start | answer

    def __post_init__(self) -> None:
        self._state = self._state or ("thinking" if self.inside else "start")

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Events of the next piece of text (what is decided so far; see the class)."""
        self._buffer += text
        events: list[tuple[str, str]] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[tuple[str, str]]:
        """The text held back: reasoning cut short stays reasoning; the rest is content."""
        events: list[tuple[str, str]] = []
        kind = "reasoning" if self._state == "thinking" else "content"
        if self._state != "answer_start":
            self._emit(events, kind, self._buffer)
        self._buffer = ""
        return events

    def _step(self, events: list) -> bool:
        buf = self._buffer
        if self._state == "start":                    # does the answer open <think>?
            head = buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._buffer, self._state = head[len(THINK_OPEN):], "thinking"
                return True
            if THINK_OPEN.startswith(head):
                return False
            self._state = "answer"
            return True
        if self._state == "thinking":
            at = buf.find(THINK_CLOSE)
            if at >= 0:
                self._emit(events, "reasoning", buf[:at])
                self._buffer, self._state = buf[at + len(THINK_CLOSE):], "answer_start"
                return True
            keep = len(buf) - _partial(buf, THINK_CLOSE)
            self._emit(events, "reasoning", buf[:keep])
            self._buffer = buf[keep:]
            return False
        if self._state == "answer_start":             # the blank lines after </think>
            if not buf.strip():
                return False
            self._buffer, self._state = buf.lstrip(), "answer"
            return True
        self._emit(events, "content", buf)
        self._buffer = ""
        return False

    def _emit(self, events: list, kind: str, text: str) -> None:
        if text:
            setattr(self, kind, getattr(self, kind) + text)
            events.append((kind, text))


def split_reasoning(text: str, inside: bool = False) -> tuple[Optional[str], str]:
    """(reasoning or None, content) of a whole answer, as `ReasoningParser` splits it."""
    parser = ReasoningParser(inside)
    parser.feed(text)
    parser.finish()
    return parser.reasoning or None, parser.content
