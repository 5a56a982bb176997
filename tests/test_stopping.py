"""Stop strings across token boundaries: held-back prefixes, earliest match, nothing after stop,
and a randomized check against a brute-force reference."""

import random

import pytest

from torchllama.errors import ArgumentError
from torchllama.generation.stopping import StopStrings


def run(stops, pieces, flush=True):
    """Push every piece; return (list of emitted strings, matcher)."""
    matcher = StopStrings(stops)
    emitted = [matcher.push(p) for p in pieces]
    if flush:
        emitted.append(matcher.flush())
    return emitted, matcher


def reference(text, stops):
    """Brute force: scan the text one character at a time and stop at the first position where a
    stop string ends (the longest one if several end there). Returns (kept text, matched)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            s = max(ending, key=len)
            return text[:end - len(s)], s
    return text, None


def test_stop_string_inside_one_piece():
    emitted, m = run(["STOP"], ["Hello ", "worldSTOPmore", " ignored"])
    assert "".join(emitted) == "Hello world"
    assert emitted[1] == "world" and emitted[2:] == ["", ""]
    assert m.stopped and m.matched == "STOP"


def test_stop_string_spanning_two_pieces():
    emitted, m = run(["\nUser:"], ["Sure.\nUs", "er: hi"])
    assert emitted[0] == "Sure."                 # "\nUs" could begin the stop string: held
    assert emitted[1] == ""
    assert m.matched == "\nUser:"


def test_stop_string_spanning_five_pieces():
    pieces = ["answer", "</", "an", "sw", "er", ">trailing"]
    emitted, m = run(["</answer>"], pieces)
    assert emitted[0] == "answer"
    assert emitted[1:5] == ["", "", "", ""]      # all held: still a prefix of the stop string
    assert "".join(emitted) == "answer" and m.matched == "</answer>"


def test_stop_string_split_in_single_characters():
    text = "one two three STOP four"
    emitted, m = run(["STOP"], list(text))
    assert "".join(emitted) == "one two three "
    assert m.stopped


def test_overlapping_prefix():
    # "ab" is held, then "a" breaks it but "ab" of "ababc" restarts the match: "ab" released.
    emitted, m = run(["abc"], ["a", "b", "a", "b", "c", "d"])
    assert emitted == ["", "", "ab", "", "", "", ""]
    assert m.matched == "abc"
    emitted, m = run(["aab"], ["a", "a", "a", "a", "b"])
    assert "".join(emitted) == "aa" and m.matched == "aab"


def test_earliest_occurrence_wins():
    emitted, m = run(["world", "lo"], ["hello world"])
    assert "".join(emitted) == "hel" and m.matched == "lo"
    emitted, m = run(["lo", "world"], ["he", "llo wor", "ld"])
    assert "".join(emitted) == "hel" and m.matched == "lo"
    # Several stop strings end at the same character: the longest (it starts first) wins.
    emitted, m = run(["c", "xbc"], ["axbcd"])
    assert "".join(emitted) == "a" and m.matched == "xbc"
    # The first stop string to complete wins, even if a longer one started before it.
    emitted, m = run(["abcd", "bc"], ["abcd"])
    assert "".join(emitted) == "a" and m.matched == "bc"


def test_prefix_that_is_not_a_stop_string_is_released():
    m = StopStrings(["</s>"])
    assert m.push("x</") == "x"                 # "</" held
    assert m.push("b") == "</b"                 # "</b" cannot start "</s>": released
    assert m.push("> ok") == "> ok"
    assert m.push("<") == ""
    assert m.flush() == "<"                     # end of generation: the held text comes out
    assert not m.stopped and m.matched is None


def test_unicode():
    emitted, m = run(["终了", "🛑"], ["こんにちは", "世界", "终", "了です"])
    assert "".join(emitted) == "こんにちは世界" and m.matched == "终了"
    emitted, m = run(["終わり"], ["é", "終", "わ", "x", "終わ", "り!"])
    assert "".join(emitted) == "é終わx"
    emitted, m = run(["🛑"], ["go 🛑 stop"])
    assert "".join(emitted) == "go " and m.matched == "🛑"


def test_flush_without_stop_returns_everything():
    emitted, m = run(["STOP", "END"], ["ST", "O", "-less E", "N"])
    assert emitted == ["", "", "STO-less ", "", "EN"]   # flush releases the held "EN"
    assert not m.stopped and m.matched is None


def test_nothing_emitted_after_stop():
    m = StopStrings(["END"])
    assert m.push("a END b") == "a "
    assert m.stopped
    assert m.push("more text") == ""
    assert m.push("END") == ""
    assert m.flush() == ""


def test_no_stop_strings_passes_text_through():
    emitted, m = run([], ["abc", "", "def"])
    assert "".join(emitted) == "abcdef" and not m.stopped


def test_fast_path_keeps_state():
    # A piece with no character of any stop string must not lose a partial match in progress.
    m = StopStrings(["ab"])
    assert m.push("a") == ""
    assert m.push("zz") == "azz"
    assert m.push("a") == "" and m.push("b") == "" and m.matched == "ab"


@pytest.mark.parametrize("stops, words", [
    ([""], "must not be empty"),
    (["ok", ""], "must not be empty"),
    ([3], "must be strings"),
    (None, "a string or a list of strings"),
])
def test_bad_stop_strings(stops, words):
    with pytest.raises(ArgumentError) as e:
        StopStrings(stops)
    assert words in str(e.value)


def test_bad_piece():
    with pytest.raises(ArgumentError, match="pieces must be strings"):
        StopStrings(["x"]).push(b"x")


def test_single_string_and_duplicates():
    m = StopStrings("STOP")
    assert m.stops == ("STOP",)
    assert StopStrings(["a", "b", "a"]).stops == ("a", "b")


def random_split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 \
        else []
    bounds = [0] + cuts + [len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    if rng.random() < 0.3:                     # empty pieces happen (incomplete characters)
        pieces.insert(rng.randint(0, len(pieces)), "")
    return pieces


def test_random_texts_match_the_reference():
    rng = random.Random(0)
    alphabet = "abc é"
    for trial in range(3000):
        stops = list({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                      for _ in range(rng.randint(1, 3))})
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        pieces = random_split(text, rng)
        matcher = StopStrings(stops)
        emitted_so_far = ""
        for piece in pieces:
            emitted_so_far += matcher.push(piece)
            # No prefix ever emitted contains a stop string.
            assert not any(s in emitted_so_far for s in stops), (stops, pieces)
            # Held back: no more than the longest stop string (minus one char).
            assert len(matcher._held) < matcher.max_len
        emitted_so_far += matcher.flush()
        expected, matched = reference(text, stops)
        assert emitted_so_far == expected, (stops, pieces)
        assert matcher.matched == matched, (stops, pieces)
        if matched is None:
            assert emitted_so_far == text


def test_long_stream_holds_back_only_a_stop_prefix():
    # Near-misses over a long stream: the text is released as soon as it cannot be a stop string,
    # and what is held never exceeds the longest stop string.
    m = StopStrings(["<|end|>", "\n\nUser:"])
    pieces = ["token<|en", "d-not|> \n\nUse", "rs "] * 20000
    emitted = []
    for p in pieces:
        emitted.append(m.push(p))
        assert len(m._held) < m.max_len
    assert emitted[:3] == ["token", "<|end-not|> ", "\n\nUsers "]
    assert "".join(emitted) + m.flush() == "".join(pieces) and not m.stopped
