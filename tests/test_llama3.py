"""Llama 3 from Meta's files: the tiktoken ``tokenizer.model`` (ids equal the ``tiktoken``
library's), Meta's chat format, ``use_scaled_rope`` in params.json (logits equal transformers'
Llama with llama3 RoPE scaling), and conversion to HF / GGUF / Meta.

The vocabulary is a small byte-level BPE trained here with HF ``tokenizers`` and written as
tiktoken writes its files (``base64(token) rank``), followed by Meta's 256 special tokens, as in
Meta's ``Tokenizer`` (llama-models ``models/llama3/tokenizer.py``). The oracles (tiktoken's
``Encoding``, Meta's ``ChatFormat``, transformers' ``LlamaForCausalLM``) are built from Meta's
code written out here, not from torchllama's constants.
"""

from __future__ import annotations

import base64
import json

import pytest
import torch

import torchllama
from conftest import byte_level_alphabet
from torchllama.checkpoint import meta
from torchllama.config import ModelArgs
from torchllama.errors import ModelFileError
from torchllama.families import permute_meta_to_hf
from torchllama.generation.session import Session, encode_chat
from torchllama.model import Transformer
from torchllama.tokenizers import TiktokenTokenizer

tiktoken = pytest.importorskip("tiktoken")

# Meta's Tokenizer.pat_str and special tokens (llama-models models/llama3/tokenizer.py).
PAT_STR = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NAMED_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                  "<|python_tag|>", "<|image|>"]
SPECIALS = NAMED_SPECIALS + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - 12)]

CORPUS = """\
The quick brown fox jumps over the lazy dog. Don't panic; I'LL be there, we've said it, they'd go.
def encode(self, text: str) -> list[int]:
    return [self.vocab[t] for t in text.split()]  # 123 + 4567 = 4690
Le café est très chaud à Paris. Übermäßig große Straßen. ¿Dónde está la biblioteca?
日本語のテキストです。中文文本。한국어 텍스트. Ελληνικά κείμενα. Русский текст.
Emoji: 😀🎉👍🏽 and symbols: ∑∫√∞ ≠ ≤ ≥ ← → ★.
    Indented   lines\twith\ttabs   and    spaces.
Numbers: 3.14159, 2,718,281, 1e-5, 0x1F, 2024-11-23.
""" * 3


@pytest.fixture(scope="module")
def ranks() -> list[bytes]:
    """A byte-level BPE trained on CORPUS with Meta's pre-tokenizer, as tiktoken ranks
    (rank = id: the 256 bytes first, then one token per merge)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=700, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_of = {c: b for b, c in enumerate(byte_level_alphabet())}
    by_id = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return [bytes(byte_of[c] for c in token) for token, _ in by_id]


def tiktoken_text(ranks: list[bytes]) -> bytes:
    return b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(ranks))


@pytest.fixture(scope="module")
def model_file(ranks, tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.model"
    path.write_bytes(tiktoken_text(ranks))
    return path


@pytest.fixture(scope="module")
def tok(model_file):
    return torchllama.load_tokenizer(model_file)


@pytest.fixture(scope="module")
def oracle(ranks):
    """Meta's tiktoken.Encoding for the same file."""
    n = len(ranks)
    return tiktoken.Encoding(name="tokenizer.model", pat_str=PAT_STR,
                             mergeable_ranks={t: r for r, t in enumerate(ranks)},
                             special_tokens={s: n + i for i, s in enumerate(SPECIALS)})


TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "don't DON'T I'LL we've You'Re she'd",
    "   leading spaces, trailing spaces   ",
    "runs    of     spaces\n\n\n\nand\r\nnewlines\n",
    "\t\ttabs\t and \u00a0 no-break spaces",
    "1 12 123 1234 12345 3.14159 2,718,281,828",
    "日本語のテキストです。中文文本。한국어",
    "emoji 😀🎉👍🏽 flags 🇫🇷 zwj 👩‍💻",
    "Über naïve café façade ÀÉÎÕÜ",
    "def f(x):\n    return {'a': x ** 2}  # comment\n",
    "unseen words: xylophone zygote quokka",
    "<|begin_of_text|>text that looks special<|eot_id|>",
    "",
    CORPUS,
]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_ids_equal_tiktoken(tok, oracle, text):
    ids = tok.encode(text)
    assert ids == oracle.encode(text, disallowed_special=())
    assert tok.decode(ids) == text == oracle.decode(ids)
    assert tok.encode(text, special=True) == oracle.encode(text, allowed_special="all")


def test_special_tokens(tok, ranks):
    n = len(ranks)
    assert tok.vocab_size == n + 256
    assert (tok.bos_id, tok.eos_id) == (n, n + 1) and tok.add_bos and not tok.add_eos
    ids = {name: n + i for i, name in enumerate(SPECIALS)}
    assert {name: tok.special_tokens[name] for name in SPECIALS} == ids
    # Meta's stop tokens (llama-models): <|end_of_text|>, <|eom_id|>, <|eot_id|>
    assert tok.stop_ids == {ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]}
    # special strings in user text are plain text unless special=True
    plain = tok.encode("a<|eot_id|>b")
    assert not set(plain) & set(ids.values()) and tok.decode(plain) == "a<|eot_id|>b"
    assert tok.encode("a<|eot_id|>b", special=True) == tok.encode("a") + [ids["<|eot_id|>"]] + \
        tok.encode("b")
    # decode drops control tokens, as the rest of torchllama does
    assert tok.decode([n, *tok.encode("hi"), ids["<|eot_id|>"]]) == "hi"
    assert tok.encode("hi", bos=True) == [n, *tok.encode("hi")]


def meta_dialog_prompt(enc, dialog) -> list[int]:
    """Meta's ChatFormat.encode_dialog_prompt (meta-llama/llama3 llama/tokenizer.py), with
    tiktoken as Meta's tokenizer."""
    special = enc._special_tokens

    def header(role):
        return [special["<|start_header_id|>"], *enc.encode(role),
                special["<|end_header_id|>"], *enc.encode("\n\n")]

    tokens = [special["<|begin_of_text|>"]]
    for message in dialog:
        tokens += header(message["role"]) + enc.encode(message["content"].strip()) + \
            [special["<|eot_id|>"]]
    return tokens + header("assistant")


def test_chat_format_equals_meta(tok, oracle):
    dialog = [{"role": "system", "content": "  You are terse.\n"},
              {"role": "user", "content": "What's 12 + 30?"},
              {"role": "assistant", "content": "42.\n\n"},
              {"role": "user", "content": "\tAnd in words? 😀 "}]
    for turns in (dialog[1:2], dialog[:2], dialog):
        ids = encode_chat(tok, turns)
        assert ids == meta_dialog_prompt(oracle, turns)
        assert ids.count(tok.bos_id) == 1
    assert oracle.encode("<|eot_id|>", allowed_special="all")[0] in tok.stop_ids


def test_generation_stops_at_eot(tok):
    """A model that always predicts <|eot_id|> ends the reply at once: a Session (the chat REPL,
    `generate`) stops on tokenizer.stop_ids by default."""
    eot = tok.special_tokens["<|eot_id|>"]
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=tok.vocab_size, max_seq_len=64)
    model = Transformer(args).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.norm.weight.fill_(1.0)
        model.tok_embeddings.weight[:, 0] = 1.0     # every hidden state is +x along dim 0
        model.output.weight[eot, 0] = 1.0
    session = Session(model, tok)
    assert list(session.generate(encode_chat(tok, [{"role": "user", "content": "Hi"}]), 5)) == []
    assert session.stats.finish_reason == "stop"


def test_load_tokenizer_of_a_folder(model_file, oracle):
    # a folder with only Meta's tokenizer.model (load_hf_tokenizer) reads it as tiktoken too
    tok = torchllama.load_tokenizer(model_file.parent)
    assert tok.encode("Hello world 123") == oracle.encode("Hello world 123")


# ---- Meta's Llama 3.1 folder -------------------------------------------------------------------

ROPE_LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def params_json(vocab_size: int) -> dict:
    """A tiny Llama 3.1 params.json, with Meta's fields."""
    return {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": vocab_size,
            "multiple_of": 32, "ffn_dim_multiplier": 1.3, "norm_eps": 1e-05,
            "rope_theta": 500000.0, "use_scaled_rope": True}


@pytest.fixture(scope="module")
def meta_folder(ranks, tmp_path_factory):
    """(folder, state) of a Meta Llama 3.1 checkpoint with random weights."""
    folder = tmp_path_factory.mktemp("llama-3.1-tiny")
    params = params_json(len(ranks) + 256)
    (folder / "params.json").write_text(json.dumps(params))
    (folder / "tokenizer.model").write_bytes(tiktoken_text(ranks))
    args = ModelArgs(**{k: v for k, v in params.items() if k != "use_scaled_rope"})
    g = torch.Generator().manual_seed(0)
    state = {name: torch.randn(t.shape, generator=g) * (0.3 if t.ndim == 1 else 0.05) + (t.ndim == 1)
             for name, t in Transformer(args).state_dict().items()}
    torch.save(state, folder / "consolidated.00.pth")
    return folder, state


def hf_llama(params: dict, state: dict):
    """transformers' Llama with Meta's weights: HF names, q/k rows permuted to rotate_half."""
    transformers = pytest.importorskip("transformers")
    hidden = state["layers.0.feed_forward.w1.weight"].shape[0]
    config = transformers.LlamaConfig(
        hidden_size=params["dim"], intermediate_size=hidden, num_hidden_layers=params["n_layers"],
        num_attention_heads=params["n_heads"], num_key_value_heads=params["n_kv_heads"],
        vocab_size=params["vocab_size"], rms_norm_eps=params["norm_eps"],
        max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": params["rope_theta"],
                         "original_max_position_embeddings": 8192, **ROPE_LLAMA3})
    hf = {"model.embed_tokens.weight": state["tok_embeddings.weight"],
          "model.norm.weight": state["norm.weight"], "lm_head.weight": state["output.weight"]}
    for i in range(params["n_layers"]):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        hf[theirs + "self_attn.q_proj.weight"] = permute_meta_to_hf(
            state[ours + "attention.wq.weight"], params["n_heads"])
        hf[theirs + "self_attn.k_proj.weight"] = permute_meta_to_hf(
            state[ours + "attention.wk.weight"], params["n_kv_heads"])
        for meta_name, hf_name in (("attention.wv", "self_attn.v_proj"), ("attention.wo", "self_attn.o_proj"),
                                   ("feed_forward.w1", "mlp.gate_proj"), ("feed_forward.w2", "mlp.down_proj"),
                                   ("feed_forward.w3", "mlp.up_proj"), ("attention_norm", "input_layernorm"),
                                   ("ffn_norm", "post_attention_layernorm")):
            hf[f"{theirs}{hf_name}.weight"] = state[f"{ours}{meta_name}.weight"]
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(hf, strict=True)
    return model


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.fixture(scope="module")
def loaded(meta_folder):
    return torchllama.load(meta_folder[0], progress=False)


@pytest.fixture(scope="module")
def tokens(ranks):
    return torch.randint(0, len(ranks) + 256, (2, 48), generator=torch.Generator().manual_seed(1))


def test_meta_llama31_folder_equals_transformers(meta_folder, loaded, tokens, ranks):
    folder, state = meta_folder
    model, tok = loaded
    assert model.args.rope_scaling == {"type": "llama3", **ROPE_LLAMA3, "original_max_seq_len": 8192}
    assert model.args.rope_theta == 500000.0 and model.args.vocab_size == len(ranks) + 256
    assert isinstance(tok, TiktokenTokenizer)
    hf = hf_llama(params_json(len(ranks) + 256), state)
    expected = logits(hf, tokens)
    torch.testing.assert_close(logits(model, tokens), expected, atol=1e-5, rtol=0)
    # the scaling matters here: the same weights without it give other logits
    plain = Transformer(model.args.replace(rope_scaling=None)).eval()
    plain.load_state_dict(state)
    assert (logits(plain, tokens) - expected).abs().max() > 1e-3


def test_llama31_8b_params_json():
    # Meta's params.json of Llama 3.1 8B: the published shape and parameter count
    params = {"dim": 4096, "ffn_dim_multiplier": 1.3, "multiple_of": 1024, "n_heads": 32,
              "n_kv_heads": 8, "n_layers": 32, "norm_eps": 1e-05, "rope_theta": 500000.0,
              "use_scaled_rope": True, "vocab_size": 128256}
    args = meta.model_args_from_params(params, 128256, "params.json")
    preset = torchllama.get_preset("llama3.1-8b")
    assert args.ffn_hidden_dim == preset.ffn_hidden_dim == 14336
    assert args.rope_scaling == preset.rope_scaling
    with torch.device("meta"):
        assert sum(p.numel() for p in Transformer(args).parameters()) == 8_030_261_248
    # written back as Meta writes it
    written = meta.meta_params(args)
    assert written["use_scaled_rope"] is True and "rope_scaling" not in written
    assert {k: written[k] for k in params} == params
    # another scaling stays torchllama's own field
    other = meta.meta_params(args.replace(rope_scaling={**preset.rope_scaling, "factor": 32.0}))
    assert "use_scaled_rope" not in other and other["rope_scaling"]["factor"] == 32.0


def test_convert_to_hf(meta_folder, loaded, tokens, oracle, tmp_path):
    transformers = pytest.importorskip("transformers")
    model, tok = loaded
    torchllama.convert(meta_folder[0], tmp_path / "hf", to="hf", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    torch.testing.assert_close(logits(hf.eval(), tokens), logits(model, tokens), atol=1e-5, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:  # (transformers matches special-token text in any input)
        assert hf_tok.encode(text, add_special_tokens=False) == oracle.encode(text, allowed_special="all")
    assert hf_tok.encode("Hi")[0] == tok.bos_id      # add_bos_token
    dialog = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert hf_tok.apply_chat_template(dialog, add_generation_prompt=True, tokenize=True,
                                      return_dict=False) == encode_chat(tok, dialog)
    # and torchllama reads its own HF export back with the same tokenizer
    _, back = torchllama.load(tmp_path / "hf", progress=False)
    assert back.encode(CORPUS) == tok.encode(CORPUS) and back.stop_ids == tok.stop_ids
    assert encode_chat(back, dialog) == encode_chat(tok, dialog)


def test_convert_to_meta_writes_tiktoken_and_use_scaled_rope(meta_folder, loaded, tokens, tmp_path):
    model, tok = loaded
    torchllama.convert(meta_folder[0], tmp_path / "meta", to="meta", progress=False)
    assert (tmp_path / "meta" / "tokenizer.model").read_bytes() == \
        (meta_folder[0] / "tokenizer.model").read_bytes()
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    assert params["use_scaled_rope"] is True and "rope_scaling" not in params
    again, tok2 = torchllama.load(tmp_path / "meta", progress=False)
    assert again.args.rope_scaling == model.args.rope_scaling
    torch.testing.assert_close(logits(again, tokens), logits(model, tokens), atol=0, rtol=0)
    assert tok2.encode(CORPUS, special=True) == tok.encode(CORPUS, special=True)


def test_convert_to_gguf(meta_folder, loaded, tokens, oracle, tmp_path):
    from torchllama.checkpoint import gguf

    model, tok = loaded
    path = torchllama.convert(meta_folder[0], tmp_path / "m.gguf", to="gguf", dtype="float32",
                              progress=False)
    fields = gguf.read_metadata(gguf.open_gguf(path))
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", "llama-bpe")
    again, tok2 = torchllama.load(path, progress=False)
    torch.testing.assert_close(logits(again, tokens), logits(model, tokens), atol=1e-5, rtol=0)
    for text in TEXTS:
        assert tok2.encode(text) == oracle.encode(text, disallowed_special=())
    assert tok2.stop_ids == tok.stop_ids and tok2.chat_template == tok.chat_template


# ---- bad files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("content, message", [
    (b"\x00\xff\x13garbage\x80\x81" * 10, r"not a SentencePiece model"),
    (b"IQ== 0\nIg== 1\n!!notbase64 2\n", r"line 3: the token '!!notbase64' is not valid base64"),
    (b"IQ== 0\nIg== one\n", r"line 2: the rank 'one' is not a non-negative integer"),
    (b"IQ== 0\nIg==\n", r"line 2: expected 'base64-token rank', got 'Ig=='"),
    (b"IQ== 0\nIg== 0\n", r"line 2: rank 0 already belongs to token b'!'"),
    (b"IQ== 0\nIQ== 1\n", r"line 2: token b'!' already has rank 0"),
    (b"IQ== 0\nIg== 2\n", r"ranks are not 0\.\.1 \(rank 1 is missing, the largest is 2\)"),
    (b"\n\n", r"empty tiktoken BPE file"),
], ids=["garbage", "base64", "rank", "fields", "same-rank", "same-token", "gap", "empty"])
def test_bad_tokenizer_model(tmp_path, content, message):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(ModelFileError, match=message) as e:
        torchllama.load_tokenizer(path)
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)
