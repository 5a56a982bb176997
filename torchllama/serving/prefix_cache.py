"""The prefix cache: keys and values of prompts already prefilled, kept for later prompts that
start the same way (a shared system prompt, a multi-turn chat resent in full, few-shot examples).

What llama.cpp's `cache_prompt` and vLLM's automatic prefix caching give their users, in its
simplest form: when the engine finishes prefilling a prompt, it keeps a copy of the prompt's
slots from its cache row (`KVCaches.read_row`: every layer's keys and values of slots
0..P-1; a sliding-window layer's ring as it is). A new prompt looks for the entry sharing the
longest prefix with it (m tokens, at most P − 1: the last prompt token is always computed, its
logits give the first new token), gets the entry's slots 0..m-1 copied into its own row, and is
prefilled from slot m. With torchllama's kernels a prompt prefilled in chunks gives the same
bits as prefilled whole, so an answer with a hit is the answer without one.

A sliding-window ring holds only the last window + margin slots of its entry: it can resume at
m only if the entry's prompt ends at most margin + 1 tokens after m (`can_write_at`); further
back, the hit is a miss for that model (Gemma, Mistral).

Entries live within a memory budget (bytes of their tensors), the least recently used evicted
first. Counters (hits, misses, tokens reused) feed the server's /metrics.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

#: A prompt is kept as a new entry only if it brings at least this many tokens beyond its hit,
#: and at least a quarter as many as the hit: a short question after a cached system prompt
#: would copy the whole prompt again for little that another request could reuse, while a
#: chat resent with a new answer and turn brings enough.
MIN_NEW_TOKENS = 16


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    state: list                       # KVCaches.read_row
    nbytes: int


def _nbytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(s) for s in state)
    return 0


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Prompts' keys and values for reuse by later prompts (see the module docstring). Used
    from the engine thread; the counters may be read from any thread.

    Args:
        model: the engine's `Transformer`, caches allocated.
        budget_bytes: memory the entries may hold in all (> 0).
    """

    def __init__(self, model, budget_bytes: int):
        self.model = model
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()   # LRU first
        self.nbytes = 0
        self.hits = 0                # prompts that reused a prefix
        self.misses = 0
        self.tokens_reused = 0       # prompt tokens not prefilled thanks to the cache
        self.evictions = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def _best(self, prompt: list[int]) -> tuple[int, _Entry | None]:
        best, entry = 0, None
        for candidate in self._entries.values():
            m = common_prefix(candidate.tokens, prompt)
            if m > best:
                best, entry = m, candidate
        return min(best, len(prompt) - 1), entry

    def restore(self, prompt: list[int], row: int) -> int:
        """Put the longest cached prefix of `prompt` into cache row `row` (freshly reset).

        Returns:
            m, the prompt tokens whose keys and values the row now holds (slots 0..m-1); 0 on a
            miss (the row is left reset).
        """
        m, entry = self._best(prompt)
        if entry is not None and m > 0:
            self.model.caches.write_row(row, entry.state)
            if self.model.caches.can_write_at(m, row):
                self._entries.move_to_end(entry.tokens)
                with self._lock:
                    self.hits += 1
                    self.tokens_reused += m
                return m
            self.model.caches.reset_rows(slice(row, row + 1))   # a ring cannot go back to m
        with self._lock:
            self.misses += 1
        return 0

    def store(self, prompt: list[int], row: int) -> None:
        """Keep the prompt just prefilled in cache row `row` (slots 0..P-1), unless an entry
        already gives most of it (see MIN_NEW_TOKENS); evict the least recently used entries
        beyond the budget."""
        key = tuple(prompt)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        m, _ = self._best(prompt)
        if len(prompt) - m < max(MIN_NEW_TOKENS, m // 4):
            return
        state = self.model.caches.read_row(row, len(prompt))
        nbytes = _nbytes(state)
        if nbytes > self.budget_bytes:
            return
        while self.nbytes + nbytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1
        self._entries[key] = _Entry(key, state, nbytes)
        self.nbytes += nbytes
