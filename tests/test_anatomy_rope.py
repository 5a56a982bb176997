"""The anatomy report's RoPE and extrapolation sections.

Oracles: the RoPE formulas of RoFormer (wavelengths 2π·θ^(2i/d), q·k depending on m − n only)
and a direct full-logits cross-entropy for the per-position losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torchllama import anatomy
from torchllama.anatomy.rope import (extrapolation_section, invariance_error, position_losses,
                                     relative_decay, rope_section, rotate, wavelengths)
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
    w = wavelengths(128, 10000.0)
    assert w[0] == pytest.approx(2 * math.pi)
    assert w[-1] == pytest.approx(2 * math.pi * 10000 ** (126 / 128))       # ≈ 54,410
    assert 54_000 < w[-1] < 62_832


def test_qk_depends_only_on_relative_position_and_decays():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(64, generator=g), torch.randn(64, generator=g)
    assert invariance_error(q, k, 10000.0, 4096) <= 1e-4
    # rotating by the same positions is a rotation: norms kept
    x = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(rotate(x, torch.arange(5) * 100, 10000.0).norm(dim=-1),
                               x.norm(dim=-1))
    decay = relative_decay(64, 10000.0, 2048)
    assert decay[0] == pytest.approx(1.0) and decay[1:].max() < 1.0
    assert decay[1000:].abs().mean() < decay[1:10].mean()


def test_rope_section_on_a_tiny_model():
    section = rope_section(tiny_ctx())
    assert [f.name for f in section.figures] == ["angles", "path-decay"]
    assert max(section.data["invariance_max_abs_error"].values()) <= 1e-4
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
