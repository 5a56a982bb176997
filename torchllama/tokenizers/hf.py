"""Vocabularies run by the HF ``tokenizers`` library: :class:`HFTokenizer` wraps a
``tokenizers.Tokenizer``, e.g. a Hugging Face ``tokenizer.json``, so that ids match transformers'
fast tokenizers. (`load_hf_tokenizer`, in `torchllama.tokenizers.files`, reads the files around
it: special tokens, BOS flag, chat template.)

Source: HF tokenizers (https://github.com/huggingface/tokenizers).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from torchllama.errors import ModelFileError, TorchLlamaError
from torchllama.tokenizers.base import (TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL,
                                        TOKEN_TYPE_USER_DEFINED, Tokenizer)
from torchllama.tokenizers.pretokenizers import _PRE_TOKENIZERS, _gguf_pre_name


class HFTokenizer(Tokenizer):
    """A vocabulary run by the HF ``tokenizers`` library, e.g. a Hugging Face ``tokenizer.json``.

    The wrapped ``tokenizers.Tokenizer`` does all the work (normalizer, pre-tokenizer, model,
    decoder, added tokens with their lstrip/rstrip/normalized flags), so ids match HF transformers'
    fast tokenizers. Added tokens marked ``special`` are control tokens: matched in text only with
    ``encode(special=True)`` and skipped by :meth:`~Tokenizer.decode`. Other added tokens are
    user-defined: decoded as their text and, as in HF, matched in text either way.
    :class:`BPETokenizer` (GGUF byte-level BPE) is an ``HFTokenizer`` built from GGUF fields.

    Args:
        tokenizer: the ``tokenizers.Tokenizer`` to wrap (not copied; do not change it afterwards).
        source: name used in error messages.
        bos_id, eos_id, pad_id, unk_id: special ids (None if absent).
        add_bos, add_eos: whether the model expects BOS/EOS around a prompt.
        extra_stop_ids: more ids that end generation (e.g. generation_config.json's eos ids).
        chat_template: Jinja chat template, if the checkpoint has one.

    Raises:
        ModelFileError: the tokenizer has an empty vocabulary.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        source: str = "<tokenizers.Tokenizer>",
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        extra_stop_ids: Sequence[int | None] = (),
        chat_template: str | None = None,
    ) -> None:
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ModelFileError(f"{source}: the tokenizer has an empty vocabulary")
        pieces = [""] * (max(vocab.values()) + 1)  # ids are contiguous in practice; gaps stay ""
        for piece, i in vocab.items():
            pieces[i] = piece
        added = tokenizer.get_added_tokens_decoder()
        control = {i for i, t in added.items() if t.special}
        self._setup(tokenizer, source=source, pieces=pieces, control_ids=control,
                    user_defined_ids=set(added) - control, raw_ids=set(added), bos_id=bos_id,
                    eos_id=eos_id, pad_id=pad_id, unk_id=unk_id, add_bos=add_bos, add_eos=add_eos,
                    extra_stop_ids=extra_stop_ids, chat_template=chat_template)

    def _setup(self, tok: Any, *, raw_ids: set[int], **common: Any) -> None:
        self._tok = tok
        self._lock = threading.Lock()  # encode_special_tokens is a setting of the shared object
        self._init_common(**common)
        self._raw_ids = frozenset(raw_ids)  # decoded as their text, not through the decoder

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs: Any) -> HFTokenizer:
        """Load a Hugging Face ``tokenizer.json`` (keyword arguments as for the constructor).

        Special ids, add_bos and the chat template live in other files of a model folder; use
        :func:`load_hf_tokenizer` to read them all.

        Raises:
            ModelFileError: the file is missing or is not a valid ``tokenizer.json``.
        """
        path = os.fspath(path)
        kwargs.setdefault("source", path)
        return HFTokenizer(_read_tokenizer_json(path), **kwargs)

    def save_hf(self, folder: str | os.PathLike) -> None:
        """``tokenizer.json`` (the wrapped ``tokenizers`` pipeline) and ``tokenizer_config.json``."""
        self._tok.save(os.path.join(folder, "tokenizer.json"))
        self._write_hf_config(folder, "PreTrainedTokenizerFast")

    def gguf_fields(self) -> dict[str, Any]:
        """GGUF ``'gpt2'`` fields of a byte-level BPE vocabulary: tokens, types, merges, and the
        ``tokenizer.ggml.pre`` name whose pre-tokenizer equals this one's.

        Raises:
            TorchLlamaError: not a byte-level BPE, or a pre-tokenizer llama.cpp has no name for.
        """
        spec = json.loads(self._tok.to_str())
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
            raise TorchLlamaError(f"{self.source}: only byte-level BPE tokenizers can be written "
                                  "to GGUF (as tokenizer.ggml.model 'gpt2')")
        pre = _gguf_pre_name(spec.get("pre_tokenizer"), bool(model.get("ignore_merges")))
        if pre is None:
            raise TorchLlamaError(f"{self.source}: its pre-tokenizer matches none that GGUF names "
                                  f"(tokenizer.ggml.pre: {', '.join(sorted(_PRE_TOKENIZERS))})")
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        types = [TOKEN_TYPE_CONTROL if i in self._control_ids else
                 TOKEN_TYPE_USER_DEFINED if i in self._user_defined_ids else TOKEN_TYPE_NORMAL
                 for i in range(self.vocab_size)]
        return {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": list(self._pieces),
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges,
            **self._gguf_common_fields(),
        }

    def _byte_level(self) -> bool:
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        return "ByteLevel" in json.dumps(decoder)

    def _encode(self, text: str, special: bool) -> list[int]:
        with self._lock:
            self._tok.encode_special_tokens = not special
            return self._tok.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: list[int]) -> str:
        # Runs of regular ids go through the decoder (so multi-byte characters split across
        # tokens are joined); added tokens are their literal text.
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._raw_ids:
                if run:
                    out.append(self._tok.decode(run, skip_special_tokens=False))
                    run = []
                out.append(self._pieces[i])
            else:
                run.append(i)
        if run:
            out.append(self._tok.decode(run, skip_special_tokens=False))
        return "".join(out)


def _read_tokenizer_json(path: str) -> Any:
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json`` file."""
    from tokenizers import Tokenizer as _Tokenizers

    if not os.path.isfile(path):
        raise ModelFileError(f"{path}: no such file (expected a Hugging Face tokenizer.json)")
    try:
        return _Tokenizers.from_file(path)
    except Exception as e:  # tokenizers raises Exception("... at line 1 column 2") and friends
        raise ModelFileError(f"{path}: not a valid Hugging Face tokenizer.json ({e})") from e
