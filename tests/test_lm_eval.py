"""EleutherAI's lm-evaluation-harness against `torchllama serve --dtype float32`
(`--model local-completions`, loglikelihood and generate_until requests through /v1/completions),
with its HF tokenizer and with its `remote` tokenizer (/tokenize, /detokenize, /tokenizer_info),
compared document by document with lm-eval's own `hf` backend on transformers' load of the
same GGUF: every loglikelihood within 1e-3, the same accuracy, the same continuations.

The tasks are local (no dataset hub), built from Shakespeare's plays (the Makefile's corpus): a
multiple-choice "which line comes next" task, a greedy "continue the line" task and a
perplexity task (loglikelihood_rolling over whole passages; both backends start a window with
the same prefix token).
Slow (lm-eval and its `datasets` import, transformers' load, three evaluations): `make
test-slow`.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / ".cache" / "shakespeare"
KEY = "lm-eval-key"
MODEL = "SmolLM2-135M-Instruct"
N_CHOICE_DOCS, N_GENERATE_DOCS, N_PASSAGES = 32, 12, 6
METRICS = {"shakespeare_next_line": "acc,none", "shakespeare_continue_line": "exact_match,none",
           "shakespeare_perplexity": "word_perplexity,none"}


def verse_runs(path: Path) -> list[list[str]]:
    """Runs of consecutive verse lines of one speech (no stage directions, no speaker lines)."""
    runs, run = [], []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if 24 <= len(line) <= 70 and not line.startswith("[") and not line.isupper() and \
                re.match(r"[A-Z]", line):
            run.append(line)
            continue
        if len(run) >= 3:
            runs.append(run)
        run = []
    return runs


def build_tasks(folder: Path) -> list[str]:
    """Write both tasks (data and YAML) under `folder`; returns their names."""
    rng = random.Random(0)
    plays = sorted(CORPUS.glob("*_gut.txt"))
    runs = [r for p in plays for r in verse_runs(p)]
    rng.shuffle(runs)
    lines = [line for r in runs for line in r]
    docs = []
    for run in runs[:N_CHOICE_DOCS]:
        context, answer = "\n".join(run[:2]), run[2]
        choices = [answer] + rng.sample([x for x in lines if x != answer], 3)
        rng.shuffle(choices)
        docs.append({"context": context, "choices": choices, "label": choices.index(answer)})
    (folder / "next_line.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    gen = [{"context": "\n".join(r[:2]), "target": r[2]}
           for r in runs[N_CHOICE_DOCS:N_CHOICE_DOCS + N_GENERATE_DOCS]]
    (folder / "continue_line.jsonl").write_text("\n".join(json.dumps(d) for d in gen) + "\n")
    start = N_CHOICE_DOCS + N_GENERATE_DOCS
    passages = [{"text": "\n".join(r)} for r in runs[start:start + N_PASSAGES]]
    (folder / "perplexity.jsonl").write_text("\n".join(json.dumps(d) for d in passages) + "\n")
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {file}\n" \
             "test_split: test\n"
    (folder / "next_line.yaml").write_text(
        "task: shakespeare_next_line\n" + common.format(file=folder / "next_line.jsonl") +
        "output_type: multiple_choice\ndoc_to_text: \"{{context}}\\n\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n")
    (folder / "continue_line.yaml").write_text(
        "task: shakespeare_continue_line\n" +
        common.format(file=folder / "continue_line.jsonl") +
        "output_type: generate_until\ndoc_to_text: \"{{context}}\\n\"\ndoc_to_target: target\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 16\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    (folder / "perplexity.yaml").write_text(
        "task: shakespeare_perplexity\n" + common.format(file=folder / "perplexity.jsonl") +
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n")
    return list(METRICS)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    pytest.importorskip("lm_eval")
    if not CORPUS.is_dir():
        pytest.skip(f"{CORPUS} is missing (make test-slow fetches it)")
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ["HF_DATASETS_CACHE"] = str(folder / "datasets")
    return folder, build_tasks(folder)


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    """`torchllama serve --dtype float32 --api-key KEY` on a free port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchllama", "serve", "--dtype", "float32", "--port",
             str(port), "--api-key", KEY], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        import urllib.request

        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def evaluate(tasks, model: str, model_args: dict) -> dict:
    """lm-eval's simple_evaluate on the local tasks: {task: (metric value, {doc_id: resps})}."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folder, names = tasks
    out = simple_evaluate(model=model, model_args=model_args, tasks=names,
                          task_manager=TaskManager(include_path=str(folder)), log_samples=True,
                          batch_size=8, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    results = {}
    for name in names:
        results[name] = (out["results"][name][METRICS[name]],
                         {s["doc_id"]: s["resps"] for s in out["samples"][name]})
    return results


@pytest.fixture(scope="module")
def hf_results(tasks, smollm2_gguf, hf_smollm2_tokenizer):
    # (a rolling window starts with a prefix token: both backends are given the same one)
    return evaluate(tasks, "hf", {"pretrained": str(smollm2_gguf.parent),
                                  "gguf_file": smollm2_gguf.name, "dtype": "float32",
                                  "device": "cpu",
                                  "prefix_token_id": hf_smollm2_tokenizer.eos_token_id})


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_lm_eval_through_the_server_equals_its_hf_backend(tasks, server, hf_results,
                                                          hf_smollm2_tokenizer, backend,
                                                          tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)               # what local-completions sends
    args = {"model": MODEL, "base_url": f"{server}/v1/completions", "max_retries": 1,
            "tokenizer_backend": backend, "auth_token": KEY, "max_length": 2048,
            "custom_prefix_token_id": hf_smollm2_tokenizer.eos_token_id}
    if backend == "huggingface":                            # the GGUF's tokenizer, saved
        hf_smollm2_tokenizer.save_pretrained(tmp_path / "tokenizer")
        args["tokenizer"] = str(tmp_path / "tokenizer")
    ours = evaluate(tasks, "local-completions", args)
    for name, (metric, docs) in hf_results.items():
        got_metric, got_docs = ours[name]
        assert got_metric == pytest.approx(metric, rel=1e-4), (name, got_metric, metric)
        assert set(got_docs) == set(docs)
        for doc_id, resps in docs.items():
            got = got_docs[doc_id]
            if name.endswith("next_line"):                 # [[(loglikelihood, is_greedy)]]
                for (g, _), (r, _) in zip((x[0] for x in got), (x[0] for x in resps)):
                    assert abs(float(g) - float(r)) <= 1e-3, (doc_id, g, r)
                assert [x[0][1] for x in got] == [x[0][1] for x in resps]
            elif name.endswith("perplexity"):              # [[loglikelihood of the passage]]
                assert abs(float(got[0][0]) - float(resps[0][0])) <= 1e-3, (doc_id, got, resps)
            else:                                           # [[continuation]]
                assert got == resps, doc_id
