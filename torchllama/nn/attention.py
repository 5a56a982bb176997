"""Causal self-attention with grouped-query heads, RoPE and a KV cache.

Attention(Q, K, V) = softmax(Q·Kᵀ / sqrt(head_dim) + mask) · V (Vaswani et al. 2017, eq. 1).

The decoder builds the per-call inputs every layer needs (`AttentionInputs`: RoPE rotations of
the new tokens, the mask, cache rows) once per forward; each layer's module only projects, rotates,
caches and attends.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchllama.nn.kv_cache import KVCache
from torchllama.nn.position import apply_rotary_emb


@dataclass
class AttentionInputs:
    """What one forward call gives every attention layer (built once by the decoder).

    Attributes:
        start_pos: slot of the first new token (tokens already in the KV cache).
        freqs_cis: RoPE rotations of the new tokens, (T, rot/2) complex64 or (B, T, rot/2) for
            rows with their own positions (left padding); real (cos, sin) pairs under
            torch.compile.
        mask: (T, S) or (B, 1, T, S) bool, True where query t may attend key s; None means causal
            among the T new tokens when nothing is cached before them, or no mask for a single
            token (it may see every cached slot).
        cache_rows: KV cache rows of the B sequences (default 0..B-1).
    """

    start_pos: int
    freqs_cis: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    cache_rows: Optional[slice] = None


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Share each key/value head among n_rep query heads (grouped-query attention, Ainslie et al.
    2023): (B, KV, S, hd) → (B, KV·n_rep, S, hd), head h of the output is KV head h // n_rep.

    Meta's repeat_kv does the same on (B, S, KV, hd); we keep heads before positions, the
    layout the KV cache and SDPA use. `attend` gets the same result from SDPA's enable_gqa
    without materialising the copies; this function states the semantics (and tests use it).
    """
    if n_rep == 1:
        return x
    B, KV, S, hd = x.shape
    return (x[:, :, None, :, :]                 # (B, KV, 1, S, hd)
            .expand(B, KV, n_rep, S, hd)        # (B, KV, n_rep, S, hd), no copy yet
            .reshape(B, KV * n_rep, S, hd))     # (B, H, S, hd)


def attention_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in for input x: x's, except float32 under CPU autocast (bf16
    training): PyTorch's CPU flash attention is slower in bfloat16 than in float32 (measured
    forward + backward 18.0 vs 12.7 ms per layer of shakespeare-small), and float32 is the more
    accurate of the two."""
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.float32
    return x.dtype


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
           *, causal: bool) -> torch.Tensor:
    """softmax(q·kᵀ/√d + mask)·v with grouped-query heads, by torch's fused SDPA kernel.

    Args:
        q: (B, H, T, d) queries (contiguous: the CPU flash kernel is ~15% faster on it).
        k, v: (B, KV, S, d) keys and values; query head h uses KV head h // (H / KV) — SDPA's
            enable_gqa does what Meta's `repeat_kv` does without copying K/V H/KV times (the
            copies cost more than the attention itself during decode).
        mask: bool (T, S) or (B, 1, T, S), True = may attend; or None.
        causal: with mask None, a plain causal mask among the T queries (keys S = T).

    Returns:
        (B, H, T, d) in q's dtype. Runs with autocast off when q is float32 under CPU autocast
        (see `attention_dtype`).
    """
    fp32 = q.dtype == torch.float32 and q.device.type == "cpu" and \
        torch.is_autocast_enabled("cpu")
    if fp32:
        k, v = k.float(), v.float()
    with torch.autocast("cpu", enabled=False) if fp32 else nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    """Multi-head self-attention with grouped-query heads, RoPE and an optional KV cache.

    n_kv_heads ≤ n_heads key/value heads are shared by groups of n_heads / n_kv_heads query
    heads (Ainslie et al. 2023): n_kv_heads = n_heads is multi-head attention (Vaswani et al.
    2017), n_kv_heads = 1 multi-query attention (Shazeer 2019).

    Args:
        dim: model width.
        n_heads, n_kv_heads: query and key/value heads.
        head_dim: width of one head.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def make_cache(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                   device: torch.device) -> KVCache:
        """A KV cache for this layer: n_kv_heads keys and values of head_dim per slot."""
        return KVCache(max_batch_size, max_seq_len, self.n_kv_heads, self.head_dim,
                       self.head_dim, dtype, device)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """
        Args:
            x: (B, T, dim) normalised hidden states of the T new tokens.
            inputs: start_pos, RoPE rotations, mask and cache rows of this call.

        Returns:
            (B, T, dim).
        """
        B, T, _ = x.shape
        xq = self.wq(x).view(B, T, self.n_heads, self.head_dim)      # (B, T, H, hd)
        xk = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)   # (B, T, KV, hd)
        xv = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)   # (B, T, KV, hd)

        dtype = attention_dtype(x)
        xq = apply_rotary_emb(xq, inputs.freqs_cis, dtype)            # (B, T, H, hd)
        xk = apply_rotary_emb(xk, inputs.freqs_cis, dtype)            # (B, T, KV, hd)

        xq = xq.transpose(1, 2).contiguous()   # (B, H, T, hd); contiguous: faster CPU SDPA
        xk = xk.transpose(1, 2)                                       # (B, KV, T, hd)
        xv = xv.transpose(1, 2)                                       # (B, KV, T, hd)
        if self.kv_cache is not None:                                 # (B, KV, S, hd)
            keys, values = self.kv_cache.update(inputs.start_pos, xk, xv, inputs.cache_rows)
        else:
            keys, values = xk, xv                                     # (B, KV, T, hd), S = T
        out = attend(xq, keys, values, inputs.mask,                   # (B, H, T, hd)
                     causal=inputs.mask is None and T > 1)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H·hd)
        return self.wo(out)                                           # (B, T, D)
