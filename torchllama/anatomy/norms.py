"""Section of the report on normalization: the residual stream's scale layer by layer, RMSNorm
vs LayerNorm on the model's real activations (statistics, agreement, speed), GroupNorm and
InstanceNorm for comparison, and pre- vs post-norm gradients at initialisation.

Formulas (per vector x ∈ R^D, μ = mean(x), σ² = mean((x − μ)²), ms = mean(x²) = σ² + μ²):
    RMSNorm   (Zhang & Sennrich 2019, eq. 4):  x / sqrt(ms + eps) · g
    LayerNorm (Ba et al. 2016, eq. 3-4):       (x − μ) / sqrt(σ² + eps) · γ + β
With unit gains and eps = 0 both outputs are positive multiples of x and of x − μ·1, so

    cos(RMSNorm(x), LayerNorm(x)) = (x · (x − μ1)) / (|x| |x − μ1|) = σ / RMS(x) = sqrt(1 − μ²/ms)

(independent of eps), and RMSNorm's output has mean μ/RMS(x) and variance σ²/ms = cos²: the two
norms agree exactly when the vector already has zero mean.
    GroupNorm    (Wu & He 2018, eq. 1-3): LayerNorm within each of G groups of channels.
    InstanceNorm (Ulyanov et al. 2016, eq. 2): each channel normalised over the spatial axis
        (here: positions), per sample.
Pre- vs post-norm: Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture".
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from torchllama.anatomy.capture import residual_stream
from torchllama.anatomy.report import AnatomyContext, Figure, Prose, Section, Table
from torchllama.config import ModelArgs
from torchllama.model import Transformer
from torchllama.nn.norms import LayerNorm, RMSNorm
from torchllama.train.optim import init_weights

#: rows of the (N, dim) tensor the speed comparison times besides the text's own T rows (a
#: training-sized batch: 8 sequences × 512 tokens)
SPEED_ROWS = 4096
#: depth and width of the models of the pre- vs post-norm gradient experiment
GRAD_LAYERS, GRAD_DIM, GRAD_HEADS = 24, 128, 4
PLACEMENTS = ("pre", "post", "sandwich")


# ---- the norms, with unit gains ----------------------------------------------------------------

@torch.no_grad()
def unit_rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm with unit gain (our `torchllama.nn.norms.RMSNorm`): x / sqrt(mean(x²) + eps)
    (Zhang & Sennrich 2019, eq. 4).

    Args:
        x: (..., D) float tensor.

    Returns:
        (..., D) same dtype: each vector has RMS sqrt(ms / (ms + eps)) ≈ 1.
    """
    return RMSNorm(x.shape[-1], eps=eps).to(x.device)(x)                    # (..., D)


@torch.no_grad()
def unit_layer_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm with unit gain and no bias (our `torchllama.nn.norms.LayerNorm`):
    (x − μ) / sqrt(σ² + eps) (Ba et al. 2016, eq. 3-4).

    Args:
        x: (..., D) float tensor.

    Returns:
        (..., D) same dtype: each vector has mean 0 and variance σ² / (σ² + eps) ≈ 1.
    """
    return LayerNorm(x.shape[-1], eps=eps, bias=False).to(x.device)(x)     # (..., D)


def vector_stats(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (biased) variance of each vector over the last dimension.

    Args:
        y: (..., D) float tensor.

    Returns:
        (mean, var), each (...,) float32.
    """
    y = y.float()
    return y.mean(-1), y.var(-1, unbiased=False)                           # (...,), (...,)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of matching vectors: (..., D), (..., D) → (...,) float32."""
    return F.cosine_similarity(a.float(), b.float(), dim=-1, eps=1e-12)    # (...,)


def residual_rms(stream: torch.Tensor) -> torch.Tensor:
    """RMS of every residual-stream vector, sqrt(mean over D of h²).

    Args:
        stream: (L + 1, T, D) float32, as `residual_stream(model, tokens)[:, 0]`.

    Returns:
        (L + 1, T) float32.
    """
    return stream.float().pow(2).mean(-1).sqrt()                           # (L+1, T)


def rms_vs_layer_norm(x: torch.Tensor, eps: float = 1e-6) -> dict[str, torch.Tensor]:
    """RMSNorm and LayerNorm (unit gains, the same eps) applied to the same vectors.

    Args:
        x: (N, D) float activations.

    Returns:
        dict of (N,) float32 tensors: "input_mean_over_rms" μ/RMS(x); "rms_mean", "rms_var"
        and "ln_mean", "ln_var" the mean and variance of each output vector; "cosine" the
        cosine between the two outputs (= sqrt(1 − μ²/ms), see the module docstring).
    """
    rms_out = unit_rms_norm(x, eps)                                        # (N, D)
    ln_out = unit_layer_norm(x, eps)                                       # (N, D)
    rms_mean, rms_var = vector_stats(rms_out)
    ln_mean, ln_var = vector_stats(ln_out)
    mu, ms = x.float().mean(-1), x.float().pow(2).mean(-1)                 # (N,), (N,)
    return {"input_mean_over_rms": mu / ms.clamp_min(1e-30).sqrt(),
            "rms_mean": rms_mean, "rms_var": rms_var, "ln_mean": ln_mean, "ln_var": ln_var,
            "cosine": cosine(rms_out, ln_out)}


def other_norms(x: torch.Tensor, groups: int, eps: float = 1e-5) -> dict[str, torch.Tensor]:
    """The same activations through RMSNorm, LayerNorm, GroupNorm and InstanceNorm, unit gains.

    Args:
        x: (T, D) float activations of one sequence (positions × channels).
        groups: GroupNorm's G; must divide D.

    Returns:
        name → (T, D) float32 output, for "RMSNorm" and "LayerNorm" (per token, over D),
        "GroupNorm per token" (F.group_norm on (N=T, C=D): over each token's D/G channels of a
        group), "GroupNorm over sequence" (on (1, C=D, T): over D/G channels × all T positions)
        and "InstanceNorm" (on (1, C=D, T): each channel over all T positions). The last two
        pool positions, so a token's output depends on later tokens: not causal.

    Raises:
        ValueError: groups does not divide D (from F.group_norm).
    """
    x = x.float()
    seq = x.T[None]                                                        # (1, D, T)
    return {
        "RMSNorm": unit_rms_norm(x, eps),                                  # (T, D)
        "LayerNorm": unit_layer_norm(x, eps),                              # (T, D)
        "GroupNorm per token": F.group_norm(x, groups, eps=eps),           # (T, D)
        "GroupNorm over sequence": F.group_norm(seq, groups, eps=eps)[0].T,  # (T, D)
        "InstanceNorm": F.instance_norm(seq, eps=eps)[0].T,                # (T, D)
    }


#: for the table: what each of `other_norms` normalises over, and whether it is causal
NORM_AXES = {
    "RMSNorm": ("each token's D channels, no centring", "yes"),
    "LayerNorm": ("each token's D channels", "yes"),
    "GroupNorm per token": ("each token's D/G channels of a group", "yes"),
    "GroupNorm over sequence": ("D/G channels × all T positions", "no"),
    "InstanceNorm": ("each channel over all T positions", "no"),
}


# ---- speed -------------------------------------------------------------------------------------

def _median_seconds(fn: Callable[[], None], repeats: int, budget_s: float) -> float:
    for _ in range(2):                                                     # warm-up
        fn()
    times = []
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    return statistics.median(times)


def norm_speed(dim: int, rows: int, repeats: int = 15, budget_s: float = 0.3,
               seed: int = 0) -> dict[str, dict[str, float]]:
    """Wall time of RMSNorm and LayerNorm on this machine, forward and forward + backward.

    Times our `RMSNorm` and `LayerNorm` modules (LayerNorm with its bias, as GPT-2) and torch's
    `F.rms_norm` / `F.layer_norm` on a float32 (rows, dim) tensor ~ N(0, 1): the median over
    up to `repeats` calls (fewer once `budget_s` is spent, at least 3), after two warm-ups.

    Returns:
        {"forward": {name: seconds}, "forward+backward": {name: seconds}} with names
        "RMSNorm (ours)", "LayerNorm (ours)", "F.rms_norm", "F.layer_norm".
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen)                              # (N, D) fp32
    grad = torch.randn(rows, dim, generator=gen)                           # (N, D) fp32
    rms, ln = RMSNorm(dim), LayerNorm(dim, bias=True)
    w, b = torch.ones(dim, requires_grad=True), torch.zeros(dim, requires_grad=True)
    impls = {"RMSNorm (ours)": rms,
             "LayerNorm (ours)": ln,
             "F.rms_norm": lambda v: F.rms_norm(v, (dim,), w, 1e-6),
             "F.layer_norm": lambda v: F.layer_norm(v, (dim,), w, b, 1e-5)}
    out: dict[str, dict[str, float]] = {"forward": {}, "forward+backward": {}}
    for name, fn in impls.items():
        def forward(fn=fn):
            with torch.no_grad():
                fn(x)

        def backward(fn=fn):
            xg = x.detach().requires_grad_(True)
            fn(xg).backward(grad)

        out["forward"][name] = _median_seconds(forward, repeats, budget_s)
        out["forward+backward"][name] = _median_seconds(backward, repeats, budget_s)
    return out


# ---- pre- vs post-norm gradients at init -------------------------------------------------------

def layer_grad_norms(args: ModelArgs, tokens: torch.Tensor, seed: int = 0,
                     init: str = "train") -> dict[str, list[float]]:
    """Gradient norms per layer of a freshly initialised model, for one batch of text.

    The model is `Transformer(args)` initialised with the training init
    (`torchllama.train.optim.init_weights`, init="train") or with every linear layer Xavier-
    uniform and embeddings N(0, 1/dim) (init="xavier", the paper's setting, Xiong et al.
    2020 §3); the loss is the mean cross-entropy of the next tokens, tokens[:, 1:] from
    tokens[:, :-1] (ids taken modulo args.vocab_size). The global RNG state is left as it was.

    Args:
        tokens: (B, T) int64, T ≥ 2 and T − 1 ≤ args.max_seq_len.

    Returns:
        {"w2": ‖∂L/∂W2‖ of each layer's FFN down projection, "block": ‖∂L/∂θ‖ over all of
        each block's parameters, "loss": [loss]}: lists of floats, one per layer.

    Raises:
        ValueError: unknown init.
    """
    if init not in ("train", "xavier"):
        raise ValueError(f"init must be 'train' or 'xavier', got {init!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(args)
        init_weights(model, args.n_layers)
        if init == "xavier":
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    nn.init.xavier_uniform_(module.weight)
            nn.init.normal_(model.tok_embeddings.weight, 0.0, args.dim ** -0.5)
    ids = tokens % args.vocab_size                                         # (B, T)
    loss = model(ids[:, :-1], targets=ids[:, 1:])                          # () fp32
    loss.backward()
    w2 = [layer.feed_forward.w2.weight.grad.norm().item() for layer in model.layers]
    block = [math.sqrt(sum(p.grad.pow(2).sum().item() for p in layer.parameters()
                           if p.grad is not None)) for layer in model.layers]
    return {"w2": w2, "block": block, "loss": [loss.item()]}


def _groups(dim: int) -> int:
    """Wu & He's default G = 32 where it divides dim, else the largest divisor ≤ 32."""
    return max(g for g in range(1, 33) if dim % g == 0)


# ---- measure -----------------------------------------------------------------------------------

@dataclass
class ResidualScale:
    """The residual stream's size, layer by layer (L+1 stream indices: 0 = the embeddings,
    l = after block l − 1; T positions; D = dim).

    Attributes:
        stream: (L+1, T, D) float32 residual stream of the text.
        rms: (L+1, T) float32 RMS sqrt(mean_d h_d²) of every residual vector.
        mean, max: (L+1,) float32 mean and max of `rms` over positions ≥ 1 (all when T = 1).
        argmax: (L+1,) int64 position of `max`.
        position0: (L+1,) float32 RMS at position 0.
        first_label: the token label of position 0.
    """

    stream: torch.Tensor
    rms: torch.Tensor
    mean: torch.Tensor
    max: torch.Tensor
    argmax: torch.Tensor
    position0: torch.Tensor
    first_label: str


@dataclass
class NormAgreement:
    """RMSNorm vs LayerNorm (unit gains, the model's eps) on every residual vector.

    Attributes:
        eps: the model's norm_eps, used by both.
        per_token: `rms_vs_layer_norm`'s statistics, name → (L+1, T) float32.
        cosine: (L+1, T) float32 cosine of the two outputs (per_token["cosine"]).
        cosine_mean, cosine_min: (L+1,) float32 over positions ≥ 1 (all when T = 1).
        picked: the few stream indices whose per-token statistics are drawn and stored.
    """

    eps: float
    per_token: dict[str, torch.Tensor]
    cosine: torch.Tensor
    cosine_mean: torch.Tensor
    cosine_min: torch.Tensor
    picked: list[int]


@dataclass
class NormSpeed:
    """Wall time of RMSNorm and LayerNorm on this machine (`norm_speed`).

    Attributes:
        seconds: str(rows) → `norm_speed(dim, rows)`: {mode: {implementation: median seconds}},
            for rows in `rows`.
        rows: the row counts timed: (T, SPEED_ROWS).
        dim: D.
        threads: torch's intra-op threads during the timing.
        ratio, ratio_functional: mode → LayerNorm time / RMSNorm time at SPEED_ROWS rows, of
            our modules and of F.layer_norm / F.rms_norm (> 1: RMSNorm faster).
    """

    seconds: dict[str, dict[str, dict[str, float]]]
    rows: tuple[int, int]
    dim: int
    threads: int
    ratio: dict[str, float]
    ratio_functional: dict[str, float]


@dataclass
class OtherNorms:
    """Five norms (`other_norms`, unit gains) on one residual stream index, positions ≥ 1.

    Attributes:
        layer: the stream index (L+1) // 2.
        groups: GroupNorm's G.
        outputs: name → (T, D) float32 output of each norm (all positions).
        per_norm: name → {"abs_mean": mean |per-token mean|, "var_mean" / "var_std": mean and
            std of the per-token variance, "cos_rms_mean" / "cos_rms_min": per-token cosine
            to RMSNorm's output, "over", "causal": NORM_AXES}.
    """

    layer: int
    groups: int
    outputs: dict[str, torch.Tensor]
    per_norm: dict[str, dict]


@dataclass
class PrePostGradients:
    """Gradient norms per layer at init of GRAD_LAYERS-layer models of each norm placement.

    Attributes:
        norm: the model's norm ("rmsnorm", "layernorm"), used by the small models.
        per_init: init ("train", "xavier") → placement → `layer_grad_norms(...)` ({"w2",
            "block": one float per layer, "loss": [nats]}); {} when the text has < 2 tokens.
        ratio: init → placement → ‖∂L/∂W2‖ of the last layer / of the first.
    """

    norm: str
    per_init: dict[str, dict[str, dict[str, list[float]]]]
    ratio: dict[str, dict[str, float]]


@dataclass
class NormsMeasurements:
    """Everything the normalization section measures, one dataclass per experiment."""

    residual: ResidualScale
    agreement: NormAgreement
    speed: NormSpeed
    others: OtherNorms
    gradients: PrePostGradients


def measure_residual(model, tokens: torch.Tensor, labels: list[str]) -> ResidualScale:
    """The residual stream of tokens (1, T) and the RMS of each of its vectors."""
    stream = residual_stream(model, tokens)[:, 0]                          # (L+1, T, D) fp32
    T = stream.shape[1]
    rms = residual_rms(stream)                                             # (L+1, T)
    rest = rms[:, 1:] if T > 1 else rms                                    # positions ≥ 1
    return ResidualScale(stream=stream, rms=rms, mean=rest.mean(1),        # (L+1,) each
                         max=rest.max(1).values, argmax=rest.argmax(1) + (1 if T > 1 else 0),
                         position0=rms[:, 0], first_label=labels[0])


def measure_agreement(stream: torch.Tensor, eps: float) -> NormAgreement:
    """RMSNorm vs LayerNorm on every vector of stream (L+1, T, D)."""
    L1, T, D = stream.shape
    flat = stream.reshape(L1 * T, D)                                       # (L+1·T, D)
    per_token = {k: v.reshape(L1, T) for k, v in rms_vs_layer_norm(flat, eps).items()}
    cos = per_token["cosine"]                                              # (L+1, T)
    cos_rest = cos[:, 1:] if T > 1 else cos
    return NormAgreement(eps=eps, per_token=per_token, cosine=cos,
                         cosine_mean=cos_rest.mean(1), cosine_min=cos_rest.min(1).values,
                         picked=sorted({0, L1 // 4, L1 // 2, (3 * L1) // 4, L1 - 1}))


def measure_speed(dim: int, T: int, seed: int) -> NormSpeed:
    """`norm_speed` on (T, dim) and (SPEED_ROWS, dim), and the LayerNorm / RMSNorm ratios."""
    speed = {str(rows): norm_speed(dim, rows, seed=seed) for rows in (T, SPEED_ROWS)}
    big = speed[str(SPEED_ROWS)]
    return NormSpeed(
        seconds=speed, rows=(T, SPEED_ROWS), dim=dim, threads=torch.get_num_threads(),
        ratio={mode: big[mode]["LayerNorm (ours)"] / big[mode]["RMSNorm (ours)"]
               for mode in big},
        ratio_functional={mode: big[mode]["F.layer_norm"] / big[mode]["F.rms_norm"]
                          for mode in big})


def measure_other_norms(stream: torch.Tensor, eps: float) -> OtherNorms:
    """The five norms of `other_norms` on the middle stream index of stream (L+1, T, D)."""
    L1, T, D = stream.shape
    mid, groups = L1 // 2, _groups(D)
    outs = other_norms(stream[mid], groups, eps)                           # name → (T, D)
    sl = slice(1, None) if T > 1 else slice(None)
    per_norm = {}
    for name, y in outs.items():
        mean, var = vector_stats(y[sl])                                    # (T−1,) each
        c = cosine(y[sl], outs["RMSNorm"][sl])                             # (T−1,)
        per_norm[name] = {"abs_mean": mean.abs().mean().item(), "var_mean": var.mean().item(),
                          "var_std": var.std(unbiased=False).item(),
                          "cos_rms_mean": c.mean().item(), "cos_rms_min": c.min().item(),
                          "over": NORM_AXES[name][0], "causal": NORM_AXES[name][1]}
    return OtherNorms(layer=mid, groups=groups, outputs=outs, per_norm=per_norm)


def measure_gradients(args: ModelArgs, tokens: torch.Tensor, seed: int) -> PrePostGradients:
    """`layer_grad_norms` of GRAD_LAYERS-layer models of each placement and init on tokens."""
    T = tokens.shape[1]
    g_args = dict(dim=GRAD_DIM, n_layers=GRAD_LAYERS, n_heads=GRAD_HEADS,
                  vocab_size=args.vocab_size, max_seq_len=max(T, 2), norm=args.norm)
    grads = {init: {pl: layer_grad_norms(ModelArgs(**g_args, norm_placement=pl), tokens,
                                         seed, init) for pl in PLACEMENTS}
             for init in ("train", "xavier")} if T >= 2 else {}
    ratio = {init: {pl: g["w2"][-1] / g["w2"][0] for pl, g in per.items()}
             for init, per in grads.items()}
    return PrePostGradients(norm=args.norm, per_init=grads, ratio=ratio)


def measure_norms(ctx: AnatomyContext) -> NormsMeasurements:
    """Every measurement of the normalization section, on ctx's model and text."""
    ctx.progress("residual stream")
    residual = measure_residual(ctx.model, ctx.tokens, ctx.labels)
    stream, eps = residual.stream, ctx.model.args.norm_eps
    ctx.progress("RMSNorm vs LayerNorm")
    agreement = measure_agreement(stream, eps)
    ctx.progress("norm speed")
    speed = measure_speed(stream.shape[2], stream.shape[1], ctx.seed)
    ctx.progress("GroupNorm, InstanceNorm")
    others = measure_other_norms(stream, eps)
    ctx.progress("pre- vs post-norm gradients")
    gradients = measure_gradients(ctx.model.args, ctx.tokens, ctx.seed)
    return NormsMeasurements(residual, agreement, speed, others, gradients)


# ---- plot --------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_residual(r: ResidualScale) -> Figure:
    """The residual stream's RMS per layer (mean, max, position 0) and at every position."""
    plt = _pyplot()
    layers = list(range(r.rms.shape[0]))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 3.8),
                                  gridspec_kw={"width_ratios": [1, 1.4]})
    ax.semilogy(layers, r.mean.numpy(), "o-", ms=3, label="mean over positions ≥ 1")
    ax.semilogy(layers, r.max.numpy(), "s--", ms=3, label="max over positions ≥ 1")
    ax.semilogy(layers, r.position0.numpy(), "^:", ms=3, label=f"position 0 ({r.first_label!r})")
    ax.set_xlabel("residual stream index (0 = embeddings, l = after block l − 1)")
    ax.set_ylabel("RMS of h (log)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    im = ax2.imshow(r.rms.log10().numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    ax2.set_xlabel("position")
    ax2.set_ylabel("residual stream index")
    fig.colorbar(im, ax=ax2, label="log10 RMS")
    ax2.set_title("RMS of every residual vector", fontsize=9)
    fig.tight_layout()
    return Figure("residual-rms", "RMS of the residual stream sqrt(mean_d h_d²) per "
                  "layer: mean and max over positions ≥ 1, and position 0 on its own "
                  "(left, log scale); every position (right).", fig)


def plot_agreement(a: NormAgreement) -> Figure:
    """The RMSNorm–LayerNorm cosine per layer, and each output's mean and variance."""
    plt = _pyplot()
    cos, picked, per_token = a.cosine, a.picked, a.per_token
    layers = list(range(cos.shape[0]))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 3.8))
    ax.plot(layers, a.cosine_mean.numpy(), "o-", ms=3, label="mean over positions ≥ 1")
    ax.plot(layers, a.cosine_min.numpy(), "s--", ms=3, label="min over positions ≥ 1")
    ax.plot(layers, cos[:, 0].numpy(), "^:", ms=3, label="position 0")
    ax.set_xlabel("residual stream index")
    ax.set_ylabel("cos(RMSNorm(h), LayerNorm(h))")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    shown = per_token["rms_mean"][picked, 1:]                               # (k, T−1)
    reach = max(0.02, 1.3 * shown.abs().max().item())                      # zoom to the data
    m = torch.linspace(-min(reach, 1.0), min(reach, 1.0), 101)
    ax2.plot(m.numpy(), (1 - m ** 2).numpy(), color="0.7", lw=1,
             label="var = 1 − mean² (RMSNorm's curve)")
    for l in picked:
        ax2.scatter(per_token["rms_mean"][l, 1:].numpy(), per_token["rms_var"][l, 1:].numpy(),
                    s=8, alpha=0.7, label=f"RMSNorm, index {l}")
    ax2.scatter(per_token["ln_mean"][picked, 1:].flatten().numpy(),
                per_token["ln_var"][picked, 1:].flatten().numpy(), s=40, marker="x",
                color="black", label="LayerNorm, all shown layers")
    ax2.set_xlim(-min(reach, 1.0), min(reach, 1.0))
    ax2.set_ylim(1 - min(reach, 1.0) ** 2 - 0.01 * reach, 1 + 0.05 * reach ** 2 + 1e-4)
    ax2.set_xlabel("mean of the output vector")
    ax2.set_ylabel("variance of the output vector")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return Figure("rms-vs-layernorm", "Left: cosine between the RMSNorm and LayerNorm "
                  "outputs (unit gains) of the same residual vectors, per layer. Right: "
                  "mean and variance of each output vector at a few layers (positions "
                  "≥ 1): LayerNorm's sit at (0, 1), RMSNorm's on var = 1 − mean².", fig)


def plot_speed(s: NormSpeed) -> Figure:
    """Bars of the median forward and forward + backward times, one panel per row count."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.4))
    for ax, rows in zip(axes, s.rows):
        times = s.seconds[str(rows)]
        names = list(times["forward"])
        xs = torch.arange(len(names)).numpy()
        ax.bar(xs - 0.2, [times["forward"][n] * 1e6 for n in names], 0.4, label="forward")
        ax.bar(xs + 0.2, [times["forward+backward"][n] * 1e6 for n in names], 0.4,
               label="forward + backward")
        ax.set_xticks(xs, names, fontsize=8)
        ax.set_ylabel("µs (median)")
        ax.set_title(f"({rows}, {s.dim}) float32, {s.threads} threads", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return Figure("speed", "Median wall time on this machine of RMSNorm and LayerNorm "
                  "(our modules, LayerNorm with bias; torch's functional kernels) on "
                  "the text's own size and on a training-sized batch.", fig)


def plot_other_norms(o: OtherNorms) -> Figure:
    """Per norm: the cosine to RMSNorm's output and the per-token output variance."""
    plt = _pyplot()
    per_norm = o.per_norm
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 3.4))
    names = list(per_norm)
    xs = torch.arange(len(names)).numpy()
    ax.bar(xs, [per_norm[n]["cos_rms_mean"] for n in names], color="tab:blue")
    ax.scatter(xs, [per_norm[n]["cos_rms_min"] for n in names], color="black", marker="_",
               s=200, label="min over tokens", zorder=3)
    ax.set_xticks(xs, [n.replace(" ", "\n", 1) for n in names], fontsize=7)
    ax.set_ylabel("cosine to RMSNorm (per token)")
    ax.set_ylim(min(0.0, min(per_norm[n]["cos_rms_min"] for n in names)), 1.02)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax2.bar(xs, [per_norm[n]["var_mean"] for n in names],
            yerr=[per_norm[n]["var_std"] for n in names], color="tab:orange", capsize=3)
    ax2.set_xticks(xs, [n.replace(" ", "\n", 1) for n in names], fontsize=7)
    ax2.set_ylabel("per-token output var (± std)")
    ax2.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Residual stream index {o.layer}, positions ≥ 1; GroupNorm G = {o.groups}",
                 fontsize=9)
    fig.tight_layout()
    return Figure("group-instance", "The same activations through five norms (unit "
                  "gains): per-token cosine to RMSNorm's output, and the variance of "
                  "each token's output vector (a per-token norm makes it ≈ 1 for every "
                  "token; norms that pool positions do not).", fig)


def plot_gradients(g: PrePostGradients) -> Figure:
    """Gradient norm per layer of each placement, one panel per init (g.per_init not empty)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for ax, (init, per) in zip(axes, g.per_init.items()):
        for pl, grad in per.items():
            ax.semilogy(range(GRAD_LAYERS), grad["w2"], "o-", ms=3, label=f"{pl}-norm, FFN W2")
            ax.semilogy(range(GRAD_LAYERS), grad["block"], ":", color=ax.lines[-1].get_color(),
                        label=f"{pl}-norm, whole block")
        ax.set_xlabel("layer")
        ax.set_ylabel("‖∂L/∂W‖ (log)")
        ax.set_title("training init (init_weights: N(0, 0.02²), residual projections "
                     "/ √(2L))" if init == "train" else
                     "Xavier-uniform init (Xiong et al. 2020's setting)", fontsize=8)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return Figure("pre-post-gradients", f"Gradient norm per layer at "
                  f"initialisation of a {GRAD_LAYERS}-layer, dim-{GRAD_DIM} "
                  f"{g.norm} model of each norm placement, for the next-token "
                  f"loss on this text (solid: FFN down projection W2; dotted: all "
                  f"of the block's parameters).", fig)


def plot_norms(m: NormsMeasurements) -> list[Figure]:
    """The section's figures, in page order (no gradient figure for a one-token text)."""
    figures = [plot_residual(m.residual), plot_agreement(m.agreement), plot_speed(m.speed),
               plot_other_norms(m.others)]
    if m.gradients.per_init:
        figures.append(plot_gradients(m.gradients))
    return figures


# ---- prose -------------------------------------------------------------------------------------

TITLE = "Normalization: RMSNorm, LayerNorm, pre- vs post-norm"

LOOK_FOR = (
    "Every block reads the residual stream through a norm, so the stream's own scale is free "
    "to drift: its RMS typically grows with depth, and position 0 (the first token, an "
    "attention sink) is often a huge outlier — look at how far the two curves and the "
    "bright first column are from the rest. LayerNorm centres and scales each vector; "
    "RMSNorm only scales it. With unit gains their outputs differ only by the removed mean, "
    "and their cosine equals σ/RMS(x) = sqrt(1 − μ²/mean(x²)): on real activations, whose "
    "per-vector mean is small against their size, it sits near 1, which is why dropping "
    "the centring costs little; RMSNorm's outputs lie on the curve var = 1 − mean² and "
    "LayerNorm's at (0, 1). Whether RMSNorm is faster here depends on the kernels: our "
    "eager RMSNorm is several elementwise ops, LayerNorm one fused kernel. GroupNorm per "
    "token is LayerNorm within channel groups and stays close; GroupNorm and InstanceNorm "
    "over the sequence pool statistics across positions (including the outlier at position "
    "0 and future tokens), so they are not causal and leave per-token scales unequal. "
    "Finally, placement: Xiong et al. 2020 (Xavier init, an encoder-decoder) find that "
    "post-norm (N after the residual add) has gradients that are large near the output "
    "relative to the lower layers, while pre-norm's stay even. Compare the slopes of the "
    "lines: here pre-norm's gradients shrink from the first layer to the last, post-norm's "
    "much less so (a higher last/first ratio), the same ordering as the paper. Note how "
    "much the picture depends on the initialisation: with the training init (small "
    "embeddings and residual projections) post-norm's gradients are flat and far smaller "
    "than pre-norm's, largely because pre-norm's final norm divides the small residual "
    "stream by its RMS and so scales every gradient up.")


def norms_headline(m: NormsMeasurements) -> list[str]:
    """One sentence per experiment with its key numbers (four for a one-token text)."""
    r, a, s, o, g = m.residual, m.agreement, m.speed, m.others, m.gradients
    L1 = r.mean.shape[0]
    peak = int(r.mean.argmax())
    worst, mid = int(a.cosine_mean.argmin()), L1 // 2
    tr, xv = g.ratio.get("train"), g.ratio.get("xavier")
    inst = o.per_norm["InstanceNorm"]
    return [
        f"Residual-stream RMS (mean over positions ≥ 1) goes from {r.mean[0]:.3g} (embeddings) "
        f"to {r.mean[-1]:.3g} after the last block"
        + (f", peaking at {r.mean[peak]:.3g} at index {peak}" if peak < L1 - 1 else "") + "; "
        f"position 0 reaches {r.position0.max():.3g}, "
        f"{r.position0.max() / r.mean[int(r.position0.argmax())]:.1f}× the mean there.",
        f"RMSNorm vs LayerNorm on the real activations (unit gains): mean cosine "
        f"{a.cosine_mean[mid]:.4f} at index {mid}, lowest mean {a.cosine_mean[worst]:.4f} at "
        f"index {worst} (lowest single token {a.cosine_min.min():.4f}); position 0: "
        f"{a.cosine[:, 0].min():.4f} at worst.",
        f"Speed on ({SPEED_ROWS}, {s.dim}): LayerNorm / RMSNorm time = "
        f"{s.ratio['forward']:.2f} forward, {s.ratio['forward+backward']:.2f} "
        f"forward+backward for our modules; {s.ratio_functional['forward']:.2f} and "
        f"{s.ratio_functional['forward+backward']:.2f} for F.layer_norm / F.rms_norm "
        f"(> 1: RMSNorm faster).",
        f"At index {o.layer}: GroupNorm (G = {o.groups}, per token) has cosine "
        f"{o.per_norm['GroupNorm per token']['cos_rms_mean']:.3f} to RMSNorm; "
        f"InstanceNorm over positions {inst['cos_rms_mean']:.3f}, "
        f"with per-token variance {inst['var_mean']:.2f} ± {inst['var_std']:.2f}.",
    ] + ([
        f"Gradient of W2, last / first layer at init ({GRAD_LAYERS} layers): "
        f"training init pre {tr['pre']:.2f}, post {tr['post']:.2f}, sandwich "
        f"{tr['sandwich']:.2f}; Xavier init pre {xv['pre']:.2f}, post "
        f"{xv['post']:.2f}, sandwich {xv['sandwich']:.2f}. Absolute size at "
        f"the last layer, training init: pre "
        f"{g.per_init['train']['pre']['w2'][-1]:.3g}, post "
        f"{g.per_init['train']['post']['w2'][-1]:.3g}."] if g.per_init else [])


def norms_prose(m: NormsMeasurements) -> Prose:
    """The section's headline, table of the five norms and anatomy.json entry."""
    r, a, s, o, g = m.residual, m.agreement, m.speed, m.others, m.gradients
    rows = [[name, p["over"], p["causal"], p["abs_mean"], p["var_mean"], p["var_std"],
             p["cos_rms_mean"], p["cos_rms_min"]] for name, p in o.per_norm.items()]
    data = {
        "positions_excluded_from_stats": [0],
        "residual_rms": {"per_position": r.rms.tolist(), "mean": r.mean.tolist(),
                         "max": r.max.tolist(), "argmax_position": r.argmax.tolist(),
                         "position0": r.position0.tolist()},
        "rms_vs_layernorm": {"eps": a.eps, "cosine_mean": a.cosine_mean.tolist(),
                             "cosine_min": a.cosine_min.tolist(),
                             "cosine_position0": a.cosine[:, 0].tolist(),
                             "picked_layers": a.picked,
                             "per_token": {str(l): {k: v[l].tolist()
                                                    for k, v in a.per_token.items()}
                                           for l in a.picked}},
        "speed_seconds": s.seconds,
        "speed_ratio_layernorm_over_rmsnorm": {"ours": s.ratio, "functional": s.ratio_functional,
                                               "rows": SPEED_ROWS, "dim": s.dim,
                                               "threads": s.threads},
        "group_instance": {"layer": o.layer, "groups": o.groups, "per_norm": o.per_norm},
        "pre_post_gradients": {"layers": GRAD_LAYERS, "dim": GRAD_DIM, "heads": GRAD_HEADS,
                               "norm": g.norm, "per_init": g.per_init,
                               "w2_last_over_first": g.ratio},
    }
    table = Table(f"Five norms on residual stream index {o.layer} (positions ≥ 1, unit gains, "
                  f"GroupNorm G = {o.groups})",
                  ["norm", "normalises over", "causal", "mean |per-token mean|",
                   "per-token var", "std of per-token var", "cos to RMSNorm (mean)",
                   "cos to RMSNorm (min)"], rows)
    return Prose(LOOK_FOR, norms_headline(m), data, [table])


# ---- the section -------------------------------------------------------------------------------

def norms_section(ctx: AnatomyContext) -> Section:
    """Normalization on the real model and text: residual-stream RMS per layer, RMSNorm vs
    LayerNorm on the same activations (statistics, cosine, speed), GroupNorm / InstanceNorm for
    comparison, and pre- vs post-norm gradient norms per layer at init (24-layer models)."""
    m = measure_norms(ctx)
    tensors = {"residual_rms": m.residual.rms, "cosine": m.agreement.cosine,
               "stream": m.residual.stream,
               **{f"out/{k}": v for k, v in m.others.outputs.items()}}
    return norms_prose(m).section("norms", TITLE, plot_norms(m), tensors)
