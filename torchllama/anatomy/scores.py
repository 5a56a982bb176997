"""Scores that say what an attention head does, computed from its attention probabilities.

Every function takes probs (..., T, T) — query t (rows) over key s (columns) of one causal
sequence, rows summing to 1 — and returns one score per leading index (e.g. (L, H) for a
stack of every layer's heads), as float32. Token-dependent scores also take the (T,) token ids.

Sources: previous-token and induction heads, Olsson et al. 2022 ("In-context Learning and
Induction Heads", §2; the induction score as TransformerLens computes it on a repeated random
sequence); duplicate-token heads, Wang et al. 2022 ("Interpretability in the Wild", §3.1);
attention sinks, Xiao et al. 2023 ("Efficient Streaming Language Models with Attention Sinks",
§3.1); entropy and the simple categories, the seed chapter's "what heads do".
"""

from __future__ import annotations

import torch

#: category of a head → its test, in the order `classify_heads` tries them
CATEGORIES = ("previous-token", "self", "sink", "local", "uniform", "mixed")


def _check(probs: torch.Tensor) -> int:
    if probs.dim() < 2 or probs.shape[-1] != probs.shape[-2]:
        raise ValueError(f"probs must be (..., T, T), got {tuple(probs.shape)}")
    return probs.shape[-1]


def previous_token_score(probs: torch.Tensor) -> torch.Tensor:
    """Mean attention from each position t ≥ 1 to t − 1: mean_t probs[..., t, t−1].
    (..., T, T) → (...,); 1.0 for a pure previous-token head."""
    T = _check(probs)
    return probs.diagonal(offset=-1, dim1=-2, dim2=-1).float().mean(-1) if T > 1 \
        else probs.new_zeros(probs.shape[:-2])                    # (..., T−1) → (...,)


def self_score(probs: torch.Tensor) -> torch.Tensor:
    """Mean attention of each position t ≥ 1 to itself (the diagonal), skipping t = 0, which
    can attend nothing else. (..., T, T) → (...,)."""
    _check(probs)
    return probs.diagonal(dim1=-2, dim2=-1)[..., 1:].float().mean(-1)


def sink_score(probs: torch.Tensor) -> torch.Tensor:
    """Attention-sink mass: mean attention of positions t ≥ 1 to position 0 (Xiao et al. 2023:
    most heads of trained LLMs park attention on the first token). (..., T, T) → (...,)."""
    _check(probs)
    return probs[..., 1:, 0].float().mean(-1)


def local_score(probs: torch.Tensor, window: int = 4) -> torch.Tensor:
    """Local mass: mean over positions t ≥ window of the attention within the last `window`
    positions, Σ_{t−window < s ≤ t} probs[t, s] (positions before `window` would score 1
    trivially). (..., T, T) → (...,).

    Raises:
        ValueError: window < 1 or T ≤ window.
    """
    T = _check(probs)
    if window < 1 or T <= window:
        raise ValueError(f"local_score: need 1 ≤ window < T, got window {window}, T {T}")
    t = torch.arange(T, device=probs.device)
    band = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)  # (T, T)
    mass = (probs.float() * band).sum(-1)                                   # (..., T)
    return mass[..., window:].mean(-1)


def entropy(probs: torch.Tensor, normalized: bool = False) -> torch.Tensor:
    """Mean entropy of the attention rows, −Σ_s p·ln p in nats, over positions t ≥ 1; with
    normalized, each row's entropy is divided by ln(t + 1), its maximum (a uniform row over
    the t + 1 visible keys scores 1). (..., T, T) → (...,)."""
    T = _check(probs)
    p = probs.float()
    h = -(p * p.clamp_min(1e-30).log()).sum(-1)                  # (..., T) nats
    if normalized:
        h = h / torch.arange(1, T + 1, device=p.device).float().log().clamp_min(1e-30)
    return h[..., 1:].mean(-1)


def _match_targets(tokens: torch.Tensor, shift: int) -> torch.Tensor:
    """(T, T) bool: key s is a target of query t when tokens[s − shift] == tokens[t] for an
    earlier occurrence s − shift < t, and s ≤ t (causal)."""
    T = tokens.shape[0]
    same = tokens[:, None] == tokens[None, :]                    # (T, T): tokens[t] == tokens[j]
    t = torch.arange(T, device=tokens.device)
    earlier = t[None, :] < t[:, None]                            # j < t
    occurrence = same & earlier                                  # (T, T) over (t, j)
    target = torch.zeros(T, T, dtype=torch.bool, device=tokens.device)
    target[:, shift:] = occurrence[:, :T - shift] if shift else occurrence
    return target & (t[None, :] <= t[:, None])                   # (t, s = j + shift), s ≤ t


def _mass_on(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over queries with at least one target of the attention they put on their targets."""
    rows = target.any(-1)                                        # (T,)
    if not rows.any():
        return probs.new_zeros(probs.shape[:-2])
    mass = (probs.float() * target).sum(-1)                      # (..., T)
    return mass[..., rows].mean(-1)


def induction_score(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Induction score (Olsson et al. 2022): at a token that occurred before, the attention to
    the token right after its earlier occurrence ("… A B … A → attend B"), averaged over the
    positions that have an earlier occurrence. On a random sequence repeated twice this is the
    standard score: mean attention from position i of the second copy to i − n + 1.

    Args:
        probs: (..., T, T) attention probabilities.
        tokens: (T,) int64 token ids of the sequence.

    Returns:
        (...,) float32; 0 when no token repeats.
    """
    _check(probs)
    return _mass_on(probs, _match_targets(tokens, shift=1))


def duplicate_token_score(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Duplicate-token score (Wang et al. 2022): at a token that occurred before, the
    attention to its earlier occurrences, averaged over the positions that have one.
    probs (..., T, T), tokens (T,) → (...,)."""
    _check(probs)
    return _mass_on(probs, _match_targets(tokens, shift=0))


def repeated_random_tokens(n: int, vocab: list[int] | torch.Tensor, batch: int = 1,
                           prefix: list[int] | None = None,
                           generator: torch.Generator | None = None) -> torch.Tensor:
    """The induction test input: `batch` sequences of n random tokens drawn from `vocab`,
    each repeated twice, after an optional prefix (e.g. BOS). Returns (batch, len(prefix) + 2n)
    int64."""
    vocab = torch.as_tensor(vocab)
    pick = torch.randint(len(vocab), (batch, n), generator=generator)
    seq = vocab[pick]                                            # (batch, n)
    pre = torch.tensor(prefix or [], dtype=torch.long).expand(batch, -1)
    return torch.cat([pre, seq, seq], dim=1)                     # (batch, P + 2n)


def classify_heads(scores: dict[str, torch.Tensor], threshold: float = 0.5) -> list:
    """The seed chapter's simple categories, per head, from the scores above (each (...,)):
    "previous-token" (previous ≥ threshold), "self" (diagonal ≥ threshold), "sink" (first
    token ≥ threshold), "local" (local mass ≥ 0.8), "uniform" (normalized entropy ≥ 0.8,
    a generalist spreading attention evenly), else "mixed". Tried in that order.

    Args:
        scores: "previous", "self", "sink", "local", "entropy_normalized" tensors of one shape.

    Returns:
        nested lists of category names with the scores' shape.
    """
    tests = [("previous-token", scores["previous"] >= threshold),
             ("self", scores["self"] >= threshold),
             ("sink", scores["sink"] >= threshold),
             ("local", scores["local"] >= 0.8),
             ("uniform", scores["entropy_normalized"] >= 0.8)]
    out = torch.full(scores["previous"].shape, len(tests), dtype=torch.long)
    for i, (_, hit) in reversed(list(enumerate(tests))):
        out[hit] = i
    names = [name for name, _ in tests] + ["mixed"]

    def to_names(x):
        return [to_names(v) for v in x] if isinstance(x, list) else names[x]
    return to_names(out.tolist())
