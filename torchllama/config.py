"""Model hyperparameters: the `ModelArgs` dataclass, its per-layer specs, and named presets.

`ModelArgs` keeps Meta's field names (llama/model.py in meta-llama/llama) so that a Meta
``params.json`` maps onto it one to one. Every other architecture choice of the modern decoder
zoo is one more field with a small set of allowed values, each selecting a small module in
`torchllama.nn` (never a branch on a family name). Fields are validated in `__post_init__`: an
inconsistent or unknown value raises one `ArgumentError` naming the field and the allowed values.

Presets are looked up by exact name; an unknown name raises and lists the known ones.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from torchllama.errors import ArgumentError

NORMS = ("rmsnorm", "layernorm")
NORM_PLACEMENTS = ("pre", "post", "sandwich")
MLPS = ("swiglu", "geglu", "geglu_tanh", "relu", "gelu", "gelu_tanh")
GATED_MLPS = ("swiglu", "geglu", "geglu_tanh")
POSITIONS = ("rope", "sinusoidal", "learned", "t5", "alibi", "none")
ATTENTIONS = ("mha", "mla")
#: ModelArgs.moe_router: how a mixture of experts picks each token's experts (`torchllama.nn.moe`).
MOE_ROUTERS = ("softmax", "sigmoid")
LAYER_TYPES = ("global", "local")
#: RoPE scaling type → (required keys, optional keys) of the `rope_scaling` dict.
ROPE_SCALINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "ntk": (("factor",), ()),
    "dynamic": (("factor", "original_max_seq_len"), ()),
    "yarn": (("factor", "original_max_seq_len"),
             ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"), ()),
}


@dataclass(frozen=True)
class LayerSpec:
    """How one layer's attention differs from the others' (HF's `layer_types`, Gemma's
    local/global pattern): global layers attend to every earlier token, local ones to the last
    `window` tokens, each kind with its own RoPE base and scaling.

    Attributes:
        kind: "global" or "local".
        window: tokens a query sees, itself included (local layers), else None.
        rope_theta: RoPE base of this layer.
        rope_scaling: RoPE scaling of this layer, as a sorted tuple of (key, value) (hashable).
    """

    kind: str
    window: Optional[int]
    rope_theta: float
    rope_scaling: Optional[tuple[tuple[str, Any], ...]]

    @property
    def scaling(self) -> Optional[dict[str, Any]]:
        """rope_scaling as a dict (None: plain RoPE)."""
        return dict(self.rope_scaling) if self.rope_scaling else None


@dataclass
class ModelArgs:
    """Hyperparameters of a decoder-only transformer: Llama 2 by default, and every variant of
    the modern zoo as a field (docs/path/modern-choices.md has one line per choice with its
    source and the models that use it).

    Sizes (Meta's names):
        dim: model (residual stream) width, d_model.
        n_layers: number of blocks.
        n_heads: number of query heads.
        n_kv_heads: number of key/value heads (grouped-query attention, Ainslie et al. 2023;
            1 = multi-query attention, Shazeer 2019); None means n_heads (multi-head attention).
        head_dim: width of one attention head; None means dim // n_heads, filled in by
            `__post_init__` (Gemma 3 270M: 256 with dim 640 and 4 heads).
        vocab_size: number of token ids (rows of tok_embeddings).
        multiple_of: gated MLP hidden sizes are rounded up to a multiple of this (Meta's rule).
        ffn_dim_multiplier: optional factor on the MLP hidden size (Llama 2 70B: 1.3).
        hidden_dim: MLP hidden size stated explicitly, as GGUF (`feed_forward_length`) and HF
            (`intermediate_size`) checkpoints do; None means the rule of `mlp` (see
            `ffn_hidden_dim`).
        norm_eps: epsilon of the norms.
        max_batch_size: batch size the KV cache is allocated for.
        max_seq_len: context length: positions for which RoPE tables, learned/sinusoidal
            position embeddings and the KV cache have room.
        tie_embeddings: the output projection shares its weight with tok_embeddings.

    Normalization:
        norm: "rmsnorm" (Zhang & Sennrich 2019) or "layernorm" (Ba et al. 2016).
        norm_bias: LayerNorm with a learned bias β (GPT-2) or without (OLMo, MPT).
        norm_unit_offset: RMSNorm gain (1 + w) with w initialised to 0 (Gemma).
        norm_placement: "pre" (x + F(N(x)), GPT-2/Llama), "post" (N(x + F(x)), Vaswani et al.
            2017; no final norm) or "sandwich" (x + N'(F(N(x))), Gemma 2/3).
        qk_norm: normalize each head's queries and keys before RoPE (Dehghani et al. 2023;
            Gemma 3, OLMo 2, Qwen 3), with the norm chosen by `norm`.
        qk_norm_span: "head" (one norm per head, of hd gains: Gemma 3, Qwen3) or "projection"
            (one norm over all the heads' queries, H·hd gains, and keys, KV·hd: OLMo 2,
            OLMoE).

    Biases (Qwen2: q/k/v only; GPT-2: all):
        qkv_bias: biases on the query, key and value projections.
        out_bias: bias on the attention output projection.
        mlp_bias: biases on the MLP's projections.

    MLP and block:
        mlp: "swiglu" (Shazeer 2020; Llama), "geglu" / "geglu_tanh" (GELU-gated; Gemma uses the
            tanh GELU), "relu" (Vaswani et al. 2017), "gelu" / "gelu_tanh" (GPT-2: tanh).
        parallel_block: x + Attn(N(x)) + MLP(N(x)) with one shared norm (GPT-J, PaLM §2)
            instead of the serial attention-then-MLP block.

    Position:
        position: "rope" (Su et al. 2021), "sinusoidal" (Vaswani et al. 2017 §3.5),
            "learned" (absolute, GPT-2), "t5" (bucketed relative bias, Raffel et al. 2020),
            "alibi" (Press et al. 2022) or "none" (NoPE, Kazemnejad et al. 2023).
        rope_theta: RoPE base frequency θ (10000 in Llama 2, 100000 in SmolLM2).
        rope_scaling: None (plain RoPE) or {"type": "linear" | "ntk" | "dynamic" | "yarn" |
            "llama3", "factor": ..., ...}: the keys of each type are in `ROPE_SCALINGS`
            (`original_max_seq_len` is the context the model was trained with).
        rotary_dim: rotate only the first rotary_dim dims of each head (partial RoPE, GPT-J /
            GPT-NeoX); None means all of them.
        rope_local_theta: RoPE base of the local (sliding-window) layers, which then use no
            rope_scaling (Gemma 3: 10,000 there, 1,000,000 on global layers); None means the
            same RoPE as the global layers.
        t5_buckets, t5_max_distance: T5's relative position buckets (32 and 128 in T5).

    Attention:
        attention: "mha" (multi-head attention; grouped-query/multi-query by n_kv_heads) or
            "mla" (multi-head latent attention, DeepSeek-V2 §2.1).
        sliding_window: tokens a local layer's query sees (itself included; Mistral 4096,
            Gemma 3 512), or None.
        layer_types: "global" / "local" per layer; None means all local when sliding_window
            is set (Mistral), else all global.
        attn_scale: softmax scale; None means 1/√(q/k head width) (Vaswani et al. eq. 1);
            Gemma: query_pre_attn_scalar^-½; T5: 1.
        attn_logit_softcap: scores → c·tanh(scores/c) before the softmax (Gemma 2: 50).
        final_logit_softcap: logits → c·tanh(logits/c) (Gemma 2: 30).
        embed_scale: multiply token embeddings by √dim, rounded to the model's dtype (Gemma).
        q_lora_rank: MLA: rank of the query compression (None: a full-rank query projection).
        kv_lora_rank: MLA: width of the joint key/value latent c_kv, what the cache holds.
        qk_nope_head_dim, qk_rope_head_dim: MLA: per-head query/key widths without and with
            RoPE (the RoPE part of the key is one shared, "decoupled" head).
        v_head_dim: MLA: per-head value width.

    Mixture of experts (`torchllama.nn.moe`; 0 experts: a dense MLP in every layer):
        n_experts: routed experts per MoE layer (Mixtral 8, Qwen3-30B-A3B 128, OLMoE 64,
            DeepSeek-V3 256).
        n_experts_per_token: experts each token is sent to, k (Mixtral 2, Qwen3-MoE 8).
        moe_hidden_dim: an expert's hidden width; None means `ffn_hidden_dim`.
        n_shared_experts: experts every token goes through besides, as one MLP of
            n_shared_experts × moe_hidden_dim (DeepSeek-V2/V3: 1 and 2).
        moe_router: "softmax" (softmax over all experts, then the top k: Shazeer et al. 2017,
            Mixtral, Qwen3-MoE, OLMoE) or "sigmoid" (a sigmoid score per expert, the top k of
            score + a correction bias within the best groups: DeepSeek-V3 eq. 12-16).
        moe_norm_topk: the k weights renormalized to sum to 1 (Mixtral; Qwen3-MoE and
            DeepSeek-V3 by config; OLMoE not).
        moe_scale: the routed output is multiplied by this (DeepSeek-V3's
            routed_scaling_factor, 2.5).
        moe_groups, moe_group_topk: sigmoid router: experts split into this many groups, of
            which the best moe_group_topk (by the sum of their two best scores) are eligible.
        first_dense_layers: the first layers keep a dense MLP (DeepSeek's
            first_k_dense_replace).
        moe_aux_loss_coef: training only: α of the load-balancing loss added to the training
            loss, α·E·Σ_e f_e·P_e per MoE layer (Fedus et al. 2021, eq. 4-6; 0: none).
        moe_bias_update_speed: training only, sigmoid router: γ of DeepSeek-V3's
            auxiliary-loss-free balancing, b_e += γ·sign(mean load − load_e) after each
            optimizer step (§2.1.2; DeepSeek used 0.001; 0: the bias stays).

    Raises:
        ArgumentError: from `__post_init__`, one line naming the field, what it must be and
            what it was: a non-positive size, head counts that do not divide, an unknown value
            of a choice (listing the allowed ones), combinations that do not go together (MLA
            with grouped KV heads, ALiBi with RoPE scaling, a sliding window without local
            layers, ...).
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    vocab_size: int = 32000
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    hidden_dim: Optional[int] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_batch_size: int = 1
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    # --- the variant zoo (defaults: Llama 2) ---
    head_dim: Optional[int] = None
    norm: str = "rmsnorm"
    norm_bias: bool = False
    norm_unit_offset: bool = False
    norm_placement: str = "pre"
    qk_norm: bool = False
    qk_norm_span: str = "head"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    mlp: str = "swiglu"
    parallel_block: bool = False
    position: str = "rope"
    rotary_dim: Optional[int] = None
    rope_local_theta: Optional[float] = None
    t5_buckets: int = 32
    t5_max_distance: int = 128
    attention: str = "mha"
    sliding_window: Optional[int] = None
    layer_types: Optional[list] = None
    attn_scale: Optional[float] = None
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    embed_scale: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    n_experts: int = 0
    n_experts_per_token: int = 2
    moe_hidden_dim: Optional[int] = None
    n_shared_experts: int = 0
    moe_router: str = "softmax"
    moe_norm_topk: bool = True
    moe_scale: float = 1.0
    moe_aux_loss_coef: float = 0.0
    moe_bias_update_speed: float = 0.0
    moe_groups: int = 1
    moe_group_topk: int = 1
    first_dense_layers: int = 0

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
                     "max_batch_size", "max_seq_len", "t5_buckets", "t5_max_distance"):
            _positive_int(self, name)
        for name in ("head_dim", "hidden_dim", "rotary_dim", "sliding_window", "q_lora_rank",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) is not None:
                _positive_int(self, name)
        for name in ("norm_eps", "rope_theta", "ffn_dim_multiplier", "rope_local_theta",
                     "attn_scale", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float))
                                          and not isinstance(value, bool)
                                          and math.isfinite(value) and value > 0):
                raise ArgumentError(f"ModelArgs.{name} must be a number > 0, got {value!r}")
        for name, allowed in (("norm", NORMS), ("norm_placement", NORM_PLACEMENTS),
                              ("mlp", MLPS), ("position", POSITIONS),
                              ("attention", ATTENTIONS)):
            if getattr(self, name) not in allowed:
                raise ArgumentError(f"ModelArgs.{name} must be one of {', '.join(allowed)}; "
                                    f"got {getattr(self, name)!r}")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ArgumentError(
                    f"ModelArgs.n_heads ({self.n_heads}) must divide dim ({self.dim}), or give "
                    "head_dim")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ArgumentError(
                f"ModelArgs.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.norm_bias and self.norm != "layernorm":
            raise ArgumentError("ModelArgs.norm_bias needs norm: layernorm (RMSNorm has no "
                                f"bias); got norm {self.norm!r}")
        if self.norm_unit_offset and self.norm != "rmsnorm":
            raise ArgumentError("ModelArgs.norm_unit_offset needs norm: rmsnorm (Gemma's "
                                f"(1 + w) gain); got norm {self.norm!r}")
        if self.qk_norm_span not in ("head", "projection") or \
                (self.qk_norm_span != "head" and not self.qk_norm):
            raise ArgumentError("ModelArgs.qk_norm_span must be head or projection (with "
                                f"qk_norm: true); got {self.qk_norm_span!r}")
        if self.parallel_block and self.norm_placement != "pre":
            raise ArgumentError("ModelArgs.parallel_block needs norm_placement: pre (one norm "
                                f"feeds both branches); got {self.norm_placement!r}")
        self._check_attention()
        self._check_position()
        self._check_moe()

    def _check_moe(self) -> None:
        for name in ("n_experts", "n_shared_experts", "first_dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ArgumentError(f"ModelArgs.{name} must be an integer ≥ 0, got {value!r}")
        for name in ("moe_aux_loss_coef", "moe_bias_update_speed"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ArgumentError(f"ModelArgs.{name} must be a number ≥ 0, got {value!r}")
        if not self.n_experts:
            return
        for name in ("n_experts_per_token", "moe_groups", "moe_group_topk"):
            _positive_int(self, name)
        if self.moe_hidden_dim is not None:
            _positive_int(self, "moe_hidden_dim")
        if self.n_experts_per_token > self.n_experts:
            raise ArgumentError(f"ModelArgs.n_experts_per_token ({self.n_experts_per_token}) "
                                f"must be ≤ n_experts ({self.n_experts})")
        if self.moe_router not in MOE_ROUTERS:
            raise ArgumentError(f"ModelArgs.moe_router must be one of {', '.join(MOE_ROUTERS)}; "
                                f"got {self.moe_router!r}")
        if self.n_experts % self.moe_groups or self.moe_group_topk > self.moe_groups:
            raise ArgumentError(f"ModelArgs.moe_groups ({self.moe_groups}) must divide n_experts "
                                f"({self.n_experts}) and be ≥ moe_group_topk "
                                f"({self.moe_group_topk})")
        if not (isinstance(self.moe_scale, (int, float)) and math.isfinite(self.moe_scale)
                and self.moe_scale > 0):
            raise ArgumentError(f"ModelArgs.moe_scale must be a number > 0, got "
                                f"{self.moe_scale!r}")
        if not self.gated_mlp:
            raise ArgumentError(f"ModelArgs.n_experts needs a gated mlp (swiglu, geglu, "
                                f"geglu_tanh): experts are gated MLPs; got mlp {self.mlp!r}")

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` has a mixture of experts (else a dense MLP)."""
        return self.n_experts > 0 and layer_id >= self.first_dense_layers

    @property
    def expert_hidden_dim(self) -> int:
        """An expert's hidden width (`moe_hidden_dim`, else the dense MLP's)."""
        return self.moe_hidden_dim or self.ffn_hidden_dim

    def _check_position(self) -> None:
        rope = self.position == "rope"
        if self.rope_scaling is not None:
            if not rope:
                raise ArgumentError("ModelArgs.rope_scaling needs position: rope; got position "
                                    f"{self.position!r}")
            _check_rope_scaling(self.rope_scaling, self.max_seq_len)
        for name in ("rotary_dim", "rope_local_theta"):
            if getattr(self, name) is not None and not rope:
                raise ArgumentError(f"ModelArgs.{name} needs position: rope; got position "
                                    f"{self.position!r}")
        if rope:
            full = self.qk_rope_head_dim if self.attention == "mla" else self.head_dim
            if self.rotary_dim is not None and (self.rotary_dim > full or self.rotary_dim % 2):
                raise ArgumentError(f"ModelArgs.rotary_dim must be even and ≤ {full} (the "
                                    f"head width); got {self.rotary_dim}")
            if self.rope_dim % 2:
                raise ArgumentError(f"the RoPE width ({self.rope_dim}: head_dim"
                                    f"{' or qk_rope_head_dim' if self.attention == 'mla' else ''})"
                                    " must be even")

    def _check_attention(self) -> None:
        if self.layer_types is not None:
            if not isinstance(self.layer_types, (list, tuple)) or \
                    len(self.layer_types) != self.n_layers or \
                    any(t not in LAYER_TYPES for t in self.layer_types):
                raise ArgumentError(
                    f"ModelArgs.layer_types must be a list of {self.n_layers} (n_layers) values "
                    f"from {', '.join(LAYER_TYPES)}; got {self.layer_types!r}")
            self.layer_types = list(self.layer_types)
            if "local" in self.layer_types and self.sliding_window is None:
                raise ArgumentError("ModelArgs.layer_types has local layers but sliding_window "
                                    "is not set")
        if self.attention == "mla":
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name) is None:
                    raise ArgumentError(f"ModelArgs.{name} is required with attention: mla")
            if self.n_kv_heads != self.n_heads:
                raise ArgumentError(
                    "ModelArgs.n_kv_heads must equal n_heads with attention: mla (the latent "
                    "c_kv replaces grouped key/value heads); got n_kv_heads "
                    f"{self.n_kv_heads}, n_heads {self.n_heads}")
            if self.position != "rope":
                raise ArgumentError("ModelArgs.attention: mla needs position: rope (its "
                                    f"decoupled RoPE key); got position {self.position!r}")
            for name in ("qk_norm", "qkv_bias"):
                if getattr(self, name):
                    raise ArgumentError(f"ModelArgs.{name} does not apply to attention: mla")
        else:
            for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                         "v_head_dim"):
                if getattr(self, name) is not None:
                    raise ArgumentError(f"ModelArgs.{name} needs attention: mla; got attention "
                                        f"{self.attention!r}")

    # ---- derived sizes ---------------------------------------------------------------------

    @property
    def head_size(self) -> int:
        """Width of one attention head's queries and keys (MLA: nope + rope parts)."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def rope_dim(self) -> int:
        """Number of rotated dims per head (rotary_dim, else the whole RoPE part of a head)."""
        if self.rotary_dim is not None:
            return self.rotary_dim
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def gated_mlp(self) -> bool:
        return self.mlp in GATED_MLPS

    # --8<-- [start:ffn-hidden]
    @property
    def ffn_hidden_dim(self) -> int:
        """MLP hidden size.

        `hidden_dim` when given. Otherwise 4·dim (Vaswani et al. 2017; GPT-2), and for gated
        MLPs Meta's rule (llama/model.py, FeedForward.__init__): hidden = int(2·4·dim/3), so
        that three matrices cost what a 4·dim two-matrix MLP costs (Shazeer 2020). Then
        hidden = int(ffn_dim_multiplier·hidden) if given, rounded up to a multiple of
        multiple_of.
        """
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = 4 * self.dim
        if self.gated_mlp:
            hidden = int(2 * hidden / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)
    # --8<-- [end:ffn-hidden]

    def layer_specs(self) -> list[LayerSpec]:
        """One `LayerSpec` per layer: global or local attention, window, RoPE base and scaling
        (`layer_types`, `sliding_window`, `rope_local_theta`)."""
        types = self.layer_types or (["local" if self.sliding_window else "global"]
                                     * self.n_layers)
        scaling = tuple(sorted(self.rope_scaling.items())) if self.rope_scaling else None
        global_spec = LayerSpec("global", None, self.rope_theta, scaling)
        if self.rope_local_theta is not None:
            local_spec = LayerSpec("local", self.sliding_window, self.rope_local_theta, None)
        else:
            local_spec = LayerSpec("local", self.sliding_window, self.rope_theta, scaling)
        return [global_spec if t == "global" else local_spec for t in types]

    def replace(self, **changes) -> "ModelArgs":
        """A copy with some fields changed (validated again). Fields that `__post_init__` fills
        in from others (n_kv_heads, head_dim) keep their values unless changed too."""
        return dataclasses.replace(self, **changes)

    def variant_fields(self) -> dict[str, Any]:
        """The zoo fields whose values differ from Llama 2's choices (their defaults; head_dim
        counts only when it is not dim // n_heads)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        out = {}
        for name in ZOO_FIELDS:
            value = getattr(self, name)
            if name == "head_dim":
                if value != self.dim // self.n_heads:
                    out[name] = value
            elif value != defaults[name]:
                out[name] = value
        return out


#: The fields of the variant zoo (after Meta's). A model whose zoo fields are all at their
#: defaults is a Llama. (The experts' balancing settings are training's, not the model's.)
ZOO_FIELDS = tuple(f.name for f in dataclasses.fields(ModelArgs)
                   if f.name not in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                     "multiple_of", "ffn_dim_multiplier", "hidden_dim",
                                     "norm_eps", "rope_theta", "max_batch_size", "max_seq_len",
                                     "tie_embeddings", "moe_aux_loss_coef",
                                     "moe_bias_update_speed"))


def _positive_int(args: ModelArgs, name: str) -> None:
    value = getattr(args, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ArgumentError(f"ModelArgs.{name} must be a positive integer, got {value!r}")


def _check_rope_scaling(scaling: Any, max_seq_len: int) -> None:
    """Raises ArgumentError unless `scaling` is a valid rope_scaling dict (see ROPE_SCALINGS)."""
    kinds = ", ".join(ROPE_SCALINGS)
    if not isinstance(scaling, dict) or scaling.get("type") not in ROPE_SCALINGS:
        kind = scaling.get("type") if isinstance(scaling, dict) else scaling
        raise ArgumentError(f"ModelArgs.rope_scaling must be a mapping with type one of {kinds}; "
                            f"got {kind!r}")
    required, optional = ROPE_SCALINGS[scaling["type"]]
    for key in required:
        if key not in scaling:
            raise ArgumentError(f"ModelArgs.rope_scaling of type {scaling['type']!r} needs "
                                f"{', '.join(required)}; {key!r} is missing")
    unknown = sorted(set(scaling) - set(required) - set(optional) - {"type"})
    if unknown:
        raise ArgumentError(f"ModelArgs.rope_scaling of type {scaling['type']!r} takes "
                            f"{', '.join(required + optional)}; got unknown {', '.join(unknown)}")
    for key, value in scaling.items():
        if key != "type" and value is not None and not (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and value > 0):
            raise ArgumentError(f"ModelArgs.rope_scaling.{key} must be a number > 0, got "
                                f"{value!r}")
    if scaling["factor"] < 1:
        raise ArgumentError(f"ModelArgs.rope_scaling.factor must be ≥ 1, got {scaling['factor']}")


def _every_nth_global(n_layers: int, n: int) -> list[str]:
    """Gemma's layer pattern: layer i is global when (i + 1) % n == 0, local otherwise."""
    return ["global" if (i + 1) % n == 0 else "local" for i in range(n_layers)]


# Named presets. Sources: Meta's params.json of each Llama 2 release; TinyLlama-1.1B and
# SmolLM2 config.json (their hidden sizes follow Meta's rule, so only dims are given); the
# config.json of each other family's published checkpoint.
PRESETS: dict[str, ModelArgs] = {
    "llama2-7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, max_seq_len=4096),
    "llama2-13b": ModelArgs(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, max_seq_len=4096),
    "llama2-70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                            multiple_of=4096, ffn_dim_multiplier=1.3, max_seq_len=4096),
    "tinyllama-1.1b": ModelArgs(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000,
                                max_seq_len=2048),
    "smollm2-135m": ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152,
                              rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True),
    "smollm2-360m": ModelArgs(dim=960, n_layers=32, n_heads=15, n_kv_heads=5, vocab_size=49152,
                              rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True),
    # Llama 3.1 8B (Meta's params.json: use_scaled_rope with the llama3 rule, factor 8).
    "llama3.1-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                             hidden_dim=14336, rope_theta=500000.0, max_seq_len=131072,
                             rope_scaling={"type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_seq_len": 8192}),
    # Mistral 7B v0.1: grouped-query attention and a 4096-token sliding window on every layer.
    "mistral-7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                            hidden_dim=14336, max_seq_len=32768, sliding_window=4096,
                            norm_eps=1e-5),
    # Qwen2 0.5B: biases on q/k/v only, tied embeddings.
    "qwen2-0.5b": ModelArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, vocab_size=151936,
                            hidden_dim=4864, rope_theta=1000000.0, norm_eps=1e-6,
                            max_seq_len=32768, tie_embeddings=True, qkv_bias=True),
    # GPT-2 small (124M): LayerNorm with bias, learned positions, GELU (tanh), biases everywhere.
    "gpt2-124m": ModelArgs(dim=768, n_layers=12, n_heads=12, vocab_size=50257, max_seq_len=1024,
                           norm="layernorm", norm_bias=True, norm_eps=1e-5, mlp="gelu_tanh",
                           position="learned", qkv_bias=True, out_bias=True, mlp_bias=True,
                           tie_embeddings=True),
    # Gemma 2 2B: sandwich norms, (1 + w) RMSNorm, GeGLU (tanh), soft-capping, √dim embedding
    # scale, alternating local (4096) / global layers, query_pre_attn_scalar 256.
    "gemma2-2b": ModelArgs(dim=2304, n_layers=26, n_heads=8, n_kv_heads=4, head_dim=256,
                           vocab_size=256000, hidden_dim=9216, norm_eps=1e-6, max_seq_len=8192,
                           tie_embeddings=True, norm_unit_offset=True, norm_placement="sandwich",
                           mlp="geglu_tanh", embed_scale=True, attn_scale=256 ** -0.5,
                           attn_logit_softcap=50.0, final_logit_softcap=30.0,
                           sliding_window=4096,
                           layer_types=["local" if i % 2 == 0 else "global" for i in range(26)]),
    # Gemma 3 270M: Gemma 2's block with QK-norm instead of soft-capping, 5 local (512) : 1
    # global layers, RoPE base 10,000 on local and 1,000,000 on global layers.
    "gemma3-270m": ModelArgs(dim=640, n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256,
                             vocab_size=262144, hidden_dim=2048, norm_eps=1e-6,
                             max_seq_len=32768, tie_embeddings=True, norm_unit_offset=True,
                             norm_placement="sandwich", qk_norm=True, mlp="geglu_tanh",
                             embed_scale=True, attn_scale=256 ** -0.5, rope_theta=1000000.0,
                             rope_local_theta=10000.0, sliding_window=512,
                             layer_types=_every_nth_global(18, 6)),
    # DeepSeek-V2-Lite: MLA without query compression (kv_lora_rank 512, 128 + 64 query/key
    # dims, 128 value dims, 16 heads, YaRN ×40 from 4096, mscale 0.707); 27 layers, the first
    # with a dense FFN (10944), the others 64 routed experts of 1408 (6 per token: softmax,
    # not renormalized, × 1.0) and 2 shared. 15.7B parameters, 2.4B active (its model card).
    "deepseek-v2-lite": ModelArgs(dim=2048, n_layers=27, n_heads=16, vocab_size=102400,
                                  hidden_dim=10944, norm_eps=1e-6, max_seq_len=163840,
                                  attention="mla", kv_lora_rank=512, qk_nope_head_dim=128,
                                  qk_rope_head_dim=64, v_head_dim=128,
                                  rope_scaling={"type": "yarn", "factor": 40.0,
                                                "original_max_seq_len": 4096,
                                                "beta_fast": 32.0, "beta_slow": 1.0,
                                                "mscale": 0.707, "mscale_all_dim": 0.707},
                                  n_experts=64, n_experts_per_token=6, moe_hidden_dim=1408,
                                  n_shared_experts=2, moe_norm_topk=False,
                                  first_dense_layers=1),
    # DeepSeek-V3 (without its multi-token-prediction module): MLA (q_lora_rank 1536,
    # kv_lora_rank 512, 128 + 64 query/key dims, 128 value dims, 128 heads, YaRN ×40 from 4096);
    # 61 layers, the first 3 with a dense FFN (18432), the others 256 routed experts of 2048
    # (8 per token: sigmoid scores, 4 of 8 groups, weights renormalized × 2.5) and 1 shared.
    "deepseek-v3": ModelArgs(dim=7168, n_layers=61, n_heads=128, vocab_size=129280,
                             hidden_dim=18432, norm_eps=1e-6, max_seq_len=163840,
                             attention="mla", q_lora_rank=1536, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             rope_scaling={"type": "yarn", "factor": 40.0,
                                           "original_max_seq_len": 4096, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "mscale": 1.0,
                                           "mscale_all_dim": 1.0},
                             n_experts=256, n_experts_per_token=8, moe_hidden_dim=2048,
                             n_shared_experts=1, moe_router="sigmoid", moe_groups=8,
                             moe_group_topk=4, moe_scale=2.5, first_dense_layers=3),
    # Mixtral 8x7B: Mistral 7B's attention (no sliding window in v0.1's config), 8 experts of
    # 14336 in every layer, 2 per token (softmax, renormalized).
    "mixtral-8x7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                              hidden_dim=14336, rope_theta=1000000.0, max_seq_len=32768,
                              norm_eps=1e-5, n_experts=8, n_experts_per_token=2),
    # Qwen3 0.6B: QK-norm, 128-wide heads (16 query, 8 key/value), tied embeddings.
    "qwen3-0.6b": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                            vocab_size=151936, hidden_dim=3072, rope_theta=1000000.0,
                            norm_eps=1e-6, max_seq_len=40960, tie_embeddings=True,
                            qk_norm=True),
    # OLMoE-1B-7B (0924): 64 experts of 1024, 8 per token (softmax weights kept as they are),
    # QK-norm over the whole q and k projections.
    "olmoe-1b-7b": ModelArgs(dim=2048, n_layers=16, n_heads=16, vocab_size=50304,
                             hidden_dim=1024, max_seq_len=4096, qk_norm=True,
                             qk_norm_span="projection", n_experts=64, n_experts_per_token=8,
                             moe_norm_topk=False),
    # Qwen3-30B-A3B: 48 layers of 128 experts of 768, 8 per token (renormalized), QK-norm.
    "qwen3-30b-a3b": ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                               vocab_size=151936, hidden_dim=6144, rope_theta=1000000.0,
                               norm_eps=1e-6, max_seq_len=40960, qk_norm=True, n_experts=128,
                               n_experts_per_token=8, moe_hidden_dim=768),
    # Small models to train from scratch on a laptop CPU (`make train-demo`), ~ a few million
    # parameters, for a SentencePiece vocabulary of 4096 tokens (`torchllama train-tokenizer`).
    "shakespeare-small": ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=4096,
                                   multiple_of=32, max_seq_len=256, tie_embeddings=True),
    # A tiny model for tests and for reading the code in a debugger.
    "debug": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                       multiple_of=16, max_seq_len=128),
}


def read_model_config(path: str | os.PathLike) -> dict[str, Any]:
    """ModelArgs fields from a YAML (.yaml/.yml) or JSON file (`train --config`, `kv-cache
    --config`), each checked against the field's type; values are validated by ModelArgs.

    Raises:
        ArgumentError: unreadable file, not a mapping, unknown fields, a value of the wrong
            type (naming the file and the field).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ArgumentError(f"--config: cannot read {path}: {e.strerror or e}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml
            fields = yaml.safe_load(text)
        else:
            fields = json.loads(text)
    except Exception as e:  # noqa: BLE001 - yaml and json errors: report the parser's words
        kind = "YAML" if path.suffix in (".yaml", ".yml") else "JSON"
        raise ArgumentError(f"--config {path}: not valid {kind}: {' '.join(str(e).split())}"
                            ) from None
    if not isinstance(fields, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of ModelArgs fields")
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ArgumentError(f"--config {path}: unknown field(s) {', '.join(unknown)}; ModelArgs "
                            f"fields are {', '.join(sorted(known))}")
    hints = typing.get_type_hints(ModelArgs)
    for name, value in fields.items():
        kinds = [k for k in (typing.get_args(hints[name]) or (hints[name],)) if k is not type(None)]
        kind = typing.get_origin(kinds[0]) or kinds[0]
        if value is None and type(None) in typing.get_args(hints[name]):
            continue
        if kind is float and isinstance(value, str):       # YAML 1.1 reads 1e-5 as a string
            try:
                value = fields[name] = float(value)
            except ValueError:
                pass
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
              else isinstance(value, int) and not isinstance(value, bool) if kind is int
              else isinstance(value, kind))
        if not ok:
            raise ArgumentError(f"--config {path}: field {name} is {value!r}, expected "
                                f"{'a number' if kind is float else kind.__name__}")
    return fields


def get_preset(name: str) -> ModelArgs:
    """The `ModelArgs` of a named preset (a fresh copy).

    Raises:
        ArgumentError: unknown name; the message lists the known presets.
    """
    if name not in PRESETS:
        raise ArgumentError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name])
