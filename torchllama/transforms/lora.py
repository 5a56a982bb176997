"""LoRA, QLoRA and DoRA adapters on the linear layers of our decoder, in PEFT's file format.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3): a frozen
weight W (N, K) gets a trainable low-rank update

    h = W·x + (α/r)·B·A·x          A (r, K) Kaiming-uniform, B (N, r) zero, so h = W·x at step 0

QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", eq. 5): W stays in
its quantized form (our int4/int8 modules or a GGUF file's blocks: `torchllama.transforms.quantize`); only
A and B are float32. The gradient reaches earlier layers through W, dequantized on the fly in
the backward pass (`torchllama.transforms.quantize.weight_only_linear`), never stored.

DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation", eq. 5): the adapted weight
is split into a trainable magnitude m (N,) and a direction,

    W' = m · (W + (α/r)·B·A) / ‖W + (α/r)·B·A‖_c

with ‖·‖_c the norm of each output row (PEFT's `weight_norm`), treated as a constant in the
backward pass (the paper's §4.3, as PEFT does).

Adapters are saved in PEFT's format (adapter_config.json + adapter_model.safetensors, tensors
named "base_model.model." + the Hugging Face model's module name + ".lora_A.weight"), so `peft.PeftModel.from_pretrained(transformers_model, folder)` loads them; the
family's name table (`torchllama.families`) gives the names and row orders (HF stores Llama's q/k
rows permuted for its rotate_half RoPE: B's rows are permuted the same way, A is unchanged).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchllama.errors import ArgumentError, ModelFileError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
#: every linear of a decoder layer our families have (attention, MLA, feed-forward)
LAYER_LINEARS = ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b", "w1", "w2", "w3")
DEFAULT_TARGETS = ("wq", "wv")


@dataclass(frozen=True)
class LoRAConfig:
    """Which linears get adapters and how large.

    Attributes:
        r: rank of A (r, K) and B (N, r); ≥ 1.
        alpha: the update is scaled by alpha / r (Hu et al. §4.1).
        dropout: dropout on the adapter's input x (training only); in [0, 1).
        targets: last names of the linears to adapt in every layer (`LAYER_LINEARS`), e.g.
            ("wq", "wv") — Hu et al.'s choice and PEFT's default for Llama.
        dora: weight-decomposed LoRA (a trainable magnitude per output row).
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r < 1:
            raise ArgumentError(f"--lora-r must be an integer ≥ 1, got {self.r!r}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ArgumentError(f"--lora-alpha must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ArgumentError(f"--lora-dropout must be in [0, 1), got {self.dropout!r}")
        unknown = [t for t in self.targets if t not in LAYER_LINEARS]
        if unknown or not self.targets:
            raise ArgumentError(f"--lora-targets: {', '.join(unknown) or 'none given'} "
                                f"(expected 'all' or names among {', '.join(LAYER_LINEARS)})")
        # one order (LAYER_LINEARS'), so configs compare equal however the names were listed
        object.__setattr__(self, "targets", tuple(t for t in LAYER_LINEARS
                                                  if t in self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.r


def parse_targets(text: str) -> tuple[str, ...]:
    """'wq,wv' → ("wq", "wv"); 'all' → every linear of a layer (`LAYER_LINEARS`)."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    return LAYER_LINEARS if names == ("all",) else names


# --------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------

def base_weight(base: nn.Module) -> torch.Tensor:
    """The frozen weight of a linear module as float32 (N, K): nn.Linear's, or a quantized
    module's dequantized (`Q4Linear`, `Q8Linear`, `Int4Linear`, `Int8Linear`)."""
    if isinstance(base, nn.Linear):
        return base.weight.detach().float()
    return base.dequantize().float()


class LoRALinear(nn.Module):
    """A frozen linear `base` plus a low-rank update (see the module docstring).

    Shapes: x (..., K) float32 → (..., N) float32. Parameters: lora_A (r, K), lora_B (N, r),
    with DoRA magnitude (N,); the base's own parameters are frozen (requires_grad False).

    Args:
        base: nn.Linear or a quantized linear of `torchllama.transforms.quantize` (QLoRA).
        config: rank, alpha, dropout, DoRA.
    """

    def __init__(self, base: nn.Module, config: LoRAConfig):
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.scale = config.r, config.scale
        weight_like = next(base.parameters(), None)
        device = weight_like.device if weight_like is not None else torch.device("cpu")
        self.lora_A = nn.Parameter(torch.empty(config.r, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, config.r, device=device))
        # nn.Linear's default init, as Hu et al.'s code and PEFT (kaiming_uniform_, a = √5)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.magnitude: Optional[nn.Parameter] = None
        if config.dora:                     # m₀ = ‖W‖_c, so W' = W at step 0 (B = 0)
            self.magnitude = nn.Parameter(base_weight(base).norm(dim=1))          # (N,)

    def delta_weight(self) -> torch.Tensor:
        """(α/r)·B·A, (N, K) float32."""
        return (self.lora_B @ self.lora_A) * self.scale                         # (N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)                                                         # (..., N)
        h = self.dropout(x)                                                      # (..., K)
        update = F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scale    # (..., N)
        if self.magnitude is None:
            return y + update
        # DoRA: m/‖W + ΔW‖_c · (W·x + ΔW·x) + b, the norm detached (Liu et al. §4.3)
        norm = (base_weight(self.base) + self.delta_weight()).norm(dim=1).detach()  # (N,)
        factor = self.magnitude / norm                                           # (N,)
        bias = getattr(self.base, "bias", None)
        y_nobias = y if bias is None else y - bias                               # W·x
        return y + (factor - 1) * y_nobias + factor * update

    def merged(self) -> nn.Linear:
        """A `torchllama.nn.linear.Linear` with W' = W + (α/r)·B·A (or DoRA's m·(W + ΔW)/‖W + ΔW‖_c), float32."""
        w = base_weight(self.base) + self.delta_weight().detach()                # (N, K)
        if self.magnitude is not None:
            w = w * (self.magnitude.detach() / w.norm(dim=1))[:, None]
        from torchllama.nn.linear import Linear      # our batch-invariant float32 product

        bias = getattr(self.base, "bias", None)
        out = Linear(self.in_features, self.out_features, bias=bias is not None,
                     device=w.device)
        with torch.no_grad():
            out.weight.copy_(w)
            if bias is not None:
                out.bias.copy_(bias.float())
        return out

    def extra_repr(self) -> str:
        return f"r={self.r}, scale={self.scale:g}" + (", dora" if self.magnitude is not None
                                                      else "")


# --------------------------------------------------------------------------------------------
# Applying, listing, merging
# --------------------------------------------------------------------------------------------

def _layer_linears(model: nn.Module, targets: tuple[str, ...]):
    """(our module name, parent module, attribute) of every targeted linear in the layers."""
    for name, module in model.named_modules():
        if not re.fullmatch(r"layers\.\d+\.(attention|feed_forward)", name):
            continue
        for attr in targets:
            child = getattr(module, attr, None)
            if isinstance(child, nn.Module) and hasattr(child, "in_features"):
                yield f"{name}.{attr}", module, attr


def apply_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Freeze every parameter of `model` and wrap its targeted linears in `LoRALinear`s, in
    place. Fused q/k/v and w1/w3 products of a quantized model (`fuse.fuse_projections`)
    are unfused where a part is adapted (their parts keep the same weights).

    Returns:
        The adapted modules' names (ours, e.g. "layers.0.attention.wq").

    Raises:
        ArgumentError: no linear of the model matches the targets.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for name, parent, attr in list(_layer_linears(model, config.targets)):
        setattr(parent, attr, LoRALinear(getattr(parent, attr), config))
        if attr in ("wq", "wk", "wv") and getattr(parent, "wqkv", None) is not None:
            parent.wqkv = None
        if attr in ("w1", "w3") and getattr(parent, "w13", None) is not None:
            parent.w13 = None
        names.append(name)
    if not names:
        raise ArgumentError(f"--lora-targets {','.join(config.targets)}: this model has no "
                            "such linear layers")
    return names


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Our name → LoRALinear of every adapted linear, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable adapter parameters (A, B, DoRA magnitudes), in a fixed order."""
    return [p for m in lora_modules(model).values() for p in
            (m.lora_A, m.lora_B, *(() if m.magnitude is None else (m.magnitude,)))]


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear by the nn.Linear of its merged weight (`LoRALinear.merged`), in
    place, and return the model: a plain float model for any of our writers."""
    for name in list(lora_modules(model)):
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, getattr(parent, attr).merged())
    return model


# --------------------------------------------------------------------------------------------
# PEFT's format
# --------------------------------------------------------------------------------------------

def _hf_names(model: nn.Module, names: list[str]) -> dict[str, tuple[str, object]]:
    """Our module name → (the module's name in PEFT's file, the row layout of B) for each
    adapted linear: transformers' module name and HF's row order where the model's family has
    a Hugging Face layout that stores each adapted weight on its own; otherwise (a config no HF
    architecture holds, or GPT-2's fused and transposed c_attn) our own names and rows, which
    our loader reads back but `peft` cannot put on a transformers model."""
    from torchllama.families import family_for_args
    from torchllama.families.base import Layout, RopePermuted

    args = model.args
    ours = {name: ("model." + name, Layout()) for name in names}
    try:
        family = family_for_args(args, "hf")
    except ArgumentError:
        return ours
    table = {m.ours: m for m in family.mappings("hf", args.n_layers)}
    out = {}
    for name in names:
        m = table.get((name + ".weight",))
        if m is None or not m.theirs.endswith(".weight") or \
                type(m.layout) not in (Layout, RopePermuted):
            return ours
        out[name] = (m.theirs[:-len(".weight")], m.layout)
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters in PEFT's names and HF's row order (float32, contiguous, on the CPU)."""
    modules = lora_modules(model)
    names = _hf_names(model, list(modules))
    out = {}
    for name, module in modules.items():
        theirs, layout = names[name]
        b = module.lora_B.detach().float().cpu()                                  # (N, r)
        a = module.lora_A.detach().float().cpu()                                  # (r, K)
        out[f"{PEFT_PREFIX}{theirs}.lora_A.weight"] = a.contiguous()
        out[f"{PEFT_PREFIX}{theirs}.lora_B.weight"] = layout.save((b,), model.args).contiguous()
        if module.magnitude is not None:
            m = module.magnitude.detach().float().cpu()[:, None]                  # (N, 1)
            out[f"{PEFT_PREFIX}{theirs}.lora_magnitude_vector"] = \
                layout.save((m,), model.args)[:, 0].contiguous()
    return out


def adapter_config(model: nn.Module, config: LoRAConfig, base_model: str = "") -> dict:
    """adapter_config.json's fields (PEFT's LoraConfig) for `model`'s adapters."""
    names = _hf_names(model, list(lora_modules(model)))
    targets = sorted({theirs.rsplit(".", 1)[1] for theirs, _ in names.values()})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": config.r, "lora_alpha": config.alpha, "lora_dropout": config.dropout,
            "target_modules": targets, "bias": "none", "use_dora": config.dora,
            "use_rslora": False, "fan_in_fan_out": False, "init_lora_weights": True,
            "modules_to_save": None, "inference_mode": True, "rank_pattern": {},
            "alpha_pattern": {}, "layers_to_transform": None}


def save_adapter(model: nn.Module, config: LoRAConfig, folder: Path | str,
                 base_model: str = "") -> None:
    """Write adapter_config.json and adapter_model.safetensors into `folder` (which must exist;
    callers write into a temporary folder and rename it, `torchllama.checkpoint.atomic_output`)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    (folder / CONFIG_FILE).write_text(
        json.dumps(adapter_config(model, config, base_model), indent=2) + "\n")
    save_file(adapter_state_dict(model), str(folder / WEIGHTS_FILE),
              metadata={"format": "pt"})


def read_adapter_config(folder: Path | str) -> LoRAConfig:
    """The LoRAConfig of a PEFT adapter folder (ours or PEFT's).

    Raises:
        ModelFileError: a missing or malformed adapter_config.json, or an adapter kind other
            than LoRA.
    """
    path = Path(folder) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFileError(f"{path} is missing: {folder} is not a LoRA adapter folder "
                             f"(adapter_config.json + {WEIGHTS_FILE})") from None
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        raise ModelFileError(f"{path}: peft_type {raw.get('peft_type') if isinstance(raw, dict) else raw!r} "
                             "is not supported (expected LORA)")
    try:
        targets = raw["target_modules"]
        short = _our_short_names()
        targets = [short.get(t, t) for t in
                   ([targets] if isinstance(targets, str) else targets)]
        return LoRAConfig(r=int(raw["r"]), alpha=float(raw["lora_alpha"]),
                          dropout=float(raw.get("lora_dropout") or 0.0),
                          targets=tuple(targets), dora=bool(raw.get("use_dora", False)))
    except (KeyError, TypeError, ValueError, ArgumentError) as e:
        raise ModelFileError(f"{path}: not a LoRA configuration we can use ({e})") from None


def _our_short_names() -> dict[str, str]:
    """HF module short names → ours ("q_proj" → "wq", "kv_b_proj" → "wkv_b"), from the
    families' name tables, for the target_modules of adapters written by PEFT itself."""
    from torchllama.families import FAMILIES

    out = {}
    for family in FAMILIES.values():
        for row in family.tensors:
            ours = row.our_names[0].split(".")
            if len(row.our_names) == 1 and row.hf and row.hf.endswith(".weight") and \
                    len(ours) == 5 and ours[2] in ("attention", "feed_forward"):
                out.setdefault(row.hf.split(".")[-2], ours[3])
    return out


def load_adapter(model: nn.Module, folder: Path | str) -> LoRAConfig:
    """Attach the PEFT adapter in `folder` to `model` (in place: `apply_lora`, then
    `copy_adapter_weights`) and return its configuration.

    Raises:
        ModelFileError: missing/malformed files, or an adapter for another model (see
            `copy_adapter_weights`; target modules the model lacks are named).
    """
    folder = Path(folder)
    config = read_adapter_config(folder)
    try:
        apply_lora(model, config)
    except ArgumentError as e:
        raise ModelFileError(f"{folder}: an adapter for another architecture ({e})") from None
    copy_adapter_weights(model, folder)
    return config


def read_adapter_weights(folder: Path | str) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors of a PEFT folder (PEFT's names).

    Raises:
        ModelFileError: the file is missing or unreadable.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder) / WEIGHTS_FILE
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise ModelFileError(f"{path} is missing") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot read it ({e})") from None


def copy_adapter_weights(model: nn.Module, folder: Path | str) -> None:
    """Copy adapter_model.safetensors' A, B (and DoRA magnitudes) into the model's LoRA
    modules (B's rows back in our order).

    Raises:
        ModelFileError: unreadable file, or an adapter for another model: a tensor whose shape
            differs, one the model has no module for, or a module without its tensor — the
            message names the first mismatch and both shapes.
    """
    path = Path(folder) / WEIGHTS_FILE
    saved = read_adapter_weights(folder)
    wanted = adapter_state_dict(model)              # our modules' tensors, in PEFT's names
    for key in saved:
        if key not in wanted:
            raise ModelFileError(f"{path}: {key} has no module in this model "
                                 f"({model.args.n_layers} layers): an adapter for another "
                                 "architecture")
    for key, expected in wanted.items():
        if key not in saved:
            raise ModelFileError(f"{path}: {key} is missing: an adapter for another "
                                 "architecture or other target modules")
        if saved[key].shape != expected.shape:
            raise ModelFileError(f"{path}: {key} has shape {tuple(saved[key].shape)} but this "
                                 f"model needs {tuple(expected.shape)}: an adapter for another "
                                 "architecture")
    names = _hf_names(model, list(lora_modules(model)))
    with torch.no_grad():
        for name, module in lora_modules(model).items():
            theirs, layout = names[name]
            key = PEFT_PREFIX + theirs
            module.lora_A.copy_(saved[key + ".lora_A.weight"])
            module.lora_B.copy_(layout.load(saved[key + ".lora_B.weight"], model.args)[0])
            if module.magnitude is not None:
                m = layout.load(saved[key + ".lora_magnitude_vector"][:, None], model.args)[0]
                module.magnitude.copy_(m[:, 0])


def resolve_adapter(path: str | Path) -> Path:
    """An adapter folder, or a finetuning run folder (its `latest` checkpoint)."""
    folder = Path(path)
    if not folder.exists():
        raise ModelFileError(f"--adapter {folder}: no such folder")
    if (folder / CONFIG_FILE).exists():
        return folder
    latest = folder / "latest"
    if latest.exists() and (latest.resolve() / CONFIG_FILE).exists():
        return latest.resolve()
    raise ModelFileError(f"--adapter {folder}: neither an adapter folder ({CONFIG_FILE}) nor a "
                         "finetuning run with a checkpoint")
