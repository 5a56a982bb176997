"""The Llama 2 transformer, from scratch: RMSNorm, RoPE, grouped-query attention with a KV cache,
SwiGLU, pre-norm residual blocks.

Read top to bottom. Parameter names are Meta's (meta-llama/llama, llama/model.py) so Meta
checkpoints load with strict key checking:

    tok_embeddings.weight                              (vocab_size, dim)
    layers.N.attention_norm.weight                     (dim,)
    layers.N.attention.wq.weight                       (n_heads·head_dim, dim)
    layers.N.attention.wk.weight / wv.weight           (n_kv_heads·head_dim, dim)
    layers.N.attention.wo.weight                       (dim, n_heads·head_dim)
    layers.N.ffn_norm.weight                           (dim,)
    layers.N.feed_forward.w1.weight / w3.weight        (hidden, dim)
    layers.N.feed_forward.w2.weight                    (dim, hidden)
    norm.weight                                        (dim,)
    output.weight                                      (vocab_size, dim)  (tied: tok_embeddings)

Shape letters in comments: B batch, T new tokens in this call, S = start_pos + T positions
attended (cached prefix + new), H n_heads, KV n_kv_heads, hd head_dim, D dim, F hidden, V vocab.

The model holds no device, compile or process-group code: callers move it (`.to`), compile its
decode step, or shard it from outside. Everything in `forward` has static shapes given
(B, T, start_pos), and the linear layers are plain `nn.Linear`s that weight-only quantization can
swap later.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError, ContextLengthError
from torchllama.loss import linear_cross_entropy


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019, eq. 4): x / RMS(x) · g.

    RMS(x) = sqrt(mean(x²) + eps). Computed in float32 whatever the input dtype, then cast back,
    as Meta's reference does (llama/model.py, RMSNorm.forward).

    Shapes: x (..., dim) any float dtype → (..., dim) same dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # g, the learned gain (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()                                                    # (..., D) fp32
        rms_inv = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., 1)
        return (x32 * rms_inv).type_as(x) * self.weight                    # (..., D)


def precompute_freqs_cis(head_dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """RoPE's rotations e^{i·m·θ_i} for positions m = 0..end-1, as Meta precomputes them.

    RoFormer (Su et al. 2021, eq. 15 and 34): pair i of a head vector at position m is rotated by
    the angle m·θ_i with θ_i = theta^(-2i/head_dim), i = 0..head_dim/2-1 (Meta's
    llama/model.py, precompute_freqs_cis). Always computed on the CPU in float32.

    Args:
        head_dim: width of one attention head (even).
        end: number of positions.
        theta: RoPE base (ModelArgs.rope_theta).

    Returns:
        complex64 tensor (end, head_dim // 2): cos(m·θ_i) + i·sin(m·θ_i).
    """
    exponents = torch.arange(0, head_dim, 2, device="cpu")[: head_dim // 2].float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)                                      # θ_i (hd/2,)
    positions = torch.arange(end, dtype=torch.float32, device="cpu")           # m (end,)
    angles = torch.outer(positions, inv_freq)                                  # m·θ_i (end, hd/2)
    return torch.polar(torch.ones_like(angles), angles)                        # (end, hd/2) c64


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor,
                     dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of every head vector by their position's angles.

    As Meta's apply_rotary_emb: view each pair as the complex number x[2i] + i·x[2i+1] and
    multiply it by e^{i·m·θ_i} (RoFormer eq. 34), i.e.
        out[2i]   = x[2i]·cos − x[2i+1]·sin
        out[2i+1] = x[2i]·sin + x[2i+1]·cos
    One complex multiplication is a single fused kernel, several times faster on CPU than the
    same formula written with real tensors. Computed in float32, returned in x's dtype.

    Args:
        x: (B, T, n_heads, head_dim) queries or keys.
        freqs_cis: (T, head_dim // 2) complex64 rotations of the T positions of x (a slice of
            `precompute_freqs_cis`), or (B, T, head_dim // 2) when rows have their own positions
            (left-padded batches); or the same as float32 (cos, sin) pairs
            (`torch.view_as_real`, one more trailing dimension of 2), which torch.compile
            needs.
        dtype: dtype of the result (default: x's).

    Returns:
        Tensor of x's shape, in `dtype`.
    """
    B, T, H, hd = x.shape
    if not freqs_cis.is_complex():
        # The same rotation in real arithmetic, for torch.compile (Inductor generates no code
        # for complex tensors): freqs_cis given as view_as_real, (..., T, hd/2, 2) = (cos, sin).
        x0, x1 = x.float().reshape(B, T, H, hd // 2, 2).unbind(-1)   # (B, T, H, hd/2) each
        cos, sin = freqs_cis.view(-1, T, 1, hd // 2, 2).unbind(-1)   # (B|1, T, 1, hd/2) each
        rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
        return rotated.flatten(3).to(dtype or x.dtype)                # (B, T, H, hd)
    pairs = torch.view_as_complex(x.float().reshape(B, T, H, hd // 2, 2))   # (B, T, H, hd/2) c64
    rotated = pairs * freqs_cis.view(-1, T, 1, hd // 2)                    # broadcast (B) and H
    return torch.view_as_real(rotated).flatten(3).to(dtype or x.dtype)     # (B, T, H, hd)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Share each key/value head among n_rep query heads (grouped-query attention, Ainslie et al.
    2023): (B, KV, S, hd) → (B, KV·n_rep, S, hd), head h of the output is KV head h // n_rep.

    Meta's repeat_kv does the same on (B, S, KV, hd); we keep heads before positions, the
    layout the KV cache and SDPA use. `Attention` gets the same result from SDPA's enable_gqa
    without materialising the copies; this function states the semantics (and tests use it).
    """
    if n_rep == 1:
        return x
    B, KV, S, hd = x.shape
    return (x[:, :, None, :, :]                 # (B, KV, 1, S, hd)
            .expand(B, KV, n_rep, S, hd)        # (B, KV, n_rep, S, hd), no copy yet
            .reshape(B, KV * n_rep, S, hd))     # (B, H, S, hd)


class KVCache(nn.Module):
    """Preallocated keys and values of one attention layer, written at the positions of new tokens.

    Buffers k_cache, v_cache: (max_batch_size, n_kv_heads, max_seq_len, head_dim). They are
    allocated uninitialised (untouched pages cost no memory): `update` only returns positions
    [0, start_pos + T), which previous calls have written — except padding slots a caller never
    wrote (the serving engine's), which that caller must zero: masked slots still meet a zero
    attention weight, and 0 · NaN is NaN.
    """

    def __init__(self, max_batch_size: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        shape = (max_batch_size, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.empty(shape, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v_cache", torch.empty(shape, dtype=dtype, device=device),
                             persistent=False)

    def update(self, start_pos: int, xk: torch.Tensor, xv: torch.Tensor,
               rows: Optional[slice] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write xk, xv (B, KV, T, hd) at positions start_pos..start_pos+T-1 and return all keys
        and values written so far, (B, KV, S, hd) with S = start_pos + T (views, no copy).

        Returning only the filled part means decode attends over S positions, not max_seq_len:
        decode is bound by memory bandwidth, so reading the empty rest would cost time.
        `rows` selects the cache rows of the B sequences (default: rows 0..B-1).
        """
        B, _, T, _ = xk.shape
        rows = rows if rows is not None else slice(0, B)
        end = start_pos + T
        self.k_cache[rows, :, start_pos:end] = xk  # (B, KV, T, hd) into (B, KV, S_max, hd)
        self.v_cache[rows, :, start_pos:end] = xv
        return self.k_cache[rows, :, :end], self.v_cache[rows, :, :end]  # (B, KV, S, hd)


class Attention(nn.Module):
    """Multi-head self-attention with grouped-query heads, RoPE and an optional KV cache.

    Attention(Q, K, V) = softmax(Q·Kᵀ / sqrt(head_dim) + mask) · V (Vaswani et al. 2017, eq. 1),
    computed by torch's scaled_dot_product_attention. n_kv_heads ≤ n_heads key/value heads are
    shared by groups of n_heads / n_kv_heads query heads (Ainslie et al. 2023).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.n_rep = args.n_heads // args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor,
                mask: Optional[torch.Tensor], cache_rows: Optional[slice] = None) -> torch.Tensor:
        """
        Args:
            x: (B, T, dim) normalised hidden states of the T new tokens.
            start_pos: position of x's first token (number of tokens already cached).
            freqs_cis: (T, head_dim // 2) complex64 RoPE rotations of positions
                start_pos..start_pos+T-1, or (B, T, head_dim // 2) per row.
            mask: (T, S) or (B, 1, T, S) bool, True where query t may attend key s; None means
                causal attention among the T tokens when nothing is cached before them, or no
                mask for a single token (it may see every cached position).
            cache_rows: KV cache rows of the B sequences (default 0..B-1).

        Returns:
            (B, T, dim).
        """
        B, T, _ = x.shape
        xq = self.wq(x).view(B, T, self.n_heads, self.head_dim)      # (B, T, H, hd)
        xk = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)   # (B, T, KV, hd)
        xv = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)   # (B, T, KV, hd)

        # Under CPU autocast (bf16 training), attention runs in float32: PyTorch's CPU flash
        # attention is slower in bfloat16 than in float32 (measured forward + backward 18.0 vs
        # 12.7 ms per layer of shakespeare-small) and float32 is the more accurate of the two.
        fp32_attention = x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
        rope_dtype = torch.float32 if fp32_attention else x.dtype
        xq = apply_rotary_emb(xq, freqs_cis, rope_dtype)              # (B, T, H, hd)
        xk = apply_rotary_emb(xk, freqs_cis, rope_dtype)              # (B, T, KV, hd)

        xq = xq.transpose(1, 2).contiguous()   # (B, H, T, hd); contiguous: faster CPU SDPA
        xk = xk.transpose(1, 2)                                       # (B, KV, T, hd)
        xv = xv.transpose(1, 2)                                       # (B, KV, T, hd)
        if self.kv_cache is not None:
            keys, values = self.kv_cache.update(start_pos, xk, xv, cache_rows)  # (B,KV,S,hd)
        else:
            keys, values = xk, xv                                     # (B, KV, T, hd), S = T
        # Grouped-query attention: query head h uses KV head h // n_rep. SDPA's enable_gqa does
        # what Meta's repeat_kv does (see `repeat_kv`) without copying keys/values n_rep times:
        # the copies cost more than the attention itself during decode.
        causal = True if mask is None and T > 1 else False           # a plain bool, also for
        if fp32_attention:
            keys, values = keys.float(), values.float()
        with torch.autocast("cpu", enabled=False) if fp32_attention else nullcontext():  # (SymInt)
            out = F.scaled_dot_product_attention(                     # (B, H, T, hd)
                xq, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=self.n_rep > 1)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H·hd)
        return self.wo(out)                                           # (B, T, D)


class FeedForward(nn.Module):
    """SwiGLU feed-forward network (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6):
    FFN(x) = W2 · (SiLU(W1·x) ⊙ W3·x), with hidden size `ModelArgs.ffn_hidden_dim`."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)   # gate projection
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)   # down projection
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)   # up projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, D) → (B, T, F) gated → (B, T, D)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One decoder layer with pre-norm residuals (as Meta's TransformerBlock):
        h   = x + Attention(RMSNorm(x))
        out = h + FeedForward(RMSNorm(h))
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor,
                mask: Optional[torch.Tensor], cache_rows: Optional[slice] = None) -> torch.Tensor:
        # x: (B, T, D) → (B, T, D)
        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask, cache_rows)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama 2: token embeddings, n_layers TransformerBlocks, a final RMSNorm and the output
    projection to vocabulary logits.

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
        # RoPE rotations (max_seq_len, head_dim/2) complex64, derived from args. A plain
        # attribute, as in Meta's model, not a buffer: `model.to(torch.bfloat16)` would cast a
        # complex buffer to real and drop the sines. forward() moves it to the input's device.
        self.freqs_cis = precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta)
        # The same as real (cos, sin) pairs (max_seq_len, head_dim/2, 2), for torch.compile.
        self.freqs_cos_sin = torch.view_as_real(self.freqs_cis).clone()

    def tie_weights(self) -> None:
        """Make `output` share `tok_embeddings`' weight when args.tie_embeddings (press & Wolf
        2017); call again after assigning loaded tensors."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def setup_caches(self, max_batch_size: Optional[int] = None,
                     max_seq_len: Optional[int] = None) -> None:
        """Allocate a KV cache in every attention layer, on the weights' device and dtype.

        Args:
            max_batch_size: rows of the cache (default args.max_batch_size).
            max_seq_len: positions of the cache (default and maximum: args.max_seq_len).

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
            layer.attention.kv_cache = KVCache(max_batch_size, max_seq_len, self.args.n_kv_heads,
                                               self.args.head_dim, weight.dtype, weight.device)

    def clear_caches(self) -> None:
        """Drop the KV caches (frees their memory; forward goes back to uncached attention)."""
        for layer in self.layers:
            layer.attention.kv_cache = None

    @property
    def cache_shape(self) -> Optional[tuple[int, int]]:
        """(max_batch_size, max_seq_len) of the allocated KV caches, or None."""
        cache = self.layers[0].attention.kv_cache if len(self.layers) else None
        if cache is None:
            return None
        return cache.k_cache.shape[0], cache.k_cache.shape[2]

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
                materialising the (B, T, vocab_size) logits (`torchllama.loss`).

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

        if self.freqs_cis.device != tokens.device:           # once, after model.to(device)
            self.freqs_cis = self.freqs_cis.to(tokens.device)
            self.freqs_cos_sin = self.freqs_cos_sin.to(tokens.device)
        h = self.tok_embeddings(tokens)                      # (B, T, D)
        freqs_cis = self._rope_table()[start_pos:end]        # (T, hd/2) complex64

        mask = None                                          # causal (T>1, nothing cached) or T=1
        if pad is not None:
            freqs_cis, mask = self._padded_rope_and_mask(pad, start_pos, end)
        elif T > 1 and start_pos > 0:
            # New tokens see the whole cached prefix and, causally, each other:
            # query t (position start_pos + t) may attend key s iff s ≤ start_pos + t.
            q_pos = torch.arange(start_pos, end, device=tokens.device)   # (T,)
            k_pos = torch.arange(end, device=tokens.device)              # (S,)
            mask = k_pos[None, :] <= q_pos[:, None]                      # (T, S) bool

        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask, cache_rows)  # (B, T, D)
        if last_only:
            h = h[:, -1:, :]                                 # (B, 1, D)
        h = self.norm(h)                                     # (B, T, D)
        if targets is not None:                              # training: fused output + loss
            return linear_cross_entropy(h.flatten(0, 1), self.output.weight,  # (B·T, D)
                                        targets.flatten())                    # → () fp32
        return self.output(h).float()                        # (B, T, V) fp32

    def _rope_table(self) -> torch.Tensor:
        """freqs_cis (max_seq_len, hd/2) complex64; under torch.compile the same numbers as
        real (cos, sin) pairs (max_seq_len, hd/2, 2) float32, made once outside the graph."""
        if not torch.compiler.is_compiling():
            return self.freqs_cis
        return self.freqs_cos_sin

    def _padded_rope_and_mask(self, pad: torch.Tensor, start_pos: int, end: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row RoPE rotations (B, T, hd/2) and attention mask (B, 1, T, S) of a left-padded
        batch whose row b starts with pad[b] padding slots."""
        q_slot = torch.arange(start_pos, end, device=pad.device)          # (T,)
        k_slot = torch.arange(end, device=pad.device)                     # (S,)
        positions = (q_slot[None, :] - pad[:, None]).clamp(min=0)         # (B, T)
        freqs_cis = self._rope_table()[positions]                         # (B, T, hd/2) c64
        causal = k_slot[None, None, :] <= q_slot[None, :, None]           # (1, T, S)
        real = k_slot[None, None, :] >= pad[:, None, None]                # (B, 1, S)
        # A padding query would see nothing (an all -inf softmax row gives NaN): let it see
        # itself. Its output is never used, since no real query attends a padding slot.
        itself = k_slot[None, None, :] == q_slot[None, :, None]           # (1, T, S)
        mask = (causal & real) | itself                                   # (B, T, S) bool
        return freqs_cis, mask[:, None]                                   # (B, 1, T, S)


def column_major(w: torch.Tensor) -> torch.Tensor:
    """The same (out, in) matrix stored as the transpose of a contiguous (in, out) tensor."""
    return w.t().contiguous().t()                               # (out, in), strides (1, out)


def set_weight_layout(model: nn.Module, layout: str) -> nn.Module:
    """Choose how every nn.Linear weight is laid out in memory; values, shapes (out, in), names
    and ties are unchanged.

    - "row": (out, in) contiguous, torch's default.
    - "column": the transpose of a contiguous (in, out) tensor. F.linear then runs
      x @ W_in_out without a transposed operand. On x86 CPUs with MKL this is much faster in
      float32: measured on 2 cores, matrix-vector products (decode) stream weights 1.27× faster,
      and some prefill GEMMs (e.g. (512, 1536) × (1536, 576)) run 3× faster. It does not help
      bfloat16 (oneDNN), so loaders use it for float32 only.

    Returns the model (modified in place).

    Raises:
        ArgumentError: unknown layout.
    """
    if layout not in ("row", "column"):
        raise ArgumentError(f"weight layout must be 'row' or 'column', got {layout!r}")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            w = module.weight.data                              # (out, in)
            if layout == "column":
                module.weight.data = column_major(w)
            else:
                module.weight.data = w.contiguous()             # (out, in), strides (in, 1)
    return model
