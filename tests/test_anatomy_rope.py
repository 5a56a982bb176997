"""The anatomy report's RoPE and extrapolation sections.

Oracles: the RoPE formulas of RoFormer (wavelengths 2π·θ^(2i/d), q·k depending on m − n only)
and a direct full-logits cross-entropy for the per-position losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torchllama import anatomy
from torchllama.anatomy.rope import (decay_curves, extrapolation_section, position_losses,
                                     rope_section, rope_table, rope_wavelengths,
                                     translation_invariance)
from torchllama.nn.position import apply_rotary_emb
from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError
from torchllama.model import Transformer


class CharTokenizer:
    """Bytes as tokens (ids 0–255), no BOS: enough for sections that only need ids."""

    bos_id = eos_id = pad_id = None
    add_bos = False
    special_tokens: dict = {}
    vocab_size = 256

    def encode(self, text, bos=False):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def tiny_ctx(**options) -> anatomy.AnatomyContext:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                                  max_seq_len=64, rope_theta=10000.0)).eval()
    tok = CharTokenizer()
    ids = tok.encode("It was the best of times, it was the worst of times.")
    return anatomy.AnatomyContext(model=model, tokenizer=tok, model_name="tiny", text="",
                                  tokens=torch.tensor([ids]), labels=[chr(i) for i in ids],
                                  options=options)


def test_wavelengths_are_roformers():
    w = rope_wavelengths(128, 10000.0)
    assert w[0] == pytest.approx(2 * math.pi)
    assert w[-1] == pytest.approx(2 * math.pi * 10000 ** (126 / 128))       # ≈ 54,410
    assert 54_000 < w[-1] < 62_832


def test_qk_depends_only_on_relative_position_and_decays():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(64, generator=g), torch.randn(64, generator=g)
    assert translation_invariance(q[None], k[None], rope_table(64, 4096, 10000.0)) <= 1e-4
    # rotating by the same positions is a rotation: norms kept
    x = torch.randn(5, 64, generator=g)
    table = rope_table(64, 401, 10000.0)[torch.arange(5) * 100]            # (5, 32)
    rotated = apply_rotary_emb(x[:, None, None], table[:, None])[:, 0, 0]  # (5, 64)
    torch.testing.assert_close(rotated.norm(dim=-1),
                               x.norm(dim=-1))
    decay = decay_curves(64, 10000.0, 2048)["ones"]
    assert decay[0] == pytest.approx(1.0) and decay[1:].max() < 1.0
    assert decay[1000:].abs().mean() < decay[1:10].mean()


def test_rope_section_on_a_tiny_model():
    section = rope_section(tiny_ctx())
    assert [f.name for f in section.figures] == ["angles", "path", "decay", "unseen"]
    assert max(section.data["invariance_max_abs_error"].values()) <= 1e-4
    L = section.data["context"]                  # at L every slow pair's angle is new
    assert section.data["unseen_pairs_at"][str(L)] == sum(
        w > L for w in section.data["wavelengths"][section.data["bases"][0]])
    assert [e.kind for e in section.explorers] == ["rope"]
    import json
    json.dumps(section.data)


def test_position_losses_equal_full_logits_cross_entropy():
    ctx = tiny_ctx()
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = F.cross_entropy(ctx.model(tokens)[0, :-1], tokens[0, 1:], reduction="none")
    torch.testing.assert_close(position_losses(ctx.model, tokens, chunk=7), expected,
                               atol=1e-5, rtol=0)


def test_extrapolation_section_compares_every_scaling(tmp_path):
    text = tmp_path / "long.txt"
    text.write_text("To be, or not to be, that is the question. " * 10)
    section = extrapolation_section(tiny_ctx(long_text_file=str(text),
                                             extrapolation_dtype="float32"))
    assert set(section.data["perplexity"]) == {"none", "linear", "ntk", "yarn"}
    losses = section.tensors["losses"]
    assert all(l.shape == (127,) for l in losses.values())
    # unscaled: positions inside the trained 64 equal the model's own losses
    ctx = tiny_ctx()
    tokens = torch.tensor([CharTokenizer().encode(text.read_text())[:64]])
    with torch.no_grad():
        inside = F.cross_entropy(ctx.model(tokens)[0, :-1], tokens[0, 1:], reduction="none")
    torch.testing.assert_close(losses["none"][:63], inside, atol=1e-5, rtol=0)
    assert not torch.allclose(losses["linear"][:63], inside, atol=1e-3)   # scaling changes it
    with pytest.raises(ArgumentError, match="tokens"):
        extrapolation_section(tiny_ctx(long_text_file=str(text), extrapolation_factor=20))
    with pytest.raises(ArgumentError, match="long-text-file"):
        extrapolation_section(tiny_ctx(long_text_file=str(tmp_path / "missing")))


# ---- more oracles -----------------------------------------------------------------------------

def test_wavelengths_hand_computed_for_smollm2s_base():
    w = rope_wavelengths(64, 100000.0)                          # SmolLM2: θ = 100,000, head dim 64
    assert w.shape == (32,)
    assert w[0].item() == pytest.approx(2 * math.pi, rel=1e-6)
    assert w[-1].item() == pytest.approx(2 * math.pi * 100000 ** (62 / 64), rel=1e-5)  # ≈ 438,460
    assert torch.all(w[1:] > w[:-1])


def test_real_layer0_queries_and_keys_are_translation_invariant_in_float32():
    from torchllama.anatomy.rope import layer0_query_key, rope_table, translation_invariance

    ctx = tiny_ctx()
    q, k = layer0_query_key(ctx.model, ctx.tokens)
    T = ctx.tokens.shape[1]
    assert q.shape == (T * 4, 16) and k.shape == (T * 2, 16)
    # layer 0's real wq applied to the normed embeddings
    x = ctx.model.layers[0].attention_norm(ctx.model.tok_embeddings(ctx.tokens))
    torch.testing.assert_close(q[:4], ctx.model.layers[0].attention.wq(x)[0, 0].view(4, 16))
    error = translation_invariance(q, k, rope_table(16, 4096, 10000.0))
    assert error <= 1e-4


def test_decay_curves_are_highest_at_distance_zero():
    from torchllama.anatomy.rope import decay_curves

    for theta in (10000.0, 100000.0):
        curves = decay_curves(64, theta, 8192)
        for name in ("ones", "bound"):
            assert curves[name].argmax().item() == 0 and curves[name][0] == pytest.approx(1.0)
        # q = k = 1: Σ_i 2·cos(d·θ_i) / dim, by hand
        d = 777
        inv = theta ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
        assert curves["ones"][d].item() == pytest.approx(torch.cos(d * inv).mean().item(),
                                                         abs=1e-4)


def test_rope_section_data_is_json_and_a_model_without_rope_gets_base_10000():
    import json

    from torchllama.anatomy.report import _jsonable

    section = rope_section(tiny_ctx())
    assert section.name == "rope" and section.look_for and section.headline
    assert section.data["bases"] == ["model: θ = 10,000"]        # no second base: θ = 10,000
    json.dumps(_jsonable(section.data), allow_nan=False)
    torch.manual_seed(0)
    nope = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=64,
                                 position="none")).eval()
    ctx = tiny_ctx()
    ctx.model = nope
    section = rope_section(ctx)
    assert "no RoPE" in section.look_for and section.data["bases"] == ["θ = 10,000"]
    assert section.data["rope_dim"] == 16 and len(section.figures) == 3
    json.dumps(_jsonable(section.data), allow_nan=False)
    assert extrapolation_section(ctx).data == {"has_rope": False}


def test_scaled_losses_equal_full_logits_of_a_scaled_model(tmp_path):
    text = tmp_path / "long.txt"
    text.write_text("Now is the winter of our discontent made glorious summer. " * 4)
    section = extrapolation_section(tiny_ctx(long_text_file=str(tmp_path)))   # a folder
    tokens = section.tensors["tokens"]
    assert tokens.shape == (1, 128)
    base = tiny_ctx().model
    for method, scaling in [("none", None), *section.data["scalings"].items()]:
        model = Transformer(base.args.replace(max_seq_len=128, rope_scaling=scaling)).eval()
        model.load_state_dict(base.state_dict())
        with torch.no_grad():
            expected = F.cross_entropy(model(tokens)[0, :-1], tokens[0, 1:], reduction="none")
        torch.testing.assert_close(section.tensors["losses"][method], expected, atol=1e-5,
                                   rtol=0)
        ppl = section.data["perplexity"][method]
        assert ppl["within"] == pytest.approx(math.exp(expected[:64].mean().item()), rel=1e-5)
        assert ppl["beyond"] == pytest.approx(math.exp(expected[64:].mean().item()), rel=1e-5)
    assert len(section.data["bucket_loss"]["yarn"]) == 16                   # buckets of 64 / 8
    assert len(section.figures) == 1


def test_no_long_text_anywhere_names_the_option_and_make_test(monkeypatch):
    from torchllama.anatomy import rope

    monkeypatch.setattr(rope, "_repo_shakespeare", lambda: None)
    with pytest.raises(ArgumentError, match="--long-text-file.*make test"):
        extrapolation_section(tiny_ctx())
    with pytest.raises(ArgumentError, match="extrapolation_factor"):
        extrapolation_section(tiny_ctx(extrapolation_factor=1))


def test_unseen_pairs_counts_the_angles_training_never_produced():
    from torchllama.anatomy.rope import rope_wavelengths, unseen_pairs

    w = rope_wavelengths(16, 100.0)                                   # (8,) wavelengths
    L = 40
    slow = int((w > L).sum())
    assert 0 < slow < 8
    m = torch.arange(0, 6 * L)
    got = unseen_pairs(w, L, m)
    # each position's angles, against the arc [0, L·θ_i) training covered of each slow pair
    theta = 2 * math.pi / w.double()
    angle = torch.remainder(m.double()[:, None] * theta, 2 * math.pi)      # (N, 8)
    expected = ((w > L) & (angle >= L * theta - 1e-9)).sum(1)
    assert torch.equal(got, expected)
    assert got[:L].eq(0).all() and got[L] == slow                       # none before L
    assert got.max() == slow
