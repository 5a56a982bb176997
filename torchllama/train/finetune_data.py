"""Finetuning data: plain text (causal LM on documents) or chat (JSON Lines of `messages`).

Plain text (.txt, .md or any non-.jsonl file, or a folder of them): each document is tokenized
with BOS (where the model uses one) and EOS after it, the documents are concatenated, the last
`val_fraction` of the tokens held out, and training windows of T + 1 tokens are drawn as in
`torchllama train` (`TokenBatches`), the first input replaced by BOS (where the model uses one,
as llama.cpp's perplexity does): every target is scored.

Chat (.jsonl): one conversation per line, `{"messages": [{"role": ..., "content": ...}, ...]}`
(OpenAI's and TRL's conversational format), rendered with the model's own chat template. Only
the assistant's tokens are scored (TRL's `assistant_only_loss`): the text of assistant turn i is
what `render(messages[:i+1])` adds to `render(messages[:i], add_generation_prompt=True)` — the
answer and the template's end-of-turn marker, so the model also learns to stop. Each segment
is tokenized on its own (the boundaries are special tokens, as at inference, where the prompt
ends with the generation prompt); the other positions get the target IGNORE_INDEX.
Conversations are cut to T + 1 tokens and a batch is padded to its longest row.

Batches are a pure function of (seed, micro-step): a resumed run sees the same ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from torchllama.errors import ArgumentError
from torchllama.nn.loss import IGNORE_INDEX
from torchllama.train.data import TokenBatches, eval_windows, expand_inputs, read_text


def _text_tokens(tokenizer, files: list[Path]) -> np.ndarray:
    from torchllama.generation.session import _with_bos

    ids: list[int] = []
    for path in files:
        doc = _with_bos(tokenizer, tokenizer.encode(read_text(path)))
        ids += doc + ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    return np.asarray(ids, dtype=np.int64)


class TextData:
    """Causal-LM windows of plain-text documents.

    Args:
        tokenizer: the model's tokenizer.
        files: text files.
        seq_len: T.
        batch_size: B.
        seed: seed of the window order.
        val_fraction: share of the tokens (the end of the stream) held out for validation.

    Raises:
        ArgumentError: too little text for the window length.
    """

    def __init__(self, tokenizer, files: list[Path], seq_len: int, batch_size: int, seed: int,
                 val_fraction: float):
        tokens = _text_tokens(tokenizer, files)
        n_val = int(len(tokens) * val_fraction)
        self.train, self.val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
        self.batches = TokenBatches(self.train, seq_len, batch_size, seed)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.n_train_tokens = len(self.train)
        self.bos_id = tokenizer.bos_id if tokenizer.add_bos else None

    def _split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows (B, T + 1) → (inputs, targets), each input starting with BOS where the model
        uses one (as llama.cpp's perplexity windows: a model trained with BOS first, Gemma
        above all, is far off without it, and an adapter would learn to fix that instead)."""
        inputs = rows[:, :-1].clone()                                      # (B, T)
        if self.bos_id is not None:
            inputs[:, 0] = self.bos_id
        return inputs, rows[:, 1:]

    def batch(self, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs (B, T), targets (B, T)) int64 of micro-step `micro_step`."""
        return self._split(self.batches.batch(micro_step))                 # rows (B, T + 1)

    def epoch_of(self, micro_step: int) -> float:
        return self.batches.epoch_of(micro_step)

    def val_batches(self, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        windows = eval_windows(self.val, self.seq_len, n_batches * self.batch_size)  # (n, T+1)
        return [self._split(w) for w in windows.split(self.batch_size)]


# --------------------------------------------------------------------------------------------
# Chat
# --------------------------------------------------------------------------------------------

def read_conversations(path: Path) -> list[list[dict]]:
    """The conversations of a JSON Lines file (blank lines skipped).

    Raises:
        ArgumentError: a line that is not JSON, not an object with a "messages" list of
            {"role": str, "content": str} objects, or without an assistant message; the
            message names the file and the line number.
    """
    conversations = []
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ArgumentError(f"{where}: not valid JSON ({e})") from None
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ArgumentError(f"{where}: expected an object with a non-empty \"messages\" "
                                "list")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise ArgumentError(f"{where}: messages[{i}] must be an object with string "
                                    "\"role\" and \"content\"")
        if not any(m["role"] == "assistant" for m in messages):
            raise ArgumentError(f"{where}: no assistant message (nothing to learn from)")
        conversations.append([{"role": m["role"], "content": m["content"]} for m in messages])
    if not conversations:
        raise ArgumentError(f"{path}: no conversations (an empty file)")
    return conversations


def chat_example(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of a rendered conversation and, per id, whether it is the assistant's (scored).

    Raises:
        ArgumentError: the tokenizer has no chat template, or the template does not render a
            conversation as its prefixes followed by each assistant turn.
    """
    from torchllama.generation.session import _with_bos

    if tokenizer.chat_template is None:
        raise ArgumentError("chat data needs a model with a chat template (this tokenizer has "
                            "none); use plain-text data")
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True) \
            if i else ""
        full = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise ArgumentError("the chat template does not render a conversation as its "
                                "prefixes (an assistant turn changes the text before it)")
        pieces += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    ids = _with_bos(tokenizer, [])
    scored = [False] * len(ids)
    for text, is_answer in pieces:
        piece = tokenizer.encode(text, special=True) if text else []
        ids += piece
        scored += [is_answer] * len(piece)
    return ids, scored


class ChatData:
    """Conversations with the loss on the assistant's tokens (see the module docstring).

    Args: as `TextData`, with JSON Lines files.

    Raises:
        ArgumentError: a malformed line (file and line number), no conversation left for
            training, or no template.
    """

    def __init__(self, tokenizer, files: list[Path], seq_len: int, batch_size: int, seed: int,
                 val_fraction: float):
        examples = []
        for path in files:
            for messages in read_conversations(path):
                ids, scored = chat_example(tokenizer, messages)
                ids, scored = ids[:seq_len + 1], scored[:seq_len + 1]
                targets = [t if s else IGNORE_INDEX for t, s in zip(ids[1:], scored[1:])]
                if any(t != IGNORE_INDEX for t in targets):
                    examples.append((ids[:-1], targets))
        n_val = int(len(examples) * val_fraction)
        self.train, self.val = examples[:len(examples) - n_val], examples[len(examples) - n_val:]
        if not self.train:
            raise ArgumentError(f"{', '.join(map(str, files))}: no conversation with an "
                                f"assistant token within --seq-len {seq_len} left to train on")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        self.n_train_tokens = sum(len(x) for x, _ in self.train)

    def _collate(self, rows: Sequence[tuple[list[int], list[int]]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        T = max(len(x) for x, _ in rows)
        inputs = torch.full((len(rows), T), self.pad_id, dtype=torch.int64)     # (B, T)
        targets = torch.full((len(rows), T), IGNORE_INDEX, dtype=torch.int64)   # (B, T)
        for b, (x, y) in enumerate(rows):
            inputs[b, :len(x)] = torch.tensor(x)
            targets[b, :len(y)] = torch.tensor(y)
        return inputs, targets

    def batch(self, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs (B, T), targets (B, T)) of micro-step `micro_step`: conversations in a
        seeded order per epoch, right-padded (pads are never targets and, with causal
        attention, never seen by a real token)."""
        n, B = len(self.train), self.batch_size
        rows = []
        for g in range(micro_step * B, micro_step * B + B):
            epoch, k = divmod(g, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                self.seed * 1_000_003 + epoch))
            rows.append(self.train[int(order[k])])
        return self._collate(rows)

    def epoch_of(self, micro_step: int) -> float:
        return micro_step * self.batch_size / len(self.train)

    def val_batches(self, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rows = self.val[:n_batches * self.batch_size]
        return [self._collate(rows[i:i + self.batch_size])
                for i in range(0, len(rows), self.batch_size)]


def finetune_data(tokenizer, inputs: Sequence[str], seq_len: int, batch_size: int, seed: int,
                  val_fraction: float = 0.05, name: str = "--data"):
    """`ChatData` for .jsonl files, else `TextData` (a mix of both is refused)."""
    files = expand_inputs(inputs, name)
    chat = [p.suffix == ".jsonl" for p in files]
    if any(chat) and not all(chat):
        raise ArgumentError(f"{name}: a mix of chat (.jsonl) and plain-text files; finetune on "
                            "one kind at a time")
    if not 0 <= val_fraction < 1:
        raise ArgumentError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    kind = ChatData if all(chat) else TextData
    return kind(tokenizer, files, seq_len, batch_size, seed, val_fraction)
