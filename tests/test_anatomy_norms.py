"""The normalization section of the anatomy report (torchllama.anatomy.norms): each helper against
a hand-computed answer, the pre- vs post-norm gradient profile against Xiong et al. 2020, and the
section on a tiny random model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from torchllama.anatomy.norms import (cosine, layer_grad_norms, norms_section, other_norms,
                                      residual_rms, rms_vs_layer_norm, unit_layer_norm,
                                      unit_rms_norm, vector_stats)
from torchllama.anatomy.report import AnatomyContext, Figure, _jsonable
from torchllama.config import ModelArgs
from torchllama.model import Transformer


def test_rms_norm_known_answer_and_unit_rms():
    # [3, 4, 0, 0]: mean(x²) = 25/4, RMS 2.5 → [1.2, 1.6, 0, 0]
    x = torch.tensor([[3.0, 4.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [-2.0, 0.5, 7.0, 3.0]])
    y = unit_rms_norm(x, eps=0.0)
    torch.testing.assert_close(y[0], torch.tensor([1.2, 1.6, 0.0, 0.0]))
    torch.testing.assert_close(y[1], torch.ones(4))
    torch.testing.assert_close(residual_rms(y), torch.ones(3))        # RMS 1 per vector
    # eps shrinks the RMS to sqrt(ms / (ms + eps)): ms = 1 for the ones row
    assert residual_rms(unit_rms_norm(x[1:2], eps=1.0)).item() == pytest.approx(math.sqrt(0.5))


def test_layer_norm_known_answer_mean_zero_variance_one():
    # 7 + 5·[1, −1, 1, −1]: μ = 7, σ = 5 → [1, −1, 1, −1]
    x = torch.tensor([[12.0, 2.0, 12.0, 2.0], [0.0, 1.0, 2.0, 3.0], [100.0, -3.0, 5.0, 40.0]])
    y = unit_layer_norm(x, eps=0.0)
    torch.testing.assert_close(y[0], torch.tensor([1.0, -1.0, 1.0, -1.0]))
    # [0, 1, 2, 3]: μ = 1.5, σ² = 1.25
    torch.testing.assert_close(y[1], (torch.arange(4.0) - 1.5) / math.sqrt(1.25))
    mean, var = vector_stats(y)
    torch.testing.assert_close(mean, torch.zeros(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(var, torch.ones(3))


def test_cosine_rms_vs_layer_norm_is_one_for_zero_mean_and_sigma_over_rms_otherwise():
    zero_mean = torch.tensor([[1.0, -1.0, 1.0, -1.0], [3.0, -2.0, 0.5, -1.5]])
    out = rms_vs_layer_norm(zero_mean)
    torch.testing.assert_close(out["cosine"], torch.ones(2), atol=1e-6, rtol=0)
    # [4, 2, 4, 2]: μ = 3, mean(x²) = 10, σ = 1 → cos = σ / RMS = 1/√10; RMSNorm's output has
    # mean μ/RMS = 3/√10 and variance σ²/ms = 1/10
    shifted = torch.tensor([[4.0, 2.0, 4.0, 2.0]])
    out = rms_vs_layer_norm(shifted, eps=0.0)
    assert out["cosine"].item() == pytest.approx(1 / math.sqrt(10), abs=1e-6)
    assert out["cosine"].item() < 0.5
    assert out["rms_mean"].item() == pytest.approx(3 / math.sqrt(10), abs=1e-6)
    assert out["rms_var"].item() == pytest.approx(0.1, abs=1e-6)
    assert out["ln_mean"].item() == pytest.approx(0.0, abs=1e-6)
    assert out["ln_var"].item() == pytest.approx(1.0, abs=1e-6)
    # a large mean drives the cosine towards 0
    big = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) + 20.0
    assert rms_vs_layer_norm(big)["cosine"].max() < 0.1
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])).item() == 0.0


def test_other_norms_known_answers_and_causality():
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(1)) * 3 + 1
    outs = other_norms(x, groups=4, eps=1e-5)
    # GroupNorm with one group per token is LayerNorm
    torch.testing.assert_close(other_norms(x, groups=1)["GroupNorm per token"], outs["LayerNorm"])
    # GroupNorm per token: each group of 4 channels of each token has mean 0, variance 1
    g_mean, g_var = vector_stats(outs["GroupNorm per token"].reshape(12, 4, 4))
    torch.testing.assert_close(g_mean, torch.zeros(12, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(g_var, torch.ones(12, 4), atol=1e-4, rtol=0)
    # InstanceNorm: each channel over positions has mean 0, variance 1
    c_mean, c_var = vector_stats(outs["InstanceNorm"].T)
    torch.testing.assert_close(c_mean, torch.zeros(16), atol=1e-5, rtol=0)
    torch.testing.assert_close(c_var, torch.ones(16), atol=1e-4, rtol=0)
    # changing the last token changes earlier outputs only for the norms that pool positions
    x2 = x.clone()
    x2[-1] += 50.0
    outs2 = other_norms(x2, groups=4)
    for name in ("RMSNorm", "LayerNorm", "GroupNorm per token"):
        torch.testing.assert_close(outs2[name][:-1], outs[name][:-1])
    for name in ("GroupNorm over sequence", "InstanceNorm"):
        assert not torch.allclose(outs2[name][:-1], outs[name][:-1], atol=1e-3)


def _log_slope(values: list[float]) -> float:
    """Least-squares slope of log(values) against layer index, times (n − 1): the log of the
    fitted last/first ratio."""
    y = torch.tensor(values).log()
    x = torch.arange(len(values), dtype=torch.float32)
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum() * (len(values) - 1))


def test_post_norm_gradient_profile_differs_from_pre_norm_as_xiong_et_al():
    """Xiong et al. 2020 (Xavier init): relative to the lower layers, post-norm's gradients are
    larger near the output than pre-norm's, whose gradients shrink with depth. Averaged over 4
    seeds the fitted log(last/first) of post-norm must exceed pre-norm's by 0.3 (measured:
    about −0.6 vs −1.2); if the placement were ignored both would be equal and this fails."""
    slopes = {"pre": [], "post": []}
    train = {"pre": [], "post": []}
    for seed in range(4):
        tokens = torch.randint(0, 64, (1, 49), generator=torch.Generator().manual_seed(seed))
        for placement in slopes:
            args = ModelArgs(dim=64, n_layers=16, n_heads=4, vocab_size=64, max_seq_len=64,
                             multiple_of=16, norm_placement=placement)
            g = layer_grad_norms(args, tokens, seed, init="xavier")
            assert len(g["w2"]) == len(g["block"]) == 16 and all(v > 0 for v in g["w2"])
            slopes[placement].append(_log_slope(g["w2"]))
            train[placement].append(layer_grad_norms(args, tokens, seed, init="train"))
    pre, post = (sum(slopes[p]) / 4 for p in ("pre", "post"))
    assert post - pre > 0.3, (pre, post)
    assert pre < -0.5                                   # pre-norm: gradients shrink with depth
    # the training init: post-norm flat, pre-norm declining, each seed
    for g_pre, g_post in zip(train["pre"], train["post"]):
        assert abs(_log_slope(g_post["w2"])) < 0.05
        assert _log_slope(g_pre["w2"]) < _log_slope(g_post["w2"]) - 0.02
        # pre-norm's final norm divides the small (RMS ≈ 0.02) stream: far larger gradients
        assert g_pre["w2"][-1] > 10 * g_post["w2"][-1]


def test_layer_grad_norms_leaves_rng_and_rejects_unknown_init():
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, multiple_of=16)
    tokens = torch.randint(0, 1000, (1, 9))                 # ids above vocab: taken modulo
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = layer_grad_norms(args, tokens, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert layer_grad_norms(args, tokens, seed=5) == a      # seeded: reproducible
    assert a["loss"][0] == pytest.approx(math.log(64), rel=0.05)   # ≈ uniform at init
    with pytest.raises(ValueError, match="init"):
        layer_grad_norms(args, tokens, init="kaiming")


class _StubTokenizer:
    bos_id, eos_id, add_bos, special_tokens = 1, 2, True, {}


def test_norms_section_on_tiny_model():
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=64)
    model = Transformer(args).float().eval()
    T = 20
    tokens = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(0))
    messages = []
    ctx = AnatomyContext(model=model, tokenizer=_StubTokenizer(), model_name="tiny", text="x",
                         tokens=tokens, labels=[f"t{i}" for i in range(T)],
                         progress=messages.append)
    section = norms_section(ctx)
    assert section.name == "norms" and "RMSNorm" in section.title
    assert messages and section.look_for and len(section.headline) == 5
    assert len(section.figures) == 5 and all(isinstance(f, Figure) for f in section.figures)
    assert len({f.name for f in section.figures}) == 5
    data = section.data
    json.dumps(_jsonable(data), allow_nan=False)            # JSON-able, no NaN / inf
    assert len(data["residual_rms"]["mean"]) == args.n_layers + 1
    assert len(data["residual_rms"]["per_position"][0]) == T
    assert all(0.0 < c <= 1.0 + 1e-6 for c in data["rms_vs_layernorm"]["cosine_mean"])
    grads = data["pre_post_gradients"]["per_init"]
    assert set(grads) == {"train", "xavier"}
    assert all(len(g["w2"]) == 24 for per in grads.values() for g in per.values())
    assert set(data["speed_seconds"]) == {str(T), "4096"}
    assert section.tensors["residual_rms"].shape == (args.n_layers + 1, T)
    assert section.tables and len(section.tables[0].rows) == 5
    import matplotlib.pyplot as plt
    for f in section.figures:
        plt.close(f.figure)
