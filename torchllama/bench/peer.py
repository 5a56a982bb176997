"""llama.cpp as the speed peer of `torchllama bench decode --peer llama.cpp`, through
llama-cpp-python's low-level ctypes bindings (the C API of llama.h: `llama_decode` on a
`llama_batch`).

The same loops as ours in torchllama.bench.decode, on the same GGUF file with the same threads
and token ids:

- prefill: one `llama_decode` of the whole prompt (n_batch = n_ubatch = 512, so a 512-token
  prompt is one call), only the last position's logits requested, from an empty KV cache;
- decode: N sequences (ids 0..N-1, one stream each) in one `llama_batch` per step, one token per
  sequence, logits of every row read back and argmax'd in NumPy (greedy), N = 1 for the batch-1
  figure. The prompts are prefilled once; every run then drops the cache past the prompt
  (`llama_memory_seq_rm`) and decodes the same steps again, as llama.cpp's examples/batched does
  after its prefill.

Contexts use llama.cpp's own defaults (`llama_context_default_params`: f16 KV cache, one KV
stream per sequence) except for sizes, threads and flash attention, which every run sets on or
off: neither is faster everywhere (its default "auto" turns it on, which on a CPU can decode at
half the speed of off), so the bench measures both and compares with the faster. Nothing here is imported
by the package unless the peer is asked for: llama-cpp-python is optional (`make bench-peer`
builds it from source with native CPU flags).
"""

from __future__ import annotations

import ctypes
import time
from typing import Optional, Sequence

import numpy as np

from torchllama.errors import ArgumentError

N_BATCH = 512                 # tokens per llama_decode call (n_batch = n_ubatch)


def import_llama_cpp():
    """The `llama_cpp` module, with llama.cpp's own logging silenced (errors only).

    Raises:
        ArgumentError: llama-cpp-python is not installed (names `make bench-peer`).
    """
    try:
        import llama_cpp
    except ImportError as e:
        raise ArgumentError(
            "--peer llama.cpp needs llama-cpp-python, which is not installed; build it with "
            "`make bench-peer` (llama-cpp-python from source with native CPU flags, ≈6 min on "
            f"2 cores), or use --peer transformers / --peer none ({e})") from None
    import logging

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)   # its log callback's filter
    return llama_cpp


def peer_version() -> str:
    """'llama-cpp-python X (CPU : SSE3 = 1 | AVX2 = 1 | ...)': the binding's version and
    llama.cpp's `llama_print_system_info` (the ISA features its CPU backend was built with)."""
    llama_cpp = import_llama_cpp()
    info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return f"llama-cpp-python {llama_cpp.__version__} ({info})"


class LlamaCpp:
    """A GGUF file loaded by llama.cpp (CPU only, memory-mapped), and contexts on it.

    Args:
        path: the .gguf file.
        n_threads: threads for both single-token and batch evaluation (n_threads and
            n_threads_batch), normally torch.get_num_threads().

    Raises:
        ArgumentError: llama-cpp-python is not installed.
        RuntimeError: llama.cpp could not load the file.
    """

    def __init__(self, path: str, n_threads: int):
        self.lib = import_llama_cpp()
        self.n_threads = n_threads
        self.lib.llama_backend_init()
        params = self.lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = self.lib.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self.model))
        self._contexts: list = []
        self._batches: list = []

    def context(self, n_seq: int, n_ctx_seq: int, flash_attn: bool):
        """A new context for `n_seq` sequences of up to `n_ctx_seq` positions each (rounded up
        to llama.cpp's padding of 256), with flash attention on or off, freed by `close`."""
        params = self.lib.llama_context_default_params()
        if hasattr(params, "flash_attn_type"):        # llama.cpp's enum: −1 auto, 0 off, 1 on
            params.flash_attn_type = int(flash_attn)
        else:
            params.flash_attn = flash_attn
        n_ctx_seq = -(-n_ctx_seq // 256) * 256
        params.n_ctx = n_seq * n_ctx_seq
        params.n_batch = params.n_ubatch = N_BATCH
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = self.n_threads
        params.no_perf = True
        ctx = self.lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_seq} × {n_ctx_seq}")
        self._contexts.append(ctx)
        return ctx

    def batch(self, n_tokens: int):
        """A new `llama_batch` of up to `n_tokens` tokens (one sequence id each), freed by
        `close`."""
        batch = self.lib.llama_batch_init(n_tokens, 0, 1)
        self._batches.append(batch)
        return batch

    def free(self, ctx) -> None:
        """Free one context of `context` now (its KV cache and buffers), before `close`."""
        if ctx in self._contexts:
            self._contexts.remove(ctx)
            self.lib.llama_free(ctx)

    def close(self) -> None:
        """Free the batches, contexts and model (in that order)."""
        for batch in self._batches:
            self.lib.llama_batch_free(batch)
        for ctx in self._contexts:
            self.lib.llama_free(ctx)
        self._batches, self._contexts = [], []
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> "LlamaCpp":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _decode(lib, ctx, batch) -> None:
    rc = lib.llama_decode(ctx, batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode failed (return code {rc})")


def _fill(batch, tokens: Sequence[int], seq_id: int, start: int, last_logits: bool) -> None:
    """Append `tokens` of sequence `seq_id` at positions start, start+1, ... to `batch`;
    request logits for the last one only when `last_logits`."""
    n0 = batch.n_tokens
    for i, t in enumerate(tokens):
        j = n0 + i
        batch.token[j] = t
        batch.pos[j] = start + i
        batch.n_seq_id[j] = 1
        batch.seq_id[j][0] = seq_id
        batch.logits[j] = 0
    batch.logits[n0 + len(tokens) - 1] = last_logits
    batch.n_tokens = n0 + len(tokens)


class PrefillRun:
    """`run()` → (prompt tokens, seconds) of one prefill of `prompt` into an emptied KV cache,
    last position's logits only (one `llama_decode` per 512 tokens)."""

    def __init__(self, peer: LlamaCpp, prompt: Sequence[int], flash_attn: bool):
        self.lib, self.prompt = peer.lib, [int(t) for t in prompt]
        self.ctx = peer.context(1, len(self.prompt), flash_attn)
        self.memory = self.lib.llama_get_memory(self.ctx)
        self.batch = peer.batch(N_BATCH)

    def __call__(self) -> tuple[int, float]:
        lib, T = self.lib, len(self.prompt)
        lib.llama_memory_clear(self.memory, True)
        t0 = time.perf_counter()
        for start in range(0, T, N_BATCH):
            self.batch.n_tokens = 0
            chunk = self.prompt[start:start + N_BATCH]
            _fill(self.batch, chunk, 0, start, start + len(chunk) == T)
            _decode(lib, self.ctx, self.batch)
        lib.llama_get_logits_ith(self.ctx, -1)          # waits for the computation
        return T, time.perf_counter() - t0


class DecodeRun:
    """`run()` → (N × new_tokens, seconds) of `new_tokens` greedy decode steps of N sequences
    in one `llama_batch` per step (sequence i is row i, ids 0..N-1).

    The prompts (one per sequence, all of the same length T) are prefilled on the first call,
    untimed; every call then drops the KV cache past position T and decodes from the prompts'
    greedy next tokens again. `tokens` holds the ids the last call's decode steps chose,
    (N, new_tokens) (the prefill's token, which they start from, not included).
    """

    def __init__(self, peer: LlamaCpp, prompts: Sequence[Sequence[int]], new_tokens: int,
                 flash_attn: bool):
        self.lib, self.n_vocab, self.new_tokens = peer.lib, peer.n_vocab, new_tokens
        self.prompts = [[int(t) for t in p] for p in prompts]
        if len({len(p) for p in self.prompts}) != 1:
            raise ValueError("DecodeRun: all prompts must have the same length")
        self.n_seq, self.T = len(self.prompts), len(self.prompts[0])
        self.ctx = peer.context(self.n_seq, self.T + new_tokens, flash_attn)
        self.memory = self.lib.llama_get_memory(self.ctx)
        self.batch = peer.batch(max(N_BATCH, self.n_seq))
        self.first: Optional[np.ndarray] = None          # (N,) greedy token after each prompt
        self.tokens: Optional[np.ndarray] = None         # (N, new_tokens) of the last run

    def _logits(self) -> np.ndarray:
        """(n_outputs, V) float32 logits of the last llama_decode (a view, not a copy)."""
        ptr = self.lib.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(self.n_seq, self.n_vocab))

    def _prefill(self) -> None:
        lib, first = self.lib, np.zeros(self.n_seq, dtype=np.int64)
        lib.llama_memory_clear(self.memory, True)
        for seq, prompt in enumerate(self.prompts):
            for start in range(0, self.T, N_BATCH):
                self.batch.n_tokens = 0
                chunk = prompt[start:start + N_BATCH]
                last = start + len(chunk) == self.T
                _fill(self.batch, chunk, seq, start, last)
                _decode(lib, self.ctx, self.batch)
            logits = lib.llama_get_logits_ith(self.ctx, -1)
            first[seq] = np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax()
        self.first = first

    def __call__(self) -> tuple[int, float]:
        lib, N, T = self.lib, self.n_seq, self.T
        if self.first is None:
            self._prefill()
        lib.llama_memory_seq_rm(self.memory, -1, T, -1)   # every sequence back to its prompt
        out = np.empty((N, self.new_tokens), dtype=np.int64)
        token = self.first
        batch = self.batch
        t0 = time.perf_counter()
        for step in range(self.new_tokens):
            batch.n_tokens = 0
            for seq in range(N):
                _fill(batch, (int(token[seq]),), seq, T + step, True)
            _decode(lib, self.ctx, batch)
            token = self._logits().argmax(axis=1)                           # (N,)
            out[:, step] = token
        seconds = time.perf_counter() - t0
        self.tokens = out
        return N * self.new_tokens, seconds
