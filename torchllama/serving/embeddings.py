"""`/v1/embeddings` for a decoder-only model: pooled final hidden states.

A decoder-only language model was not trained to embed: its final hidden state at a position
is what predicts the next token, and under causal attention each position has seen only the
tokens before it. Two poolings are offered (the request's `pooling`, an extension):
  "mean" (default)  the mean of every position's final hidden state (after the final norm):
                    every token contributes (Sentence-BERT's mean pooling, Reimers & Gurevych
                    2019, over a decoder's states);
  "last"            the last position's, the only one that has seen the whole input (what
                    decoder-based embedders such as E5-Mistral and SFR pool, with an EOS
                    appended; here the input as tokenized, nothing appended).
The vectors are returned as computed, not normalized (OpenAI's are unit length: normalize for
cosine similarity), in float32, as JSON numbers or base64 of their little-endian bytes
(OpenAI's `encoding_format`). Inputs are left-padded into batches of up to `BATCH` rows; the
model's padded forward computes each row exactly as alone (tested).
"""

from __future__ import annotations

import base64

import torch

#: inputs per forward pass
BATCH = 16
POOLINGS = ("mean", "last")


def pooled(model, token_lists: list[list[int]], pooling: str = "mean") -> torch.Tensor:
    """The pooled final hidden states of each token list.

    Args:
        model: a `Transformer` without KV caches installed (the engine's `call` takes them off).
        token_lists: N non-empty lists of token ids, each within the model's context.
        pooling: "mean" or "last" (module docstring).

    Returns:
        (N, dim) float32.
    """
    out = []
    for i in range(0, len(token_lists), BATCH):
        batch = token_lists[i:i + BATCH]
        T = max(len(ids) for ids in batch)
        pad = torch.tensor([T - len(ids) for ids in batch])                   # (B,)
        tokens = torch.tensor([[0] * (T - len(ids)) + ids for ids in batch])  # (B, T) left-padded
        h = model(tokens, 0, pad=pad if pad.any() else None, hidden=True).float()  # (B, T, D)
        for b, ids in enumerate(batch):
            rows = h[b, T - len(ids):]                                        # (len, D) real
            out.append(rows.mean(0) if pooling == "mean" else rows[-1])       # (D,)
    return torch.stack(out)                                                   # (N, D)


def encoded(vector: torch.Tensor, encoding_format: str):
    """One (D,) float32 vector as OpenAI's `embedding` field: a list of floats, or base64 of
    its float32 little-endian bytes."""
    if encoding_format == "base64":
        data = vector.contiguous().numpy().astype("<f4").tobytes()
        return base64.b64encode(data).decode("ascii")
    return vector.tolist()
