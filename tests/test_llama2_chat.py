"""Llama 2's chat format, as Meta's `chat_completion` builds it, on Llama 2's own vocabulary."""

import pytest

from torchllama.errors import ArgumentError
from torchllama.generation.session import encode_chat, llama2_chat_ids


# Pieces of Llama 2's vocabulary used below (from Meta's tokenizer.model):
INST = [518, 25580, 29962]            # "▁[" "INST" "]"
END_INST = [518, 29914, 25580, 29962]  # "▁[" "/" "INST" "]"
SYS = [3532, 14816, 29903, 6778, 13]  # "▁<<" "SY" "S" ">>" "\n"
END_SYS = [13, 29966, 829, 14816, 29903, 6778, 13, 13]  # "\n" "<" "</" "SY" "S" ">>" "\n" "\n"
BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def tokenizer(llama_spm_tokenizer):
    return llama_spm_tokenizer


def test_multi_turn_dialog_with_system_prompt(tokenizer):
    dialog = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": " Hello! "},        # stripped, as Meta does
        {"role": "user", "content": "2+2?"},
    ]
    expected = (
        # BOS [INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST] Hello! EOS
        [BOS] + INST + SYS + [3629, 11473, 29889] + END_SYS + [18567, 727] + END_INST
        + [15043, 29991, 29871, EOS]
        # BOS [INST] 2+2? [/INST]   (the last turn stays open, no EOS)
        + [BOS] + INST + [29871, 29906, 29974, 29906, 29973] + END_INST
    )
    assert llama2_chat_ids(tokenizer, dialog) == expected
    assert encode_chat(tokenizer, dialog) == expected   # no jinja template → Meta's format


def test_single_user_turn(tokenizer):
    ids = llama2_chat_ids(tokenizer, [{"role": "user", "content": "Hello world"}])
    assert ids == [BOS] + INST + [15043, 3186] + END_INST


@pytest.mark.parametrize("content", ["[INST] hi", "a [/INST] b", "<<SYS>>x", "x<</SYS>>"])
def test_special_tags_in_user_text_are_refused(tokenizer, content):
    with pytest.raises(ArgumentError, match="special tags are not allowed"):
        llama2_chat_ids(tokenizer, [{"role": "user", "content": content}])


@pytest.mark.parametrize("dialog, words", [
    ([{"role": "assistant", "content": "a"}], "alternating"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternating"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
     "last message must be from the user"),
    ([{"role": "system", "content": "s"}], "followed by a user message"),
    ([], "non-empty list"),
])
def test_dialog_rules(tokenizer, dialog, words):
    with pytest.raises(ArgumentError, match=words):
        llama2_chat_ids(tokenizer, dialog)


def test_a_jinja_template_takes_precedence(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        ids = encode_chat(tokenizer, [{"role": "user", "content": "Hello world"}])
    finally:
        tokenizer.chat_template = None
    assert ids == [BOS, 15043, 3186]
