"""Speculative decoding: a cheap drafter proposes k tokens, the target model scores them all in
one forward pass, and a rejection rule keeps exactly the target's output distribution.

    context x_1..x_t (x_t sampled, not yet in the target's KV cache)
      ──drafter──▶ d_1..d_k  (+ their draft distributions q_1..q_k, or none: one-hot)
    target([x_t, d_1..d_k], start_pos = t − 1) ──▶ logits (k+1, V)
      ──process_logits(SamplingParams), softmax──▶ p_1..p_{k+1}
    for i = 1..k: accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
                  on the first rejection emit a token from normalize(max(0, p_i − q_i)), stop
    all k accepted: emit a bonus token from p_{k+1}
    rollback: the target's cache slots of rejected drafts are forgotten (the next pass writes over
    them; attention only reads slots < start_pos + T)

Drafters (`Drafter`): `ModelDrafter` runs a smaller model with the same vocabulary, or the target's
own weights quantized (`--draft int4`: the float32 answer at near-int4 speed); it keeps its own KV
cache and catches up on whatever context it has not seen, so it also follows tokens the target
produced without it. `PromptLookupDrafter` copies the tokens that followed the latest earlier
occurrence of the context's last n-gram (Saxena 2023, "Prompt Lookup Decoding"): no model at all.

Why the output distribution is the target's (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", arXiv 2211.17192, Algorithm 1 and Appendix A.1; Chen et
al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling", arXiv
2302.01318, Theorem 1). Take one position with target distribution p and draft distribution q;
the draft d ~ q is accepted with probability min(1, p(d)/q(d)), else x ~ p' with
p'(x) = max(0, p(x) − q(x)) / Σ_y max(0, p(y) − q(y)). Let β = Σ_y min(p(y), q(y)), the
acceptance probability. Then

    P(emit x) = q(x)·min(1, p(x)/q(x)) + (1 − β)·p'(x)
              = min(p(x), q(x)) + (1 − β)·max(0, p(x) − q(x)) / (1 − β)      (Σ max(0, p − q)
              = min(p(x), q(x)) + max(0, p(x) − q(x)) = p(x),                  = 1 − β)

so every emitted token has the target's distribution given the tokens before it; by induction
over positions (p_i is computed on the context including the accepted d_1..d_{i−1}, exactly what
plain decoding would condition on) the whole sequence does. The bonus token after k acceptances
is sampled from p_{k+1} directly. A deterministic draft (prompt lookup, or a draft model at
temperature 0) is q = one-hot(d): accept with probability p(d), else sample p with d removed.
At temperature 0 p is one-hot on the argmax of the target's processed logits, and the rule
becomes: accept while d_i equals the target's argmax at i, then emit the target's argmax, so
greedy speculative output is greedy plain output token for token (given a target whose k+1-token
forward gives the same logits as one-token steps: batch-invariant kernels).

p and q are the processed distributions: softmax of `torchllama.generation.sampling.process_logits` with the
request's SamplingParams (temperature, top-k, top-p, min-p, logit bias, penalties), the context of
position i including the drafts before it.

Draft length (`DraftLength`): k starts at its maximum; when every drafted token is accepted
k grows by 2 (up to the maximum), after a rejection it shrinks by 1 (down to 1) — the schedule of
transformers' assisted generation ("heuristic"). A round whose drafter proposes nothing (no n-gram
match) is a plain one-token decode step and leaves k as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from torchllama.errors import ArgumentError
from torchllama.generation.steps import decode_one_token
from torchllama.generation.sampling import GREEDY_BELOW, SamplingParams, process_logits, sample

#: Default maximum (and initial) number of drafted tokens per round (`--draft-tokens`).
DEFAULT_DRAFT_TOKENS = 12
#: The `--draft` values that load the target's own checkpoint in another weight format.
SELF_DRAFT_DTYPES = ("int4", "int8", "auto")


# --------------------------------------------------------------------------------------------
# Drafters
# --------------------------------------------------------------------------------------------

@dataclass
class Draft:
    """Proposed tokens d_1..d_m and the draft distributions they were sampled from.

    Attributes:
        tokens: m ≥ 0 token ids.
        probs: (m, V) float32 q_i (rows sum to 1), or None for a deterministic draft (q_i is
            one-hot on d_i: prompt lookup, a draft model at temperature 0).
    """

    tokens: list[int]
    probs: Optional[torch.Tensor] = None


class Drafter:
    """Proposes the next tokens of a context for `SpeculativeDecoder` to verify.

    Attributes:
        vocab_size: the vocabulary its token ids and probabilities index (None: any, e.g.
            prompt lookup, which only copies ids from the context).
    """

    vocab_size: Optional[int] = None

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                generator: Optional[torch.Generator], generated: Sequence[int]) -> Draft:
        """Up to k tokens that may follow `context` (all tokens so far, prompt included).

        Args:
            context: the token ids so far.
            k: the most tokens to propose (≥ 0).
            sampling: the request's settings (a draft model samples its q with them).
            generator: the request's RNG.
            generated: the completion so far (the end of `context`), for penalties.
        """
        raise NotImplementedError

    def reset(self) -> None:
        """Forget any state kept between calls."""

    def prefill(self, context: Sequence[int]) -> None:
        """Take in a prompt before the first `propose` (a draft model runs it through its
        cache, so that the prompt's cost is counted as prefill, not as decoding)."""


class ModelDrafter(Drafter):
    """A draft model: a smaller model with the target's tokenizer, or the target's own weights
    in a faster format. It keeps its own KV cache (batch 1) and the ids in it; each `propose`
    first runs whatever part of the context the cache lacks (the longest cached prefix is kept,
    as `Session` does), then k − 1 one-token steps (the k-th draft is never fed: the next round
    feeds it if it was accepted).

    Args:
        model: a `Transformer` (eval mode), not the target object itself (the cache lives in
            the model).
        max_seq_len: length of its KV cache (default: the model's context).
    """

    def __init__(self, model, max_seq_len: Optional[int] = None):
        self.model = model
        self.vocab_size = model.args.vocab_size
        self.max_seq_len = min(max_seq_len or model.args.max_seq_len, model.args.max_seq_len)
        self.cached_ids: list[int] = []
        self._caches = None

    def reset(self) -> None:
        self.cached_ids = []

    def _ensure_cache(self) -> None:
        if self._caches is None or self.model.caches is not self._caches:
            with torch.inference_mode(False):
                self.model.setup_caches(1, self.max_seq_len)
            self._caches = self.model.caches
            self.cached_ids = []

    @torch.inference_mode()
    def prefill(self, context: Sequence[int]) -> None:
        """Run the context through the draft model's cache (what it already holds is kept)."""
        if 0 < len(context) < self.max_seq_len:
            self._ensure_cache()
            self._catch_up(context)

    def _catch_up(self, context: Sequence[int]) -> torch.Tensor:
        """Run the part of `context` not in the cache; logits of the next token, (1, V)."""
        n, limit = 0, min(len(self.cached_ids), len(context) - 1)
        while n < limit and self.cached_ids[n] == context[n]:
            n += 1
        if not self.model.caches.can_write_at(n):   # a sliding window's ring lost slot n's keys
            n = 0
        tokens = torch.tensor([list(context[n:])], dtype=torch.long, device=self.model.device)
        if tokens.shape[1] == 1:
            logits = decode_one_token(self.model, tokens, n)                      # (1, V)
        else:
            logits = self.model(tokens, n, last_only=True)[:, -1]                 # (1, V)
        self.cached_ids = list(context)
        return logits

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                generator: Optional[torch.Generator], generated: Sequence[int]) -> Draft:
        """See `Drafter.propose`. At temperature 0 the drafts are the draft model's argmax
        (deterministic); otherwise d_i ~ q_i = softmax(process_logits(draft logits)).
        Fewer than k where the draft model's context ends."""
        k = min(k, self.max_seq_len - len(context) + 1)    # slots up to len + k − 2 written
        if k <= 0 or not context:
            return Draft([])
        self._ensure_cache()
        logits = self._catch_up(context)
        greedy = sampling.temperature < GREEDY_BELOW
        ctx, gen = list(context), list(generated)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            processed = process_logits(logits, sampling, [ctx], [gen])           # (1, V)
            if greedy:
                token = int(processed.argmax(dim=-1))
            else:
                q = torch.softmax(processed.float(), dim=-1)                      # (1, V)
                token = int(torch.multinomial(q, 1, generator=generator))
                probs.append(q[0])
            tokens.append(token)
            ctx.append(token)
            gen.append(token)
            if i + 1 < k:
                step = torch.tensor([[token]], dtype=torch.long, device=logits.device)
                logits = decode_one_token(self.model, step, len(self.cached_ids))  # (1, V)
                self.cached_ids.append(token)
        return Draft(tokens, torch.stack(probs) if probs else None)


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding): find
    the context's last n-gram earlier in the context (longest n first, from max_ngram down to
    min_ngram) and propose the tokens that followed its latest earlier occurrence. Free to run
    and deterministic (q one-hot); it pays off where the output repeats its input: summaries
    that quote, code edits, extraction. No match: no draft (a plain decode step). Saxena's
    search goes down to single tokens; by default we stop at pairs (a one-token match in open
    text mostly proposes a wrong continuation, and each costs a wider verification pass:
    SmolLM2 float32, a story, 1.02× plain decode with min_ngram=1, 1.08× with 2).

    Args:
        max_ngram: longest n-gram looked up (≥ min_ngram).
        min_ngram: shortest n-gram looked up (≥ 1).

    Raises:
        ArgumentError: sizes outside those ranges.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ArgumentError(f"prompt lookup needs 1 ≤ min_ngram ≤ max_ngram, got "
                                f"min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams = SamplingParams(),
                generator: Optional[torch.Generator] = None,
                generated: Sequence[int] = ()) -> Draft:
        """See `Drafter.propose`: at most k tokens copied from the context (sampling, generator
        and generated are not used)."""
        L = len(context)
        if k <= 0 or L < 2:
            return Draft([])
        ids = torch.tensor(list(context), dtype=torch.long)                       # (L,)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            windows = ids[:L - 1].unfold(0, n, 1)            # (L − n, n): n-grams ending ≤ L − 2
            hits = (windows == ids[L - n:]).all(dim=1).nonzero()                 # (h, 1)
            if hits.numel():
                start = int(hits[-1]) + n                    # the latest occurrence's successor
                return Draft(list(context[start:start + k]))
        return Draft([])


# --------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------

def accept_or_resample(p: torch.Tensor, q: Optional[torch.Tensor], token: int,
                       generator: Optional[torch.Generator]) -> tuple[bool, int]:
    """One position of Leviathan et al.'s Algorithm 1 (Chen et al.'s modified rejection
    sampling): accept the draft `token` with probability min(1, p(token)/q(token)); otherwise
    sample from normalize(max(0, p − q)). The emitted token is distributed as p.

    Args:
        p: (V,) float target probabilities (sum 1).
        q: (V,) float draft probabilities the token was drawn from, or None for a deterministic
            draft (q = one-hot(token)).
        token: the draft token d.
        generator: the RNG (one uniform, and one categorical draw on rejection).

    Returns:
        (accepted, emitted token): (True, token) or (False, a token from the residual).
    """
    q_d = 1.0 if q is None else float(q[token])
    u = float(torch.rand((), generator=generator, device=p.device))
    if q_d > 0 and u * q_d < float(p[token]):                 # u < p(d)/q(d), u ∈ [0, 1)
        return True, token
    if q is None:
        residual = p.clone()
        residual[token] = 0.0                                 # max(0, p − one-hot(d))
    else:
        residual = (p - q).clamp(min=0.0)                     # (V,)
    if float(residual.sum()) <= 0.0:     # p ≤ q everywhere: only rounding gets here
        residual = p
    return False, int(torch.multinomial(residual, 1, generator=generator))


def verify(logits: torch.Tensor, draft: Draft, sampling: SamplingParams,
           generator: Optional[torch.Generator], context: Sequence[int],
           generated: Sequence[int]) -> tuple[list[int], int]:
    """The tokens one speculative round emits: the accepted drafts, then one token of the
    target's (its correction at the first rejection, or the bonus token after all of them).

    Args:
        logits: (m+1, V) float32 raw target logits: row i scores the token after context +
            d_1..d_i (row 0: after the context).
        draft: the m ≤ k drafted tokens (and q, if sampled).
        sampling: the request's settings (p_i = softmax(process_logits(logits[i]))).
        generator: the request's RNG.
        context: the tokens so far (prompt + completion); generated: the completion so far.

    Returns:
        (emitted tokens, number of drafts accepted): 1 + accepted tokens.
    """
    m = len(draft.tokens)
    ctxs = [list(context) + draft.tokens[:i] for i in range(m + 1)]
    gens = [list(generated) + draft.tokens[:i] for i in range(m + 1)]
    if sampling.temperature < GREEDY_BELOW:
        best = process_logits(logits, sampling, ctxs, gens).argmax(dim=-1).tolist()  # (m+1,)
        j = 0
        while j < m and draft.tokens[j] == best[j]:
            j += 1
        return draft.tokens[:j] + [best[j]], j
    if m:
        p = torch.softmax(process_logits(logits[:m], sampling, ctxs[:m], gens[:m]).float(),
                          dim=-1)                                                  # (m, V)
        for i, token in enumerate(draft.tokens):
            q = None if draft.probs is None else draft.probs[i]
            accepted, emitted = accept_or_resample(p[i], q, token, generator)
            if not accepted:
                return draft.tokens[:i] + [emitted], i
    bonus = int(sample(logits[m:], sampling, generator, [ctxs[m]], [gens[m]])[0])  # from p_{m+1}
    return draft.tokens + [bonus], m


# --------------------------------------------------------------------------------------------
# Rounds
# --------------------------------------------------------------------------------------------

class DraftLength:
    """The number of tokens to draft next round (see the module docstring): start at k_max;
    all drafted accepted → k + 2 (≤ k_max); a rejection → k − 1 (≥ 1).

    Raises:
        ArgumentError: k_max < 1.
    """

    def __init__(self, k_max: int = DEFAULT_DRAFT_TOKENS):
        if k_max < 1:
            raise ArgumentError(f"the number of draft tokens must be ≥ 1, got {k_max}")
        self.k_max = self.k = k_max

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.k = min(self.k + 2, self.k_max) if accepted == drafted else max(self.k - 1, 1)


@dataclass
class Round:
    """One speculative round: the tokens it emits, how many were drafted and accepted, and the
    target's raw logits of each emitted token, (len(tokens), V) float32 (for log-probs)."""

    tokens: list[int]
    drafted: int
    accepted: int
    logits: torch.Tensor


def rewind_limit(model) -> Optional[int]:
    """How many drafts a round may write past the slot it keeps, for the model's KV caches to
    take the next write there (`SlidingWindowKVCache.can_write_at`): a ring of `capacity` slots
    for a window of `window` keeps rewinds of up to capacity − window + 1 slots behind its
    furthest write safe. None: no limit (caches keeping every slot, or a ring as long as the
    context, which never wraps)."""
    limits = [cache.capacity - cache.window + 1 for cache in model.caches or ()
              if hasattr(cache, "window") and cache.capacity < cache.max_seq_len]
    return min(limits) if limits else None


def check_vocabulary(draft_vocab: Optional[int], target_vocab: int) -> None:
    """Raises ArgumentError when a draft model's vocabulary size differs from the target's."""
    if draft_vocab is not None and draft_vocab != target_vocab:
        raise ArgumentError(f"the draft model's vocabulary has {draft_vocab} tokens but the "
                            f"target's has {target_vocab}: speculative decoding needs the "
                            "same tokenizer")


class SpeculativeDecoder:
    """Speculative rounds for one target model and one drafter, with the adaptive draft length
    and acceptance counts (used by `Session` and by the engine for a lone request).

    Args:
        target: the `Transformer` whose output is kept exactly.
        drafter: a `Drafter` (`ModelDrafter`, `PromptLookupDrafter`).
        max_draft: the maximum (and initial) number of drafted tokens per round.

    Raises:
        ArgumentError: vocabulary sizes differ (naming both), the draft model is the target
            object itself, or max_draft < 1.
    """

    def __init__(self, target, drafter: Drafter, max_draft: int = DEFAULT_DRAFT_TOKENS):
        check_vocabulary(drafter.vocab_size, target.args.vocab_size)
        if getattr(drafter, "model", None) is target:
            raise ArgumentError("the draft model is the target model itself: load a second "
                                "copy (the KV cache lives in the model)")
        self.target, self.drafter = target, drafter
        self.length = DraftLength(max_draft)
        self.rounds = self.drafted = self.accepted = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted ÷ drafted tokens over every round so far (0 before any draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @torch.inference_mode()
    def step(self, context: Sequence[int], sampling: SamplingParams,
             generator: Optional[torch.Generator], generated: Sequence[int], max_tokens: int,
             cache_rows: Optional[slice] = None) -> Round:
        """One round: draft, verify in one target forward, roll back.

        Args:
            context: all tokens so far; the last one is not yet in the target's cache (it is
                fed at slot len(context) − 1 now), the others are.
            sampling, generator: the request's settings and RNG.
            generated: the completion so far (the end of context), for penalties.
            max_tokens: the most tokens this round may emit (≥ 1): k ≤ max_tokens − 1.
            cache_rows: the target's cache row of this sequence (default row 0).

        Returns:
            the `Round`. Afterwards the target's cache holds context + the accepted drafts;
            the slots of rejected drafts are stale and get overwritten by the next round.
        """
        start = len(context) - 1
        k = min(self.length.k, max_tokens - 1)
        limit = rewind_limit(self.target)
        k = k if limit is None else min(k, limit)
        draft = self.drafter.propose(context, k, sampling, generator, generated) if k > 0 \
            else Draft([])
        tokens = torch.tensor([[context[-1], *draft.tokens]], dtype=torch.long,
                              device=self.target.device)                             # (1, m+1)
        if draft.tokens or cache_rows is not None:
            logits = self.target(tokens, start, cache_rows=cache_rows)[0]           # (m+1, V)
        else:
            logits = decode_one_token(self.target, tokens, start)                   # (1, V)
        emitted, accepted = verify(logits, draft, sampling, generator, context, generated)
        self.length.update(len(draft.tokens), accepted)
        self.rounds += 1
        self.drafted += len(draft.tokens)
        self.accepted += accepted
        return Round(emitted, len(draft.tokens), accepted, logits[:len(emitted)])


# --------------------------------------------------------------------------------------------
# Building a drafter from a --draft value
# --------------------------------------------------------------------------------------------

def make_drafter(spec: str, target_path: Optional[str | os.PathLike] = None,
                 max_seq_len: Optional[int] = None, progress: bool = False) -> Drafter:
    """The drafter a `--draft` value names.

    Args:
        spec: "lookup" (prompt lookup, no model); "int4", "int8" or "auto" (the target's own
            checkpoint loaded with that dtype: e.g. a float32 target drafted by its int4 weights;
            for a Q4_0/Q4_1 GGUF "int4" and "auto" both keep the file's 4-bit blocks on
            torchllama's kernels); anything else: a checkpoint path (or packaged name) of a
            draft model with the target's tokenizer, loaded with dtype "auto".
        target_path: the target's checkpoint (None: the embedded SmolLM2-135M-Instruct), for
            the dtype specs.
        max_seq_len: the draft model's KV cache length (default: its context).
        progress: show a progress bar while loading.

    Raises:
        ArgumentError: an empty spec. ModelFileError: as `torchllama.load` for the draft.
    """
    from torchllama.checkpoint import load

    if not spec:
        raise ArgumentError("--draft needs a value: lookup, int4, int8, auto or a checkpoint path")
    if spec == "lookup":
        return PromptLookupDrafter()
    path, dtype = (target_path, spec) if spec in SELF_DRAFT_DTYPES else (spec, "auto")
    model, _ = load(path, dtype=dtype, progress=progress)
    return ModelDrafter(model, max_seq_len)
