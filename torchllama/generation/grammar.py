"""Structured output: generation constrained by a grammar, through token masks.

At each step, the tokens that cannot continue a string of the grammar get −inf logits before
sampling, so what comes out always matches it: a JSON schema (OpenAI's `response_format`
`{"type": "json_schema", ...}`), any JSON object (`{"type": "json_object"}`), a regular
expression, or a context-free grammar (Lark, or llama.cpp's GBNF). The grammar engine is
Microsoft's `llguidance` (Rust, via its Python wheel): it computes the allowed tokens of a
vocabulary from its token bytes (`Tokenizer.token_bytes`) in tens of microseconds a token. (Chosen
over xgrammar, measured side by side: see the serving guide's "Structured output".)

A generation ends when the grammar is complete: the model samples an end token (allowed only
where the grammar may end) or the grammar allows nothing more. Cut short by max_tokens, the
output is a prefix of a valid one and its finish_reason is "length".
"""

from __future__ import annotations

import json
import threading
from typing import Any, Optional

import numpy as np
import torch

from torchllama.errors import ArgumentError


class GrammarError(ArgumentError):
    """A grammar, JSON schema or regular expression the grammar engine cannot compile (the
    message is the engine's)."""


#: The whitespace a JSON grammar allows between two JSON tokens: none, one space, or a newline
#: and an indent of at most 20 spaces or tabs (llama.cpp's `ws` rule, json-schema-to-grammar).
#: llguidance's default allows any run of whitespace there, and sampling at temperature 0.7
#: filled `max_tokens` with blank lines (`{\n"city": "Oslo"\n\n   \n\n…`). A schema's own
#: "x-guidance" options override it.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"


#: JSON schema keywords whose value is a schema, a list of schemas, or a map to schemas
_SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


def closed_schema(schema: Any, require_all: bool = False) -> Any:
    """A copy of a JSON schema in which every object that lists its properties (or
    patternProperties) and says nothing of others takes no others: `"additionalProperties":
    false` where the schema has no `additionalProperties` (nor `unevaluatedProperties`).

    JSON Schema's own default admits any further key, and a small model sampling a schema that
    leaves objects open keeps inventing keys (`"style": {"type": "object", "properties": …`)
    until max_tokens cuts the document. Closing them is what OpenAI's strict mode requires and
    what xgrammar's strict mode (vLLM's default structured-output backend) assumes. An object
    that says `"additionalProperties": true` (or gives a schema for them) stays open, and so
    does one that lists no properties (`{"type": "object"}`: any object).

    With `require_all` (OpenAI's `strict: true` functions and formats) every object also
    requires every property it lists and takes no others, as OpenAI defines strict mode.
    """
    if isinstance(schema, list):
        return [closed_schema(s, require_all) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: closed_schema(v, require_all) for k, v in value.items()}
        elif (key in _SUBSCHEMA_LISTS and isinstance(value, list)) or \
                (key in _SUBSCHEMA and isinstance(value, dict)):
            out[key] = closed_schema(value, require_all)
        else:
            out[key] = value
    if "properties" in out or "patternProperties" in out:
        if require_all or ("additionalProperties" not in out and
                           "unevaluatedProperties" not in out):
            out["additionalProperties"] = False
        if require_all and isinstance(out.get("properties"), dict):
            out["required"] = list(out["properties"])
    return out


def _json_grammar(schema: dict) -> str:
    """llguidance's grammar of a JSON schema (its objects closed: `closed_schema`) with
    `JSON_WHITESPACE` between tokens."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(
        closed_schema(schema), defaults={"whitespace_pattern": JSON_WHITESPACE})


def grammar_of(kind: str, spec: Any) -> str:
    """The llguidance grammar of a constraint. JSON (json_schema, json_object) allows only
    `JSON_WHITESPACE` between its tokens; a schema's objects that list their properties take
    no others unless they say so (`closed_schema`).

    Args:
        kind: "json_schema" (spec: a JSON schema as a dict or a JSON string), "json_object"
            (spec ignored: any JSON object), "regex" (spec: the expression, Rust `regex`
            syntax), or "grammar" (spec: a Lark grammar, or GBNF — llama.cpp's — told by its
            `::=` rules).

    Raises:
        GrammarError: a schema that is not a JSON object, a GBNF grammar that does not convert.
        ArgumentError: an unknown kind.
    """
    from llguidance import LLMatcher, grammar_from
    from llguidance._lib import regex_to_lark

    if kind == "json_object":
        return _json_grammar({"type": "object"})
    if kind == "json_schema":
        try:
            schema = json.loads(spec) if isinstance(spec, str) else spec
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be a JSON object")
            return _json_grammar(schema)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if kind == "regex":     # \d and \w as ASCII ([0-9], [0-9A-Za-z_]), as in JSON schemas
        try:
            return LLMatcher.grammar_from_lark(f"start: /{regex_to_lark(spec, 'dw')}/")
        except Exception as e:                       # noqa: BLE001 - the converter's message
            raise GrammarError(f"regex: {e}") from None
    if kind == "grammar":
        try:
            return grammar_from("gbnf" if "::=" in spec else "lark", spec)
        except ValueError as e:
            raise GrammarError(str(e)) from None
    raise ArgumentError(f"unknown constraint kind {kind!r}: expected json_schema, json_object, "
                        "regex or grammar")


class _Vocabulary:
    """What llguidance's `TokenizerWrapper` reads of a tokenizer: token bytes, ends, encode."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.tokens = tokenizer.token_bytes()
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else \
            min(tokenizer.stop_ids, default=0)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(i for i, b in enumerate(self.tokens) if not b)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


class Grammars:
    """Compiles constraints for one tokenizer (its llguidance vocabulary is built once, ~1 s
    for 262k tokens, on first use) and makes a `Constraint` per request.

    Args:
        tokenizer: a torchllama `Tokenizer`.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lltokenizer = None
        self._lock = threading.Lock()

    @property
    def lltokenizer(self):
        with self._lock:
            if self._lltokenizer is None:
                from llguidance import LLTokenizer, TokenizerWrapper
                stops = sorted(self.tokenizer.stop_ids) or None
                self._lltokenizer = LLTokenizer(TokenizerWrapper(_Vocabulary(self.tokenizer)),
                                                eos_token=stops)
            return self._lltokenizer

    def compile(self, kind: str, spec: Any) -> "Constraint":
        """A fresh constraint for one request (see `grammar_of` for kind and spec).

        Raises:
            GrammarError: the grammar engine rejects it (its message).
        """
        from llguidance import LLMatcher

        grammar = grammar_of(kind, spec)          # compiled once, by the matcher itself:
        matcher = LLMatcher(self.lltokenizer, grammar, log_level=0)   # errors are its state
        if matcher.is_error():
            raise GrammarError(f"{kind}: {matcher.get_error()}")
        return Constraint(matcher, self.tokenizer.vocab_size)


class Constraint:
    """The state of one generation under a grammar: which tokens may come next.

    Args:
        matcher: an `llguidance.LLMatcher` at the start of the grammar.
        vocab_size: the tokenizer's ids (the model's logits may have more: never allowed).
    """

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)

    def copy(self) -> "Constraint":
        """An independent constraint at the same point (for another choice of a request)."""
        return Constraint(self.matcher.deep_copy(), self.vocab_size)

    def allowed(self) -> torch.Tensor:
        """(vocab_size,) bool: the tokens that may come next."""
        return ~self._refused()

    def _refused(self) -> torch.Tensor:
        """(vocab_size,) bool: the tokens that may not come next (one bit each in the matcher's
        int32 bitmask, lowest bit first)."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        bits = np.unpackbits(np.invert(self._bitmask.view(np.uint8)), bitorder="little",
                             count=self.vocab_size)                        # (vocab_size,) 0/1
        return torch.from_numpy(bits).view(torch.bool)

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (…, V) with −inf at every token the grammar does not allow next (V may exceed
        the vocabulary: those ids are never allowed)."""
        refused = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
        refused[:self.vocab_size] = self._refused().to(logits.device)
        return logits.masked_fill(refused, float("-inf"))

    def accept(self, token: int) -> None:
        """Advance past a sampled token (one `mask_logits` allowed)."""
        self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more (or the matcher failed)."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def accepting(self) -> bool:
        """What was generated so far is a complete string of the grammar."""
        return self.matcher.is_accepting()

    @property
    def error(self) -> Optional[str]:
        return self.matcher.get_error() if self.matcher.is_error() else None
