"""The tokenizer of a GGUF file: :func:`tokenizer_from_gguf_metadata` picks the kind by
``tokenizer.ggml.model`` ('llama': SentencePiece, 'gpt2': byte-level BPE) and builds it from the
``tokenizer.ggml.*`` fields.

Source: llama.cpp ``llama-vocab.cpp``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchllama.errors import ModelFileError
from torchllama.tokenizers.base import Tokenizer
from torchllama.tokenizers.bpe import BPETokenizer
from torchllama.tokenizers.gguf_fields import _get
from torchllama.tokenizers.sentencepiece import SentencePieceTokenizer


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any], source: str) -> Tokenizer:
    """Build the tokenizer described by GGUF metadata (the ``tokenizer.ggml.*`` fields).

    Args:
        metadata: as returned by :func:`torchllama.checkpoint.gguf.read_metadata`.
        source: the file's path, for error messages.

    Raises:
        ModelFileError: the tokenizer fields are missing, malformed, or of an unsupported kind
            (``tokenizer.ggml.model`` other than 'llama' or 'gpt2').
    """
    kind = _get(metadata, "tokenizer.ggml.model", str, source)
    if kind == "llama":
        return SentencePieceTokenizer.from_gguf_metadata(metadata, source)
    if kind == "gpt2":
        return BPETokenizer.from_gguf_metadata(metadata, source)
    raise ModelFileError(
        f"{source}: unsupported tokenizer {kind!r} in metadata field 'tokenizer.ggml.model' "
        "(supported: 'llama' (SentencePiece), 'gpt2' (byte-level BPE))"
    )
