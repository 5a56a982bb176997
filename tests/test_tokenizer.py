"""Tests of torchllama.tokenizers: SentencePiece (Llama 2 vocabulary) and byte-level BPE (SmolLM2).

Oracles: token ids published for Llama 2's vocabulary (and llama.cpp's tokenizer tests), and HF
transformers' GGUF tokenizer loader where it agrees with the reference tokenizers (see the notes at
the HF comparisons for where it does not).
"""

from __future__ import annotations

import os
from pathlib import Path

# huggingface_hub reads this when imported: never reach for the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from torchllama.errors import ArgumentError, ModelFileError, TorchLlamaError
from conftest import LLAMA_SPM_VOCAB, byte_level_alphabet
from torchllama.checkpoint import load_tokenizer
from torchllama.tokenizers import (
    BPETokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    tokenizer_from_gguf_metadata,
)

SPM_GGUF = LLAMA_SPM_VOCAB

# Varied text: unicode, emoji, CJK, accents, whitespace runs, tabs, newlines, code, digits,
# punctuation, contractions, strings that look like special tokens.
TEXTS = [
    "Hello world",
    " Hello world",
    "  two leading spaces",
    "trailing spaces   ",
    "a  b   c    d",
    "tabs\tand\t\ttabs",
    "line1\nline2\n\n\nline5\r\n",
    "\n",
    "   ",
    "😀🎉 emoji, 👩‍👩‍👧 family",
    "漢字とかな、한국어 中文",
    "café naïve résumé Ωμέγα Привет, мир!",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))",
    "12345678901234567890",
    "3.14159, 1,000,000 and 2024-01-31",
    "x=1;y=22;z=333;w=4444",
    "I'm sure you're right; they'll say we've won and he'd agree. DON'T",
    "!!!???...,,,;;; --- ~~~ ***",
    "<|im_start|> <s> </s> literal <|im_end|>",
    "mixed😀text漢字123abc",
    "\u00a0non-breaking\u2009thin space",
    "The quick brown fox jumps over the lazy dog. " * 3,
]


@pytest.fixture(scope="module")
def spm(llama_spm_tokenizer) -> Tokenizer:
    return llama_spm_tokenizer


@pytest.fixture(scope="module")
def spm_metadata() -> dict:
    if not SPM_GGUF.is_file():
        pytest.skip(f"test vocabulary {SPM_GGUF} not present")
    from torchllama.checkpoint.gguf import open_gguf, read_metadata

    return read_metadata(open_gguf(SPM_GGUF))


@pytest.fixture(scope="module")
def smol(smollm2) -> Tokenizer:
    # the embedded model's tokenizer as `torchllama.load` reads it for the shared model (the same
    # `tokenizer_from_gguf_metadata` as `load_tokenizer`, which `spm` exercises on a GGUF file)
    return smollm2[1]


def _hf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_smol(hf_smollm2_tokenizer):
    return hf_smollm2_tokenizer                # AutoTokenizer on the embedded GGUF (conftest)


@pytest.fixture(scope="module")
def hf_spm():
    if not SPM_GGUF.is_file():
        pytest.skip(f"test vocabulary {SPM_GGUF} not present")
    return _hf_tokenizer(SPM_GGUF)


# ------------------------------------------------------------------------------------------------
# SentencePiece: Llama 2's vocabulary
# ------------------------------------------------------------------------------------------------


def test_spm_known_ids(spm):
    assert isinstance(spm, SentencePieceTokenizer)
    assert spm.encode("Hello world") == [15043, 3186]
    assert spm.encode(" Hello world") == [29871, 15043, 3186]
    assert spm.encode("Hello world", bos=True) == [1, 15043, 3186]
    assert spm.encode("Hello world", bos=True, eos=True) == [1, 15043, 3186, 2]
    assert spm.encode("") == []
    assert spm.encode("", bos=True) == [1]


def test_spm_properties(spm):
    assert spm.vocab_size == 32000
    assert (spm.bos_id, spm.eos_id, spm.pad_id, spm.unk_id) == (1, 2, None, 0)
    assert spm.add_bos is True and spm.add_eos is False
    assert spm.special_tokens == {"<s>": 1, "</s>": 2}
    assert spm.stop_ids == frozenset({2})
    assert spm.chat_template is None
    assert spm.id_to_piece(15043) == "▁Hello"
    assert spm.id_to_piece(3) == "<0x00>" and spm.id_to_piece(258) == "<0xFF>"


@pytest.mark.parametrize("char", ["😀", "龘"])
def test_spm_byte_fallback(spm, char):
    pieces = {spm.id_to_piece(i) for i in range(spm.vocab_size)}
    assert char not in pieces and "▁" + char not in pieces
    byte_ids = [3 + b for b in char.encode("utf-8")]  # <0x00>..<0xFF> are ids 3..258
    # The dummy prefix '▁' is a piece of its own, then one id per UTF-8 byte.
    assert spm.id_to_piece(29871) == "▁"
    assert spm.encode(char) == [29871, *byte_ids]
    assert spm.encode("a" + char) == spm.encode("a") + byte_ids
    assert spm.decode(spm.encode(char)) == char


@pytest.mark.parametrize("text", TEXTS)
def test_spm_round_trip(spm, text):
    assert spm.decode(spm.encode(text)) == text
    assert spm.decode(spm.encode(text, bos=True, eos=True)) == text


def test_spm_special_tokens(spm):
    assert spm.encode("<s>", special=True) == [1]
    plain = spm.encode("<s>")
    assert 1 not in plain and spm.decode(plain) == "<s>"
    assert spm.encode("<s>Hello</s>", special=True) == [1, 15043, 2]
    # Each text fragment gets SentencePiece's dummy-prefix space, as after BOS at the start.
    assert spm.encode("a<s>b", special=True) == spm.encode("a") + [1] + spm.encode("b")
    assert spm.encode("a<s>b", special=True) == [263, 1, 289]
    # Without specials in the text, special=True changes nothing.
    assert spm.encode("Hello world", special=True) == [15043, 3186]


def test_spm_decode_whitespace_and_streaming(spm):
    assert spm.decode([1, 15043, 3186, 2]) == "Hello world"  # BOS/EOS are not text
    assert spm.decode([29871, 15043]) == " Hello"  # only the first dummy-prefix space goes
    assert spm.decode([3186]) == "world"  # '▁world' at the start: dummy prefix dropped
    ids = spm.encode("The quick brown fox jumps over the lazy dog, twice.", bos=True)
    texts = [spm.decode(ids[:k]) for k in range(1, len(ids) + 1)]
    for shorter, longer in zip(texts, texts[1:]):
        assert longer.startswith(shorter)  # streaming by decoding the growing list works
    assert texts[-1] == "The quick brown fox jumps over the lazy dog, twice."


def test_spm_matches_hf(spm, hf_spm):
    # HF's GGUF loader differs from SentencePiece/llama.cpp in two known ways, so those inputs
    # are left out: (1) its Metaspace pre-tokenizer does not add the dummy prefix when the text
    # already starts with a space (" Hello" -> [15043] instead of [29871, 15043]); (2) it gives no
    # dummy prefix to text after a special token ("<s>Hello" -> [1, 10994] instead of [1, 15043]).
    # The known ids above cover both.
    compared = [t for t in TEXTS if not t[0].isspace()]
    assert len(compared) > 15
    for text in compared:
        expected = hf_spm.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert spm.encode(text) == expected, text


def test_spm_from_tokenizer_model_file(spm, tmp_path):
    # A tokenizer.model file is a serialized SentencePiece ModelProto: write ours and load it back.
    path = tmp_path / "tokenizer.model"
    path.write_bytes(spm._sp.serialized_model_proto())
    tok = SentencePieceTokenizer.from_file(path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (32000, 1, 2, 0, None)
    assert tok.add_bos is True and tok.stop_ids == frozenset({2})
    for text in TEXTS:
        assert tok.encode(text, bos=True) == spm.encode(text, bos=True)
    assert tok.encode("<s>x</s>", special=True) == [1, *spm.encode("x"), 2]


def test_sentencepiece_file_errors(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        SentencePieceTokenizer.from_file(tmp_path / "missing.model")
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"IQ== 0\nIg== 1\n")  # tiktoken format (Llama 3), not SentencePiece
    with pytest.raises(ModelFileError, match="not a SentencePiece model"):
        SentencePieceTokenizer.from_file(bad)


def test_spm_user_defined_tokens(spm_metadata, spm):
    meta = dict(spm_metadata)
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "<tool>"]
    meta["tokenizer.ggml.scores"] = [*meta["tokenizer.ggml.scores"], 0.0]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 4]
    meta["tokenizer.ggml.eot_token_id"] = 32000
    tok = tokenizer_from_gguf_metadata(meta, "test")
    assert tok.special_tokens["<tool>"] == 32000
    assert tok.stop_ids == frozenset({2, 32000})
    assert tok.encode("<tool>", special=True) == [32000]
    assert tok.encode("x<tool>y", special=True) == spm.encode("x") + [32000] + spm.encode("y")
    # user-defined pieces match in any text, as in SentencePiece, llama.cpp and HF
    plain = tok.encode("x<tool>y")
    assert plain[:2] == spm.encode("x") + [32000] and tok.decode(plain) == "x<tool>y"
    assert tok.decode([15043, 32000]) == "Hello<tool>"  # user-defined tokens are text
    # a control piece does not: without special=True its text is plain text
    assert 2 not in tok.encode("x</s>y") and tok.encode("x</s>y", special=True)[1] == 2
    # llama.cpp writes user-defined pieces with plain spaces; SentencePiece matches them escaped
    meta["tokenizer.ggml.tokens"][-1] = "<a b>"
    spaced = tokenizer_from_gguf_metadata(meta, "test")
    assert 32000 in spaced.encode("x<a b>") and spaced.decode([32000]) == "<a b>"
    assert spaced.gguf_fields()["tokenizer.ggml.tokens"][-1] == "<a b>"


# ------------------------------------------------------------------------------------------------
# Byte-level BPE: SmolLM2
# ------------------------------------------------------------------------------------------------


def test_smollm_properties(smol):
    assert isinstance(smol, BPETokenizer)
    assert smol.vocab_size == 49152
    assert (smol.bos_id, smol.eos_id, smol.pad_id) == (1, 2, 2)
    assert smol.id_to_piece(1) == "<|im_start|>" and smol.id_to_piece(2) == "<|im_end|>"
    assert smol.add_bos is False
    assert 2 in smol.stop_ids and 0 in smol.stop_ids  # <|im_end|>, <|endoftext|>
    assert 1 not in smol.stop_ids
    assert smol.special_tokens["<|im_start|>"] == 1 and len(smol.special_tokens) == 17
    assert smol.chat_template and "<|im_start|>" in smol.chat_template


@pytest.mark.parametrize(
    "text, ids",
    [  # SmolLM2's tokenizer.json / llama.cpp results, independent of HF's GGUF loader
        ("Hello, we can use", [19556, 28, 392, 416, 722]),
        ("The capital of France is", [504, 3575, 282, 4649, 314]),
        ("Hello world! 123", [19556, 905, 17, 216, 33, 34, 35]),
        ("Café déjà vu.", [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30]),
        ("  multiple   spaces", [216, 2701, 256, 5600]),
        ("\n", [198]),
    ],
)
def test_smollm_known_ids(smol, text, ids):
    assert smol.encode(text) == ids


def test_smollm_vocab_ids_match_gguf(smol, hf_smol):
    pieces = [smol.id_to_piece(i) for i in range(smol.vocab_size)]
    assert pieces == hf_smol.convert_ids_to_tokens(list(range(smol.vocab_size)))
    for text, i in smol.special_tokens.items():
        assert smol.encode(text, special=True) == [i]


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_matches_hf(smol, hf_smol, text):
    assert smol.encode(text) == hf_smol.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert smol.encode(text, special=True) == hf_smol.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_round_trip(smol, text):
    assert smol.decode(smol.encode(text)) == text


def test_smollm_digits_are_split(smol):
    # Pre-tokenizer 'smollm' splits every digit off before the GPT-2 regex.
    ids = smol.encode("2024")
    assert [smol.decode([i]) for i in ids] == ["2", "0", "2", "4"]
    assert smol.encode(" 42") == smol.encode(" ") + smol.encode("4") + smol.encode("2")


def test_smollm_special_tokens(smol):
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = smol.encode(text, special=True)
    assert ids == [1, *smol.encode("user\nhi"), 2]
    plain = smol.encode(text)
    assert 1 not in plain and 2 not in plain and smol.decode(plain) == text
    assert smol.decode(ids) == "user\nhi"  # control tokens are skipped


CONVERSATION = [
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke.\nA short one, with émojis 😀."},
]


@pytest.mark.parametrize("system", [None, "You are terse."])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_chat_template_matches_hf(smol, hf_smol, system, add_generation_prompt):
    messages = ([{"role": "system", "content": system}] if system else []) + CONVERSATION
    ours = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert ("You are terse." in ours) == bool(system)
    assert smol.encode(ours, special=True) == hf_smol.encode(ours, add_special_tokens=False)


# ------------------------------------------------------------------------------------------------
# Byte-level BPE built from small synthetic vocabularies
# ------------------------------------------------------------------------------------------------


def _tiny_bpe_metadata(**overrides) -> dict:
    specials = ["<|endoftext|>", "<|eot_id|>", "<think>"]
    tokens = specials + byte_level_alphabet() + ["12", "34"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 4] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["1 2", "3 4"],
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.eot_token_id": 1,
        "tokenizer.chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("gpt2", ["12", "34", "5"]),  # ' ?\p{N}+': one word, merges by rank
        ("default", ["12", "34", "5"]),
        ("llama-bpe", ["12", "3", "4", "5"]),  # '\p{N}{1,3}': '123' | '45'
        ("smollm", ["1", "2", "3", "4", "5"]),  # every digit alone
        ("qwen2", ["1", "2", "3", "4", "5"]),
    ],
)
def test_bpe_pre_tokenizers(pre, pieces):
    tok = tokenizer_from_gguf_metadata(_tiny_bpe_metadata(**{"tokenizer.ggml.pre": pre}), "tiny")
    assert [tok.id_to_piece(i) for i in tok.encode("12345")] == pieces
    assert tok.decode(tok.encode("12345 and 😀")) == "12345 and 😀"
    # Without tokenizer.ggml.add_bos_token, llama.cpp adds BOS for Llama 3 vocabularies only.
    assert tok.add_bos is (pre == "llama-bpe")


def test_bpe_special_and_user_defined_tokens():
    tok = tokenizer_from_gguf_metadata(_tiny_bpe_metadata(), "tiny")
    assert tok.add_bos is False and tok.bos_id is None
    assert tok.special_tokens == {"<|endoftext|>": 0, "<|eot_id|>": 1, "<think>": 2}
    assert tok.stop_ids == frozenset({0, 1})
    ids = tok.encode("a<think>b<|eot_id|>", special=True)
    assert ids == [*tok.encode("a"), 2, *tok.encode("b"), 1]
    assert tok.decode(ids) == "a<think>b"  # user-defined kept, control skipped
    assert 2 not in tok.encode("<think>")
    with pytest.raises(ArgumentError, match="BOS"):
        tok.encode("x", bos=True)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_unknown_tokenizer_model():
    with pytest.raises(ModelFileError, match=r"tokenizer\.ggml\.model.*"):
        tokenizer_from_gguf_metadata(_tiny_bpe_metadata(**{"tokenizer.ggml.model": "bert"}), "x.gguf")
    with pytest.raises(ModelFileError, match=r"x\.gguf.*'tokenizer\.ggml\.model' is missing"):
        tokenizer_from_gguf_metadata({}, "x.gguf")


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_missing_tokens_field(model):
    meta = _tiny_bpe_metadata(**{"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": None})
    with pytest.raises(ModelFileError, match=r"x\.gguf.*'tokenizer\.ggml\.tokens'"):
        tokenizer_from_gguf_metadata(meta, "x.gguf")


def test_malformed_bpe_fields():
    with pytest.raises(ModelFileError, match=r"'tokenizer\.ggml\.merges' is missing"):
        tokenizer_from_gguf_metadata(_tiny_bpe_metadata(**{"tokenizer.ggml.merges": None}), "x.gguf")
    with pytest.raises(ModelFileError, match=r"'tokenizer\.ggml\.merges' entry 1"):
        tokenizer_from_gguf_metadata(_tiny_bpe_metadata(**{"tokenizer.ggml.merges": ["1 2", "34"]}), "x.gguf")
    with pytest.raises(ModelFileError, match=r"'no-such-pre'.*'tokenizer\.ggml\.pre'"):
        tokenizer_from_gguf_metadata(_tiny_bpe_metadata(**{"tokenizer.ggml.pre": "no-such-pre"}), "x.gguf")
    with pytest.raises(ModelFileError, match=r"'tokenizer\.ggml\.token_type' has 2 entries"):
        tokenizer_from_gguf_metadata(_tiny_bpe_metadata(**{"tokenizer.ggml.token_type": [1, 1]}), "x.gguf")
    with pytest.raises(ModelFileError, match=r"'tokenizer\.ggml\.eos_token_id' is 9999"):
        tokenizer_from_gguf_metadata(_tiny_bpe_metadata(**{"tokenizer.ggml.eos_token_id": 9999}), "x.gguf")


def test_load_tokenizer_file_errors(tmp_path):
    gguf = pytest.importorskip("gguf")
    with pytest.raises(ModelFileError, match="no such file"):
        load_tokenizer(tmp_path / "missing.gguf")
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        load_tokenizer(not_gguf)
    no_tokenizer = tmp_path / "no_tokenizer.gguf"
    writer = gguf.GGUFWriter(str(no_tokenizer), arch="llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match=r"no_tokenizer\.gguf.*'tokenizer\.ggml\.model' is missing"):
        load_tokenizer(no_tokenizer)


def test_chat_template_missing(spm):
    with pytest.raises(TorchLlamaError, match="no chat template"):
        spm.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "messages",
    [
        "hi",
        [],
        ["hi"],
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "user", "content": 3}],
        [{"role": None, "content": "hi"}],
    ],
)
def test_chat_template_malformed_messages(messages):
    tok = tokenizer_from_gguf_metadata(_tiny_bpe_metadata(), "tiny")
    with pytest.raises(ArgumentError, match="messages"):
        tok.apply_chat_template(messages)


def test_chat_template_rendering_and_errors():
    tok = tokenizer_from_gguf_metadata(_tiny_bpe_metadata(), "tiny")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"
    # Block tags on their own lines leave no whitespace behind (trim_blocks, lstrip_blocks), the
    # special-token variables are defined, and tojson does not HTML-escape (all as in HF).
    tok.chat_template = (
        "{{ eos_token }}\n"
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'user' %}\n"
        "User: {{ m['content'] }}\n"
        "    {% else %}\n"
        "Bot: {{ m['content'] | tojson }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}Bot:{% endif %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<b>yo</b>"}]
    assert tok.apply_chat_template(messages) == '<|endoftext|>\nUser: hi\nBot: "<b>yo</b>"\nBot:'
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith('"<b>yo</b>"\n')
    tok.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('First must be user') }}{% endif %}ok"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TorchLlamaError, match="First must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    bad = tokenizer_from_gguf_metadata(_tiny_bpe_metadata(**{"tokenizer.chat_template": "{% for %}"}), "tiny")
    with pytest.raises(ModelFileError, match="tokenizer.chat_template"):
        bad.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_ids_and_text():
    tok = tokenizer_from_gguf_metadata(_tiny_bpe_metadata(), "tiny")
    with pytest.raises(ArgumentError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ArgumentError, match="out of range"):
        tok.decode([-1])
    with pytest.raises(ArgumentError, match="out of range"):
        tok.id_to_piece(10**6)
    with pytest.raises(ArgumentError, match="str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
