"""The optimizer-step loop shared by `torchllama train` (torchllama.train.loop) and
`torchllama finetune` (torchllama.train.finetune).

    Trainer.fit():
        while step < max_steps:
            entry = train_step()        lr = schedule.at(step); grad_accum micro-steps of
                                        forward + backward (forward_backward); clip ‖g‖₂ to
                                        grad_clip; stop on a NaN/inf loss or norm; AdamW step
            every eval_every steps and at the end:  entry |= evaluate()
            append entry to log.jsonl (rank 0); progress bar; report lines
            every save_every steps and at the end:  save_checkpoint()

A subclass builds the run (model, optimizer, data; a resumed run restores its checkpoint before
the loop starts) and says what differs: what the micro-steps compute (`forward_backward`), what an
evaluation adds to the log (`evaluate`), how a checkpoint is written (`save_checkpoint`), the log
entry of a step (`log_entry`) and the lines printed after an evaluation (`report`).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from torchllama.checkpoint import atomic_output
from torchllama.errors import TrainingError
from torchllama.nn.moe import update_biases
from torchllama.train.optim import LRSchedule

LOG_FILE = "log.jsonl"


def write_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (temporary file, then rename)."""
    with atomic_output(path, folder=False, force=True) as tmp:
        tmp.write_text(text)


class Trainer:
    """One run's training loop (see the module docstring).

    Args:
        model: the module whose parameters `params` are trained (its `train()`/`eval()` mode is
            the subclass's business).
        optimizer: the optimizer over `params`; its learning rate is set before every step.
        params: the trained parameters, in the order their gradient norm is summed.
        schedule: learning rate per step; its max_steps is the number of steps to train for.
        run_dir: the run folder (log.jsonl, loss.png, checkpoints).
        step: optimizer steps already done (a resumed run's checkpoint step, else 0).
        grad_accum: micro-steps per optimizer step.
        grad_clip: maximum global gradient L2 norm (0: no clipping, the norm is still logged).
        eval_every, save_every: evaluate / checkpoint every N steps (and after the last step).
        progress: show a progress bar (rank 0 only).
        is_main: this process writes the log and prints (rank 0).
        device: where the model runs (CUDA steps are synchronised for the step times).
    """

    desc = "training"                                      # the progress bar's label

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 params: list[torch.nn.Parameter], schedule: LRSchedule, *, run_dir: Path,
                 step: int, grad_accum: int, grad_clip: float, eval_every: int,
                 save_every: int, progress: bool, is_main: bool = True,
                 device: torch.device = torch.device("cpu")):
        self.model, self.optimizer, self.params, self.schedule = model, optimizer, params, schedule
        self.run_dir, self.log_path = run_dir, run_dir / LOG_FILE
        self.step, self.max_steps = step, schedule.max_steps
        self.grad_accum, self.grad_clip = grad_accum, grad_clip
        self.eval_every, self.save_every = eval_every, save_every
        self.progress, self.is_main, self.device = progress, is_main, device
        self.bar = None
        self.last: dict[str, Any] = {"step": step, "loss": None, "val_loss": None,
                                     "checkpoint": None}

    # ---- what a subclass supplies ----------------------------------------------------------

    def forward_backward(self) -> float:
        """Run the `grad_accum` micro-steps of optimizer step `self.step`: forward, loss,
        backward of loss / grad_accum (gradients accumulate). Returns the mean loss."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, Any]:
        """Fields an evaluation adds to the step's log entry (val_loss, val_ppl, sample)."""
        return {}

    def save_checkpoint(self) -> Path:
        """Write the checkpoint of `self.step`; returns its folder."""
        raise NotImplementedError

    def log_entry(self, loss: float, lr: float, grad_norm: float, seconds: float) -> dict:
        """The log.jsonl entry of the step just done (`self.step` counts it)."""
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm}

    def report(self, entry: dict) -> list[str]:
        """Lines printed after a step (e.g. its validation loss)."""
        return []

    def non_finite_error(self, loss: float, grad_norm: float) -> TrainingError:
        """The error that stops a run whose loss or gradient norm is NaN/inf."""
        return TrainingError(f"the loss became {loss} (gradient norm {grad_norm}) at step "
                             f"{self.step + 1}; stopping")

    # ---- the loop --------------------------------------------------------------------------

    def open_log(self, keep_old: bool) -> None:
        """Create the run folder, remove temporary folders of a killed save and rewrite
        log.jsonl: a resumed run (`keep_old`) keeps the entries up to its step, a fresh one
        starts empty. Rank 0 only."""
        from torchllama.train.plot import read_log

        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.run_dir.glob(".tmp-step-*"):                # from a killed save
            shutil.rmtree(stale, ignore_errors=True)
        kept = [e for e in read_log(self.run_dir) if e.get("step", 0) <= self.step] \
            if keep_old else []
        write_text(self.log_path, "".join(json.dumps(e) + "\n" for e in kept))

    # --8<-- [start:train-step]
    def train_step(self) -> dict:
        """One optimizer step at the schedule's learning rate; returns its log entry.

        Raises:
            TrainingError: the loss or the gradient norm is NaN/inf (before the update).
        """
        lr = self.schedule.at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._synchronize()
        t0 = time.perf_counter()
        loss = self.forward_backward()
        grad_norm = self.clip_gradients()
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise self.non_finite_error(loss, grad_norm)
        self.optimizer.step()
        update_biases(self.model)            # DeepSeek-V3's expert biases, where asked
        self.optimizer.zero_grad(set_to_none=True)
        self._synchronize()
        seconds = time.perf_counter() - t0
        self.step += 1
        return self.log_entry(loss, lr, grad_norm, seconds)
    # --8<-- [end:train-step]

    def clip_gradients(self) -> float:
        """Clip the global gradient L2 norm to grad_clip (0: no clipping); returns the norm
        before clipping."""
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm(
                [p.grad for p in self.params if p.grad is not None])
        if hasattr(norm, "full_tensor"):                          # FSDP2: a DTensor
            norm = norm.full_tensor()
        return float(norm)

    def record(self, entry: dict) -> None:
        """Remember the step's losses; on rank 0 append its entry to log.jsonl, advance the
        progress bar and print its report lines."""
        self.last.update(step=self.step, loss=entry["loss"])
        if "val_loss" in entry:
            self.last["val_loss"] = entry["val_loss"]
        if not self.is_main:
            return
        with open(self.log_path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        postfix = {"loss": f"{entry['loss']:.3f}", "lr": f"{entry['lr']:.2e}"}
        if "tokens_per_s" in entry:
            postfix["tok_s"] = f"{entry['tokens_per_s']:,.0f}"
        self.bar.set_postfix(**postfix, refresh=False)
        self.bar.update(1)
        for line in self.report(entry):
            self.bar.write(line)

    def fit(self) -> dict[str, Any]:
        """Train until max_steps (see the module docstring), then plot log.jsonl to loss.png.
        Returns {"step", "loss", "val_loss", "checkpoint"}: the last step's values (val_loss
        None and checkpoint the resumed one until the run makes new ones)."""
        from tqdm import tqdm

        from torchllama.train.plot import plot_log

        self.bar = tqdm(total=self.max_steps, initial=self.step, desc=self.desc, unit="step",
                        disable=not (self.progress and self.is_main), dynamic_ncols=True)
        try:
            while self.step < self.max_steps:
                entry = self.train_step()
                if self._due(self.eval_every):
                    entry.update(self.evaluate())
                self.record(entry)
                if self._due(self.save_every):
                    self.last["checkpoint"] = str(self.save_checkpoint())
        finally:
            self.bar.close()
        if self.is_main:
            plot_log(self.run_dir)
        return self.last

    def _due(self, every: int) -> bool:
        return self.step % every == 0 or self.step == self.max_steps

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def perplexity(loss: float) -> float:
    """exp(loss), capped to stay finite: the perplexity logged next to a validation loss."""
    return math.exp(min(loss, 700))


__all__ = ["LOG_FILE", "Trainer", "perplexity", "write_text"]
