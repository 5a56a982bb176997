"""ModelArgs and presets: known parameter counts (counted on the meta device), Meta's hidden-size
rule, validation."""

import pytest
import torch

from torchllama.config import PRESETS, ModelArgs, get_preset
from torchllama.errors import ArgumentError
from torchllama.model import Transformer


def count_params(args: ModelArgs) -> int:
    with torch.device("meta"):
        model = Transformer(args)
    return sum(p.numel() for p in model.parameters())   # shared (tied) weights counted once


@pytest.mark.parametrize("name, expected", [
    ("llama2-7b", 6_738_415_616),        # Meta's Llama 2 paper / model card
    ("llama2-13b", 13_015_864_320),
    ("llama2-70b", 68_976_648_192),
    ("smollm2-135m", 134_515_008),       # HF SmolLM2-135M (tied embeddings)
    ("tinyllama-1.1b", 1_100_048_384),   # TinyLlama-1.1B (HF model.num_parameters())
    ("smollm2-360m", 361_821_120),       # HF SmolLM2-360M (tied embeddings)
])
def test_preset_parameter_counts(name, expected):
    assert count_params(get_preset(name)) == expected


@pytest.mark.parametrize("name, hidden", [
    ("llama2-7b", 11008), ("llama2-13b", 13824), ("llama2-70b", 28672),
    ("tinyllama-1.1b", 5632), ("smollm2-135m", 1536), ("smollm2-360m", 2560),
])
def test_meta_hidden_size_rule(name, hidden):
    # The FFN sizes of the released checkpoints, produced by Meta's rule from dim/multiple_of.
    assert get_preset(name).ffn_hidden_dim == hidden


def test_explicit_hidden_dim_overrides_rule():
    assert ModelArgs(dim=64, n_heads=4, hidden_dim=100).ffn_hidden_dim == 100


def test_debug_preset_is_tiny_and_gqa():
    args = get_preset("debug")
    assert count_params(args) < 200_000 and args.n_kv_heads < args.n_heads


def test_unknown_preset_lists_known_names():
    with pytest.raises(ArgumentError) as e:
        get_preset("llama2-7B")           # exact names only
    assert "llama2-7b" in str(e.value) and "debug" in str(e.value)


def test_get_preset_returns_a_copy():
    get_preset("debug").dim = 1
    assert PRESETS["debug"].dim == 64


@pytest.mark.parametrize("kwargs, words", [
    (dict(dim=100, n_heads=3), "n_heads (3) must divide dim (100)"),
    (dict(dim=64, n_heads=4, n_kv_heads=3), "n_kv_heads (3) must divide n_heads (4)"),
    (dict(dim=12, n_heads=4), "must be even"),
    (dict(n_layers=0), "n_layers"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(rope_scaling={"type": "linear"}), "rope_scaling"),
])
def test_invalid_args_are_rejected(kwargs, words):
    with pytest.raises(ArgumentError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ModelArgs(**kwargs)
