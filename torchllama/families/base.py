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

from torchllama.errors import MISSING, checked_field

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
    ModelArgs field with this matrix's head count ("n_heads" or "n_kv_heads"), or is 1 for a
    per-head vector (QK-norm gains: the same order within one head)."""

    heads: str | int

    def _n(self, args) -> int:
        return self.heads if isinstance(self.heads, int) else getattr(args, self.heads)

    def load(self, t, args):
        return (permute_hf_to_meta(t, self._n(args)),)

    def save(self, ts, args):
        return permute_meta_to_hf(ts[0], self._n(args))


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


def _expert_mappings(ours_name: str, theirs: str, layout: Layout,
                     ours: Optional[set[str]]) -> list[Mapping]:
    """A row of a mixture of experts' weights, "{e}" the expert index: one mapping per expert
    when the format names each expert's tensor (HF), else one mapping of every expert's
    tensor to one stored tensor (GGUF's 3-D `ffn_*_exps`, with a `Stacked` layout). The
    experts are those of `ours` (none without it)."""
    names = []
    while ours is not None and ours_name.replace("{e}", str(len(names))) in ours:
        names.append(ours_name.replace("{e}", str(len(names))))
    if not names:
        return []
    if "{e}" in theirs:
        return [Mapping((n,), theirs.replace("{e}", str(e)), layout)
                for e, n in enumerate(names)]
    return [Mapping(tuple(names), theirs, layout)]


class Stacked(Layout):
    """Experts' 2-D tensors stored as one 3-D tensor, expert first (llama.cpp's
    `ffn_{gate,up,down}_exps`)."""

    def stored_shape(self, shapes: tuple[torch.Size, ...]) -> torch.Size:
        return torch.Size((len(shapes), *shapes[0]))

    def load(self, t: torch.Tensor, args: "ModelArgs") -> tuple[torch.Tensor, ...]:
        return tuple(t.unbind(0))

    def save(self, ts: tuple[torch.Tensor, ...], args: "ModelArgs") -> torch.Tensor:
        return torch.stack(ts)


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
        unsupported: (ModelArgs, format "hf" | "gguf") → why this family's files of that format
            cannot hold such a model, or None.
        hf_ignored: HF keys that hold no weights (buffers some checkpoints carry), skipped.
        chat_template: the family's chat format as a Jinja template, given to a tokenizer whose
            checkpoint carries none (Gemma's GGUF files); None: no built-in format.
        gguf_ignored: GGUF tensors that hold no weights of ours (llama's `rope_freqs`, which
            `args_from_gguf` reads as a hyperparameter), skipped by the weight loader.
        hf_extra_layers_ignored: HF tensors of layers past the config's layer count
            (`model.layers.{i}.*`, i ≥ n_layers: DeepSeek-V3's multi-token-prediction module)
            are skipped rather than refused.
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
    unsupported: Callable[["ModelArgs", str], Optional[str]] = field(
        default=lambda args, fmt: None)
    hf_ignored: Optional[re.Pattern] = None
    chat_template: Optional[str] = None
    gguf_ignored: Optional[re.Pattern] = None
    hf_extra_layers_ignored: bool = False

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
                at = (lambda n: n.replace("{i}", str(i))) if i is not None else (lambda n: n)
                names = tuple(at(n) for n in row.our_names)
                if "{e}" in names[0]:
                    out += _expert_mappings(names[0], at(theirs), layout, ours)
                    continue
                if ours is not None and not all(n in ours for n in names):
                    continue
                out.append(Mapping(names, at(theirs), layout))
        return out

    def their_name(self, fmt: str, our_name: str, n_layers: int) -> str:
        """The name of our parameter `our_name` in format `fmt` (itself if the table has none);
        for error messages. An expert's (`layers.{i}.feed_forward.experts.{e}.*`): its own
        tensor or its layer's stacked one (GGUF's `ffn_*_exps`)."""
        expert = re.search(r"\.experts\.(\d+)\.", our_name)
        ours = None if expert is None else {   # experts 0..e, which `_expert_mappings` lists
            our_name.replace(expert.group(0), f".experts.{e}.")
            for e in range(int(expert.group(1)) + 1)}
        for m in self.mappings(fmt, n_layers, ours):
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


@dataclass(frozen=True)
class Transposed(Layout):
    """Stored as the transpose (GPT-2's Conv1D keeps (in, out) weights)."""

    def stored_shape(self, shapes):
        return torch.Size(reversed(shapes[0]))

    def load(self, t, args):
        return (t.t(),)

    def save(self, ts, args):
        return ts[0].t()


class Part(Layout):
    """One of several stored tensors that together hold one of our tensors (llama.cpp stores
    DeepSeek's wkv_b as attn_k_b and attn_v_b). `load` gives this part in our layout, `join`
    puts all parts of one tensor (in table order) back together, `save` cuts this part out of
    ours, `part_shape` gives this part's stored shape. Loaders collect the parts of a tensor
    before joining them; a tensor several table rows hold (a part and a legacy whole) is
    written once, under its first rows."""

    def part_shape(self, shape: torch.Size, args: "ModelArgs") -> torch.Size:
        raise NotImplementedError

    def join(self, parts: list[torch.Tensor], args: "ModelArgs") -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class Fused(Layout):
    """Several of our tensors stored concatenated along `dim` (a fused qkv projection), each
    `sizes` rows/columns wide (a callable of ModelArgs giving the sizes); `transposed` when the
    stored matrix is (in, out) (GPT-2's Conv1D)."""

    sizes: Callable[["ModelArgs"], tuple[int, ...]]
    dim: int = 0
    transposed: bool = False

    def stored_shape(self, shapes):
        if len(shapes[0]) == 1:
            return torch.Size([sum(s[0] for s in shapes)])
        out = list(shapes[0])
        out[self.dim] = sum(s[self.dim] for s in shapes)
        return torch.Size(reversed(out)) if self.transposed else torch.Size(out)

    def load(self, t, args):
        if self.transposed and t.ndim == 2:
            t = t.t()
        return tuple(x.contiguous() for x in t.split(self.sizes(args), dim=self.dim))

    def save(self, ts, args):
        t = torch.cat(ts, dim=self.dim)
        return t.t() if self.transposed and t.ndim == 2 else t


# ---- Hugging Face config helpers -----------------------------------------------------------------

def hf_key(config: dict[str, Any], key: str, typ: type, source: str, default: Any = MISSING) -> Any:
    """config[key] checked to be of `typ` (null counts as absent); see `checked_field`."""
    return checked_field(config, key, typ, source, default, what="key")


def hf_rope(params: Optional[dict[str, Any]], theta: Optional[float], max_positions: int,
            source: str, where: str = "rope_parameters") -> tuple[float, Optional[dict], int]:
    """(rope_theta, ModelArgs.rope_scaling, max_seq_len) from a transformers rope dict
    (`rope_parameters` in transformers 5, `rope_scaling` in 4: rope_type default, linear,
    dynamic, yarn or llama3) and the config's max_position_embeddings.

    Dynamic NTK stretches the trained context (max_position_embeddings) by its factor, so the
    model gets max_seq_len = factor · max_position_embeddings.

    Raises:
        ModelFileError: another rope_type, a malformed dict or a missing key (named).
    """
    from torchllama.errors import ModelFileError

    if params is None:
        return (10000.0 if theta is None else theta), None, max_positions
    if not isinstance(params, dict):
        raise ModelFileError(f"{source}: {where!r} is {params!r}, expected an object or null")
    kind = params.get("rope_type", params.get("type", "default"))
    if "rope_theta" in params:
        theta = hf_key(params, "rope_theta", float, f"{source}: {where}")
    theta = 10000.0 if theta is None else theta
    here = f"{source}: {where}"
    if kind == "default":
        return theta, None, max_positions
    if kind not in ("linear", "dynamic", "yarn", "llama3"):
        raise ModelFileError(f"{source}: {where} of type {kind!r} is not supported (supported: "
                             "default, linear, dynamic, yarn, llama3)")
    factor = hf_key(params, "factor", float, here)
    scaling: dict[str, Any] = {"type": kind, "factor": factor}
    if kind == "dynamic":
        scaling["original_max_seq_len"] = max_positions
        return theta, scaling, int(max_positions * factor)
    if kind in ("yarn", "llama3"):
        scaling["original_max_seq_len"] = hf_key(params, "original_max_position_embeddings",
                                                 int, here, max_positions)
    if kind == "llama3":
        scaling["low_freq_factor"] = hf_key(params, "low_freq_factor", float, here)
        scaling["high_freq_factor"] = hf_key(params, "high_freq_factor", float, here)
    if kind == "yarn":
        if params.get("truncate", True) is not True:
            raise ModelFileError(f"{here}: truncate false (YaRN without rounding the correction "
                                 "range) is not supported")
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            value = hf_key(params, key, float, here, None)
            if value is not None:
                scaling[key] = value
    return theta, scaling, max_positions


def hf_rope_parameters(args: "ModelArgs", scaling: Optional[dict[str, Any]] = None,
                       theta: Optional[float] = None) -> dict[str, Any]:
    """The transformers 5 `rope_parameters` dict of a RoPE base and ModelArgs.rope_scaling (the
    inverse of `hf_rope`)."""
    scaling = args.rope_scaling if scaling is None else scaling
    out: dict[str, Any] = {"rope_type": "default",
                           "rope_theta": args.rope_theta if theta is None else theta}
    if scaling:
        out["rope_type"] = scaling["type"]
        for key, value in scaling.items():
            if key == "original_max_seq_len":
                if scaling["type"] != "dynamic":
                    out["original_max_position_embeddings"] = value
            elif key != "type":
                out[key] = value
    return out


def hf_max_positions(args: "ModelArgs") -> int:
    """max_position_embeddings for config.json (dynamic NTK: the trained context)."""
    if args.rope_scaling and args.rope_scaling["type"] == "dynamic":
        return args.rope_scaling["original_max_seq_len"]
    return args.max_seq_len


def unsupported_fields(args: "ModelArgs", allowed: dict[str, Callable[["ModelArgs"], bool]]
                       ) -> Optional[str]:
    """Why a family cannot hold `args`: the first zoo field that differs from Llama 2's choice
    (`ModelArgs.variant_fields`) and is not in `allowed`, or whose value its predicate refuses;
    None if every difference is allowed."""
    for name, value in args.variant_fields().items():
        ok = allowed.get(name)
        if ok is None or not ok(args):
            return f"{name}={value!r}"
    return None


def gguf_sizes(writer, args: "ModelArgs") -> None:
    """Write the `{arch}.*` size keys every llama.cpp architecture reads the same way: context
    length, width, block count, feed-forward width, query and key/value head counts."""
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_hidden_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
