"""`torchllama plot-log DIR`: the loss curve of a training run as a PNG (matplotlib)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from torchllama.checkpoint import atomic_output
from torchllama.errors import ArgumentError


def read_log(run_dir: str | os.PathLike) -> list[dict]:
    """The entries of RUN/log.jsonl (a last line cut short by a kill is ignored).

    Raises:
        ArgumentError: no log.jsonl in the folder.
    """
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        raise ArgumentError(f"{path} is missing: {run_dir} is not a training run folder")
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            break
    return entries


def plot_log(run_dir: str | os.PathLike, out: Optional[str | os.PathLike] = None) -> Path:
    """Plot training loss (raw and smoothed), validation loss and the learning rate against the
    optimizer step; write it atomically to OUT (default RUN/loss.png).

    Raises:
        ArgumentError: no log.jsonl, or a log without any step.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = read_log(run_dir)
    if not entries:
        raise ArgumentError(f"{Path(run_dir) / 'log.jsonl'} has no steps yet")
    steps = [e["step"] for e in entries]
    loss = [e["loss"] for e in entries]
    smooth, ema = [], None
    for x in loss:                                       # exponential moving average, α = 0.1
        ema = x if ema is None else 0.9 * ema + 0.1 * x
        smooth.append(ema)
    val = [(e["step"], e["val_loss"]) for e in entries if "val_loss" in e]

    fig, (ax, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                    gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(steps, loss, color="tab:blue", alpha=0.25, linewidth=0.8, label="train loss")
    ax.plot(steps, smooth, color="tab:blue", linewidth=1.5, label="train loss (EMA 0.9)")
    if val:
        ax.plot(*zip(*val), "o-", color="tab:orange", markersize=4, label="validation loss")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"{Path(run_dir).resolve().name}: {steps[-1]} steps, "
                 f"{entries[-1].get('tokens', 0):,} tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    ax_lr.plot(steps, [e["lr"] for e in entries], color="tab:green")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out) if out is not None else Path(run_dir) / "loss.png"
    try:
        with atomic_output(out, folder=False, force=True) as tmp:
            fig.savefig(tmp, dpi=100)
    finally:
        plt.close(fig)
    return out
