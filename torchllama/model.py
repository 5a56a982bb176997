"""The decoder: token embeddings, n_layers residual blocks of attention and feed-forward, a final
norm and the output projection — assembled from the building blocks in `torchllama.nn`.

Read top to bottom. Parameter names are Meta's (meta-llama/llama, llama/model.py), so Meta
checkpoints load with strict key checking; other checkpoint formats map their names onto these
through their family's adapter (`torchllama.families`).

Shape letters in comments: B batch, T new tokens in this call, S = start_pos + T positions
attended (cached prefix + new), H n_heads, KV n_kv_heads, hd head_dim, D dim, F hidden, V vocab.

The model holds no device, compile or process-group code: callers move it (`.to`), compile its
decode step, or shard it from outside. Everything in `forward` has static shapes given
(B, T, start_pos), and the linear layers are plain `nn.Linear`s that weight-only quantization can
swap later.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError, ContextLengthError
from torchllama.nn import (Attention, AttentionInputs, FeedForward, KVCache, RMSNorm,
                           RotaryEmbedding, linear_cross_entropy)


class TransformerBlock(nn.Module):
    """One decoder layer with pre-norm residuals (as Meta's TransformerBlock):
        h   = x + Attention(RMSNorm(x))
        out = h + FeedForward(RMSNorm(h))
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        # x: (B, T, D) → (B, T, D)
        h = x + self.attention(self.attention_norm(x), inputs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """A decoder-only language model: token embeddings, n_layers TransformerBlocks, a final
    RMSNorm and the output projection to vocabulary logits (Llama 2).

    Without a KV cache (the default, as for training) `forward` runs causal attention over the
    tokens it is given. After `setup_caches`, each call appends its tokens' keys and values at
    `start_pos`: prefill the prompt once (start_pos=0), then decode one token at a time at
    start_pos = number of tokens so far.

    Loaders build it on the meta device and assign the loaded weights (no second copy).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # RoPE rotations of every position, derived from args (not parameters).
        self.rope = RotaryEmbedding(args.head_dim, args.max_seq_len, args.rope_theta)
        self.caches: Optional[tuple[KVCache, ...]] = None   # one per layer, see setup_caches

    def tie_weights(self) -> None:
        """Make `output` share `tok_embeddings`' weight when args.tie_embeddings (Press & Wolf
        2017); call again after assigning loaded tensors."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def residual_projections(self) -> list[nn.Linear]:
        """The linear layers whose outputs are added to the residual stream (attention output
        and feed-forward down projections): GPT-2's init scales them by 1/√(2·n_layers)."""
        return [m for block in self.layers for m in (block.attention.wo, block.feed_forward.w2)]

    # ---- KV cache ----------------------------------------------------------------------------

    def setup_caches(self, max_batch_size: Optional[int] = None,
                     max_seq_len: Optional[int] = None) -> None:
        """Allocate a KV cache in every attention layer, on the weights' device and dtype.
        `self.caches` is then the tuple of them (a new tuple at every call, so a caller can
        tell whether the caches it filled are still in place).

        Args:
            max_batch_size: rows of the cache (default args.max_batch_size).
            max_seq_len: slots per row (default and maximum: args.max_seq_len).

        Raises:
            ArgumentError: max_seq_len beyond args.max_seq_len, or a non-positive size.
        """
        max_batch_size = self.args.max_batch_size if max_batch_size is None else max_batch_size
        max_seq_len = self.args.max_seq_len if max_seq_len is None else max_seq_len
        if max_batch_size < 1 or not 1 <= max_seq_len <= self.args.max_seq_len:
            raise ArgumentError(
                f"setup_caches: need max_batch_size ≥ 1 and 1 ≤ max_seq_len ≤ "
                f"{self.args.max_seq_len}, got {max_batch_size}, {max_seq_len}")
        weight = self.tok_embeddings.weight
        for layer in self.layers:
            layer.attention.kv_cache = layer.attention.make_cache(
                max_batch_size, max_seq_len, weight.dtype, weight.device)
        self.caches = tuple(layer.attention.kv_cache for layer in self.layers)

    def clear_caches(self) -> None:
        """Drop the KV caches (frees their memory; forward goes back to uncached attention)."""
        for layer in self.layers:
            layer.attention.kv_cache = None
        self.caches = None

    @property
    def cache_shape(self) -> Optional[tuple[int, int]]:
        """(max_batch_size, max_seq_len) of the allocated KV caches, or None."""
        if not self.caches:
            return None
        return self.caches[0].max_batch_size, self.caches[0].max_seq_len

    def shift_caches(self, d: int, end: int) -> None:
        """Move slots [0, end) of every cache row by d slots (`KVCache.shift`)."""
        for cache in self.caches or ():
            cache.shift(d, end)

    def zero_cache_slots(self, rows: slice, start: int, end: int) -> None:
        """Zero slots [start, end) of the given cache rows in every layer (`KVCache.zero`)."""
        for cache in self.caches or ():
            cache.zero(rows, start, end)

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, *, last_only: bool = False,
                pad: Optional[torch.Tensor] = None, cache_rows: Optional[slice] = None,
                targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits of the next token after each of the given tokens, or, given targets, the
        training loss.

        Args:
            tokens: (B, T) int64 token ids in cache slots start_pos..start_pos+T-1.
            start_pos: number of slots already in the KV cache (0 without a cache).
            last_only: compute logits for the last position only (what generation needs after
                a prefill; saves a (T, dim)×(dim, V) matmul).
            pad: (B,) int64, for left-padded batches: the first pad[b] slots of row b hold
                padding. They are never attended, and slot s of row b is RoPE position
                s − pad[b], so each row computes exactly what it would alone. None: no padding.
            cache_rows: the KV cache rows these B sequences use (default: rows 0..B-1), e.g.
                slice(b, b + 1) to prefill one sequence into row b of a running batch.
            targets: (B, T) int64 next-token ids: return the mean cross-entropy of the logits
                against them instead of the logits, computed chunk by chunk without
                materialising the (B, T, vocab_size) logits (`torchllama.nn.loss`).

        Returns:
            float32 logits (B, T, vocab_size), or (B, 1, vocab_size) with last_only; with
            targets, a float32 scalar loss (nats per token).

        Raises:
            ContextLengthError: start_pos + T exceeds the context (args.max_seq_len or the
                cache's length).
            ArgumentError: start_pos > 0 without a KV cache, or B above the cache's batch size.
        """
        B, T = tokens.shape
        end = start_pos + T
        self._check_slots(B, start_pos, end, cache_rows)
        h = self.tok_embeddings(tokens)                      # (B, T, D)
        inputs = self._attention_inputs(tokens.device, start_pos, end, pad, cache_rows)
        for layer in self.layers:
            h = layer(h, inputs)                             # (B, T, D)
        if last_only:
            h = h[:, -1:, :]                                 # (B, 1, D)
        h = self.norm(h)                                     # (B, T, D)
        if targets is not None:                              # training: fused output + loss
            return linear_cross_entropy(h.flatten(0, 1), self.output.weight,  # (B·T, D)
                                        targets.flatten())                    # → () fp32
        return self.output(h).float()                        # (B, T, V) fp32

    def _check_slots(self, B: int, start_pos: int, end: int, cache_rows: Optional[slice]) -> None:
        cache_shape = self.cache_shape
        if cache_shape is None:
            if start_pos != 0:
                raise ArgumentError("start_pos > 0 needs a KV cache: call setup_caches() first")
            max_len = self.args.max_seq_len
        else:
            first = (cache_rows.start or 0) if cache_rows is not None else 0
            if first + B > cache_shape[0]:
                raise ArgumentError(f"batch size {B} exceeds the KV cache's {cache_shape[0]}")
            max_len = cache_shape[1]
        if end > max_len:
            raise ContextLengthError(
                f"positions {start_pos}..{end - 1} exceed the context of {max_len} tokens")

    def _attention_inputs(self, device: torch.device, start_pos: int, end: int,
                          pad: Optional[torch.Tensor], cache_rows: Optional[slice]
                          ) -> AttentionInputs:
        """RoPE rotations and mask of the new tokens in slots start_pos..end-1, for every layer."""
        T = end - start_pos
        if pad is None:
            freqs_cis = self.rope.span(start_pos, end, device)           # (T, hd/2)
            mask = None                    # causal (T>1, nothing cached) or one token: no mask
            if T > 1 and start_pos > 0:
                # New tokens see the whole cached prefix and, causally, each other:
                # query t (slot start_pos + t) may attend key s iff s ≤ start_pos + t.
                q_slot = torch.arange(start_pos, end, device=device)     # (T,)
                k_slot = torch.arange(end, device=device)                # (S,)
                mask = k_slot[None, :] <= q_slot[:, None]                # (T, S) bool
            return AttentionInputs(start_pos, freqs_cis, mask, cache_rows)
        q_slot = torch.arange(start_pos, end, device=device)             # (T,)
        k_slot = torch.arange(end, device=device)                        # (S,)
        # Left-padded rows: row b's first pad[b] slots hold padding, slot s is position s − pad[b].
        positions = (q_slot[None, :] - pad[:, None]).clamp(min=0)       # (B, T)
        freqs_cis = self.rope(positions)                                 # (B, T, hd/2)
        causal = k_slot[None, None, :] <= q_slot[None, :, None]          # (1, T, S)
        real = k_slot[None, None, :] >= pad[:, None, None]               # (B, 1, S)
        # A padding query would see nothing (an all -inf softmax row gives NaN): let it see
        # itself. Its output is never used, since no real query attends a padding slot.
        itself = k_slot[None, None, :] == q_slot[None, :, None]          # (1, T, S)
        mask = ((causal & real) | itself)[:, None]                       # (B, 1, T, S)
        return AttentionInputs(start_pos, freqs_cis, mask, cache_rows)
