"""DeepSeek's mixture of experts in GGUF (llama.cpp's `deepseek2` with expert keys):
V2(-Lite)'s softmax router and V3's sigmoid router with its correction bias and groups, read
and written, exact against llama.cpp; DeepSeek-V3's multi-token-prediction layer skipped."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import torchllama
from torchllama.errors import ModelFileError

sys.path.insert(0, str(Path(__file__).parent))
from test_gguf_families import MLA, random_model, tiny_bpe_tokenizer, tokens  # noqa: E402

# DeepSeek-V2-Lite's choices, tiny: no query compression, a dense first layer, softmax over
# the experts without renormalizing, 2 shared experts; 27 layers, as llama.cpp's deepseek2
# knows a model without query compression only by V2-Lite's layer count
V2_LITE = dict(MLA, n_layers=27, max_seq_len=512, hidden_dim=96, n_experts=8,
               n_experts_per_token=3, moe_hidden_dim=64, n_shared_experts=2,
               moe_norm_topk=False, first_dense_layers=1)
# DeepSeek-V3's: query compression, sigmoid scores + correction bias, 4 groups of which 2,
# renormalized, × 2.5, 1 shared expert
V3 = dict(V2_LITE, n_layers=3, q_lora_rank=24, moe_router="sigmoid", moe_groups=4, moe_group_topk=2,
          moe_norm_topk=True, moe_scale=2.5, n_shared_experts=1)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_bpe_tokenizer(tmp_path_factory.mktemp("tok"))


def _model(fields):
    model = random_model(fields)
    for layer in model.layers[fields["first_dense_layers"]:]:
        if fields.get("moe_router") == "sigmoid":               # a bias that changes choices
            layer.feed_forward.e_score_correction_bias.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("fields", [V2_LITE, V3], ids=["v2-lite", "v3"])
def test_round_trip_keeps_the_experts(tmp_path, tokenizer, fields):
    model = _model(fields)
    path = torchllama.save(model, tokenizer, tmp_path / "m.gguf", to="gguf", progress=False)
    meta = {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values()}
    assert meta["deepseek2.expert_count"] == 8 and meta["deepseek2.leading_dense_block_count"] == 1
    assert meta["deepseek2.expert_gating_func"] == (2 if fields is V3 else 1)
    loaded, _ = torchllama.load(path, dtype="float32", progress=False)
    for name in ("n_experts", "n_experts_per_token", "moe_hidden_dim", "n_shared_experts",
                 "moe_router", "moe_norm_topk", "moe_scale", "moe_groups", "moe_group_topk",
                 "first_dense_layers", "q_lora_rank"):
        assert getattr(loaded.args, name) == getattr(model.args, name), name
    ids = tokens(20)
    with torch.inference_mode():
        assert torch.equal(loaded(ids), model(ids))


@pytest.mark.parametrize("fields", [V2_LITE, V3], ids=["v2-lite", "v3"])
def test_llama_cpp_computes_our_deepseek_moe_files_as_we_do(tmp_path, tokenizer, fields):
    """float32: every top-1 equal over 64 positions, max |Δlogit| < 1e-3 for 3 layers (V3)
    and < 0.02 for V2-Lite's 27 (measured 0.008: llama.cpp keeps its KV cache in float16);
    Q8_0 (the experts' 3-D tensors in blocks, our kernels' stacked op) over 256 positions: the
    same top-1 at ≥ 98% (measured 98.0% / 98.8%: a random model's near-ties, as
    tests/test_moe_kernels.py) and max |Δlogit| < 0.08 at 98% of positions (measured medians
    0.010 / 0.004; V3's two largest, 0.11 and 0.15, are positions where a near-tie among the
    router's scores picked another expert)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    model = _model(fields)
    f32 = torchllama.save(model, tokenizer, tmp_path / "f32.gguf", to="gguf", progress=False)
    q8 = torchllama.save(model, tokenizer, tmp_path / "q8.gguf", to="gguf", dtype="q8_0",
                         progress=False)
    ids = torch.randint(0, model.args.vocab_size, (256,),
                        generator=torch.Generator().manual_seed(2)).tolist()

    def theirs(path, n):
        llm = llama_cpp.Llama(str(path), n_ctx=512, n_batch=512, logits_all=True, verbose=False,
                              n_threads=2)
        llm.eval(ids[:n])
        return np.array(llm.scores[:n])

    with torch.inference_mode():
        ours = model(torch.tensor([ids[:64]]))[0].numpy()
    exact = theirs(f32, 64)
    assert np.abs(exact - ours).max() < (1e-3 if model.args.n_layers == 3 else 0.02)
    assert (exact.argmax(-1) == ours.argmax(-1)).all()
    quantized, _ = torchllama.load(q8, progress=False)
    assert quantized.layers[1].feed_forward.stacked is not None
    with torch.inference_mode():
        ours = quantized(torch.tensor([ids]))[0].numpy()
    cpp = theirs(q8, 256)
    per_position = np.abs(cpp - ours).max(-1)                               # (256,)
    assert np.quantile(per_position, 0.98) < 0.08
    assert (cpp.argmax(-1) == ours.argmax(-1)).mean() >= 0.98


def test_an_unknown_gating_function_is_named(tmp_path, tokenizer):
    from test_gguf_families import rewrite

    path = torchllama.save(_model(V2_LITE), tokenizer, tmp_path / "m.gguf", to="gguf",
                           progress=False)
    bad = rewrite(path, tmp_path / "bad.gguf", drop_keys=("deepseek2.expert_gating_func",),
                  set_keys={"deepseek2.expert_gating_func": ("add_uint32", 7)})
    with pytest.raises(ModelFileError, match=r"deepseek2\.expert_gating_func is 7"):
        torchllama.load(bad, progress=False)


def test_the_multi_token_prediction_layer_of_an_hf_folder_is_skipped(tmp_path, tokenizer):
    """DeepSeek-V3's release carries its MTP module as the layer past num_hidden_layers: it
    loads as the main model alone (the same logits as without it)."""
    from safetensors.torch import load_file, save_file

    model = _model(dict(V3, rope_scaling=None))
    folder = torchllama.save(model, tokenizer, tmp_path / "hf", to="hf", progress=False)
    weights = load_file(folder / "model.safetensors")
    extra = {k.replace("model.layers.2.", "model.layers.3."): v.clone()
             for k, v in weights.items() if k.startswith("model.layers.2.")}
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**weights, **extra}, folder / "model.safetensors")
    loaded, _ = torchllama.load(folder, dtype="float32", progress=False)
    ids = tokens(12)
    with torch.inference_mode():
        assert torch.equal(loaded(ids), model(ids))
