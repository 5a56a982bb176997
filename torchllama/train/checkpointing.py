"""Training checkpoints: everything needed to resume a run exactly, in a folder that is also a
normal torchllama (Meta-format) checkpoint.

    OUT/step-00000500/
        params.json, consolidated.00.pth      the model (float32), loadable by `torchllama.load`
        tokenizer.model (or tokenizer.json)   the run's tokenizer
        train_state.pt                        step, micro-step (data-loader position), model args,
                                              run config, tokenizer and dataset hashes, the RNG
                                              states of every generator in use (per rank), and
                                              the optimizer state (one process / DDP)
        dcp/                                  FSDP runs: model + optimizer shards written by
                                              torch.distributed.checkpoint (each rank its own)
    OUT/latest -> step-00000500               symbolic link to the newest complete checkpoint

A checkpoint is assembled in OUT/.tmp-step-00000500 and renamed into place after every file is
flushed to disk, then `latest` is switched with an atomic rename: a process killed at any moment
(even with kill -9) leaves the previous checkpoint intact and no half-written one under a
step-* name. The newest `keep` checkpoints are kept.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from torchllama.errors import ModelFileError
from torchllama.checkpoint import fsync_path
from torchllama.train.distributed import DistContext, barrier

STEP_DIR = re.compile(r"step-(\d{8})\Z")
STATE_FILE = "train_state.pt"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run folder, oldest first."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The checkpoint `latest` points to (else the newest step-* folder), or None."""
    link = run_dir / "latest"
    if link.is_symlink() and link.resolve().is_dir():
        return link.resolve()
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state(device: torch.device) -> dict[str, Any]:
    """The states of every random generator the process may use: Python's, NumPy's, torch's
    CPU generator and, on GPUs, the CUDA generator of `device`."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def publish_checkpoint(run_dir: Path, tmp: Path, final: Path, keep: int) -> None:
    """Make the fully written folder `tmp` the checkpoint `final`: fsync it, rename it into
    place (replacing a checkpoint of this step from an earlier try), switch `latest` to it with
    an atomic rename, and delete all but the newest `keep` checkpoints."""
    fsync_path(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    link_tmp = run_dir / ".latest.tmp"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    os.symlink(final.name, link_tmp)
    os.replace(link_tmp, run_dir / "latest")
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


# --8<-- [start:save-checkpoint]
def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], tokenizer, ctx: DistContext, *, fsdp: bool,
                    keep: int) -> Path:
    """Write checkpoint `step` of a run (collective: every rank calls it).

    Args:
        run_dir: the run folder.
        step: optimizer steps done.
        model: the trained Transformer (FSDP2-sharded in place, or plain; not a DDP wrapper).
        optimizer: its optimizer.
        state: run state to store in train_state.pt (step, micro_step, args, config, hashes).
        tokenizer: the run's `Tokenizer` (written as tokenizer.model / tokenizer.json).
        ctx: this process's rank and device.
        fsdp: the model is sharded with FSDP2 (model and optimizer go through DCP).
        keep: number of newest checkpoints to keep.

    Returns:
        The checkpoint folder.
    """
    from torchllama.checkpoint.meta import meta_params

    final = step_dir(run_dir, step)
    tmp = run_dir / f".tmp-{final.name}"
    rngs = _gather_objects(rng_state(ctx.device), ctx)
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    if fsdp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                             get_model_state_dict)

        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / "dcp"))
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        optim_state = None
    else:
        full = model.state_dict()
        optim_state = optimizer.state_dict()
    if ctx.is_main:
        import json

        (tmp / "params.json").write_text(json.dumps(meta_params(model.args), indent=2) + "\n")
        torch.save({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in full.items()},
                   tmp / "consolidated.00.pth")
        tokenizer.save_hf(tmp)
        torch.save({**state, "rng": rngs, "optimizer": optim_state, "fsdp": fsdp,
                    "world_size": ctx.world_size}, tmp / STATE_FILE)
        publish_checkpoint(run_dir, tmp, final, keep)
    barrier()
    return final
# --8<-- [end:save-checkpoint]


def read_train_state(ckpt: Path) -> dict[str, Any]:
    """train_state.pt of a checkpoint folder, read with `weights_only=True` (tensors, numbers,
    strings, containers: a tampered file cannot run code).

    Raises:
        ModelFileError: missing or unreadable.
    """
    path = ckpt / STATE_FILE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ModelFileError(f"{path} is missing: {ckpt} is not a training checkpoint") from None
    except Exception as e:  # noqa: BLE001 - a damaged file: say which
        raise ModelFileError(f"{path}: cannot read the training state ({e})") from None


def load_checkpoint(ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    ctx: DistContext, *, fsdp: bool) -> dict[str, Any]:
    """Restore model weights, optimizer state and this rank's RNG states from a checkpoint
    written by `save_checkpoint` (collective). Returns train_state.pt's dict.

    Raises:
        ModelFileError: missing or damaged files, or a checkpoint written by a run with another
            parallelism or number of processes where that matters (FSDP ↔ not).
    """
    state = read_train_state(ckpt)
    if bool(state.get("fsdp")) != fsdp:
        raise ModelFileError(
            f"{ckpt}: written by a{'n FSDP' if state.get('fsdp') else ' non-FSDP'} run; resume "
            + ("it under torchrun with --parallel fsdp" if state.get("fsdp") else
               "it in one process or under torchrun with --parallel ddp"))
    if fsdp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        target = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(target, checkpoint_id=str(ckpt / "dcp"))
        set_state_dict(model, optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"])
    else:
        weights = torch.load(ckpt / "consolidated.00.pth", map_location="cpu", weights_only=True)
        with torch.no_grad():
            model.load_state_dict(weights, strict=True)    # copies into the existing tensors
        optimizer.load_state_dict(state["optimizer"])
    rngs = state["rng"]
    set_rng_state(rngs[ctx.rank] if ctx.rank < len(rngs) else rngs[0], ctx.device)
    return state
