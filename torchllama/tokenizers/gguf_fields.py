"""Readers of GGUF ``tokenizer.ggml.*`` metadata fields, checked: a missing or malformed field
raises `ModelFileError` naming it. Both GGUF vocabulary kinds (`SentencePieceTokenizer`,
`BPETokenizer`) read their fields through these; `torchllama.tokenizers.gguf` picks the kind.

Source: llama.cpp ``llama-vocab.cpp`` (how the fields are meant to be used; -1 and
``LLAMA_TOKEN_NULL`` mean "no such token").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchllama.errors import MISSING, ModelFileError, checked_field
from torchllama.tokenizers.base import TOKEN_TYPE_NORMAL


def _get(metadata: Mapping[str, Any], key: str, typ: type, source: str, default: Any = MISSING) -> Any:
    return checked_field(metadata, key, typ, source, default, what="metadata field")


def _tokens(metadata: Mapping[str, Any], source: str) -> list[str]:
    tokens = _get(metadata, "tokenizer.ggml.tokens", list, source)
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelFileError(
            f"{source}: metadata field 'tokenizer.ggml.tokens' must be a non-empty list of strings"
        )
    return tokens


def _float_list(metadata: Mapping[str, Any], key: str, n: int, source: str, default: float) -> list[float]:
    values = _get(metadata, key, list, source, None)
    if values is None:
        return [default] * n
    if len(values) != n:
        raise ModelFileError(
            f"{source}: metadata field {key!r} has {len(values)} entries, expected {n} (one per token)"
        )
    return [float(v) for v in values]


def _token_types(metadata: Mapping[str, Any], n: int, source: str) -> list[int]:
    key = "tokenizer.ggml.token_type"
    types = _get(metadata, key, list, source, None)
    if types is None:
        return [TOKEN_TYPE_NORMAL] * n
    if len(types) != n:
        raise ModelFileError(
            f"{source}: metadata field {key!r} has {len(types)} entries, expected {n} (one per token)"
        )
    return [int(t) for t in types]


def _token_id(metadata: Mapping[str, Any], key: str, n: int, source: str) -> int | None:
    i = _get(metadata, key, int, source, None)
    if i is None or i == -1 or i == 0xFFFFFFFF:  # llama.cpp writes -1 / LLAMA_TOKEN_NULL for "none"
        return None
    if not 0 <= i < n:
        raise ModelFileError(f"{source}: metadata field {key!r} is {i}, expected an id in 0..{n - 1}")
    return i


def _extra_stop_ids(metadata: Mapping[str, Any], n: int, source: str) -> list[int | None]:
    return [_token_id(metadata, f"tokenizer.ggml.{k}_token_id", n, source) for k in ("eot", "eom")]


def _common_fields(metadata: Mapping[str, Any], n: int, source: str) -> dict[str, Any]:
    """Constructor arguments both tokenizer kinds read the same way from GGUF metadata."""
    return dict(
        bos_id=_token_id(metadata, "tokenizer.ggml.bos_token_id", n, source),
        eos_id=_token_id(metadata, "tokenizer.ggml.eos_token_id", n, source),
        pad_id=_token_id(metadata, "tokenizer.ggml.padding_token_id", n, source),
        add_eos=_get(metadata, "tokenizer.ggml.add_eos_token", bool, source, False),
        extra_stop_ids=_extra_stop_ids(metadata, n, source),
        chat_template=_get(metadata, "tokenizer.chat_template", str, source, None),
    )
