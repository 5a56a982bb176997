"""Position encodings: rotary position embeddings (RoPE).

RoPE (Su et al. 2021, RoFormer) rotates each pair of a query's or key's coordinates by an angle
proportional to its position, so that the dot product q_m · k_n depends on m − n only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


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


class RotaryEmbedding(nn.Module):
    """The RoPE rotations of every position of the context, precomputed once.

    Holds `freqs_cis` (max_seq_len, head_dim/2) complex64 — a plain attribute, as in Meta's model,
    not a buffer: `model.to(torch.bfloat16)` would cast a complex buffer to real and drop the
    sines — and the same numbers as real (cos, sin) pairs for torch.compile, which has no
    complex codegen. Both follow the input's device on first use.

    Args:
        head_dim: width of the rotated part of a head.
        max_seq_len: number of positions.
        theta: RoPE base.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.freqs_cis = precompute_freqs_cis(head_dim, max_seq_len, theta)   # (S, hd/2) c64
        self.freqs_cos_sin = torch.view_as_real(self.freqs_cis).clone()       # (S, hd/2, 2)

    def table(self, device: torch.device) -> torch.Tensor:
        """freqs_cis on `device` (max_seq_len, hd/2) complex64; under torch.compile the same
        numbers as real (cos, sin) pairs (max_seq_len, hd/2, 2) float32, made once outside
        the graph."""
        if self.freqs_cis.device != device:                 # once, after model.to(device)
            self.freqs_cis = self.freqs_cis.to(device)
            self.freqs_cos_sin = self.freqs_cos_sin.to(device)
        if not torch.compiler.is_compiling():
            return self.freqs_cis
        return self.freqs_cos_sin

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotations of the given positions: (T,) → (T, hd/2) or (B, T) → (B, T, hd/2) complex64
        (or (…, hd/2, 2) real pairs under torch.compile)."""
        return self.table(positions.device)[positions]

    def span(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Rotations of positions start..end-1, a view of the table: (end − start, hd/2)."""
        return self.table(device)[start:end]
