"""Sampling: the next token's logits → a token id, as a chain of small pure functions.

    raw logits (B, V) ──────────────────────────────▶ token_logprobs (reported before any edit)
        │ apply_logit_bias                    + bias[j]                         (OpenAI logit_bias)
        │ apply_repetition_penalty            l/θ if l > 0 else l·θ, seen j     (CTRL, as HF)
        │ apply_frequency_presence_penalties  − c[j]·α_f − 1[c[j] > 0]·α_p      (OpenAI)
        │ temperature == 0 ──▶ argmax                                           (greedy)
        │ apply_temperature                   l / T
        │ top_k_filter                        keep the k largest
        │ top_p_filter                        Meta's nucleus rule
        │ min_p_filter                        keep p ≥ min_p·p_max              (Nguyen et al. 2024)
        ▼ softmax ──▶ multinomial(generator) ──▶ (B,) int64

Why this order:
  * Bias and penalties come first and apply at temperature 0 too: they change which token is the
    most likely, so greedy decoding must see them. They are HF's "logits processors", which run
    before its "warpers" (temperature, top-k, top-p, min-p); vLLM's sampler likewise applies logit
    bias, then penalties (repetition, frequency, presence), then takes the greedy token or
    applies temperature. Penalties before temperature keep OpenAI's formula on the model's own
    logits μ: a frequency penalty of 0.5 means the same thing at every temperature.
  * Bias before the repetition penalty, as HF (`SequenceBiasLogitsProcessor` is added before
    `RepetitionPenaltyLogitsProcessor`) and vLLM; the multiplicative penalty then scales a biased
    logit.
  * Temperature before truncation, so top-p and min-p see the distribution that is sampled
    (HF and vLLM both do this).
  * top-k → top-p → min-p is HF's warper order. vLLM's v1 sampler runs min-p before top-k/top-p;
    the min-p cut itself is the same either way (it is relative to the top token, which every
    filter keeps), but top-p then sees a different, renormalised distribution. We follow HF.

Each function takes logits of shape (B, V) and works for any B; one `SamplingParams` applies to
every row of a call (callers with per-request settings call per row, or per group of rows that
share settings). The functions return new tensors; none edits its input.

`sample` draws the top-p/min-p-truncated distribution in probability space, in the descending
order of Meta's `sample_top_p`, so that with temperature/top-k/top-p alone it picks exactly the
tokens `torchllama.generation.session.sample` (Meta's reference code) picks for the same generator state.
Its distribution is softmax(process_logits(...)) up to rounding.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch

from torchllama.errors import ArgumentError

LOGPROBS_MAX = 20                   # OpenAI's limit on top_logprobs
# Temperatures this small act as 0 (argmax, the limit T → 0): dividing float32 logits by them
# overflows to inf and the softmax to NaN.
GREEDY_BELOW = 1e-5
PENALTY_MIN, PENALTY_MAX = -2.0, 2.0          # OpenAI's range for frequency/presence penalties
#: the repetition penalty's range: a divisor of logits, so that they stay finite (1e-300 made
#: them inf and the probabilities NaN)
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.001, 1000.0
LOGIT_BIAS_MIN, LOGIT_BIAS_MAX = -100.0, 100.0  # OpenAI's range for logit_bias values

LogitBias = tuple[tuple[int, float], ...]     # ((token id, bias), ...) sorted by token id
LogitBiasLike = Union[Mapping[int, float], Iterable[tuple[int, float]], None]
TokenIds = Union[torch.Tensor, Sequence[int], Sequence[Sequence[int]]]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _logit_bias_pairs(bias: LogitBiasLike) -> Optional[LogitBias]:
    """A logit bias (mapping or (token id, bias) pairs) as sorted pairs; None when empty.

    Raises:
        ArgumentError: a token id that is not an integer ≥ 0, a bias outside [-100, 100] (NaN
            included), an entry that is not a pair, or a token id given twice.
    """
    if bias is None:
        return None
    items = bias.items() if isinstance(bias, Mapping) else bias
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise ArgumentError(f"logit_bias must be a mapping {{token id: bias}} or (token id, bias) "
                            f"pairs, got {bias!r}")
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ArgumentError(f"logit_bias entries must be (token id, bias) pairs, got {item!r}")
        token, value = item
        if not _is_int(token) or token < 0:
            raise ArgumentError(f"logit_bias token ids must be integers ≥ 0, got {token!r}")
        if not _is_real(value) or not LOGIT_BIAS_MIN <= value <= LOGIT_BIAS_MAX:
            raise ArgumentError(f"logit_bias values must be in [-100, 100], got {value!r} "
                                f"for token {token}")
        if int(token) in pairs:
            raise ArgumentError(f"logit_bias gives token {token} more than one bias")
        pairs[int(token)] = float(value)
    return tuple(sorted(pairs.items())) or None


# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token (one request's settings; frozen and hashable).

    Attributes:
        temperature: 0 = greedy (argmax of the biased/penalised logits); > 0 divides the logits
            before softmax. Finite.
        top_k: keep the k most likely tokens, ties at the k-th included (0 = all).
        top_p: nucleus sampling (Holtzman et al. 2019) with Meta's rule: drop every token whose
            *preceding* probability mass (sorted descending) exceeds p; the top token is always
            kept; 1.0 = all. In (0, 1].
        min_p: keep tokens with probability ≥ min_p · (probability of the top token) (Nguyen et
            al. 2024, "min-p sampling"); 0 = off. In [0, 1].
        repetition_penalty: CTRL's penalty θ (Keskar et al. 2019) on every token of the context
            (prompt + generated); 1 = off, > 1 discourages repeats, < 1 encourages them. > 0.
        frequency_penalty: OpenAI's α_frequency, subtracted once per occurrence of the token in
            the completion so far; 0 = off. In [-2, 2].
        presence_penalty: OpenAI's α_presence, subtracted once if the token occurs in the
            completion so far; 0 = off. In [-2, 2].
        logit_bias: OpenAI's logit_bias, added to the logit of each listed token. Given as a
            mapping {token id: bias} or (token id, bias) pairs; stored as a tuple of
            (int, float) pairs sorted by token id (None when empty) so the dataclass stays
            hashable: `dict(params.logit_bias or ())` gives the mapping back. Token ids are
            integers ≥ 0 (the vocabulary bound is checked when applied); biases in [-100, 100].
        seed: seed of the sampling RNG; None = nondeterministic.
        logprobs: how many most likely alternatives to report with each token (0 = none).
            In [0, 20] (OpenAI's top_logprobs limit). Only read by callers (`token_logprobs`).

    Raises:
        ArgumentError: a field outside its range (the message names the field and the range).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[LogitBias] = None
    seed: Optional[int] = None
    logprobs: int = 0

    def __post_init__(self) -> None:
        # `not (a <= x <= b)` is also true for NaN, so NaN is rejected everywhere.
        if not (_is_real(self.temperature) and 0 <= self.temperature < math.inf):
            raise ArgumentError(f"temperature must be ≥ 0 (0 = greedy) and finite, "
                                f"got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ArgumentError(f"top_k must be an integer ≥ 0 (0 = off), got {self.top_k!r}")
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_is_real(self.min_p) and 0 <= self.min_p <= 1):
            raise ArgumentError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not (_is_real(self.repetition_penalty) and
                REPETITION_PENALTY_MIN <= self.repetition_penalty <= REPETITION_PENALTY_MAX):
            raise ArgumentError(f"repetition_penalty must be in [{REPETITION_PENALTY_MIN}, "
                                f"{REPETITION_PENALTY_MAX}] (1 = off), "
                                f"got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (_is_real(value) and PENALTY_MIN <= value <= PENALTY_MAX):
                raise ArgumentError(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if self.seed is not None and not (_is_int(self.seed) and -2**63 <= self.seed < 2**64):
            raise ArgumentError(f"seed must be an integer in [-2**63, 2**64) or None, "
                                f"got {self.seed!r}")
        if not _is_int(self.logprobs) or not 0 <= self.logprobs <= LOGPROBS_MAX:
            raise ArgumentError(f"logprobs must be an integer in [0, {LOGPROBS_MAX}] (0 = none), "
                                f"got {self.logprobs!r}")

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A torch.Generator seeded with `seed` (or randomly when seed is None)."""
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


# --------------------------------------------------------------------------------------------
# Token ids → counts
# --------------------------------------------------------------------------------------------

def _padded_ids(ids: TokenIds, batch_size: int, vocab_size: int,
                device: torch.device | str | None, name: str) -> torch.Tensor:
    """Token ids as a (B, L) int64 tensor; ragged rows are padded with `vocab_size`.

    `ids` is a (B, L) tensor or a list of B lists (one per row, any lengths), or a 1-D tensor /
    flat list of ints shared by every row ([] = no tokens).

    Raises:
        ArgumentError: a row count other than batch_size, or an id outside [0, vocab_size).
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 1:
            ids = ids.unsqueeze(0).expand(batch_size, -1)                 # (B, L)
        if ids.dim() != 2 or ids.shape[0] != batch_size:
            raise ArgumentError(f"{name} must have shape ({batch_size}, L) or (L,), "
                                f"got {tuple(ids.shape)}")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ArgumentError(f"{name} must hold integer token ids, got {ids.dtype}")
        ids = ids.to(device=device, dtype=torch.long)
        if ids.numel() and bool(((ids < 0) | (ids >= vocab_size)).any()):
            raise ArgumentError(f"{name} holds token ids outside the vocabulary "
                                f"[0, {vocab_size})")
        return ids
    rows = list(ids)
    if all(_is_int(x) for x in rows):                                     # flat: every row
        rows = [rows] * batch_size
    else:
        rows = [r.tolist() if isinstance(r, torch.Tensor) else list(r) for r in rows]
    if len(rows) != batch_size:
        raise ArgumentError(f"{name} has {len(rows)} rows for a batch of {batch_size}")
    for row in rows:
        for t in row:
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise ArgumentError(f"{name} holds {t!r}, not a token id in [0, {vocab_size})")
    width = max((len(r) for r in rows), default=0)
    padded = [list(r) + [vocab_size] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.long, device=device).view(batch_size, width)


def token_counts(ids: TokenIds, batch_size: int, vocab_size: int,
                 device: torch.device | str | None = None, *, name: str = "token ids"
                 ) -> torch.Tensor:
    """How often each token occurs in each row: c[b, j] = #{i : ids[b, i] = j}.

    Args:
        ids: (B, L) int tensor, or B lists of ids (ragged), or a 1-D tensor / flat list shared
            by every row.
        batch_size, vocab_size: B and V of the result.
        device: where the result lives.
        name: what the ids are, for error messages.

    Returns:
        (B, V) float32 counts.

    Raises:
        ArgumentError: wrong number of rows, or an id outside [0, V).
    """
    padded = _padded_ids(ids, batch_size, vocab_size, device, name)   # (B, L), pad = V
    counts = torch.zeros(batch_size, vocab_size + 1, device=padded.device)   # (B, V+1)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=padded.device))
    return counts[:, :vocab_size]                                           # (B, V), pad dropped


# --------------------------------------------------------------------------------------------
# Logits processors: bias and penalties (applied at every temperature, greedy included)
# --------------------------------------------------------------------------------------------

def apply_logit_bias(logits: torch.Tensor, bias: LogitBiasLike) -> torch.Tensor:
    """Add a fixed bias to chosen tokens' logits: l[j] + bias[j] (OpenAI's `logit_bias`).

    Args:
        logits: (B, V) logits.
        bias: {token id: bias} or (token id, bias) pairs (as `SamplingParams.logit_bias`), or
            None. The same bias applies to every row.

    Returns:
        (B, V) logits, same dtype.

    Raises:
        ArgumentError: a bad entry (see SamplingParams) or a token id ≥ V.
    """
    pairs = _logit_bias_pairs(bias)
    if not pairs:
        return logits
    vocab_size = logits.shape[-1]
    outside = [t for t, _ in pairs if t >= vocab_size]
    if outside:
        raise ArgumentError(f"logit_bias: token id {outside[0]} is outside the vocabulary "
                            f"[0, {vocab_size})")
    ids = torch.tensor([t for t, _ in pairs], device=logits.device)                # (n,)
    values = torch.tensor([v for _, v in pairs], dtype=logits.dtype,
                          device=logits.device)                                    # (n,)
    return logits.index_add(-1, ids, values.expand(*logits.shape[:-1], -1))        # (B, V)


def apply_repetition_penalty(logits: torch.Tensor, context_ids: TokenIds,
                             penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019, sec. 4.1), as HF's
    `RepetitionPenaltyLogitsProcessor` implements it.

    For every token j present in the row's context (prompt + tokens generated so far):
    l[j] / θ if l[j] > 0 else l[j] · θ, so θ > 1 makes repeats less likely whatever the sign of
    the logit (CTRL's paper divides only; the sign rule is HF's, also used by vLLM). Tokens occur
    once or many times alike.

    Args:
        logits: (B, V) logits.
        context_ids: (B, L) int tensor, B lists of ids (ragged), or a 1-D tensor / flat list
            shared by every row.
        penalty: θ > 0; 1 returns logits unchanged.

    Returns:
        (B, V) logits, same dtype.

    Raises:
        ArgumentError: θ ≤ 0 or not finite; bad context_ids (row count, ids outside [0, V)).
    """
    if not (_is_real(penalty) and 0 < penalty < math.inf):
        raise ArgumentError(f"repetition_penalty must be > 0 and finite, got {penalty!r}")
    if penalty == 1.0:
        return logits
    B, V = logits.shape
    counts = token_counts(context_ids, B, V, logits.device, name="context_ids")  # (B, V)
    seen = counts > 0                                                           # (B, V) bool
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)     # (B, V)
    return torch.where(seen, penalised, logits)                                 # (B, V)


def apply_frequency_presence_penalties(logits: torch.Tensor,
                                       generated_ids: Optional[TokenIds] = None,
                                       frequency: float = 0.0, presence: float = 0.0, *,
                                       counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """OpenAI's frequency and presence penalties:

        μ[j] − c[j]·α_frequency − 1[c[j] > 0]·α_presence

    (OpenAI API reference, "Parameter details: frequency and presence penalties"), where c[j]
    counts token j in the tokens generated so far — the completion only, not the prompt, as
    OpenAI and vLLM do (the repetition penalty is the one that sees the prompt).

    Args:
        logits: (B, V) logits μ.
        generated_ids: the completion so far: (B, L) int tensor, B lists of ids (ragged), or a
            1-D tensor / flat list shared by every row.
        frequency, presence: α_frequency, α_presence (any real; SamplingParams keeps them in
            [-2, 2]). Both 0 returns logits unchanged.
        counts: instead of generated_ids, the counts c as a (B, V) tensor (for callers that
            keep them up to date incrementally). Give exactly one of the two.

    Returns:
        (B, V) logits, same dtype (computed in float32).

    Raises:
        ArgumentError: both or neither of generated_ids and counts; counts of another shape;
            bad generated_ids.
    """
    if (generated_ids is None) == (counts is None):
        raise ArgumentError("give exactly one of generated_ids and counts")
    if frequency == 0 and presence == 0:
        return logits
    B, V = logits.shape
    if counts is None:
        counts = token_counts(generated_ids, B, V, logits.device, name="generated_ids")  # (B, V)
    elif tuple(counts.shape) != (B, V):
        raise ArgumentError(f"counts must have shape {(B, V)}, got {tuple(counts.shape)}")
    counts = counts.to(device=logits.device, dtype=torch.float32)               # (B, V)
    out = logits.float() - counts * frequency - (counts > 0).float() * presence  # (B, V)
    return out.to(logits.dtype)


# --------------------------------------------------------------------------------------------
# Logits warpers: temperature and truncation (only when sampling, temperature > 0)
# --------------------------------------------------------------------------------------------

# --8<-- [start:temperature]
def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """l / T (softmax(l / T): T < 1 sharpens, T > 1 flattens).

    Shapes: logits (B, V) → (B, V).

    Raises:
        ArgumentError: T ≤ 0 or not finite (temperature 0 means argmax; callers branch first).
    """
    if not (_is_real(temperature) and 0 < temperature < math.inf):
        raise ArgumentError(f"temperature must be > 0 and finite here, got {temperature!r}")
    return logits / temperature                                                  # (B, V)
# --8<-- [end:temperature]


# --8<-- [start:top-k]
def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf (ties at the k-th are kept),
    as HF's `TopKLogitsWarper` (Fan et al. 2018, top-k sampling).

    Shapes: logits (B, V) → (B, V). k ≤ 0 or k ≥ V returns logits unchanged.
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]        # (B, 1) k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))      # (B, V)
# --8<-- [end:top-k]


# --8<-- [start:nucleus]
def _nucleus_drop(probs_sort: torch.Tensor, p: float) -> torch.Tensor:
    """Meta's nucleus rule on descending-sorted probabilities: drop a token when the mass
    *before* it already exceeds p (llama/generation.py, `sample_top_p`).

    Shapes: probs_sort (B, V) → (B, V) bool, True = drop. The first column is never dropped.
    """
    probs_sum = torch.cumsum(probs_sort, dim=-1)                   # (B, V)
    return probs_sum - probs_sort > p                              # mass before token > p
# --8<-- [end:nucleus]


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter with Meta's rule (as `sample_top_p`), on logits: set to -inf every token
    whose preceding probability mass, in descending order, exceeds p. The top token is kept.

    HF's `TopPLogitsWarper` drops a token when its preceding mass is ≥ p (it keeps tokens whose
    ascending cumulative mass exceeds 1 − p): the two differ only for a token whose preceding
    mass equals p exactly, which Meta keeps and HF drops.

    Args:
        logits: (B, V) logits.
        p: in (0, 1]; 1 returns logits unchanged (no float rounding of the cumulative sum can
            drop a tail token).

    Returns:
        (B, V) logits with dropped tokens at -inf.

    Raises:
        ArgumentError: p outside (0, 1].
    """
    if not (_is_real(p) and 0 < p <= 1):
        raise ArgumentError(f"top_p must be in (0, 1], got {p!r}")
    if p >= 1.0:
        return logits
    probs = torch.softmax(logits, dim=-1)                                   # (B, V)
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)      # (B, V) each
    drop_sorted = _nucleus_drop(probs_sort, p)                              # (B, V) sorted order
    drop = torch.zeros_like(drop_sorted).scatter(-1, probs_idx, drop_sorted)  # (B, V) vocab order
    return logits.masked_fill(drop, float("-inf"))                          # (B, V)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Min-p filter (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling"), as HF's
    `MinPLogitsWarper`: keep token j when p[j] ≥ min_p · max_i p[i], p = softmax(logits).

    Args:
        logits: (B, V) logits.
        min_p: in [0, 1]; 0 returns logits unchanged. The top token is always kept.

    Returns:
        (B, V) logits with dropped tokens at -inf.

    Raises:
        ArgumentError: min_p outside [0, 1].
    """
    if not (_is_real(min_p) and 0 <= min_p <= 1):
        raise ArgumentError(f"min_p must be in [0, 1], got {min_p!r}")
    if min_p == 0:
        return logits
    probs = torch.softmax(logits, dim=-1)                                   # (B, V)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)                 # (B, V)
    return logits.masked_fill(drop, float("-inf"))                          # (B, V)


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------

def _bias_and_penalties(logits: torch.Tensor, params: SamplingParams,
                        context_ids: Optional[TokenIds],
                        generated_ids: Optional[TokenIds]) -> torch.Tensor:
    """logit bias → repetition penalty → frequency/presence penalties. Shapes: (B, V) → (B, V)."""
    logits = apply_logit_bias(logits, params.logit_bias)
    if params.repetition_penalty != 1.0:
        if context_ids is None:
            raise ArgumentError("repetition_penalty needs context_ids (prompt + generated ids)")
        logits = apply_repetition_penalty(logits, context_ids, params.repetition_penalty)
    if params.frequency_penalty != 0 or params.presence_penalty != 0:
        if generated_ids is None:
            raise ArgumentError("frequency_penalty/presence_penalty need generated_ids "
                                "(the completion so far; [] at the first step)")
        logits = apply_frequency_presence_penalties(
            logits, generated_ids, params.frequency_penalty, params.presence_penalty)
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams,
                   context_ids: Optional[TokenIds] = None,
                   generated_ids: Optional[TokenIds] = None) -> torch.Tensor:
    """All of `params` applied to the logits, in the module's order: logit bias → repetition
    penalty → frequency/presence penalties → (temperature 0: stop here) → temperature →
    top-k → top-p → min-p.

    Args:
        logits: (B, V) raw next-token logits.
        params: the settings (one for every row).
        context_ids: prompt + generated ids per row, for the repetition penalty (required when
            it is on). (B, L) tensor, B lists, or one flat list for every row.
        generated_ids: the completion so far per row, for the frequency/presence penalties
            (required when they are on; [] at the first step). Same forms.

    Returns:
        (B, V) logits. At temperature 0: biased and penalised, not scaled nor truncated (the
        greedy token is their argmax). Otherwise: scaled, truncated tokens at -inf; the sampled
        distribution is their softmax.

    Raises:
        ArgumentError: a penalty is on but its ids are missing, or the ids/bias are invalid.
    """
    logits = _bias_and_penalties(logits, params, context_ids, generated_ids)   # (B, V)
    if params.temperature < GREEDY_BELOW:
        return logits
    logits = apply_temperature(logits, params.temperature)                     # (B, V)
    logits = top_k_filter(logits, params.top_k)                                # (B, V)
    logits = top_p_filter(logits, params.top_p)                                # (B, V)
    return min_p_filter(logits, params.min_p)                                  # (B, V)


def _sample_probs(probs: torch.Tensor, top_p: float, min_p: float,
                  generator: Optional[torch.Generator]) -> torch.Tensor:
    """Draw one token per row from probs truncated by top-p (Meta's rule) then min-p.

    With top_p < 1 this is Meta's `sample_top_p` (sort, drop, renormalise, draw in descending
    order) with the min-p cut added to the drop mask; min-p's threshold is relative to the top
    token, which top-p keeps, so cutting it before renormalisation is the same cut. With
    top_p == 1 the draw is in vocabulary order, as torch.multinomial on the softmax.

    Shapes: probs (B, V) (rows sum to 1) → (B,) int64.
    """
    if top_p < 1.0:
        fast = _sample_nucleus_prefix(probs, top_p, min_p, generator)
        if fast is not None:
            return fast
        probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)   # (B, V) each
        drop = _nucleus_drop(probs_sort, top_p)                               # (B, V) bool
        if min_p > 0:
            drop = drop | (probs_sort < min_p * probs_sort[..., :1])          # (B, V)
        probs_sort = probs_sort.masked_fill(drop, 0.0)
        probs_sort = probs_sort / probs_sort.sum(dim=-1, keepdim=True)        # renormalise
        choice = torch.multinomial(probs_sort, num_samples=1, generator=generator)  # (B, 1)
        return torch.gather(probs_idx, -1, choice).squeeze(-1)                # (B,)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    # multinomial takes unnormalised non-negative weights
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # (B,)


NUCLEUS_PREFIXES = (256, 4096)     # top-k sizes tried before sorting the whole vocabulary


def _sample_nucleus_prefix(probs: torch.Tensor, top_p: float, min_p: float,
                           generator: Optional[torch.Generator]) -> Optional[torch.Tensor]:
    """`_sample_probs`' top-p draw without sorting the vocabulary, or None where it cannot
    be sure to pick the same token (the caller then sorts).

    Meta's rule keeps a prefix of the descending order: the nucleus. `torch.topk` of k ≪ V
    gives that prefix in O(V) (sorting all V probabilities can cost more than a decode step of
    a small model: `torchllama bench decode` measures the sampling with the step). The draw then repeats `torch.multinomial`'s
    own arithmetic on CPU for one sample (Gumbel-max with exponentials: argmax_j p_j / q_j,
    q ~ Exp(1) drawn for all V columns in order, so the generator advances as before):
    dropped columns are 0 / q = 0 and never win, so the argmax over the prefix is the same.
    The renormalising sum runs over the full-width row (zeros after the prefix), the same
    reduction as Meta's. It is exact when the prefix's order is unique: the nucleus ends
    inside the top k, and its probabilities (and the first one after it) are distinct; where
    values tie, `torch.sort`'s order among them is its own, so we return None.

    Shapes: probs (B, V) float (rows sum to 1) → (B,) int64, or None.
    """
    B, V = probs.shape
    for k in NUCLEUS_PREFIXES:
        if k >= V:
            return None
        top, top_idx = torch.topk(probs, k, dim=-1)                      # (B, k) each, sorted
        drop = _nucleus_drop(top, top_p)                                  # (B, k) bool
        n = int((~drop).sum(dim=-1).max())                                # longest nucleus
        if n < k:
            break
    else:
        return None
    if n > 0 and not bool((top[:, :n] > top[:, 1:n + 1]).all()):          # ties: sort's order
        return None
    if min_p > 0:
        drop = drop | (top < min_p * top[..., :1])                        # (B, k)
    full = probs.new_zeros(B, V)                                          # (B, V)
    full[:, :k] = top.masked_fill(drop, 0.0)                              # Meta's probs_sort
    nucleus = full[:, :n] / full.sum(dim=-1, keepdim=True)                # (B, n) renormalised
    q = torch.empty_like(full).exponential_(1, generator=generator)       # (B, V) Exp(1)
    choice = (nucleus / q[:, :n]).argmax(dim=-1, keepdim=True)            # (B, 1)
    return torch.gather(top_idx, -1, choice).squeeze(-1)                  # (B,)


# --8<-- [start:sample-top-p]
def sample_top_p(probs: torch.Tensor, p: float, generator: Optional[torch.Generator] = None
                 ) -> torch.Tensor:
    """Nucleus sampling exactly as Meta's `sample_top_p` (llama/generation.py).

    Sort probabilities descending, take the cumulative sum, drop every token whose *preceding*
    mass already exceeds p (so the top token always survives), renormalise, sample.

    Args:
        probs: (B, V) probabilities (rows sum to 1).
        p: top-p threshold in (0, 1].
        generator: RNG for torch.multinomial.

    Returns:
        (B,) int64 sampled token ids.
    """
    probs_sort, probs_idx = torch.sort(probs, dim=-1, descending=True)   # (B, V) each
    mask = _nucleus_drop(probs_sort, p)                                   # mass before token > p
    probs_sort = probs_sort.masked_fill(mask, 0.0)
    probs_sort = probs_sort / probs_sort.sum(dim=-1, keepdim=True)        # renormalise
    choice = torch.multinomial(probs_sort, num_samples=1, generator=generator)  # (B, 1)
    return torch.gather(probs_idx, -1, choice).squeeze(-1)                # (B,)
# --8<-- [end:sample-top-p]


# --8<-- [start:sample]
def sample(logits: torch.Tensor, params: SamplingParams,
           generator: Optional[torch.Generator] = None,
           context_ids: Optional[TokenIds] = None,
           generated_ids: Optional[TokenIds] = None) -> torch.Tensor:
    """Pick the next token of each row: `process_logits`' steps, then argmax or multinomial.

    Temperature 0: argmax of the biased and penalised logits (no division by 0; top-k, top-p and
    min-p do not apply). Otherwise: temperature → top-k → softmax → top-p and min-p cut on the
    probabilities → multinomial with `generator`. With only temperature/top_k/top_p set this
    picks exactly the tokens of Meta's reference code (llama/generation.py: softmax(l / T),
    then `sample_top_p`) for the same
    generator state.

    Args:
        logits: (B, V) float next-token logits (raw model output).
        params: the settings (one for every row).
        generator: RNG (see SamplingParams.make_generator); None = torch's global RNG.
        context_ids: prompt + generated ids per row (needed by the repetition penalty).
        generated_ids: the completion so far per row (needed by frequency/presence penalties).

    Returns:
        (B,) int64 token ids.

    Raises:
        ArgumentError: see `process_logits`.
    """
    logits = _bias_and_penalties(logits, params, context_ids, generated_ids)   # (B, V)
    if params.temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)                                          # (B,)
    logits = top_k_filter(apply_temperature(logits, params.temperature), params.top_k)  # (B, V)
    probs = torch.softmax(logits, dim=-1)                                     # (B, V)
    return _sample_probs(probs, params.top_p, params.min_p, generator)        # (B,)
# --8<-- [end:sample]


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, n: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the chosen tokens and of the n most likely tokens.

    Computed from the model's raw logits — before logit bias, penalties, temperature and
    truncation — as OpenAI reports them and vLLM does by default (`logprobs_mode` =
    "raw_logprobs"): log p[j] = log_softmax(l)[j].

    Args:
        logits: (B, V) raw next-token logits (any float dtype; computed in float32).
        chosen: (B,) int token ids picked for each row.
        n: how many alternatives to return (≥ 0; more than V returns V).

    Returns:
        chosen_logprob (B,) float32; top_ids (B, n') int64 and top_logprobs (B, n') float32,
        most likely first, n' = min(n, V).

    Raises:
        ArgumentError: n < 0, or chosen not of shape (B,).
    """
    if not _is_int(n) or n < 0:
        raise ArgumentError(f"the number of logprobs must be an integer ≥ 0, got {n!r}")
    B, V = logits.shape
    if tuple(chosen.shape) != (B,):
        raise ArgumentError(f"chosen must have shape ({B},), got {tuple(chosen.shape)}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)                        # (B, V) float32
    chosen_logprob = logprobs.gather(-1, chosen.to(logits.device, torch.long)[:, None])  # (B, 1)
    top = torch.topk(logprobs, min(n, V), dim=-1)                               # (B, n') each
    return chosen_logprob.squeeze(-1), top.indices, top.values
