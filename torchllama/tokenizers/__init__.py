"""Tokenizers: text <-> token ids for the models torchllama runs, plus chat templates.

Two kinds of vocabulary occur in the checkpoints we load, named by GGUF's ``tokenizer.ggml.model``:

- ``'llama'``: a SentencePiece BPE vocabulary (Llama 1/2, Mistral, TinyLlama, ...).
  :class:`SentencePieceTokenizer` rebuilds a SentencePiece ``ModelProto`` from the GGUF fields
  (pieces, scores, types) and lets the ``sentencepiece`` library do the work. It also loads Meta's
  ``tokenizer.model`` files directly.
- ``'gpt2'``: a byte-level BPE vocabulary with merges (SmolLM, Llama 3, Qwen, ...).
  :class:`BPETokenizer` builds a HF ``tokenizers`` pipeline from the GGUF tokens and merges, with
  the pre-tokenizer (regex split) named by ``tokenizer.ggml.pre``. Meta's Llama 3
  ``tokenizer.model`` is such a vocabulary in tiktoken's format (``base64(token) rank`` lines):
  :class:`TiktokenTokenizer` converts its ranks to merges and adds Meta's special tokens and
  chat format.

Hugging Face model folders carry a ``tokenizer.json``: :class:`HFTokenizer` wraps it (``BPETokenizer``
is an ``HFTokenizer`` built from GGUF fields) and :func:`load_hf_tokenizer` reads the special tokens,
BOS flag and chat template from the files around it. A folder with only a SentencePiece
``tokenizer.model`` gets a :class:`SentencePieceTokenizer`.

All share the :class:`Tokenizer` interface: :meth:`~Tokenizer.encode`, :meth:`~Tokenizer.decode`,
special token ids (BOS/EOS/PAD, :attr:`~Tokenizer.stop_ids`) and
:meth:`~Tokenizer.apply_chat_template`, which renders the checkpoint's Jinja chat template the way
HF ``transformers`` does.

Conventions:

- ``encode`` never adds BOS/EOS unless asked (``bos=True``); :attr:`Tokenizer.add_bos` says whether
  the model expects one. With ``special=False`` (the default) text that looks like a special token
  (``<|im_start|>``, ``<s>``) is encoded as plain text, so user input cannot inject control tokens;
  pass ``special=True`` for text you produced yourself, such as a rendered chat template.
- ``decode`` drops *control* tokens (BOS, EOS, ``<|im_end|>`` ...), keeps user-defined tokens as
  their text, and follows SentencePiece's whitespace rules: only the dummy-prefix space of the very
  first piece is dropped. For streaming, decode the growing id list and print what was added (a
  single id may be half of a UTF-8 character, which decodes to U+FFFD until completed).

Sources: SentencePiece (https://github.com/google/sentencepiece), HF tokenizers, tiktoken
(https://github.com/openai/tiktoken) and Meta's Llama 3 ``tokenizer.py``, llama.cpp's
``llama-vocab.cpp`` (how GGUF tokenizer fields are meant to be used, pre-tokenizer regexes) and HF
transformers' ``chat_template_utils`` (how chat templates are rendered).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from torchllama.errors import MISSING, checked_field, ArgumentError, ModelFileError, TorchLlamaError

# GGUF token types (llama.cpp's llama_token_type), identical to SentencePiece's piece types.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
#: SentencePiece's stand-in for a space in pieces ("▁", U+2581)
SPM_SPACE = "\u2581"
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

#: Special tokens that end a turn in common chat formats; any of them present in a vocabulary as a
#: special token is a stop token (in addition to EOS and GGUF's eot/eom ids).
END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML (SmolLM, Qwen, ...)
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",  # Llama 3.1 tool calls
    "<|end|>",  # Phi-3
    "<end_of_turn>",  # Gemma
    "<|endoftext|>",  # GPT-2 family
    "</s>",  # Llama 2, Mistral
)

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>\Z")


class Tokenizer(ABC):
    """Common interface of torchllama's tokenizers.

    Attributes:
        source: where the tokenizer came from (a file path), used in error messages.
        vocab_size: number of token ids; ids are ``0 .. vocab_size - 1``.
        bos_id: id of the beginning-of-sequence token, or None if the vocabulary has none.
        eos_id: id of the end-of-sequence token, or None.
        pad_id: id of the padding token, or None.
        unk_id: id of the unknown token, or None.
        add_bos: whether the model expects BOS before a prompt (GGUF ``tokenizer.ggml.add_bos_token``).
        add_eos: whether the model expects EOS after a prompt (GGUF ``tokenizer.ggml.add_eos_token``).
        special_tokens: text -> id of the control and user-defined tokens (``<s>``, ``<|im_end|>``).
        stop_ids: ids that end generation: EOS, GGUF's end-of-turn/end-of-message ids, and the
            :data:`END_OF_TURN_TOKENS` present among :attr:`special_tokens`.
        chat_template: the Jinja chat template (GGUF ``tokenizer.chat_template``), or None.
    """

    source: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    special_tokens: dict[str, int]
    stop_ids: frozenset[int]
    chat_template: str | None

    def _init_common(
        self,
        *,
        source: str,
        pieces: Sequence[str],
        control_ids: set[int],
        user_defined_ids: set[int],
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        unk_id: int | None,
        add_bos: bool,
        add_eos: bool,
        extra_stop_ids: Sequence[int | None] = (),
        chat_template: str | None = None,
    ) -> None:
        self.source = source
        self._pieces = list(pieces)
        self.vocab_size = len(self._pieces)
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = bos_id, eos_id, pad_id, unk_id
        self.add_bos, self.add_eos = bool(add_bos), bool(add_eos)
        self._control_ids = frozenset(control_ids)
        self._user_defined_ids = frozenset(user_defined_ids)
        special: dict[str, int] = {}
        for i in sorted(self._control_ids | self._user_defined_ids):
            special.setdefault(self._pieces[i], i)  # first id wins for duplicated strings
        self.special_tokens = special
        stops = {i for i in (eos_id, *extra_stop_ids) if i is not None}
        stops.update(special[t] for t in END_OF_TURN_TOKENS if t in special)
        self.stop_ids = frozenset(stops)
        self.chat_template = chat_template or None
        self._compiled_template: Any = None
        # Longest first, so that '<|im_start|>' wins over a prefix of it in the alternation.
        by_length = sorted(special, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, by_length))) if by_length else None

    # ---- encoding / decoding -------------------------------------------------------------------

    def encode(self, text: str, bos: bool = False, eos: bool = False, special: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: the text to encode.
            bos: prepend the BOS id (pass ``tokenizer.add_bos`` for the model's default).
            eos: append the EOS id.
            special: map special-token strings in ``text`` (``<s>``, ``<|im_start|>``) to their ids.
                With False (the default) they are encoded as plain text.

        Raises:
            ArgumentError: ``text`` is not a str, or BOS/EOS is asked for but the vocabulary has none.
        """
        if not isinstance(text, str):
            raise ArgumentError(f"text to encode must be a str, got {type(text).__name__}")
        ids: list[int] = []
        if bos:
            if self.bos_id is None:
                raise ArgumentError(f"{self.source}: the tokenizer has no BOS token (bos=True)")
            ids.append(self.bos_id)
        ids.extend(self._encode(text, special))
        if eos:
            if self.eos_id is None:
                raise ArgumentError(f"{self.source}: the tokenizer has no EOS token (eos=True)")
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; control tokens (BOS, EOS, ``<|im_end|>``...) are skipped.

        User-defined tokens decode to their text. SentencePiece vocabularies drop only the
        dummy-prefix space of the first piece, so ``decode(encode(" x")) == " x"``.

        Raises:
            ArgumentError: an id is not an int in ``0 .. vocab_size - 1``.
        """
        checked = [self._check_id(i) for i in ids]
        return self._decode([i for i in checked if i not in self._control_ids])

    def id_to_piece(self, i: int) -> str:
        """The vocabulary entry of id ``i`` as stored (e.g. ``'▁Hello'``, ``'Ġworld'``, ``'<0x0A>'``)."""
        return self._pieces[self._check_id(i)]

    def token_bytes(self) -> list[bytes]:
        """The bytes each id adds to the text, for every id (what grammar-constrained decoding
        matches token by token): a byte-level BPE piece's bytes (``'Ġworld'`` → ``b' world'``), a
        SentencePiece piece with ``▁`` as a space and ``<0xNN>`` as byte NN, a user-defined
        token's text; ``b''`` for control tokens (BOS, EOS, ``<|im_end|>``), which add no text."""
        if getattr(self, "_token_bytes", None) is None:
            byte_level = self._byte_level()
            inverse = {c: b for b, c in enumerate(_BYTE_CHARS)}
            out = []
            for i, piece in enumerate(self._pieces):
                if i in self._control_ids:
                    out.append(b"")
                elif i in self._user_defined_ids:
                    out.append(piece.encode())
                elif byte_level:
                    out.append(bytes(inverse[c] for c in piece if c in inverse))
                elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                    out.append(bytes([int(piece[3:5], 16)]))
                else:
                    out.append(piece.replace("\u2581", " ").encode())
            self._token_bytes = out
        return self._token_bytes

    def _byte_level(self) -> bool:
        """Whether the pieces are GPT-2's byte-level alphabet (else SentencePiece-style)."""
        return False

    def _check_id(self, i: Any) -> int:
        try:
            ok = int(i) == i and 0 <= i < self.vocab_size
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ArgumentError(f"token id {i!r} out of range: expected an int in 0..{self.vocab_size - 1}")
        return int(i)

    def _split_special(self, text: str) -> list[str | int]:
        """``text`` cut at special-token strings: text fragments and special ids, in order."""
        if self._special_re is None:
            return [text] if text else []
        parts: list[str | int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                parts.append(text[pos : m.start()])
            parts.append(self.special_tokens[m.group()])
            pos = m.end()
        if pos < len(text):
            parts.append(text[pos:])
        return parts

    @abstractmethod
    def _encode(self, text: str, special: bool) -> list[int]:
        """Ids of ``text`` without BOS/EOS."""

    @abstractmethod
    def _decode(self, ids: list[int]) -> str:
        """Text of valid, non-control ids."""

    # ---- chat templates --------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render a conversation with the checkpoint's Jinja chat template, as HF transformers does.

        Args:
            messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``; extra
                keys are passed through to the template.
            add_generation_prompt: end with the header of an assistant turn (what the model
                should continue).

        Returns:
            The prompt text; encode it with ``special=True`` (and ``bos=add_bos`` unless the
            template already starts with the BOS text).

        Raises:
            TorchLlamaError: the tokenizer has no chat template, or the template failed to render
                (including the template's own ``raise_exception`` calls).
            ModelFileError: the template is not valid Jinja.
            ArgumentError: ``messages`` is not a non-empty list of dicts with str 'role' and 'content'.
        """
        if self.chat_template is None:
            raise TorchLlamaError(
                f"{self.source}: the tokenizer has no chat template (GGUF metadata field "
                "'tokenizer.chat_template', or tokenizer_config.json / chat_template.jinja in a "
                "Hugging Face folder); pass a raw prompt instead"
            )
        _validate_messages(messages)
        template = self._get_compiled_template()
        variables: dict[str, Any] = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": bool(add_generation_prompt),
        }
        for name, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("unk_token", self.unk_id),
                        ("pad_token", self.pad_id)):
            variables[name] = self._pieces[i] if i is not None else ""
        try:
            return template.render(**variables)
        except TorchLlamaError:
            raise
        except Exception as e:  # jinja2 UndefinedError, TypeError in the template ...
            raise TorchLlamaError(
                f"{self.source}: the chat template failed to render ({type(e).__name__}: {e})"
            ) from e

    def _get_compiled_template(self) -> Any:
        # Keyed by the text, so that assigning a new ``chat_template`` takes effect.
        cached = self._compiled_template
        if cached is None or cached[0] is not self.chat_template:
            cached = (self.chat_template, _compile_chat_template(self.chat_template, self.source))
            self._compiled_template = cached
        return cached[1]

    # ---- export -------------------------------------------------------------------------------

    def gguf_fields(self) -> dict[str, Any]:
        """This tokenizer as GGUF ``tokenizer.*`` metadata (what `load_tokenizer` reads back).

        Raises:
            TorchLlamaError: the vocabulary cannot be expressed in GGUF.
        """
        raise TorchLlamaError(f"{self.source}: this tokenizer cannot be written to GGUF")

    def save_hf(self, folder: str | os.PathLike) -> None:
        """Write Hugging Face tokenizer files into ``folder``: the vocabulary (``tokenizer.json``
        or ``tokenizer.model``) and ``tokenizer_config.json`` (special tokens, add_bos_token,
        chat_template), which `load_hf_tokenizer` and transformers read."""
        raise NotImplementedError

    def save_meta(self, folder: str | os.PathLike) -> None:
        """Write the tokenizer file of a Meta checkpoint folder: Meta's own ``tokenizer.model``
        (SentencePiece for Llama 2, tiktoken for Llama 3), else (a vocabulary Meta's format has
        no file for) the `save_hf` files, which `torchllama.load` reads in a Meta folder too."""
        self.save_hf(folder)

    def _gguf_common_fields(self) -> dict[str, Any]:
        return {
            "tokenizer.ggml.bos_token_id": self.bos_id,
            "tokenizer.ggml.eos_token_id": self.eos_id,
            "tokenizer.ggml.unknown_token_id": self.unk_id,
            "tokenizer.ggml.padding_token_id": self.pad_id,
            "tokenizer.ggml.add_bos_token": self.add_bos,
            "tokenizer.ggml.add_eos_token": self.add_eos,
            "tokenizer.chat_template": self.chat_template,
        }

    def _write_hf_config(self, folder: str | os.PathLike, tokenizer_class: str) -> None:
        def text(i: int | None) -> str | None:
            return None if i is None else self._pieces[i]

        config = {
            "tokenizer_class": tokenizer_class,
            "bos_token": text(self.bos_id), "eos_token": text(self.eos_id),
            "unk_token": text(self.unk_id), "pad_token": text(self.pad_id),
            "add_bos_token": self.add_bos, "add_eos_token": self.add_eos,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos})"
        )


def _validate_messages(messages: Any) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ArgumentError(
            f"messages must be a list of {{'role': str, 'content': str}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise ArgumentError("messages must contain at least one message, got an empty list")
    for n, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ArgumentError(f"messages[{n}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ArgumentError(f"messages[{n}] has no {key!r} key (expected 'role' and 'content')")
            if not isinstance(m[key], str):
                raise ArgumentError(f"messages[{n}][{key!r}] must be a str, got {type(m[key]).__name__}")


def _compile_chat_template(source_text: str, source: str) -> Any:
    """Compile a chat template in the sandboxed environment HF transformers uses."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TorchLlamaError(f"{source}: chat template error: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Like HF: no HTML escaping (Jinja's own tojson escapes '<', '>', '&').
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source_text)
    except jinja2.TemplateSyntaxError as e:
        raise ModelFileError(
            f"{source}: metadata field 'tokenizer.chat_template' is not a valid Jinja template "
            f"(line {e.lineno}: {e.message})"
        ) from e


# ------------------------------------------------------------------------------------------------
# SentencePiece
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# Byte-level BPE
# ------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# Llama 3: tiktoken BPE files
# ------------------------------------------------------------------------------------------------

#: Meta's pre-tokenizer regex for Llama 3 (``Tokenizer.pat_str`` in meta-llama/llama3
#: ``llama/tokenizer.py`` and llama-models ``models/llama3/tokenizer.py``); llama.cpp calls it
#: 'llama-bpe'.
LLAMA3_PAT_STR = _LLAMA3_PATTERN

#: Meta's special tokens of Llama 3.1+ (llama-models ``models/llama3/tokenizer.py``), in id order
#: after the 128,000 regular tokens: ``<|begin_of_text|>`` 128000, ``<|end_of_text|>`` 128001,
#: ``<|start_header_id|>`` 128006, ``<|end_header_id|>`` 128007, ``<|eom_id|>`` 128008,
#: ``<|eot_id|>`` 128009, ... 256 in all (``num_reserved_special_tokens``). Llama 3.0's list
#: (meta-llama/llama3) has the same ids for these and calls the others reserved tokens.
LLAMA3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",  # end of message (tool call)
    "<|eot_id|>",  # end of turn
    "<|python_tag|>",
    "<|image|>",
) + tuple(f"<|reserved_special_token_{2 + i}|>" for i in range(256 - 12))

#: Meta's Llama 3 chat format (``ChatFormat.encode_dialog_prompt`` in meta-llama/llama3
#: ``llama/tokenizer.py``) as a Jinja chat template: ``<|begin_of_text|>``, then per message
#: ``<|start_header_id|>{role}<|end_header_id|>\n\n{content stripped}<|eot_id|>``, then the
#: assistant's header. Given to tokenizers read from a tiktoken file, which carry no template.
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte → printable character table (``bytes_to_unicode`` in openai/gpt-2
    ``encoder.py``), the alphabet of byte-level BPE vocabularies (``'Ġ'`` is the space byte)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_BYTE_CHARS = _gpt2_byte_chars()


def read_tiktoken_bpe(path: str | os.PathLike) -> list[bytes]:
    """The regular tokens of a tiktoken BPE file, as bytes, indexed by rank (= token id).

    The format (tiktoken's ``load_tiktoken_bpe``, Meta's Llama 3 ``tokenizer.model``): one line
    per token, ``base64(token bytes) rank``. The ranks must be 0 .. n-1, each once, and every
    single byte must be a token (byte-level BPE can then encode any text).

    Raises:
        ModelFileError: unreadable or empty file, a malformed line (the message names the file and
            the line), a repeated token or rank, a missing rank or byte.
    """
    import base64
    import binascii

    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the file ({e.strerror or e})") from e
    by_rank: dict[int, bytes] = {}
    seen: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        where = f"{path}: line {number}"
        if len(fields) != 2:
            raise ModelFileError(f"{where}: expected 'base64-token rank', got {_line_text(line)}")
        try:
            token = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError) as e:
            raise ModelFileError(f"{where}: the token {_line_text(fields[0])} is not valid base64 ({e})") from e
        if not fields[1].isdigit():
            raise ModelFileError(f"{where}: the rank {_line_text(fields[1])} is not a non-negative integer")
        rank = int(fields[1])
        if not token:
            raise ModelFileError(f"{where}: empty token")
        if token in seen:
            raise ModelFileError(f"{where}: token {token!r} already has rank {seen[token]}")
        if rank in by_rank:
            raise ModelFileError(f"{where}: rank {rank} already belongs to token {by_rank[rank]!r}")
        seen[token], by_rank[rank] = rank, token
    if not by_rank:
        raise ModelFileError(f"{path}: empty tiktoken BPE file (expected lines 'base64-token rank')")
    n = len(by_rank)
    if max(by_rank) != n - 1:
        missing = next(r for r in range(n) if r not in by_rank)
        raise ModelFileError(f"{path}: ranks are not 0..{n - 1} (rank {missing} is missing, the "
                             f"largest is {max(by_rank)})")
    missing_bytes = [b for b in range(256) if bytes([b]) not in seen]
    if missing_bytes:
        raise ModelFileError(f"{path}: not a byte-level BPE vocabulary: {len(missing_bytes)} single "
                             f"bytes have no token (first: 0x{missing_bytes[0]:02x})")
    return [by_rank[r] for r in range(n)]


def _line_text(raw: bytes) -> str:
    return repr(raw[:60].decode("latin-1")) + ("..." if len(raw) > 60 else "")


def tiktoken_to_bpe(ranks: Sequence[bytes]) -> tuple[list[str], list[tuple[str, str]]]:
    """A tiktoken vocabulary as the (tokens, merges) of a byte-level BPE model.

    Converted as HF transformers' ``TikTokenConverter.extract_vocab_merges_from_model``
    (``convert_slow_tokenizer.py``) does: tokens become GPT-2 byte-level strings; every split of a
    token into two tokens is a merge, merges are ordered by the rank of the token they make
    (ties by the ranks of the parts). With ``ignore_merges`` (a word that is a token is taken
    whole, as tiktoken does) HF ``tokenizers`` then encodes exactly like tiktoken.

    Args:
        ranks: token bytes indexed by rank (`read_tiktoken_bpe`).

    Returns:
        tokens: byte-level strings, index = id; merges: pairs of tokens in priority order.
    """
    rank_of = {t: r for r, t in enumerate(ranks)}
    chars = _BYTE_CHARS
    tokens = ["".join([chars[b] for b in t]) for t in ranks]
    merges: list[tuple[int, int, int]] = []
    for rank, token in enumerate(ranks):
        local = []
        for cut in range(1, len(token)):
            left, right = rank_of.get(token[:cut]), rank_of.get(token[cut:])
            if left is not None and right is not None:
                local.append((rank, left, right))
        merges.extend(sorted(local))
    return tokens, [(tokens[left], tokens[right]) for _, left, right in merges]


class TiktokenTokenizer(BPETokenizer):
    """Meta's Llama 3 tokenizer: a tiktoken BPE file (``tokenizer.model``) plus Meta's special
    tokens, run by HF ``tokenizers`` (a :class:`BPETokenizer`).

    Meta's ``Tokenizer`` (meta-llama/llama3 ``llama/tokenizer.py``) builds a ``tiktoken.Encoding``
    from the file's ranks, its ``pat_str`` regex (`LLAMA3_PAT_STR`) and 256 special tokens
    numbered after the regular ones (`LLAMA3_SPECIAL_TOKENS`). Here the ranks become a
    byte-level BPE vocabulary with merges (`tiktoken_to_bpe`, as transformers converts them) and
    the pipeline is llama.cpp's 'llama-bpe' one: split on Meta's regex, byte-level BPE with
    ``ignore_merges``, byte-level decoder; the special tokens are control tokens. The ids equal
    tiktoken's. (Meta also cuts runs over 25,000 whitespace or non-whitespace characters before
    tiktoken sees them, a workaround for tiktoken's recursion limit; HF ``tokenizers`` needs none.)

    BOS is ``<|begin_of_text|>`` (added to prompts: ``add_bos``), EOS ``<|end_of_text|>``;
    ``<|eot_id|>`` and ``<|eom_id|>`` also stop generation. The chat template is Meta's chat
    format (`LLAMA3_CHAT_TEMPLATE`). `save_meta` writes the tiktoken file back; `save_hf` writes a
    ``tokenizer.json``, `gguf_fields` GGUF's 'gpt2' fields with ``tokenizer.ggml.pre`` 'llama-bpe'.

    Args:
        ranks: regular tokens as bytes, index = rank = id (`read_tiktoken_bpe`).
        special_tokens: names of the special tokens that follow them.
        source: name used in error messages.
        chat_template: Jinja chat template (default: Meta's Llama 3 chat format).
    """

    def __init__(
        self,
        ranks: Sequence[bytes],
        *,
        special_tokens: Sequence[str] = LLAMA3_SPECIAL_TOKENS,
        source: str = "<tiktoken ranks>",
        chat_template: str | None = LLAMA3_CHAT_TEMPLATE,
    ) -> None:
        tokens, merges = tiktoken_to_bpe(ranks)
        n = len(tokens)
        ids = {t: n + i for i, t in enumerate(special_tokens)}
        super().__init__(
            tokens + list(special_tokens),
            merges,
            [TOKEN_TYPE_NORMAL] * n + [TOKEN_TYPE_CONTROL] * len(special_tokens),
            pre="llama-bpe",
            source=source,
            bos_id=ids.get("<|begin_of_text|>"),
            eos_id=ids.get("<|end_of_text|>"),
            add_bos=True,
            chat_template=chat_template,
        )
        self._ranks = list(ranks)
        self._special_names = list(special_tokens)
        if self.bos_id is not None:
            # For transformers, which reads add_special_tokens off tokenizer.json (our encode
            # adds none): BOS before each sequence, as in Meta's Hugging Face Llama 3 release.
            from tokenizers import processors

            bos = self._pieces[self.bos_id]
            self._tok.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, self.bos_id)])

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs: Any) -> TiktokenTokenizer:
        """Load a tiktoken BPE file (Meta's Llama 3 ``tokenizer.model``; keyword arguments as for
        the constructor).

        Raises:
            ModelFileError: see `read_tiktoken_bpe`.
        """
        path = os.fspath(path)
        kwargs.setdefault("source", path)
        return cls(read_tiktoken_bpe(path), **kwargs)

    def tiktoken_bpe(self) -> bytes:
        """The regular tokens as a tiktoken BPE file (``base64(token) rank`` lines), the bytes of
        Meta's ``tokenizer.model``. The special tokens are not in it: Meta's code adds them."""
        import base64

        return b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(self._ranks))

    def save_meta(self, folder: str | os.PathLike) -> None:
        """``tokenizer.model`` in tiktoken's format, as Meta ships Llama 3."""
        if self._special_names != list(LLAMA3_SPECIAL_TOKENS):
            super().save_meta(folder)  # other special tokens: Meta's code would not restore them
            return
        Path(folder, "tokenizer.model").write_bytes(self.tiktoken_bpe())


def _is_tiktoken_file(path: str | os.PathLike) -> bool:
    """Whether a tokenizer.model is a tiktoken text file rather than a SentencePiece protobuf:
    its start is printable ASCII (a SentencePiece model starts with binary protobuf fields).

    Raises:
        ModelFileError: the file cannot be read.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the file ({e.strerror or e})") from e
    return bool(head) and re.fullmatch(rb"[\x20-\x7e\t\r\n]*", head) is not None


# ------------------------------------------------------------------------------------------------
# GGUF metadata
# ------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# Hugging Face tokenizer files
# ------------------------------------------------------------------------------------------------


def _read_json_object(path: str, optional: bool = True) -> dict[str, Any] | None:
    """The JSON object in ``path``; None if the file is absent and ``optional``."""
    if not os.path.isfile(path):
        if optional:
            return None
        raise ModelFileError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(value, dict):
        raise ModelFileError(f"{path}: expected a JSON object, got a {type(value).__name__}")
    return value


def _hf_token_text(value: Any, key: str, where: str) -> str | None:
    """A special token as written in tokenizer_config.json: a string, an AddedToken dict with
    'content', or null."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"] or None
    raise ModelFileError(f"{where}: {key!r} is {value!r}, expected a string or a dict with 'content'")


def _hf_chat_template(folder: str, config: Mapping[str, Any], config_path: str) -> str | None:
    """The default chat template, found where HF transformers looks: chat_template.jinja (written
    by transformers ≥ 4.50) wins over tokenizer_config.json's 'chat_template' (a string, or a list
    of {'name', 'template'} of which 'default' is used); chat_template.json as a last resort."""
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        try:
            with open(jinja_path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFileError(f"{jinja_path}: not a readable text file ({e})") from e
    where, value = config_path, config.get("chat_template")
    if value is None:
        json_path = os.path.join(folder, "chat_template.json")
        value = (_read_json_object(json_path) or {}).get("chat_template")
        where = json_path
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
            isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in value):
        return {t["name"]: t["template"] for t in value}.get("default")
    raise ModelFileError(
        f"{where}: 'chat_template' must be a string or a list of {{'name', 'template'}} dicts")


def _hf_id_list(value: Any, key: str, where: str, n: int) -> list[int]:
    """A token id field of config/generation_config (an int, a list of ints, or null)."""
    values = value if isinstance(value, list) else [value] if value is not None else []
    for i in values:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ModelFileError(f"{where}: {key!r} is {value!r}, expected token ids in 0..{n - 1}")
    return values


def load_hf_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer of a Hugging Face model folder, the way HF transformers reads it.

    Files used:

    - ``tokenizer.json`` (preferred, as transformers' fast tokenizers are) → :class:`HFTokenizer`;
      else ``tokenizer.model`` (SentencePiece) → :class:`SentencePieceTokenizer`.
    - ``tokenizer_config.json`` (else ``special_tokens_map.json``): ``bos_token``, ``eos_token``,
      ``pad_token``, ``unk_token`` (strings or dicts with 'content'; null means none),
      ``add_bos_token``, ``add_eos_token`` and ``chat_template``. When ``add_bos_token`` is absent
      it is read off ``tokenizer.json``'s post-processor (does it prepend BOS?); a SentencePiece
      tokenizer adds BOS by default, as HF's ``LlamaTokenizer``.
    - ``chat_template.jinja`` (overrides the config's template, as in transformers).
    - ``generation_config.json``: ``eos_token_id`` (an id or a list, e.g. Llama 3.1's three) are
      stop ids; its ``bos/eos/pad_token_id`` also stand in for special tokens the tokenizer
      files do not name.

    Raises:
        ModelFileError: no tokenizer file, a malformed file, or a special token that is not in the
            vocabulary (the message names the file).
    """
    folder = os.fspath(folder)
    config_path = os.path.join(folder, "tokenizer_config.json")
    map_path = os.path.join(folder, "special_tokens_map.json")
    gen_path = os.path.join(folder, "generation_config.json")
    config = _read_json_object(config_path) or {}
    special_map = _read_json_object(map_path) or {}
    gen = _read_json_object(gen_path) or {}
    chat_template = _hf_chat_template(folder, config, config_path)

    json_path = os.path.join(folder, "tokenizer.json")
    sp_path = os.path.join(folder, "tokenizer.model")
    if os.path.isfile(json_path):
        tok = _read_tokenizer_json(json_path)
        tok_path, n = json_path, max(tok.get_vocab(with_added_tokens=True).values()) + 1
        lookup = tok.token_to_id
    elif os.path.isfile(sp_path) and _is_tiktoken_file(sp_path):
        return TiktokenTokenizer.from_file(sp_path)  # Llama 3's: Meta's special tokens and format
    elif os.path.isfile(sp_path):
        with open(sp_path, "rb") as f:
            proto = _parse_sp_proto(f.read(), sp_path)
        first_id: dict[str, int] = {}
        for i, p in enumerate(proto.pieces):
            first_id.setdefault(p.piece, i)
        tok, tok_path, n, lookup = None, sp_path, len(proto.pieces), first_id.get
    else:
        raise ModelFileError(
            f"{folder}: no tokenizer (expected tokenizer.json or a SentencePiece tokenizer.model)")

    ids: dict[str, int | None] = {}
    for name in ("bos", "eos", "pad", "unk"):
        key = f"{name}_token"
        where = config_path if key in config else map_path if key in special_map else None
        if where is None:  # not named by the tokenizer files: generation_config's id, if any
            found = _hf_id_list(gen.get(f"{key}_id"), f"{key}_id", gen_path, n)
            ids[name] = found[0] if found else None
            continue
        text = _hf_token_text((config if where == config_path else special_map)[key], key, where)
        ids[name] = None if text is None else lookup(text)
        if text is not None and ids[name] is None:
            raise ModelFileError(f"{where}: {key} {text!r} is not in the vocabulary of {tok_path}")
    if tok is not None and ids["unk"] is None and getattr(tok.model, "unk_token", None):
        ids["unk"] = tok.token_to_id(tok.model.unk_token)
    stop_ids = _hf_id_list(gen.get("eos_token_id"), "eos_token_id", gen_path, n)

    flags: dict[str, bool] = {}
    for name, position in (("bos", 0), ("eos", -1)):
        key = f"add_{name}_token"
        value = config.get(key)
        if value is not None and not isinstance(value, bool):
            raise ModelFileError(f"{config_path}: {key!r} is {value!r}, expected true or false")
        if value is None:
            if tok is None:  # HF LlamaTokenizer (SentencePiece): add_bos_token=True, add_eos_token=False
                value = name == "bos"
            else:  # does the post-processor add it?
                with_special = tok.encode("a", add_special_tokens=True).ids
                without = tok.encode("a", add_special_tokens=False).ids
                value = (ids[name] is not None and len(with_special) > len(without)
                         and with_special[position] == ids[name])
        flags[name] = value

    common = dict(bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["pad"], add_bos=flags["bos"],
                  add_eos=flags["eos"], extra_stop_ids=stop_ids, chat_template=chat_template)
    if tok is None:
        return SentencePieceTokenizer(proto, source=sp_path, **common)
    return HFTokenizer(tok, source=json_path, unk_id=ids["unk"], **common)


def load_tokenizer_file(path: Path) -> Tokenizer:
    """The tokenizer in one file: Meta's ``tokenizer.model``, either a SentencePiece model (Llama
    1/2; BOS/EOS from the model, add_bos True as Meta's reference prepends BOS to every prompt)
    or a tiktoken BPE file (Llama 3: `TiktokenTokenizer`), or a ``tokenizer.json`` with the
    tokenizer files of its folder (`load_hf_tokenizer`).

    Raises:
        ModelFileError: missing or unreadable file; a text file that is not a valid tiktoken file
            (the message names the line); a binary file that is not a SentencePiece model.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such tokenizer file")
    if path.name == "tokenizer.json":
        return load_hf_tokenizer(path.parent)
    if _is_tiktoken_file(path):
        return TiktokenTokenizer.from_file(path)
    return SentencePieceTokenizer.from_file(path, add_bos=True)
