"""The interface every tokenizer implements, and what the kinds share.

`Tokenizer` holds the common part: special ids, stop ids, the special-token splitter, BOS/EOS
handling in :meth:`~Tokenizer.encode`, control-token skipping in :meth:`~Tokenizer.decode`,
:meth:`~Tokenizer.token_bytes` for grammar-constrained decoding and
:meth:`~Tokenizer.apply_chat_template` (rendered by `torchllama.tokenizers.chat`). Each kind
(SentencePiece, HF ``tokenizers``, GGUF byte-level BPE, tiktoken) implements ``_encode`` and
``_decode`` and its own exports (`~Tokenizer.gguf_fields`, `~Tokenizer.save_hf`,
`~Tokenizer.save_meta`).

Also here: GGUF's token types (llama.cpp's ``llama_token_type``), the end-of-turn tokens of common
chat formats, and GPT-2's byte → character table (the alphabet of byte-level BPE vocabularies).
"""

from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from torchllama.errors import ArgumentError, TorchLlamaError
from torchllama.tokenizers.chat import _compile_chat_template, _validate_messages


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

    # --8<-- [start:encode]
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
    # --8<-- [end:encode]

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
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Render a conversation with the checkpoint's Jinja chat template, as HF transformers does.

        Args:
            messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``; extra
                keys are passed through to the template.
            add_generation_prompt: end with the header of an assistant turn (what the model
                should continue).
            tools: OpenAI's tool objects, given to the template as ``tools`` (transformers'
                ``apply_chat_template(tools=...)``); templates that do not read it ignore it.
            variables: more template variables (transformers' ``**kwargs``, e.g. Qwen3's
                ``enable_thinking``); they cannot replace the ones above.

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
        context: dict[str, Any] = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": bool(add_generation_prompt),
        }
        if tools is not None:
            context["tools"] = [dict(t) for t in tools]
        for name, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("unk_token", self.unk_id),
                        ("pad_token", self.pad_id)):
            context[name] = self._pieces[i] if i is not None else ""
        for key, value in (variables or {}).items():
            context.setdefault(key, value)
        try:
            return template.render(**context)
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
