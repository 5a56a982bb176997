"""The training benchmark compares like with like: HF's LlamaForCausalLM built by `build_pair` is
the same model as ours (same loss on the same batch, before and after an AdamW step), and
`run_train_bench` returns positive figures for both."""

import pytest
import torch

from torchllama.config import get_preset
from torchllama.errors import ArgumentError
from torchllama.bench.train import _loss, _train_step, build_pair, run_train_bench
from torchllama.train.optim import make_optimizer

pytest.importorskip("transformers")


def test_run_train_bench_reports_both_with_equal_initial_loss():
    lines = []
    r = run_train_bench("debug", batch_size=2, seq_len=16, steps=1, repeats=1,
                        write=lines.append)
    assert r["torchllama_tok_s"] > 0 and r["transformers_tok_s"] > 0 and r["ratio"] > 0
    assert r["tokens_per_step"] == 32 and r["n_params"] > 0
    assert r["torchllama_initial_loss"] == pytest.approx(r["transformers_initial_loss"], abs=1e-5)
    assert any(line.startswith("ratio") for line in lines)


def test_pair_is_the_same_model_through_an_optimizer_step():
    # Same loss at the start, and still after one AdamW step each: the weights, the loss math
    # and the optimizer's decay grouping all agree (tied embeddings: one matrix, not decayed).
    args = get_preset("debug").replace(tie_embeddings=True)
    ours, hf = build_pair(args, seed=3)
    batch = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = batch[:, :-1], batch[:, 1:]
    # ours: the fused output + loss training path; HF: logits, then F.cross_entropy
    fns = {"ours": lambda t, y: ours(t, targets=y),
           "hf": lambda t, y: _loss(hf(input_ids=t, use_cache=False).logits, y)}
    opt = {"ours": make_optimizer(ours, lr=1e-2), "hf": make_optimizer(hf, lr=1e-2)}
    losses = {k: [_train_step(fns[k], opt[k], x, y, autocast=False).item() for _ in range(2)]
              for k in fns}
    assert losses["ours"][0] == pytest.approx(losses["hf"][0], abs=1e-5)
    assert losses["ours"][1] == pytest.approx(losses["hf"][1], abs=1e-5)  # wrong decay: 9e-4
    assert losses["ours"][1] < losses["ours"][0]


@pytest.mark.slow      # a second run of the bench (≈ 13 s); the first is the test above
def test_without_hf_and_bfloat16():
    r = run_train_bench("debug", batch_size=1, seq_len=8, dtype="bfloat16", steps=1, repeats=1,
                        with_hf=False, write=lambda s: None)
    assert r["torchllama_tok_s"] > 0 and "ratio" not in r


def test_rejects_bad_arguments():
    with pytest.raises(ArgumentError):
        run_train_bench("debug", dtype="float16", with_hf=False)
    with pytest.raises(ArgumentError):
        run_train_bench("debug", seq_len=10_000, with_hf=False)
