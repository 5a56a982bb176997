"""GGUF files of every family, read and written through the family adapters (llama.cpp's
`llama`, `qwen2`, `gpt2`, `deepseek2` architectures; Mistral as `llama` with a sliding window;
Llama with linear, YaRN and Llama 3.1 RoPE scaling), and the GGUF loader on damaged files.

Each model is tiny and random. `torchllama.save(..., to="gguf")` → `torchllama.load` gives the
same tensors and logits; where transformers' own GGUF loader reads the architecture
(`from_pretrained(dir, gguf_file=...)`), its logits equal ours within 1e-4 in float32 — that
checks the stored names, layouts (q/k permutation, fused and transposed weights) and metadata
against an implementation that is not ours. transformers' GGUF loader ignores RoPE scaling keys
and the rope_freqs tensor, so the scaled Llamas give it the scaling as a config override; it
does not read deepseek2, so DeepSeek is compared with transformers' DeepseekV3ForCausalLM on
the same weights (our HF export).
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

import torchllama
from torchllama.checkpoint import gguf as gguf_format
from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError, ModelFileError, TorchLlamaError
from torchllama.families import DEEPSEEK_V3, LLAMA, family_for_args
from torchllama.families.base import Part, hf_rope_parameters
from torchllama.families.llama import llama3_rope_factors
from torchllama.model import Transformer

from conftest import byte_level_alphabet

transformers = pytest.importorskip("transformers")

BPE_TOKENS = byte_level_alphabet() + ["12", "34", "<|endoftext|>"]
VOCAB = len(BPE_TOKENS)      # 259
SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, hidden_dim=96,
             norm_eps=1e-5, rope_theta=500.0, max_seq_len=64)
GPT2 = dict(SMALL, n_kv_heads=4, hidden_dim=256, max_seq_len=1024, rope_theta=10000.0,
            tie_embeddings=True, norm="layernorm", norm_bias=True, mlp="gelu_tanh",
            position="learned", qkv_bias=True, out_bias=True, mlp_bias=True)
MLA = dict(SMALL, n_kv_heads=4, attention="mla", kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=12)
OLMOE = dict(SMALL, n_kv_heads=4, qk_norm=True, qk_norm_span="projection", moe_norm_topk=False)
LLAMA3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_seq_len": 16}
YARN = {"type": "yarn", "factor": 4.0, "original_max_seq_len": 16}

# name → (ModelArgs fields, GGUF architecture, transformers reads it from GGUF)
CASES = {
    "qwen2": (dict(SMALL, qkv_bias=True), "qwen2", True),
    # (transformers' GGUF reader takes Qwen3's head_dim from its config default, 128, not from
    # qwen3.attention.key_length: a head_dim of 128 is what it can check)
    "qwen3": (dict(SMALL, qk_norm=True, head_dim=128), "qwen3", True),
    # (its GGUF reader takes moe_intermediate_size from the config default, 768, likewise)
    "qwen3-moe": (dict(SMALL, qk_norm=True, head_dim=128, n_experts=4, n_experts_per_token=2,
                       moe_hidden_dim=768), "qwen3moe", True),
    "mixtral": (dict(SMALL, n_experts=4, n_experts_per_token=2), "llama", False),
    "olmoe": (dict(OLMOE, n_experts=4, n_experts_per_token=2), "olmoe", False),
    "gpt2": (GPT2, "gpt2", True),
    "gpt2-untied": (dict(GPT2, tie_embeddings=False), "gpt2", True),
    "mistral": (dict(SMALL, sliding_window=6), "llama", True),
    "deepseek2": (dict(MLA, q_lora_rank=24), "deepseek2", False),
    "deepseek2-yarn": (dict(MLA, rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0}),
                       "deepseek2", False),
    # DeepSeek-V3's experts (tests/test_deepseek_moe_gguf.py: V2-Lite's too, and llama.cpp)
    "deepseek2-moe": (dict(MLA, q_lora_rank=24, n_experts=4, n_experts_per_token=2,
                           moe_hidden_dim=64, n_shared_experts=1, first_dense_layers=1,
                           moe_router="sigmoid", moe_groups=2, moe_group_topk=1,
                           moe_scale=2.5), "deepseek2", False),
    "llama": (SMALL, "llama", True),
    "llama-linear": (dict(SMALL, rope_scaling={"type": "linear", "factor": 3.0}), "llama", True),
    "llama-yarn": (dict(SMALL, rope_scaling=YARN), "llama", True),
    "llama-yarn-attn": (dict(SMALL, rope_scaling={**YARN, "attention_factor": 1.3,
                                                  "beta_fast": 16.0}), "llama", True),
    "llama3": (dict(SMALL, rope_scaling=LLAMA3), "llama", True),
    "llama3-head-dim": (dict(SMALL, head_dim=32, rope_scaling={**LLAMA3, "factor": 32.0}),
                        "llama", True),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A tiny byte-level BPE vocabulary (a vocab-only GGUF file; a 32k vocabulary would make
    transformers' GGUF reader take seconds per file)."""
    return tiny_bpe_tokenizer(tmp_path_factory.mktemp("vocab"))


def tiny_bpe_tokenizer(folder):
    """The `tokenizer` fixture's vocabulary, written in `folder`."""
    path = folder / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(BPE_TOKENS)
    writer.add_token_types([1] * (VOCAB - 1) + [3])
    writer.add_token_merges(["1 2", "3 4"])
    writer.add_eos_token_id(VOCAB - 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return torchllama.load_tokenizer(path)


def random_model(fields: dict, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**fields)).eval()
    for p in model.parameters():          # norms and biases away from 1 and 0
        torch.nn.init.normal_(p, std=0.5 if p.ndim == 1 else 0.05)
    return model


def tokens(T: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, T), generator=torch.Generator().manual_seed(3))


def same_args(a: ModelArgs, b: ModelArgs) -> bool:
    """Equal up to float32 rounding of GGUF's float keys (norm_eps, factors)."""
    def rounded(args):
        scaling = args.rope_scaling and {k: (float(np.float32(v)) if isinstance(v, float) else v)
                                         for k, v in args.rope_scaling.items()}
        return args.replace(norm_eps=float(np.float32(args.norm_eps)), rope_scaling=scaling)
    return rounded(a) == rounded(b)


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_round_trip_and_transformers(tmp_path, tokenizer, name):
    fields, arch, hf_reads = CASES[name]
    model = random_model(fields)
    path = tmp_path / "model.gguf"      # general.name "model" (transformers: not "mistral")
    torchllama.save(model, tokenizer, path, to="gguf", progress=False)

    reader = gguf_format.open_gguf(path)
    assert gguf_format.read_metadata(reader)["general.architecture"] == arch
    loaded, tok = torchllama.load(path, dtype="float32", progress=False)
    assert same_args(loaded.args, model.args), (loaded.args, model.args)
    assert tok.decode(tok.encode("Hello 1234 world")) == "Hello 1234 world"
    state = loaded.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
    T = 40     # past the sliding window and the scalings' original context
    with torch.no_grad():
        expected = model(tokens(T))
        torch.testing.assert_close(loaded(tokens(T)), expected, atol=0, rtol=0)

    if hf_reads:
        overrides = {}
        if model.args.rope_scaling:          # transformers' GGUF loader drops RoPE scaling
            overrides["rope_parameters"] = hf_rope_parameters(model.args)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager",
            **overrides).eval()
        # transformers reads a Mistral GGUF as a Llama, without the window: compare within it
        T_hf = model.args.sliding_window or T
        with torch.no_grad():
            torch.testing.assert_close(hf(tokens(T)[:, :T_hf]).logits, expected[:, :T_hf], atol=1e-4,
                                       rtol=0)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_deepseek2_equals_transformers_deepseek_v3(tmp_path, tokenizer, q_lora_rank):
    """transformers has no deepseek2 GGUF reader: compare the GGUF-loaded model with its
    DeepseekV3ForCausalLM holding the same weights (our HF export)."""
    fields = dict(MLA, q_lora_rank=q_lora_rank,
                  rope_scaling={**YARN, "mscale": 0.7, "mscale_all_dim": 0.7})
    model = random_model(fields, seed=1)
    torchllama.save(model, tokenizer, tmp_path / "m.gguf", to="gguf", progress=False)
    torchllama.save(model, tokenizer, tmp_path / "hf", to="hf", progress=False)
    loaded, _ = torchllama.load(tmp_path / "m.gguf", dtype="float32", progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager").eval()
    names = {t.name for t in gguf_format.open_gguf(tmp_path / "m.gguf").tensors}
    assert {"blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"} <= names
    assert "blk.0.attn_kv_b.weight" not in names
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens(40)), hf(tokens(40)).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen2", "gpt2", "mistral", "deepseek2", "llama3"])
def test_convert_hf_folder_to_gguf_on_the_command_line(tmp_path, tokenizer, name, capsys):
    from torchllama.cli import main

    model = random_model(CASES[name][0])
    torchllama.save(model, tokenizer, tmp_path / "hf", to="hf", progress=False)
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "m.gguf"), "--to", "gguf"]) == 0
    loaded, _ = torchllama.load(tmp_path / "m.gguf", dtype="float32", progress=False)
    assert same_args(loaded.args, model.args)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens(30)), model(tokens(30)), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------
# Files as other writers make them
# ------------------------------------------------------------------------------------------------

def rewrite(src, dst, *, drop_keys=(), set_keys=None, tensors=None):
    """Copy a GGUF file with keys dropped or set ({key: (writer method, value)}) and tensors
    replaced ({name: float32 array, or None to drop}; new names are added)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for key, (method, value) in (set_keys or {}).items():
        getattr(writer, method)(key, value)
    tensors = dict(tensors or {})
    for t in reader.tensors:
        if t.name in tensors:
            value = tensors.pop(t.name)
            if value is not None:
                writer.add_tensor(t.name, value)
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_deepseek2_legacy_whole_attn_kv_b(tmp_path, tokenizer):
    """Files of llama.cpp before its absorbed MLA hold wkv_b whole (attn_kv_b) and state the
    head sizes as key_length / value_length."""
    model = random_model(dict(MLA, q_lora_rank=24), seed=2)
    path = tmp_path / "new.gguf"
    torchllama.save(model, tokenizer, path, to="gguf", progress=False)
    wkv_b = {f"blk.{i}.attn_kv_b.weight": model.layers[i].attention.wkv_b.weight.detach().numpy()
             for i in range(2)}
    parts = {f"blk.{i}.attn_{p}_b.weight": None for i in range(2) for p in "kv"}
    legacy = rewrite(path, tmp_path / "old.gguf", drop_keys=(
        "deepseek2.attention.key_length_mla", "deepseek2.attention.value_length_mla"),
        set_keys={"deepseek2.attention.key_length": ("add_uint32", 12),
                  "deepseek2.attention.value_length": ("add_uint32", 12),
                  "deepseek2.attention.head_count_kv": ("add_uint32", 4)},
        tensors={**parts, **wkv_b})
    loaded, _ = torchllama.load(legacy, dtype="float32", progress=False)
    assert same_args(loaded.args, model.args)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens(20)), model(tokens(20)), atol=0, rtol=0)
    # only one of the two parts: wkv_b is missing
    half = rewrite(path, tmp_path / "half.gguf", tensors={"blk.1.attn_v_b.weight": None})
    with pytest.raises(ModelFileError, match=r"missing tensors.*blk\.1\.attn_k_b"):
        torchllama.load(half, dtype="float32", progress=False)


def test_deepseek2_experts_without_their_tensors_are_named(tmp_path, tokenizer):
    """A deepseek2 file whose keys say experts (1 dense layer, 8 experts) but whose tensors
    are a dense model's: the first missing expert tensor is named."""
    model = random_model(dict(MLA, q_lora_rank=None), seed=3)
    path = torchllama.save(model, tokenizer, tmp_path / "m.gguf", to="gguf", progress=False)
    keys = ("leading_dense_block_count", "expert_count", "expert_used_count",
            "expert_feed_forward_length")
    moe = rewrite(path, tmp_path / "moe.gguf", drop_keys=tuple(f"deepseek2.{k}" for k in keys),
                  set_keys={f"deepseek2.{k}": ("add_uint32", v) for k, v in zip(keys,
                                                                                (1, 8, 2, 64))})
    with pytest.raises(ModelFileError, match=r"blk\.1\.ffn_gate_inp\.weight|unexpected tensor "
                                             r"'blk\.1\.ffn_(gate|down|up)\.weight'"):
        torchllama.load(moe, dtype="float32", progress=False)


def test_llama_cpp_llama3_file_without_our_key(tmp_path, tokenizer):
    """llama.cpp's converter writes Llama 3.1's RoPE as rope_freqs alone (factor 8, low 1,
    high 4, original context 8192 by default): read as that rule."""
    scaling = {**LLAMA3, "original_max_seq_len": 8192}
    model = random_model(dict(SMALL, rope_theta=500000.0, max_seq_len=64, rope_scaling=scaling))
    path = torchllama.save(model, tokenizer, tmp_path / "m.gguf", to="gguf", progress=False)
    cpp = rewrite(path, tmp_path / "cpp.gguf",
                  drop_keys=("llama.rope.scaling.original_context_length",))
    loaded, _ = torchllama.load(cpp, dtype="float32", progress=False)
    assert loaded.args.rope_scaling == scaling
    assert torchllama.read_model_args(cpp).rope_scaling == scaling


def test_rope_freqs_that_follow_no_llama3_rule_are_refused(tmp_path, tokenizer):
    model = random_model(dict(SMALL, rope_scaling=LLAMA3))
    path = torchllama.save(model, tokenizer, tmp_path / "m.gguf", to="gguf", progress=False)
    factors = llama3_rope_factors(16, 500.0, LLAMA3).numpy()
    assert factors.max() == 8.0 and 1 < factors[1] < 8          # long and in-between dims
    bad = rewrite(path, tmp_path / "bad.gguf", tensors={
        "rope_freqs.weight": np.linspace(1, 3, 8, dtype=np.float32)})
    with pytest.raises(ModelFileError, match=r"rope_freqs\.weight .* does not follow Llama "
                                             r"3\.1's RoPE rule"):
        torchllama.load(bad, dtype="float32", progress=False)
    ones = rewrite(path, tmp_path / "ones.gguf", tensors={
        "rope_freqs.weight": np.ones(8, dtype=np.float32)})
    assert torchllama.load(ones, dtype="float32", progress=False)[0].args.rope_scaling is None


def test_llama3_with_other_band_parameters_round_trips(tmp_path, tokenizer):
    scaling = {**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 16.0,
               "original_max_seq_len": 64}
    model = random_model(dict(SMALL, rope_scaling=scaling))
    path = torchllama.save(model, tokenizer, tmp_path / "m.gguf", to="gguf", progress=False)
    loaded, _ = torchllama.load(path, dtype="float32", progress=False)
    got = loaded.args.rope_scaling
    assert got["type"] == "llama3" and got["factor"] == 8.0
    assert got["low_freq_factor"] == pytest.approx(2.0) and got["high_freq_factor"] == \
        pytest.approx(16.0)
    assert torchllama.read_model_args(path).rope_scaling == got      # metadata-only reader too
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens(40)), model(tokens(40)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fields, why", [
    (dict(SMALL, rope_scaling={"type": "dynamic", "factor": 2.0, "original_max_seq_len": 32}),
     "no 'dynamic' RoPE scaling"),
    (dict(SMALL, qkv_bias=True, sliding_window=8), "qwen2: sliding_window"),
    (dict(GPT2, mlp="gelu"), "tanh GELU"),
    (dict(SMALL, position="alibi"), "llama: position='alibi'"),
])
def test_models_no_gguf_architecture_holds_are_refused(tmp_path, tokenizer, fields, why):
    model = random_model(fields)
    with pytest.raises(ArgumentError, match="no gguf architecture can hold this model") as info:
        torchllama.save(model, tokenizer, tmp_path / "x.gguf", to="gguf", progress=False)
    assert why in str(info.value)
    assert not (tmp_path / "x.gguf").exists()


def test_families_for_gguf():
    for fields, name in ((dict(SMALL, qkv_bias=True), "qwen2"), (GPT2, "gpt2"),
                         (dict(SMALL, sliding_window=6), "mistral"),
                         (dict(MLA, q_lora_rank=None), "deepseek_v3"), (SMALL, "llama")):
        assert family_for_args(ModelArgs(**fields), "gguf").name == name
    assert any(isinstance(t.gguf_layout, Part) for t in DEEPSEEK_V3.tensors)
    assert LLAMA.gguf_ignored.fullmatch("rope_freqs.weight")


# ------------------------------------------------------------------------------------------------
# Damaged files: only TorchLlamaError, never anything else
# ------------------------------------------------------------------------------------------------

TOKENS = [f"<{i}>" for i in range(40)]


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """A small valid GGUF file (tiny Qwen2, 40-token SentencePiece-style vocabulary)."""
    path = tmp_path_factory.mktemp("fuzz") / "small.gguf"
    model = random_model(dict(SMALL, vocab_size=40, qkv_bias=True, n_layers=1))
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_name("small")
    family_for_args(model.args, "gguf").gguf_metadata(writer, model.args)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0] * 40)
    writer.add_token_types([2, 3, 3] + [1] * 37)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{{ messages }}")
    for m in family_for_args(model.args, "gguf").mappings("gguf", 1, set(model.state_dict())):
        tensor = m.layout.save(tuple(model.state_dict()[n] for n in m.ours), model.args)
        writer.add_tensor(m.theirs, tensor.detach().float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    torchllama.load(path, dtype="float32", progress=False)               # valid as written
    return path


def _load_is_clean(path) -> None:
    """torchllama.load either works or raises a TorchLlamaError."""
    try:
        torchllama.load(path, dtype="float32", progress=False)
    except TorchLlamaError:
        pass


def test_damaged_files_raise_only_torchllama_errors(tmp_path, small_gguf):
    data = small_gguf.read_bytes()
    reader = gguf.GGUFReader(small_gguf)
    info_start = min(t.field.offset for t in reader.tensors)
    data_start = min(t.data_offset for t in reader.tensors)
    rng = np.random.default_rng(0)
    cut = tmp_path / "cut.gguf"
    # truncated everywhere in the header, metadata and tensor infos, and across the data
    points = (list(range(0, 64)) + list(range(64, data_start, 7))
              + list(np.linspace(data_start, len(data) - 1, 10).astype(int)))
    for n in points:
        cut.write_bytes(data[:n])
        with pytest.raises(TorchLlamaError):
            torchllama.load(cut, dtype="float32", progress=False)
    # single bytes overwritten in the header, metadata and tensor infos (lengths, types, counts,
    # dims, offsets) with 0x00, 0xff or a random byte
    for n in list(range(0, 24)) + list(rng.integers(24, data_start, 150)):
        for value in (0x00, 0xFF, int(rng.integers(0, 256))):
            damaged = bytearray(data)
            damaged[n] = value
            cut.write_bytes(bytes(damaged))
            _load_is_clean(cut)
    assert info_start < data_start


@pytest.mark.parametrize("text, words", [
    (b"general.name", "metadata key or tensor name is not valid UTF-8"),
    (b"qwen2.context_length", "metadata key or tensor name is not valid UTF-8"),
    (b"token_embd.weight", "metadata key or tensor name is not valid UTF-8"),
    (b"<7>", "metadata key 'tokenizer.ggml.tokens' holds a string that is not valid UTF-8"),
    (b"{{ messages }}", "metadata key 'tokenizer.chat_template' holds a string that is not "
                        "valid UTF-8"),
])
def test_invalid_utf8_anywhere_is_a_model_file_error(tmp_path, small_gguf, text, words):
    """A string that is not UTF-8 in a key, a tensor name, a token or the chat template: one
    ModelFileError, naming the key of a value."""
    data = small_gguf.read_bytes()
    at = data.index(text)
    path = tmp_path / "bad.gguf"
    path.write_bytes(data[:at] + b"\xff" + data[at + 1:])
    with pytest.raises(ModelFileError) as info:
        torchllama.load(path, dtype="float32", progress=False)
    assert words in str(info.value) and str(path) in str(info.value), str(info.value)


def test_utf8_error_names_the_key(tmp_path, small_gguf):
    data = small_gguf.read_bytes()
    at = data.index(b"small", data.index(b"general.name"))
    path = tmp_path / "bad.gguf"
    path.write_bytes(data[:at] + b"\xc3\x28" + data[at + 2:])
    with pytest.raises(ModelFileError, match=r"metadata key 'general\.name' holds a string that "
                                             r"is not valid UTF-8"):
        torchllama.load(path, dtype="float32", progress=False)
