"""Causal self-attention: multi-head with grouped-query heads (MHA / GQA / MQA) and multi-head
latent attention (MLA), with RoPE, relative biases, sliding windows and a KV cache.

Attention(Q, K, V) = softmax(Q·Kᵀ · scale + bias + mask) · V (Vaswani et al. 2017, eq. 1, with
scale 1/√d_k unless a model says otherwise).

The decoder builds the per-call inputs every layer of one kind needs once per forward
(`torchllama.nn.attention_inputs.AttentionInputs`: RoPE rotations of the new tokens, the mask,
position biases, cache rows); each layer's module only projects, rotates, caches and attends.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchllama import kernels
from torchllama.config import LayerSpec, ModelArgs
from torchllama.nn.attention_inputs import AttentionInputs
from torchllama.nn.kv_cache import KVCache, KVStorage, SlidingWindowKVCache, stored_to_float
from torchllama.nn.linear import Linear
from torchllama.nn.norms import RMSNorm, make_norm
from torchllama.nn.position import apply_rotary_emb, yarn_mscale

#: Extra slots a sliding-window cache keeps beyond its window, so that a chat turn can rewind a
#: few tokens without recomputing the conversation (see `SlidingWindowKVCache`).
WINDOW_CACHE_MARGIN = 64


# --8<-- [start:repeat-kv]
def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Share each key/value head among n_rep query heads (grouped-query attention, Ainslie et al.
    2023): (B, KV, S, hd) → (B, KV·n_rep, S, hd), head h of the output is KV head h // n_rep.

    Meta's repeat_kv does the same on (B, S, KV, hd); we keep heads before positions, the
    layout the KV cache and SDPA use. `attend` gets the same result from SDPA's enable_gqa
    without materialising the copies; this function states the semantics (and the soft-capped
    path uses it).
    """
    if n_rep == 1:
        return x
    B, KV, S, hd = x.shape
    return (x[:, :, None, :, :]                 # (B, KV, 1, S, hd)
            .expand(B, KV, n_rep, S, hd)        # (B, KV, n_rep, S, hd), no copy yet
            .reshape(B, KV * n_rep, S, hd))     # (B, H, S, hd)
# --8<-- [end:repeat-kv]


def attention_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in for input x: x's, except float32 under CPU autocast (bf16
    training): PyTorch's CPU flash attention is slower in bfloat16 than in float32 forward and
    backward (`torchllama bench train --dtype bfloat16` measures the step), and float32 is the
    more accurate of the two."""
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.float32
    return x.dtype


# --8<-- [start:attend]
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs, *,
           scale: Optional[float] = None, softcap: Optional[float] = None,
           capture: Optional[list] = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + bias + mask)·v with grouped-query heads.

    Inference in float32 on the CPU (no gradient, no autocast, no position bias) runs
    torchllama's attention kernel (`torchllama.kernels`, csrc/layers.cpp): each query's keys in
    slot order, sums in a fixed order, so a row's answer is the same bits alone, left-padded in a
    batch or chunked (what the serving engine needs for exact answers under load). Otherwise,
    without soft-capping this is torch's fused SDPA kernel: the mask (bool) or the bias (float,
    mask folded in) is its attn_mask, and enable_gqa does what Meta's `repeat_kv` does without
    copying K/V H/KV times (the copies cost more than the attention itself during decode). With
    soft-capping (Gemma 2: scores → c·tanh(scores/c) before the mask, so no fused kernel can do
    it), or when the caller captures the attention probabilities, the scores are formed
    explicitly, as transformers' eager attention does.

    Args:
        q: (B, H, T, d) queries.
        k: (B, KV, S, d) keys; v: (B, KV, S, dv) values; query head h uses KV head h // (H/KV).
            As a KV cache stores them (`torchllama.nn.kv_cache`): float32, float16, bfloat16,
            or uint8 q8_0 records (B, KV, S, d + d/8). The kernel reads them as they are (for
            q8_0 it rounds each query to int8 per 32 too, and scores by integer dot products,
            as llama.cpp does); the fallback converts them to q's dtype first.
        inputs: the mask / bias of this call (see `AttentionInputs`).
        scale: the softmax scale (default 1/√d).
        softcap: c of the attention-logit soft-capping, or None.
        capture: a list to append the attention probabilities to, (B, H, T, S) float32 (one
            row per query head, so with GQA each head of a group has its own), detached. None
            (the default) takes the fused kernel and costs nothing.

    Returns:
        (B, H, T, dv) in q's dtype. Runs with autocast off when q is float32 under CPU autocast
        (see `attention_dtype`).
    """
    T = q.shape[2]
    if capture is None and inputs.bias is None and kernels.layer_ops_apply(q, k, v):
        return torch.ops.torchllama.attention(q, k, v, inputs.mask,           # (B, H, T, dv)
                                              scale or q.shape[-1] ** -0.5, softcap or 0.0,
                                              inputs.key_start)
    q = q.contiguous()                         # the CPU flash kernel is ~15% faster on it
    fp32 = q.dtype == torch.float32 and q.device.type == "cpu" and \
        torch.is_autocast_enabled("cpu")
    k, v = stored_to_float(k, q.dtype), stored_to_float(v, q.dtype)   # (B, KV, S, d|dv)
    mask = inputs.bias if inputs.bias is not None else inputs.mask
    if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)                    # SDPA wants a float mask in q's dtype
    with torch.autocast("cpu", enabled=False) if fp32 else nullcontext():
        if softcap is None and capture is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, scale=scale,
                enable_gqa=q.shape[1] != k.shape[1])
        n_rep = q.shape[1] // k.shape[1]
        scores = q @ repeat_kv(k, n_rep).transpose(2, 3) * (scale or q.shape[-1] ** -0.5)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)               # (B, H, T, S)
        if mask is None and T > 1:                                        # causal, S = T
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores.float(), dim=-1)                     # (B, H, T, S) fp32
        if capture is not None:
            capture.append(probs.detach())
        return probs.to(q.dtype) @ repeat_kv(v, n_rep)                    # (B, H, T, dv)
# --8<-- [end:attend]


def make_kv_cache(spec: LayerSpec, max_batch_size: int, max_seq_len: int, n_heads: int,
                  k_dim: int, v_dim: int, dtype: KVStorage, device: torch.device) -> KVCache:
    """The cache a layer of this spec needs: a ring of window + margin slots for a local layer
    whose window is shorter than the context, else every slot; storing `dtype` (a float dtype
    or "q8_0", see `torchllama.nn.kv_cache`)."""
    if spec.window is not None and spec.window + WINDOW_CACHE_MARGIN < max_seq_len:
        return SlidingWindowKVCache(max_batch_size, max_seq_len, n_heads, k_dim, v_dim, dtype,
                                    device, window=spec.window, margin=WINDOW_CACHE_MARGIN)
    return KVCache(max_batch_size, max_seq_len, n_heads, k_dim, v_dim, dtype, device)


class Attention(nn.Module):
    """Multi-head self-attention with grouped-query heads, RoPE and an optional KV cache.

    n_kv_heads ≤ n_heads key/value heads are shared by groups of n_heads / n_kv_heads query
    heads (Ainslie et al. 2023): n_kv_heads = n_heads is multi-head attention (Vaswani et al.
    2017), n_kv_heads = 1 multi-query attention (Shazeer 2019). Options from `ModelArgs`:
    head_dim, biases on q/k/v (Qwen2) and on the output projection (GPT-2), QK-norm (each head's
    q and k normalized before RoPE, Dehghani et al. 2023; Gemma 3), the softmax scale, attention
    logit soft-capping (Gemma 2); the layer's `LayerSpec` gives its sliding window.

    Args:
        args: the model's hyperparameters.
        spec: this layer's spec (global/local, window).
    """

    def __init__(self, args: ModelArgs, spec: LayerSpec):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = hd = args.head_dim
        self.spec = spec
        self.scale = args.attn_scale
        self.softcap = args.attn_logit_softcap
        self.rope = args.position == "rope"
        self.wq = Linear(args.dim, args.n_heads * hd, bias=args.qkv_bias)
        self.wk = Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.wv = Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.wo = Linear(args.n_heads * hd, args.dim, bias=args.out_bias)
        #: wq, wk and wv as one product, where `torchllama.transforms.fuse.fuse_projections` made one
        self.wqkv: Optional[nn.Module] = None
        self.qk_norm_span = args.qk_norm_span
        if args.qk_norm:         # over each head's hd dims, or all heads' (H·hd, KV·hd)
            whole = args.qk_norm_span == "projection"
            self.q_norm = make_norm(args, self.n_heads * hd if whole else hd)
            self.k_norm = make_norm(args, self.n_kv_heads * hd if whole else hd)
        self.kv_cache: Optional[KVCache] = None
        #: a list to append each call's attention probabilities (B, H, T, S) to, or None (see
        #: `torchllama.anatomy.capture_attention`)
        self.capture: Optional[list] = None

    def make_cache(self, max_batch_size: int, max_seq_len: int, dtype: KVStorage,
                   device: torch.device) -> KVCache:
        """A KV cache for this layer: n_kv_heads keys and values of head_dim per slot (only the
        window's slots for a local layer), stored as `dtype` (`make_kv_cache`)."""
        return make_kv_cache(self.spec, max_batch_size, max_seq_len, self.n_kv_heads,
                             self.head_dim, self.head_dim, dtype, device)

    # --8<-- [start:attention-forward]
    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """
        Args:
            x: (B, T, dim) normalised hidden states of the T new tokens.
            inputs: start_pos, RoPE rotations, mask, bias and cache rows of this call.

        Returns:
            (B, T, dim).
        """
        B, T, _ = x.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if self.wqkv is not None:                                     # one fused product
            xq, xk, xv = self.wqkv(x).split([H * hd, KV * hd, KV * hd], dim=-1)
        else:
            xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)           # (B, T, H·hd | KV·hd)
        whole = hasattr(self, "q_norm") and self.qk_norm_span == "projection"
        if whole:                                         # QK-norm over all heads (OLMoE)
            xq, xk = self.q_norm(xq), self.k_norm(xk)                 # (B, T, H·hd | KV·hd)
        xq = xq.view(B, T, H, hd)                                     # (B, T, H, hd)
        xk = xk.view(B, T, KV, hd)                                    # (B, T, KV, hd)
        xv = xv.view(B, T, KV, hd)                                    # (B, T, KV, hd)
        if hasattr(self, "q_norm") and not whole:                     # QK-norm, before RoPE
            xq, xk = self.q_norm(xq), self.k_norm(xk)

        dtype = attention_dtype(x)
        if self.rope:
            xq = apply_rotary_emb(xq, inputs.freqs_cis, dtype)        # (B, T, H, hd)
            xk = apply_rotary_emb(xk, inputs.freqs_cis, dtype)        # (B, T, KV, hd)
        else:
            xq, xk = xq.to(dtype), xk.to(dtype)

        xq = xq.transpose(1, 2)                                       # (B, H, T, hd)
        xk = xk.transpose(1, 2)                                       # (B, KV, T, hd)
        xv = xv.transpose(1, 2)                                       # (B, KV, T, hd)
        if self.kv_cache is not None:                                 # (B, KV, S, hd)
            keys, values = inputs.cache_update(self.kv_cache, xk, xv)
        else:
            keys, values = xk, xv                                     # (B, KV, T, hd), S = T
        out = attend(xq, keys, values, inputs, scale=self.scale,      # (B, H, T, hd)
                     softcap=self.softcap, capture=self.capture)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H·hd)
        return self.wo(out)                                           # (B, T, D)
    # --8<-- [end:attention-forward]


# --8<-- [start:mla]
class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, Liu et al. 2024, §2.1; DeepSeek-V3), with
    DeepSeek's parameter names (inference/model.py `MLA`).

    Keys and values are compressed jointly into a latent c_kv of kv_lora_rank dims per token
    (eq. 9), from which each head's key part and value are re-expanded (eq. 10-11); queries are
    compressed likewise through a rank q_lora_rank (eq. 12-13). RoPE cannot pass through the
    re-expansion, so it goes on separate dims ("decoupled RoPE", eq. 14-19): each head's query
    has qk_rope_head_dim rotated dims, and all heads share one rotated key of that width.

        c_q  = RMSNorm(W_DQ·x)           q = W_UQ·c_q → per head [q_nope (dn), q_rope (dr)]
        [c_kv, k_rope] = W_DKV·x         c_kv = RMSNorm(c_kv)     (kv_lora_rank + dr)
        [k_nope, v] = W_UKV·c_kv          per head (dn + dv)
        k = [k_nope, RoPE(k_rope)] (k_rope shared by all heads), q = [q_nope, RoPE(q_rope)]
        out = W_O · softmax(q·kᵀ / √(dn + dr)) · v

    The KV cache holds only c_kv and the rotated k_rope per token: (kv_lora_rank + dr) numbers
    instead of 2·n_heads·head_dim (DeepSeek-V3: 576 vs 32,768). They are re-expanded at every
    step (the "naive" form; DeepSeek's "absorb" form folds W_UK into the query instead).
    With YaRN, DeepSeek multiplies the softmax scale by mscale(s, mscale_all_dim)².
    The latent norms use eps 1e-6, as DeepSeek's reference (and transformers) do.

    Args:
        args: the model's hyperparameters (q_lora_rank, kv_lora_rank, qk_nope_head_dim,
            qk_rope_head_dim, v_head_dim).
        spec: this layer's spec.
    """

    def __init__(self, args: ModelArgs, spec: LayerSpec):
        super().__init__()
        self.n_heads = H = args.n_heads
        self.spec = spec
        self.dn, self.dr, self.dv = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        if args.q_lora_rank:
            self.wq_a = Linear(args.dim, args.q_lora_rank, bias=False)            # W_DQ
            self.q_norm = RMSNorm(args.q_lora_rank, eps=1e-6)
            self.wq_b = Linear(args.q_lora_rank, H * (self.dn + self.dr), bias=False)     # W_UQ
        else:
            self.wq = Linear(args.dim, H * (self.dn + self.dr), bias=False)
        self.wkv_a = Linear(args.dim, args.kv_lora_rank + self.dr, bias=False)     # W_DKV
        self.kv_norm = RMSNorm(args.kv_lora_rank, eps=1e-6)
        self.wkv_b = Linear(args.kv_lora_rank, H * (self.dn + self.dv), bias=False)     # W_UKV
        self.wo = Linear(H * self.dv, args.dim, bias=args.out_bias)
        self.scale = args.attn_scale or (self.dn + self.dr) ** -0.5
        scaling = spec.scaling
        if scaling and scaling["type"] == "yarn" and scaling.get("mscale_all_dim"):
            self.scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        self.softcap = args.attn_logit_softcap
        self.kv_cache: Optional[KVCache] = None
        self.capture: Optional[list] = None        # as Attention.capture

    def make_cache(self, max_batch_size: int, max_seq_len: int, dtype: KVStorage,
                   device: torch.device) -> KVCache:
        """The latent cache: one "head" of c_kv (kv_lora_rank) as keys and the rotated shared
        k_rope (qk_rope_head_dim) as values, per slot."""
        return make_kv_cache(self.spec, max_batch_size, max_seq_len, 1, self.kv_lora_rank,
                             self.dr, dtype, device)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """x (B, T, dim) → (B, T, dim); see the class docstring."""
        B, T, _ = x.shape
        H, dn, dr, dv = self.n_heads, self.dn, self.dr, self.dv
        if hasattr(self, "wq_a"):
            q = self.wq_b(self.q_norm(self.wq_a(x)))                  # (B, T, H·(dn+dr))
        else:
            q = self.wq(x)
        q_nope, q_rope = q.view(B, T, H, dn + dr).split([dn, dr], dim=-1)  # (B, T, H, dn|dr)
        c_kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, dr], dim=-1)  # (B, T, r|dr)
        c_kv = self.kv_norm(c_kv)                                     # (B, T, r)

        dtype = attention_dtype(x)
        q_rope = apply_rotary_emb(q_rope, inputs.freqs_cis, dtype)    # (B, T, H, dr)
        k_rope = apply_rotary_emb(k_rope[:, :, None], inputs.freqs_cis, dtype)  # (B, T, 1, dr)
        c_kv, k_rope = c_kv[:, None].to(dtype), k_rope.transpose(1, 2)   # (B, 1, T, r|dr)
        if self.kv_cache is not None:                                 # (B, 1, S, r|dr)
            c_kv, k_rope = inputs.cache_update(self.kv_cache, c_kv, k_rope)
            c_kv, k_rope = stored_to_float(c_kv, dtype), stored_to_float(k_rope, dtype)
        S = c_kv.shape[2]
        kv = self.wkv_b(c_kv[:, 0].to(x.dtype)).view(B, S, H, dn + dv).transpose(1, 2)
        k_nope, v = kv.split([dn, dv], dim=-1)                        # (B, H, S, dn|dv)
        k = torch.cat([k_nope.to(dtype), k_rope.to(dtype).expand(B, H, S, dr)], dim=-1)
        q = torch.cat([q_nope.to(dtype), q_rope], dim=-1).transpose(1, 2)  # (B, H, T, dn+dr)
        out = attend(q.contiguous(), k, v.to(dtype), inputs, scale=self.scale,  # (B, H, T, dv)
                     softcap=self.softcap, capture=self.capture)
        return self.wo(out.transpose(1, 2).reshape(B, T, H * dv).to(x.dtype))  # (B, T, D)
# --8<-- [end:mla]


def make_attention(args: ModelArgs, spec: LayerSpec) -> nn.Module:
    """The attention module of one layer: `MultiHeadLatentAttention` for attention "mla", else
    `Attention`."""
    if args.attention == "mla":
        return MultiHeadLatentAttention(args, spec)
    return Attention(args, spec)
