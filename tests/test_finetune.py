"""`torchllama finetune` (torchllama.train.finetune): the loss goes down, resume is exact, chat
data scores the assistant's tokens only, bad chat lines are named, --merge equals the adapter
applied unmerged, and the CLI's errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import torchllama
from torchllama import cli
from torchllama.errors import ArgumentError
from torchllama.nn.loss import IGNORE_INDEX
from torchllama.train.finetune import FinetuneConfig, finetune
from torchllama.train.finetune_data import ChatData, chat_example

transformers = pytest.importorskip("transformers")

from test_hf_checkpoint import save_tiny, tiny_tokenizer  # noqa: E402,F401  (fixture)

TEXT = ("Hello world! The quick brown fox jumps over the lazy dog. def f(x): return x + 1\n"
        * 40)
CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"},
     {"role": "assistant", "content": "The quick brown fox"},
     {"role": "user", "content": "def f(x)"}, {"role": "assistant", "content": "return x + 1"}],
    [{"role": "user", "content": "The lazy dog"}, {"role": "assistant", "content": "jumps over"}],
] * 6


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_tokenizer):
    """A tiny random Llama checkpoint folder (HF files, with a chat template)."""
    folder = tmp_path_factory.mktemp("base")
    save_tiny(folder, tiny_tokenizer)
    return folder


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "doc.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return path


def _config(base, data, out, **kw):
    settings = dict(data=[str(data)], out=str(out), model=str(base), max_steps=6, batch_size=2,
                    seq_len=32, lr=1e-2, eval_every=3, eval_batches=2, progress=False,
                    lora_dropout=0.1, lora_targets="all")
    return FinetuneConfig(**{**settings, **kw})


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "log.jsonl").read_text().splitlines()]


def test_finetune_lowers_the_loss_and_resume_after_kill_9_is_exact(base, text_file, tmp_path):
    config = _config(base, text_file, tmp_path / "whole", max_steps=12, save_every=2)
    result = finetune(config)
    assert result["val_loss"] < result["val_loss_before"]
    straight = _losses(tmp_path / "whole")
    assert len(straight) == 12 and straight[-1] < straight[0]

    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "torchllama", "finetune", "--data", str(text_file), "--out",
           str(cut), "--model", str(base), "--max-steps", "12", "--batch-size", "2",
           "--seq-len", "32", "--lr", "1e-2", "--eval-every", "3", "--eval-batches", "2",
           "--save-every", "2", "--lora-dropout", "0.1", "--lora-targets", "all",
           "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        log = cut / "log.jsonl"
        if log.exists() and len(log.read_text().splitlines()) >= 5:
            break
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = len((cut / "log.jsonl").read_text().splitlines())
    assert 5 <= killed_at < 12, "the run should have been killed mid-way"
    done = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "resuming at step" in done.stdout
    assert _losses(cut) == straight                                        # bit for bit
    assert not list(cut.glob(".tmp-*")) and (cut / "loss.png").stat().st_size > 0
    with pytest.raises(ArgumentError, match="--lora-r 8 in the run, 4 now"):
        finetune(_config(base, text_file, cut, resume=True, lora_r=4))
    with pytest.raises(ArgumentError, match="already holds a finetuning run"):
        finetune(_config(base, text_file, cut))


def test_chat_examples_score_only_the_assistant(base):
    _, tokenizer = torchllama.load(base, progress=False)
    ids, scored = chat_example(tokenizer, CONVERSATIONS[0])
    full = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=False)
    assert tokenizer.decode(ids) == tokenizer.decode(tokenizer.encode(full, special=True))
    spans, current = [], []
    for i, s in zip(ids, scored):
        if s:
            current.append(i)
        elif current:
            spans.append(current)
            current = []
    spans += [current] if current else []
    # the template: "<s>{role}: {content}</s>\n" — each answer with its end-of-turn marker
    assert spans == [tokenizer.encode(" The quick brown fox</s>\n", special=True),
                     tokenizer.encode(" return x + 1</s>\n", special=True)]
    assert sum(scored) == sum(map(len, spans)) and not scored[0]


def test_chat_finetune_lowers_the_assistant_loss(base, chat_file, tmp_path):
    result = finetune(_config(base, chat_file, tmp_path / "run", val_fraction=0.2))
    assert result["val_loss"] < result["val_loss_before"]
    _, tokenizer = torchllama.load(base, progress=False)
    data = ChatData(tokenizer, [chat_file], 32, 2, 0, 0.0)
    inputs, targets = data.batch(0)
    assert inputs.shape == targets.shape and (targets == IGNORE_INDEX).any()


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2: not valid JSON"),
    ('{"messages": "hi"}', 'line 2: expected an object with a non-empty "messages" list'),
    ('{"messages": [{"role": "user"}]}', 'line 2: messages\\[0\\] must be an object'),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: no assistant message"),
])
def test_malformed_chat_line_names_file_and_line(base, tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n" + line + "\n")
    with pytest.raises(ArgumentError, match=f"{path}, {message}"):
        finetune(_config(base, path, tmp_path / "run"))


def test_cli_merge_equals_unmerged_adapter(base, text_file, tmp_path, capsys):
    run, merged = tmp_path / "run", tmp_path / "merged"
    assert cli.main(["finetune", "--data", str(text_file), "--out", str(run), "--model",
                     str(base), "--max-steps", "3", "--seq-len", "32", "--batch-size", "2",
                     "--lr", "1e-2", "--lora-targets", "wq,wk,wv,wo,w2", "--no-progress",
                     "--merge", str(merged), "--merge-format", "hf"]) == 0
    assert "merged:" in capsys.readouterr().out
    tokens = torch.tensor([[1, 17, 45, 200, 9, 33, 120, 7]])
    adapted, _ = torchllama.load(base, progress=False, adapter=run)
    plain, _ = torchllama.load(merged, progress=False)
    with torch.no_grad():
        a, m = adapted(tokens), plain(tokens)
    assert (a - torchllama.load(base, progress=False)[0](tokens).detach()).abs().max() > 1e-4
    torch.testing.assert_close(m, a, rtol=1e-5, atol=1e-5)


def test_cli_adapter_for_another_model_fails_cleanly(base, text_file, tmp_path, tiny_tokenizer,
                                                    capsys):
    run = tmp_path / "run"
    finetune(_config(base, text_file, run, max_steps=1))
    other = tmp_path / "other"
    save_tiny(other, tiny_tokenizer, n_heads=4, n_kv_heads=1)
    code = cli.main(["perplexity", "--text-file", str(text_file), "--model", str(other),
                     "--ctx", "16", "--adapter", str(run), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "k_proj.lora_B.weight has shape (32, 8) but this model needs (16, 8)" \
        in err and "Traceback" not in err
