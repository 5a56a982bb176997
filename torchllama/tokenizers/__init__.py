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

Layout (each module imports its siblings directly, never this package):

- ``base.py``: the :class:`Tokenizer` interface; GGUF token types, :data:`END_OF_TURN_TOKENS`,
  GPT-2's byte alphabet.
- ``chat.py``: chat templates (the message checks, transformers' sandboxed Jinja environment).
- ``sentencepiece.py``: :class:`SentencePieceTokenizer`.
- ``pretokenizers.py``: byte-level BPE pre-tokenizers by their GGUF ``tokenizer.ggml.pre`` name.
- ``hf.py``: :class:`HFTokenizer` (a HF ``tokenizers`` pipeline, e.g. ``tokenizer.json``).
- ``bpe.py``: :class:`BPETokenizer` (GGUF byte-level BPE, an ``HFTokenizer``).
- ``tiktoken.py``: :class:`TiktokenTokenizer`, `read_tiktoken_bpe`, `tiktoken_to_bpe` and Meta's
  Llama 3 special tokens, regex and chat format.
- ``gguf_fields.py``: checked readers of the ``tokenizer.ggml.*`` fields;
  ``gguf.py``: :func:`tokenizer_from_gguf_metadata`.
- ``files.py``: :func:`load_hf_tokenizer` (a Hugging Face folder), :func:`load_tokenizer_file`
  (one file).
"""

from torchllama.tokenizers.base import (END_OF_TURN_TOKENS, SPM_SPACE, TOKEN_TYPE_BYTE,
                                        TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN,
                                        TOKEN_TYPE_UNUSED, TOKEN_TYPE_USER_DEFINED, Tokenizer)
from torchllama.tokenizers.sentencepiece import SentencePieceTokenizer
from torchllama.tokenizers.hf import HFTokenizer
from torchllama.tokenizers.bpe import BPETokenizer
from torchllama.tokenizers.tiktoken import (LLAMA3_CHAT_TEMPLATE, LLAMA3_PAT_STR,
                                            LLAMA3_SPECIAL_TOKENS, TiktokenTokenizer,
                                            read_tiktoken_bpe, tiktoken_to_bpe)
from torchllama.tokenizers.gguf import tokenizer_from_gguf_metadata
from torchllama.tokenizers.files import load_hf_tokenizer, load_tokenizer_file

__all__ = [
    "BPETokenizer", "END_OF_TURN_TOKENS", "HFTokenizer", "LLAMA3_CHAT_TEMPLATE", "LLAMA3_PAT_STR",
    "LLAMA3_SPECIAL_TOKENS", "SPM_SPACE", "SentencePieceTokenizer", "TOKEN_TYPE_BYTE",
    "TOKEN_TYPE_CONTROL", "TOKEN_TYPE_NORMAL", "TOKEN_TYPE_UNKNOWN", "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_USER_DEFINED", "TiktokenTokenizer", "Tokenizer", "load_hf_tokenizer",
    "load_tokenizer_file", "read_tiktoken_bpe", "tiktoken_to_bpe", "tokenizer_from_gguf_metadata",
]
