"""Stop strings: end generation when the text contains one, across token boundaries.

A stop string ("\\nUser:", "</answer>") can arrive split over many decoded pieces, or sit in the
middle of one. `StopStrings` takes the text pieces as they come (from
`torchllama.generation.text.StreamDecoder.push`) and returns the part that is safe to show now: it
holds back any suffix that could still grow into a stop string, releases it once it cannot, and
when a stop string completes returns only the text before it and marks itself stopped.

    pieces ─▶ StopStrings.push ─▶ safe text ─▶ print
                 │ Aho–Corasick automaton over the stop strings (one step per character)
                 │ held back: the longest suffix of the text that is a prefix of a stop string
                 └ stopped / matched once a stop string is complete

    stops = StopStrings(["\\nUser:"])
    for token in tokens:
        out = stops.push(stream.push(token))
        print(out, end="")
        if stops.stopped:
            break
    else:
        print(stops.push(stream.flush()) + stops.flush())   # no stop string: release the rest

Where it stops: at the first character where some stop string is complete; the text is cut at
the start of that stop string (if several end there, the longest, i.e. the one starting first).
This is what checking after every character would give, so the result does not depend on how
the text is split into pieces. (With stops "abcd" and "bc", "abcd" stops after "a", matching
"bc": "bc" is complete before "abcd" is.)

Cost: O(len(piece) + longest stop string) per push, whatever the number of stop strings — the
automaton (Aho & Corasick 1975, "Efficient string matching") never re-scans emitted text — so,
unlike OpenAI's API (at most 4), no limit is put on how many stop strings there are.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Optional, Union

from torchllama.errors import ArgumentError


class StopStrings:
    """Streaming matcher of stop strings over decoded text pieces.

    Args:
        stops: one stop string or several (non-empty strings; duplicates are ignored; an empty
            collection never stops and passes text through).

    Attributes:
        stops: the stop strings, in the given order, without duplicates.
        matched: the stop string that ended the text, or None.

    Raises:
        ArgumentError: a stop that is not a string, or an empty string.
    """

    def __init__(self, stops: Union[str, Iterable[str]]):
        if isinstance(stops, str):
            stops = [stops]
        try:
            given = list(stops)
        except TypeError:
            raise ArgumentError(f"stop strings must be a string or a list of strings, "
                                f"got {stops!r}") from None
        for s in given:
            if not isinstance(s, str):
                raise ArgumentError(f"stop strings must be strings, got {s!r}")
            if not s:
                raise ArgumentError("a stop string must not be empty")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(given))
        self.matched: Optional[str] = None
        self.max_len = max((len(s) for s in self.stops), default=0)
        self._chars = frozenset("".join(self.stops))
        self._build()
        self._state = 0          # automaton state: the held text is its string
        self._held = ""          # == the last depth[state] characters seen, not yet emitted

    def _build(self) -> None:
        """The Aho–Corasick automaton: a trie of the stop strings with failure links.

        Node u spells a prefix of some stop string (depth[u] characters). fail[u] is the node of
        the longest proper suffix of that prefix that is itself such a prefix; out[u] is the
        index of the longest stop string that is a suffix of u's string (-1 if none).
        """
        goto: list[dict[str, int]] = [{}]
        depth, out = [0], [-1]
        for index, s in enumerate(self.stops):
            node = 0
            for ch in s:
                if ch not in goto[node]:
                    goto.append({})
                    depth.append(depth[node] + 1)
                    out.append(-1)
                    goto[node][ch] = len(goto) - 1
                node = goto[node][ch]
            out[node] = index                       # the node's whole string: the longest
        fail = [0] * len(goto)
        queue = deque(goto[0].values())            # depth-1 nodes fail to the root
        while queue:                               # breadth first: fail[u] is set before u's
            u = queue.popleft()                    # children need it
            for ch, v in goto[u].items():
                f = fail[u]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[v] = goto[f].get(ch, 0)
                if out[v] < 0:
                    out[v] = out[fail[v]]
                queue.append(v)
        self._goto, self._fail, self._depth, self._out = goto, fail, depth, out

    @property
    def stopped(self) -> bool:
        """True once a stop string has appeared; push and flush then return ''."""
        return self.matched is not None

    def push(self, piece: str) -> str:
        """Add the next decoded piece; return the text that is safe to emit now.

        Returns the text before the stop string when one completes in this piece (then
        `stopped` is True and the rest is dropped); otherwise everything except the held-back
        suffix that could begin a stop string. '' after stopping.

        Raises:
            ArgumentError: piece is not a string.
        """
        if not isinstance(piece, str):
            raise ArgumentError(f"pieces must be strings, got {piece!r}")
        if self.matched is not None:
            return ""
        if self._state == 0 and self._chars.isdisjoint(piece):
            return piece                            # no character of any stop string: fast path
        goto, fail, out = self._goto, self._fail, self._out
        text = self._held + piece
        offset = len(self._held)
        state = self._state
        for i, ch in enumerate(piece):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if out[state] >= 0:                     # a stop string ends at this character
                self.matched = self.stops[out[state]]
                self._state, self._held = 0, ""
                return text[:offset + i + 1 - len(self.matched)]
        self._state = state
        cut = len(text) - self._depth[state]        # hold back what may start a stop string
        self._held = text[cut:]
        return text[:cut]

    def flush(self) -> str:
        """At the end of generation (stopped for another reason): the held-back text.

        Forgets the partial match, so later pushes start afresh. '' after stopping.
        """
        held = "" if self.matched is not None else self._held
        self._state, self._held = 0, ""
        return held
