"""The decoder: token embeddings, n_layers residual blocks of attention and feed-forward, a final
norm and the output projection — assembled from the building blocks in `torchllama.nn`, one
block per architecture choice of `ModelArgs` (Llama 2's by default).

Read top to bottom. Parameter names are Meta's (meta-llama/llama, llama/model.py), so Meta
checkpoints load with strict key checking; other checkpoint formats map their names onto these
through their family's adapter (`torchllama.families`). Names the zoo adds: `pos_embeddings`
(learned positions), `position_bias` (T5), `layers.N.post_attention_norm` / `post_ffn_norm`
(sandwich), `layers.N.attention.q_norm` / `k_norm` (QK-norm), `.bias` of biased projections and
LayerNorms, and DeepSeek's `wq_a`, `q_norm`, `wq_b`, `wkv_a`, `kv_norm`, `wkv_b` for MLA.

Shape letters in comments: B batch, T new tokens in this call, S keys attended (cached + new),
H n_heads, KV n_kv_heads, hd head_dim, D dim, F hidden, V vocab.

The model holds no device, compile or process-group code: callers move it (`.to`), compile its
decode step, or shard it from outside. Everything in `forward` has static shapes given
(B, T, start_pos), and the linear layers are `nn.Linear`s (`torchllama.nn.linear.Linear`: batch-
invariant float32 products at inference) that weight-only quantization can swap later.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchllama import kernels
from torchllama.config import LayerSpec, ModelArgs
from torchllama.errors import ArgumentError, ContextLengthError
from torchllama.nn import (ALiBi, AttentionInputs, KVCache, LearnedPositions, RotaryEmbedding,
                           SinusoidalPositions, T5RelativeBias, linear_cross_entropy,
                           make_attention, make_mlp, make_norm)
from torchllama.nn.kv_cache import SlidingWindowKVCache
from torchllama.nn.linear import Linear


class TransformerBlock(nn.Module):
    """One decoder layer. With N a norm, Attn and FFN the sublayers:

        pre-norm (GPT-2, Llama; Xiong et al. 2020):  h = x + Attn(N(x));   out = h + FFN(N(h))
        post-norm (Vaswani et al. 2017):             h = N(x + Attn(x));   out = N(h + FFN(h))
        sandwich (Gemma 2/3):                        h = x + N'(Attn(N(x))); out = h + N'(FFN(N(h)))
        parallel (GPT-J, PaLM §2):                   out = x + Attn(N(x)) + FFN(N(x))
    """

    def __init__(self, layer_id: int, args: ModelArgs, spec: LayerSpec):
        super().__init__()
        self.layer_id = layer_id
        self.spec = spec
        self.placement = "parallel" if args.parallel_block else args.norm_placement
        self.attention = make_attention(args, spec)
        self.feed_forward = make_mlp(args)
        self.attention_norm = make_norm(args, args.dim)
        if self.placement != "parallel":                 # parallel: one norm feeds both
            self.ffn_norm = make_norm(args, args.dim)
        if self.placement == "sandwich":
            self.post_attention_norm = make_norm(args, args.dim)
            self.post_ffn_norm = make_norm(args, args.dim)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        # x: (B, T, D) → (B, T, D)
        fused = self.fused_layer_args(x, inputs)
        if fused is not None:        # the same kernels in one call (kernels/csrc/decoder.cpp)
            return torch.ops.torchllama.decoder_layer(x, *fused)
        if self.placement == "pre":
            h = x + self.attention(self.attention_norm(x), inputs)
            return h + self.feed_forward(self.ffn_norm(h))
        if self.placement == "sandwich":
            h = x + self.post_attention_norm(self.attention(self.attention_norm(x), inputs))
            return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))
        if self.placement == "post":
            h = self.attention_norm(x + self.attention(x, inputs))
            return self.ffn_norm(h + self.feed_forward(h))
        n = self.attention_norm(x)                                         # parallel
        return x + self.attention(n, inputs) + self.feed_forward(n)

    def fused_layer_args(self, x: torch.Tensor, inputs: AttentionInputs) -> Optional[tuple]:
        """The arguments of `torch.ops.torchllama.decoder_layer` after x when it computes this
        layer exactly as the modules do, else None: a pre-norm or sandwich layer of RMSNorms
        (Llama, Mistral, Gemma 2/3), attention with fused block-weight q/k/v (optionally
        QK-norm and soft-capping), full RoPE and a cache that can write in place; a gated FFN
        (SwiGLU or tanh GeGLU) with fused block w1/w3; no biases; float32 inference on
        torchllama's kernels. A decode step of a small model is mostly Python dispatch of
        ~40 small ops per layer; this is one call (README "Speed").

        When it returns arguments, the cache has counted the write (`KVCache.write_slots`):
        the caller must run the op."""
        weights = self._fused_weights()
        if weights is None:
            return None
        attention = self.attention
        cache, cs = attention.kv_cache, inputs.freqs_cis
        if cache is None or cache.k_cache.dtype != torch.float32 or \
                attention.capture is not None or cs is None or \
                inputs.bias is not None or not kernels.layer_ops_apply(x, weights[0][0]):
            return None
        cs = torch.view_as_real(cs) if cs.is_complex() else cs              # (…, T, hd/2, 2)
        if 2 * cs.shape[-2] != attention.head_dim:                          # partial RoPE
            return None
        rows = inputs.cache_rows
        row0 = 0 if rows is None else (rows.start or 0)
        if inputs.row_pos is not None:                   # rows at their own positions
            if type(cache) not in (KVCache, SlidingWindowKVCache):
                return None
            cache.count_row_writes(inputs.row_pos, rows)
            slots = (0, inputs.mask.shape[-1])
        else:
            slots = cache.write_slots(inputs.start_pos, x.shape[1],
                                      range(row0, row0 + x.shape[0]))
            if slots is None:
                return None
        return (*weights[:6], cache.k_cache, cache.v_cache, row0, *slots, cs, inputs.mask,
                *weights[6:], inputs.row_index, inputs.key_start)

    def _fused_weights(self) -> Optional[tuple]:
        """This layer's weights for `decoder_layer`, or None if its structure does not fit;
        remembered for the modules it was computed from."""
        attention, ffn = self.attention, self.feed_forward
        key = (getattr(attention, "wqkv", None), getattr(ffn, "w13", None))
        cached = getattr(self, "_fused_cache", None)
        if cached is None or cached[0] != key:
            self._fused_cache = cached = (key, _decoder_layer_weights(self))
        return cached[1]


def _block_weight(module: nn.Module) -> Optional[list[torch.Tensor]]:
    """[codes, d, m] of a q4 block linear, [codes, d] of a q8 one (no bias), else None: the
    module says so itself (`kernel_weight`), so the model needs no quantization code."""
    kernel_weight = getattr(module, "kernel_weight", None)
    return kernel_weight() if callable(kernel_weight) else None


def _decoder_layer_weights(block: TransformerBlock) -> Optional[tuple]:
    """(norms, wqkv, wo, w13, w2, qk_norms, n_heads, n_kv_heads, eps, scale, softcap,
    unit_offset, gelu_tanh) of a block that `decoder_layer` computes exactly, else None (see
    `fused_layer_args`)."""
    from torchllama.nn.attention import Attention
    from torchllama.nn.mlp import ACTIVATIONS, FeedForward
    from torchllama.nn.norms import RMSNorm

    attention, ffn = block.attention, block.feed_forward
    if block.placement not in ("pre", "sandwich") or type(attention) is not Attention or \
            type(ffn) is not FeedForward or not attention.rope:
        return None
    gelu_tanh = ffn.act is ACTIVATIONS["geglu_tanh"]
    names = ["attention_norm", "ffn_norm"] + \
        (["post_attention_norm", "post_ffn_norm"] if block.placement == "sandwich" else [])
    norms = [getattr(block, n) for n in names]
    qk_norms = [attention.q_norm, attention.k_norm] if hasattr(attention, "q_norm") else []
    if not (ffn.act is F.silu or gelu_tanh) or any(
            type(n) is not RMSNorm or n.unit_offset != norms[0].unit_offset or
            n.eps != norms[0].eps for n in norms + qk_norms):
        return None
    weights = [_block_weight(m) for m in (attention.wqkv, attention.wo, ffn.w13, ffn.w2)]
    if any(w is None for w in weights):
        return None
    scale = attention.scale or attention.head_dim ** -0.5
    return ([n.weight for n in norms], *weights, [n.weight for n in qk_norms],
            attention.n_heads, attention.n_kv_heads, norms[0].eps, scale,
            attention.softcap or 0.0, norms[0].unit_offset, gelu_tanh)


class Transformer(nn.Module):
    """A decoder-only language model: token embeddings (+ absolute positions), n_layers
    TransformerBlocks, a final norm (none after post-norm blocks) and the output projection to
    vocabulary logits. `ModelArgs` chooses every part; the defaults are Llama 2.

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
        if args.position == "learned":
            self.pos_embeddings = LearnedPositions(args.max_seq_len, args.dim)
        elif args.position == "sinusoidal":
            self.pos_embeddings = SinusoidalPositions(args.max_seq_len, args.dim)
        if args.position == "t5":
            self.position_bias = T5RelativeBias(args.n_heads, args.t5_buckets,
                                                args.t5_max_distance)
        elif args.position == "alibi":
            self.position_bias = ALiBi(args.n_heads)
        specs = args.layer_specs()
        self.layers = nn.ModuleList(TransformerBlock(i, args, s) for i, s in enumerate(specs))
        self.specs = list(dict.fromkeys(specs))              # the distinct kinds of layer
        self._first_layer = [specs.index(spec) for spec in self.specs]
        for layer in self.layers:
            layer.kind = self.specs.index(layer.spec)        # index into self.specs
        if args.norm_placement != "post":                    # post-norm blocks end normed
            self.norm = make_norm(args, args.dim)
        self.output = Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # RoPE rotations of every position for each kind of layer (θ and scaling), derived from
        # args: plain attributes, not parameters or buffers. rope[k] serves self.specs[k].
        self.rope = [RotaryEmbedding(args.rope_dim, args.max_seq_len, spec.rope_theta,
                                     spec.scaling) for spec in self.specs] \
            if args.position == "rope" else []
        self.caches: Optional[tuple[KVCache, ...]] = None   # one per layer, see setup_caches

    def tie_weights(self) -> None:
        """Make `output` share `tok_embeddings`' weight when args.tie_embeddings (Press & Wolf
        2017); call again after assigning loaded tensors. (A quantized model's tied table is
        shared by `torchllama.transforms.quantize` instead.)"""
        if self.args.tie_embeddings and isinstance(self.output, nn.Linear):
            self.output.weight = self.tok_embeddings.weight

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations and of the KV cache: the first floating-point parameter's
        (the embeddings', or a norm's when weight-only quantization holds the matrices)."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def residual_projections(self) -> list[nn.Linear]:
        """The linear layers whose outputs are added to the residual stream (attention output
        and feed-forward down projections): GPT-2's init scales them by 1/√(2·n_layers)."""
        return [m for block in self.layers for m in (block.attention.wo, block.feed_forward.w2)]

    # ---- KV cache ----------------------------------------------------------------------------

    def setup_caches(self, max_batch_size: Optional[int] = None,
                     max_seq_len: Optional[int] = None) -> None:
        """Allocate a KV cache in every attention layer, on the weights' device and dtype (each
        layer's kind: all slots, a sliding window's, MLA's latents). `self.caches` is then the
        tuple of them (a new tuple at every call, so a caller can tell whether the caches it
        filled are still in place).

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
        for layer in self.layers:
            layer.attention.kv_cache = layer.attention.make_cache(
                max_batch_size, max_seq_len, self.dtype, self.device)
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

    def cache_can_write_at(self, start_pos: int, row: Optional[int] = None) -> bool:
        """Whether every cache can take a write starting at start_pos in cache row `row` (default:
        in every row): rewinding a sliding-window cache further than its margin cannot; then
        start over at 0."""
        return all(cache.can_write_at(start_pos, row) for cache in self.caches or ())

    def reset_cache_rows(self, rows: slice) -> None:
        """The cache rows start new sequences from slot 0 (`KVCache.reset_rows`)."""
        for cache in self.caches or ():
            cache.reset_rows(rows)

    def read_cache_row(self, row: int, end: int) -> list:
        """A copy of cache row `row`'s slots [0, end) in every layer (a prefix cache entry; a
        sliding-window layer's ring as it is), for `write_cache_row`."""
        return [cache.read_row(row, end) for cache in self.caches or ()]

    def write_cache_row(self, row: int, state: list) -> None:
        """Put a `read_cache_row` copy into cache row `row` (any row)."""
        for cache, layer_state in zip(self.caches or (), state):
            cache.write_row(row, layer_state)

    def zero_cache_slots(self, rows: slice, start: int, end: int) -> None:
        """Zero slots [start, end) of the given cache rows in every layer (`KVCache.zero`)."""
        for cache in self.caches or ():
            cache.zero(rows, start, end)

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, start_pos: int | torch.Tensor = 0, *,
                last_only: bool = False,
                pad: Optional[torch.Tensor] = None, cache_rows: Optional[slice] = None,
                targets: Optional[torch.Tensor] = None, hidden: bool = False) -> torch.Tensor:
        """Logits of the next token after each of the given tokens, or, given targets, the
        training loss, or with hidden=True the final hidden states.

        Args:
            tokens: (B, T) int64 token ids in cache slots start_pos..start_pos+T-1.
            start_pos: number of slots already in the KV cache (0 without a cache); or, for
                rows at their own positions (the serving engine's decode step: T = 1, a KV
                cache, no pad), a (B,) int64 tensor: row b's token goes to slot start_pos[b]
                and attends to that row's slots up to it; −1 marks an idle row (nothing
                written, its logits meaningless).
            last_only: compute logits for the last position only (what generation needs after
                a prefill; saves a (T, dim)×(dim, V) matmul).
            pad: (B,) int64, for left-padded batches: the first pad[b] slots of row b hold
                padding. They are never attended, and slot s of row b is position s − pad[b],
                so each row computes exactly what it would alone. None: no padding.
            cache_rows: the KV cache rows these B sequences use (default: rows 0..B-1), e.g.
                slice(b, b + 1) to prefill one sequence into row b of a running batch.
            targets: (B, T) int64 next-token ids: return the mean cross-entropy of the logits
                against them instead of the logits, computed chunk by chunk without
                materialising the (B, T, vocab_size) logits (`torchllama.nn.loss`).
            hidden: return the hidden states after the final norm, (B, T, dim) in the model's
                dtype, without the output projection (per-token losses over long texts
                chunk by chunk, the logit lens).

        Returns:
            float32 logits (B, T, vocab_size), or (B, 1, vocab_size) with last_only; with
            targets, a float32 scalar loss (nats per token); with hidden, (B, T|1, dim).

        Raises:
            ContextLengthError: start_pos + T exceeds the context (args.max_seq_len or the
                cache's length).
            ArgumentError: start_pos > 0 without a KV cache, or B above the cache's batch size.
        """
        B, T = tokens.shape
        row_pos = self._row_positions(start_pos, B, T, pad)
        if row_pos is not None:
            start_pos = max(row_pos)                         # the furthest row's slot
        end = start_pos + T
        self._check_slots(B, start_pos, end, cache_rows)
        h = self.tok_embeddings(tokens)                      # (B, T, D)
        if self.args.embed_scale:                            # × √dim, rounded to h's dtype
            h = h * torch.tensor(self.args.dim ** 0.5, dtype=h.dtype)
        if hasattr(self, "pos_embeddings"):                  # absolute positions (T|B,T) → +D
            positions = self._positions(tokens.device, start_pos, end, pad) if row_pos is None \
                else torch.tensor(row_pos, device=tokens.device).clamp(min=0)[:, None]
            h = h + self.pos_embeddings(positions)
        if row_pos is None:
            inputs = [self._attention_inputs(k, tokens.device, start_pos, end, pad, cache_rows,
                                             B) for k in range(len(self.specs))]
        else:                                                # one per kind of layer
            inputs = [self._row_attention_inputs(k, tokens.device, row_pos, cache_rows)
                      for k in range(len(self.specs))]
        for layer in self.layers:
            h = layer(h, inputs[layer.kind])                 # (B, T, D)
        if last_only:
            h = h[:, -1:, :]                                 # (B, 1, D)
        if hasattr(self, "norm"):
            h = self.norm(h)                                 # (B, T, D)
        if hidden:
            return h
        softcap = self.args.final_logit_softcap
        if targets is not None:                              # training: fused output + loss
            weight = self.output.weight if isinstance(self.output, nn.Linear) else \
                self.output.dequantize()                     # QLoRA: (V, D) fp32, frozen
            return linear_cross_entropy(h.flatten(0, 1), weight,              # (B·T, D)
                                        targets.flatten(), softcap=softcap)   # → () fp32
        return self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output projection of final-normed hidden states h (..., dim) → float32 logits
        (..., vocab_size), soft-capped where the model says so (Gemma 2: c·tanh(logits/c))."""
        logits = self.output(h).float()                      # (..., V) fp32
        softcap = self.args.final_logit_softcap
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return logits

    def _row_positions(self, start_pos: int | torch.Tensor, B: int, T: int,
                       pad: Optional[torch.Tensor]) -> Optional[list[int]]:
        """start_pos as a list when rows are at their own positions, else None (see forward)."""
        if not isinstance(start_pos, torch.Tensor):
            return None
        row_pos = start_pos.tolist()
        if T != 1 or pad is not None or not self.caches or len(row_pos) != B or \
                max(row_pos) < 0 or min(row_pos) < -1:
            raise ArgumentError(
                f"rows at their own positions need one token each (T = 1, got {T}), a KV cache, "
                f"no pad and B = {B} positions ≥ −1, at least one ≥ 0; got {row_pos}")
        return row_pos

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

    @staticmethod
    def _positions(device: torch.device, start_pos: int, end: int,
                   pad: Optional[torch.Tensor]) -> torch.Tensor:
        """Positions of the new tokens: slots start_pos..end-1 (T,), or per row slot − pad[b]
        (B, T) for left-padded rows (padding slots get position 0)."""
        q_slot = torch.arange(start_pos, end, device=device)             # (T,)
        if pad is None:
            return q_slot
        return (q_slot[None, :] - pad[:, None]).clamp(min=0)            # (B, T)

    def _attention_inputs(self, kind: int, device: torch.device, start_pos: int, end: int,
                          pad: Optional[torch.Tensor], cache_rows: Optional[slice], B: int = 1
                          ) -> AttentionInputs:
        """RoPE rotations, mask and position bias of the new tokens in slots start_pos..end-1,
        for every layer of kind self.specs[kind]."""
        T = end - start_pos
        spec = self.specs[kind]
        rope = self.rope[kind] if self.rope else None
        cache = self.layers[self._first_layer[kind]].attention.kv_cache
        windowed = spec.window is not None and end > spec.window
        bias_module = getattr(self, "position_bias", None)
        # Plain causal attention over every slot so far (Llama's decode and prefill): nothing
        # to build but the rotations of the new positions.
        if pad is None and not windowed and bias_module is None and \
                (T == 1 or start_pos == 0) and (cache is None or cache.in_slot_order):
            freqs_cis = rope.span(start_pos, end, device) if rope else None   # (T, rot/2)
            return AttentionInputs(start_pos, freqs_cis, None, None, cache_rows)

        q_slot = torch.arange(start_pos, end, device=device)             # (T,)
        key_start = None
        if cache is not None:
            k_slot = cache.key_slots(start_pos, T, device)               # (S,)
            first = cache.key_start(start_pos, T)                        # ring: oldest index
            if first:
                key_start = torch.full((B,), first, dtype=torch.long, device=device)  # (B,)
        else:
            k_slot = torch.arange(start_pos, end, device=device)         # (S = T,)
        # query t (slot q) may attend key s iff s was written (≥ 0), s ≤ q, and, in a local
        # layer, s > q − window
        mask = (k_slot[None, :] <= q_slot[:, None]) & (k_slot[None, :] >= 0)   # (T, S)
        if spec.window is not None:
            mask &= k_slot[None, :] > q_slot[:, None] - spec.window
        freqs_cis = None
        if pad is not None:
            # Row b's first pad[b] slots hold padding: never attended. A padding query would
            # see nothing (an all -inf softmax row gives NaN): let it see itself; its output is
            # never used, since no real query attends a padding slot.
            real = k_slot[None, None, :] >= pad[:, None, None]           # (B, 1, S)
            itself = k_slot[None, None, :] == q_slot[None, :, None]      # (1, T, S)
            mask = ((mask[None] & real) | itself)[:, None]               # (B, 1, T, S)
        if rope:
            positions = self._positions(device, start_pos, end, pad)     # (T,) or (B, T)
            freqs_cis = rope(positions, end)                             # (…, T, rot/2)
        bias = None
        if bias_module is not None:                  # relative: pad-independent (q − k slots)
            bias = bias_module(q_slot, k_slot)                           # (1, H, T, S)
            bias = bias.masked_fill(~mask, float("-inf"))                # (1|B, H, T, S)
            mask = None
        return AttentionInputs(start_pos, freqs_cis, mask, bias, cache_rows, key_start)

    def _row_attention_inputs(self, kind: int, device: torch.device, row_pos: list[int],
                              cache_rows: Optional[slice]) -> AttentionInputs:
        """RoPE rotations, mask, key order and position bias of one new token per row, row b's
        at slot row_pos[b] (−1: idle), for every layer of kind self.specs[kind]: each row
        attends to its own slots up to its own, within the window of a local layer."""
        spec = self.specs[kind]
        cache = self.layers[self._first_layer[kind]].attention.kv_cache
        index, k_slot, key_start = cache.row_slots(row_pos, device)      # (B,), (B, S), (B,)
        q_slot = torch.tensor(row_pos, device=device)[:, None]           # (B, 1)
        # key s of row b may be attended iff it was written (≥ 0) and s ≤ q (and, in a local
        # layer, s > q − window); an idle row (q = −1) attends nothing
        mask = (k_slot >= 0) & (k_slot <= q_slot)                        # (B, S)
        if spec.window is not None:
            mask &= k_slot > q_slot - spec.window
        mask = mask[:, None, None, :]                                    # (B, 1, 1, S)
        freqs_cis = None
        if self.rope:
            end = max(row_pos) + 1
            freqs_cis = self.rope[kind](q_slot.clamp(min=0), end)        # (B, 1, rot/2)
        bias = None
        bias_module = getattr(self, "position_bias", None)
        if bias_module is not None:                  # relative: row by row (q − k slots)
            bias = torch.cat([bias_module(q_slot[b], k_slot[b])          # (1, H, 1, S) each
                              for b in range(len(row_pos))])             # (B, H, 1, S)
            bias = bias.masked_fill(~mask, float("-inf"))
            mask = None
        return AttentionInputs(max(row_pos), freqs_cis, mask, bias, cache_rows, key_start,
                               row_pos, index)

