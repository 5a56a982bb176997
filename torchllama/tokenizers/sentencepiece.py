"""SentencePiece vocabularies: GGUF ``tokenizer.ggml.model == 'llama'`` (Llama 1/2, Mistral,
TinyLlama, Gemma, ...) and Meta's Llama 2 ``tokenizer.model``.

:class:`SentencePieceTokenizer` rebuilds a SentencePiece ``ModelProto`` from the GGUF fields
(pieces, scores, types) and lets the ``sentencepiece`` library do the work; it also loads
``tokenizer.model`` files directly.

Sources: SentencePiece (https://github.com/google/sentencepiece, ``sentencepiece_model.proto``),
llama.cpp's ``llama-vocab.cpp`` and its GGUF converter (user-defined pieces with plain spaces).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torchllama.errors import ModelFileError
from torchllama.tokenizers.base import (SPM_SPACE, TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL,
                                        TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN,
                                        TOKEN_TYPE_USER_DEFINED, Tokenizer)
from torchllama.tokenizers.gguf_fields import (_common_fields, _float_list, _get, _token_id,
                                               _token_types, _tokens)


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>\Z")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece vocabulary (GGUF ``tokenizer.ggml.model == 'llama'``, or Meta's ``tokenizer.model``).

    Encoding and decoding are done by the ``sentencepiece`` library. With ``special=True`` the text
    is cut at special-token strings and every text fragment is encoded separately, each getting
    SentencePiece's dummy-prefix space (as Meta's reference code and llama.cpp do).

    Args:
        model: a path to a SentencePiece ``tokenizer.model`` file, its serialized bytes, or a
            ``sentencepiece_model_pb2.ModelProto``.
        source: name used in error messages (defaults to the path).
        add_bos, add_eos: whether the model expects BOS/EOS around a prompt.
        eos_id, bos_id, pad_id: override the ids recorded in the model's trainer spec.
        extra_stop_ids: more ids that end generation (e.g. GGUF's end-of-turn id).
        chat_template: Jinja chat template, if the checkpoint has one.

    Raises:
        ModelFileError: the file is missing or is not a SentencePiece model.
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes | Any,
        *,
        source: str | None = None,
        add_bos: bool = True,
        add_eos: bool = False,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        extra_stop_ids: Sequence[int | None] = (),
        chat_template: str | None = None,
    ) -> None:
        from sentencepiece import sentencepiece_model_pb2 as sp_pb2

        if isinstance(model, sp_pb2.ModelProto):
            proto = model
            source = source or "<SentencePiece model>"
        elif isinstance(model, (bytes, bytearray)):
            proto = _parse_sp_proto(bytes(model), source or "<SentencePiece model>")
            source = source or "<SentencePiece model>"
        else:
            path = os.fspath(model)
            source = source or path
            if not os.path.isfile(path):
                raise ModelFileError(f"{path}: no such file (expected a SentencePiece tokenizer.model)")
            with open(path, "rb") as f:
                proto = _parse_sp_proto(f.read(), path)

        # User-defined pieces (Gemma's whitespace runs, a trained model's user_defined_symbols)
        # are matched in any text, as SentencePiece, llama.cpp and HF match them; only control
        # pieces (<s>, <start_of_turn>) need special=True, which splits the text at them.
        Type = sp_pb2.ModelProto.SentencePiece.Type
        user_defined = {i for i, p in enumerate(proto.pieces) if p.type == Type.USER_DEFINED}
        self._sp = self._sp_encode = _sp_processor(proto, source)

        def or_none(i: int) -> int | None:
            return i if i >= 0 else None

        self._init_common(
            source=source,
            pieces=[p.piece for p in proto.pieces],
            control_ids={i for i, p in enumerate(proto.pieces) if p.type == Type.CONTROL},
            user_defined_ids=user_defined,
            bos_id=bos_id if bos_id is not None else or_none(self._sp.bos_id()),
            eos_id=eos_id if eos_id is not None else or_none(self._sp.eos_id()),
            pad_id=pad_id if pad_id is not None else or_none(self._sp.pad_id()),
            unk_id=or_none(self._sp.unk_id()),
            add_bos=add_bos,
            add_eos=add_eos,
            extra_stop_ids=extra_stop_ids,
            chat_template=chat_template,
        )
        if self.vocab_size != self._sp.get_piece_size():  # pragma: no cover - sentencepiece invariant
            raise ModelFileError(f"{source}: SentencePiece reports {self._sp.get_piece_size()} pieces, "
                                 f"expected {self.vocab_size}")

    def serialized_model_proto(self) -> bytes:
        """The SentencePiece model as the bytes of a ``tokenizer.model`` file."""
        return self._sp.serialized_model_proto()

    def save_meta(self, folder: str | os.PathLike) -> None:
        """``tokenizer.model``: the SentencePiece model, as Meta ships Llama 2."""
        Path(folder, "tokenizer.model").write_bytes(self.serialized_model_proto())

    def gguf_fields(self) -> dict[str, Any]:
        """GGUF ``'llama'`` vocabulary fields: pieces, scores and types of the SentencePiece model."""
        proto = self._sp_proto()
        return {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.pre": "default",
            # llama.cpp's converter writes user-defined pieces with plain spaces
            "tokenizer.ggml.tokens": [p.piece.replace(SPM_SPACE, " ") if p.type == 4 else p.piece
                                      for p in proto.pieces],
            "tokenizer.ggml.scores": [p.score for p in proto.pieces],
            "tokenizer.ggml.token_type": [int(p.type) for p in proto.pieces],
            "tokenizer.ggml.add_space_prefix": proto.normalizer_spec.add_dummy_prefix,
            **self._gguf_common_fields(),
        }

    def save_hf(self, folder: str | os.PathLike) -> None:
        """``tokenizer.model`` and ``tokenizer_config.json``: transformers' ``LlamaTokenizer``
        for a vocabulary with SentencePiece's dummy-prefix space (Llama), ``GemmaTokenizer`` for
        one without (Gemma: transformers' LlamaTokenizer would add the prefix space)."""
        with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
            f.write(self.serialized_model_proto())
        prefix = self._sp_proto().normalizer_spec.add_dummy_prefix
        self._write_hf_config(folder, "LlamaTokenizer" if prefix else "GemmaTokenizer")

    def _sp_proto(self) -> Any:
        from sentencepiece import sentencepiece_model_pb2 as sp_pb2

        proto = sp_pb2.ModelProto()
        proto.ParseFromString(self.serialized_model_proto())
        return proto

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs: Any) -> SentencePieceTokenizer:
        """Load a SentencePiece ``tokenizer.model`` file (keyword arguments as for the constructor)."""
        return cls(os.fspath(path), **kwargs)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str) -> SentencePieceTokenizer:
        """Build from GGUF ``tokenizer.ggml.*`` fields of a ``'llama'`` (SentencePiece) vocabulary.

        Raises:
            ModelFileError: a required field is missing or malformed (the message names it).
        """
        from sentencepiece import sentencepiece_model_pb2 as sp_pb2

        tokens = _tokens(metadata, source)
        n = len(tokens)
        scores = _float_list(metadata, "tokenizer.ggml.scores", n, source, default=0.0)
        types = _token_types(metadata, n, source)
        unk_id = _token_id(metadata, "tokenizer.ggml.unknown_token_id", n, source)
        common = _common_fields(metadata, n, source)
        bos_id, eos_id, pad_id = common["bos_id"], common["eos_id"], common["pad_id"]

        if unk_id is not None:
            types[unk_id] = TOKEN_TYPE_UNKNOWN
        unknown = [i for i, t in enumerate(types) if t == TOKEN_TYPE_UNKNOWN]
        if not unknown:
            raise ModelFileError(
                f"{source}: SentencePiece vocabulary has no unknown token (no token of type 2 in "
                "'tokenizer.ggml.token_type' and no 'tokenizer.ggml.unknown_token_id')"
            )
        for i in unknown[1:]:  # SentencePiece allows exactly one; llama.cpp ignores the type anyway
            types[i] = TOKEN_TYPE_CONTROL
        unk_id = unknown[0]
        byte_ids = [i for i, t in enumerate(types) if t == TOKEN_TYPE_BYTE]
        for i in byte_ids:
            if not _BYTE_PIECE.match(tokens[i]):
                raise ModelFileError(
                    f"{source}: token {i} {tokens[i]!r} has type 6 (byte) in 'tokenizer.ggml.token_type' "
                    "but is not of the form <0xXX>"
                )

        proto = sp_pb2.ModelProto()
        for piece, score, typ in zip(tokens, scores, types):
            if typ not in (1, 2, 3, 4, 5, 6):
                typ = TOKEN_TYPE_NORMAL
            if typ == TOKEN_TYPE_USER_DEFINED:
                # llama.cpp's converter stores user-defined pieces with plain spaces ("pre-
                # normalized"); SentencePiece matches them in escaped text (U+2581 for a space)
                piece = piece.replace(" ", SPM_SPACE)
            proto.pieces.add(piece=piece, score=score, type=typ)
        spec = proto.trainer_spec
        spec.model_type = sp_pb2.TrainerSpec.ModelType.BPE
        spec.vocab_size = n
        spec.byte_fallback = len(byte_ids) == 256
        spec.unk_id = unk_id
        spec.unk_piece = tokens[unk_id]
        # trainer_spec ids must be distinct and in range; we keep our own copies of bos/eos/pad.
        used = {unk_id}
        for field, i in (("bos", bos_id), ("eos", eos_id), ("pad", pad_id)):
            if i is not None and i not in used:
                setattr(spec, f"{field}_id", i)
                setattr(spec, f"{field}_piece", tokens[i])
                used.add(i)
            else:
                setattr(spec, f"{field}_id", -1)
        norm = proto.normalizer_spec
        norm.name = "identity"
        norm.add_dummy_prefix = bool(_get(metadata, "tokenizer.ggml.add_space_prefix", bool, source, True))
        norm.remove_extra_whitespaces = False
        norm.escape_whitespaces = True

        return cls(
            proto,
            source=source,
            add_bos=_get(metadata, "tokenizer.ggml.add_bos_token", bool, source, True),
            **common,
        )

    def _encode(self, text: str, special: bool) -> list[int]:
        if not special:
            return list(self._sp_encode.encode(text))
        ids: list[int] = []
        for part in self._split_special(text):
            if isinstance(part, int):
                ids.append(part)
            else:
                ids.extend(self._sp_encode.encode(part))
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


def _parse_sp_proto(data: bytes, source: str) -> Any:
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    proto = sp_pb2.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as e:  # protobuf DecodeError
        raise ModelFileError(
            f"{source}: not a SentencePiece model (protobuf parse failed: {e}); "
            "expected a SentencePiece tokenizer.model"
        ) from e
    if len(proto.pieces) == 0:
        raise ModelFileError(
            f"{source}: not a SentencePiece model (no pieces); expected a SentencePiece tokenizer.model"
        )
    return proto


def _sp_processor(proto: Any, source: str) -> Any:
    import sentencepiece as spm

    try:
        return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    except Exception as e:  # RuntimeError / OSError from the C++ loader
        raise ModelFileError(f"{source}: SentencePiece rejected the tokenizer model ({e})") from e
