"""`torchllama bench speculative`: greedy decoding of the float32 model (the exact answer)
plainly, drafted by the checkpoint's own int4 weights (or another --draft) and by prompt lookup,
on an open chat answer and on a summary quoting its input (`run_speculative_bench`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from torchllama.bench.decode import weight_dtypes
from torchllama.bench.timing import PAUSE_S

#: A paragraph to summarise with quotes: the answer repeats its context (prompt lookup's case).
SPECULATIVE_PARAGRAPH = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
    "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the "
    "coast of Queensland, Australia. It can be seen from outer space and is the world's "
    "biggest single structure made by living organisms. This reef structure is composed of and "
    "built by billions of tiny organisms, known as coral polyps.")
#: (name, chat prompt) of the speculative bench: an open answer, and one that quotes its input.
SPECULATIVE_PROMPTS = (
    ("story", "Write a short story about a robot who learns to paint."),
    ("summary", SPECULATIVE_PARAGRAPH + "\n\nSummarise the paragraph above, quoting its key "
                                        "sentences word for word."),
)


@dataclass
class SpeculativeResult:
    """One (prompt, method) of `run_speculative_bench`: median decode tokens/s and median
    seconds from the prompt to the last token (prefill, a draft model's included), the last
    run's acceptance rate and tokens per target forward, and whether its tokens were plain
    decoding's."""

    prompt: str
    method: str
    decode_tok_s: float
    total_s: float
    acceptance: Optional[float]
    tokens_per_pass: float
    same_tokens: bool


class SessionRun:
    """`run()` → (decode tokens/s, prefill + decode seconds) of one greedy `Session.generate`
    from empty caches (the drafter's too). A draft model's prefill of the prompt counts as
    prefill (`Session.generate` runs it there), the drafting as decoding. `stats` and
    `tokens`: the last run's."""

    def __init__(self, model, tokenizer, prompt_ids: list[int], new_tokens: int, drafter=None,
                 draft_tokens: int = 12):
        self.model, self.tokenizer, self.prompt_ids = model, tokenizer, prompt_ids
        self.new_tokens, self.drafter, self.draft_tokens = new_tokens, drafter, draft_tokens
        self.stats, self.tokens = None, []

    def __call__(self) -> tuple[float, float]:
        from torchllama.generation.session import Session
        from torchllama.generation.sampling import SamplingParams

        if self.drafter is not None:
            self.drafter.reset()
        session = Session(self.model, self.tokenizer, draft=self.drafter,
                          draft_tokens=self.draft_tokens)
        self.tokens = list(session.generate(self.prompt_ids, self.new_tokens,
                                            SamplingParams(temperature=0)))
        self.stats = session.stats
        return self.stats.decode_tokens_per_s, self.stats.prefill_s + self.stats.decode_s


def _measure_sessions(runs: dict[str, SessionRun], repeats: int) -> dict[str, tuple]:
    """Median (decode tok/s, total seconds) of each run: one warm-up each, then `repeats`
    rounds interleaved, with `timing.measure`'s pause before each run."""
    for run in runs.values():
        run()
    figures: dict[str, list] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            time.sleep(PAUSE_S)
            figures[name].append(run())
    return {name: (statistics.median(f[0] for f in fs), statistics.median(f[1] for f in fs))
            for name, fs in figures.items()}


def run_speculative_bench(model_path: Optional[str] = None, new_tokens: int = 128,
                          repeats: int = 3, draft: str = "int4", draft_tokens: int = 12,
                          print_fn: Callable[[str], None] = print) -> list[SpeculativeResult]:
    """Greedy decoding of the float32 model (the exact answer) plain, drafted by a draft
    model (`draft`, default the checkpoint's own int4 weights) and by prompt lookup, on an open
    chat answer and on a summary that quotes its paragraph; prints decode tokens/s and the
    time from prompt to last token, each with its speedup over plain float32, the acceptance
    rate, tokens per target pass, and whether the tokens were plain decoding's (they must be).

    Args:
        model_path: the checkpoint (default: the embedded SmolLM2-135M-Instruct).
        new_tokens: the most tokens generated per answer (the chat's end token stops sooner).
        repeats: measurements per figure after a warm-up, interleaved (the median is shown).
        draft: the draft model: int4, int8, auto (the checkpoint's own weights in that
            format) or a path (`torchllama.generation.speculative.make_drafter`).
        draft_tokens: the most tokens drafted per step.

    Raises:
        ArgumentError, ModelFileError: as `make_drafter` and `load`.
    """
    from torchllama.checkpoint import load, resolve_model_path
    from torchllama.generation.session import encode_prompt
    from torchllama.kernels import isa as kernels_isa
    from torchllama.generation.speculative import PromptLookupDrafter, make_drafter

    path = str(resolve_model_path(model_path))
    model, tokenizer = load(path, dtype="float32", progress=False)
    drafter = make_drafter(draft, model_path)
    print_fn(f"model {path}: target float32 (exact), draft {draft} (weights: "
             f"{weight_dtypes(drafter.model)}) or prompt lookup, at most {draft_tokens} "
             f"drafted tokens per step")
    print_fn(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torchllama kernels "
             f"{kernels_isa()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
             f"greedy, at most {new_tokens} new tokens, median of {repeats} after a warm-up, "
             "interleaved")
    methods = (("plain float32", None), (f"draft {draft}", drafter),
               ("prompt lookup", PromptLookupDrafter()))
    results = []
    for name, text in SPECULATIVE_PROMPTS:
        ids = encode_prompt(tokenizer, text, chat=True)
        runs = {method: SessionRun(model, tokenizer, ids, new_tokens, d, draft_tokens)
                for method, d in methods}
        figures = _measure_sessions(runs, repeats)
        plain = runs["plain float32"].tokens
        for method, run in runs.items():
            results.append(SpeculativeResult(
                f"{name} ({len(ids)}+{len(plain)})", method, *figures[method],
                run.stats.acceptance_rate if run.drafter is not None else None,
                run.stats.decode_tokens / max(run.stats.decode_steps, 1), run.tokens == plain))
    for line in format_speculative_table(results):
        print_fn(line)
    return results


def format_speculative_table(results: list[SpeculativeResult]) -> list[str]:
    """One row per (prompt, method): decode tok/s and its speedup over the prompt's plain row,
    seconds from prompt to last token and that speedup, acceptance, tokens per target pass,
    same tokens as plain."""
    width = max(len(r.prompt) for r in results) + 2
    lines = [f"{'prompt (in+out)':{width}}{'method':<16}{'decode tok/s':>13}{'speedup':>9}"
             f"{'total s':>9}{'speedup':>9}{'accepted':>10}{'tok/pass':>10}{'same tokens':>13}"]
    base: dict[str, SpeculativeResult] = {}
    for r in results:
        b = base.setdefault(r.prompt, r)
        accepted = f"{r.acceptance:.0%}" if r.acceptance is not None else "-"
        lines.append(f"{r.prompt:{width}}{r.method:<16}{r.decode_tok_s:13.1f}"
                     f"{r.decode_tok_s / b.decode_tok_s:8.2f}x{r.total_s:9.2f}"
                     f"{b.total_s / r.total_s:8.2f}x{accepted:>10}{r.tokens_per_pass:10.2f}"
                     f"{'yes' if r.same_tokens else 'NO':>13}")
    return lines


def result_runs(results: list[SpeculativeResult], model: str):
    """The figures of `run_speculative_bench` as `torchllama.bench.results` runs, one per
    prompt: each method's decode tokens/s beside plain decoding's (the "peer": the ratio is
    the speed-up)."""
    from torchllama.bench.results import Figure, Run

    runs = []
    for prompt in dict.fromkeys(r.prompt for r in results):
        rows = [r for r in results if r.prompt == prompt]
        plain = next((r for r in rows if r.method.startswith("plain")), None)
        figures = [Figure(f"{r.method} decode", "tok/s", r.decode_tok_s,
                          plain.decode_tok_s if plain else None)
                   for r in rows if r is not plain]
        runs.append(Run(f"{model}: {prompt}", figures, "plain decoding" if plain else None,
                        "the same float32 model, greedy (the same tokens)"))
    return runs

