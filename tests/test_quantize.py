"""Weight-only quantization (torchllama.transforms.quantize) and quantized GGUF loading: the int8/int4
kernels against a float matmul of the dequantized weights, GGUF's Q4_0/Q4_1 blocks repacked
code for code (the `gguf` library's dequantization is the oracle), quantized loading of real
and tiny files, and the compiled decode step's fallback."""

import os

import gguf
import numpy as np
import pytest
import torch

import torchllama
from torchllama.checkpoint import parse_dtype, save
from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError
from torchllama.generation.session import (Session, compile_decode, decode_one_token,
                                   runs_one_op_layers)
from torchllama.model import Transformer
from torchllama import kernels
from torchllama.blocks.linear import BlockEmbedding, Q4Linear, Q8Linear
from torchllama.transforms.quantize import (Int4Linear, Int8Linear, QuantizedEmbedding, Scheme,
                                            quantize_model, weight_bytes)
from torchllama.blocks.forms import Int4Weight, Int8Weight
from torchllama.generation.sampling import SamplingParams


Q = gguf.GGMLQuantizationType
#: The modules a 4-bit / 8-bit block weight gets: torchllama's kernels, or torch's where the
#: kernels are unavailable (TORCHLLAMA_KERNELS=0, no compiler).
KERNELS = kernels.available()
LINEAR4, LINEAR8 = (Q4Linear, Q8Linear) if KERNELS else (Int4Linear, Int8Linear)
EMBEDDING = BlockEmbedding if KERNELS else (BlockEmbedding, QuantizedEmbedding)


def bf16_tolerance(reference: torch.Tensor) -> float:
    """Activations are rounded to bfloat16 (8 significant bits) before the quantized matmul:
    allow a few bf16 steps of the output's scale."""
    return 2e-2 * float(reference.abs().max())


@pytest.mark.parametrize("bits, group_size", [(8, 32), (4, 32), (4, 128)])
def test_quantized_linear_equals_the_dequantized_matmul(bits, group_size):
    torch.manual_seed(0)
    w = torch.randn(96, 256)                                   # (N, K)
    x = torch.randn(2, 3, 256)                                 # (B, T, K)
    weight = Int8Weight.from_float(w) if bits == 8 else Int4Weight.from_float(w, group_size)
    linear = Int8Linear(weight) if bits == 8 else Int4Linear(weight)
    y = linear(x)
    reference = x @ weight.dequantize().t()                    # float32 on the same weights
    assert y.shape == (2, 3, 96) and y.dtype == torch.float32
    torch.testing.assert_close(y, reference, rtol=0, atol=bf16_tolerance(reference))
    # the quantized weights are close to the originals: the error is the rounding, no more
    step = (w.abs().amax(1, keepdim=True) / 127 if bits == 8 else
            (w.view(96, -1, group_size).amax(-1) - w.view(96, -1, group_size).amin(-1))
            .repeat_interleave(group_size, 1) / 15)
    assert ((weight.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    # what the kernel multiplies by is the dequantized weight up to bf16 scales and zeros
    torch.testing.assert_close(linear.dequantize(), weight.dequantize(), rtol=0,
                               atol=float(w.abs().max()) * 2 ** -7)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_q4_blocks_are_repacked_code_for_code_for_torchs_kernel(qtype):
    """The fallback's int4 (G = 32) holds the file's codes: scale d, zero m + 8·d."""
    from test_kernels import gguf_tensor, random_blocks
    from torchllama.checkpoint.gguf import read_blocks

    raw = random_blocks(qtype, 32, 256, seed=1)
    reference = gguf.quants.dequantize(raw, qtype)             # the gguf library's values
    weight = read_blocks(gguf_tensor(raw, qtype), "t").to_int4()
    assert weight.group_size == 32 and weight.q.dtype == torch.uint8 and weight.q.max() <= 15
    # exact up to float32 rounding of zero = m + 8·d (a wrong code would be off by d)
    np.testing.assert_allclose(weight.dequantize().numpy(), reference, rtol=0,
                               atol=4 * np.finfo(np.float32).eps * np.abs(reference).max())


def tiny_args(tie: bool) -> ModelArgs:
    return ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32000,
                     hidden_dim=192, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=128,
                     tie_embeddings=tie)


def random_model(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5 if p.ndim == 1 else 0.05)
    return model.requires_grad_(False)


# Every format tied (the output reads the embedding's blocks); untied, the output is one more
# matrix of the same format as the layers', so one untied format is enough in `make test`.
@pytest.mark.parametrize("gguf_dtype, modules, tie, tolerance", [
    ("q4_1", LINEAR4, False, 0.5), ("q4_1", LINEAR4, True, 0.5), ("q4_0", LINEAR4, True, 0.5),
    ("q8_0", LINEAR8, True, 5e-2),
    pytest.param("q4_0", LINEAR4, False, 0.5, marks=pytest.mark.slow),
    pytest.param("q8_0", LINEAR8, False, 5e-2, marks=pytest.mark.slow)])
def test_a_quantized_gguf_loads_quantized_by_default(tmp_path, gguf_dtype, modules, tie,
                                                     tolerance, llama_spm_tokenizer):
    tokenizer = llama_spm_tokenizer
    path = tmp_path / "m.gguf"
    original = random_model(tiny_args(tie))
    save(original, tokenizer, path, "gguf", gguf_dtype, progress=False)
    exact, _ = torchllama.load(path, dtype="float32", progress=False)
    model, _ = torchllama.load(path, progress=False)                    # dtype="auto"
    assert isinstance(model.layers[0].attention.wq, modules)
    assert isinstance(model.layers[1].feed_forward.w2, modules)
    assert isinstance(model.output, modules) and isinstance(model.tok_embeddings, EMBEDDING)
    assert model.dtype == torch.float32                     # norms, activations, KV cache
    tokens = torch.tensor([[1, 15043, 3186, 29892, 920, 526]])
    with torch.no_grad():
        reference = exact(tokens)
        # the file holds the float model rounded to the format: close, not equal
        assert 0 < (reference - original(tokens)).abs().max() < tolerance
        rows = exact.tok_embeddings(tokens)
        # the file's blocks: the same values; Q8_0 re-quantized per row for torch's kernel:
        # within half an int8 step
        atol = 1e-6 if modules is not Int8Linear else float(rows.abs().max()) / 254 + 1e-6
        torch.testing.assert_close(model.tok_embeddings(tokens), rows, rtol=0, atol=atol)
        torch.testing.assert_close(model(tokens), reference, rtol=0,
                                   atol=bf16_tolerance(reference))
    assert weight_bytes(model) < weight_bytes(exact) / 2.5


def test_quantize_model_shares_one_table_between_tied_embeddings_and_output():
    model = random_model(tiny_args(tie=True))
    float_embedding = model.tok_embeddings.weight.clone()
    quantize_model(model, "int8")
    assert isinstance(model.output, LINEAR8)
    codes = model.output.codes if KERNELS else model.output.weight_int8
    assert model.tok_embeddings.codes.data_ptr() == codes.data_ptr()
    tokens = torch.tensor([[5, 17, 31999]])
    rows = model.tok_embeddings(tokens)
    torch.testing.assert_close(rows, float_embedding[tokens], rtol=0,
                               atol=float(float_embedding.abs().max()) / 127)
    int4 = quantize_model(random_model(tiny_args(tie=True)), "int4-g64")
    assert isinstance(int4.layers[0].feed_forward.w1, LINEAR4)
    assert isinstance(int4.output, LINEAR8)             # the vocabulary stays 8-bit


@pytest.mark.skipif(not KERNELS, reason="fused products need torchllama's kernels")
@pytest.mark.parametrize("kind", ["q4 f16", "q4 f32", "q4 mixed", "q8 small", "q8 six",
                                  "q8 mixed"])
def test_fused_linears_are_what_fusing_separate_linears_gives(kind):
    """`fused_linears` (one module packed over stacked rows, parts viewing it) equals building
    the parts apart and `fuse_rows`-ing them (bit for bit, buffer dtypes included), and
    `fuse_rows` of its parts copies nothing; parts whose scales would be stored in different
    dtypes, or whose codes in 8 and in 6 bits, are not fused (None), as `fuse_rows` refuses
    them."""
    from torchllama.blocks.forms import Q4Blocks, Q8Blocks
    from torchllama.transforms.fuse import fuse_rows, fused_linears
    from torchllama.transforms.quantize import quantized_linear

    g = torch.Generator().manual_seed(0)
    sizes, K = [16, 8, 24], 64
    N = sum(sizes)
    if kind.startswith("q4"):
        d = torch.randint(1, 100, (N, K // 32), generator=g).float() / 64     # f16-exact
        if kind != "q4 f16":
            d[:16 if kind == "q4 mixed" else N] += 1e-4                       # not f16-exact
        weight = Q4Blocks(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g),
                          d, -8 * d)
    else:
        codes = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
        if kind == "q8 six":                                # every part in 6 bits
            codes //= 8
        else:                                               # one part within ±32: "small",
            codes[16:24] = codes[16:24] // 8 + (kind == "q8 small")    # 6 bits if "mixed"
            codes[16, 0] = 32 if kind == "q8 small" else codes[16, 0]
        weight = Q8Blocks(codes, torch.rand(N, K // 32, generator=g))
    apart = [quantized_linear(w) for w in weight.split_rows(sizes)]
    reference = fuse_rows(apart)
    linears = fused_linears(weight, sizes)
    if kind.startswith("q8"):
        assert [p.codes.shape[-1] for p in apart] == {
            "q8 small": [256] * 3, "q8 six": [192] * 3, "q8 mixed": [256, 192, 256]}[kind]
    if kind in ("q4 mixed", "q8 mixed"):
        assert reference is None and linears is None
        return
    fused, parts = linears[0], linears[1:]
    for ours, theirs in zip(parts, apart):
        for a, b in zip(ours.packed(), theirs.packed()):
            assert a.dtype == b.dtype and torch.equal(a, b)
    again = fuse_rows(parts)
    for a, b, c in zip(again.packed(), reference.packed(), fused.packed()):
        assert a.dtype == b.dtype and torch.equal(a, b) and torch.equal(a, c)
    assert again.codes.data_ptr() == fused.codes.data_ptr()             # no copy
    assert reference.codes.data_ptr() != fused.codes.data_ptr()
    x = torch.randn(3, K, generator=g)
    assert torch.equal(again(x), reference(x))
    if kind == "q8 small":
        assert [bool(p.small) for p in parts] == [False, True, False] and not bool(fused.small)


def test_dtype_names():
    assert parse_dtype("float32") == (torch.float32, None)
    assert parse_dtype("auto") == (torch.float32, "auto")
    assert parse_dtype("int8") == (torch.float32, Scheme(8))
    assert parse_dtype("int4-g128") == (torch.float32, Scheme(4, 128))
    with pytest.raises(ArgumentError, match="'int3' is not supported; use one of auto, "):
        parse_dtype("int3")
    with pytest.raises(ArgumentError, match="group size must be one of 32, 64, 128, 256"):
        parse_dtype("int4-g48")


def test_the_compiled_step_falls_back_to_eager_with_one_warning():
    model = random_model(tiny_args(tie=False))
    model.setup_caches(1, 16)
    token = torch.tensor([[7]])

    def broken(tokens, pos):
        raise RuntimeError("inductor exploded\nsecond line")

    model.compiled_decode = broken
    with torch.inference_mode(), pytest.warns(UserWarning, match=r"inductor exploded\); decoding eagerly"):
        logits = decode_one_token(model, token, 0)
    assert model.compiled_decode is None
    with torch.inference_mode():
        torch.testing.assert_close(logits, model(token, 0)[:, -1])


@pytest.mark.slow
def test_compiled_decode_generates_what_eager_does(llama_spm_tokenizer):
    model = random_model(tiny_args(tie=True))
    quantize_model(model, "int4")
    tokenizer = llama_spm_tokenizer
    ids = tokenizer.encode("Hello world", bos=True)
    greedy = SamplingParams(temperature=0)
    eager = list(Session(model, tokenizer).generate(ids, 12, greedy))
    assert compile_decode(model, force=kernels.available()) > 0
    assert list(Session(model, tokenizer).generate(ids, 12, greedy)) == eager


def test_one_op_layers_stay_eager_when_compiling_is_asked():
    # Every layer is one decoder_layer call: nothing for Inductor to fuse (eager is faster).
    if not kernels.available():
        pytest.skip("torchllama's kernels are not built here")
    model = random_model(tiny_args(tie=True))
    quantize_model(model, "int4")
    assert runs_one_op_layers(model)
    with pytest.warns(UserWarning, match="not compiled"):
        assert compile_decode(model) == 0.0
    assert model.compiled_decode is None
    attention = model.layers[0].attention
    attention.wqkv = None                        # q, k, v as three products: still one op
    assert runs_one_op_layers(model)
    attention.wq = torch.nn.Linear(attention.wq.in_features, attention.wq.out_features,
                                   bias=False)   # a float product the op cannot run: compile
    assert not runs_one_op_layers(model)


# ---- the embedded SmolLM2 (Q4_1 matrices, Q8_0 tied embeddings) ----------------------------

DEMO_PROMPTS = ["Once upon a time, a little robot", "The capital of France is",
                "def fibonacci(n):"]


def test_smollm2_keeps_its_quantization_in_memory(smollm2_gguf, smollm2_auto):
    model, _ = smollm2_auto
    assert isinstance(model.layers[0].attention.wq, LINEAR4)           # Q4_1, code for code
    assert isinstance(model.output, LINEAR8)                           # Q8_0 (as stored)
    codes = model.output.codes if KERNELS else model.output.weight_int8
    assert model.tok_embeddings.codes.data_ptr() == codes.data_ptr()
    assert weight_bytes(model) <= 1.3 * smollm2_gguf.stat().st_size


def greedy(model, tokenizer, prompt, n):
    ids = tokenizer.encode(prompt, bos=tokenizer.add_bos)
    return list(Session(model, tokenizer).generate(ids, n, SamplingParams(temperature=0)))


def test_quantized_smollm2_greedy_output_starts_as_float32s(smollm2, smollm2_auto):
    """The GGUF's own Q4_1 values (as int4) and its Q8_0 head (as int8 per row) against the
    exact float32 dequantization: bf16 activations and the re-quantized head change logits
    by ~1e-2, so greedy texts agree on their first tokens and may part where two candidates
    are nearly tied."""
    exact, tokenizer = smollm2
    model, _ = smollm2_auto
    for prompt in DEMO_PROMPTS:
        reference = greedy(exact, tokenizer, prompt, 8)
        assert greedy(model, tokenizer, prompt, 8)[:4] == reference[:4], prompt


FALLBACK_SCRIPT = """
import torch
from torchllama import kernels
from torchllama.blocks.forms import Q4Blocks, Q8Blocks
from torchllama.transforms.quantize import Int4Linear, Int8Linear, quantized_linear
w = torch.randn(32, 64)
assert not kernels.available() and kernels.isa() == "none"
assert isinstance(quantized_linear(Q4Blocks.from_float(w)), Int4Linear)
assert isinstance(quantized_linear(Q8Blocks.from_float(w)), Int8Linear)
print("fallback ok")
"""


@pytest.mark.parametrize("env", [{"CXX": "/nonexistent/c++"}, {"TORCHLLAMA_KERNELS": "0"}],
                         ids=["no-compiler", "disabled"])
def test_without_the_kernels_torchs_run_after_at_most_one_warning(tmp_path, env):
    import subprocess
    import sys
    inherited = {k: v for k, v in os.environ.items() if k != "TORCHLLAMA_KERNELS"}  # (make
    # test-fallback sets it)
    run = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], capture_output=True, text=True,
                         env={**inherited, "TORCHLLAMA_CACHE": str(tmp_path), **env}, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "fallback ok"
    warnings = [line for line in run.stderr.splitlines() if line.strip()]
    if "CXX" in env:
        assert len(warnings) == 1 and "no C++ compiler" in warnings[0], run.stderr
    else:
        assert warnings == [], run.stderr                 # switched off on purpose: silent
