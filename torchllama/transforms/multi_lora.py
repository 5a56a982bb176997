"""Many LoRA adapters on one served model, chosen per request: batched LoRA.

The base weights are shared; each adapter adds its own low-rank update to the rows of the batch
that chose it (S-LoRA, Sheng et al. 2023, §4; Punica's SGMV, Chen et al. 2023):

    y_b = W·x_b + (α_a/r_a)·B_a·(A_a·x_b)        for batch row b served with adapter a
    y_b = W·x_b                                   for a row served with the base model

`install` wraps each product of every decoder layer — the fused q/k/v and gate/up products
where the model has them (`transforms.fuse.fuse_projections`), each adapter's part of them
at its offset in the output — in a `MultiLoRALinear`; `AdapterSet.selecting(rows)` tells them,
for one forward, which adapter each batch row uses. A row's update is computed from that row
alone with torchllama's batch-invariant float32 product (`nn.linear.invariant_linear`), so a
request gets the same bits whatever adapters the other rows use. While no row of a forward uses
an adapter, a fused decoder layer (`transforms.fuse`) runs its one-op path on the base weights
as before; otherwise the layer runs its readable forward.

Adapters are PEFT folders (`transforms.lora`'s format): LoRA only (DoRA's magnitude depends on
the merged weight: merge such an adapter instead).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn

from torchllama.errors import ModelFileError
from torchllama.nn.linear import invariant_linear


@dataclass
class AdapterSet:
    """The adapters loaded on a model (name → id) and, during one forward, the adapter id of
    each batch row (−1: the base model)."""

    ids: dict[str, int] = field(default_factory=dict)
    rows: Optional[list[int]] = None
    _next: int = 0

    @property
    def active(self) -> bool:
        """Some row of the current forward uses an adapter."""
        return self.rows is not None and any(r >= 0 for r in self.rows)

    @contextlib.contextmanager
    def selecting(self, rows: list[int]) -> Iterator[None]:
        """For the forward inside: batch row b uses adapter id rows[b] (−1: none)."""
        self.rows = rows
        try:
            yield
        finally:
            self.rows = None

    def new_id(self, name: str) -> int:
        self._next += 1
        self.ids[name] = self._next - 1
        return self.ids[name]


class MultiLoRALinear(nn.Module):
    """A product `base` (nn.Linear or a block-quantized linear) plus, per adapter id, low-rank
    updates of parts of its output.

    Shapes: x (B, T, K) → (B, T, N); an update (A (r, K), B (n, r), scale, offset) adds
    scale·B·A·x to outputs offset..offset+n-1 of the rows using its adapter.

    Args:
        base: the product.
        adapters: the model's `AdapterSet`.
        parts: our linear name ("wq", "w1", …) → (offset, width) of its output in `base`'s.
    """

    def __init__(self, base: nn.Module, adapters: AdapterSet, parts: dict[str, tuple[int, int]]):
        super().__init__()
        self.base, self.adapters, self.parts = base, adapters, parts
        self.in_features, self.out_features = base.in_features, base.out_features
        self.updates: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}

    def kernel_weight(self):
        """The base's block weight (the fused decoder layer runs the base alone)."""
        kernel_weight = getattr(self.base, "kernel_weight", None)
        return kernel_weight() if callable(kernel_weight) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)                                                         # (B, T, N)
        rows = self.adapters.rows
        if rows is None or not self.updates:
            return y
        for a in sorted(set(rows)):
            updates = self.updates.get(a)
            if not updates:
                continue
            sel = torch.tensor([b for b, r in enumerate(rows) if r == a], device=x.device)
            h = x.index_select(0, sel)                                           # (n, T, K)
            for offset, lora_a, lora_b, scale in updates:
                u = invariant_linear(invariant_linear(h, lora_a), lora_b) * scale  # (n, T, w)
                y[sel, :, offset:offset + lora_b.shape[0]] += u.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"parts={list(self.parts)}, adapters={sorted(self.updates)}"


def _wrap(parent: nn.Module, attr: str, adapters: AdapterSet,
          parts: dict[str, tuple[int, int]]) -> None:
    module = getattr(parent, attr, None)
    if module is not None and not isinstance(module, MultiLoRALinear):
        setattr(parent, attr, MultiLoRALinear(module, adapters, parts))


def install(model: nn.Module) -> AdapterSet:
    """Wrap every layer's products in `MultiLoRALinear`s sharing one `AdapterSet` (in place;
    again: the same set). Fused q/k/v and w1/w3 products are wrapped whole."""
    existing = getattr(model, "adapter_set", None)
    if existing is not None:
        return existing
    adapters = AdapterSet()
    for block in model.layers:
        attention, ffn = block.attention, block.feed_forward
        if getattr(attention, "wqkv", None) is not None:
            q, kv = attention.wq.out_features, attention.wk.out_features
            _wrap(attention, "wqkv", adapters, {"wq": (0, q), "wk": (q, kv),
                                                "wv": (q + kv, kv)})
        for name in ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            _wrap(attention, name, adapters, {name: (0, 0)})
        if getattr(ffn, "w13", None) is not None:
            f = ffn.w1.out_features
            _wrap(ffn, "w13", adapters, {"w1": (0, f), "w3": (f, f)})
        for name in ("w1", "w2", "w3"):
            _wrap(ffn, name, adapters, {name: (0, 0)})
        block.adapters = adapters
    model.adapter_set = adapters
    return adapters


def _owner(model: nn.Module, name: str) -> tuple[MultiLoRALinear, int]:
    """The wrapper computing our linear `name` ("layers.3.attention.wq") and its offset."""
    parent_name, attr = name.rsplit(".", 1)
    parent = model.get_submodule(parent_name)
    for fused in ("wqkv", "w13"):
        module = getattr(parent, fused, None)
        if isinstance(module, MultiLoRALinear) and attr in module.parts:
            return module, module.parts[attr][0]
    return getattr(parent, attr), 0


@dataclass
class AdapterWeights:
    """An adapter read from its folder: (wrapper, offset, A, B, scale) per adapted linear."""

    name: str
    updates: list


def read_adapter(model: nn.Module, name: str, folder: Path | str) -> AdapterWeights:
    """Read a PEFT adapter for `model` (after `install`), its B rows in our order, checked
    as `check_adapter` checks it.

    Raises:
        ModelFileError: see `check_adapter`.
    """
    device = next(model.parameters()).device
    updates = []
    for ours, lora_a, lora_b, scale in _adapter_tensors(model, folder):
        wrapper, offset = _owner(model, ours)
        updates.append((wrapper, offset, lora_a.contiguous().to(device),
                        lora_b.contiguous().to(device), scale))
    return AdapterWeights(name, updates)


def check_adapter(model: nn.Module, folder: Path | str) -> None:
    """Check a PEFT adapter folder against `model` without changing the model: what the
    server does before an adapter touches the engine.

    Raises:
        ModelFileError: missing or malformed files; a DoRA adapter; a rank below 1 or above
            the layer's sizes; a non-finite lora_alpha; target modules this model lacks; a
            tensor that is not floating point, of another shape, or holding NaN/inf; a tensor
            for no module of this model (each named).
    """
    _adapter_tensors(model, folder)


def _adapter_tensors(model: nn.Module, folder: Path | str) -> list[tuple]:
    """(our linear's name, A (r, K), B (N, r) in our row order, scale) per adapted linear,
    every check of `check_adapter` made."""
    from torchllama.transforms.lora import (PEFT_PREFIX, WEIGHTS_FILE, _hf_names,
                                            read_adapter_config, read_adapter_weights,
                                            resolve_adapter)

    folder = resolve_adapter(folder)
    config = read_adapter_config(folder)
    if config.dora:
        raise ModelFileError(f"{folder}: a DoRA adapter cannot be served per request (its "
                             "magnitudes depend on the merged weight); merge it instead")
    if config.r < 1 or not math.isfinite(config.alpha):
        raise ModelFileError(f"{folder}: adapter_config.json: r must be ≥ 1 and lora_alpha "
                             f"finite, got r={config.r}, lora_alpha={config.alpha}")
    names = [f"layers.{i}.{part}.{t}" for i, block in enumerate(model.layers)
             for part in ("attention", "feed_forward") for t in config.targets
             if hasattr(getattr(block, part), t)]
    if not names:
        raise ModelFileError(f"{folder}: target modules {', '.join(config.targets)}: this "
                             "model has no such linear layers (an adapter for another "
                             "architecture)")
    path = folder / WEIGHTS_FILE
    saved = read_adapter_weights(folder)
    out, used = [], set()
    for ours, (theirs, layout) in _hf_names(model, names).items():
        key = PEFT_PREFIX + theirs
        a_key, b_key = key + ".lora_A.weight", key + ".lora_B.weight"
        if a_key not in saved or b_key not in saved:
            raise ModelFileError(f"{path}: {key}.lora_A/B are missing: an adapter for another "
                                 "architecture or other target modules")
        _check_tensor(path, a_key, saved[a_key])
        _check_tensor(path, b_key, saved[b_key])
        used |= {a_key, b_key}
        lora_a = saved[a_key].float()                                            # (r, K)
        lora_b = layout.load(saved[b_key].float(), model.args)[0]                # (N, r)
        linear = model.get_submodule(ours)
        linear = getattr(linear, "base", linear)
        if lora_a.shape != (config.r, linear.in_features) or \
                lora_b.shape != (linear.out_features, config.r):
            raise ModelFileError(f"{path}: {key} has A {tuple(lora_a.shape)} and B "
                                 f"{tuple(lora_b.shape)}, this model needs ({config.r}, "
                                 f"{linear.in_features}) and ({linear.out_features}, "
                                 f"{config.r}): an adapter for another architecture")
        out.append((ours, lora_a, lora_b, config.scale))
    extra = sorted(set(saved) - used)
    if extra:
        raise ModelFileError(f"{path}: {extra[0]} (and {len(extra) - 1} more) belong to no "
                             f"target module of this model ({', '.join(config.targets)})")
    return out


def _check_tensor(path: Path, key: str, tensor: torch.Tensor) -> None:
    """A LoRA factor must be a finite floating-point matrix."""
    if not tensor.is_floating_point() or tensor.dim() != 2:
        raise ModelFileError(f"{path}: {key} is {tensor.dtype} with {tensor.dim()} dimensions; "
                             "expected a floating-point matrix")
    if not torch.isfinite(tensor).all():
        raise ModelFileError(f"{path}: {key} holds NaN or infinite values")


def add_adapter(adapters: AdapterSet, weights: AdapterWeights) -> int:
    """Attach a read adapter under its name (in the thread that runs the model); its id."""
    a = adapters.new_id(weights.name)
    for wrapper, offset, lora_a, lora_b, scale in weights.updates:
        wrapper.updates.setdefault(a, []).append((offset, lora_a, lora_b, scale))
    return a


def remove_adapter(model: nn.Module, adapters: AdapterSet, name: str) -> None:
    """Detach adapter `name` from every wrapper (in the thread that runs the model)."""
    a = adapters.ids.pop(name)
    for module in model.modules():
        if isinstance(module, MultiLoRALinear):
            module.updates.pop(a, None)
