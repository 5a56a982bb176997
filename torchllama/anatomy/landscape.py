"""The loss-landscape section of the report: validation loss around the trained weights along
filter-normalized random directions (Li, Xu, Taylor, Studer & Goldstein 2018, "Visualizing the
Loss Landscape of Neural Nets", NeurIPS, §4).

    d  ~ N(0, I), one entry per weight                     a random direction
    d_{i,j} ← d_{i,j} / ‖d_{i,j}‖ · ‖θ_{i,j}‖              filter normalization (Li et al. §4):
                                                           j-th filter (output unit: a row of
                                                           a weight matrix) of parameter i
    d_i = 0 for 1-D parameters                             norm gains and biases (the paper does
                                                           this for BatchNorm parameters)

    1-D:  L(α)    = L(θ + α·d₁),           α ∈ [−1, 1]       a curve (default 21 points)
    2-D:  L(α, β) = L(θ + α·d₁ + β·d₂),    α, β ∈ [−1, 1]    a contour plot (default 11 × 11)

where L is the mean next-token cross-entropy (nats/token) of a fixed set of validation windows
of the run's val.bin (the same windows at every point, `torchllama.train.data.eval_windows`).
The 1-D curve is the β = 0 slice of the 2-D surface (d₁ is shared), so grid points on that
slice are not evaluated twice. Tied embeddings move once: one shared tensor, or the two equal
copies a `torchllama train` checkpoint loads as, given the same direction.

Cost: one forward pass over the validation windows per point. The `make train-demo` model
(shakespeare-small: 5.5 M parameters, seq-len 256) takes ≈ 0.31 s for 8 × 256 tokens on 2 idle
CPU cores, so the defaults (21 + 11·11 − 11 + 2 = 133 points: the curve, the grid less its
β = 0 row, α = ±0.25) take ≈ 45 s; far longer when other processes share the cores.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from torchllama.anatomy.report import AnatomyContext, Figure, Prose, Section
from torchllama.errors import ArgumentError, ModelFileError

#: default number of points of the 1-D curve over α ∈ [−1, 1] (odd: α = 0 is one of them)
DEFAULT_POINTS = 21
#: default side of the 2-D grid over (α, β) ∈ [−1, 1]²
DEFAULT_GRID = 11
#: default number of validation windows (sequences of the run's seq-len) per evaluation
DEFAULT_BATCHES = 8
#: windows per forward pass
EVAL_ROWS = 8
#: the step at which sharpness is measured: L(θ ± 0.25·d₁) − L(θ)
SHARPNESS_ALPHA = 0.25
#: a curve point lower than the trained point by less than this (nats) does not count as a dip
DIP_TOLERANCE = 1e-3

NEEDS_RUN = "the loss landscape needs a training run: --model RUN (a `torchllama train` folder)"


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# --------------------------------------------------------------------------------------------
# Directions
# --------------------------------------------------------------------------------------------

def filter_normalized_direction(params: dict[str, torch.Tensor],
                                generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A random Gaussian direction, filter-normalized to the weights (Li et al. 2018, §4).

    For each parameter θ_i with ≥ 2 dimensions, each filter j (θ_i[j], a row of a weight
    matrix: one output unit; the rest of the dimensions flattened) gets
    d_{i,j} = g_{i,j} / ‖g_{i,j}‖ · ‖θ_{i,j}‖ with g ~ N(0, I), so ‖d_{i,j}‖ = ‖θ_{i,j}‖
    (Frobenius norms). 1-D parameters (norm gains, biases) get a zero direction.

    Args:
        params: name → parameter (any shape, floating dtype); each tensor once (tied weights
            under one name, as `Module.named_parameters()` gives them).
        generator: a CPU torch.Generator; the draws follow the order of `params`.

    Returns:
        name → direction tensor of the parameter's shape, dtype and device.
    """
    direction = {}
    for name, p in params.items():
        theta = p.detach()
        if theta.ndim < 2:
            direction[name] = torch.zeros_like(theta)
            continue
        g = torch.randn(theta.shape, generator=generator, dtype=torch.float32)
        g = g.to(device=theta.device, dtype=theta.dtype).flatten(1)          # (n_filters, k)
        rows = theta.flatten(1)                                              # (n_filters, k)
        scale = rows.norm(dim=1, keepdim=True) / g.norm(dim=1, keepdim=True).clamp_min(1e-12)
        direction[name] = (g * scale).reshape(theta.shape)                   # ‖d_j‖ = ‖θ_j‖
    return direction


def tied_copy(model: torch.nn.Module) -> bool:
    """Whether the model holds the output projection as a separate tensor equal, bit for bit,
    to the token embeddings: a tied model loaded from a checkpoint that stores both (a
    `torchllama train` checkpoint's params.json does not record tie_embeddings)."""
    params = dict(model.named_parameters())
    emb, out = params.get("tok_embeddings.weight"), params.get("output.weight")
    return (emb is not None and out is not None and emb.shape == out.shape
            and torch.equal(emb, out))


def landscape_directions(model: torch.nn.Module, seed: int
                         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The section's two directions (d₁, d₂) for `model` and `seed` (d₁ drawn first from a
    generator seeded with `seed`, then d₂), keyed like `model.named_parameters()`.

    Tied embeddings move once: a shared tensor appears once in named_parameters; an output
    projection that is a bit-exact copy of the embeddings (`tied_copy`) gets the embeddings'
    direction (the same tensor), so both copies stay equal at every point.
    """
    params = dict(model.named_parameters())            # shared (tied) tensors appear once
    alias = {"output.weight": "tok_embeddings.weight"} if tied_copy(model) else {}
    drawn = {name: p for name, p in params.items() if name not in alias}
    generator = torch.Generator().manual_seed(seed)
    d1 = filter_normalized_direction(drawn, generator)
    d2 = filter_normalized_direction(drawn, generator)
    for name, source in alias.items():
        d1[name], d2[name] = d1[source], d2[source]
    return d1, d2


@contextlib.contextmanager
def perturbed(model: torch.nn.Module, directions: list[dict[str, torch.Tensor]]):
    """Yield set(coefficients): setting the weights to θ + Σ_k c_k·d_k in place (θ the weights
    on entry). The weights are restored bit-exactly on exit, also after an error.

    Each new point is computed from the saved θ (not from the previous point), so a point's
    weights depend only on its coefficients.
    """
    params = dict(model.named_parameters())
    saved = {name: p.detach().clone() for name, p in params.items()}          # θ

    @torch.no_grad()
    def set_point(coefficients: tuple[float, ...]) -> None:
        for name, p in params.items():
            w = saved[name].clone()
            for c, d in zip(coefficients, directions):
                w.add_(d[name], alpha=c)                                      # θ + Σ c_k·d_k
            p.copy_(w)

    try:
        yield set_point
    finally:
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(saved[name])


# --------------------------------------------------------------------------------------------
# Validation data of the run
# --------------------------------------------------------------------------------------------

def run_info(run_dir: Path) -> dict:
    """The run's run.json (written by `torchllama train`), or {} if missing or unreadable."""
    try:
        info = json.loads((Path(run_dir) / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def validation_windows(run_dir: Path, n_windows: int, vocab_size: int, max_seq_len: int,
                       data: Optional[str | Path] = None) -> tuple[torch.Tensor, dict]:
    """Fixed validation windows of the run's dataset: `n_windows` windows of the run's
    seq-len spread evenly over val.bin (`eval_windows`).

    Args:
        run_dir: the `torchllama train` run folder (its run.json names the data folder and
            seq-len).
        n_windows: how many windows.
        vocab_size: the model's vocabulary size (the dataset's must not exceed it).
        max_seq_len: the model's context (the seq-len when run.json gives none).
        data: a dataset folder to use instead of the one the run recorded.

    Returns:
        (n, T + 1) int64 windows (n ≤ n_windows when val.bin is short) and a dict with
        "data" (the folder), "seq_len" and "unigram_val_loss" (from run.json, or None).

    Raises:
        ArgumentError: no data folder recorded or given, a missing folder (naming it and the
            `landscape_data` option), a dataset of another vocabulary, a val.bin shorter than
            one window.
        ModelFileError: a damaged dataset (meta.json unreadable, val.bin checksum differs).
    """
    from torchllama.train.data import eval_windows, load_tokens, read_meta, sha256_file

    info = run_info(run_dir)
    folder = data if data is not None else info.get("data")
    if folder is None:
        raise ArgumentError(f"{run_dir}: the run records no data folder (no run.json); give "
                            f"one with the landscape_data option")
    folder = Path(folder)
    source = "landscape_data" if data is not None else f"{run_dir / 'run.json'}"
    if not (folder / "meta.json").is_file():
        raise ArgumentError(f"the data folder {folder} (from {source}) is missing or not a "
                            f"dataset; give the run's dataset with the landscape_data option")
    meta = read_meta(folder)
    val_path = folder / meta["splits"]["val"]["file"]
    if not val_path.is_file():
        raise ArgumentError(f"{val_path} (from {source}) is missing; give the run's dataset "
                            f"with the landscape_data option")
    if sha256_file(val_path) != meta["splits"]["val"]["sha256"]:
        raise ModelFileError(f"{val_path}: checksum differs from meta.json: the dataset is "
                             f"damaged")
    if meta["tokenizer"]["vocab_size"] > vocab_size:
        raise ArgumentError(f"landscape data {folder}: its tokenizer has "
                            f"{meta['tokenizer']['vocab_size']} tokens, the model {vocab_size}; "
                            f"give the run's dataset with the landscape_data option")
    seq_len = int(info.get("seq_len") or max_seq_len)
    tokens = load_tokens(folder, "val", meta)                                # (N,) memmap
    windows = eval_windows(tokens, seq_len, n_windows)                       # (n, T + 1)
    if len(windows) == 0:
        raise ArgumentError(f"{folder}: val.bin has {len(tokens)} tokens, fewer than one "
                            f"window of {seq_len + 1}; give another dataset with landscape_data")
    return windows, {"data": str(folder), "seq_len": seq_len,
                     "unigram_val_loss": info.get("unigram_val_loss")}


@torch.no_grad()
def validation_loss(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats/token) of windows[:, 1:] given windows[:, :-1],
    weighted by tokens over forward passes of EVAL_ROWS windows (the training loop's
    `evaluate`, without autocast). windows: (n, T + 1) int64."""
    from torchllama.train.loop import evaluate

    device = next(model.parameters()).device
    return evaluate(model, windows, EVAL_ROWS, contextlib.nullcontext, device)


# --------------------------------------------------------------------------------------------
# The section
# --------------------------------------------------------------------------------------------

def axis(n: int) -> list[float]:
    """n evenly spaced values over [−1, 1]: (i − m) / m, m = (n − 1)/2, each a correctly
    rounded quotient, so the same value in any axis where it occurs (0 exactly for odd n)."""
    m = (n - 1) / 2
    return [(i - m) / m for i in range(n)]


def _int_option(options: dict, key: str, default: int, low: int) -> int:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ArgumentError(f"{key} must be an integer ≥ {low}, got {value!r}")
    return value


@dataclass
class LossLandscape:
    """Validation loss around the trained weights θ along filter-normalized directions d₁, d₂
    (`landscape_directions(model, seed)`); losses in nats/token.

    Attributes:
        alphas: (P,) α of the 1-D curve, evenly over [−1, 1] (`axis`).
        losses: (P,) L(θ + α·d₁).
        trained: L(θ).
        sharp: (L(θ − a·d₁), L(θ + a·d₁)), a = SHARPNESS_ALPHA.
        grid_axis: (G,) α and β of the 2-D grid.
        grid: (G, G) float64 L(θ + α·d₁ + β·d₂), [β index, α index].
        grid_min, grid_max: (α, β) of the grid's lowest and highest point.
        windows: (n, T + 1) int64 the validation windows.
        data: the dataset folder; seq_len: T.
        unigram: the run's unigram validation loss (run.json), or None.
        ln_vocab: ln V, the uniform guess.
        tied: how tied embeddings move: "shared tensor", "equal copies moved together",
            "untied".
        seed: the directions' seed.
        evaluations: distinct points evaluated; seconds_per_evaluation: their mean time (s).
        seconds: wall time of the measurement (s).
    """

    alphas: list[float]
    losses: list[float]
    trained: float
    sharp: tuple[float, float]
    grid_axis: list[float]
    grid: torch.Tensor
    grid_min: tuple[float, float]
    grid_max: tuple[float, float]
    windows: torch.Tensor
    data: str
    seq_len: int
    unigram: Optional[float]
    ln_vocab: float
    tied: str
    seed: int
    evaluations: int
    seconds_per_evaluation: float
    seconds: float

    @property
    def rise(self) -> tuple[float, float]:
        """L(θ ∓ a·d₁) − L(θ), a = SHARPNESS_ALPHA (nats)."""
        return self.sharp[0] - self.trained, self.sharp[1] - self.trained


def evaluate_points(model: torch.nn.Module, windows: torch.Tensor, directions: list[dict],
                    alphas: list[float], grid_axis: list[float], progress) -> tuple:
    """The validation loss at θ, along the curve, at α = ±SHARPNESS_ALPHA and on the grid,
    each distinct (α, β) once; the weights are restored on return.

    Returns:
        (trained, losses (P,), sharp (2,), grid (G rows [β] of G [α]), evaluations).
    """
    cache: dict[tuple[float, float], float] = {}
    total = len({(a, 0.0) for a in alphas} | {(a, b) for a in grid_axis for b in grid_axis}
                | {(0.0, 0.0), (SHARPNESS_ALPHA, 0.0), (-SHARPNESS_ALPHA, 0.0)})
    with perturbed(model, directions) as set_point:
        def loss_at(a: float, b: float) -> float:
            key = (a + 0.0, b + 0.0)                                         # −0.0 → 0.0
            if key not in cache:
                set_point(key)
                cache[key] = validation_loss(model, windows)
                if len(cache) % 5 == 0 or len(cache) == total:
                    progress(f"landscape: {len(cache)}/{total} points")
            return cache[key]

        trained = loss_at(0.0, 0.0)                                          # L(θ)
        losses = [loss_at(a, 0.0) for a in alphas]                           # (P,) L(θ + α·d₁)
        sharp = (loss_at(-SHARPNESS_ALPHA, 0.0), loss_at(SHARPNESS_ALPHA, 0.0))
        grid = [[loss_at(a, b) for a in grid_axis] for b in grid_axis]       # (G, G) [β][α]
    return trained, losses, sharp, grid, len(cache)


def _tied(model: torch.nn.Module) -> str:
    """How the model's tied embeddings move (see `landscape_directions`)."""
    params = dict(model.named_parameters())
    return ("shared tensor" if "tok_embeddings.weight" in params and model.args.tie_embeddings
            and "output.weight" not in params else
            "equal copies moved together" if tied_copy(model) else "untied")


def measure_landscape(ctx: AnatomyContext) -> LossLandscape:
    """The 1-D curve, the sharpness points and the 2-D grid of ctx's run (see
    `landscape_section` for the options and errors)."""
    if ctx.run_dir is None:
        raise ArgumentError(NEEDS_RUN)
    start = time.perf_counter()
    model, options = ctx.model, ctx.options
    n_points = _int_option(options, "landscape_points", DEFAULT_POINTS, 3)
    n_grid = _int_option(options, "landscape_grid", DEFAULT_GRID, 2)
    n_windows = _int_option(options, "landscape_batches", DEFAULT_BATCHES, 1)
    args = model.args
    ctx.progress("landscape: validation windows")
    windows, source = validation_windows(Path(ctx.run_dir), n_windows, args.vocab_size,
                                         args.max_seq_len, options.get("landscape_data"))
    tied = _tied(model)
    d1, d2 = landscape_directions(model, ctx.seed)
    alphas, grid_axis = axis(n_points), axis(n_grid)                         # (P,), (G,)
    was_training = model.training
    model.eval()
    t_eval = time.perf_counter()
    trained, losses, sharp, grid, evals = evaluate_points(model, windows, [d1, d2], alphas,
                                                          grid_axis, ctx.progress)
    model.train(was_training)
    eval_seconds = (time.perf_counter() - t_eval) / max(evals, 1)
    grid_t = torch.tensor(grid, dtype=torch.float64)                         # (G, G)
    flat_min, flat_max = int(grid_t.argmin()), int(grid_t.argmax())
    return LossLandscape(
        alphas=alphas, losses=losses, trained=trained, sharp=sharp, grid_axis=grid_axis,
        grid=grid_t,
        grid_min=(grid_axis[flat_min % n_grid], grid_axis[flat_min // n_grid]),   # (α, β)
        grid_max=(grid_axis[flat_max % n_grid], grid_axis[flat_max // n_grid]),
        windows=windows, data=source["data"], seq_len=source["seq_len"],
        unigram=source["unigram_val_loss"], ln_vocab=math.log(args.vocab_size),
        tied=tied, seed=ctx.seed, evaluations=evals, seconds_per_evaluation=eval_seconds,
        seconds=time.perf_counter() - start)


def plot_curve(m: LossLandscape) -> Figure:
    """The 1-D curve with the trained point, ln V and the unigram loss."""
    plt = _pyplot()
    fig1, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(m.alphas, m.losses, "o-", ms=4, color="tab:blue", label="L(θ + α·d₁)")
    ax.plot([0.0], [m.trained], "*", ms=14, color="tab:red", label=f"trained θ: {m.trained:.3f}")
    ax.axhline(m.ln_vocab, ls=":", color="gray", label=f"uniform guess ln V = {m.ln_vocab:.2f}")
    if isinstance(m.unigram, (int, float)) and math.isfinite(m.unigram):
        ax.axhline(m.unigram, ls="--", color="tab:green",
                   label=f"unigram (no context) {m.unigram:.2f}")
    ax.set_xlabel("α (filter-normalized units: α = 1 is a step as long as each filter)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("1-D slice through the trained weights")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig1.tight_layout()
    return Figure("curve", "Validation loss along one filter-normalized random direction d₁ "
                           "through the trained weights (α = 0).", fig1)


def plot_contour(m: LossLandscape) -> Figure:
    """The 2-D grid as filled contours, the trained point and the grid's minimum."""
    plt = _pyplot()
    grid_axis, grid_t = m.grid_axis, m.grid
    fig2, ax = plt.subplots(figsize=(6.4, 5.4))
    lo, hi = float(grid_t.min()), float(grid_t.max())
    levels = torch.linspace(lo, hi if hi > lo else lo + 1e-6, 25).tolist()
    filled = ax.contourf(grid_axis, grid_axis, grid_t.numpy(), levels=levels, cmap="viridis")
    lines = ax.contour(grid_axis, grid_axis, grid_t.numpy(), levels=levels[::3], colors="white",
                       linewidths=0.6)
    ax.clabel(lines, fontsize=7, fmt="%.2f")
    fig2.colorbar(filled, ax=ax, label="validation loss (nats/token)", format="%.2f")
    ax.plot([0.0], [0.0], "*", ms=15, color="tab:red", markeredgecolor="white",
            label=f"trained θ: {m.trained:.3f}")
    if m.grid_min != (0.0, 0.0):
        ax.plot([m.grid_min[0]], [m.grid_min[1]], "x", ms=9, color="tab:orange",
                label=f"grid minimum: {grid_t.min():.3f}")
    ax.set_xlabel("α (direction d₁)")
    ax.set_ylabel("β (direction d₂)")
    ax.set_title("2-D slice: L(θ + α·d₁ + β·d₂)")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_aspect("equal")
    fig2.tight_layout()
    return Figure("contour", "Validation loss on the plane of two filter-normalized random "
                             "directions d₁, d₂ through the trained weights (star).", fig2)


LOOK_FOR = (
    "Each point is the validation loss of the trained model moved along random directions "
    "in weight space, θ + α·d₁ (curve) and θ + α·d₁ + β·d₂ (contours), with the same "
    "validation windows at every point. The trained weights (the red star, α = β = 0) "
    "should sit at the bottom of a basin: the curve lowest at α = 0 and the contours "
    "closing around the star; a curve that still falls away from α = 0 means training had "
    "not settled. A flat minimum is a wide basin whose loss barely rises for small α (a "
    "small rise at α = ±0.25), which Li et al. found to go with better generalisation; a "
    "sharp minimum is a narrow valley whose loss shoots up within a small step. The "
    "directions are filter-normalized (Li et al. 2018, §4): every filter (row of a weight "
    "matrix) of d has the norm of the same filter of θ, and norm gains get no "
    "perturbation, so α = 1 is a step as large as the weights themselves in every layer. "
    "This removes the scale invariance that makes raw random directions misleading, so "
    "sharpness can be compared across models and checkpoints; at α = ±1 the weights are "
    "mostly noise and the loss should approach or exceed the uniform guess ln V.")


def landscape_headline(m: LossLandscape) -> list[str]:
    """Sentences with the trained loss, the curve's ends, sharpness, the grid and the cost."""
    trained, losses, alphas, rise, grid_t = m.trained, m.losses, m.alphas, m.rise, m.grid
    n_grid, g_min, g_max = len(m.grid_axis), m.grid_min, m.grid_max
    lowest = min(range(len(losses)), key=lambda i: losses[i])
    where = (f"{len(m.windows)} validation windows × {m.seq_len} tokens "
             f"({m.windows[:, 1:].numel():,} tokens) of {m.data}")
    return [
        f"Validation loss at the trained weights: {trained:.3f} nats/token ({where}).",
        f"Along d₁: L(α = −1) = {losses[0]:.3f}, L(α = +1) = {losses[-1]:.3f} "
        f"(uniform guess ln V = {m.ln_vocab:.3f}"
        + (f", unigram {m.unigram:.3f})." if isinstance(m.unigram, (int, float)) else ")."),
        f"Sharpness: the loss rises by {rise[0]:+.3f} / {rise[1]:+.3f} nats at "
        f"α = −{SHARPNESS_ALPHA} / +{SHARPNESS_ALPHA} (mean {(rise[0] + rise[1]) / 2:+.3f}).",
        f"2-D grid {n_grid}×{n_grid}: minimum {grid_t.min():.3f} at (α, β) = "
        f"({g_min[0]:+.2f}, {g_min[1]:+.2f}), maximum {grid_t.max():.3f} at "
        f"({g_max[0]:+.2f}, {g_max[1]:+.2f}).",
        ("The trained point is the lowest point of the 1-D curve."
         if losses[lowest] >= trained - DIP_TOLERANCE else
         f"The 1-D curve dips below the trained point: {losses[lowest]:.4f} at "
         f"α = {alphas[lowest]:+.2f}, {trained - losses[lowest]:.4f} nats lower (not a minimum "
         f"along d₁: training had not settled, or these validation windows prefer other "
         f"weights)."),
        f"{m.evaluations} loss evaluations, {m.seconds_per_evaluation:.2f} s each; "
        f"seed {m.seed}.",
    ]


def landscape_prose(m: LossLandscape) -> Prose:
    """The landscape section's words and anatomy.json entry (every loss)."""
    rise = m.rise
    data = {
        "alphas": m.alphas, "losses": m.losses, "trained_loss": m.trained,
        "sharpness": {"alpha": SHARPNESS_ALPHA, "loss_minus": m.sharp[0],
                      "loss_plus": m.sharp[1], "rise_minus": rise[0], "rise_plus": rise[1],
                      "rise_mean": (rise[0] + rise[1]) / 2},
        "grid_alphas": m.grid_axis, "grid_betas": m.grid_axis, "grid": m.grid.tolist(),
        "grid_min": {"loss": float(m.grid.min()), "alpha": m.grid_min[0], "beta": m.grid_min[1]},
        "grid_max": {"loss": float(m.grid.max()), "alpha": m.grid_max[0], "beta": m.grid_max[1]},
        "ln_vocab": m.ln_vocab, "unigram_val_loss": m.unigram, "data": m.data,
        "seq_len": m.seq_len, "windows": len(m.windows), "tokens": m.windows[:, 1:].numel(),
        "tied_embeddings": m.tied, "seed": m.seed, "evaluations": m.evaluations,
        "seconds_per_evaluation": m.seconds_per_evaluation,
        "seconds": m.seconds,
        "method": "filter-normalized random directions (Li et al. 2018 §4); 1-D params zero; "
                  "the 1-D curve is the β = 0 slice of the 2-D surface",
    }
    return Prose(LOOK_FOR, landscape_headline(m), data)


def landscape_section(ctx: AnatomyContext) -> Section:
    """Validation loss along one and two filter-normalized random directions around the trained
    weights (Li et al. 2018): a 1-D curve L(θ + α·d₁) and a 2-D contour plot
    L(θ + α·d₁ + β·d₂), α, β ∈ [−1, 1].

    ctx.options: "landscape_points" (1-D points, default 21, ≥ 3), "landscape_grid" (2-D side,
    default 11, ≥ 2), "landscape_batches" (validation windows of the run's seq-len, default 8),
    "landscape_data" (a dataset folder instead of the one the run recorded).

    Returns:
        the Section "landscape"; its data holds every loss, tensors "alphas" (P,), "losses"
        (P,), "grid_alphas" (G,), "grid_betas" (G,), "grid" (G, G) [β index, α index] float64,
        "windows" (n, T + 1) int64. The directions are `landscape_directions(ctx.model,
        ctx.seed)`. The model's weights are restored bit-exactly.

    Raises:
        ArgumentError: ctx.run_dir is None, the run's data folder is missing, bad options.
        ModelFileError: a damaged dataset.
    """
    start = time.perf_counter()
    m = measure_landscape(ctx)
    figures = [plot_curve(m), plot_contour(m)]
    prose = landscape_prose(m)
    prose.data["seconds"] = time.perf_counter() - start        # the whole section, figures too
    grid_axis = torch.tensor(m.grid_axis, dtype=torch.float64)
    tensors = {"alphas": torch.tensor(m.alphas, dtype=torch.float64),
               "losses": torch.tensor(m.losses, dtype=torch.float64),
               "grid_alphas": grid_axis, "grid_betas": grid_axis.clone(),
               "grid": m.grid, "windows": m.windows}
    return prose.section("landscape", "Loss landscape around the trained weights", figures,
                         tensors)
