"""`torchllama <command>`: each subcommand is a plain typed function below.

Options are derived from the function's signature (name → --kebab-name, type, default) and the
help text from its docstring's Args section, so there is one definition of each option.

Errors the user can fix (a `TorchLlamaError`: bad file, bad argument, prompt too long) print one
line to stderr and exit 1; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import re
import sys
import types
import typing
import warnings
from typing import Callable, Optional

from torchllama.errors import TorchLlamaError

DEFAULT_PROMPT = "The capital of France is"


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------

def generate(prompt: str = DEFAULT_PROMPT, model: Optional[str] = None,
             max_new_tokens: int = 256, temperature: float = 0.6, top_k: int = 0,
             top_p: float = 0.9, seed: Optional[int] = None, chat: bool = False,
             system: Optional[str] = None, dtype: str = "auto",
             prompt_file: Optional[str] = None, batch_size: int = 8, min_p: float = 0.0,
             repetition_penalty: float = 1.0, stop: Optional[list[str]] = None,
             compile: bool = False, draft: Optional[str] = None, draft_tokens: int = 12,
             adapter: Optional[str] = None, kv_cache_dtype: str = "auto") -> int:
    """Generate text from a prompt and stream it to stdout.

    Args:
        prompt: the prompt text. Without --chat it is continued as it is (and echoed first).
        prompt_file: a text file with one prompt per line, generated in batches; prints one
            JSON object per prompt (prompt, text, finish_reason, token counts) instead.
        batch_size: prompts per batch with --prompt-file.
        model: a .gguf file, a Meta/Hugging Face checkpoint folder, a training run folder, or
            the name of an installed packaged model: gemma3-270m (default: the embedded
            SmolLM2-135M-Instruct).
        max_new_tokens: maximum number of tokens to generate (≥ 1).
        temperature: sampling temperature ≥ 0 (0 = greedy); the default is Meta's.
        top_k: sample among the k most likely tokens only (0 = off).
        top_p: nucleus sampling threshold in (0, 1] (1 = off); the default is Meta's.
        seed: random seed for reproducible sampling.
        chat: wrap the prompt in the model's chat template and print only the answer.
        system: system prompt (with --chat).
        dtype: weights: auto (a quantized GGUF keeps its quantization: int4/int8 kernels;
            anything else float32), float32 (exact: GGUF weights dequantized), bfloat16,
            float16, int8 or int4 (weight-only quantization at load; int4-g128 etc. for
            other group sizes).
        min_p: keep tokens at least this fraction as likely as the top one (0 = off).
        repetition_penalty: CTRL's penalty on tokens already in the text (1 = off).
        stop: end the text before this string (it may span tokens; never printed).
        compile: compile the decode step with torch.compile first (faster per token; the
            first run compiles for about a minute, later runs reuse Inductor's cache).
        draft: speculative decoding with the model's exact output distribution (temperature
            0: the same tokens): lookup (n-grams copied from the context), int4, int8 or auto
            (the model's own checkpoint in that format drafts: --dtype float32 --draft int4 is
            the float32 answer at near-int4 speed), or a smaller model with the same tokenizer.
        draft_tokens: with --draft, the most tokens drafted per step (the first step's; then
            +2 after a step whose drafts were all accepted, −1 after a rejection).
        adapter: a LoRA adapter folder (PEFT format) or `torchllama finetune` run, applied
            to the model without merging.
        kv_cache_dtype: what the KV cache stores: auto (float16 when the weights are
            quantized, the default path; else the weights' dtype: --dtype float32 keeps the
            exact float32 cache), float32, float16, bfloat16 or q8_0 (int8 per 32 numbers
            with a float32 scale: 0.56× float16's bytes).
    """
    from torchllama.checkpoint import load, parse_dtype
    from torchllama.errors import ArgumentError
    from torchllama.generation.session import SamplingParams
    from torchllama.generation.stopping import StopStrings

    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repetition_penalty=repetition_penalty,
                              seed=seed)                     # validate before loading
    if max_new_tokens < 1:
        raise ArgumentError(f"--max-new-tokens must be ≥ 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ArgumentError(f"--batch-size must be ≥ 1, got {batch_size}")
    if system is not None and not chat:
        raise ArgumentError("--system goes with --chat (a system prompt needs the chat template)")
    _check_draft(draft, draft_tokens, prompt_file)
    parse_dtype(dtype)
    _check_kv_cache_dtype(kv_cache_dtype)
    StopStrings(stop or [])                                  # validates the strings first
    prompts = _read_prompt_file(prompt_file) if prompt_file is not None else None
    llm, tokenizer = load(model, dtype=dtype, adapter=adapter, kv_cache_dtype=kv_cache_dtype,
                          progress=True)
    drafter = _load_draft(draft, model)
    if compile:
        _compile_decode(llm)
    if prompts is not None:
        return _generate_file(llm, tokenizer, prompts, max_new_tokens, sampling, chat, system,
                              batch_size, stop or [])
    return _generate_one(llm, tokenizer, drafter, draft_tokens, prompt, chat, system,
                         max_new_tokens, sampling, stop)


def _generate_one(llm, tokenizer, drafter, draft_tokens, prompt, chat, system, max_new_tokens,
                  sampling, stop) -> int:
    """One prompt streamed to stdout through a `Session` (with the draft, if any) and its
    `TextStream` (ended at a stop string); the session's stats on stderr."""
    from torchllama.generation.session import Session, encode_prompt
    from torchllama.generation.text import TextStream

    prompt_ids = encode_prompt(tokenizer, prompt, chat=chat, system=system)
    session = Session(llm, tokenizer, draft=drafter, draft_tokens=draft_tokens)
    text = TextStream(tokenizer, prompt_ids, stop)
    new_ids = session.generate(prompt_ids, max_new_tokens, sampling)
    first = next(new_ids, None)  # runs the prefill: a too-long prompt fails before any output
    if not chat:
        _write(prompt)
    for token_id in itertools.chain([] if first is None else [first], new_ids):
        _write(text.push(token_id))
        if text.stopped:
            new_ids.close()
            session.stats.finish_reason = "stop"
            break
    _write(text.flush() + "\n")
    print(session.stats.summary(), file=sys.stderr)
    return 0


def _check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """ArgumentError naming --kv-cache-dtype and its choices for an unknown value (before any
    model loads)."""
    from torchllama.nn.kv_cache import check_kv_cache_dtype

    check_kv_cache_dtype(kv_cache_dtype, "--kv-cache-dtype")


def _check_draft(draft: Optional[str], draft_tokens: int,
                 prompt_file: Optional[str] = None) -> None:
    from torchllama.errors import ArgumentError

    if draft_tokens < 1:
        raise ArgumentError(f"--draft-tokens must be ≥ 1, got {draft_tokens}")
    if draft is not None and prompt_file is not None:
        raise ArgumentError("--draft speculates for one prompt; --prompt-file batches prompts "
                            "(batching already shares the weights' memory traffic)")


def _load_draft(draft: Optional[str], model: Optional[str]):
    """The drafter of a --draft value (`torchllama.generation.speculative.make_drafter`), or None."""
    if draft is None:
        return None
    from torchllama.generation.speculative import make_drafter

    print(f"[loading the draft: {draft}]", file=sys.stderr, flush=True)
    return make_drafter(draft, model, progress=True)


def _compile_decode(model) -> None:
    from torchllama.generation.session import compile_decode

    print("[compiling the decode step ...]", file=sys.stderr, flush=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seconds = compile_decode(model)
    for w in caught:
        print(f"[{w.message}]", file=sys.stderr, flush=True)
    state = "compiled" if getattr(model, "compiled_decode", None) else "not compiled (eager)"
    print(f"[decode step {state} in {seconds:.1f} s]", file=sys.stderr, flush=True)


def _read_prompt_file(path: str) -> list[str]:
    from torchllama.errors import ArgumentError

    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
        raise ArgumentError(f"--prompt-file {path}: cannot read it ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise ArgumentError(f"--prompt-file {path}: not UTF-8 text ({e.reason})") from e
    if not prompts:
        raise ArgumentError(f"--prompt-file {path}: no prompts (one per line expected)")
    return prompts


def _generate_file(llm, tokenizer, prompts, max_new_tokens, sampling, chat, system,
                   batch_size, stop: list[str]) -> int:
    """--prompt-file through the engine (`torchllama.serving.batch.complete`): batch_size
    prompts decoded together, each ending at its own stop token or stop string; one JSON line
    per prompt, in order."""
    import dataclasses
    import json
    import time

    from torchllama.generation.session import encode_prompt
    from torchllama.serving.batch import complete

    t0, new_tokens = time.perf_counter(), 0
    ids = [encode_prompt(tokenizer, p, chat=chat, system=system) for p in prompts]
    # One seed per prompt (seed + index): reproducible whatever the batch size.
    params = [dataclasses.replace(sampling, seed=None if sampling.seed is None
                                  else sampling.seed + i) for i in range(len(prompts))]
    results = complete(llm, ids, max_new_tokens, params, tokenizer.stop_ids,
                       tokenizer.pad_id or 0, tokenizer=tokenizer, stop=stop,
                       max_batch_size=batch_size)
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        new_tokens += len(result.token_ids)
        _write(json.dumps({"index": i, "prompt": prompt, "text": result.text,
                           "finish_reason": result.finish_reason,
                           "prompt_tokens": result.prompt_tokens,
                           "completion_tokens": len(result.token_ids)},
                          ensure_ascii=False) + "\n")
    seconds = time.perf_counter() - t0
    print(f"[{len(prompts)} prompts, {new_tokens} new tokens in {seconds:.1f} s: "
          f"{new_tokens / seconds:.1f} tok/s]", file=sys.stderr)
    return 0


def chat(model: Optional[str] = None, system: Optional[str] = None, max_new_tokens: int = 512,
         temperature: float = 0.6, top_k: int = 0, top_p: float = 0.9,
         seed: Optional[int] = None, dtype: str = "auto", compile: bool = False,
         draft: Optional[str] = None, draft_tokens: int = 12,
         adapter: Optional[str] = None, kv_cache_dtype: str = "auto") -> int:
    """Interactive multi-turn chat. The conversation and its KV cache are kept across turns
    (each turn prefills only its new tokens). Type /reset to start over, /exit or Ctrl-D to quit.

    Args:
        model: a .gguf file, a Meta/Hugging Face checkpoint folder, a training run folder, or
            the name of an installed packaged model: gemma3-270m (default: the embedded
            SmolLM2-135M-Instruct).
        system: system prompt.
        max_new_tokens: maximum tokens per answer (≥ 1).
        temperature: sampling temperature (≥ 0; 0 = greedy).
        top_k: sample among the k most likely tokens only (0 = off).
        top_p: nucleus sampling threshold in (0, 1] (1 = off).
        seed: random seed for reproducible sampling.
        dtype: weights: auto (a quantized GGUF keeps its quantization: int4/int8 kernels;
            anything else float32), float32 (exact: GGUF weights dequantized), bfloat16,
            float16, int8 or int4 (weight-only quantization at load; int4-g128 etc. for
            other group sizes).
        compile: compile the decode step with torch.compile first.
        draft: speculative decoding (the same answers): lookup, int4, int8, auto or a smaller
            model's path, as for `torchllama generate --draft`.
        draft_tokens: with --draft, the most tokens drafted per step (adapted to acceptance).
        adapter: a LoRA adapter folder (PEFT format) or `torchllama finetune` run, applied
            to the model without merging.
        kv_cache_dtype: what the KV cache stores: auto (float16 when the weights are
            quantized, the default path; else the weights' dtype: --dtype float32 keeps the
            exact float32 cache), float32, float16, bfloat16 or q8_0 (int8 per 32 numbers
            with a float32 scale: 0.56× float16's bytes).
    """
    from torchllama.checkpoint import load, parse_dtype
    from torchllama.errors import ArgumentError
    from torchllama.generation.session import SamplingParams, Session, chat_format

    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    if max_new_tokens < 1:
        raise ArgumentError(f"--max-new-tokens must be ≥ 1, got {max_new_tokens}")
    _check_draft(draft, draft_tokens)
    parse_dtype(dtype)
    _check_kv_cache_dtype(kv_cache_dtype)
    llm, tokenizer = load(model, dtype=dtype, adapter=adapter, kv_cache_dtype=kv_cache_dtype,
                          progress=True)
    drafter = _load_draft(draft, model)
    if compile:
        _compile_decode(llm)
    if chat_format(tokenizer) is None:
        raise ArgumentError(f"{tokenizer.source}: the model has no chat template; "
                            "use `torchllama generate` instead")
    session = Session(llm, tokenizer, draft=drafter, draft_tokens=draft_tokens)
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    print("torchllama chat: /reset starts over, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            break
        if text == "/reset":
            messages = list(start)
            session.reset()
            print("(conversation cleared)", file=sys.stderr)
            continue
        _chat_turn(session, messages, text, max_new_tokens, sampling)
    return 0


def _chat_turn(session, messages: list[dict], text: str, max_new_tokens: int,
               sampling) -> None:
    """One turn of `chat`: the user's text in, the streamed answer out; `messages` gains both
    (or neither, when the text cannot be encoded or the context is full)."""
    from torchllama.errors import ContextLengthError
    from torchllama.generation.session import encode_chat

    tokenizer = session.tokenizer
    messages.append({"role": "user", "content": text})
    try:
        prompt_ids = encode_chat(tokenizer, messages)
    except TorchLlamaError as e:                  # e.g. Llama 2's special tags in the text
        messages.pop()
        print(f"torchllama: {e}", file=sys.stderr)
        return
    from torchllama.serving.reasoning import ReasoningParser, template_thinks

    reasoning = None                 # a thinking model: its <think>…</think> shown dimmed
    if template_thinks(tokenizer.chat_template):
        reasoning = ReasoningParser(tokenizer.decode(prompt_ids[-8:]).rstrip()
                                    .endswith("<think>"))
    try:
        new_ids = list(_stream_answer(session, tokenizer, prompt_ids, max_new_tokens,
                                      sampling, reasoning))
    except ContextLengthError as e:
        messages.pop()
        print(f"torchllama: {e}. Type /reset to start a new conversation.", file=sys.stderr)
        return
    answer = reasoning.content if reasoning is not None else tokenizer.decode(new_ids)
    messages.append({"role": "assistant", "content": answer.strip()})
    print(session.stats.summary(), file=sys.stderr)


def _stream_answer(session, tokenizer, prompt_ids, max_new_tokens, sampling, reasoning=None):
    """Stream the answer's text to stdout (a `ReasoningParser`'s reasoning dimmed on a
    terminal, else to stderr) and yield its token ids."""
    from torchllama.generation.text import TextStream

    text = TextStream(tokenizer, prompt_ids)

    def show(piece: str, final: bool = False) -> None:
        if reasoning is None:
            return _write(piece)
        for kind, part in reasoning.feed(piece) + (reasoning.finish() if final else []):
            if kind == "content":
                _write(part)
            elif sys.stdout.isatty():
                _write(f"\033[2m{part}\033[0m")
            else:
                print(part, end="", file=sys.stderr, flush=True)

    for token_id in session.generate(prompt_ids, max_new_tokens, sampling):
        show(text.push(token_id))
        yield token_id
    show(text.flush(), final=True)
    _write("\n")


def bench_decode(model: Optional[str] = None, dtype: str = "auto", prompt_tokens: int = 512,
                 new_tokens: int = 128, repeats: int = 5, peer: str = "transformers",
                 batch: int = 8, no_hf: bool = False, compile: bool = False,
                 kv_cache_dtype: str = "auto", results: str = "benchmarks/results") -> int:
    """Prefill, decode and batched-decode tokens/s of torchllama and, side by side in the same
    run, a peer on the same file: HF transformers (when installed) or llama.cpp (--peer
    llama.cpp, through llama-cpp-python: `make bench-peer` builds it).

    Args:
        model: a .gguf file, a Meta/Hugging Face checkpoint folder, a training run folder, or
            the name of an installed packaged model: gemma3-270m (default: the embedded
            SmolLM2-135M-Instruct).
        dtype: weights: auto (a quantized GGUF keeps its quantization), float32, bfloat16,
            float16, int8 or int4 (transformers runs float32 for the quantized choices).
        prompt_tokens: prompt length for the prefill figure (and of each decoded sequence).
        new_tokens: tokens generated (greedy) for the decode figures.
        repeats: measurements per figure (the median is shown).
        peer: the library measured side by side: transformers, llama.cpp (same GGUF file, same
            threads, same token ids) or none.
        batch: sequences decoded together for the batched-decode figure (1: none).
        no_hf: the same as --peer none.
        compile: compile our decode step first (the seconds it takes are printed).
        kv_cache_dtype: what our KV cache stores: auto (float16 when the weights are
            quantized, the default path; else the weights' dtype: --dtype float32 keeps the
            exact float32 cache), float32, float16, bfloat16 or q8_0 (int8 per 32 numbers
            with a float32 scale: 0.56× float16's bytes).
        results: a folder for the results file (JSON: machine, versions, command, every
            figure beside the peer's; `torchllama.bench.results`), or none.
    """
    from torchllama.bench.decode import result_runs, run_bench
    from torchllama.errors import ArgumentError

    _check_at_least_one(prompt_tokens=prompt_tokens, new_tokens=new_tokens, repeats=repeats)
    _check_kv_cache_dtype(kv_cache_dtype)
    if no_hf and peer not in ("transformers", "none"):
        raise ArgumentError(f"--no-hf means --peer none; it does not go with --peer {peer}")
    peer = "none" if no_hf else peer
    measured = run_bench(model, dtype, prompt_tokens, new_tokens, repeats, peer=peer,
                         batch=batch, compile=compile, kv_cache_dtype=kv_cache_dtype)
    _save_results("decode", result_runs(measured, f"{_model_label(model)} ({dtype})",
                                        prompt_tokens, batch), results, peer)
    return 0


def bench_shapes(shape: Optional[list[str]] = None, type: Optional[list[str]] = None,
                 prefill: str = "128,512,2048", context: str = "512,4096", batch: str = "1,8",
                 threads: int = 2, peer: str = "llama.cpp", runs: int = 3, new_tokens: int = 32,
                 json: Optional[str] = None, results: str = "benchmarks/results") -> int:
    """Prefill, decode, load time and peak RSS at real sizes: random-weight GGUFs of Llama
    shapes (written once into $TORCHLLAMA_CACHE/shapes, SmolLM2's tokenizer), each engine
    loading in a process of its own, then both in one process with their runs interleaved,
    llama.cpp with flash attention on and off (the faster shown).

    Args:
        shape: 1b (Llama 3.2 1B), 3b (Llama 3.2 3B), 7b (Llama 2 7B), 8b (Llama 3.1 8B) or tiny;
            comma lists too (default: 1b).
        type: llama.cpp's mixes q4_0, q4_k_m, q8_0, q5_k_m, q5_k_s, q3_k_m, q2_k, iq4_xs,
            iq4_nl, q5_1 or q5_0; comma lists too (default: q4_0).
        prefill: prompt lengths of the prefill figures (comma list).
        context: decode figures after a prompt filling each context (comma list).
        batch: decode batch sizes (comma list; those above 1 at the smallest context).
        threads: threads of both engines.
        peer: llama.cpp (through llama-cpp-python: `make bench-peer`) or none.
        runs: timed runs per figure after a warm-up (the best is shown).
        new_tokens: greedy decode steps per run.
        json: also write every run's figures to this new JSON file.
        results: a folder for the results file (JSON: machine, versions, command, every
            figure beside the peer's; `torchllama.bench.results`), or none.
    """
    from torchllama.bench.shapes_bench import (ShapesConfig, parse_sizes, result_runs,
                                               run_shapes_bench, split_names)

    cfg = ShapesConfig(parse_sizes(prefill, "prefill"), parse_sizes(context, "context"),
                       parse_sizes(batch, "batch"), threads, runs, new_tokens)
    measured = run_shapes_bench(split_names(shape or ["1b"]), split_names(type or ["q4_0"]),
                                cfg, peer, json)
    _save_results("shapes", result_runs(measured, cfg), results, peer)
    return 0


def bench_serve(url: Optional[str] = None, api_key: Optional[str] = None,
                model: Optional[str] = None, dtype: str = "auto", new_tokens: int = 128,
                kv_cache_dtype: str = "auto", results: str = "benchmarks/results") -> int:
    """An OpenAI-compatible server's generated tokens/s at 1, 4 and 8 concurrent requests (8
    prompts per level, temperature 0, streaming completions) and the median time to first
    token.

    Args:
        url: the server's base URL (e.g. http://127.0.0.1:8000); without it --model is served
            by `torchllama serve` in a process of its own on a free loopback port for the run.
        api_key: the server's API key.
        model: without --url, the model served (as `bench decode --model`; default: the
            embedded SmolLM2-135M-Instruct).
        dtype: without --url, its weights (as `bench decode --dtype`).
        new_tokens: the max_tokens of every request.
        kv_cache_dtype: without --url, what the served model's KV cache stores (as
            `serve --kv-cache-dtype`).
        results: a folder for the results file (JSON: machine, versions, command, every
            figure beside the peer's; `torchllama.bench.results`), or none.
    """
    import http.client

    from torchllama.bench.serve import result_runs, run_serve_bench
    from torchllama.errors import ArgumentError

    _check_at_least_one(new_tokens=new_tokens)
    _check_kv_cache_dtype(kv_cache_dtype)
    if url is not None and not url.startswith(("http://", "https://")):
        raise ArgumentError(f"--url must start with http:// or https://, got {url!r}")
    try:
        measured = run_serve_bench(url, api_key, new_tokens, model, dtype,
                                   kv_cache_dtype=kv_cache_dtype)
    except (OSError, RuntimeError, ValueError, http.client.HTTPException) as e:
        raise ArgumentError(f"bench serve: {e}") from e
    label = url if url is not None else f"{_model_label(model)} ({dtype})"
    _save_results("serve", result_runs(measured, label), results, None)
    return 0


def bench_load(model: Optional[str] = None, dtype: str = "auto", clients: int = 64,
               requests: int = 10, drop: float = 0.1, new_tokens: int = 128, batch: int = 8,
               peer: str = "llama.cpp", results: str = "benchmarks/results") -> int:
    """A load test of our server, served in this process: --clients clients each sending
    --requests chat requests (shared system prompts, follow-up turns of their conversation,
    tool calls, streaming or not, --drop of them dropped mid-stream, up to --new-tokens tokens
    each), and the same load against llama-cpp-python's
    server on the same file where it is installed; prints tokens/s, p50/p99 time to first token
    and inter-token latency.

    Args:
        model: the model served (as `bench decode --model`; default: the embedded
            SmolLM2-135M-Instruct).
        dtype: its weights (as `bench decode --dtype`).
        clients: concurrent clients.
        requests: requests per client.
        drop: the fraction of requests whose client goes away mid-stream.
        new_tokens: the most tokens of each answer (≥ 8).
        batch: sequences our server decodes together.
        peer: llama.cpp (its server, where installed, on the same GGUF file) or none.
        results: a folder for the results file (JSON: machine, versions, command, every
            figure beside the peer's; `torchllama.bench.results`), or none.
    """
    from torchllama.bench.load import result_runs, run_load_bench
    from torchllama.errors import ArgumentError

    if peer not in ("llama.cpp", "none"):
        raise ArgumentError(f"--peer {peer!r}: use llama.cpp or none")
    measured = run_load_bench(model, dtype, clients, requests, drop, new_tokens, batch,
                              peer=peer)
    _save_results("load", result_runs(measured, f"{_model_label(model)} ({dtype}), {clients} "
                                      f"clients × {requests}"), results, peer)
    return 0


def bench_soak(model: Optional[str] = None, minutes: float = 20.0, users: int = 16,
               warmup: float = 120.0, sample: int = 40,
               results: str = "benchmarks/results") -> int:
    """A soak of our server with Locust: --users users for --minutes mixing chat, completions
    with logprobs, tool calls, multi-turn replays, two LoRA adapters, embeddings, structured
    output, cancelled streams and the Responses and Messages APIs; prints the failures (5xx,
    lost streams), the server's RSS after the warm-up and whether temperature-0 answers equal
    the same requests alone. Exit status 1 if anything failed, RSS was not flat (±10%) or an
    answer differed. Needs locust (pip install locust).

    Args:
        model: the model served (default: the embedded SmolLM2-135M-Instruct).
        minutes: how long Locust runs.
        users: Locust users (each sends a request, pauses 0.05–0.5 s, sends the next).
        warmup: seconds before the server's RSS is judged (the prefix cache and the allocator
            fill up first).
        sample: temperature-0 answers re-sent alone afterwards.
        results: a folder for the results file (`torchllama.bench.results`), or none.
    """
    from torchllama.bench.soak import result_runs, run_soak
    from torchllama.errors import ArgumentError

    if not minutes > 0 or users < 1 or warmup < 0 or sample < 0:
        raise ArgumentError("--minutes must be > 0, --users ≥ 1, --warmup and --sample ≥ 0")
    try:
        measured = run_soak(model, minutes, users, warmup, sample)
    except RuntimeError as e:
        raise ArgumentError(f"bench soak: {e}") from e
    _save_results("soak", result_runs(measured, _model_label(model)), results, None)
    ok = measured.failures == 0 and measured.rss_flat and measured.equal == measured.sampled
    return 0 if ok else 1


def bench_speculative(model: Optional[str] = None, new_tokens: int = 128, repeats: int = 5,
                      draft: str = "int4", draft_tokens: int = 12,
                      results: str = "benchmarks/results") -> int:
    """Greedy decode tok/s of the float32 model plain, drafted by --draft and by prompt lookup,
    on an open answer and on a summary quoting its input.

    Args:
        model: the target model (as `bench decode --model`; default: the embedded
            SmolLM2-135M-Instruct).
        new_tokens: the most tokens generated per answer.
        repeats: measurements per figure (the median is shown).
        draft: the draft model: int4, int8, auto or a path.
        draft_tokens: the most tokens drafted per step.
        results: a folder for the results file (JSON: machine, versions, command, every
            figure beside the peer's; `torchllama.bench.results`), or none.
    """
    from torchllama.bench.speculative import result_runs, run_speculative_bench

    _check_at_least_one(new_tokens=new_tokens, repeats=repeats)
    _check_draft(draft, draft_tokens)
    measured = run_speculative_bench(model, new_tokens, repeats, draft, draft_tokens)
    _save_results("speculative", result_runs(measured, _model_label(model)), results, None)
    return 0


def bench_train(preset: str = "shakespeare-small", dtype: str = "float32", batch_size: int = 8,
                seq_len: int = 256, steps: int = 5, repeats: int = 5, peer: str = "transformers",
                device: str = "cpu", compile: bool = False,
                results: str = "benchmarks/results") -> int:
    """Training tokens/s (forward, loss, backward, AdamW) of a preset vs transformers'
    LlamaForCausalLM of the same config and weights.

    Args:
        preset: the model preset.
        dtype: float32, or bfloat16 (autocast).
        batch_size: sequences per step.
        seq_len: tokens per sequence.
        steps: optimizer steps per measurement.
        repeats: measurements per figure (the median is shown).
        peer: transformers (side by side) or none.
        device: cpu or cuda.
        compile: torch.compile both models.
        results: a folder for the results file (JSON: machine, versions, command, every
            figure beside the peer's; `torchllama.bench.results`), or none.
    """
    from torchllama.bench.train import result_runs, run_train_bench
    from torchllama.errors import ArgumentError

    if peer not in ("transformers", "none"):
        raise ArgumentError(f"--peer {peer!r}: use transformers or none")
    measured = run_train_bench(preset, batch_size, seq_len, dtype, steps, repeats,
                               with_hf=peer == "transformers", device=device, compile=compile)
    _save_results("train", result_runs(measured), results, None)
    return 0


def _model_label(model: Optional[str]) -> str:
    """A checkpoint's name for a results file (the embedded model's by default)."""
    from pathlib import Path

    return Path(model).name if model else "SmolLM2-135M-Instruct"


def _save_results(benchmark: str, runs: list, folder: Optional[str], peer: Optional[str]) -> None:
    """Write a bench command's results file (`torchllama.bench.results.save`)."""
    from torchllama.bench.results import save

    version = None
    if peer == "llama.cpp" and any(r.peer for r in runs):
        from torchllama.bench.peer import peer_version

        version = peer_version()
    elif peer == "transformers" and any(r.peer for r in runs):
        import transformers

        version = f"transformers {transformers.__version__}"
    save(benchmark, runs, folder, version, argv=_ARGV)


def _check_at_least_one(**values: int) -> None:
    """ArgumentError naming the first option (by its --flag) whose value is below 1."""
    from torchllama.errors import ArgumentError

    for name, value in values.items():
        if value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be ≥ 1, got {value}")


def convert(src: str, dst: str, *, to: str, dtype: Optional[str] = None,
            force: bool = False) -> int:
    """Convert a checkpoint between formats: GGUF, Meta (params.json + consolidated.*.pth) and
    Hugging Face (config.json + safetensors). The output is written atomically.

    Args:
        src: the checkpoint to read (a .gguf file, a Meta folder or a Hugging Face folder).
        dst: the output: a folder for meta and hf, a file for gguf. Must not exist unless --force.
        to: output format: meta, hf or gguf.
        dtype: output dtype: float32, bfloat16 or float16 (default: float32), or q8_0, q5_0,
            q5_1, q4_0 or q4_1 for gguf (matrices quantized by the gguf library).
        force: replace an existing output.
    """
    from torchllama.checkpoint import convert as convert_checkpoint

    out = convert_checkpoint(src, dst, to, dtype, force=force)
    print(f"wrote {out} ({to})", file=sys.stderr)
    return 0


def serve(model: Optional[str] = None, host: str = "127.0.0.1", port: int = 8000,
          api_key: Optional[str] = None, dtype: str = "auto", max_batch_size: int = 8,
          max_queue: int = 64, prefill_chunk: int = 512, prefix_cache_mb: int = 512,
          draft: Optional[str] = None, draft_tokens: int = 12,
          adapter: Optional[list[str]] = None, kv_cache_dtype: str = "auto",
          responses_store: int = 1000, max_body_mb: float = 8.0,
          api_key_file: Optional[str] = None, allow_adapter_loading: bool = False,
          adapter_root: Optional[str] = None, drain_timeout: float = 30.0) -> int:
    """Serve the model over OpenAI's APIs (/v1/chat/completions, /v1/completions,
    /v1/responses, /v1/embeddings, /v1/models), Anthropic's (/v1/messages), vLLM's tokenizer
    and LoRA endpoints, /health and /metrics, batching concurrent requests.

    Args:
        model: checkpoint to serve (default: the embedded SmolLM2-135M-Instruct).
        host: address to bind (loopback by default).
        port: TCP port.
        api_key: require this key on every request (`Authorization: Bearer KEY`, or
            `x-api-key: KEY` as Anthropic's clients send it). Every user of the machine sees
            it in `ps`: prefer --api-key-file or the TORCHLLAMA_API_KEY environment variable.
        api_key_file: a file of API keys, one per line (# comments): any of them is accepted,
            with TORCHLLAMA_API_KEY's and --api-key's.
        dtype: weights: auto (a quantized GGUF keeps its quantization: int4/int8 kernels;
            anything else float32), float32 (exact: GGUF weights dequantized), bfloat16,
            float16, int8 or int4 (weight-only quantization at load; int4-g128 etc. for
            other group sizes).
        max_batch_size: requests decoded together.
        max_queue: requests that may wait for a free slot (more get HTTP 429).
        prefill_chunk: prompt tokens prefilled per engine step, in all: a longer prompt is
            prefilled in chunks between decode steps, so running streams keep flowing.
        prefix_cache_mb: memory (MiB) for the prefix cache: prompts that start like an earlier
            one (a system prompt, a chat resent in full) reuse its keys and values (0: off).
        draft: speculative decoding while a single request is decoding (as `generate
            --draft`: lookup, int4, int8, auto or a smaller model's path); with several
            decoding, plain batched steps (batching already shares the weights' memory
            traffic). Same answers either way (temperature 0: the same tokens).
        draft_tokens: with --draft, the most tokens drafted per round.
        adapter: NAME=DIR: a LoRA adapter (PEFT folder or `torchllama finetune` run)
            served to requests whose model is NAME, the others getting the base model; a
            bare DIR: applied to every request (at most one).
        kv_cache_dtype: what the KV cache stores: auto (float16 when the weights are
            quantized, the default path; else the weights' dtype: --dtype float32 keeps the
            exact float32 cache), float32, float16, bfloat16 or q8_0 (int8 per 32 numbers
            with a float32 scale: 0.56× float16's bytes).
        responses_store: Responses API responses kept in memory for previous_response_id
            and GET /v1/responses/{id}, least recently used out first (0: none; nothing is
            kept across restarts).
        max_body_mb: the largest request body, MiB (larger: HTTP 413).
        allow_adapter_loading: let clients load and unload LoRA adapters at run time
            (/v1/load_lora_adapter; else 403). Also TORCHLLAMA_ALLOW_ADAPTER_LOADING=1.
        adapter_root: the folder runtime-loaded adapters must be inside (relative paths are
            taken from it; nothing outside it, through `..` or a symlink, is read).
        drain_timeout: seconds running requests get to finish after SIGTERM/SIGINT (new ones
            get 503); those still running then end with an error event, and the server
            exits 0.
    """
    from torchllama.checkpoint import parse_dtype

    parse_dtype(dtype)
    _check_serve_options(port, max_batch_size, max_queue, prefill_chunk, prefix_cache_mb,
                         responses_store, max_body_mb, drain_timeout, adapter_root)
    _check_kv_cache_dtype(kv_cache_dtype)
    _check_draft(draft, draft_tokens)
    base, named = _adapters(adapter or [])
    from torchllama.serving.app import serve as run_server
    from torchllama.serving.guard import api_keys

    keys = api_keys(api_key, api_key_file)
    return run_server(model, host, port, dtype, base, kv_cache_dtype, draft, draft_tokens,
                      api_key=keys, max_batch_size=max_batch_size, max_queue=max_queue,
                      prefill_chunk=prefill_chunk, prefix_cache_mb=prefix_cache_mb,
                      adapters=named, responses_store=responses_store,
                      max_body_mb=max_body_mb, allow_adapter_loading=allow_adapter_loading,
                      adapter_root=adapter_root, drain_timeout=drain_timeout)


def _check_serve_options(port: int, max_batch_size: int, max_queue: int, prefill_chunk: int,
                         prefix_cache_mb: int, responses_store: int, max_body_mb: float,
                         drain_timeout: float, adapter_root: Optional[str]) -> None:
    """ArgumentError naming the first `serve` option out of its range."""
    from torchllama.errors import ArgumentError

    if not 0 < port < 65536:
        raise ArgumentError(f"--port must be in 1..65535, got {port}")
    if max_batch_size < 1 or max_queue < 1 or prefill_chunk < 1:
        raise ArgumentError("--max-batch-size, --max-queue and --prefill-chunk must be ≥ 1")
    if prefix_cache_mb < 0:
        raise ArgumentError(f"--prefix-cache-mb must be ≥ 0, got {prefix_cache_mb}")
    if responses_store < 0 or not max_body_mb > 0 or not drain_timeout >= 0:
        raise ArgumentError("--responses-store and --drain-timeout must be ≥ 0 and "
                            "--max-body-mb > 0")
    if adapter_root is not None and not os.path.isdir(adapter_root):
        raise ArgumentError(f"--adapter-root {adapter_root}: no such folder")


def _adapters(values: list[str]) -> tuple[Optional[str], dict[str, str]]:
    """(the adapter for every request, name → folder of those served by name) of `serve
    --adapter` values (NAME=DIR or DIR).

    Raises:
        ArgumentError: two bare folders, a name given twice, an empty name or folder.
    """
    from torchllama.errors import ArgumentError

    base, named = None, {}
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep:
            if base is not None:
                raise ArgumentError("--adapter: one adapter DIR for every request at most; "
                                    "serve more by name: --adapter NAME=DIR")
            base = value
        elif not name or not folder or name in named:
            raise ArgumentError(f"--adapter {value!r}: expected NAME=DIR with a new NAME")
        else:
            named[name] = folder
    return base, named


def kv_cache(model: Optional[str] = None, preset: Optional[str] = None,
             config: Optional[str] = None, seq_len: Optional[int] = None, batch_size: int = 1,
             dtype: str = "bfloat16", compare_attention: bool = False) -> int:
    """KV cache memory of a model from its configuration: bytes per token and for the whole
    context, per layer and in total (latents for MLA, only the window for sliding-window
    layers). No weights are read.

    Args:
        model: a checkpoint (.gguf, Meta or Hugging Face folder, training run); default: the
            embedded SmolLM2-135M-Instruct.
        preset: a preset name instead (e.g. deepseek-v3, llama2-70b, gemma3-270m).
        config: a YAML or JSON file of ModelArgs fields instead.
        seq_len: tokens in the context (default: the model's max_seq_len).
        batch_size: sequences cached at once.
        dtype: dtype of the cache: float32, bfloat16, float16, q8_0 (torchllama's int8 cache:
            36 bytes per 32 numbers) or float8.
        compare_attention: also show the same model with MHA, GQA (8 query heads per KV head),
            MQA and MLA side by side.
    """
    from torchllama.errors import ArgumentError
    from torchllama.bench.kv_cache_size import DTYPE_BYTES, report

    if dtype not in DTYPE_BYTES:
        raise ArgumentError(f"--dtype {dtype!r} is not supported; use one of "
                            f"{', '.join(DTYPE_BYTES)}")
    if (seq_len is not None and seq_len < 1) or batch_size < 1:
        raise ArgumentError("--seq-len and --batch-size must be ≥ 1")
    args, name = _model_args(model, preset, config)
    print(report(args, name, seq_len or args.max_seq_len, batch_size, dtype, compare_attention))
    return 0


def _model_args(model: Optional[str], preset: Optional[str], config: Optional[str]):
    """(ModelArgs, a name for it) of --model, --preset or --config (no weights read).

    Raises:
        ArgumentError: more than one given, an unknown preset, a config that is not ModelArgs.
    """
    from torchllama.checkpoint import read_model_args
    from torchllama.config import ModelArgs, get_preset, read_model_config
    from torchllama.errors import ArgumentError

    if sum(x is not None for x in (model, preset, config)) > 1:
        raise ArgumentError("give one of --model, --preset and --config")
    if preset is not None:
        return get_preset(preset), preset
    if config is not None:
        try:
            return ModelArgs(**read_model_config(config)), config
        except (TypeError, ArgumentError) as e:
            raise ArgumentError(f"--config {config}: {e}") from None
    return read_model_args(model), model or "SmolLM2-135M-Instruct (embedded)"


def info(model: Optional[str] = None, preset: Optional[str] = None,
         config: Optional[str] = None, tensors: bool = False) -> int:
    """A model's shape from its configuration: layers, widths, heads, the variant-zoo choices
    that differ from Llama 2's, and its parameters, in total and active per token (a mixture
    of experts runs only its chosen experts); for a GGUF file, which kernel each tensor type
    runs on and which fall back to float. No weights are read.

    Args:
        model: a checkpoint (.gguf, Meta or Hugging Face folder, training run); default: the
            embedded SmolLM2-135M-Instruct.
        preset: a preset name instead (e.g. mixtral-8x7b, qwen3-30b-a3b, deepseek-v3).
        config: a YAML or JSON file of ModelArgs fields instead.
        tensors: list every tensor of a GGUF file with its type and kernel.
    """
    from torchllama.model import parameter_counts

    args, name = _model_args(model, preset, config)
    total, active = parameter_counts(args)
    moe = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    layers = f"{args.n_layers} layers" + (f" ({args.n_layers - moe} dense, {moe} mixture of "
                                          "experts)" if moe and moe < args.n_layers else
                                          " (mixture of experts)" if moe else "")
    heads = (f"{args.n_heads} heads (MLA: a {args.kv_lora_rank} + {args.qk_rope_head_dim} "
             "latent)" if args.attention == "mla" else
             f"{args.n_heads} heads ({args.n_kv_heads} key/value, {args.head_dim} wide)")
    print(f"{name}\n  {layers}, dim {args.dim}, {heads}, vocabulary {args.vocab_size}, "
          f"context {args.max_seq_len}")
    choices = {k: v for k, v in args.variant_fields().items() if k not in ("layer_types",)}
    if choices:
        print("  choices: " + ", ".join(f"{k}={v}" for k, v in choices.items()))
    line = f"  parameters: {total:,} ({total / 1e9:.2f}B)"
    if moe:
        line += (f"; active per token {active:,} ({active / 1e9:.2f}B: {args.n_experts_per_token}"
                 f" of {args.n_experts} experts" + (f" + {args.n_shared_experts} shared"
                                                      if args.n_shared_experts else "") + ")")
    print(line)
    if preset is None and config is None:
        _print_kernel_plan(model, tensors)
    return 0


def _print_kernel_plan(model: Optional[str], tensors: bool) -> None:
    """For a GGUF file (or the embedded model): per tensor type, how many tensors, their bytes
    and the kernel they run on (`checkpoint.gguf.kernel_plan`); every tensor with `tensors`."""
    from torchllama.checkpoint.common import detect_format, resolve_model_path
    from torchllama.checkpoint.gguf import kernel_plan

    path = resolve_model_path(model)
    if detect_format(path) != "gguf":
        return
    plans = kernel_plan(path)
    print("  weights (dtype auto):")
    groups: dict[tuple[str, str], list] = {}
    for p in plans:
        groups.setdefault((p.type, p.runs_on), []).append(p)
    for (typ, runs_on), group in sorted(groups.items(), key=lambda g: -sum(
            p.n_bytes for p in g[1])):
        size = sum(p.n_bytes for p in group) / 2**20
        print(f"    {typ:>7} {len(group):5} tensors {size:9.1f} MiB → {runs_on}")
    if tensors:
        for p in plans:
            print(f"    {p.name:<32} {p.type:>7} {str(list(p.shape)):<16} → {p.runs_on}")


def train_tokenizer(*, input: list[str], vocab_size: int, out: str, force: bool = False) -> int:
    """Train a SentencePiece BPE tokenizer with Llama 2's settings on text files.

    Args:
        input: text files, or folders of .txt files.
        vocab_size: number of pieces (incl. 3 control and 256 byte-fallback pieces).
        out: output folder; the tokenizer is written to OUT/tokenizer.model.
        force: replace an existing OUT/tokenizer.model.
    """
    from torchllama.train.data import train_tokenizer as run

    path = run(input, vocab_size, out, force=force)
    from torchllama.checkpoint import load_tokenizer
    print(f"{path}: {load_tokenizer(path).vocab_size} pieces")
    return 0


def prepare_data(*, input: list[str], tokenizer: str, out: str, val_fraction: float = 0.1,
                 seed: int = 0, workers: Optional[int] = None, force: bool = False) -> int:
    """Tokenize text files into a training dataset (train.bin, val.bin, meta.json).

    Args:
        input: text files, or folders of .txt files; each file is one document.
        tokenizer: tokenizer.model, tokenizer.json, model folder or GGUF file.
        out: dataset folder.
        val_fraction: share of tokens held out for validation, in whole documents.
        seed: seed of the choice of validation documents.
        workers: tokenizer processes (default: one per CPU).
        force: replace an existing, different dataset in OUT.
    """
    from torchllama.train.data import prepare_data as run

    run(input, tokenizer, out, val_fraction=val_fraction, seed=seed, workers=workers,
        force=force)
    return 0


def train(**options) -> int:
    """Train a Llama from scratch (or resume a run); run under torchrun to scale out."""
    from torchllama.train.loop import TrainConfig, train as run

    result = run(TrainConfig(**options))
    if result.get("checkpoint") and result["rank"] == 0 and result.get("loss") is not None:
        print(f"step {result['step']}: loss {result['loss']:.4f}"
              + (f", val_loss {result['val_loss']:.4f}" if result.get("val_loss") else "")
              + f"; checkpoint {result['checkpoint']}")
    return 0


def _train_spec():
    from torchllama.train.loop import TrainConfig
    return TrainConfig


train.cli_spec = _train_spec   # options from TrainConfig's fields and their docs


def finetune(**options) -> int:
    """Finetune a model with LoRA / QLoRA / DoRA adapters (PEFT's format); --merge writes the
    adapted model as a full checkpoint."""
    from torchllama.train.finetune import FinetuneConfig, finetune as run, merge

    merge_to = options.pop("merge")
    to, dtype = options.pop("merge_format"), options.pop("merge_dtype")
    result = run(FinetuneConfig(**options))
    before, after = result["val_loss_before"], result["val_loss"]
    print(f"step {result['step']}: loss {result['loss']:.4f}"
          + (f", val_loss {before:.4f} → {after:.4f}" if before is not None and after else "")
          + f"; {result['seconds']:.0f} s, peak memory {result['peak_rss_mib']:.0f} MiB; "
          f"adapter {result['checkpoint']}")
    if merge_to is not None:
        to = to or ("gguf" if merge_to.endswith(".gguf") else "hf")
        print(f"merged: {merge(options.get('model'), options['out'], merge_to, to, dtype)}")
    return 0


def _finetune_spec():
    from torchllama.train.finetune import FinetuneCommand
    return FinetuneCommand


finetune.cli_spec = _finetune_spec


def ablate(*, data: str, out: str, steps: int = 100, variants: Optional[list[str]] = None,
           seq_len: int = 128, batch_size: int = 16, lr: float = 2e-3, seed: int = 1337,
           no_progress: bool = False) -> int:
    """Train the shakespeare-small model once per architecture variant (same data, seed, tokens,
    optimizer and non-embedding parameter budget) and compare them: validation loss at 1×, 2×
    and 4× the training length, tokens/s, parameters, KV bytes/token. Writes OUT/ablation.md,
    OUT/ablation.png, OUT/results.json and one run folder per variant (re-running skips the
    finished ones).

    Args:
        data: dataset folder from `torchllama prepare-data`.
        out: output folder.
        steps: optimizer steps per variant.
        variants: variant names (default all): baseline, layernorm, post-norm,
            sandwich, qk-norm, relu, gelu, geglu, parallel, sinusoidal, learned, t5-bias,
            alibi, nope, mha, mqa, mla, moe, baseline-seed2 (the baseline with seed 2: the
            noise).
        seq_len: training length in tokens (the models' context is 4× this).
        batch_size: sequences per step.
        lr: peak learning rate.
        seed: seed of every variant's init and batch order.
        no_progress: no progress bars.
    """
    from torchllama.train.ablate import run_ablation

    run_ablation(data, out, steps, variants, seq_len, batch_size, lr, seed,
                 progress=not no_progress)
    return 0


def plot_log(run: str, out: Optional[str] = None) -> int:
    """Plot a training run's loss curve (RUN/log.jsonl → RUN/loss.png).

    Args:
        run: the run folder (the --out of `torchllama train`).
        out: PNG file to write (default RUN/loss.png).
    """
    from torchllama.train.plot import plot_log as run_plot

    print(run_plot(run, out))
    return 0


def anatomy(model: Optional[str] = None, text: Optional[str] = None,
            text_file: Optional[str] = None, out: str = "anatomy", only: Optional[str] = None,
            max_tokens: int = 256, seed: int = 0, long_text_file: Optional[str] = None,
            option: Optional[list[str]] = None, force: bool = False) -> int:
    """Look inside a model: attention maps, head roles, RoPE, norms, sampling, the logit lens
    and (for a training run) the loss landscape, as one self-contained HTML page OUT/index.html
    (with interactive explorers of RoPE, attention, the logit lens and sampling) with each
    figure also as PNG and every number in OUT/anatomy.json.

    Args:
        model: a checkpoint, packaged name or `torchllama train` run folder; default: the
            embedded SmolLM2-135M-Instruct.
        text: the text to analyse (default: the opening of A Tale of Two Cities).
        text_file: read the text from this UTF-8 file instead.
        out: the folder to write (created if missing).
        only: comma-separated sections, in any order: attention, heads, rope, extrapolation,
            norms, sampling, logit-lens, landscape (default: all but extrapolation, and
            landscape only for a run folder).
        max_tokens: analyse at most this many tokens of the text (the page says when it cut).
        seed: seed of the random choices (induction sequences, random directions).
        long_text_file: text (file or folder of .txt) for the extrapolation section (default:
            the Shakespeare corpus that `make test` downloads to .cache/shakespeare).
        option: a section option KEY=VALUE, e.g. extrapolation_dtype=bfloat16,
            extrapolation_factor=2, landscape_points=21, landscape_grid=11,
            landscape_batches=8, landscape_data=DIR, attention_layer=5, sampling_prompt=TEXT.
        force: overwrite files in OUT that an earlier report did not write.
    """
    from pathlib import Path

    from torchllama import anatomy as anatomy_report
    from torchllama.errors import ArgumentError

    anatomy_report.parse_only(only)                # a bad --only fails before the model loads
    out_path = Path(out)
    anatomy_report.check_out_folder(out_path, force=force)     # before minutes of work
    options = {"long_text_file": long_text_file} if long_text_file else {}
    for item in option or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ArgumentError(f"--option {item!r}: expected KEY=VALUE")
        for kind in (int, float):
            try:
                value = kind(value)
                break
            except ValueError:
                pass
        options[key] = value
    report = anatomy_report.run(model, text, text_file=text_file, only=only,
                                max_tokens=max_tokens, seed=seed, options=options)
    index = anatomy_report.write_report(report, out_path, force=force)
    for section in report.sections:
        print(f"## {section.title} ({section.seconds:.1f} s)")
        for line in section.headline:
            print(f"  - {line}")
    print(f"wrote {index} ({len(report.sections)} sections, {report.seconds:.0f} s)")
    return 0


def perplexity(*, text_file: str, model: Optional[str] = None, ctx: int = 512,
               batch_size: int = 4, chunks: Optional[int] = None, dtype: str = "auto",
               peer: Optional[str] = None, progress: bool = True,
               adapter: Optional[str] = None, kv_cache_dtype: str = "auto") -> int:
    """Perplexity of a model on a text, computed as llama.cpp's llama-perplexity does:
    non-overlapping windows of --ctx tokens (BOS first when the model adds one), the second half
    of each scored; prints the running PPL per chunk ([1]x,[2]y,...) and PPL ± its standard
    error. Held-out Shakespeare (never in `make train-demo`'s training split):
    `torchllama perplexity --text-file .cache/shakespeare/romeo_and_juliet_gut.txt`.

    Args:
        text_file: UTF-8 text file; it must hold at least 2 × ctx tokens.
        model: a .gguf file, a Meta/Hugging Face checkpoint folder, a training run folder, or
            the name of an installed packaged model: gemma3-270m (default: the embedded
            SmolLM2-135M-Instruct).
        ctx: window length in tokens (llama.cpp's -c); the last ctx/2 − 1 of each are scored.
        batch_size: windows per forward pass.
        chunks: evaluate only the first N windows (llama.cpp's --chunks; default: all).
        dtype: weight dtype, as for loading the model (auto keeps a GGUF's quantization).
        peer: llama.cpp: also compute llama.cpp's own perplexity of the same GGUF file on the
            same text (needs llama-cpp-python: `make bench-peer`).
        progress: show progress bars.
        adapter: a LoRA adapter folder (PEFT format) or `torchllama finetune` run applied to
            the model without merging.
        kv_cache_dtype: what the KV cache the windows go through stores (llama.cpp's:
            float16): auto (float16 when the weights are quantized, the default path; else
            the weights' dtype), float32, float16, bfloat16 or q8_0.
    """
    from torchllama.bench.perplexity import run_perplexity

    _check_kv_cache_dtype(kv_cache_dtype)
    run_perplexity(model, text_file, ctx=ctx, batch_size=batch_size, dtype=dtype,
                   chunks=chunks, peer=peer, progress=progress, adapter=adapter,
                   kv_cache_dtype=kv_cache_dtype)
    return 0


#: `torchllama bench SUBCOMMAND`: one measurement each, with only its own options.
BENCH: dict[str, Callable[..., int]] = {
    "decode": bench_decode, "shapes": bench_shapes, "serve": bench_serve, "load": bench_load,
    "soak": bench_soak, "speculative": bench_speculative, "train": bench_train}

#: `torchllama COMMAND`: a function, or a dict of subcommands (`torchllama bench decode`).
COMMANDS: dict[str, Callable[..., int] | dict[str, Callable[..., int]]] = {
    "generate": generate, "chat": chat, "convert": convert, "serve": serve, "bench": BENCH,
    "kv-cache": kv_cache, "info": info, "train-tokenizer": train_tokenizer, "prepare-data": prepare_data,
    "train": train, "finetune": finetune, "plot-log": plot_log, "ablate": ablate,
    "anatomy": anatomy, "perplexity": perplexity}


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


# --------------------------------------------------------------------------------------------
# Signature → argparse
# --------------------------------------------------------------------------------------------

def _arg_help(doc: str) -> dict[str, str]:
    """Map parameter name → help text from a Google-style docstring's Args section."""
    helps: dict[str, str] = {}
    section = doc.split("Args:", 1)[1] if "Args:" in doc else (
        doc.split("Attributes:", 1)[1] if "Attributes:" in doc else "")
    current = None
    for line in section.splitlines():
        m = re.match(r" {4}(\w+): (.*)", line)   # inspect.getdoc dedents the docstring
        if m:
            current = m.group(1)
            helps[current] = m.group(2).strip()
        elif current and line.strip():
            helps[current] += " " + line.strip()
    return {k: v.replace("%", "%%") for k, v in helps.items()}   # argparse %-formats help


def _add_command(subparsers, name: str, fn: Callable[..., int]) -> None:
    # Options come from fn's signature and docstring Args, or from the dataclass its `cli_spec`
    # returns (fields and docstring Attributes), e.g. `train` from TrainConfig.
    spec = fn.cli_spec() if hasattr(fn, "cli_spec") else fn
    doc = inspect.getdoc(fn) or ""
    helps = _arg_help(inspect.getdoc(spec) or "")
    parser = subparsers.add_parser(name, help=doc.splitlines()[0],
                                   description=doc.split("Args:")[0].strip())
    hints = typing.get_type_hints(spec)
    for param in inspect.signature(spec).parameters.values():
        flag = "--" + param.name.replace("_", "-")
        hint = hints[param.name]
        if hint is bool:
            if param.default is True:                           # on by default: --no-progress
                parser.add_argument("--no-" + param.name.replace("_", "-"), dest=param.name,
                                    action="store_false", help="do not: " + helps.get(
                                        param.name, param.name))
            else:
                parser.add_argument(flag, action="store_true", help=helps.get(param.name))
            continue
        base = hint                                             # Optional[X] → X
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            base = next(a for a in typing.get_args(hint) if a is not type(None))
        if typing.get_origin(base) is list and param.default is inspect.Parameter.empty:
            parser.add_argument(flag, type=typing.get_args(base)[0], action="extend",
                                nargs="+", required=True, metavar=param.name.upper(),
                                help=helps.get(param.name))  # --input A B C (--input D)
            continue
        if typing.get_origin(base) is list:     # --stop A --stop B, or --variants a b c
            parser.add_argument(flag, type=typing.get_args(base)[0], action="extend",
                                nargs="+", default=param.default, metavar=param.name.upper(),
                                help=helps.get(param.name, "") + " (repeatable)")
            continue
        if param.default is inspect.Parameter.empty:
            if param.kind == param.KEYWORD_ONLY:                # required option: --to FORMAT
                parser.add_argument(flag, type=base, required=True, metavar=param.name.upper(),
                                    help=helps.get(param.name))
            else:                                               # required: a positional argument
                parser.add_argument(param.name, type=base, metavar=param.name.upper(),
                                    help=helps.get(param.name))
            continue
        default_help = f" (default: {param.default})" if param.default is not None else ""
        parser.add_argument(flag, type=base, default=param.default, metavar=param.name.upper(),
                            help=(helps.get(param.name, "") + default_help))
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    parser.set_defaults(_command=fn)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchllama",
        description="A from-scratch PyTorch Llama: generate, chat, serve and benchmark on local "
                    "checkpoints (default: the embedded SmolLM2-135M-Instruct); train your own.")
    subparsers = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    for name, fn in COMMANDS.items():
        if isinstance(fn, dict):
            _add_group(subparsers, name, fn)
        else:
            _add_command(subparsers, name, fn)
    return parser


def _add_group(subparsers, name: str, commands: dict[str, Callable[..., int]]) -> None:
    """`torchllama NAME SUBCOMMAND [options]`: each subcommand a plain function, as above."""
    choices = " | ".join(commands)
    parser = subparsers.add_parser(name, help=f"subcommands: {choices}", description=(
        f"torchllama {name} {choices}: `torchllama {name} SUBCOMMAND --help` lists the options "
        "of each."))
    nested = parser.add_subparsers(title="subcommands", required=True, metavar="SUBCOMMAND")
    for sub, fn in commands.items():
        _add_command(nested, sub, fn)


#: the arguments of the running command (a results file records them)
_ARGV: list[str] = []


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `torchllama` command. Returns the exit status."""
    _ARGV[:] = sys.argv[1:] if argv is None else argv
    args = vars(build_parser().parse_args(argv))
    command = args.pop("_command")
    debug = args.pop("debug")
    try:
        return command(**args)
    except TorchLlamaError as e:
        if debug:
            raise
        print(f"torchllama: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:              # a path the user gave: unwritable, a file not a folder...
        if debug:
            raise
        where = f"{e.filename}: " if e.filename else ""
        print(f"torchllama: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
