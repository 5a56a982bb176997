"""The building blocks of the decoder, each written from its paper: normalization, position
encodings, attention, feed-forward blocks, the KV cache and the fused training loss.

`torchllama.model.Transformer` assembles them; nothing here knows about checkpoints, devices or
processes.
"""

from torchllama.nn.attention import Attention, AttentionInputs, attend, repeat_kv
from torchllama.nn.kv_cache import KVCache
from torchllama.nn.loss import linear_cross_entropy
from torchllama.nn.mlp import FeedForward
from torchllama.nn.norms import RMSNorm
from torchllama.nn.position import RotaryEmbedding, apply_rotary_emb, precompute_freqs_cis

__all__ = ["Attention", "AttentionInputs", "FeedForward", "KVCache", "RMSNorm",
           "RotaryEmbedding", "apply_rotary_emb", "attend", "linear_cross_entropy",
           "precompute_freqs_cis", "repeat_kv"]
