"""Scaling out with torch.distributed: process groups from torchrun, DDP or FSDP2 wrapping,
activation checkpointing. Nothing here is ours to get wrong: each piece is torch's own engine.

    torchrun --nproc-per-node N -m torchllama.train --parallel ddp|fsdp ...

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and MASTER_ADDR/PORT (also across nodes with
--nnodes/--rdzv-endpoint); `init_distributed` joins the group with NCCL on CUDA devices and Gloo
on the CPU. Without those variables training runs in one process.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from torchllama.errors import ArgumentError

PARALLEL = ("ddp", "fsdp")


@dataclass
class DistContext:
    """Where this process sits: rank among world_size processes, and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, prints and writes the run's files."""
        return self.rank == 0


def resolve_device(device: str) -> torch.device:
    """'auto' → 'cuda' when available, else 'cpu'; other names are checked.

    Raises:
        ArgumentError: an unknown device, or CUDA asked for but not available.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ArgumentError(f"--device {device!r} is not a device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ArgumentError("--device cuda: no CUDA device is available here")
    if dev.type not in ("cpu", "cuda"):
        raise ArgumentError(f"--device {device!r}: only cpu and cuda are supported")
    return dev


def init_distributed(device: str) -> DistContext:
    """Join torchrun's process group if this process was started by torchrun, else run alone.

    Under torchrun each process uses cuda:LOCAL_RANK (NCCL) on GPUs, or the CPU (Gloo).
    """
    dev = resolve_device(device)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistContext(device=dev)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo",
                                device_id=dev if dev.type == "cuda" else None)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, parallel: str, ctx: DistContext) -> nn.Module:
    """The module to train: `model` itself in one process; DistributedDataParallel (every rank
    holds all weights, gradients are all-reduced) or FSDP2 `fully_shard` (parameters, gradients
    and optimizer state sharded over ranks, each block gathered for its forward/backward) under
    torchrun. FSDP2 shards each TransformerBlock, then the root (embeddings, norm, output).

    Raises:
        ArgumentError: unknown `parallel`.
    """
    if parallel not in PARALLEL:
        raise ArgumentError(f"--parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
    if not ctx.distributed:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The Transformer inside DDP and torch.compile wrappers (FSDP2 shards in place)."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter of a micro-step that is not the last of an
    accumulation (DDP `no_sync`, FSDP2 `set_requires_gradient_sync`); no-op in one process."""
    inner = getattr(model, "_orig_mod", model)
    if hasattr(inner, "no_sync") and not enabled:
        with inner.no_sync():
            yield
    elif hasattr(inner, "set_requires_gradient_sync"):
        inner.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def all_reduce_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over ranks (x itself in one process)."""
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= dist.get_world_size()
    return x


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over ranks (x itself in one process)."""
    if dist.is_initialized():
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each TransformerBlock's activations during backward instead of storing them
    (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): activation memory
    drops from O(n_layers · B·T·(dim + hidden)) to the block inputs, for ≈ one extra forward.

    Uses torch.utils.checkpoint (non-reentrant) around each block's forward; module and
    parameter names stay unchanged, so checkpoints and FSDP wrapping are unaffected.
    """
    from torch.utils.checkpoint import checkpoint

    for block in model.layers:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
