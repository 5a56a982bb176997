"""What training needs beyond the model: weight initialisation, AdamW with decoupled weight decay
on matrices, the learning-rate schedule, and the FLOP count behind MFU.

Choices (each with its source):
- Init (GPT-2, Radford et al. 2019 §2.3, as nanoGPT's `_init_weights`): every nn.Linear and the
  token embeddings ~ N(0, 0.02²); the two projections that write into the residual stream
  (attention.wo and feed_forward.w2) ~ N(0, (0.02 / sqrt(2·n_layers))²) so that the residual
  stream's variance does not grow with depth; RMSNorm gains = 1.
- Weight decay (Loshchilov & Hutter 2019, AdamW) on the linear layers' weight matrices only. Not
  on RMSNorm gains (they scale, decaying them towards 0 shrinks every activation) and not on the
  token embeddings: a row is only updated when its token occurs, so decay would mostly pull rare
  tokens towards 0 (the choice of Meta's OPT/Llama recipes is decay on all matrices; nanoGPT
  decays embeddings too — ours follows the argument above). A tied output matrix is the
  embedding matrix and is therefore not decayed either.
- Schedule (Loshchilov & Hutter 2017, SGDR; used by Llama 2, Touvron et al. 2023 §2.2): linear
  warmup over `warmup_steps`, then cosine decay to `min_lr` at `max_steps`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from torchllama.config import ModelArgs


def init_weights(model: nn.Module, n_layers: int, std: float = 0.02) -> None:
    """Initialise a Transformer's parameters in place as described in the module docstring.

    Parameters are told apart by the modules that hold them, not by name: norm gains get their
    norm's neutral value (1, or 0 for a (1 + w) gain), biases 0, the residual projections
    (`Transformer.residual_projections`) the smaller normal, every other matrix N(0, std²).

    Args:
        model: a `torchllama.model.Transformer` (on any device, not on the meta device).
        n_layers: its number of blocks (scales the residual projections).
        std: standard deviation of the normal init (0.02, GPT-2).

    Draws from torch's global generator, in `named_parameters()` order: seed it
    (torch.manual_seed) for a reproducible init.
    """
    residual_std = std / math.sqrt(2 * n_layers)
    residual = {id(m.weight) for m in model.residual_projections()}
    fills = {id(p): value for m in model.modules() if hasattr(m, "neutral_values")
             for p, value in m.neutral_values()}               # norm gains and biases
    with torch.no_grad():
        for _, p in model.named_parameters():
            if id(p) in fills:
                p.fill_(fills[id(p)])
            elif p.ndim == 1:                                 # biases of linear layers
                p.zero_()
            elif id(p) in residual:                           # residual projections
                p.normal_(0.0, residual_std)
            else:                                             # embeddings, other matrices
                p.normal_(0.0, std)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: linear weight matrices decayed, the rest (norm gains, token
    embeddings and a tied output matrix) not. Each parameter appears once.

    Returns:
        [{"params": decayed, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0}]
    """
    decay, no_decay, seen = [], [], set()
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for p in model.parameters():                  # parameters() yields a shared tensor once
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if p.ndim >= 2 and id(p) not in embedding_ids:
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1,
                   betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                   fused: bool = False) -> torch.optim.AdamW:
    """torch's AdamW over `param_groups(model, weight_decay)` (β = (0.9, 0.95), ε = 1e-8,
    weight decay 0.1: Llama 2, Touvron et al. 2023 §2.2). `fused` uses the fused CUDA kernel."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps,
                             fused=fused or None)


def lr_at(step: int, lr: float, warmup_steps: int, max_steps: int, min_lr: float) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup from lr/warmup_steps to lr
    over steps 0..warmup_steps-1, then cosine decay lr → min_lr over the remaining steps,
    min_lr after max_steps.

    lr(s) = min_lr + ½·(lr − min_lr)·(1 + cos(π·(s − warmup)/(max_steps − warmup)))
    (SGDR, Loshchilov & Hutter 2017, eq. 5). A pure function of the step: resuming at step k
    gives the same rates as never stopping.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)    # 0 → 1
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of every step of a run: `lr_at` with these settings.

    Attributes:
        lr: peak learning rate.
        min_lr: final learning rate of the cosine decay.
        warmup_steps: linear warmup steps.
        max_steps: the run's optimizer steps (the cosine reaches min_lr there).
    """

    lr: float
    min_lr: float
    warmup_steps: int
    max_steps: int

    @classmethod
    def for_run(cls, lr: float, min_lr: Optional[float], warmup_steps: Optional[int],
                max_steps: int, max_warmup: int) -> "LRSchedule":
        """A run's schedule from its options: min_lr defaults to lr / 10, warmup_steps to 10%
        of max_steps, at most `max_warmup`."""
        return cls(lr=lr, min_lr=min_lr if min_lr is not None else lr / 10,
                   warmup_steps=warmup_steps if warmup_steps is not None else
                   min(max_warmup, max_steps // 10), max_steps=max_steps)

    def at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based)."""
        return lr_at(step, self.lr, self.warmup_steps, self.max_steps, self.min_lr)


def count_params(model: nn.Module, *, exclude_embeddings: bool = False) -> int:
    """Number of parameters (a tied matrix counted once); optionally without tok_embeddings."""
    seen, n = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embeddings and name.endswith("tok_embeddings.weight"):
            continue
        n += p.numel()
    return n


def flops_per_token(args: ModelArgs, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), nanoGPT's `estimate_mfu` formula after the
    PaLM paper (Chowdhery et al. 2022, appendix B): 6·N + 12·L·H·Q·T, with N parameters, L layers,
    H heads, Q head_dim and T the sequence length (the attention score and value matmuls, which
    the 6·N weight term does not count)."""
    return 6 * n_params + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
