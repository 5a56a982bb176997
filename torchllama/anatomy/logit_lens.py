"""Section 6 of the report: the logit lens (nostalgebraist 2020, "interpreting GPT: the logit
lens"): the final norm and output projection applied to the residual stream after every block,
showing at which depth each position's prediction forms."""

from __future__ import annotations

import torch

from torchllama.anatomy.capture import residual_stream
from torchllama.anatomy.report import AnatomyContext, Figure, Section, token_labels

#: positions shown in the grid (the text's first tokens)
LENS_TOKENS = 16


@torch.no_grad()
def logit_lens(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token predictions read from the residual stream after each block.

    Args:
        tokens: (1, T) int64.

    Returns:
        (top_ids, top_probs), each (L, T): at layer l (after block l) and position t, the most
        likely next token of softmax(output(norm(h_l))) and its probability. The last row is the
        model's own prediction.
    """
    h = residual_stream(model, tokens)[1:, 0]                        # (L, T, D) fp32
    if hasattr(model, "norm"):
        h = model.norm(h)                                            # (L, T, D)
    probs = torch.softmax(model.logits(h), dim=-1)                   # (L, T, V)
    top = probs.max(-1)
    return top.indices, top.values


def logit_lens_section(ctx: AnatomyContext) -> Section:
    """A layers × positions grid of the top next-token at each depth, coloured by its
    probability, and per layer the share of positions where it already equals the final one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model, tok = ctx.model, ctx.tokenizer
    ctx.progress("logit lens")
    top_ids, top_probs = logit_lens(model, ctx.tokens)              # (L, T) each
    L, T = top_ids.shape
    agree = (top_ids == top_ids[-1]).float().mean(1)                 # (L,)
    first = next((l for l in range(L) if agree[l] >= 0.5), L - 1)
    n = min(LENS_TOKENS, T)
    words = [token_labels(tok, row[:n].tolist()) for row in top_ids]

    fig, ax = plt.subplots(figsize=(1.0 * n + 2, 0.32 * L + 1.5))
    ax.imshow(top_probs[:, :n].numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto",
              interpolation="nearest")
    for l in range(L):
        for t in range(n):
            ax.text(t, l, words[l][t][:8], ha="center", va="center", fontsize=6,
                    color="white" if top_probs[l, t] > 0.6 else "black")
    ax.set_xticks(range(n), [f"{w}\n→" for w in ctx.labels[:n]], fontsize=7)
    ax.set_yticks(range(L), [f"after block {l}" for l in range(L)], fontsize=6)
    ax.set_title("Top next token read from the residual stream (colour: its probability)",
                 fontsize=9)
    fig.tight_layout()
    fig2, ax2 = plt.subplots(figsize=(7, 3))
    ax2.plot(range(L), agree.numpy(), "o-", label="top-1 = final prediction")
    ax2.plot(range(L), top_probs.mean(1).numpy(), "s-", label="mean top-1 probability")
    ax2.set_xlabel("layer (after block)")
    ax2.set_ylim(0, 1.02)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig2.tight_layout()
    return Section(
        "logit-lens", "Logit lens: the prediction layer by layer",
        "The residual stream is a running sum that every block adds to, and only the final norm "
        "and output projection turn it into next-token logits. Applying them early (the logit "
        "lens) shows what the model would predict if it stopped after block l. Read each column "
        "top to bottom: early layers mostly echo the input token or common words; the final "
        "prediction appears part-way down and its probability grows; the last row is the "
        "model's real output. A lens trained per layer (the tuned lens) reads early layers "
        "better; this is the plain one.",
        [Figure("grid", f"Layers × the first {n} positions: the most likely next token read "
                "after each block (column label: the input token at that position).", fig),
         Figure("agreement", "Share of positions whose lens prediction already equals the "
                "model's final prediction, and the mean top-1 probability, by layer.", fig2)],
        headline=[f"The lens agrees with the final prediction at ≥ 50% of the {T} positions "
                  f"from block {first} of {L} on; after block {L // 2} it agrees at "
                  f"{agree[L // 2]:.0%}."],
        data={"top_ids": top_ids.tolist(), "top_probs": top_probs.tolist(),
              "agreement": agree.tolist(), "grid_words": words, "first_agreeing_layer": first},
        tensors={"top_ids": top_ids, "top_probs": top_probs})
