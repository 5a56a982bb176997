"""The building blocks of the decoder, each written from its paper: normalization, position
encodings, attention (MHA/GQA/MQA and MLA), the attention inputs of a call (masks, rotations,
cache slots), feed-forward blocks, the KV cache and the fused training loss.

`torchllama.model.Transformer` assembles them; nothing here knows about checkpoints, devices or
processes.
"""

from torchllama.nn.attention import (Attention, MultiHeadLatentAttention, attend, make_attention,
                                     repeat_kv)
from torchllama.nn.attention_inputs import AttentionInputs, slot_positions
from torchllama.nn.kv_cache import (KV_CACHE_DTYPES, KVCache, KVCaches, SlidingWindowKVCache,
                                    check_kv_cache_dtype, kv_storage)
from torchllama.nn.loss import linear_cross_entropy
from torchllama.nn.mlp import MLP, FeedForward, make_mlp
from torchllama.nn.moe import MoE, make_feed_forward
from torchllama.nn.norms import LayerNorm, RMSNorm, make_norm
from torchllama.nn.position import (ALiBi, LearnedPositions, RotaryEmbedding, SinusoidalPositions,
                                    T5RelativeBias, alibi_slopes, apply_rotary_emb,
                                    precompute_freqs_cis, rope_inv_freq, sinusoidal_embeddings,
                                    t5_relative_position_bucket)

__all__ = ["ALiBi", "Attention", "AttentionInputs", "FeedForward", "KVCache", "KVCaches",
           "KV_CACHE_DTYPES", "check_kv_cache_dtype", "kv_storage", "LayerNorm",
           "LearnedPositions", "MLP", "MoE", "MultiHeadLatentAttention", "RMSNorm",
           "RotaryEmbedding", "SinusoidalPositions", "SlidingWindowKVCache", "T5RelativeBias",
           "alibi_slopes", "apply_rotary_emb", "attend", "linear_cross_entropy",
           "make_attention", "make_feed_forward", "make_mlp", "make_norm", "precompute_freqs_cis", "repeat_kv", "rope_inv_freq", "slot_positions",
           "sinusoidal_embeddings", "t5_relative_position_bucket"]
