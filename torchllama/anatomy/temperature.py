"""Section 5 of the report: how temperature, top-p and min-p reshape the real next-token
distribution, using the sampler's own filters (`torchllama.generation.sampling`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchllama.anatomy.report import (AnatomyContext, Explorer, Figure, Prose, Section, Table,
                                       float32_blob, token_labels)
from torchllama.generation.sampling import apply_temperature, min_p_filter, top_p_filter

#: the prompt whose next token is shown (an open continuation with many plausible tokens)
DEFAULT_PROMPT = "Once upon a time, there was a little"
TEMPERATURES = (0.2, 0.5, 0.7, 1.0, 1.5, 2.0)
TOP_P, MIN_P, TOP_N = 0.9, 0.05, 20


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def distribution_stats(logits: torch.Tensor, temperature: float, top_p: float = TOP_P,
                       min_p: float = MIN_P) -> dict:
    """The next-token distribution at one temperature and what top-p and min-p keep of it.

    Args:
        logits: (V,) float32 next-token logits.

    Returns:
        dict with "probs" (V,) softmax(logits / T); "entropy" in nats, −Σ p ln p;
        "top_p_kept" and "min_p_kept", the number of tokens each filter keeps, and their
        probability mass; "top1" the largest probability.
    """
    scaled = apply_temperature(logits[None], temperature)                  # (1, V)
    probs = torch.softmax(scaled, dim=-1)[0]                               # (V,)
    h = -(probs * probs.clamp_min(1e-30).log()).sum().item()               # nats
    kept_p = torch.isfinite(top_p_filter(scaled, top_p))[0]                # (V,) bool
    kept_m = torch.isfinite(min_p_filter(scaled, min_p))[0]                # (V,) bool
    return {"probs": probs, "entropy": h, "top1": probs.max().item(),
            "top_p_kept": int(kept_p.sum()), "top_p_mass": probs[kept_p].sum().item(),
            "min_p_kept": int(kept_m.sum()), "min_p_mass": probs[kept_m].sum().item()}


@dataclass
class NextTokenDistribution:
    """The next-token distribution of a prompt across temperatures.

    Attributes:
        prompt: the prompt text.
        logits: (V,) float32 next-token logits of the prompt's last position.
        stats: T → `distribution_stats(logits, T)`, for every T of TEMPERATURES ("probs" (V,)
            float32, "entropy" in nats, token counts and masses of top-p and min-p).
        top_ids: (TOP_N,) int64 the most likely tokens, best first (the same at any T).
        top_labels: their printable labels.
        curve_temperatures: (39,) float32 temperatures 0.1 … 2.0 of the curves.
        curve: `distribution_stats` at each curve temperature.
    """

    prompt: str
    logits: torch.Tensor
    stats: dict[float, dict]
    top_ids: torch.Tensor
    top_labels: list[str]
    curve_temperatures: torch.Tensor
    curve: list[dict]


def measure_sampling(ctx: AnatomyContext) -> NextTokenDistribution:
    """The model's next-token distribution after the prompt (ctx.options["sampling_prompt"],
    default DEFAULT_PROMPT) at TEMPERATURES and along 39 temperatures 0.1 … 2.0."""
    model, tok = ctx.model, ctx.tokenizer
    prompt = ctx.options.get("sampling_prompt", DEFAULT_PROMPT)
    ctx.progress("next-token distribution")
    ids = tok.encode(prompt, bos=tok.add_bos and tok.bos_id is not None)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), last_only=True)[0, -1]         # (V,) fp32
    stats = {t: distribution_stats(logits, t) for t in TEMPERATURES}
    order = logits.topk(TOP_N).indices                                     # (20,) same at any T
    grid = torch.linspace(0.1, 2.0, 39)
    return NextTokenDistribution(
        prompt=prompt, logits=logits, stats=stats, top_ids=order,
        top_labels=token_labels(tok, order.tolist()), curve_temperatures=grid,
        curve=[distribution_stats(logits, float(t)) for t in grid])


def plot_temperatures(m: NextTokenDistribution) -> Figure:
    """The TOP_N most likely tokens at each temperature, min-p's cut and top-p's end marked."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), sharey=True)
    for ax, t in zip(axes.flat, TEMPERATURES):
        s = m.stats[t]
        p = s["probs"][m.top_ids].numpy()
        colors = ["tab:blue" if i < s["min_p_kept"] else "tab:gray" for i in range(TOP_N)]
        ax.barh(range(TOP_N), p, color=colors)
        if s["top_p_kept"] <= TOP_N:
            ax.axhline(s["top_p_kept"] - 0.5, color="tab:red", linestyle="--", linewidth=1)
        ax.set_title(f"T = {t}: top-p {TOP_P} keeps {s['top_p_kept']}, min-p {MIN_P} keeps "
                     f"{s['min_p_kept']}", fontsize=8)
        ax.set_yticks(range(TOP_N), m.top_labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel("probability", fontsize=8)
    fig.suptitle(f"Next token after “{m.prompt}”", fontsize=10)
    fig.tight_layout()
    return Figure("temperatures", "The 20 most likely next tokens at each temperature. "
                  "Blue: kept by min-p 0.05 (p ≥ 0.05 · p_max); grey: cut. Red dashed "
                  "line: the end of the top-p 0.9 nucleus (when within the 20).", fig)


def plot_entropy(m: NextTokenDistribution) -> Figure:
    """Entropy and the tokens top-p and min-p keep, against temperature."""
    plt = _pyplot()
    grid, curve = m.curve_temperatures, m.curve
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(grid.numpy(), [c["entropy"] for c in curve], label="entropy (nats)")
    ax2 = ax.twinx()
    ax2.semilogy(grid.numpy(), [c["top_p_kept"] for c in curve], color="tab:red",
                 label=f"tokens in top-p {TOP_P}")
    ax2.semilogy(grid.numpy(), [c["min_p_kept"] for c in curve], color="tab:green",
                 label=f"tokens kept by min-p {MIN_P}")
    ax.set_xlabel("temperature")
    ax.set_ylabel("entropy (nats)")
    ax2.set_ylabel("tokens kept (log)")
    fig.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.12, 0.88))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return Figure("entropy", "Entropy of the next-token distribution and the number of "
                  "tokens top-p and min-p keep, as temperature grows.", fig)


LOOK_FOR = (
    "Generation samples the next token from softmax(logits / T). Below 1 the temperature "
    "sharpens the distribution towards the argmax (T → 0 is greedy decoding); above 1 it "
    "flattens it, and the long tail of unlikely tokens gains mass, which is where "
    "incoherent text comes from. Top-p (Holtzman et al. 2020) keeps the smallest set of "
    "tokens whose mass reaches p, so its size follows the distribution's shape: a few "
    "tokens when the model is sure, thousands when it is flat. Min-p (Nguyen et al. 2024) "
    "keeps tokens with at least min_p times the top probability, which stays small even at "
    "high temperature — compare the two curves.")


def sampling_prose(m: NextTokenDistribution) -> Prose:
    """The sampling section's headline, table per temperature and anatomy.json entry."""
    stats, curve = m.stats, m.curve
    rows = [[t, stats[t]["top1"], stats[t]["entropy"], stats[t]["top_p_kept"],
             stats[t]["min_p_kept"]] for t in TEMPERATURES]
    cold, hot = stats[TEMPERATURES[0]], stats[TEMPERATURES[-1]]
    headline = [
        f"Most likely next token {m.top_labels[0]!r}: p = {stats[1.0]['top1']:.2f} at T = 1, "
        f"{cold['top1']:.2f} at T = {TEMPERATURES[0]}, {hot['top1']:.3f} at T = "
        f"{TEMPERATURES[-1]}.",
        f"Entropy {cold['entropy']:.2f} → {stats[1.0]['entropy']:.2f} → {hot['entropy']:.2f} "
        f"nats; the top-p {TOP_P} nucleus grows from {cold['top_p_kept']} to "
        f"{stats[1.0]['top_p_kept']} to {hot['top_p_kept']:,} tokens, min-p {MIN_P} keeps "
        f"{cold['min_p_kept']} → {stats[1.0]['min_p_kept']} → {hot['min_p_kept']}.",
    ]
    data = {"prompt": m.prompt, "top_tokens": m.top_labels, "top_ids": m.top_ids.tolist(),
            "temperatures": list(TEMPERATURES),
            "top_probs": {str(t): stats[t]["probs"][m.top_ids].tolist() for t in TEMPERATURES},
            "per_temperature": {str(t): {k: v for k, v in stats[t].items() if k != "probs"}
                                for t in TEMPERATURES},
            "curve_temperatures": m.curve_temperatures.tolist(),
            "curve_entropy": [c["entropy"] for c in curve],
            "curve_top_p_kept": [c["top_p_kept"] for c in curve],
            "curve_min_p_kept": [c["min_p_kept"] for c in curve]}
    table = Table("Per temperature", ["T", "p(top token)", "entropy (nats)",
                                      f"top-p {TOP_P} keeps", f"min-p {MIN_P} keeps"], rows)
    return Prose(LOOK_FOR, headline, data, [table])


def sampling_explorer(m: NextTokenDistribution) -> Explorer:
    """The interactive view: temperature, top-p and min-p sliders over the prompt's (V,)
    float32 logits (embedded whole: the kept set depends on every token's mass), the TOP_N
    most likely tokens drawn, the kept set counted by the sampler's rules in the browser."""
    return Explorer(
        "kept-set", "sampling",
        "Move the sliders: the bars are softmax(logits / T) of the 20 most likely tokens, blue "
        "where the sampler would keep them. The counts are computed in your browser from all "
        "the model's logits, by the rules of torchllama.generation.sampling.",
        {"prompt": m.prompt, "logits": float32_blob(m.logits), "top_labels": m.top_labels,
         "defaults": {"temperature": 1.0, "top_p": TOP_P, "min_p": MIN_P}})


def sampling_section(ctx: AnatomyContext) -> Section:
    """The next-token distribution of a prompt at temperatures 0.2 → 2: the top 20 tokens with
    their probabilities, the top-p nucleus and the min-p cut marked; entropy vs temperature;
    the same interactively (`sampling_explorer`)."""
    m = measure_sampling(ctx)
    figures = [plot_temperatures(m), plot_entropy(m)]
    section = sampling_prose(m).section("sampling", "Sampling: temperature, top-p, min-p",
                                        figures, {"logits": m.logits})
    section.explorers.append(sampling_explorer(m))
    return section
