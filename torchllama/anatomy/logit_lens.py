"""Section 6 of the report: the logit lens (nostalgebraist 2020, "interpreting GPT: the logit
lens"): the final norm and output projection applied to the residual stream after every block,
showing at which depth each position's prediction forms."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchllama.anatomy.capture import residual_stream
from torchllama.anatomy.report import (AnatomyContext, Explorer, Figure, Prose, Section,
                                       float32_blob, token_labels)

#: positions shown in the grid (the text's first tokens)
LENS_TOKENS = 16


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


@torch.no_grad()
def logit_lens(model, tokens: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token predictions read from the residual stream after each block (nostalgebraist
    2020, "interpreting GPT: the logit lens").

    Args:
        tokens: (1, T) int64.
        k: how many of the most likely tokens to return.

    Returns:
        (top_ids, top_probs), each (L, T) for k = 1, else (L, T, k) best first: at layer l
        (after block l) and position t, the most likely next tokens of
        softmax(output(norm(h_l))) and their probabilities. The last row is the model's own
        prediction.
    """
    h = residual_stream(model, tokens)[1:, 0]                        # (L, T, D) fp32
    if hasattr(model, "norm"):
        h = model.norm(h)                                            # (L, T, D)
    probs = torch.softmax(model.logits(h), dim=-1)                   # (L, T, V)
    top = probs.topk(k, dim=-1)                                      # (L, T, k) each
    if k == 1:
        return top.indices[..., 0], top.values[..., 0]               # (L, T) each
    return top.indices, top.values


@dataclass
class LogitLens:
    """The logit lens of the text: what each layer would predict.

    Attributes:
        top_ids, top_probs: (L, T) int64 / float32, the most likely next token read after
            each block and its probability (`logit_lens`); the last row is the model's output.
        agreement: (L,) float32 share of positions whose top token equals the final one.
        first_agreeing: the first layer with agreement ≥ 0.5 (L − 1 if none).
        words: the first n = min(LENS_TOKENS, T) predicted tokens of each layer, as labels.
        input_labels: the labels of the first n input tokens.
        top_k_ids, top_k_probs: (L, T, TOP_K) the TOP_K most likely, best first (the
            explorer's table).
        vocab: label of every token id in top_k_ids.
    """

    top_ids: torch.Tensor
    top_probs: torch.Tensor
    agreement: torch.Tensor
    first_agreeing: int
    words: list[list[str]]
    input_labels: list[str]
    top_k_ids: torch.Tensor
    top_k_probs: torch.Tensor
    vocab: dict[int, str]


#: tokens per block and position in the explorer
TOP_K = 5


def measure_logit_lens(ctx: AnatomyContext) -> LogitLens:
    """`logit_lens` of ctx's text and how early it agrees with the final prediction."""
    ctx.progress("logit lens")
    top_k_ids, top_k_probs = logit_lens(ctx.model, ctx.tokens, TOP_K)  # (L, T, k) each
    top_ids, top_probs = top_k_ids[..., 0], top_k_probs[..., 0]        # (L, T) each
    L, T = top_ids.shape
    used = sorted(set(top_k_ids.flatten().tolist()))
    agree = (top_ids == top_ids[-1]).float().mean(1)                 # (L,)
    n = min(LENS_TOKENS, T)
    return LogitLens(top_ids=top_ids, top_probs=top_probs, agreement=agree,
                     first_agreeing=next((l for l in range(L) if agree[l] >= 0.5), L - 1),
                     words=[token_labels(ctx.tokenizer, row[:n].tolist()) for row in top_ids],
                     input_labels=ctx.labels[:n], top_k_ids=top_k_ids, top_k_probs=top_k_probs,
                     vocab=dict(zip(used, token_labels(ctx.tokenizer, used))))


def plot_lens_grid(m: LogitLens) -> Figure:
    """Layers × the first positions: the predicted token, coloured by its probability."""
    plt = _pyplot()
    L, n = m.top_ids.shape[0], len(m.input_labels)
    fig, ax = plt.subplots(figsize=(1.0 * n + 2, 0.32 * L + 1.5))
    ax.imshow(m.top_probs[:, :n].numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto",
              interpolation="nearest")
    for l in range(L):
        for t in range(n):
            ax.text(t, l, m.words[l][t][:8], ha="center", va="center", fontsize=6,
                    color="white" if m.top_probs[l, t] > 0.6 else "black")
    ax.set_xticks(range(n), [f"{w}\n→" for w in m.input_labels], fontsize=7)
    ax.set_yticks(range(L), [f"after block {l}" for l in range(L)], fontsize=6)
    ax.set_title("Top next token read from the residual stream (colour: its probability)",
                 fontsize=9)
    fig.tight_layout()
    return Figure("grid", f"Layers × the first {n} positions: the most likely next token read "
                  "after each block (column label: the input token at that position).", fig)


def plot_agreement(m: LogitLens) -> Figure:
    """Per layer: agreement with the final prediction and the mean top-1 probability."""
    plt = _pyplot()
    L = m.top_ids.shape[0]
    fig2, ax2 = plt.subplots(figsize=(7, 3))
    ax2.plot(range(L), m.agreement.numpy(), "o-", label="top-1 = final prediction")
    ax2.plot(range(L), m.top_probs.mean(1).numpy(), "s-", label="mean top-1 probability")
    ax2.set_xlabel("layer (after block)")
    ax2.set_ylim(0, 1.02)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig2.tight_layout()
    return Figure("agreement", "Share of positions whose lens prediction already equals the "
                  "model's final prediction, and the mean top-1 probability, by layer.", fig2)


LOOK_FOR = (
    "The residual stream is a running sum that every block adds to, and only the final norm "
    "and output projection turn it into next-token logits. Applying them early (the logit "
    "lens) shows what the model would predict if it stopped after block l. Read each column "
    "top to bottom: early layers mostly echo the input token or common words; the final "
    "prediction appears part-way down and its probability grows; the last row is the "
    "model's real output. A lens trained per layer (the tuned lens) reads early layers "
    "better; this is the plain one.")


def logit_lens_prose(m: LogitLens) -> Prose:
    """The logit-lens section's headline and anatomy.json entry."""
    L, T = m.top_ids.shape
    headline = [f"The lens agrees with the final prediction at ≥ 50% of the {T} positions "
                f"from block {m.first_agreeing} of {L} on; after block {L // 2} it agrees at "
                f"{m.agreement[L // 2]:.0%}."]
    data = {"top_ids": m.top_ids.tolist(), "top_probs": m.top_probs.tolist(),
            "agreement": m.agreement.tolist(), "grid_words": m.words,
            "first_agreeing_layer": m.first_agreeing}
    return Prose(LOOK_FOR, headline, data)


def lens_explorer(m: LogitLens, ctx: AnatomyContext) -> Explorer:
    """The interactive view (explorers.js `lensExplorer`): click a position of the text to
    see the TOP_K next tokens and probabilities after every block; a block slider."""
    L, T, _ = m.top_k_ids.shape
    return Explorer(
        "positions", "lens",
        "Click a token of the text: the table lists, after every block, the five most likely "
        "next tokens read through the final norm and output head, with their probabilities; "
        "the slider picks a block for the readout.",
        {"ids": m.top_k_ids.tolist(), "probs": float32_blob(m.top_k_probs),
         "words": {str(i): w for i, w in m.vocab.items()}, "labels": ctx.labels[:T],
         "position": min(T - 1, LENS_TOKENS - 1)})


def logit_lens_section(ctx: AnatomyContext) -> Section:
    """A layers × positions grid of the top next-token at each depth, coloured by its
    probability, and per layer the share of positions where it already equals the final one;
    the top 5 per block at any position interactively (`lens_explorer`)."""
    m = measure_logit_lens(ctx)
    section = logit_lens_prose(m).section(
        "logit-lens", "Logit lens: the prediction layer by layer",
        [plot_lens_grid(m), plot_agreement(m)], {"top_ids": m.top_ids, "top_probs": m.top_probs})
    section.explorers.append(lens_explorer(m, ctx))
    return section
