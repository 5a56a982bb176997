"""Sections 1 and 2 of the report: attention maps and head roles, from the attention
probabilities the model computes in its own forward pass (`capture_attention`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchllama.anatomy.capture import capture_attention
from torchllama.anatomy.report import (AnatomyContext, Explorer, Figure, Prose, Section, Table,
                                       float32_blob, token_labels)
from torchllama.anatomy.scores import (CATEGORIES, classify_heads, duplicate_token_score,
                                       entropy, induction_score, local_score,
                                       previous_token_score, repeated_random_tokens, self_score,
                                       sink_score)

#: tokens of the text drawn in the attention maps (labels stay legible up to about this many)
MAP_TOKENS = 32
#: the two prompts of different lengths of the left-padded batch
PADDED_PROMPTS = ("The cat sat on the mat.",
                  "Once upon a time there lived a king who had three daughters.")
#: length n of the random sequence that the induction test repeats, and how many sequences
INDUCTION_LEN, INDUCTION_BATCH = 50, 4
#: the score above which a head counts as an induction / previous-token head
ROLE_THRESHOLD = 0.4


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


@torch.no_grad()
def attention_probs(model, tokens: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
    """Every layer's attention probabilities for tokens (B, T) in one forward pass:
    (L, B, H, T, T) float32 (per query head; rows sum to 1)."""
    with capture_attention(model) as cap:
        model(tokens, pad=pad, hidden=True)
    return cap.probs


def _heatmap(ax, probs: torch.Tensor, labels: list[str] | None, title: str, mask=None):
    """One (T, T) map; masked (never attended) cells in grey."""
    data = probs.numpy().copy()
    if mask is None and probs.shape[0] == probs.shape[1]:                 # causal: s ≤ t
        mask = torch.ones(probs.shape, dtype=torch.bool).tril()
    if mask is not None:
        import numpy as np
        data = np.ma.masked_where(~mask.numpy(), data)
    cmap = _plt().get_cmap("viridis").with_extremes(bad="#d0d0d0")
    ax.imshow(data, cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
    ax.set_title(title, fontsize=8)
    if labels:
        ticks = range(len(labels))
        ax.set_xticks(ticks, labels, rotation=90, fontsize=6)
        ax.set_yticks(ticks, labels, fontsize=6)
    else:
        ax.set_xticks([])
        ax.set_yticks([])


# ---- attention maps ----------------------------------------------------------------------------

@dataclass
class AttentionMaps:
    """Attention probabilities of the text's first tokens and of a left-padded batch.

    Attributes:
        labels: the T (≤ MAP_TOKENS) token labels of the mapped tokens.
        probs: (L, H, T, T) float32 attention of every layer and query head; rows sum to 1.
        mean: (L, T, T) float32, probs averaged over heads.
        layer: the layer whose heads are drawn one by one.
        sink: (L,) float32 mean attention of queries 1..T−1 on the first token.
        padded_probs: (L, 2, H, W, W) float32 attention of the left-padded batch of
            PADDED_PROMPTS (W the longer prompt's tokens).
        pad: (2,) int64 padding slots on the left of each row of the batch.
        padded_labels: per row, W labels: "<pad>" for each padding slot, then the tokens.
        alone_diff: max |Δ probability| between the batch's real slots and each prompt alone.
    """

    labels: list[str]
    probs: torch.Tensor
    mean: torch.Tensor
    layer: int
    sink: torch.Tensor
    padded_probs: torch.Tensor
    pad: torch.Tensor
    padded_labels: list[list[str]]
    alone_diff: float


def padded_batch(model, tok) -> tuple[torch.Tensor, torch.Tensor, list[list[str]], float]:
    """PADDED_PROMPTS as one left-padded batch: its attention (L, 2, H, W, W), the padding
    (2,), each row's labels, and the max |Δ| of its real slots against each prompt alone."""
    bos = tok.add_bos and tok.bos_id is not None
    ids = [tok.encode(p, bos=bos) for p in PADDED_PROMPTS]
    width = max(map(len, ids))
    pad_id = tok.pad_id if tok.pad_id is not None else 0
    batch = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids])   # (2, W) left-padded
    pad = torch.tensor([width - len(x) for x in ids])                       # (2,)
    batched = attention_probs(model, batch, pad)                             # (L, 2, H, W, W)
    alone_diff = 0.0
    for b, x in enumerate(ids):
        alone = attention_probs(model, torch.tensor([x]))[:, 0]             # (L, H, n, n)
        p = int(pad[b])
        alone_diff = max(alone_diff, (batched[:, b, :, p:, p:] - alone).abs().max().item())
    labels = [["<pad>"] * int(pad[b]) + token_labels(tok, ids[b]) for b in range(2)]
    return batched, pad, labels, alone_diff


def measure_attention(ctx: AnatomyContext) -> AttentionMaps:
    """The attention maps of ctx's first MAP_TOKENS tokens and of the padded batch."""
    ctx.progress("attention maps")
    tokens = ctx.tokens[:, :MAP_TOKENS]                                # (1, T)
    probs = attention_probs(ctx.model, tokens)[:, 0]                   # (L, H, T, T)
    L = probs.shape[0]
    layer = ctx.options.get("attention_layer", L // 2)
    ctx.progress("padded batch")
    batched, pad, padded_labels, alone_diff = padded_batch(ctx.model, ctx.tokenizer)
    return AttentionMaps(labels=ctx.labels[:MAP_TOKENS], probs=probs,
                         mean=probs.mean(1),                           # (L, T, T)
                         layer=layer, sink=probs[:, :, 1:, 0].mean((1, 2)),   # (L,)
                         padded_probs=batched, pad=pad, padded_labels=padded_labels,
                         alone_diff=alone_diff)


def plot_layer_heads(m: AttentionMaps) -> Figure:
    """Every head of layer m.layer, with the tokens as labels."""
    plt = _plt()
    L, H, T, _ = m.probs.shape
    side = max(4.0, 0.22 * T)
    cols = min(H, 3)
    rows = -(-H // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols, side * rows), squeeze=False)
    for h in range(rows * cols):
        ax = axes.flat[h]
        if h < H:
            _heatmap(ax, m.probs[m.layer, h], m.labels, f"layer {m.layer}, head {h}")
        else:
            ax.axis("off")
    fig.tight_layout()
    return Figure(f"layer{m.layer}-heads", f"Every head of layer {m.layer} on the first "
                  f"{T} tokens: row = query, column = key; above the diagonal is "
                  f"masked (causal).", fig)


def plot_layer_means(m: AttentionMaps) -> Figure:
    """Every layer's attention averaged over heads, small multiples."""
    plt = _plt()
    L, H = m.probs.shape[:2]
    cols = 6
    rows = -(-L // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.0 * cols, 2.0 * rows), squeeze=False)
    for l in range(rows * cols):
        ax = axes.flat[l]
        if l < L:
            _heatmap(ax, m.mean[l], None, f"layer {l}")
        else:
            ax.axis("off")
    fig.suptitle("Mean over heads, every layer", fontsize=10)
    fig.tight_layout()
    return Figure("layers-mean", f"Each layer's attention averaged over its {H} heads "
                  "(same tokens): the first column lights up where heads sink "
                  "attention on the first token.", fig)


def plot_padded_batch(m: AttentionMaps) -> Figure:
    """Layer 0's mean attention of each row of the padded batch, masked slots grey."""
    plt = _plt()
    width = m.padded_probs.shape[-1]
    slots = torch.arange(width)
    fig, axes = plt.subplots(1, 2, figsize=(2 * max(4.0, 0.3 * width), max(4.0, 0.3 * width)))
    for b in range(2):
        real = slots >= m.pad[b]                                           # (W,)
        mask = (slots[None, :] <= slots[:, None]) & real[None, :] & real[:, None]  # (W, W)
        _heatmap(axes[b], m.padded_probs[0, b].mean(0), m.padded_labels[b],
                 f"row {b}: {int(m.pad[b])} padding slots", mask=mask)
    fig.tight_layout()
    return Figure("padded-batch", "A left-padded batch of two prompts, layer 0 mean "
                  "over heads. Grey: slots never attended — the causal mask above the "
                  "diagonal and the padding columns (padding rows are not used).", fig)


ATTENTION_LOOK_FOR = (
    "Each map shows, for every query token (row), how its attention is spread over the "
    "keys it may see (columns). Everything above the diagonal is zero: the causal mask. "
    "Look for diagonal stripes (a head reading the previous token or itself), a bright "
    "first column (an attention sink parking probability on the first token), and "
    "vertical lines at punctuation or repeated words. With grouped-query attention the "
    "heads of one group share keys and values but each has its own queries, so their maps "
    "differ. In the padded batch, the shorter prompt's padding columns stay empty: each "
    "row computes exactly what it would alone.")


def attention_prose(m: AttentionMaps) -> Prose:
    """The attention section's headline and anatomy.json entry."""
    L, H, T, _ = m.probs.shape
    headline = [
        f"Layer {m.layer}: {H} heads on {T} tokens; mean attention on the first token across "
        f"layers {m.sink.min():.2f}–{m.sink.max():.2f}.",
        f"Left-padded batch vs each prompt alone: max |Δ attention| = {m.alone_diff:.1e} "
        f"(padding changes nothing).",
    ]
    data = {"layer": m.layer, "labels": m.labels, "probs_layer": m.probs[m.layer].tolist(),
            "mean_over_heads": m.mean.tolist(),
            "padded_batch_mean_layer0": m.padded_probs[0].mean(1).tolist(),
            "padded_pad": m.pad.tolist(), "padded_vs_alone_max_abs_diff": m.alone_diff,
            "sink_by_layer": m.sink.tolist()}
    return Prose(ATTENTION_LOOK_FOR, headline, data)


def attention_section(ctx: AnatomyContext) -> Section:
    """Attention maps: per layer and head (B, H, T, S) from the model's own forward, as
    heatmaps with the tokens as labels; every layer's mean over heads; a left-padded batch of
    two prompts that shows the causal and padding masks (each row checked against the same
    prompt alone)."""
    m = measure_attention(ctx)
    figures = [plot_layer_heads(m), plot_layer_means(m), plot_padded_batch(m)]
    return attention_prose(m).section(
        "attention", "Attention maps", figures,
        {"probs": m.probs, "padded_probs": m.padded_probs, "pad": m.pad})


# ---- head roles --------------------------------------------------------------------------------

def head_scores(model, tokens: torch.Tensor, induction_tokens: torch.Tensor) -> dict:
    """Every score of `torchllama.anatomy.scores` for every head: text tokens (1, T) for the
    text scores, induction_tokens (N, P + 2n) repeated random sequences for the induction
    score. Returns name → (L, H) float32."""
    probs = attention_probs(model, tokens)[:, 0]                        # (L, H, T, T)
    ids = tokens[0]
    window = min(4, tokens.shape[1] - 1)
    scores = {"previous": previous_token_score(probs), "self": self_score(probs),
              "sink": sink_score(probs), "local": local_score(probs, window),
              "entropy": entropy(probs), "entropy_normalized": entropy(probs, normalized=True),
              "duplicate": duplicate_token_score(probs, ids)}
    rep = attention_probs(model, induction_tokens)                      # (L, N, H, S, S)
    scores["induction"] = torch.stack([induction_score(rep[:, b], induction_tokens[b])
                                       for b in range(rep.shape[1])]).mean(0)   # (L, H)
    return scores


#: the scores drawn as heatmaps (key in `head_scores`, title); the first four fill the table
SHOWN_SCORES = [("previous", "previous-token"), ("induction", "induction"),
                ("duplicate", "duplicate-token"), ("sink", "sink (first token)"),
                ("local", "local (last 4)"), ("entropy_normalized", "entropy / max")]


@dataclass
class HeadRoles:
    """Every head's scores and category.

    Attributes:
        scores: name → (L, H) float32, each in [0, 1] except "entropy" (nats): `head_scores`.
        categories: L rows of H category names (`classify_heads`).
        counts: category → number of heads, for every name of CATEGORIES.
        sink: (L,) float32 sink score averaged over each layer's heads.
        induction_tokens: (N, P + 2n) int64 repeated random sequences of the induction score.
    """

    scores: dict[str, torch.Tensor]
    categories: list[list[str]]
    counts: dict[str, int]
    sink: torch.Tensor
    induction_tokens: torch.Tensor

    def top(self, key: str, k: int = 5) -> list[tuple[int, int, float]]:
        """The k heads with the highest score `key`: (layer, head, score), best first."""
        H = self.scores[key].shape[1]
        flat = self.scores[key].flatten()
        best = flat.topk(min(k, flat.numel())).indices
        return [(int(i) // H, int(i) % H, float(flat[i])) for i in best]


def measure_heads(ctx: AnatomyContext) -> HeadRoles:
    """Every score of every head on ctx's text and on repeated random tokens (seed ctx.seed)."""
    model, tok = ctx.model, ctx.tokenizer
    ctx.progress("head scores")
    special = set(tok.special_tokens.values()) | {tok.bos_id, tok.eos_id, tok.pad_id}
    vocab = [i for i in range(min(model.args.vocab_size, tok.vocab_size)) if i not in special]
    gen = torch.Generator().manual_seed(ctx.seed)
    n = min(INDUCTION_LEN, (model.args.max_seq_len - 1) // 2)
    prefix = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    rep = repeated_random_tokens(n, vocab, INDUCTION_BATCH, prefix, gen)   # (N, P + 2n)
    scores = head_scores(model, ctx.tokens, rep)
    categories = classify_heads(scores)
    return HeadRoles(scores=scores, categories=categories,
                     counts={c: sum(row.count(c) for row in categories) for c in CATEGORIES},
                     sink=scores["sink"].mean(1), induction_tokens=rep)   # (L,)


def plot_score_maps(m: HeadRoles) -> Figure:
    """One layer × head heatmap per score of SHOWN_SCORES."""
    plt = _plt()
    L, H = m.scores["previous"].shape
    fig, axes = plt.subplots(1, len(SHOWN_SCORES),
                             figsize=(2.6 * len(SHOWN_SCORES), max(3.0, 0.16 * L + 1)))
    for ax, (key, title) in zip(axes, SHOWN_SCORES):
        im = ax.imshow(m.scores[key].numpy(), vmin=0, vmax=1, cmap="magma", aspect="auto",
                       interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("head")
        ax.set_xticks(range(H))
        ax.tick_params(labelsize=6)
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes, shrink=0.8)
    return Figure("scores", "Scores of every head (rows: layers, columns: heads), each in "
                  "[0, 1]. Induction: repeated random tokens; the others: the text.", fig)


def plot_scores_by_layer(m: HeadRoles) -> Figure:
    """Per layer: the mean sink score and the strongest previous-token and induction head."""
    plt = _plt()
    L = m.sink.shape[0]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(range(L), m.sink.numpy(), "o-", label="sink (first token)")
    ax.plot(range(L), m.scores["previous"].max(1).values.numpy(), "s-",
            label="max previous-token")
    ax.plot(range(L), m.scores["induction"].max(1).values.numpy(), "^-", label="max induction")
    ax.set_xlabel("layer")
    ax.set_ylabel("score")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return Figure("by-layer", "By layer: mean attention-sink mass over the heads, and "
                  "the strongest previous-token and induction head.", fig)


def plot_categories(m: HeadRoles) -> Figure:
    """The category of every head as a layer × head grid."""
    from matplotlib.patches import Patch

    plt = _plt()
    L, H = m.scores["previous"].shape
    fig, ax = plt.subplots(figsize=(max(4, 0.3 * H + 2), max(3, 0.16 * L + 1)))
    grid = torch.tensor([[CATEGORIES.index(c) for c in row] for row in m.categories])
    cmap = plt.get_cmap("tab10", len(CATEGORIES))
    ax.imshow(grid.numpy(), cmap=cmap, vmin=-0.5, vmax=len(CATEGORIES) - 0.5, aspect="auto",
              interpolation="nearest")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.legend(handles=[Patch(color=cmap(i), label=f"{c} ({m.counts[c]})")
                       for i, c in enumerate(CATEGORIES)], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    return Figure("categories", "The simple categories: previous-token (score ≥ 0.5), "
                  "self, sink, local (≥ 0.8 of the mass on the last 4 tokens), uniform "
                  "(normalized entropy ≥ 0.8), else mixed.", fig)


HEADS_LOOK_FOR = (
    "Scores summarise each head's attention pattern. A previous-token head puts its "
    "attention on the token just before; an induction head (Olsson et al. 2022), on a "
    "sequence it has seen before, attends to the token that followed the earlier "
    "occurrence of the current one — the copy mechanism behind in-context learning, "
    "measured on random tokens repeated twice so that only copying can predict the second "
    "half. Previous-token heads in early layers feed induction heads in later ones. "
    "Duplicate-token heads attend to earlier copies of the current token. Most heads of "
    "a trained model park much of their attention on the first token, an attention sink "
    "(Xiao et al. 2023) that lets a head do nothing; StreamingLLM keeps those first tokens "
    "in its cache for that reason. Entropy near its maximum means the head averages "
    "evenly over the context.")


def heads_prose(m: HeadRoles) -> Prose:
    """The heads section's headline, table of the strongest heads and anatomy.json entry."""
    L, H = m.scores["previous"].shape
    sink, counts = m.sink, m.counts
    rows = []
    for key, title in SHOWN_SCORES[:4]:
        for layer, head, value in m.top(key, 3):
            rows.append([title, f"L{layer}.H{head}", value, m.categories[layer][head]])
    n_ind = int((m.scores["induction"] > ROLE_THRESHOLD).sum())
    n_prev = int((m.scores["previous"] > ROLE_THRESHOLD).sum())
    first_ind = m.top("induction", 1)[0]
    headline = [
        f"{n_ind} of {L * H} heads have induction score > {ROLE_THRESHOLD} (best "
        f"L{first_ind[0]}.H{first_ind[1]}: {first_ind[2]:.2f}); {n_prev} have previous-token "
        f"score > {ROLE_THRESHOLD}.",
        f"Attention-sink mass on the first token, mean over heads: layer 0 {sink[0]:.2f}, "
        f"layers 1–{L - 1} {sink[1:].min():.2f}–{sink[1:].max():.2f} (mean "
        f"{sink[1:].mean():.2f}).",
        "Categories: " + ", ".join(f"{c} {counts[c]}" for c in CATEGORIES) + ".",
    ]
    data = {**{k: v.tolist() for k, v in m.scores.items()}, "categories": m.categories,
            "category_counts": counts, "induction_tokens": m.induction_tokens.tolist(),
            "threshold": ROLE_THRESHOLD, "n_induction_heads": n_ind,
            "n_previous_token_heads": n_prev, "sink_by_layer": sink.tolist()}
    table = Table("The strongest heads of each score (layer.head)",
                  ["score", "head", "value", "category"], rows)
    return Prose(HEADS_LOOK_FOR, headline, data, [table])


def heads_explorer(m: HeadRoles, ctx: AnatomyContext) -> Explorer:
    """The interactive view (explorers.js `attentionExplorer`): every layer's and head's
    attention probabilities (L, H, T, T) over the text's first MAP_TOKENS tokens (causal, so
    they are the full text's first rows and columns), the head-role scores of SHOWN_SCORES
    and the categories; a layer × head grid to click, the selected head's heatmap, a query
    token's row on hover."""
    tokens = ctx.tokens[:, :MAP_TOKENS]
    probs = attention_probs(ctx.model, tokens)[:, 0]                    # (L, H, T, T)
    L = probs.shape[0]
    return Explorer(
        "heads", "attention",
        "Click a cell of the layer × head grid (coloured by the chosen score) or pick a layer "
        "and head: the heatmap is that head's attention over the text's first tokens (rows: "
        "queries, columns: keys); hover a token to list its row.",
        {"probs": float32_blob(probs), "labels": ctx.labels[:MAP_TOKENS],
         "layer": ctx.options.get("attention_layer", L // 2),
         "scores": {title: [[round(float(v), 4) for v in row] for row in m.scores[key]]
                    for key, title in SHOWN_SCORES},
         "categories": m.categories})


def heads_section(ctx: AnatomyContext) -> Section:
    """Head roles: previous-token, induction, duplicate-token, attention-sink, local-window
    and entropy scores for every head (layer × head heatmaps, a table of the strongest heads)
    and the simple categories."""
    m = measure_heads(ctx)
    figures = [plot_score_maps(m), plot_scores_by_layer(m), plot_categories(m)]
    section = heads_prose(m).section("heads", "What each head does", figures,
                                     {**m.scores, "induction_tokens": m.induction_tokens})
    section.explorers.append(heads_explorer(m, ctx))
    return section
