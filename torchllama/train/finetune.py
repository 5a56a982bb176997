"""`torchllama finetune`: LoRA / QLoRA / DoRA adapters trained on a real checkpoint.

The loop is `torchllama train`'s (`torchllama.train.trainer.Trainer`; `FinetuneTrainer` here
supplies the micro-steps, evaluation and checkpoints). One optimizer step: grad_accum
micro-steps of mean next-token cross-entropy (chat data: the assistant's tokens only), the
gradient clipped to grad_clip, AdamW at lr_at(step) (linear warmup, cosine decay) — over the
adapters' parameters only; the base stays frozen (QLoRA: in its quantized form,
`--dtype auto|int8|int4`).

A run folder:

    OUT/step-00000100/   adapter_config.json + adapter_model.safetensors (PEFT's format: the
                         folder is an adapter for `--adapter`, `peft` and `--merge`) and
                         train_state.pt (step, micro-step, optimizer moments, RNG states, config)
    OUT/latest -> step-00000100
    OUT/log.jsonl, OUT/loss.png, OUT/run.json

Checkpoints are written to a temporary folder and renamed (kill -9 leaves the previous one);
`--resume` restores adapters, optimizer, step and RNG states, and batches are a pure function of
(seed, micro-step): the resumed run's losses equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from torchllama.errors import ArgumentError, TrainingError
from torchllama.train import checkpointing as ckpt_io
from torchllama.train.optim import LRSchedule, count_params
from torchllama.train.trainer import Trainer, perplexity, write_text
from torchllama.transforms.lora import (LoRAConfig, apply_lora, copy_adapter_weights,
                                        lora_parameters, parse_targets, save_adapter)


@dataclass(kw_only=True)
class FinetuneConfig:
    """Settings of a finetuning run (the options of `torchllama finetune`).

    Attributes:
        data: text files/folders (causal LM) or .jsonl chat files (assistant-only loss).
        out: run folder.
        model: base checkpoint (None: the embedded SmolLM2-135M-Instruct).
        dtype: the frozen base's weights: float32 (LoRA), or auto/int8/int4 (QLoRA: a GGUF's
            blocks kept as they are with auto, or quantized at load).
        lora_r, lora_alpha, lora_dropout, lora_targets, dora: the adapters (`LoRAConfig`;
            targets "wq,wv" or "all").
        max_steps, batch_size, seq_len, grad_accum, lr, min_lr, warmup_steps, weight_decay,
        grad_clip: as `torchllama train`.
        val_fraction: share of the data held out for the validation loss.
        eval_every, eval_batches: validation every N steps, over this many batches.
        save_every: checkpoint every N steps (default eval_every) and at the end.
        keep: newest checkpoints kept.
        seed: adapter initialisation, batch order and dropout.
        resume: continue the run in `out` from its latest checkpoint.
        progress: progress bar.
    """

    data: list[str]
    out: str
    model: Optional[str] = None
    dtype: str = "float32"
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "wq,wv"
    dora: bool = False
    max_steps: int = 100
    batch_size: int = 4
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: Optional[float] = None
    warmup_steps: Optional[int] = None
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    val_fraction: float = 0.05
    eval_every: int = 25
    eval_batches: int = 4
    save_every: Optional[int] = None
    keep: int = 2
    seed: int = 0
    resume: bool = False
    progress: bool = True

    def lora(self) -> LoRAConfig:
        return LoRAConfig(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout,
                          targets=parse_targets(self.lora_targets), dora=self.dora)

    def check(self) -> None:
        """Raises ArgumentError naming the first bad option."""
        for name in ("max_steps", "batch_size", "seq_len", "grad_accum", "eval_every",
                     "eval_batches", "keep"):
            if getattr(self, name) < 1:
                raise ArgumentError(f"--{name.replace('_', '-')} must be ≥ 1, got "
                                    f"{getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ArgumentError(f"--lr must be > 0, got {self.lr}")
        self.lora()                                      # validates the adapter options


#: options a resumed run must keep (they change the model or the data order)
FIXED_ON_RESUME = ("model", "dtype", "lora_r", "lora_alpha", "lora_dropout", "lora_targets",
                   "dora", "seq_len", "batch_size", "seed", "data", "val_fraction")


def _resumed(config: FinetuneConfig, saved: dict) -> FinetuneConfig:
    diff = [f"--{k.replace('_', '-')} {saved[k]!r} in the run, {getattr(config, k)!r} now"
            for k in FIXED_ON_RESUME if saved.get(k) != getattr(config, k)]
    if diff:
        raise ArgumentError(f"--resume: {config.out} was started with other settings "
                            f"({'; '.join(diff)}); use the same ones or another --out")
    return config


def _save(run_dir: Path, step: int, model, config: FinetuneConfig, optimizer,
          state: dict[str, Any]) -> Path:
    """Checkpoint `step` (see the module docstring): temp folder, fsync, rename, `latest`."""
    final = ckpt_io.step_dir(run_dir, step)
    tmp = run_dir / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_adapter(model, config.lora(), tmp, base_model=str(config.model or "SmolLM2-135M-Instruct"))
    torch.save({**state, "optimizer": optimizer.state_dict(),
                "rng": ckpt_io.rng_state(torch.device("cpu"))}, tmp / ckpt_io.STATE_FILE)
    ckpt_io.publish_checkpoint(run_dir, tmp, final, config.keep)
    return final


@torch.no_grad()
def evaluate(model, batches: list) -> float:
    """Mean validation loss (nats per scored token) over (inputs, targets) batches."""
    from torchllama.nn.loss import IGNORE_INDEX

    total, count = 0.0, 0
    for inputs, targets in batches:
        n = int((targets != IGNORE_INDEX).sum())
        if n:
            total += float(model(inputs, targets=targets)) * n
            count += n
    return total / count if count else float("nan")


def _write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


def _setup(config: FinetuneConfig):
    """(model with adapters, tokenizer, data, optimizer, step, saved state or None)."""
    from torchllama.checkpoint import load
    from torchllama.transforms.layout import set_weight_layout
    from torchllama.train.finetune_data import finetune_data

    run_dir = Path(config.out)
    latest = ckpt_io.latest_checkpoint(run_dir) if config.resume else None
    if config.resume and latest is None:
        raise ArgumentError(f"--resume: {run_dir} has no checkpoint to resume from")
    if not config.resume and ckpt_io.list_checkpoints(run_dir):
        raise ArgumentError(f"{run_dir} already holds a finetuning run; pass --resume to "
                            "continue it, or choose another --out")
    saved = ckpt_io.read_train_state(latest) if latest is not None else None
    if saved is not None:
        _resumed(config, saved["config"])
    model, tokenizer = load(config.model, dtype=config.dtype, progress=config.progress)
    data = finetune_data(tokenizer, config.data, config.seq_len, config.batch_size, config.seed,
                         config.val_fraction)
    # Training runs the frozen float32 products through autograd (F.linear, MKL), which is
    # faster on column-major weights (torchllama.transforms.layout.set_weight_layout); same values.
    set_weight_layout(model, "column")
    torch.manual_seed(config.seed)                       # A's initialisation, dropout
    apply_lora(model, config.lora())
    params = lora_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=config.weight_decay)
    step = 0
    if saved is not None:
        copy_adapter_weights(model, latest)
        optimizer.load_state_dict(saved["optimizer"])
        ckpt_io.set_rng_state(saved["rng"], torch.device("cpu"))
        step = saved["step"]
    return model, tokenizer, data, optimizer, step, saved


def _announce(config: FinetuneConfig, data, trainable: int, total: int,
              resumed_at: Optional[int], before: Optional[float]) -> None:
    """Write OUT/run.json and print the run's one-line summary."""
    _write_json(Path(config.out) / "run.json", {
        "config": dataclasses.asdict(config), "trainable_parameters": trainable,
        "parameters": total, "train_tokens": data.n_train_tokens, "val_loss_before": before})
    print(f"finetuning {trainable:,} adapter parameters ({trainable / total:.2%} of {total:,} in "
          f"all; {config.lora_targets}, r={config.lora_r}, α={config.lora_alpha:g}"
          f"{', DoRA' if config.dora else ''}) on a {config.dtype} base; "
          f"{data.n_train_tokens:,} training tokens; {type(data).__name__}"
          + (f"; resuming at step {resumed_at}" if resumed_at is not None else "")
          + (f"; val_loss before {before:.4f}" if before is not None else ""), flush=True)


class FinetuneTrainer(Trainer):
    """`torchllama finetune`'s run: adapters trained on a frozen base through the shared
    `Trainer` loop. Beyond its state: the options, the tokenizer, the data (`TextData` or
    `ChatData`), the validation batches, the adapter and model sizes and the validation loss
    before training (`before`; a resumed run keeps its first one)."""

    desc = "finetuning"

    def __init__(self, config: FinetuneConfig):
        from torchllama.checkpoint.common import meta_model

        model, tokenizer, data, optimizer, step, saved = _setup(config)
        params = lora_parameters(model)
        schedule = LRSchedule.for_run(config.lr, config.min_lr, config.warmup_steps,
                                      config.max_steps, max_warmup=100)
        super().__init__(model, optimizer, params, schedule, run_dir=Path(config.out),
                         step=step, grad_accum=config.grad_accum, grad_clip=config.grad_clip,
                         eval_every=config.eval_every,
                         save_every=config.save_every or config.eval_every,
                         progress=config.progress)
        self.config, self.tokenizer, self.data = config, tokenizer, data
        self.trainable = sum(p.numel() for p in params)
        self.total = count_params(meta_model(model.args)) + self.trainable  # the base's, any form
        self.val = data.val_batches(config.eval_batches)
        self.open_log(keep_old=saved is not None)
        model.eval()
        self.before = saved["val_loss_before"] if saved else (
            evaluate(model, self.val) if self.val else None)
        _announce(config, data, self.trainable, self.total, step if saved else None,
                  self.before)
        model.train()

    def forward_backward(self) -> float:
        """grad_accum micro-steps of (B, T) batches (chat: targets of the assistant's tokens
        only); returns their mean loss."""
        loss_sum = 0.0
        for k in range(self.grad_accum):
            inputs, targets = self.data.batch(self.step * self.grad_accum + k)
            loss = self.model(inputs, targets=targets)
            (loss / self.grad_accum).backward()
            loss_sum += float(loss.detach())
        return loss_sum / self.grad_accum

    def log_entry(self, loss: float, lr: float, grad_norm: float, seconds: float) -> dict:
        """The step's entry with its time and the epochs done."""
        return {**super().log_entry(loss, lr, grad_norm, seconds), "seconds": seconds,
                "epoch": self.data.epoch_of(self.step * self.grad_accum)}

    def evaluate(self) -> dict[str, Any]:
        """Validation loss and perplexity (none without validation data), in eval mode."""
        if not self.val:
            return {}
        self.model.eval()
        val_loss = evaluate(self.model, self.val)                 # the module's evaluate()
        self.model.train()
        return {"val_loss": val_loss, "val_ppl": perplexity(val_loss)}

    def report(self, entry: dict) -> list[str]:
        if "val_loss" not in entry:
            return []
        return [f"step {entry['step']}: loss {entry['loss']:.4f}, val_loss "
                f"{entry['val_loss']:.4f} (ppl {entry['val_ppl']:.2f})"]

    def non_finite_error(self, loss: float, grad_norm: float) -> TrainingError:
        return TrainingError(f"the loss became {loss} (gradient norm {grad_norm}) at step "
                             f"{self.step + 1}; lower --lr and --resume from the last checkpoint")

    def save_checkpoint(self) -> Path:
        """The adapters, optimizer and RNG states of the current step (`_save`)."""
        state = {"step": self.step, "config": dataclasses.asdict(self.config),
                 "val_loss_before": self.before}
        return _save(self.run_dir, self.step, self.model, self.config, self.optimizer, state)

    def fit(self) -> dict[str, Any]:
        """Train to --max-steps; returns `finetune`'s result."""
        t_start = time.perf_counter()
        last = super().fit()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024    # KiB → MiB (Linux)
        return {"step": self.step, "loss": last["loss"], "val_loss": last["val_loss"],
                "val_loss_before": self.before, "checkpoint": last["checkpoint"],
                "seconds": time.perf_counter() - t_start, "peak_rss_mib": peak,
                "trainable": self.trainable, "total": self.total}


def finetune(config: FinetuneConfig) -> dict[str, Any]:
    """Train adapters as `config` says (see the module docstring).

    Returns:
        {"step", "loss", "val_loss", "val_loss_before", "checkpoint", "seconds",
        "peak_rss_mib", "trainable", "total"} of the finished run.

    Raises:
        ArgumentError: bad options, bad data (file and line), an existing run without --resume.
        ModelFileError: a missing or damaged base model or checkpoint.
        TrainingError: the loss or gradient became NaN/inf.
    """
    config.check()
    return FinetuneTrainer(config).fit()


def merge(base: Optional[str], adapter: str, dst: str, to: str, dtype: Optional[str] = None,
          *, force: bool = False, progress: bool = True) -> Path:
    """Load the base in float32, attach the adapter, merge it into the weights
    (W + (α/r)·B·A) and write a full checkpoint (`torchllama.checkpoint.save`: meta, hf or
    gguf; GGUF quantized with dtype q8_0/q4_0/q4_1)."""
    from torchllama.checkpoint import load, save
    from torchllama.transforms.lora import load_adapter, merge_lora, resolve_adapter

    if Path(dst).exists() and not force:
        raise ArgumentError(f"{dst}: already exists; pass --force to overwrite it")
    model, tokenizer = load(base, dtype="float32", progress=progress)
    load_adapter(model, resolve_adapter(adapter))
    merge_lora(model)
    return save(model, tokenizer, dst, to, dtype, force=force, progress=progress)


@dataclass(kw_only=True)
class FinetuneCommand(FinetuneConfig):
    """`torchllama finetune`'s options: FinetuneConfig's, and a merged checkpoint to write.

    Attributes:
        data: text files/folders (causal LM on documents) or .jsonl chat files, one
            {"messages": [...]} per line (loss on the assistant's tokens only).
        out: run folder (checkpoints are PEFT adapter folders; OUT/latest the newest).
        model: base checkpoint: a .gguf file, a Meta/HF folder or an installed packaged model
            (gemma3-270m); default: the embedded SmolLM2-135M-Instruct.
        dtype: the frozen base: float32 (LoRA), or auto/int8/int4 (QLoRA: a GGUF's blocks kept
            with auto, or quantized at load).
        lora_r: adapter rank r.
        lora_alpha: the update is scaled by alpha / r.
        lora_dropout: dropout on the adapters' input while training.
        lora_targets: linears to adapt in every layer: wq,wk,wv,wo,w1,w2,w3 (comma-separated)
            or all.
        dora: weight-decomposed LoRA (a trainable magnitude per output row).
        max_steps: optimizer steps.
        batch_size: sequences per micro-step.
        seq_len: tokens per sequence (chat: conversations are cut to this).
        grad_accum: micro-steps per optimizer step.
        lr: peak learning rate (AdamW on the adapters).
        min_lr: final learning rate of the cosine schedule (default lr / 10).
        warmup_steps: linear warmup steps (default: 10% of max_steps, at most 100).
        weight_decay: AdamW weight decay on the adapters.
        grad_clip: maximum gradient L2 norm (0 = no clipping).
        val_fraction: share of the data held out for the validation loss.
        eval_every: evaluate every N steps.
        eval_batches: validation batches per evaluation.
        save_every: checkpoint every N steps (default: eval_every), and at the end.
        keep: number of newest checkpoints kept.
        seed: seed of the adapters' initialisation, the batch order and dropout.
        resume: continue the run in --out from its latest checkpoint.
        progress: show a progress bar.
        merge: also write the base with the adapter merged into its weights to this path (a
            folder for hf/meta, a .gguf file).
        merge_format: hf, meta or gguf (default: gguf for a .gguf path, else hf).
        merge_dtype: the merged checkpoint's dtype: float32, bfloat16, float16; for GGUF also
            q8_0, q4_0, q4_1.
    """

    merge: Optional[str] = None
    merge_format: Optional[str] = None
    merge_dtype: Optional[str] = None
