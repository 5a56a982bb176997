"""Byte-level BPE vocabularies of GGUF files (``tokenizer.ggml.model == 'gpt2'``: SmolLM,
Llama 3, Qwen, ...): :class:`BPETokenizer` builds a HF ``tokenizers`` pipeline (an
:class:`HFTokenizer`) from the GGUF tokens and merges, with the pre-tokenizer named by
``tokenizer.ggml.pre`` (`torchllama.tokenizers.pretokenizers`).

Source: llama.cpp ``llama-vocab.cpp`` (merges split at the first space after the first character).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torchllama.errors import ModelFileError
from torchllama.tokenizers.base import TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED
from torchllama.tokenizers.gguf_fields import (_common_fields, _get, _token_id, _token_types,
                                               _tokens)
from torchllama.tokenizers.hf import HFTokenizer
from torchllama.tokenizers.pretokenizers import _PRE_ADD_BOS, _bpe_pre_tokenizer


class BPETokenizer(HFTokenizer):
    """A byte-level BPE vocabulary (GGUF ``tokenizer.ggml.model == 'gpt2'``), run by HF ``tokenizers``.

    Control and user-defined tokens are added as special tokens that match atomically (only when
    encoding with ``special=True``). Use :meth:`from_gguf_metadata` to build one.

    Args:
        tokens: the vocabulary; position = id. Regular tokens are byte-level strings ('Ġworld').
        merges: BPE merges in priority order, as pairs of tokens.
        token_types: GGUF token type per token (1 normal, 3 control, 4 user-defined, ...).
        pre: GGUF ``tokenizer.ggml.pre``: which regex splits text before BPE.
        source: name used in error messages.
        bos_id, eos_id, pad_id, unk_id: special ids (None if absent).
        add_bos, add_eos: whether the model expects BOS/EOS around a prompt.
        extra_stop_ids: more ids that end generation (e.g. GGUF's end-of-turn id).
        chat_template: Jinja chat template, if the checkpoint has one.

    Raises:
        ModelFileError: unknown pre-tokenizer, malformed merges.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[tuple[str, str]],
        token_types: Sequence[int],
        *,
        pre: str = "default",
        source: str = "<BPE vocabulary>",
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        extra_stop_ids: Sequence[int | None] = (),
        chat_template: str | None = None,
    ) -> None:
        from tokenizers import AddedToken, decoders, models
        from tokenizers import Tokenizer as _Tokenizers

        pre_tokenizer, ignore_merges = _bpe_pre_tokenizer(pre, source)
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        try:
            model = models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False, byte_fallback=False,
                               ignore_merges=ignore_merges)
        except Exception as e:  # tokenizers raises Exception("... merges ...") for unknown tokens
            raise ModelFileError(f"{source}: invalid 'tokenizer.ggml.merges' ({e})") from e
        tok = _Tokenizers(model)
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoders.ByteLevel()
        control = {i for i, t in enumerate(token_types) if t == TOKEN_TYPE_CONTROL}
        user_defined = {i for i, t in enumerate(token_types) if t == TOKEN_TYPE_USER_DEFINED}
        special_ids = sorted(i for i in control | user_defined if vocab[tokens[i]] == i and tokens[i])
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special_ids])
        for i in special_ids:
            if tok.token_to_id(tokens[i]) != i:  # pragma: no cover - tokenizers reuses vocab ids
                raise ModelFileError(f"{source}: special token {tokens[i]!r} did not keep its id {i}")
        self._setup(tok, source=source, pieces=tokens, control_ids=control,
                    user_defined_ids=user_defined, raw_ids=set(special_ids), bos_id=bos_id,
                    eos_id=eos_id, pad_id=pad_id, unk_id=unk_id, add_bos=add_bos, add_eos=add_eos,
                    extra_stop_ids=extra_stop_ids, chat_template=chat_template)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str) -> BPETokenizer:
        """Build from GGUF ``tokenizer.ggml.*`` fields of a ``'gpt2'`` (byte-level BPE) vocabulary.

        Raises:
            ModelFileError: a required field is missing or malformed (the message names it).
        """
        tokens = _tokens(metadata, source)
        n = len(tokens)
        raw_merges = _get(metadata, "tokenizer.ggml.merges", list, source)
        merges: list[tuple[str, str]] = []
        for k, m in enumerate(raw_merges):
            # Like llama.cpp: split at the first space after the first character.
            pos = m.find(" ", 1) if isinstance(m, str) else -1
            if pos < 0:
                raise ModelFileError(
                    f"{source}: metadata field 'tokenizer.ggml.merges' entry {k} is {m!r}, "
                    "expected two tokens separated by a space"
                )
            merges.append((m[:pos], m[pos + 1 :]))
        pre = _get(metadata, "tokenizer.ggml.pre", str, source, "default")
        return cls(
            tokens,
            merges,
            _token_types(metadata, n, source),
            pre=pre,
            source=source,
            unk_id=_token_id(metadata, "tokenizer.ggml.unknown_token_id", n, source),
            add_bos=_get(metadata, "tokenizer.ggml.add_bos_token", bool, source, pre in _PRE_ADD_BOS),
            **_common_fields(metadata, n, source),
        )
