"""Saving and converting between Meta, Hugging Face and GGUF: round trips are bit-identical,
logits agree across loaders, transformers reads our HF export, outputs are written atomically."""

import os

import pytest
import torch

import torchllama
from torchllama.checkpoint import atomic_output, convert, save
from torchllama.cli import main
from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError, TorchLlamaError
from torchllama.model import Transformer


@pytest.fixture(scope="module")
def spm_tokenizer(llama_spm_tokenizer):
    return llama_spm_tokenizer


def random_model(n_kv_heads, seed=0):
    torch.manual_seed(seed)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=32000,
                     hidden_dim=176, norm_eps=1e-5, rope_theta=5000.0, max_seq_len=256)
    model = Transformer(args).eval()
    for p in model.parameters():          # norms away from 1 so a lost norm would show
        torch.nn.init.normal_(p, std=0.5 if p.ndim == 1 else 0.05)
    return model


def state(model):
    return {k: v.contiguous() for k, v in model.state_dict().items()}


# GQA is the case that catches wk un-permuted with the wrong head count; MHA (every head its own
# key) goes through the same code and is also read against transformers in test_hf_checkpoint.
@pytest.mark.parametrize("n_kv_heads", [pytest.param(4, marks=pytest.mark.slow), 2])  # MHA, GQA
def test_meta_hf_gguf_meta_round_trip_is_bit_identical(tmp_path, spm_tokenizer, n_kv_heads):
    model = random_model(n_kv_heads)
    tokens = torch.tensor([spm_tokenizer.encode("The capital of France is", bos=True)])
    with torch.no_grad():
        expected_logits = model(tokens)
    save(model, spm_tokenizer, tmp_path / "meta", "meta", progress=False)
    convert(tmp_path / "meta", tmp_path / "hf", "hf", progress=False)
    convert(tmp_path / "hf", tmp_path / "m.gguf", "gguf", "float32", progress=False)
    convert(tmp_path / "m.gguf", tmp_path / "meta2", "meta", progress=False)
    for path in ("meta", "hf", "m.gguf", "meta2"):
        loaded, tok = torchllama.load(tmp_path / path, dtype="float32", progress=False)
        for name, tensor in state(model).items():
            assert torch.equal(loaded.state_dict()[name].contiguous(), tensor), (path, name)
        with torch.no_grad():
            torch.testing.assert_close(loaded(tokens), expected_logits, atol=1e-5, rtol=0)
        assert tok.encode("Hello world") == [15043, 3186] and tok.bos_id == 1 and tok.add_bos
    assert sorted(os.listdir(tmp_path / "meta2")) == ["consolidated.00.pth", "params.json",
                                                      "tokenizer.model"]


# The block formats are written, read back and compared with the float model, within the same
# tolerances, by test_quantize's test_a_quantized_gguf_loads_quantized_by_default too.
@pytest.mark.parametrize("dtype, tolerance", [
    ("float16", 1e-2), ("bfloat16", 5e-2), *(pytest.param(d, t, marks=pytest.mark.slow)
                                             for d, t in [("q8_0", 5e-2), ("q4_0", 0.5),
                                                          ("q4_1", 0.5)])])
def test_gguf_outputs_in_lower_precision(tmp_path, spm_tokenizer, dtype, tolerance):
    model = random_model(2)
    save(model, spm_tokenizer, tmp_path / "m.gguf", "gguf", dtype, progress=False)
    loaded, _ = torchllama.load(tmp_path / "m.gguf", dtype="float32", progress=False)
    tokens = torch.tensor([[1, 15043, 3186, 29892]])
    with torch.no_grad():
        diff = (loaded(tokens) - model(tokens)).abs().max()
    assert 0 < diff < tolerance              # rounded, but close


def test_hf_export_of_the_real_model_loads_in_transformers(tmp_path, smollm2):
    transformers = pytest.importorskip("transformers")
    model, tokenizer = smollm2
    save(model, tokenizer, tmp_path / "hf", "hf", progress=False)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The capital of France is Paris. 12345 héllo 🙂"
    ids = tokenizer.encode(text)
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ids
    with torch.no_grad():
        ours = model(torch.tensor([ids]))
        theirs = hf_model(torch.tensor([ids])).logits
    assert (ours - theirs).abs().max() < 1e-4
    chat = [{"role": "user", "content": "Hi!"}]
    assert hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) \
        == tokenizer.apply_chat_template(chat)


def test_bpe_tokenizer_survives_every_format(tmp_path, smollm2):
    _, tokenizer = smollm2
    model = random_model(2)                      # any model: only the tokenizer matters here
    model = Transformer(model.args.replace(vocab_size=tokenizer.vocab_size)).eval()
    text = "Hello world 12345\n\tcode(x) <|im_start|> 世界"
    for to, name in [("meta", "meta"), ("hf", "hf"), ("gguf", "t.gguf")]:
        save(model, tokenizer, tmp_path / name, to, progress=False)
        _, loaded = torchllama.load(tmp_path / name, progress=False)
        assert loaded.encode(text) == tokenizer.encode(text), to
        assert loaded.encode(text, special=True) == tokenizer.encode(text, special=True), to
        assert loaded.stop_ids == tokenizer.stop_ids and loaded.chat_template == tokenizer.chat_template


# ---- atomic writes, refusals -------------------------------------------------------------------

def test_existing_output_is_not_overwritten_without_force(tmp_path, spm_tokenizer):
    model = random_model(2)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "mine.txt").write_text("precious")
    with pytest.raises(ArgumentError, match="already exists; pass --force"):
        save(model, spm_tokenizer, dst, "hf", progress=False)
    assert (dst / "mine.txt").read_text() == "precious"
    save(model, spm_tokenizer, dst, "hf", force=True, progress=False)
    assert not (dst / "mine.txt").exists() and (dst / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]         # no leftovers


@pytest.mark.parametrize("folder", [True, False])
def test_a_failed_write_leaves_nothing_and_keeps_the_old_output(tmp_path, folder):
    dst = tmp_path / ("out" if folder else "out.gguf")
    with pytest.raises(RuntimeError):
        with atomic_output(dst, folder=folder) as tmp:
            (tmp / "half" if folder else tmp).write_text("half-written")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []                                # nothing half-written
    dst.write_text("old") if not folder else (dst.mkdir(), (dst / "f").write_text("old"))
    with pytest.raises(RuntimeError):
        with atomic_output(dst, folder=folder, force=True) as tmp:
            (tmp / "half" if folder else tmp).write_text("half-written")
            raise RuntimeError("disk full")
    assert (dst / "f" if folder else dst).read_text() == "old"           # old output intact
    assert [p.name for p in tmp_path.iterdir()] == [dst.name]


def test_bad_format_dtype_and_tokenizer(tmp_path, spm_tokenizer):
    model = random_model(2)
    with pytest.raises(ArgumentError, match="--to 'onnx' is not a format"):
        save(model, spm_tokenizer, tmp_path / "x", "onnx")
    with pytest.raises(ArgumentError, match="not supported for GGUF"):
        save(model, spm_tokenizer, tmp_path / "x.gguf", "gguf", "q2_k")
    with pytest.raises(ArgumentError, match="--dtype 'int8' is not supported"):
        save(model, spm_tokenizer, tmp_path / "x", "hf", "int8")
    assert list(tmp_path.iterdir()) == []


def test_convert_cli(tmp_path, spm_tokenizer, capsys):
    save(random_model(2), spm_tokenizer, tmp_path / "meta", "meta", progress=False)
    assert main(["convert", str(tmp_path / "meta"), str(tmp_path / "m.gguf"), "--to", "gguf",
                 "--dtype", "bfloat16"]) == 0
    assert (tmp_path / "m.gguf").is_file()
    assert main(["convert", str(tmp_path / "meta"), str(tmp_path / "m.gguf"), "--to", "gguf"]) == 1
    err = capsys.readouterr().err
    assert "torchllama: error:" in err and "already exists; pass --force" in err
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "x"), "--to", "hf"]) == 1
    assert "no such file or folder" in capsys.readouterr().err


def test_convert_checks_dtype_before_loading(tmp_path):
    with pytest.raises(ArgumentError, match="--dtype 'q8_0' is not supported for hf"):
        convert(tmp_path / "does-not-exist", tmp_path / "out", "hf", "q8_0")
