"""Meta's Llama 3 tokenizer: a tiktoken BPE file (``tokenizer.model``, ``base64(token) rank``
lines) plus Meta's special tokens and chat format.

:class:`TiktokenTokenizer` converts the ranks to byte-level BPE merges (`tiktoken_to_bpe`) and
runs them as a :class:`BPETokenizer`; the ids equal tiktoken's.

Sources: tiktoken (https://github.com/openai/tiktoken, ``load_tiktoken_bpe``), Meta's Llama 3
``llama/tokenizer.py`` (meta-llama/llama3, llama-models), HF transformers'
``convert_slow_tokenizer.py`` (``TikTokenConverter``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchllama.errors import ModelFileError
from torchllama.tokenizers.base import _BYTE_CHARS, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL
from torchllama.tokenizers.bpe import BPETokenizer
from torchllama.tokenizers.pretokenizers import _LLAMA3_PATTERN


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
