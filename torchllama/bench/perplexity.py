"""`torchllama perplexity`: a model's perplexity on a text, computed exactly as llama.cpp's
`llama-perplexity` computes it (tools/perplexity/perplexity.cpp, `perplexity()`), so that the
figures of the two can be compared on the same GGUF file and text.

The method (llama.cpp's defaults: no --ppl-stride, no KL divergence):

1. Tokenize the whole text once, with the model's BOS in front when it adds one
   (`common_tokenize(ctx, text, add_special=true, parse_special=false)`).
2. The text must hold at least 2·n_ctx tokens; it is cut into n_chunk = ⌊n_tokens / n_ctx⌋
   non-overlapping windows of n_ctx tokens (fewer with `chunks`); the tail is dropped.
3. When the model adds BOS, the first token of every window is replaced by BOS.
4. Each window is evaluated from an empty cache; only its second half is scored: with
   first = ⌊n_ctx/2⌋, the logits at positions first .. n_ctx−2 predict tokens first+1 .. n_ctx−1,
   i.e. n_ctx − 1 − first tokens per window (255 for n_ctx = 512). Every scored token has at least
   first tokens of context.
5. NLL = −log softmax(logits)[next token]; the sums of NLL and NLL² run over all scored tokens.
   PPL = exp(mean NLL). Its uncertainty, as llama.cpp prints it ("PPL = x +/- y"):
   σ = sqrt((mean(NLL²) − mean(NLL)²) / (count − 1)) is the standard error of the mean NLL, and
   the ± is PPL·σ (first-order propagation through exp).
6. After each window the running PPL exp(ΣNLL / count) is printed as llama.cpp does:
   `[1]12.3456,[2]11.9876,...`.

Several windows go through one forward pass (`batch_size`, llama.cpp's n_seq = n_batch / n_ctx);
the output projection runs only on the scored half, window by window, and the log-softmax is
float32 whatever the weights' dtype (llama.cpp's logits are float32 too). As in llama.cpp, the
keys and values go through the KV cache (float16 there by default; here the model's
kv_cache_dtype or `kv_cache_dtype`), so a window's attention reads them as the cache stores them.

`llama_cpp_perplexity` computes llama.cpp's own figure with llama-cpp-python, when it is installed
(an optional peer, never a dependency).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from torchllama.errors import ArgumentError, ModelFileError

#: The smallest context with at least one scored token per window (n_ctx − 1 − n_ctx/2 ≥ 1).
MIN_CTX = 4


@dataclass
class PerplexityResult:
    """The outcome of a perplexity run.

    Attributes:
        ppl: exp(mean NLL) over the scored tokens.
        stderr: the uncertainty of ppl as llama.cpp prints it (PPL·σ of the mean NLL); NaN with
            fewer than two scored tokens.
        n_tokens: tokens in the whole text (with the leading BOS when the model adds one).
        n_scored: tokens scored (chunks × (ctx − 1 − ctx//2)).
        chunks: windows evaluated.
        ctx: window length in tokens.
        running: the running PPL after each window ([1], [2], ... in llama.cpp's output).
        nll_sum: Σ NLL over the scored tokens (nats).
        nll2_sum: Σ NLL² (nats²).
        seconds: wall time of the evaluation (tokenization excluded).
        name: who computed it ("torchllama" or "llama.cpp").
    """

    ppl: float
    stderr: float
    n_tokens: int
    n_scored: int
    chunks: int
    ctx: int
    running: list[float] = field(default_factory=list)
    nll_sum: float = 0.0
    nll2_sum: float = 0.0
    seconds: float = 0.0
    name: str = "torchllama"

    @property
    def mean_nll(self) -> float:
        """Mean NLL per scored token in nats (= log ppl)."""
        return self.nll_sum / self.n_scored


def ppl_and_stderr(nll_sum: float, nll2_sum: float, count: int) -> tuple[float, float]:
    """PPL and its uncertainty from the sums of per-token NLL and NLL², as llama.cpp's
    perplexity.cpp reports them ("Final estimate: PPL = %.4lf +/- %.5lf").

    Args:
        nll_sum: Σ NLL over the scored tokens (nats).
        nll2_sum: Σ NLL².
        count: number of scored tokens (≥ 1).

    Returns:
        (ppl, stderr): ppl = exp(Σ/count); stderr = ppl·sqrt((Σ²/count − (Σ/count)²)/(count − 1)),
        0.0 when the variance rounds to ≤ 0, NaN when count < 2.

    Raises:
        ArgumentError: count < 1.
    """
    if count < 1:
        raise ArgumentError(f"no scored tokens (count={count})")
    mean = nll_sum / count
    ppl = math.exp(mean)
    if count < 2:
        return ppl, math.nan
    var = nll2_sum / count - mean * mean
    return ppl, ppl * math.sqrt(var / (count - 1)) if var > 0 else 0.0


def tokenize_text(tokenizer, text: str, ctx: int, source: str = "the text") -> list[int]:
    """The text's token ids as llama.cpp's perplexity tokenizes it: BOS in front when the model
    adds one (`tokenizer.add_bos`), special-token strings read as plain text.

    Args:
        tokenizer: a `torchllama.tokenizers.Tokenizer`.
        text: the whole text.
        ctx: window length, to check that the text holds at least 2·ctx tokens (llama.cpp's rule).
        source: how the error names the text (e.g. "--text-file FILE").

    Raises:
        ArgumentError: ctx < 4, or fewer than 2·ctx tokens.
    """
    if ctx < MIN_CTX:
        raise ArgumentError(f"--ctx must be ≥ {MIN_CTX}, got {ctx}")
    ids = tokenizer.encode(text, bos=tokenizer.add_bos, special=False)
    if len(ids) < 2 * ctx:
        raise ArgumentError(
            f"{source} tokenizes to only {len(ids)} tokens; perplexity with --ctx {ctx} needs at "
            f"least {2 * ctx} (2 × ctx, as llama.cpp requires): give more text or a smaller --ctx")
    return ids


def make_windows(ids: Sequence[int], ctx: int, chunks: Optional[int] = None,
                 bos_id: Optional[int] = None) -> torch.Tensor:
    """The non-overlapping windows llama.cpp evaluates.

    Args:
        ids: the text's token ids.
        ctx: window length.
        chunks: at most this many windows (llama.cpp's --chunks; None = all).
        bos_id: replace the first token of each window by it (None = keep the text's token).

    Returns:
        (n_chunk, ctx) int64, n_chunk = min(⌊len(ids)/ctx⌋, chunks).

    Raises:
        ArgumentError: chunks < 1.
    """
    if chunks is not None and chunks < 1:
        raise ArgumentError(f"--chunks must be ≥ 1, got {chunks}")
    n_chunk = len(ids) // ctx
    if chunks is not None:
        n_chunk = min(n_chunk, chunks)
    windows = torch.tensor(list(ids[:n_chunk * ctx]), dtype=torch.long).view(n_chunk, ctx)
    if bos_id is not None:
        windows[:, 0] = bos_id
    return windows


def scored_nll(logits: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Per-token NLL of a window's scored half.

    Args:
        logits: (ctx − 1 − first, V) logits at positions first .. ctx−2 (any float dtype;
            computed in float32).
        window: (ctx,) int64 token ids of the window (BOS already in place).

    Returns:
        (ctx − 1 − first,) float64 NLL in nats of tokens first+1 .. ctx−1.
    """
    first = window.shape[0] // 2
    targets = window[first + 1:]
    return F.cross_entropy(logits.float(), targets, reduction="none").double()


@torch.inference_mode()
def window_nll(model, windows: torch.Tensor) -> torch.Tensor:
    """NLL of the scored half of each window, with one forward pass over all of them.

    Args:
        model: a `torchllama.model.Transformer` with KV caches of at least B rows and ctx slots
            (each window is written from slot 0: an empty cache), or none (uncached attention
            over the float keys).
        windows: (B, ctx) int64 token ids.

    Returns:
        (B, ctx − 1 − ctx//2) float64 NLL in nats.
    """
    ctx = windows.shape[1]
    first = ctx // 2
    h = model(windows, hidden=True)                          # (B, ctx, dim) model dtype
    h = h[:, first:ctx - 1]                                  # positions first .. ctx−2
    # the output projection one window at a time: (ctx/2, V) float32 logits, not (B, ctx/2, V)
    return torch.stack([scored_nll(model.logits(h[b]), windows[b]) for b in range(len(windows))])


def _accumulate(result: PerplexityResult, nll: torch.Tensor) -> None:
    """Add one window's NLL (n,) float64 to the sums and record the running PPL."""
    result.nll_sum += float(nll.sum())
    result.nll2_sum += float((nll * nll).sum())
    result.n_scored += nll.numel()
    result.chunks += 1
    result.running.append(math.exp(result.nll_sum / result.n_scored))


def _finish(result: PerplexityResult, started: float) -> PerplexityResult:
    result.ppl, result.stderr = ppl_and_stderr(result.nll_sum, result.nll2_sum, result.n_scored)
    result.seconds = time.perf_counter() - started
    return result


def _bar(total: int, progress: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="chunk", desc=desc, disable=not progress, file=sys.stderr,
                dynamic_ncols=True)


def perplexity(model, tokenizer, text: str, ctx: int = 512, batch_size: int = 4,
               chunks: Optional[int] = None, progress: bool = False,
               source: str = "the text",
               on_chunk: Optional[Callable[[int, float], None]] = None,
               kv_cache_dtype: Optional[str] = None) -> PerplexityResult:
    """A model's perplexity on a text by llama.cpp's method (see the module docstring).

    Args:
        model: a `torchllama.model.Transformer` on the CPU (or any device: windows follow the
            model's embedding device), any weight dtype.
        tokenizer: its `torchllama.tokenizers.Tokenizer`.
        text: the whole text.
        ctx: window length in tokens (≥ 4, ≤ the model's max_seq_len).
        batch_size: windows per forward pass (≥ 1); does not change the result beyond float
            rounding.
        chunks: evaluate at most this many windows (llama.cpp's --chunks; None = all).
        progress: show a progress bar (stderr) with the running PPL.
        source: how errors name the text.
        on_chunk: called with (window number from 1, running PPL) after each window.
        kv_cache_dtype: what the KV cache the windows go through stores (`setup_caches`;
            default: the model's kv_cache_dtype).

    Returns:
        A `PerplexityResult`.

    Raises:
        ArgumentError: ctx out of range, batch_size < 1, chunks < 1, or a text shorter than
            2·ctx tokens.
    """
    if batch_size < 1:
        raise ArgumentError(f"--batch-size must be ≥ 1, got {batch_size}")
    if ctx > model.args.max_seq_len:
        raise ArgumentError(f"--ctx {ctx} exceeds the model's context of "
                            f"{model.args.max_seq_len} tokens")
    ids = tokenize_text(tokenizer, text, ctx, source)
    windows = make_windows(ids, ctx, chunks, tokenizer.bos_id if tokenizer.add_bos else None)
    device = model.device
    model.setup_caches(min(batch_size, len(windows)), ctx, kv_cache_dtype)   # slot 0 each time
    result = PerplexityResult(math.nan, math.nan, len(ids), 0, 0, ctx)
    started = time.perf_counter()
    with _bar(len(windows), progress, "perplexity") as bar:
        for batch in windows.split(batch_size):
            for nll in window_nll(model, batch.to(device)).cpu():
                _accumulate(result, nll)
                if on_chunk is not None:
                    on_chunk(result.chunks, result.running[-1])
            bar.update(len(batch))
            bar.set_postfix(ppl=f"{result.running[-1]:.4f}")
    model.clear_caches()
    return _finish(result, started)


# --------------------------------------------------------------------------------------------
# The peer: llama.cpp's own figure through llama-cpp-python (optional)
# --------------------------------------------------------------------------------------------

def llama_cpp_available() -> bool:
    """Whether llama-cpp-python can be imported."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_perplexity(gguf_path: str | os.PathLike, text: str, ctx: int = 512,
                         chunks: Optional[int] = None, n_threads: Optional[int] = None,
                         progress: bool = False,
                         source: str = "the text") -> PerplexityResult:
    """llama.cpp's perplexity of a GGUF file on a text, through llama-cpp-python, by the same
    method: llama.cpp's own tokenizer (BOS as the file says), the same windows, BOS replacement
    and scored halves, its float32 logits (log-softmax here in float32, sums in float64).

    Args:
        gguf_path: the .gguf file.
        text: the whole text.
        ctx: window length (n_ctx).
        chunks: at most this many windows (None = all).
        n_threads: llama.cpp threads (default: torch.get_num_threads()).
        progress: show a progress bar.
        source: how errors name the text.

    Returns:
        A `PerplexityResult` named "llama.cpp".

    Raises:
        ArgumentError: llama-cpp-python is not installed; ctx or text as `perplexity`.
        ModelFileError: llama.cpp cannot load the file.
    """
    if not llama_cpp_available():
        raise ArgumentError("--peer llama.cpp needs llama-cpp-python (`make bench-peer` builds "
                            "it into .venv); it is not installed")
    if ctx < MIN_CTX:
        raise ArgumentError(f"--ctx must be ≥ {MIN_CTX}, got {ctx}")
    import llama_cpp

    try:
        llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=ctx, n_batch=ctx,
                              logits_all=True, n_threads=n_threads or torch.get_num_threads(),
                              verbose=False)
    except (ValueError, RuntimeError) as e:
        raise ModelFileError(f"{gguf_path}: llama.cpp cannot load it ({e})") from e
    try:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)  # add_special
        if len(ids) < 2 * ctx:
            raise ArgumentError(
                f"{source} tokenizes (llama.cpp) to only {len(ids)} tokens; perplexity with "
                f"--ctx {ctx} needs at least {2 * ctx}")
        add_bos = bool(llm._model.add_bos_token())           # llama_vocab_get_add_bos
        windows = make_windows(ids, ctx, chunks, llm.token_bos() if add_bos else None)
        first = ctx // 2
        result = PerplexityResult(math.nan, math.nan, len(ids), 0, 0, ctx, name="llama.cpp")
        started = time.perf_counter()
        with _bar(len(windows), progress, "perplexity (llama.cpp)") as bar:
            for window in windows:
                llm.reset()                                   # empty KV cache per window
                llm.eval(window.tolist())
                logits = torch.from_numpy(llm.scores[first:ctx - 1].copy())   # (ctx/2−1, V)
                _accumulate(result, scored_nll(logits, window))
                bar.update(1)
                bar.set_postfix(ppl=f"{result.running[-1]:.4f}")
        return _finish(result, started)
    finally:
        if hasattr(llm, "close"):
            llm.close()


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------

def read_text_file(path: str | os.PathLike) -> str:
    """A UTF-8 text file's contents.

    Raises:
        ArgumentError: the file is missing, unreadable or not UTF-8 (named as --text-file).
    """
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ArgumentError(f"--text-file {path}: cannot read it ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise ArgumentError(f"--text-file {path}: not UTF-8 text ({e.reason})") from e


def format_running(running: Sequence[float]) -> str:
    """llama.cpp's per-chunk line: `[1]12.3456,[2]11.9876,`."""
    return "".join(f"[{i}]{p:.4f}," for i, p in enumerate(running, 1))


def format_result(r: PerplexityResult) -> str:
    """One line: `name: PPL = x +/- y (N tokens scored in C chunks of ctx, S s)`."""
    return (f"{r.name}: PPL = {r.ppl:.4f} +/- {r.stderr:.5f}  ({r.n_scored} tokens scored in "
            f"{r.chunks} chunks of {r.ctx}; text {r.n_tokens} tokens; {r.seconds:.1f} s, "
            f"{r.chunks * r.ctx / r.seconds:.0f} tok/s)")


def run_perplexity(model_path: Optional[str], text_file: str, ctx: int = 512,
                   batch_size: int = 4, dtype: str = "auto", chunks: Optional[int] = None,
                   peer: Optional[str] = None, progress: bool = True,
                   adapter: Optional[str] = None,
                   kv_cache_dtype: str = "auto") -> list[PerplexityResult]:
    """`torchllama perplexity`: load the model, compute and print its perplexity (and the peer's).

    Prints the per-chunk running PPL and the final estimate in llama.cpp's format to stdout.

    Args:
        model_path: as `torchllama.checkpoint.load`'s path (None = the embedded SmolLM2).
        text_file: UTF-8 text file.
        ctx, batch_size, chunks: as `perplexity`.
        dtype: passed to `load` (it rejects unknown names).
        peer: None or "llama.cpp".
        progress: progress bars on stderr.
        kv_cache_dtype: what our KV cache stores (`load`; llama.cpp keeps its default float16).

    Returns:
        The results: torchllama's, then the peer's.

    Raises:
        ArgumentError: bad options, unreadable or too short text, unknown peer.
        ModelFileError: as `load`.
    """
    from torchllama.checkpoint import load
    from torchllama.checkpoint.common import resolve_model_path

    if peer is not None and peer != "llama.cpp":
        raise ArgumentError(f"--peer {peer!r} is not supported; the one peer is llama.cpp")
    if batch_size < 1:
        raise ArgumentError(f"--batch-size must be ≥ 1, got {batch_size}")
    if ctx < MIN_CTX:
        raise ArgumentError(f"--ctx must be ≥ {MIN_CTX}, got {ctx}")
    if chunks is not None and chunks < 1:
        raise ArgumentError(f"--chunks must be ≥ 1, got {chunks}")
    text = read_text_file(text_file)
    gguf_path = None
    if peer is not None:
        if not llama_cpp_available():
            raise ArgumentError("--peer llama.cpp needs llama-cpp-python (`make bench-peer` "
                                "builds it into .venv); it is not installed")
        gguf_path = resolve_model_path(model_path)
        if not (gguf_path.is_file() and gguf_path.suffix == ".gguf"):
            raise ArgumentError(f"--peer llama.cpp needs a .gguf --model, got {gguf_path}")
    source = f"--text-file {text_file}"
    if adapter is not None and peer is not None:
        raise ArgumentError("--peer llama.cpp scores the GGUF file alone; it cannot apply "
                            "--adapter (merge it first: torchllama finetune --merge)")
    model, tokenizer = load(model_path, dtype=dtype, progress=progress, adapter=adapter,
                            kv_cache_dtype=kv_cache_dtype)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in model.state_dict().values()
                     if not t.is_complex()})
    kv = model.kv_cache_storage()
    print(f"model: {model_path or 'SmolLM2-135M-Instruct (embedded)'}"
          + (f" + adapter {adapter}" if adapter else "") + f", --dtype {dtype} "
          f"(tensors: {', '.join(dtypes)}), KV cache {str(kv).removeprefix('torch.')} "
          f"(--kv-cache-dtype {kv_cache_dtype}), {torch.get_num_threads()} threads", flush=True)
    results = [perplexity(model, tokenizer, text, ctx, batch_size, chunks, progress, source)]
    del model
    if gguf_path is not None:
        results.append(llama_cpp_perplexity(gguf_path, text, ctx, chunks, progress=progress,
                                            source=source))
    for r in results:
        print(f"{r.name}: {format_running(r.running)}")
    for r in results:
        print(format_result(r))
    if len(results) == 2:
        ours, theirs = results
        print(f"difference: {100 * (ours.ppl / theirs.ppl - 1):+.3f}% "
              f"(torchllama − llama.cpp, relative to llama.cpp's PPL)")
    return results
