"""The prefix cache: keys and values of token sequences already computed, kept for later prompts
that start the same way (a shared system prompt, a multi-turn chat resent in full with the
answers it got, an agent's growing transcript, few-shot examples).

`BlockPrefixCache` (every model whose layers all keep every slot): vLLM's automatic prefix
caching in its simplest form. A sequence is cut into blocks of `block_size` tokens; block i is
keyed by a hash chain, digest_i = H(digest_{i−1} ‖ its tokens) from a root that names the
adapter, so a key stands for the block's whole prefix. What a cache row holds is stored twice
in a request's life: when its prompt is prefilled, and when it finishes (the prompt and the
generated tokens the model has fed: an answer resent in the next turn is not prefilled again).
A block already cached is not copied again: a system prompt shared by many chats is held once.
A new prompt copies the longest chain of cached blocks from its start into its row (at most
P − 1 tokens: the last prompt token is always computed, its logits give the first new token)
and is prefilled from there. With torchllama's kernels a token's keys and values are the same
bits whether computed in a decode step, a prefill chunk or a whole prompt, so an answer with a
hit is the answer without one. Least recently used blocks are evicted first, a chain's last
blocks before its first (a hit touches a chain from its end to its root).

`PrefixCache` (models with sliding-window layers: Gemma 2/3, Mistral): a ring holds only the
last window + margin slots, so it cannot be cut into blocks. Whole prompts are kept as entries
(the row's slots 0..P−1, a ring as it is) when their prefill completes; a new prompt takes the
entry sharing the longest prefix with it, if the ring can resume there (the entry's prompt
ends at most margin + 1 tokens after it: `can_write_at`); else it is a miss. An entry is kept
only if it brings at least `MIN_NEW_TOKENS` tokens beyond its own hit and a quarter as many as
the hit. Generated tokens are not kept.

Both live within a memory budget (bytes of their tensors) and count hits, misses, tokens reused
and evictions for the server's /metrics.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

#: Tokens per block of `BlockPrefixCache` (vLLM's default too; SGLang's radix tree: 1). A hit
#: recomputes up to a block's worth of the shared prefix, which costs more than the copies a
#: smaller block adds (`benchmarks/multi_turn.py` and `torchllama bench load` measure the time
#: to first token). A turn prefills at most its new tokens + one block.
BLOCK_SIZE = 16

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
    salt: bytes = b""                 # the adapter's name


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
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()   # LRU first
        self.nbytes = 0
        self.hits = 0                # prompts that reused a prefix
        self.misses = 0
        self.tokens_reused = 0       # prompt tokens not prefilled thanks to the cache
        self.evictions = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def _best(self, prompt: list[int], salt: bytes = b"") -> tuple[int, _Entry | None]:
        best, entry = 0, None
        for candidate in self._entries.values():
            if candidate.salt != salt:
                continue
            m = common_prefix(candidate.tokens, prompt)
            if m > best:
                best, entry = m, candidate
        return min(best, len(prompt) - 1), entry

    def restore(self, prompt: list[int], row: int, salt: bytes = b"") -> int:
        """Put the longest cached prefix of `prompt` (among entries of the same `salt`: the
        adapter's name) into cache row `row` (freshly reset).

        Returns:
            m, the prompt tokens whose keys and values the row now holds (slots 0..m-1); 0 on a
            miss (the row is left reset).
        """
        m, entry = self._best(prompt, salt)
        if entry is not None and m > 0:
            self.model.caches.write_row(row, entry.state)
            if self.model.caches.can_write_at(m, row):
                self._entries.move_to_end((salt, entry.tokens))
                with self._lock:
                    self.hits += 1
                    self.tokens_reused += m
                return m
            self.model.caches.reset_rows(slice(row, row + 1))   # a ring cannot go back to m
        with self._lock:
            self.misses += 1
        return 0

    def store(self, prompt: list[int], row: int, salt: bytes = b"") -> None:
        """Keep the prompt just prefilled in cache row `row` (slots 0..P-1), unless an entry
        already gives most of it (see MIN_NEW_TOKENS); evict the least recently used entries
        beyond the budget."""
        key = (salt, tuple(prompt))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        m, _ = self._best(prompt, salt)
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
        self._entries[key] = _Entry(key[1], state, nbytes, salt)
        self.nbytes += nbytes


@dataclass
class _Block:
    digest: bytes
    state: list                       # KVCaches.read_slots: per layer (keys, values) of B slots
    nbytes: int


class BlockPrefixCache:
    """Blocks of keys and values keyed by their whole prefix (see the module docstring). Used
    from the engine thread; the counters may be read from any thread.

    Args:
        model: the engine's `Transformer`, caches allocated (no sliding-window layer).
        budget_bytes: memory the blocks may hold in all (> 0).
        block_size: tokens per block.
    """

    def __init__(self, model, budget_bytes: int, block_size: int = BLOCK_SIZE):
        self.model = model
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()    # least recently used first
        self.nbytes = 0
        self.hits = 0                # prompts that reused a prefix
        self.misses = 0
        self.tokens_reused = 0       # prompt tokens not prefilled thanks to the cache
        self.evictions = 0           # blocks evicted
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    def digests(self, tokens: Sequence[int], salt: bytes = b"") -> list[bytes]:
        """The hash chain of the whole blocks of `tokens`: digest_i = BLAKE2b-128(digest_{i−1}
        ‖ block i's ids as int64), digest_{−1} = BLAKE2b-128(salt) (the adapter's name)."""
        B = self.block_size
        parent = hashlib.blake2b(b"torchllama-prefix:" + salt, digest_size=16).digest()
        ids = np.asarray(tokens[:len(tokens) // B * B], dtype=np.int64)
        out = []
        for i in range(len(ids) // B):
            parent = hashlib.blake2b(parent + ids[i * B:(i + 1) * B].tobytes(),
                                     digest_size=16).digest()
            out.append(parent)
        return out

    def restore(self, prompt: Sequence[int], row: int, salt: bytes = b"") -> int:
        """Copy the longest chain of cached blocks that starts `prompt` into cache row `row`
        (freshly reset).

        Returns:
            m, the prompt tokens whose keys and values the row now holds (slots 0..m-1, at
            most len(prompt) − 1); 0 on a miss.
        """
        chain = []
        for digest in self.digests(prompt, salt):
            block = self._blocks.get(digest)
            if block is None:
                break
            chain.append(block)
        m = min(len(chain) * self.block_size, len(prompt) - 1)
        if m <= 0:
            with self._lock:
                self.misses += 1
            return 0
        chain = chain[:-(-m // self.block_size)]              # the blocks holding 0..m-1
        self.model.caches.write_slots(row, 0, [b.state for b in chain])
        self._touch(chain)
        with self._lock:
            self.hits += 1
            self.tokens_reused += m
        return m

    def store(self, tokens: Sequence[int], row: int, salt: bytes = b"") -> None:
        """Keep the whole blocks of `tokens`, whose keys and values cache row `row` holds at
        slots 0..len(tokens)-1, that are not cached yet; evict the least recently used blocks
        beyond the budget."""
        B = self.block_size
        chain = []
        for i, digest in enumerate(self.digests(tokens, salt)):
            block = self._blocks.get(digest)
            if block is None:
                state = self.model.caches.read_slots(row, i * B, (i + 1) * B)
                block = _Block(digest, state, _nbytes(state))
                if block.nbytes > self.budget_bytes:
                    break
                self._blocks[digest] = block
                self.nbytes += block.nbytes
            chain.append(block)
        self._touch(chain)
        while self.nbytes > self.budget_bytes:
            _, old = self._blocks.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1

    def _touch(self, chain: list[_Block]) -> None:
        """Most recently used: the chain, its root last (so its end is evicted first)."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.digest)
