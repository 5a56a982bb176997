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

The model holds no device, compile, process-group or fast-path code: callers move it (`.to`),
compile its decode step, or shard it from outside, and the transforms (`torchllama.transforms`)
change it from outside too: weight-only quantization swaps its linear layers, LoRA wraps them,
and `transforms.fuse` runs a whole block as one C++ op where its structure allows — always
computing what the readable forward below computes (tests prove it bit for bit). Everything in
`forward` has static shapes given (B, T, start_pos).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from torchllama.config import LayerSpec, ModelArgs
from torchllama.errors import ArgumentError, ContextLengthError
from torchllama.nn import (ALiBi, AttentionInputs, KVCaches, LearnedPositions, RotaryEmbedding,
                           SinusoidalPositions, T5RelativeBias, kv_storage,
                           linear_cross_entropy, make_attention, make_feed_forward, make_norm,
                           slot_positions)
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
        self.feed_forward = make_feed_forward(args, layer_id)   # dense MLP or experts
        self.attention_norm = make_norm(args, args.dim)
        if self.placement != "parallel":                 # parallel: one norm feeds both
            self.ffn_norm = make_norm(args, args.dim)
        if self.placement == "sandwich":
            self.post_attention_norm = make_norm(args, args.dim)
            self.post_ffn_norm = make_norm(args, args.dim)

    # --8<-- [start:block]
    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        # x: (B, T, D) → (B, T, D)
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
    # --8<-- [end:block]


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
        self.caches: Optional[KVCaches] = None               # one per layer, see setup_caches
        #: what `setup_caches` stores by default: one of `torchllama.nn.KV_CACHE_DTYPES`
        #: ("auto": float16 when the linear layers are quantized, else the model's dtype)
        self.kv_cache_dtype = "auto"

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
        and feed-forward down projections; a mixture of experts' every expert's and shared
        expert's): GPT-2's init scales them by 1/√(2·n_layers)."""
        out = []
        for block in self.layers:
            ffn = block.feed_forward
            experts = list(getattr(ffn, "experts", ())) + \
                [s for s in [getattr(ffn, "shared_experts", None)] if s is not None]
            out += [block.attention.wo] + [e.w2 for e in experts or [ffn]]
        return out

    # ---- KV cache ----------------------------------------------------------------------------

    def weights_quantized(self) -> bool:
        """Whether a layer holds weight-only quantized weights (a module that can `dequantize`
        itself: `torchllama.transforms.quantize`'s linears and embeddings)."""
        return any(not isinstance(m, nn.Linear) and callable(getattr(m, "dequantize", None))
                   for m in self.modules())

    def setup_caches(self, max_batch_size: Optional[int] = None,
                     max_seq_len: Optional[int] = None,
                     kv_cache_dtype: Optional[str] = None) -> None:
        """Allocate a KV cache in every attention layer, on the weights' device (each layer's
        kind: all slots, a sliding window's, MLA's latents). `self.caches` is then a `KVCaches`
        of them, with the operations on cache rows (a new one at every call, so a caller can
        tell whether the caches it filled are still in place).

        Args:
            max_batch_size: rows of the cache (default args.max_batch_size).
            max_seq_len: slots per row (default and maximum: args.max_seq_len).
            kv_cache_dtype: what a slot stores: auto, float32, float16, bfloat16 or q8_0
                (`torchllama.nn.kv_cache`; default: `self.kv_cache_dtype`).

        Raises:
            ArgumentError: max_seq_len beyond args.max_seq_len, a non-positive size, an
                unknown kv_cache_dtype, or q8_0 for heads not a multiple of 32 wide.
        """
        max_batch_size = self.args.max_batch_size if max_batch_size is None else max_batch_size
        max_seq_len = self.args.max_seq_len if max_seq_len is None else max_seq_len
        if max_batch_size < 1 or not 1 <= max_seq_len <= self.args.max_seq_len:
            raise ArgumentError(
                f"setup_caches: need max_batch_size ≥ 1 and 1 ≤ max_seq_len ≤ "
                f"{self.args.max_seq_len}, got {max_batch_size}, {max_seq_len}")
        storage = self.kv_cache_storage(kv_cache_dtype)
        self.use_caches(KVCaches([layer.attention.make_cache(max_batch_size, max_seq_len,
                                                             storage, self.device)
                                  for layer in self.layers]))

    def kv_cache_storage(self, kv_cache_dtype: Optional[str] = None):
        """What `setup_caches(…, kv_cache_dtype)` stores: a torch dtype or "q8_0"
        (`torchllama.nn.kv_cache.kv_storage`; default: `self.kv_cache_dtype`)."""
        return kv_storage(kv_cache_dtype or self.kv_cache_dtype, self.dtype,
                          self.weights_quantized())

    def use_caches(self, caches: Optional[KVCaches]) -> None:
        """Give every attention layer its cache of `caches` (from `setup_caches`, e.g. put back
        after a scratch cache), or none (None: forward goes back to uncached attention)."""
        for i, layer in enumerate(self.layers):
            layer.attention.kv_cache = None if caches is None else caches[i]
        self.caches = caches

    def clear_caches(self) -> None:
        """Drop the KV caches (frees their memory; forward goes back to uncached attention)."""
        self.use_caches(None)

    # ---- forward -----------------------------------------------------------------------------

    # --8<-- [start:forward]
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
        h = self._embed(tokens, start_pos, end, pad, row_pos)             # (B, T, D)
        inputs = self._attention_inputs(tokens.device, B, start_pos, end, pad, cache_rows,
                                        row_pos)             # one per kind of layer
        for layer in self.layers:
            h = layer(h, inputs[layer.kind])                 # (B, T, D)
        if last_only:
            h = h[:, -1:, :]                                 # (B, 1, D)
        if hasattr(self, "norm"):
            h = self.norm(h)                                 # (B, T, D)
        if hidden:
            return h
        if targets is not None:                              # training: fused output + loss
            return self.loss(h, targets)
        return self.logits(h)
    # --8<-- [end:forward]

    # --8<-- [start:logits]
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output projection of final-normed hidden states h (..., dim) → float32 logits
        (..., vocab_size), soft-capped where the model says so (Gemma 2: c·tanh(logits/c))."""
        logits = self.output(h).float()                      # (..., V) fp32
        softcap = self.args.final_logit_softcap
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return logits
    # --8<-- [end:logits]

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the logits of final-normed h (B, T, dim) against targets (B, T)
        int64 (−100: ignored), without materialising the (B·T, V) logits (`linear_cross_entropy`)
        → () float32, nats per token."""
        weight = self.output.weight if isinstance(self.output, nn.Linear) else \
            self.output.dequantize()                         # QLoRA: (V, D) fp32, frozen
        return linear_cross_entropy(h.flatten(0, 1), weight,                  # (B·T, D)
                                    targets.flatten(), softcap=self.args.final_logit_softcap)

    # --8<-- [start:embed]
    def _embed(self, tokens: torch.Tensor, start_pos: int, end: int,
               pad: Optional[torch.Tensor], row_pos: Optional[list[int]]) -> torch.Tensor:
        """Token embeddings (B, T) → (B, T, D), scaled by √dim (Gemma) and plus absolute
        position embeddings where the model has them."""
        h = self.tok_embeddings(tokens)                      # (B, T, D)
        if self.args.embed_scale:                            # × √dim, rounded to h's dtype
            h = h * torch.tensor(self.args.dim ** 0.5, dtype=h.dtype)
        if hasattr(self, "pos_embeddings"):                  # absolute positions (T|B,T) → +D
            positions = slot_positions(tokens.device, start_pos, end, pad) if row_pos is None \
                else torch.tensor(row_pos, device=tokens.device).clamp(min=0)[:, None]
            h = h + self.pos_embeddings(positions)
        return h
    # --8<-- [end:embed]

    def _attention_inputs(self, device: torch.device, B: int, start_pos: int, end: int,
                          pad: Optional[torch.Tensor], cache_rows: Optional[slice],
                          row_pos: Optional[list[int]]) -> list[AttentionInputs]:
        """The attention inputs of this call for each kind of layer (self.specs[k]): its RoPE
        rotations, its cache (the kind's first layer's), the relative position bias."""
        inputs = []
        for k, spec in enumerate(self.specs):
            kind = (spec, self.rope[k] if self.rope else None,
                    self.layers[self._first_layer[k]].attention.kv_cache,
                    getattr(self, "position_bias", None), device)
            inputs.append(AttentionInputs.for_slots(*kind, start_pos, end, B, pad, cache_rows)
                          if row_pos is None else
                          AttentionInputs.for_rows(*kind, row_pos, cache_rows))
        return inputs

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
        if self.caches is None:
            if start_pos != 0:
                raise ArgumentError("start_pos > 0 needs a KV cache: call setup_caches() first")
            max_len = self.args.max_seq_len
        else:
            rows, max_len = self.caches.shape
            first = (cache_rows.start or 0) if cache_rows is not None else 0
            if first + B > rows:
                raise ArgumentError(f"batch size {B} exceeds the KV cache's {rows}")
        if end > max_len:
            raise ContextLengthError(
                f"positions {start_pos}..{end - 1} exceed the context of {max_len} tokens")


def parameter_counts(args: ModelArgs) -> tuple[int, int]:
    """(total, active per token) parameters of a model with these args, counted on the meta
    device (nothing allocated). Active leaves out the routed experts a token is not sent to:
    per MoE layer (n_experts − n_experts_per_token) × 3·dim·expert_hidden_dim (a dense
    model: total = active)."""
    with torch.device("meta"):
        total = sum(p.numel() for p in Transformer(args).parameters())
    moe_layers = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    idle = moe_layers * (args.n_experts - args.n_experts_per_token) * 3 * args.dim * \
        args.expert_hidden_dim
    return total, total - idle if args.n_experts else total
