"""Tokenizer files on disk: :func:`load_hf_tokenizer` reads a Hugging Face model folder (the
vocabulary, special tokens, BOS flag, chat template and stop ids, as transformers reads them),
:func:`load_tokenizer_file` one file (Meta's ``tokenizer.model``: SentencePiece or tiktoken; or a
``tokenizer.json`` with its folder).

Source: HF transformers (``PreTrainedTokenizerBase.from_pretrained``, ``GenerationConfig``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from torchllama.errors import ModelFileError
from torchllama.tokenizers.base import Tokenizer
from torchllama.tokenizers.hf import HFTokenizer, _read_tokenizer_json
from torchllama.tokenizers.sentencepiece import SentencePieceTokenizer, _parse_sp_proto
from torchllama.tokenizers.tiktoken import TiktokenTokenizer


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
    configs = _HFConfigFiles.read(folder)
    chat_template = _hf_chat_template(folder, configs.config, configs.config_path)
    vocab = _hf_vocabulary(folder)
    if vocab is None:  # a tiktoken tokenizer.model (Llama 3): Meta's special tokens and format
        return TiktokenTokenizer.from_file(os.path.join(folder, "tokenizer.model"))
    ids = _hf_special_ids(configs, vocab)
    stop_ids = _hf_id_list(configs.gen.get("eos_token_id"), "eos_token_id", configs.gen_path,
                           vocab.size)
    common = dict(bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["pad"],
                  add_bos=_hf_add_token(configs, vocab, "bos", ids["bos"]),
                  add_eos=_hf_add_token(configs, vocab, "eos", ids["eos"]),
                  extra_stop_ids=stop_ids, chat_template=chat_template)
    if vocab.tok is None:
        return SentencePieceTokenizer(vocab.proto, source=vocab.path, **common)
    return HFTokenizer(vocab.tok, source=vocab.path, unk_id=ids["unk"], **common)


class _HFConfigFiles(NamedTuple):
    """The JSON files around the vocabulary of a Hugging Face folder, ``{}`` where absent."""

    config_path: str  # tokenizer_config.json
    config: dict[str, Any]
    map_path: str  # special_tokens_map.json
    special_map: dict[str, Any]
    gen_path: str  # generation_config.json
    gen: dict[str, Any]

    @classmethod
    def read(cls, folder: str) -> _HFConfigFiles:
        """Read them from ``folder``.

        Raises:
            ModelFileError: a file that is present but not a JSON object.
        """
        paths = [os.path.join(folder, name) for name in
                 ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")]
        config, special_map, gen = (_read_json_object(p) or {} for p in paths)
        return cls(paths[0], config, paths[1], special_map, paths[2], gen)


class _HFVocabulary(NamedTuple):
    """The vocabulary file of a Hugging Face folder, as the config files need it."""

    path: str  # tokenizer.json or tokenizer.model
    size: int  # number of ids
    lookup: Callable[[str], int | None]  # token text -> its (first) id, None if absent
    tok: Any = None  # the tokenizers.Tokenizer of a tokenizer.json
    proto: Any = None  # the SentencePiece ModelProto of a tokenizer.model


def _hf_vocabulary(folder: str) -> _HFVocabulary | None:
    """The folder's ``tokenizer.json`` (preferred, as in transformers), else its SentencePiece
    ``tokenizer.model``; None if ``tokenizer.model`` is a tiktoken file (Llama 3's).

    Raises:
        ModelFileError: neither file, or one that cannot be read.
    """
    json_path = os.path.join(folder, "tokenizer.json")
    sp_path = os.path.join(folder, "tokenizer.model")
    if os.path.isfile(json_path):
        tok = _read_tokenizer_json(json_path)
        n = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        return _HFVocabulary(json_path, n, tok.token_to_id, tok=tok)
    if os.path.isfile(sp_path) and _is_tiktoken_file(sp_path):
        return None
    if os.path.isfile(sp_path):
        with open(sp_path, "rb") as f:
            proto = _parse_sp_proto(f.read(), sp_path)
        first_id: dict[str, int] = {}
        for i, p in enumerate(proto.pieces):
            first_id.setdefault(p.piece, i)
        return _HFVocabulary(sp_path, len(proto.pieces), first_id.get, proto=proto)
    raise ModelFileError(
        f"{folder}: no tokenizer (expected tokenizer.json or a SentencePiece tokenizer.model)")


def _hf_special_ids(configs: _HFConfigFiles, vocab: _HFVocabulary) -> dict[str, int | None]:
    """'bos', 'eos', 'pad', 'unk' → id: the ``{name}_token`` of tokenizer_config.json, else of
    special_tokens_map.json, else generation_config.json's ``{name}_token_id``; an unknown token
    no file names is the tokenizer.json model's ``unk_token``.

    Raises:
        ModelFileError: a malformed entry, or a token that is not in the vocabulary.
    """
    ids: dict[str, int | None] = {}
    for name in ("bos", "eos", "pad", "unk"):
        key = f"{name}_token"
        if key in configs.config:
            where, value = configs.config_path, configs.config[key]
        elif key in configs.special_map:
            where, value = configs.map_path, configs.special_map[key]
        else:  # not named by the tokenizer files: generation_config's id, if any
            found = _hf_id_list(configs.gen.get(f"{key}_id"), f"{key}_id", configs.gen_path,
                                vocab.size)
            ids[name] = found[0] if found else None
            continue
        text = _hf_token_text(value, key, where)
        ids[name] = None if text is None else vocab.lookup(text)
        if text is not None and ids[name] is None:
            raise ModelFileError(f"{where}: {key} {text!r} is not in the vocabulary of {vocab.path}")
    tok = vocab.tok
    if tok is not None and ids["unk"] is None and getattr(tok.model, "unk_token", None):
        ids["unk"] = tok.token_to_id(tok.model.unk_token)
    return ids


def _hf_add_token(configs: _HFConfigFiles, vocab: _HFVocabulary, name: str,
                  token_id: int | None) -> bool:
    """Whether prompts get the ``name`` ('bos' or 'eos') token: tokenizer_config.json's
    ``add_{name}_token``; absent, whether tokenizer.json's post-processor adds it (BOS first, EOS
    last), or for a SentencePiece model HF ``LlamaTokenizer``'s defaults (BOS yes, EOS no).

    Raises:
        ModelFileError: ``add_{name}_token`` is not a boolean.
    """
    key = f"add_{name}_token"
    value = configs.config.get(key)
    if value is not None and not isinstance(value, bool):
        raise ModelFileError(f"{configs.config_path}: {key!r} is {value!r}, expected true or false")
    if value is not None:
        return value
    if vocab.tok is None:  # HF LlamaTokenizer (SentencePiece): add_bos_token=True, add_eos_token=False
        return name == "bos"
    # does the post-processor add it?
    with_special = vocab.tok.encode("a", add_special_tokens=True).ids
    without = vocab.tok.encode("a", add_special_tokens=False).ids
    position = 0 if name == "bos" else -1
    return (token_id is not None and len(with_special) > len(without)
            and with_special[position] == token_id)


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
