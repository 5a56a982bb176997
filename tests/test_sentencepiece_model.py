"""A SentencePiece `tokenizer.model` trained here with Llama 2's settings: our tokenizer on the
file, on the same vocabulary written to GGUF and read back, and the `sentencepiece` library itself
all give the same ids."""

import io

import pytest
import sentencepiece as spm

from torchllama.tokenizers import SentencePieceTokenizer, tokenizer_from_gguf_metadata

CORPUS = """The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
def main():
    return 42  # the answer
""" * 20

TEXTS = ["The quick brown fox", " leading space", "two  spaces and\ttab\nnewline",
         "unknown: héllo 世界 🙂", "digits 1234567890", "def f(x): return x ** 2"]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(            # Llama 2's tokenizer settings
        sentence_iterator=iter(CORPUS.splitlines()), model_writer=model, vocab_size=300,
        model_type="bpe", byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        add_dummy_prefix=True, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0, minloglevel=2)
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


def test_same_ids_from_file_gguf_and_sentencepiece(model_file):
    oracle = spm.SentencePieceProcessor(model_file=str(model_file))
    ours = SentencePieceTokenizer.from_file(model_file)
    via_gguf = tokenizer_from_gguf_metadata(ours.gguf_fields(), "round trip")
    assert (ours.bos_id, ours.eos_id, ours.unk_id, ours.pad_id) == (1, 2, 0, None)
    for text in TEXTS:
        expected = oracle.encode(text)
        assert ours.encode(text) == expected == via_gguf.encode(text), text
        assert ours.encode(text, bos=True, eos=True) == [1] + expected + [2]
        assert ours.decode(expected) == oracle.decode(expected) == via_gguf.decode(expected)


def test_byte_fallback_for_characters_outside_the_vocabulary(model_file):
    ours = SentencePieceTokenizer.from_file(model_file)
    ids = ours.encode("世")                       # not in the English training text
    pieces = [ours.id_to_piece(i) for i in ids]
    assert pieces[-3:] == ["<0xE4>", "<0xB8>", "<0x96>"]   # its UTF-8 bytes
    assert ours.decode(ids) == "世"
