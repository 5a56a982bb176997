"""Generation: prefill/decode with the KV cache, stop tokens, chat formats (text: `generation.text`).

    prompt ids ──prefill (one forward over the prompt, start_pos = cached prefix)──▶ logits
    loop: sample(logits) ──▶ token ──stop id?──▶ decode_one_token(token, start_pos) ──▶ logits

Sampling (torchllama.generation.sampling) is pure functions: (logits, settings, torch.Generator, the ids so
far) → token ids. `Session` keeps a conversation's KV cache between calls and re-uses the longest cached
prefix of the next prompt, so a chat turn only prefills the new tokens.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from torchllama.errors import ArgumentError, ContextLengthError
from torchllama.generation.sampling import SamplingParams, sample
from torchllama.generation.steps import decode_one_token, prefill  # noqa: F401  (also exported here)
from torchllama.generation.text import StreamDecoder  # noqa: F401  (also exported here)
from torchllama.nn.kv_cache import check_kv_cache_dtype
from torchllama.transforms.fuse import runs_one_op_layers  # noqa: F401  (also exported here)


# --------------------------------------------------------------------------------------------
# Prefill and decode
# --------------------------------------------------------------------------------------------

def compile_decode(model, *, warmup: bool = True, freezing: Optional[bool] = None,
                   force: bool = False) -> float:
    """Compile the model's one-token decode step with torch.compile (Inductor), as gpt-fast
    does; `decode_one_token` then runs it.

    The step's only changing size is the number of cached slots S = pos + 1, which is made a
    symbolic size (`dynamic=True`), so one graph serves every position and batch size (no
    recompilation per token). On CPU, Inductor's `freezing` folds the weights into the graph as
    constants (the quantized kernels' packed weights included), which removes their guards and
    lets it plan the weight layouts ahead; on CUDA the graph is captured in CUDA graphs
    (mode="reduce-overhead"). Compiled code is cached on disk by Inductor (its FX graph cache,
    under $TORCHINDUCTOR_CACHE_DIR or /tmp/torchinductor_$USER), so a second process compiles
    faster. If compiling or running the compiled step fails, one warning is given and decoding
    goes on eagerly.

    Args:
        model: a `Transformer` in eval mode; its KV caches are allocated when warming up.
        warmup: compile now, by running two steps on a scratch cache (else: at the first
            decode step).
        freezing: Inductor's freezing (CPU). None (default): on for float weights (MKL's
            packed layouts), off when torchllama's block kernels hold the weights — they gain
            nothing from it, and without it Inductor's FX graph cache serves later processes.
        force: compile even when every layer runs as one `decoder_layer` op
            (`runs_one_op_layers`). Without it such a model stays eager, with one warning:
            each layer is already one call, so Inductor has nothing to fuse, and the layer's
            integer arguments (cache positions) recompile the graph per position until
            torch._dynamo's limit: slower than eager, after a long compile (`torchllama bench
            decode --compile` measures both).

    Returns:
        Seconds spent compiling and warming up (0 without warmup, or when not compiled).
    """
    import torch._inductor.config as inductor_config

    if not force and runs_one_op_layers(model):
        warnings.warn("decode step not compiled: every layer already runs as one torchllama "
                      "kernel call (eager is faster than compiled here)", stacklevel=2)
        model.compiled_decode = None
        return 0.0
    device = model.device
    if freezing is None:
        from torchllama.blocks.linear import Q4Linear, Q8Linear
        freezing = not any(isinstance(m, (Q4Linear, Q8Linear)) for m in model.modules())
    if freezing and device.type == "cpu":
        inductor_config.freezing = True
    mode = "reduce-overhead" if device.type == "cuda" else None
    for rope in model.rope:                     # the real (cos, sin) table, outside the graph
        rope.for_compile(device)
    model.compiled_decode = torch.compile(model.forward, dynamic=True, mode=mode)
    if not warmup:
        return 0.0
    t0 = time.perf_counter()
    caches = model.caches                       # the caller's, put back afterwards
    with torch.inference_mode():
        model.setup_caches(1, 4)
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        for pos in range(3):       # pos 0 (T = S = 1), then the general symbolic-S graph
            decode_one_token(model, token, pos)
    model.use_caches(caches)
    return time.perf_counter() - t0


@dataclass
class GenerationStats:
    """Counts and timings of one `Session.generate` call (seconds, tokens).

    With a draft (speculative decoding) one decode step is one target forward over the last
    token and the drafts, and may yield several tokens: `decode_tokens` counts them, `drafted`
    and `accepted` the drafted tokens and those the target kept.
    """

    prompt_tokens: int = 0
    prefilled_tokens: int = 0      # prompt tokens actually run (the rest came from the cache)
    new_tokens: int = 0            # tokens yielded (stop token excluded)
    decode_steps: int = 0          # target forward passes after the prefill
    decode_tokens: int = 0         # tokens those passes produced (a stop token included)
    drafted: int = 0               # speculative decoding: tokens drafted
    accepted: int = 0              # ... and accepted by the target
    prefill_s: float = 0.0         # a draft model's prefill of the prompt included
    decode_s: float = 0.0          # decode steps, drafting included
    finish_reason: str = ""        # "stop" (stop token) or "length" (max_new_tokens/context)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefilled_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode rate: tokens produced by decode steps (+ drafting and sampling) per second."""
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted ÷ drafted tokens (0 without drafts)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def summary(self) -> str:
        draft = (f"; draft acceptance {self.acceptance_rate:.0%} ({self.accepted} of "
                 f"{self.drafted} drafted tokens), {self.decode_tokens / self.decode_steps:.2f} "
                 f"tokens per target pass" if self.drafted else "")
        return (f"[{self.prompt_tokens} prompt tokens ({self.prefilled_tokens} prefilled) at "
                f"{self.prefill_tokens_per_s:.1f} tok/s; {self.new_tokens} new tokens at "
                f"{self.decode_tokens_per_s:.1f} tok/s decode{draft}; "
                f"finish: {self.finish_reason}]")


class Session:
    """A model, its tokenizer and one KV cache (batch 1) that persists between calls.

    Each `generate` call re-uses the longest prefix of the new prompt that is already in the
    cache (a chat REPL re-renders the whole conversation each turn; only the new turn is
    prefilled). Sliding-window layers keep only their window plus a margin of slots, so a new
    prompt that diverges from the cached one more than that margin before the cache's end is
    prefilled from the start.

    With a `draft` (a `torchllama.generation.speculative.Drafter`: a draft model, the model's own weights
    quantized, or prompt lookup), decoding is speculative: each step drafts up to
    `draft_tokens` tokens and the model checks them in one forward pass, keeping exactly its
    own output distribution (greedy: the same tokens; see `torchllama.generation.speculative`).

    The cache lives in the model (`Transformer.setup_caches`), as in gpt-fast: use one Session
    per model at a time, and don't run the model elsewhere between its calls.

    Args:
        model: a `Transformer` (eval mode).
        tokenizer: its `Tokenizer`.
        max_seq_len: length of the KV cache (default: the model's context).
        draft: a `Drafter` for speculative decoding (default: none).
        draft_tokens: the most tokens drafted per step (the initial number too; adapted to
            the acceptance, see `torchllama.generation.speculative.DraftLength`; default
            `torchllama.generation.speculative.DEFAULT_DRAFT_TOKENS`).
        kv_cache_dtype: what the KV cache stores: auto, float32, float16, bfloat16 or q8_0
            (`torchllama.nn.kv_cache`; default: the model's `kv_cache_dtype`).

    Raises:
        ArgumentError: a draft model whose vocabulary size differs from the model's (both
            named), draft_tokens < 1, or an unknown kv_cache_dtype.
    """

    def __init__(self, model, tokenizer, max_seq_len: Optional[int] = None, *,
                 draft=None, draft_tokens: Optional[int] = None,
                 kv_cache_dtype: Optional[str] = None):
        self.model = model
        self.kv_cache_dtype = kv_cache_dtype and check_kv_cache_dtype(kv_cache_dtype)
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len or model.args.max_seq_len
        self.cached_ids: list[int] = []       # tokens whose keys/values are in the cache
        self.stats = GenerationStats()
        self._device = model.device
        self._caches = None                   # the model's caches this session filled
        self.speculator = None
        if draft is not None:                 # speculative.py builds on prefill/decode above
            from torchllama.generation.speculative import DEFAULT_DRAFT_TOKENS, SpeculativeDecoder
            self.speculator = SpeculativeDecoder(model, draft, draft_tokens or
                                                 DEFAULT_DRAFT_TOKENS)

    def reset(self) -> None:
        """Forget the cached conversation."""
        self.cached_ids = []

    def _ensure_cache(self) -> None:
        # Our own caches, not just ones of the right shape: the engine or another
        # Session may have replaced them since (then what we remember is not in them).
        if self._caches is None or self.model.caches is not self._caches:
            with torch.inference_mode(False):   # normal tensors: usable outside inference mode
                self.model.setup_caches(1, self.max_seq_len, self.kv_cache_dtype)
            self._caches = self.model.caches
            self.cached_ids = []

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 256,
                 sampling: SamplingParams = SamplingParams(),
                 stop_ids: Optional[frozenset[int]] = None) -> Iterator[int]:
        """Yield new token ids one at a time; the stop token itself is not yielded.

        Args:
            prompt_ids: full prompt (BOS included if wanted).
            max_new_tokens: at most this many tokens (≥ 1); fewer if the context fills up.
            sampling: temperature, top-k, top-p, seed.
            stop_ids: token ids that end generation (default: tokenizer.stop_ids).

        Raises:
            ArgumentError: empty prompt or max_new_tokens < 1.
            ContextLengthError: the prompt leaves no room in the context for a new token.

        After the iterator is exhausted, `self.stats` holds counts, timings and finish_reason.
        """
        if max_new_tokens < 1:
            raise ArgumentError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if len(prompt_ids) == 0:
            raise ArgumentError("the prompt is empty (no tokens)")
        if len(prompt_ids) >= self.max_seq_len:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds "
                f"{self.max_seq_len}; shorten it to at most {self.max_seq_len - 1} tokens")
        stop_ids = self.tokenizer.stop_ids if stop_ids is None else stop_ids
        generator = sampling.make_generator(self._device)
        self._ensure_cache()

        # Longest cached prefix we can keep (at least one prompt token must be run to get logits).
        n = 0
        limit = min(len(self.cached_ids), len(prompt_ids) - 1)
        while n < limit and self.cached_ids[n] == prompt_ids[n]:
            n += 1
        if not self.model.caches.can_write_at(n):   # a sliding window's ring no longer holds
            n = 0                                   # what slot n needs: start over
        stats = self.stats = GenerationStats(prompt_tokens=len(prompt_ids),
                                             prefilled_tokens=len(prompt_ids) - n)
        self.cached_ids = list(prompt_ids[:n])

        t0 = time.perf_counter()
        tokens = torch.tensor([prompt_ids[n:]], dtype=torch.long, device=self._device)
        logits = prefill(self.model, tokens, start_pos=n)                # (1, V)
        self.cached_ids = list(prompt_ids)
        next_id = int(sample(logits, sampling, generator, [list(prompt_ids)], [[]])[0])
        if self.speculator is not None:         # a draft model reads the prompt too
            self.speculator.drafter.prefill(prompt_ids)
        stats.prefill_s = time.perf_counter() - t0

        budget = min(max_new_tokens, self.max_seq_len - len(prompt_ids))
        stats.finish_reason = "length"
        decode = self._decode if self.speculator is None else self._speculate
        yield from decode(next_id, budget, sampling, generator, stop_ids)

    def _decode(self, next_id: int, budget: int, sampling: SamplingParams,
                generator: torch.Generator, stop_ids: frozenset[int]) -> Iterator[int]:
        """Plain decoding: one forward pass per token, from the prefill's token `next_id`."""
        stats, generated = self.stats, []
        while next_id not in stop_ids:
            stats.new_tokens += 1
            yield next_id
            if stats.new_tokens >= budget:
                return
            t1 = time.perf_counter()
            token = torch.tensor([[next_id]], dtype=torch.long, device=self._device)
            logits = decode_one_token(self.model, token, len(self.cached_ids))  # (1, V)
            self.cached_ids.append(next_id)
            generated.append(next_id)
            next_id = int(sample(logits, sampling, generator, [self.cached_ids], [generated])[0])
            stats.decode_steps += 1
            stats.decode_tokens += 1
            stats.decode_s += time.perf_counter() - t1
        stats.finish_reason = "stop"

    def _speculate(self, next_id: int, budget: int, sampling: SamplingParams,
                   generator: torch.Generator, stop_ids: frozenset[int]) -> Iterator[int]:
        """Speculative decoding (`torchllama.generation.speculative.SpeculativeDecoder.step`): each step
        yields the drafts the model accepted and one token of its own. The cache then holds
        the context and the accepted drafts; rejected drafts' slots are simply forgotten."""
        stats, generated, pending = self.stats, [], [next_id]
        while True:
            for token in pending:
                if token in stop_ids:
                    stats.finish_reason = "stop"
                    return
                stats.new_tokens += 1
                generated.append(token)
                yield token
                if stats.new_tokens >= budget:
                    return
            t1 = time.perf_counter()
            context = self.cached_ids + [generated[-1]]
            step = self.speculator.step(context, sampling, generator, generated,
                                        max_tokens=budget - stats.new_tokens)
            self.cached_ids = context + step.tokens[:-1]     # the last one is not fed yet
            pending = step.tokens
            stats.decode_steps += 1
            stats.decode_tokens += len(step.tokens)
            stats.drafted += step.drafted
            stats.accepted += step.accepted
            stats.decode_s += time.perf_counter() - t1


# --------------------------------------------------------------------------------------------
# Text in, text out
# --------------------------------------------------------------------------------------------

def encode_prompt(tokenizer, prompt: str, chat: bool = False,
                  system: Optional[str] = None) -> list[int]:
    """Token ids of a prompt, with BOS when the model expects it (exactly once).

    Args:
        tokenizer: a torchllama Tokenizer.
        prompt: user text. Special-token strings in it are treated as plain text unless `chat`
            wraps it in the template (the template's own markers are parsed as special tokens).
        chat: wrap the prompt in the model's chat template as one user turn (+ optional system
            prompt) with the assistant's turn opened.
        system: optional system prompt (with chat=True).
    """
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        return encode_chat(tokenizer, messages)
    ids = tokenizer.encode(prompt)
    return _with_bos(tokenizer, ids)


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: Optional[list[dict]] = None,
                variables: Optional[dict] = None) -> list[int]:
    """Token ids of a conversation, ending with the assistant's turn opened.

    The checkpoint's own jinja chat template when it has one (BOS added once; `tools` given to
    it as transformers does, and `variables`, more template variables such as Qwen3's
    enable_thinking); otherwise, for a SentencePiece vocabulary with BOS and EOS (Llama 2 chat),
    Meta's format (`llama2_chat_ids`, no tools).

    Raises:
        TorchLlamaError: no template and no known format; malformed messages; Llama 2 format
            rules (see `llama2_chat_ids`).
    """
    if chat_format(tokenizer) == "llama2":
        return llama2_chat_ids(tokenizer, messages)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, variables=variables)
    return _with_bos(tokenizer, tokenizer.encode(text, special=True))


def chat_format(tokenizer) -> Optional[str]:
    """How `encode_chat` formats conversations for this tokenizer: "template" (the checkpoint's
    jinja chat template), "llama2" (no template, a SentencePiece vocabulary with BOS and EOS:
    Meta's Llama 2 chat format) or None (no chat format known)."""
    from torchllama.tokenizers import SentencePieceTokenizer

    if tokenizer.chat_template is not None:
        return "template"
    if isinstance(tokenizer, SentencePieceTokenizer) and tokenizer.bos_id is not None \
            and tokenizer.eos_id is not None:
        return "llama2"
    return None


# Llama 2 chat format, as Meta's reference builds it (llama/generation.py, chat_completion).
B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
LLAMA2_SPECIAL_TAGS = (B_INST, E_INST, "<<SYS>>", "<</SYS>>")


def llama2_chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a dialog in Llama 2's chat format, exactly as Meta's `chat_completion`.

    Each finished (user, assistant) pair is `BOS [INST] {user} [/INST] {answer} EOS`; the last
    user message is `BOS [INST] {user} [/INST]`, left open for the answer. A leading system
    message is folded into the first user message as `<<SYS>>\n{system}\n<</SYS>>\n\n`.
    Contents are stripped; BOS/EOS are token ids, never text.

    Args:
        tokenizer: a SentencePiece tokenizer with BOS and EOS (Llama 2's).
        messages: [{"role": "system"|"user"|"assistant", "content": str}, ...]: an optional
            system message, then user/assistant alternating, ending with a user message.

    Raises:
        ArgumentError: roles out of order, last message not from the user, or content holding
            the special tags [INST], [/INST], <<SYS>>, <</SYS>> (Meta refuses such requests).
    """
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        raise ArgumentError("messages must be a non-empty list of {'role': ..., 'content': str}")
    for m in messages:
        if any(tag in m["content"] for tag in LLAMA2_SPECIAL_TAGS):
            raise ArgumentError("special tags are not allowed as part of the prompt "
                                f"({', '.join(LLAMA2_SPECIAL_TAGS)}), as in Meta's Llama 2")
    dialog = list(messages)
    if dialog[0].get("role") == "system":
        if len(dialog) < 2:
            raise ArgumentError("a system message must be followed by a user message")
        dialog = [{"role": dialog[1]["role"],
                   "content": B_SYS + dialog[0]["content"] + E_SYS + dialog[1]["content"]}] \
            + dialog[2:]
    if not (all(m.get("role") == "user" for m in dialog[::2])
            and all(m.get("role") == "assistant" for m in dialog[1::2])):
        raise ArgumentError("Llama 2 chat supports 'system', 'user' and 'assistant' roles, "
                            "starting with 'system' (optional), then 'user' and alternating "
                            "(u/a/u/a/u...)")
    if dialog[-1]["role"] != "user":
        raise ArgumentError(f"the last message must be from the user, got {dialog[-1]['role']!r}")
    ids: list[int] = []
    for prompt, answer in zip(dialog[::2], dialog[1::2]):
        ids += tokenizer.encode(
            f"{B_INST} {prompt['content'].strip()} {E_INST} {answer['content'].strip()} ",
            bos=True, eos=True)
    ids += tokenizer.encode(f"{B_INST} {dialog[-1]['content'].strip()} {E_INST}", bos=True)
    return ids


# --8<-- [start:with-bos]
def _with_bos(tokenizer, ids: list[int]) -> list[int]:
    if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        return [tokenizer.bos_id] + ids
    return ids
# --8<-- [end:with-bos]


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 256, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: Optional[int] = None, chat: bool = False, draft=None,
             draft_tokens: Optional[int] = None) -> str:
    """Generate a continuation of `prompt` (or, with chat=True, the assistant's answer to it).

    Args:
        draft: speculative decoding (the same output distribution, faster where drafts are
            accepted): a `torchllama.generation.speculative.Drafter`, "lookup" (prompt lookup) or the
            path of a draft model with the same tokenizer. ("int4"/"int8"/"auto" need the
            target's checkpoint: `torchllama.generation.speculative.make_drafter(spec, path)`.)
        draft_tokens: the most tokens drafted per step.

    Returns the new text only (no prompt). See `Session.generate` for the errors raised; a
    draft model of another vocabulary size raises ArgumentError.
    """
    if isinstance(draft, str):
        from torchllama.generation.speculative import SELF_DRAFT_DTYPES, make_drafter
        if draft in SELF_DRAFT_DTYPES:
            raise ArgumentError(f"draft={draft!r} loads the target's own checkpoint: build it "
                                "with torchllama.generation.speculative.make_drafter(spec, target_path)")
        draft = make_drafter(draft)
    session = Session(model, tokenizer, draft=draft, draft_tokens=draft_tokens)
    ids = encode_prompt(tokenizer, prompt, chat=chat)
    new_ids = list(session.generate(ids, max_new_tokens,
                                    SamplingParams(temperature=temperature, top_k=top_k,
                                                   top_p=top_p, seed=seed)))
    stream = StreamDecoder(tokenizer, ids)
    return "".join(stream.push(i) for i in new_ids) + stream.flush()
