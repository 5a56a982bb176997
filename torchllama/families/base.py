"""What a model family's adapter is: one table naming each of our parameters in the family's
Hugging Face and GGUF files (with how the stored layout differs), plus how the family's config
files map to `ModelArgs`.

Our parameter names are Meta's (`torchllama.model`); every loader, converter and the training
code reads names and layouts from these tables only. "{i}" in a name is the layer index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:
    from torchllama.config import ModelArgs


class Layout:
    """How a checkpoint format stores some of our tensors differently. `load` turns the stored
    tensor into ours (one or several: a fused projection), `save` the other way, and
    `stored_shape` gives the stored tensor's shape from ours (checked before reading data)."""

    def stored_shape(self, shapes: tuple[torch.Size, ...]) -> torch.Size:
        return shapes[0]

    def load(self, t: torch.Tensor, args: "ModelArgs") -> tuple[torch.Tensor, ...]:
        return (t,)

    def save(self, ts: tuple[torch.Tensor, ...], args: "ModelArgs") -> torch.Tensor:
        return ts[0]


def permute_meta_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection from Meta's interleaved RoPE layout to HF's rotate_half layout.

    HF's `convert_llama_weights_to_hf.py` permutes the rows of wq and wk so that RoPE can be
    applied with `rotate_half` (first half of each head rotated against the second half) instead
    of Meta's interleaved pairs (2i, 2i+1): within one head of width hd, Meta row 2i+c
    (c ∈ {0, 1}) becomes HF row c·hd/2 + i. Works on a bias (rows only) as on a weight.

    Args:
        w: (n_heads·head_dim, ...) weight or bias of wq (n_heads) or wk (n_kv_heads).
        n_heads: number of heads of *this* matrix (n_kv_heads for wk: using n_heads silently
            breaks every grouped-query model).

    Returns:
        A new tensor of w's shape.
    """
    rows, rest = w.shape[0], w.shape[1:]
    hd = rows // n_heads
    return (w.reshape(n_heads, hd // 2, 2, *rest)   # (heads, hd/2 pairs, 2 members, ...)
             .transpose(1, 2)                       # (heads, 2 members, hd/2 pairs, ...)
             .reshape(rows, *rest))


def permute_hf_to_meta(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `permute_meta_to_hf`: HF rotate_half rows back to Meta's interleaved pairs.

    Args:
        w: (n_heads·head_dim, ...) HF q_proj (n_heads) or k_proj (n_kv_heads) weight or bias.
        n_heads: number of heads of *this* matrix.
    """
    rows, rest = w.shape[0], w.shape[1:]
    hd = rows // n_heads
    return (w.reshape(n_heads, 2, hd // 2, *rest)   # (heads, 2 halves, hd/2, ...)
             .transpose(1, 2)                       # (heads, hd/2, 2, ...)
             .reshape(rows, *rest))


@dataclass(frozen=True)
class RopePermuted(Layout):
    """HF's rotate_half row order for q or k (see `permute_meta_to_hf`); `heads` names the
    ModelArgs field with this matrix's head count ("n_heads" or "n_kv_heads")."""

    heads: str

    def load(self, t, args):
        return (permute_hf_to_meta(t, getattr(args, self.heads)),)

    def save(self, ts, args):
        return permute_meta_to_hf(ts[0], getattr(args, self.heads))


@dataclass(frozen=True)
class Tensors:
    """One row of a family's name table.

    Attributes:
        ours: our parameter name(s); several when the family stores them fused in one tensor.
        hf: the name in the family's Hugging Face checkpoints (None: not stored there).
        gguf: the name in its GGUF files (None: not stored there).
        hf_layout, gguf_layout: how those formats store it differently from us (None: as is).
        meta_shard_dim: dimension along which Meta's model parallelism (fairscale) splits it
            across consolidated.NN.pth shards; None for replicated tensors (norms).
    """

    ours: str | tuple[str, ...]
    hf: Optional[str] = None
    gguf: Optional[str] = None
    hf_layout: Optional[Layout] = None
    gguf_layout: Optional[Layout] = None
    meta_shard_dim: Optional[int] = None

    @property
    def our_names(self) -> tuple[str, ...]:
        return (self.ours,) if isinstance(self.ours, str) else self.ours


@dataclass(frozen=True)
class Mapping:
    """One of our tensors (or a fused group of them) and its name and layout in a format, for a
    concrete model (layer index filled in)."""

    ours: tuple[str, ...]
    theirs: str
    layout: Layout


_AS_IS = Layout()


@dataclass(frozen=True)
class Family:
    """A model family's adapter: its name table and its config translations.

    Attributes:
        name: short name ("llama").
        tensors: the name table (see `Tensors`).
        hf_architectures: `architectures` values of its HF config.json.
        hf_model_type: `model_type` of its HF config.json.
        gguf_architecture: `general.architecture` of its GGUF files (None: none).
        args_from_hf: config.json dict, source path → ModelArgs (raises ModelFileError).
        hf_config: ModelArgs → config.json dict.
        args_from_gguf: GGUF metadata, tensor names, source → ModelArgs.
        gguf_metadata: (GGUFWriter, ModelArgs) → writes the family's hyperparameter keys.
        unsupported: ModelArgs → why this family's files cannot hold such a model, or None.
    """

    name: str
    tensors: tuple[Tensors, ...]
    hf_architectures: tuple[str, ...] = ()
    hf_model_type: Optional[str] = None
    gguf_architecture: Optional[str] = None
    args_from_hf: Optional[Callable[[dict, str], "ModelArgs"]] = None
    hf_config: Optional[Callable[["ModelArgs"], dict]] = None
    args_from_gguf: Optional[Callable[[dict, set, str], "ModelArgs"]] = None
    gguf_metadata: Optional[Callable[[Any, "ModelArgs"], None]] = None
    unsupported: Callable[["ModelArgs"], Optional[str]] = field(default=lambda args: None)

    def mappings(self, fmt: str, n_layers: int, ours: Optional[set[str]] = None
                 ) -> list[Mapping]:
        """The table for a concrete model in format `fmt` ("hf" or "gguf"): one `Mapping` per
        stored tensor, layer rows repeated for layers 0..n_layers-1. With `ours` (the model's
        parameter names), rows naming parameters the model does not have are left out."""
        out = []
        for row in self.tensors:
            theirs = row.hf if fmt == "hf" else row.gguf
            if theirs is None:
                continue
            layout = (row.hf_layout if fmt == "hf" else row.gguf_layout) or _AS_IS
            layers = range(n_layers) if "{i}" in theirs else [None]
            for i in layers:
                names = tuple(n.format(i=i) if i is not None else n for n in row.our_names)
                if ours is not None and not all(n in ours for n in names):
                    continue
                out.append(Mapping(names, theirs.format(i=i) if i is not None else theirs,
                                   layout))
        return out

    def their_name(self, fmt: str, our_name: str, n_layers: int) -> str:
        """The name of our parameter `our_name` in format `fmt` (itself if the table has none);
        for error messages."""
        for m in self.mappings(fmt, n_layers):
            if our_name in m.ours:
                return m.theirs
        return our_name

    def meta_shard_dim(self, our_name: str) -> Optional[int]:
        """Meta's model-parallel split dimension of one of our tensors (None: replicated, or a
        tensor Meta's layers do not split)."""
        generic = re.sub(r"\Alayers\.\d+\.", "layers.{i}.", our_name)
        for row in self.tensors:
            if generic in row.our_names:
                return row.meta_shard_dim
        return None
