"""Position encodings: how a decoder knows where each token is.

- RoPE (Su et al. 2021, RoFormer) rotates each pair of a query's or key's coordinates by an angle
  proportional to its position, so that q_m · k_n depends on m − n only; with the scalings that
  stretch a trained model's context (linear interpolation, NTK-aware, dynamic NTK, YaRN, Llama
  3.1's rule) and partial rotation of a head's first dims.
- Absolute embeddings added to the token embeddings: sinusoidal (Vaswani et al. 2017 §3.5) or
  learned (GPT-2).
- Relative biases added to the attention scores: T5's bucketed bias (Raffel et al. 2020 §2.1)
  and ALiBi's linear penalty (Press et al. 2022).
- NoPE: nothing at all; causal attention alone leaks position (Kazemnejad et al. 2023).

All of them work with a KV cache: positions come from the slot of each token (minus a row's
left padding), relative biases from the difference of two slots.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchllama import kernels

# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------


def rope_inv_freq(dim: int, theta: float, scaling: Optional[dict[str, Any]] = None,
                  seq_len: Optional[int] = None) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies θ_i = theta^(−2i/dim), i = 0..dim/2−1 (RoFormer eq. 15), changed
    by a context-extension scaling, and the attention factor the scaling multiplies q and k by.

    Scalings (`scaling["type"]`, factor s, original context L):
    - "linear": position interpolation (Chen et al. 2023): θ_i / s, i.e. positions m/s.
    - "ntk": NTK-aware (bloc97, 2023): base theta·s^(dim/(dim−2)), which leaves the highest
      frequency as it is and divides the lowest by s.
    - "dynamic": dynamic NTK (emozilla, 2023; transformers' `_compute_dynamic_ntk_parameters`):
      for a sequence of n > L positions, base theta·(s·n/L − (s − 1))^(dim/(dim−2)); plain RoPE
      up to L. Needs `seq_len` (n).
    - "yarn": YaRN (Peng et al. 2023, §3.2-3.4): per frequency, interpolate (θ_i/s) when its
      wavelength 2π/θ_i is long compared with L, keep it when short, with a linear ramp between
      the dims that make beta_fast (32) and beta_slow (1) rotations over L; attention factor
      0.1·ln(s) + 1 (or `attention_factor`; DeepSeek: a ratio of mscale / mscale_all_dim).
    - "llama3": Llama 3.1 (Meta's `apply_scaling`): wavelengths above L/low_freq_factor are
      divided by s, below L/high_freq_factor kept, smoothly interpolated in between.

    Args:
        dim: rotated dims per head (even).
        theta: RoPE base.
        scaling: a `ModelArgs.rope_scaling` dict, or None.
        seq_len: current sequence length (dynamic NTK only).

    Returns:
        (inv_freq (dim/2,) float32, attention factor).
    """
    # computed on the CPU, also while a model is built on the meta device
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # 2i/dim
    inv_freq = 1.0 / theta ** exponents                                     # θ_i
    if scaling is None:
        return inv_freq, 1.0
    kind, s = scaling["type"], float(scaling["factor"])
    if kind == "linear":
        return inv_freq / s, 1.0
    if kind == "ntk":
        return 1.0 / (theta * s ** (dim / (dim - 2))) ** exponents, 1.0
    if kind == "dynamic":
        L = scaling["original_max_seq_len"]
        n = max(seq_len or L, L)
        base = theta * (s * n / L - (s - 1)) ** (dim / (dim - 2))
        return 1.0 / base ** exponents, 1.0
    if kind == "llama3":
        L = scaling["original_max_seq_len"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq                                    # (dim/2,)
        smooth = (L / wavelen - low) / (high - low)                         # 0 → 1 over the band
        mid = (1 - smooth) * inv_freq / s + smooth * inv_freq
        out = torch.where(wavelen > L / low, inv_freq / s, inv_freq)        # long: /s, short: keep
        band = (wavelen >= L / high) & (wavelen <= L / low)
        return torch.where(band, mid, out), 1.0
    if kind == "yarn":
        L = scaling["original_max_seq_len"]
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            # the dim whose wavelength makes `rotations` turns over L positions (YaRN eq. 23)
            return dim * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low)
                / max(high - low, 1e-3)).clamp(0, 1)                        # 0: keep, 1: interp.
        inv_freq = inv_freq / s * ramp + inv_freq * (1 - ramp)
        return inv_freq, _yarn_attention_factor(scaling)
    raise ValueError(f"unknown RoPE scaling {kind!r}")


def yarn_mscale(s: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature √(1/t) = 0.1·mscale·ln(s) + 1 (Peng et al. 2023 eq. 22;
    DeepSeek's yarn_get_mscale), 1 when s ≤ 1."""
    return 1.0 if s <= 1 else 0.1 * mscale * math.log(s) + 1.0


def _yarn_attention_factor(scaling: dict[str, Any]) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    s = float(scaling["factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):     # DeepSeek's convention
        return yarn_mscale(s, scaling["mscale"]) / yarn_mscale(s, scaling["mscale_all_dim"])
    return yarn_mscale(s)


# --8<-- [start:rope-freqs]
def precompute_freqs_cis(head_dim: int, end: int, theta: float = 10000.0,
                         scaling: Optional[dict[str, Any]] = None) -> torch.Tensor:
    """RoPE's rotations e^{i·m·θ_i} for positions m = 0..end-1, as Meta precomputes them
    (llama/model.py, precompute_freqs_cis), with the frequencies of `rope_inv_freq`. A scaling's
    attention factor becomes the modulus of the complex numbers, so it multiplies q and k (and
    their dot products by its square), as transformers multiplies cos and sin by it. Always
    computed on the CPU in float32 (also while a model is built on the meta device).

    Args:
        head_dim: rotated dims per head (even).
        end: number of positions.
        theta: RoPE base (ModelArgs.rope_theta).
        scaling: ModelArgs.rope_scaling, or None.

    Returns:
        complex64 tensor (end, head_dim // 2): a·(cos(m·θ_i) + i·sin(m·θ_i)), a the attention
        factor (1 without scaling).
    """
    inv_freq, factor = rope_inv_freq(head_dim, theta, scaling, seq_len=end)
    positions = torch.arange(end, dtype=torch.float32, device="cpu")        # m (end,)
    angles = torch.outer(positions, inv_freq)                               # m·θ_i (end, hd/2)
    return torch.polar(torch.full_like(angles, factor), angles)             # (end, hd/2) c64
# --8<-- [end:rope-freqs]


# --8<-- [start:rope-apply]
def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor,
                     dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of every head vector by their position's angles.

    As Meta's apply_rotary_emb: view each pair as the complex number x[2i] + i·x[2i+1] and
    multiply it by e^{i·m·θ_i} (RoFormer eq. 34), i.e.
        out[2i]   = x[2i]·cos − x[2i+1]·sin
        out[2i+1] = x[2i]·sin + x[2i+1]·cos
    One complex multiplication is a single fused kernel, several times faster on CPU than the
    same formula written with real tensors. Computed in float32, returned in x's dtype. When
    freqs_cis covers fewer pairs than the head has (partial RoPE, `ModelArgs.rotary_dim`), only
    the first 2·pairs dims rotate and the rest pass through.

    Args:
        x: (B, T, n_heads, head_dim) queries or keys.
        freqs_cis: (T, rot/2) complex64 rotations of the T positions of x (a slice of
            `precompute_freqs_cis`), or (B, T, rot/2) when rows have their own positions
            (left-padded batches); or the same as float32 (cos, sin) pairs
            (`torch.view_as_real`, one more trailing dimension of 2), which torch.compile
            needs.
        dtype: dtype of the result (default: x's).

    Returns:
        Tensor of x's shape, in `dtype`.
    """
    B, T, H, hd = x.shape
    rot = 2 * freqs_cis.shape[-1 if freqs_cis.is_complex() else -2]
    if (dtype in (None, torch.float32)) and kernels.layer_ops_apply(x):
        # torchllama's kernel (csrc/layers.cpp): the same formula, one op instead of six
        cs = torch.view_as_real(freqs_cis) if freqs_cis.is_complex() else freqs_cis
        return torch.ops.torchllama.rope(x, cs)                  # (B, T, H, hd) fp32
    if rot < hd:                                                 # partial RoPE
        rotated = apply_rotary_emb(x[..., :rot], freqs_cis, dtype)
        return torch.cat([rotated, x[..., rot:].to(rotated.dtype)], dim=-1)  # (B, T, H, hd)
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
# --8<-- [end:rope-apply]


class RotaryEmbedding:
    """The RoPE rotations of the context's positions, computed once as far as they are used.

    Holds `freqs_cis` (rows, dim/2) complex64 — a plain attribute, as in Meta's model, not
    a buffer: `model.to(torch.bfloat16)` would cast a complex buffer to real and drop the sines.
    Meta precomputes every position of the context; here the table starts at `FIRST_ROWS`
    positions and doubles (up to max_seq_len) when a later one is asked for, each time
    computed whole by `precompute_freqs_cis` (the same bits as rows of the whole table): a
    128k-context model whose prompts stay short holds 4096 rows, not 33 MB of them (64 pairs).
    Under torch.compile, which has no complex codegen, the whole table as real (cos, sin)
    pairs is read instead (`for_compile`). Both follow the input's device on first use.

    Dynamic NTK changes the frequencies with the sequence length: up to the original context the
    table is plain RoPE; a call whose positions reach n > L gets rotations computed for n (as
    transformers does). Keys already in a KV cache keep the rotations they were written with,
    so cached decoding past L differs from recomputing the whole sequence — a property of the
    method, not of the cache.

    Args:
        dim: rotated dims per head.
        max_seq_len: number of positions.
        theta: RoPE base.
        scaling: ModelArgs.rope_scaling (or None).
    """

    #: Positions the table holds at first.
    FIRST_ROWS = 4096

    def __init__(self, dim: int, max_seq_len: int, theta: float,
                 scaling: Optional[dict[str, Any]] = None):
        self.dim, self.theta, self.scaling = dim, theta, scaling
        self.max_seq_len = max_seq_len
        self.dynamic = scaling is not None and scaling["type"] == "dynamic"
        self.freqs_cis = self._rows(min(max_seq_len, self.FIRST_ROWS))     # (rows, dim/2) c64
        self.freqs_cos_sin: Optional[torch.Tensor] = None           # (S, dim/2, 2) fp32

    def _rows(self, n: int) -> torch.Tensor:
        """Rotations of positions 0..n−1 (n, dim/2) complex64 (dynamic NTK: plain up to L)."""
        table_scaling = None if self.dynamic else self.scaling
        return precompute_freqs_cis(self.dim, n, self.theta, table_scaling)

    def table(self, device: torch.device, end: Optional[int] = None) -> torch.Tensor:
        """freqs_cis on `device` holding at least positions 0..end−1 (all max_seq_len of them
        by default): (rows, dim/2) complex64; under torch.compile the whole table as real
        (cos, sin) pairs (max_seq_len, dim/2, 2) float32 (`for_compile`)."""
        if torch.compiler.is_compiling():
            if self.freqs_cos_sin is None:
                self.for_compile(device)
            return self.freqs_cos_sin
        return self._grown(device, self.max_seq_len if end is None else end)

    def _grown(self, device: torch.device, end: int) -> torch.Tensor:
        """freqs_cis on `device`, grown to hold positions 0..end−1 (at most max_seq_len)."""
        want, rows = min(end, self.max_seq_len), self.freqs_cis.shape[0]
        if rows < want:
            self.freqs_cis = self._rows(min(self.max_seq_len, max(want, 2 * rows)))
        if self.freqs_cis.device != device:                 # once, after model.to(device)
            self.freqs_cis = self.freqs_cis.to(device)
        return self.freqs_cis

    def for_compile(self, device: torch.device) -> None:
        """Make the whole table as real (cos, sin) pairs on `device`, which the forward reads
        under torch.compile: made here, outside the graph (`compile_decode` calls it first)."""
        whole = self._grown(device, self.max_seq_len)                       # (S, dim/2) c64
        self.freqs_cos_sin = torch.view_as_real(whole).clone()              # (S, dim/2, 2)

    def __call__(self, positions: torch.Tensor, end: int) -> torch.Tensor:
        """Rotations of the given positions: (T,) → (T, dim/2) or (B, T) → (B, T, dim/2)
        complex64 (or real pairs under torch.compile). `end` is one past the largest position
        (dynamic NTK's sequence length)."""
        if self.dynamic and end > self.scaling["original_max_seq_len"]:
            inv_freq, _ = rope_inv_freq(self.dim, self.theta, self.scaling, seq_len=end)
            angles = positions[..., None].float() * inv_freq.to(positions.device)
            freqs = torch.polar(torch.ones_like(angles), angles)   # (…, dim/2) c64
            return torch.view_as_real(freqs) if torch.compiler.is_compiling() else freqs
        return self.table(positions.device, end)[positions]

    def span(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Rotations of positions start..end-1, (end − start, dim/2): a view of the table."""
        if self.dynamic and end > self.scaling["original_max_seq_len"]:
            return self(torch.arange(start, end, device=device), end)
        return self.table(device, end)[start:end]


# --------------------------------------------------------------------------------------------
# Absolute position embeddings
# --------------------------------------------------------------------------------------------


def sinusoidal_embeddings(n_positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Vaswani et al. 2017 §3.5: PE(pos, 2i) = sin(pos / base^(2i/dim)),
    PE(pos, 2i+1) = cos(pos / base^(2i/dim)).

    Returns:
        (n_positions, dim) float32, on the CPU.
    """
    pos = torch.arange(n_positions, dtype=torch.float64, device="cpu")[:, None]    # (P, 1)
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)  # (d/2,)
    pe = torch.zeros(n_positions, dim, dtype=torch.float64, device="cpu")
    pe[:, 0::2] = torch.sin(pos * inv)
    pe[:, 1::2] = torch.cos(pos * inv[: dim // 2])
    return pe.float()


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal position embeddings added to the token embeddings (no parameters; the
    table is a non-persistent buffer, so checkpoints do not carry it)."""

    def __init__(self, max_seq_len: int, dim: int):
        super().__init__()
        self.register_buffer("table", sinusoidal_embeddings(max_seq_len, dim), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (T,) or (B, T) int64 → (…, dim) in the table's dtype."""
        return self.table[positions]


class LearnedPositions(nn.Embedding):
    """Learned absolute position embeddings (GPT-2's wpe): one trained vector per position, added
    to the token embeddings. Positions beyond max_seq_len do not exist."""

    def __init__(self, max_seq_len: int, dim: int):
        super().__init__(max_seq_len, dim)


# --------------------------------------------------------------------------------------------
# Relative position biases
# --------------------------------------------------------------------------------------------


# --8<-- [start:alibi]
def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al. 2022 §3 and the authors' `get_slopes`): for n a power of
    two, the geometric sequence 2^(−8/n), 2^(−16/n), …, 2^(−8); otherwise the slopes of the
    closest smaller power of two 2^k, then every other slope of 2^(k+1) heads, n − 2^k of them.

    Returns:
        (n_heads,) float32.
    """
    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))          # 2^(-8/n)
        return [start * start ** i for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_2(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_2(closest) + power_of_2(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device="cpu")
# --8<-- [end:alibi]


class ALiBi(nn.Module):
    """Attention with Linear Biases (Press et al. 2022, eq. 1): head h adds −m_h·(i − j) to the
    score of query i for key j ≤ i; no position embeddings at all. A non-persistent buffer of
    slopes, no parameters."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)

    def forward(self, q_slot: torch.Tensor, k_slot: torch.Tensor) -> torch.Tensor:
        """q_slot (T,), k_slot (S,) int64 → bias (1, H, T, S) float32."""
        distance = (q_slot[:, None] - k_slot[None, :]).float()            # i − j (T, S)
        return -(self.slopes[:, None, None] * distance)[None]             # (1, H, T, S)


def t5_relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool = False,
                                num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's bucket of each relative position (key − query) (Raffel et al. 2020 §2.1; Mesh
    TensorFlow's `_relative_position_bucket`, as transformers' `T5Attention`): exact buckets for
    small distances, logarithmically wider ones up to max_distance, one bucket beyond. A decoder
    is unidirectional: only keys at or before the query (relative position ≤ 0) occur, and they
    use all num_buckets buckets.

    Args:
        relative_position: int64 tensor, key position − query position.
        bidirectional: separate buckets for keys after the query (an encoder's).

    Returns:
        int64 tensor of the same shape, values in [0, num_buckets).
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        n = relative_position.abs()
    else:
        n = (-relative_position).clamp(min=0)                 # distance back from the query
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (torch.log(n.float().clamp(min=1) / max_exact)
                         / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, n, large)


class T5RelativeBias(nn.Module):
    """T5's learned relative position bias (Raffel et al. 2020 §2.1): one scalar per (bucket of
    key − query distance, head), added to the attention scores of every layer (T5 computes it in
    the first layer and shares it).

    Args:
        n_heads: attention heads.
        num_buckets, max_distance: bucketing (T5: 32 and 128).
    """

    def __init__(self, n_heads: int, num_buckets: int = 32, max_distance: int = 128):
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.weight = nn.Parameter(torch.zeros(num_buckets, n_heads))     # (buckets, H)

    def forward(self, q_slot: torch.Tensor, k_slot: torch.Tensor) -> torch.Tensor:
        """q_slot (T,), k_slot (S,) int64 → bias (1, H, T, S) in the weight's dtype."""
        buckets = t5_relative_position_bucket(k_slot[None, :] - q_slot[:, None], False,
                                              self.num_buckets, self.max_distance)   # (T, S)
        return F.embedding(buckets, self.weight).permute(2, 0, 1)[None]   # (1, H, T, S)
