"""Token ids to text, as it streams: incremental detokenizing and stop strings, in one object.

    token id ─▶ StreamDecoder.push ─▶ piece ─▶ StopStrings.push ─▶ safe text delta
                 (left context for spacing,     (holds back what may still become a stop
                  whole characters only)          string; cuts at one when it completes)

`TextStream` is the one text pipeline of torchllama: `torchllama generate` and `chat` print its
deltas, and the serving engine (`torchllama.serving`) pushes every row's tokens into the row's
stream, finishing the row in the same step when a stop string completes. Its deltas joined with
`flush()` are the generated text up to, not including, the first stop string.

    text = TextStream(tokenizer, prompt_ids, stop=["\\nUser:"])
    for token in tokens:
        print(text.push(token), end="")
        if text.stopped:
            break
    print(text.flush())                      # '' after a stop string
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

from torchllama.generation.stopping import StopStrings


class StreamDecoder:
    """Turns a growing list of token ids into text pieces, safe to print as they come.

    Decoding tokens one at a time drops SentencePiece's leading spaces and cuts multi-byte
    characters in half. Instead (as text-generation-inference's incremental detokenizer): keep a
    few tokens of left context, decode context+new tokens and context alone, and emit the
    difference, but only once it no longer ends in an incomplete character (U+FFFD).

    Args:
        tokenizer: has decode(ids) -> str.
        context_ids: tokens before the generated ones (the end of the prompt), for spacing.
    """

    def __init__(self, tokenizer, context_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context_ids[-6:])
        self.prefix_offset = 0                  # start of the left context window
        self.read_offset = len(self.ids)        # tokens before this are already emitted

    # --8<-- [start:stream-decoder]
    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is incomplete)."""
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new_text[len(prefix_text):]
        return ""
    # --8<-- [end:stream-decoder]

    def flush(self) -> str:
        """Text still held back at the end (e.g. an incomplete character)."""
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):]


class TextStream:
    """One generated sequence's text: token ids in, text deltas out, stopped at a stop string.

    Args:
        tokenizer: has decode(ids) -> str.
        prompt_ids: the prompt's token ids (its last few give the first token its spacing).
        stop: stop strings (one string or several; none: the text is never cut). A stop string
            may span tokens; neither it nor anything after it is ever returned.

    Attributes:
        stopped: True once a stop string has completed; push and flush then return ''.
        matched: that stop string, or None.

    Raises:
        ArgumentError: a stop that is not a string, or an empty string (`StopStrings`).
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (),
                 stop: Union[str, Iterable[str], None] = None):
        self.decoder = StreamDecoder(tokenizer, prompt_ids)
        self.stops = StopStrings(stop or [])

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    @property
    def matched(self) -> Optional[str]:
        return self.stops.matched

    def push(self, token_id: int) -> str:
        """Add the next generated token; return the new text that is safe to show ('' while
        a character is incomplete or a stop string may be starting). When a stop string
        completes, returns the text before it and `stopped` becomes True."""
        if self.stopped:
            return ""
        return self.stops.push(self.decoder.push(token_id))

    def flush(self) -> str:
        """At the end of generation (for any other reason than a stop string): the text still
        held back ('' after a stop string)."""
        if self.stopped:
            return ""
        return self.stops.push(self.decoder.flush()) + self.stops.flush()
