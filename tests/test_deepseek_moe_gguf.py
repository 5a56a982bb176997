"""DeepSeek's mixture of experts in GGUF (llama.cpp's `deepseek2` with expert keys):
V2(-Lite)'s softmax router and V3's sigmoid router with its correction bias and groups, read
and written, exact against llama.cpp (float32), close in Q8_0 / Q4_0; bad expert keys named;
DeepSeek-V3's multi-token-prediction tensors skipped."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import torchllama
from torchllama.errors import ArgumentError, ModelFileError

sys.path.insert(0, str(Path(__file__).parent))
from test_gguf_families import MLA, random_model, rewrite, tiny_bpe_tokenizer, tokens  # noqa: E402

# DeepSeek-V2-Lite's choices, tiny: no query compression, a dense first layer, softmax over
# the experts without renormalizing (scale 1), 2 shared experts; 27 layers, as llama.cpp's
# deepseek2 knows a model without query compression only by V2-Lite's layer count (26 or 27)
V2_LITE = dict(MLA, n_layers=27, max_seq_len=512, hidden_dim=96, n_experts=8,
               n_experts_per_token=3, moe_hidden_dim=64, n_shared_experts=2,
               moe_norm_topk=False, first_dense_layers=1)
# DeepSeek-V3's: query compression, sigmoid scores + correction bias, 4 groups of which 2,
# renormalized, × 2.5, 1 shared expert
V3 = dict(V2_LITE, n_layers=3, q_lora_rank=24, moe_router="sigmoid", moe_groups=4,
          moe_group_topk=2, moe_norm_topk=True, moe_scale=2.5, n_shared_experts=1)
ROUTERS = pytest.mark.parametrize("fields", [V2_LITE, V3], ids=["v2-lite", "v3"])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_bpe_tokenizer(tmp_path_factory.mktemp("tok"))


def _model(fields):
    model = random_model(fields)
    for layer in model.layers[fields["first_dense_layers"]:]:
        if fields.get("moe_router") == "sigmoid":               # a bias that changes choices
            layer.feed_forward.e_score_correction_bias.normal_(0, 0.05)
    return model


def _ids(n: int) -> list[int]:
    return torch.randint(0, MLA["vocab_size"], (n,),
                         generator=torch.Generator().manual_seed(2)).tolist()


def _llama_cpp_logits(path, ids, f32_cache=False):
    """llama.cpp's logits (T, V) of `ids` (its KV cache float32 with `f32_cache`)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    cache = dict(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32) \
        if f32_cache else {}
    llm = llama_cpp.Llama(str(path), n_ctx=512, n_batch=512, logits_all=True, verbose=False,
                          n_threads=1, **cache)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def _router_margins(model, ids) -> np.ndarray:
    """(T,) for each position, the smallest margin over the MoE layers between a chosen
    expert's choice score and the best one left out (softmax: the probabilities; sigmoid:
    σ + correction bias, groups left aside) and, with groups, between the chosen and the
    best left-out group's score: where it is ~1e-6, float rounding alone decides the choice."""
    logits = []
    hooks = [layer.feed_forward.gate.register_forward_hook(
        lambda m, inp, out: logits.append(out.detach().float().reshape(len(ids), -1)))
        for layer in model.layers[model.args.first_dense_layers:]]
    with torch.inference_mode():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    k, G, Gk = model.args.n_experts_per_token, model.args.moe_groups, model.args.moe_group_topk
    margins = []
    for layer, x in zip(model.layers[model.args.first_dense_layers:], logits):   # x (T, E)
        moe = layer.feed_forward
        score = torch.softmax(x, -1) if moe.router == "softmax" else \
            torch.sigmoid(x) + moe.e_score_correction_bias                       # (T, E)
        top = score.sort(-1, descending=True).values                             # (T, E)
        margins.append(top[:, k - 1] - top[:, k])
        if G > 1:
            group = score.view(len(ids), G, -1).topk(2, -1).values.sum(-1)       # (T, G)
            top = group.sort(-1, descending=True).values
            margins.append(top[:, Gk - 1] - top[:, Gk])
    return torch.stack(margins).min(0).values.numpy()                           # (T,)


@ROUTERS
def test_round_trip_keeps_the_experts(tmp_path, tokenizer, fields):
    model = _model(dict(fields, n_layers=3))        # (V2-Lite's 27 layers: llama.cpp's)
    path = torchllama.save(model, tokenizer, tmp_path / "m.gguf", to="gguf", progress=False)
    meta = {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values()}
    assert meta["deepseek2.expert_count"] == 8 and meta["deepseek2.leading_dense_block_count"] == 1
    assert meta["deepseek2.expert_gating_func"] == (2 if fields is V3 else 1)
    assert ("deepseek2.expert_group_count" in meta) == (fields is V3)
    loaded, _ = torchllama.load(path, dtype="float32", progress=False)
    for name in ("n_experts", "n_experts_per_token", "moe_hidden_dim", "n_shared_experts",
                 "moe_router", "moe_norm_topk", "moe_scale", "moe_groups", "moe_group_topk",
                 "first_dense_layers", "q_lora_rank"):
        assert getattr(loaded.args, name) == getattr(model.args, name), name
    ids = tokens(20)
    with torch.inference_mode():
        assert torch.equal(loaded(ids), model(ids))


@ROUTERS
def test_llama_cpp_computes_our_float32_deepseek_moe_files_as_we_do(tmp_path, tokenizer,
                                                                    fields):
    """float32 (llama.cpp's KV cache float32 too), 64 positions: every top-1 equal, and
    max |Δlogit| < 1e-3 wherever the routers' choices are not near-ties (measured 2.3e-4
    V2-Lite, 1.0e-4 V3). The exception, measured: V2-Lite's position 55, whose 3rd and 4th
    expert in layer 12 differ by 9.5e-7 in probability — llama.cpp's rounding picks the other
    one, 5.9e-3 apart in the logits."""
    model = _model(fields)
    path = torchllama.save(model, tokenizer, tmp_path / "f32.gguf", to="gguf", progress=False)
    ids = _ids(64)
    theirs = _llama_cpp_logits(path, ids, f32_cache=True)
    with torch.inference_mode():
        ours = model(torch.tensor([ids]))[0].numpy()
    error = np.abs(theirs - ours).max(-1)                                   # (64,)
    tie = _router_margins(model, ids) < 1e-5                                # (64,)
    assert tie.sum() <= 2
    assert error[~tie].max() < 1e-3 and error.max() < 0.02
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
@ROUTERS
def test_llama_cpp_computes_our_quantized_deepseek_moe_files_as_we_do(tmp_path, tokenizer,
                                                                      fields, dtype):
    """Q8_0 / Q4_0 (the experts' 3-D tensors in blocks, on our kernels' stacked op; llama.cpp's
    default float16 KV cache), 256 positions; measured (V2-Lite / V3):
      Q8_0: max |Δlogit| 0.035 / 0.154, 98th percentile 0.023 / 0.010, top-1 98.0% / 98.8%
      Q4_0: max |Δlogit| 0.026 / 0.114, 98th percentile 0.021 / 0.009, top-1 97.7% / 98.4%.
    V3's largest are positions where a near-tie among the router's scores picked another
    expert. The top-1 tokens that differ are the random model's near-ties: wherever ours
    leads its runner-up by more than 2 × that position's |Δlogit|, llama.cpp's top-1 is ours.
    Asserted: 98th percentile < 0.04, max < 0.25, top-1 ≥ 97%, and every top-1 beyond a
    near-tie equal."""
    model = _model(fields)
    path = torchllama.save(model, tokenizer, tmp_path / f"{dtype}.gguf", to="gguf",
                           dtype=dtype, progress=False)
    quantized, _ = torchllama.load(path, progress=False)
    assert quantized.layers[1].feed_forward.stacked is not None
    ids = _ids(256)
    with torch.inference_mode():
        ours = quantized(torch.tensor([ids]))[0].numpy()
    theirs = _llama_cpp_logits(path, ids)
    error = np.abs(theirs - ours).max(-1)                                   # (256,)
    assert np.quantile(error, 0.98) < 0.04 and error.max() < 0.25
    same = theirs.argmax(-1) == ours.argmax(-1)                             # (256,)
    assert same.mean() >= 0.97
    top2 = np.sort(ours, -1)[:, -2:]                                        # (256, 2)
    assert same[top2[:, 1] - top2[:, 0] > 2 * error].all()


# ---- bad input ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v3_file(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("v3")
    return torchllama.save(_model(V3), tokenizer, folder / "m.gguf", to="gguf", progress=False)


@pytest.mark.parametrize("key, value, match", [
    ("expert_gating_func", 7, r"deepseek2\.expert_gating_func is 7; expected 1 \(softmax\) or "
                              r"2 \(sigmoid\)"),
    ("expert_used_count", 9, r"deepseek2\.expert_used_count is 9; expected 1 to "
                             r"deepseek2\.expert_count \(8\)"),
    ("expert_used_count", 0, r"deepseek2\.expert_used_count is 0"),
    ("expert_group_count", 3, r"deepseek2\.expert_group_count \(3\) must divide "
                              r"deepseek2\.expert_count \(8\)"),
    # the router's expert count is its rows': the loader names the router tensor
    ("expert_count", 16, r"'blk\.1\.ffn_gate_inp\.weight' has shape \(8, 64\), expected "
                         r"\(16, 64\)"),
    ("expert_feed_forward_length", 32, r"'blk\.1\.ffn_gate_exps\.weight' has shape "
                                       r"\(8, 64, 64\), expected \(8, 32, 64\)"),
])
def test_expert_keys_that_do_not_fit_are_named(tmp_path, v3_file, key, value, match):
    bad = rewrite(v3_file, tmp_path / "bad.gguf", drop_keys=(f"deepseek2.{key}",),
                  set_keys={f"deepseek2.{key}": ("add_uint32", value)})
    with pytest.raises(ModelFileError, match=match):
        torchllama.load(bad, progress=False)


def test_softmax_gating_with_groups_is_refused(tmp_path, v3_file):
    """DeepSeek-V2's group-limited choice over softmax scores: not our softmax router's."""
    bad = rewrite(v3_file, tmp_path / "bad.gguf", drop_keys=("deepseek2.expert_gating_func",),
                  set_keys={"deepseek2.expert_gating_func": ("add_uint32", 1)})
    with pytest.raises(ModelFileError, match=r"deepseek2\.expert_group_count is 4 with "
                                             r"softmax gating"):
        torchllama.load(bad, progress=False)


@pytest.mark.parametrize("name, match", [
    ("blk.1.ffn_up_exps.weight", r"missing tensors for blk\.1\.ffn_up_exps\.weight "
                                 r"\(layers\.1\.feed_forward\.experts\.0\.w3\.weight\)"),
    ("blk.2.exp_probs_b.bias", r"missing tensors for blk\.2\.exp_probs_b\.bias"),
    ("blk.1.ffn_down_shexp.weight", r"missing tensors for blk\.1\.ffn_down_shexp\.weight"),
])
def test_missing_expert_tensors_are_named(tmp_path, v3_file, name, match):
    bad = rewrite(v3_file, tmp_path / "bad.gguf", tensors={name: None})
    with pytest.raises(ModelFileError, match=match):
        torchllama.load(bad, progress=False)


def test_experts_without_shared_experts_are_not_written(tmp_path, tokenizer):
    """llama.cpp's deepseek2 requires ffn_*_shexp: such a file would not load there."""
    with pytest.raises(ArgumentError, match=r"llama\.cpp's deepseek2 requires shared experts"):
        torchllama.save(_model(dict(V3, n_shared_experts=0)), tokenizer, tmp_path / "m.gguf",
                        to="gguf", progress=False)


# ---- DeepSeek-V3's multi-token prediction ---------------------------------------------------

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


_NEXTN = {"eh_proj": (64, 128), "enorm": (64,), "hnorm": (64,), "shared_head_norm": (64,)}


def test_the_nextn_tensors_of_a_gguf_file_are_skipped(tmp_path, v3_file):
    """gguf-py's NEXTN tensors (`blk.{i}.nextn.*`): skipped, whether block_count counts their
    block (with deepseek2.nextn_predict_layers) or not; the main model's logits as without."""
    nextn = {f"blk.3.nextn.{n}.weight": np.zeros(s, np.float32) for n, s in _NEXTN.items()}
    counted = rewrite(v3_file, tmp_path / "counted.gguf", tensors=nextn,
                      drop_keys=("deepseek2.block_count",),
                      set_keys={"deepseek2.block_count": ("add_uint32", 4),
                                "deepseek2.nextn_predict_layers": ("add_uint32", 1)})
    plain = rewrite(v3_file, tmp_path / "plain.gguf", tensors=nextn)
    model, _ = torchllama.load(v3_file, dtype="float32", progress=False)
    ids = tokens(12)
    for path in (counted, plain):
        loaded, _ = torchllama.load(path, dtype="float32", progress=False)
        assert loaded.args.n_layers == 3
        with torch.inference_mode():
            assert torch.equal(loaded(ids), model(ids))


def test_a_whole_mtp_block_in_a_gguf_file_is_named(tmp_path, v3_file):
    """A file whose MTP block holds a layer's tensors besides its nextn ones (llama.cpp's
    DeepSeek-V3.2 converter): the weight loader cannot skip them; they are named."""
    bad = rewrite(v3_file, tmp_path / "bad.gguf", drop_keys=("deepseek2.block_count",),
                  set_keys={"deepseek2.block_count": ("add_uint32", 4),
                            "deepseek2.nextn_predict_layers": ("add_uint32", 1)},
                  tensors={"blk.3.attn_norm.weight": np.ones(64, np.float32),
                           "blk.3.nextn.enorm.weight": np.ones(64, np.float32)})
    with pytest.raises(ModelFileError, match=r"multi-token-prediction block\(s\) past the main "
                                             r"model's 3 .*: blk\.3\.attn_norm\.weight$"):
        torchllama.load(bad, progress=False)
