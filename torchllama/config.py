"""Model hyperparameters: the `ModelArgs` dataclass and a registry of named presets.

`ModelArgs` keeps Meta's field names (llama/model.py in meta-llama/llama) so that a Meta
``params.json`` maps onto it one to one. Fields Meta does not have are documented where they are
declared. Presets are looked up by exact name; an unknown name raises and lists the known ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from torchllama.errors import ArgumentError


@dataclass
class ModelArgs:
    """Hyperparameters of a Llama-family decoder-only transformer.

    Attributes:
        dim: model (residual stream) width, d_model.
        n_layers: number of TransformerBlocks.
        n_heads: number of query heads; head_dim = dim // n_heads.
        n_kv_heads: number of key/value heads (grouped-query attention, Ainslie et al. 2023);
            None means n_heads (multi-head attention).
        vocab_size: number of token ids (rows of tok_embeddings).
        multiple_of: the SwiGLU hidden size is rounded up to a multiple of this (Meta's rule).
        ffn_dim_multiplier: optional factor on the SwiGLU hidden size (Llama 2 70B: 1.3).
        hidden_dim: SwiGLU hidden size stated explicitly, as GGUF (`feed_forward_length`) and
            HF (`intermediate_size`) checkpoints do; None means Meta's rule (see `ffn_hidden_dim`).
        norm_eps: epsilon of RMSNorm.
        rope_theta: RoPE base frequency θ (10000 in Llama 2, 100000 in SmolLM2).
        rope_scaling: reserved for RoPE scaling schemes (Llama 3.1 `use_scaled_rope`, ...); None
            means plain RoPE, the only kind implemented now.
        max_batch_size: batch size the KV cache is allocated for.
        max_seq_len: context length: positions for which freqs_cis is precomputed and the KV
            cache has room.
        tie_embeddings: the output projection shares its weight with tok_embeddings.

    Raises:
        ArgumentError: from `__post_init__` when the fields are inconsistent (dim not divisible
            by n_heads, n_heads not divisible by n_kv_heads, odd head_dim, non-positive sizes).
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    vocab_size: int = 32000
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    hidden_dim: Optional[int] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_batch_size: int = 1
    max_seq_len: int = 2048
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
                     "max_batch_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ArgumentError(f"ModelArgs.{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ArgumentError(
                f"ModelArgs.n_heads ({self.n_heads}) must divide dim ({self.dim})")
        if self.n_heads % self.n_kv_heads:
            raise ArgumentError(
                f"ModelArgs.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ArgumentError(
                f"head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")
        if self.norm_eps <= 0:
            raise ArgumentError(f"ModelArgs.norm_eps must be > 0, got {self.norm_eps}")
        if self.rope_theta <= 0:
            raise ArgumentError(f"ModelArgs.rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            raise ArgumentError(
                f"ModelArgs.rope_scaling={self.rope_scaling!r} is not supported yet "
                "(only plain RoPE: rope_scaling=None)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: dim // n_heads."""
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size.

        `hidden_dim` when given; otherwise Meta's rule (llama/model.py, FeedForward.__init__):
        hidden = 4·dim, hidden = int(2·hidden/3) (so SwiGLU's three matrices cost what a
        4·dim two-matrix MLP costs, Shazeer 2020), hidden = int(ffn_dim_multiplier·hidden) if
        given, then rounded up to a multiple of multiple_of.
        """
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = 4 * self.dim
        hidden = int(2 * hidden / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def replace(self, **changes) -> "ModelArgs":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# Named presets. Sources: Meta's params.json of each Llama 2 release; TinyLlama-1.1B and
# SmolLM2 config.json (their hidden sizes follow Meta's rule, so only dims are given).
PRESETS: dict[str, ModelArgs] = {
    "llama2-7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, max_seq_len=4096),
    "llama2-13b": ModelArgs(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, max_seq_len=4096),
    "llama2-70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                            multiple_of=4096, ffn_dim_multiplier=1.3, max_seq_len=4096),
    "tinyllama-1.1b": ModelArgs(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000,
                                max_seq_len=2048),
    "smollm2-135m": ModelArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152,
                              rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True),
    "smollm2-360m": ModelArgs(dim=960, n_layers=32, n_heads=15, n_kv_heads=5, vocab_size=49152,
                              rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True),
    # Small models to train from scratch on a laptop CPU (`make train-demo`), ~ a few million
    # parameters, for a SentencePiece vocabulary of 4096 tokens (`torchllama train-tokenizer`).
    "shakespeare-small": ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=4096,
                                   multiple_of=32, max_seq_len=256, tie_embeddings=True),
    # A tiny model for tests and for reading the code in a debugger.
    "debug": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                       multiple_of=16, max_seq_len=128),
}


def get_preset(name: str) -> ModelArgs:
    """The `ModelArgs` of a named preset (a fresh copy).

    Raises:
        ArgumentError: unknown name; the message lists the known presets.
    """
    if name not in PRESETS:
        raise ArgumentError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name])
