"""Timing shared by the benches: every figure is the median of interleaved runs, each library's
after one warm-up, with a pause before each run (`measure`).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

#: Seconds between two timed runs (see `measure`).
PAUSE_S = 0.5


def measure(runs: dict[str, Callable[[], tuple[int, float]]], repeats: int) -> dict[str, float]:
    """Median tokens/s of each run. Runs are interleaved (A, B, A, B, ...) after one warm-up
    each, so that both see the same machine noise, with a pause before each: the worker threads
    of the run before (OpenMP's, ggml's thread pool) poll for work a while after it ends, and on
    a 2-core machine they would take the next run's cores (measured: torchllama's decode
    99 tok/s right after llama.cpp's, 141 alone)."""
    return {name: statistics.median(r) for name, r in interleaved_rates(runs, repeats).items()}


def interleaved_rates(runs: dict[str, Callable[[], tuple[int, float]]], repeats: int
                      ) -> dict[str, list[float]]:
    """Tokens/s of `repeats` timed runs of each setting (each run returns (tokens, seconds)),
    interleaved A, B, A, B, ... after one untimed warm-up of each (allocations, kernel
    selection), with `PAUSE_S` before each timed run (see `measure`)."""
    for run in runs.values():
        run()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            time.sleep(PAUSE_S)
            tokens, seconds = run()
            rates[name].append(tokens / seconds)
    return rates
