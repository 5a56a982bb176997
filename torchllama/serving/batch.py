"""Offline batched generation: many prompts through the engine, run in the caller's thread.

    prompts ─▶ one engine `Request` each ─▶ Engine.step() until every one has finished
                                             ─▶ one `Completion` per prompt, in order

The engine runs here as it does in the server (continuous batching: a row freed by a finished
prompt takes the next one; every row at its own positions), but without its thread: the caller's
thread drives `Engine.step`. So each prompt gets what it would alone (at temperature 0 the same
tokens as `Session`), stops on its own stop tokens and stop strings, and `torchllama generate
--prompt-file` prints each line as soon as it and the lines before it are done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import torch

from torchllama.errors import ArgumentError, ContextLengthError, TorchLlamaError
from torchllama.generation.sampling import SamplingParams
from torchllama.generation.text import TextStream
from torchllama.serving.engine import Engine, Request, TokenEvent


@dataclass
class Completion:
    """One prompt's generation: its new token ids (stop token excluded) and why it ended.

    Attributes:
        token_ids: the new tokens; with a stop string, up to the one that completed it.
        finish_reason: "stop" (a stop token or stop string) or "length" (max_new_tokens or the
            context).
        prompt_tokens: the prompt's length.
        logprobs: with SamplingParams.logprobs = n > 0, one (log p(token), [(id, log p)] × n
            most likely) per new token, from the model's raw logits
            (`torchllama.generation.sampling.token_logprobs`); else None.
        text: with a tokenizer, the new text (up to, not including, a stop string); else None.
    """

    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None
    text: Optional[str] = None


class _Collector:
    """What the engine reports of one request, as a `Completion`."""

    def __init__(self, prompt_tokens: int, logprobs: bool):
        self.events: list[TokenEvent] = []
        self.reason: Optional[str] = None
        self.prompt_tokens, self.logprobs = prompt_tokens, logprobs

    def completion(self, request: Request) -> Completion:
        events = self.events
        text = None if request.text is None else "".join(e.text for e in events) + request.tail
        return Completion([e.token_id for e in events], self.reason, self.prompt_tokens,
                          [(e.logprob, e.top_logprobs) for e in events] if self.logprobs
                          else None, text)


def complete(model, prompts: Sequence[Sequence[int]], max_new_tokens: int = 256,
             sampling: Union[SamplingParams, Sequence[SamplingParams]] = SamplingParams(),
             stop_ids: frozenset[int] = frozenset(), pad_id: int = 0, *, tokenizer=None,
             stop: Sequence[str] = (), max_batch_size: Optional[int] = None
             ) -> Iterator[Completion]:
    """Generate for several prompts through the engine; yield their `Completion`s in order.

    Args:
        model: a `Transformer`; its KV caches are (re)allocated: max_batch_size rows of
            min(context, longest prompt + max_new_tokens) slots.
        prompts: B lists of token ids (BOS included if wanted), each non-empty.
        max_new_tokens: at most this many new tokens per prompt (≥ 1); fewer where a prompt
            and its output would exceed the model's context.
        sampling: one SamplingParams for all, or one per prompt (own seed each).
        stop_ids: token ids that end a sequence (not included in its output).
        pad_id: token id fed to idle rows (never attended).
        tokenizer: with it, each Completion has its text (`TextStream`).
        stop: stop strings (with a tokenizer): a sequence ends in the step that completes one.
        max_batch_size: prompts decoded together (default: all of them).

    Raises:
        ArgumentError: no prompts, an empty prompt, max_new_tokens < 1, a sampling list of
            another length, stop strings without a tokenizer, or a bad stop string.
        ContextLengthError: a prompt leaves no room for a new token.
        TorchLlamaError: generation failed for a prompt (the engine logged why).
    """
    params = _check(model, prompts, max_new_tokens, sampling, tokenizer, stop)
    longest = max(len(p) for p in prompts)
    engine = Engine(model, max_batch_size or len(prompts), max_queue=len(prompts),
                    pad_id=pad_id, max_seq_len=longest + max_new_tokens)
    collectors, requests = [], []
    for prompt, p in zip(prompts, params):
        collector = _Collector(len(prompt), bool(p.logprobs))
        text = TextStream(tokenizer, prompt, stop) if tokenizer is not None else None
        requests.append(Request(list(prompt), max_new_tokens, p, stop_ids,
                                collector.events.append,
                                lambda reason, c=collector: setattr(c, "reason", reason),
                                logprobs=p.logprobs or None, text=text))
        collectors.append(collector)
    engine.allocate()
    for request in requests:
        engine.submit(request)
    for i, (collector, request) in enumerate(zip(collectors, requests)):
        with torch.inference_mode():
            while collector.reason is None and engine.step():
                pass
        if collector.reason not in ("stop", "length"):
            raise TorchLlamaError(f"generation failed for prompt {i} ({collector.reason}; see "
                                  "the log)")
        yield collector.completion(request)


def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int = 256,
                   sampling: Union[SamplingParams, Sequence[SamplingParams]] = SamplingParams(),
                   stop_ids: frozenset[int] = frozenset(), pad_id: int = 0) -> list[Completion]:
    """Generate for several prompts at once (all decoded together, each stopping on its own):
    `complete` as a list. At temperature 0 each sequence equals what `Session` generates for
    its prompt alone. Arguments and errors: `complete`."""
    return list(complete(model, prompts, max_new_tokens, sampling, stop_ids, pad_id))


def _check(model, prompts, max_new_tokens, sampling, tokenizer, stop) -> list[SamplingParams]:
    """The per-prompt sampling settings of a valid `complete` call (see its Raises)."""
    B = len(prompts)
    if B == 0:
        raise ArgumentError("generate_batch needs at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ArgumentError("a prompt is empty (no tokens)")
    if max_new_tokens < 1:
        raise ArgumentError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    params = [sampling] * B if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != B:
        raise ArgumentError(f"{len(params)} sampling settings for {B} prompts")
    if stop and tokenizer is None:
        raise ArgumentError("stop strings need the tokenizer (to see the text)")
    T = max(len(p) for p in prompts)
    context = model.args.max_seq_len
    if T >= context:
        raise ContextLengthError(f"a prompt has {T} tokens but the context holds {context}; "
                                 f"shorten it to at most {context - 1} tokens")
    return params
