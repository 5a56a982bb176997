"""Pre-tokenizers of byte-level BPE vocabularies: the regex that splits text into words before
BPE, named as GGUF names it (``tokenizer.ggml.pre``), built as HF ``tokenizers`` objects.

`BPETokenizer` builds its pipeline from a name; `HFTokenizer.gguf_fields` finds the name of a
``tokenizer.json``'s pre-tokenizer (`_gguf_pre_name`).

Source: llama.cpp ``llama-vocab.cpp`` (the names, their regexes, which add BOS by default).
"""

from __future__ import annotations

import json
from typing import Any

from torchllama.errors import ModelFileError


_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: GGUF ``tokenizer.ggml.pre`` values we know -> (regex family, ignore_merges), as in llama.cpp's
#: llama-vocab.cpp ('gpt2' and 'default' are taken as plain GPT-2 byte-level BPE, like HF does).
_PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    **dict.fromkeys(["default", "gpt2", "gpt-2", "mpt", "olmo", "phi-2", "jina-es", "jina-de", "exaone4"],
                    ("gpt2", False)),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
                    ("digits+gpt2", False)),
    # 'llama-bpe' first: the name `_gguf_pre_name` writes, as llama.cpp's converter does for Llama 3
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "falcon3"], ("llama3", True)),
    **dict.fromkeys(["dbrx", "smaug-bpe"], ("llama3", False)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"], ("qwen2", False)),
}
#: Pre-tokenizers for which llama.cpp adds BOS when ``tokenizer.ggml.add_bos_token`` is absent.
_PRE_ADD_BOS = frozenset(["llama3", "llama-v3", "llama-bpe", "falcon3"])


def _bpe_pre_tokenizer(pre: str, source: str) -> tuple[Any, bool]:
    """The ``tokenizers`` pre-tokenizer for GGUF ``tokenizer.ggml.pre`` and whether merges are
    skipped for words already in the vocabulary (``ignore_merges``)."""
    from tokenizers import Regex, pre_tokenizers

    if pre not in _PRE_TOKENIZERS:
        raise ModelFileError(
            f"{source}: unsupported BPE pre-tokenizer {pre!r} in metadata field 'tokenizer.ggml.pre' "
            f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    family, ignore_merges = _PRE_TOKENIZERS[pre]
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), ignore_merges
    if family == "digits+gpt2":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]), ignore_merges
    pattern = _LLAMA3_PATTERN if family == "llama3" else _QWEN2_PATTERN
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]), ignore_merges


def _gguf_pre_name(pre_tokenizer_json: Any, ignore_merges: bool) -> str | None:
    """The first GGUF ``tokenizer.ggml.pre`` name whose pre-tokenizer serializes to the given
    ``tokenizer.json`` pre_tokenizer (and has the same ignore_merges), or None."""
    from tokenizers import Tokenizer as _Tokenizers
    from tokenizers import models

    for name, (_, name_ignore_merges) in _PRE_TOKENIZERS.items():
        if name_ignore_merges != ignore_merges:
            continue
        probe = _Tokenizers(models.BPE())
        probe.pre_tokenizer, _ = _bpe_pre_tokenizer(name, "<probe>")
        if json.loads(probe.to_str())["pre_tokenizer"] == pre_tokenizer_json:
            return name
    return None
