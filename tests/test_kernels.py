"""torchllama's block kernels (torchllama/kernels) against independent oracles: the `gguf`
library's dequantization with a float64 matmul (within the bound of int8 activation rounding),
NumPy integer arithmetic (bit for bit), and themselves at other batch sizes and instruction
sets (bit for bit)."""

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from torchllama import kernels
from torchllama import blocks as block_types
from torchllama.checkpoint.gguf import _quantized, read_blocks
from torchllama.errors import ModelFileError
from torchllama.blocks.forms import Q4Blocks, Q8Blocks
from torchllama.blocks.linear import Q4Linear, Q8Linear
from torchllama.blocks.packing import pack_rows, unpack_rows
from torchllama.transforms.quantize import quantized_embedding, quantized_linear

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"kernels unavailable: {kernels.unavailable_reason()}")
#: Every type of the registry (torchllama.blocks): a new row is tested by every test below.
FORMATS = sorted(block_types.TYPES, key=lambda t: t.value)


def gguf_tensor(raw: np.ndarray, typ, name="blk.0.attn_q.weight"):
    """A stand-in for a GGUFReader tensor: (N, bytes per row) uint8 data of type typ."""
    block, size = gguf.GGML_QUANT_SIZES[typ]
    K = raw.shape[1] // size * block
    return types.SimpleNamespace(name=name, tensor_type=typ, shape=[K, raw.shape[0]], data=raw)


def random_blocks(typ, N: int, K: int, seed: int = 0) -> np.ndarray:
    """(N, bytes) raw GGUF data: quantized by the gguf library where it can (Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0), else random bytes (every code pattern occurs) with sane f16 scales: d
    ~U(1e-3, 2e-2), dmin = d / 2, in the fields the type's block names (torchllama.blocks)."""
    rng = np.random.default_rng(seed)
    if typ in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        w = (rng.standard_normal((N, K)) * rng.uniform(0.01, 1, (N, 1))).astype(np.float32)
        w[1] += 3.0                                                   # an all-positive row
        return gguf.quants.quantize(w, typ)
    kind = block_types.block_type(typ)
    raw = rng.integers(0, 256, (N, K // kind.weights * kind.block.itemsize), dtype=np.uint8)
    b = raw.view(kind.block)                                          # (N, blocks)
    scale = rng.uniform(1e-3, 2e-2, b.shape).astype(np.float16)
    b["d"] = scale
    if "dmin" in kind.block.names:
        b["dmin"] = scale / 2
    return raw


def activation_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|y − x·wᵀ| allowed by int8 activations: each x is off by at most d_x / 2, so a row's
    error is ≤ Σ_b d_x,b / 2 · Σ_{k∈b} |w_k|; plus float32 accumulation (1e-5 relative)."""
    M, K = x.shape
    d_x = np.abs(x.reshape(M, K // 32, 32)).max(-1) / 127                 # (M, K/32)
    w_abs = np.abs(w).reshape(w.shape[0], K // 32, 32).sum(-1)            # (N, K/32)
    return (d_x / 2) @ w_abs.T + 1e-5 * np.abs(x) @ np.abs(w).T + 1e-30


def linear_for(blocks) -> torch.nn.Module:
    return Q4Linear(blocks) if isinstance(blocks, Q4Blocks) else Q8Linear(blocks)


@pytest.mark.parametrize("typ", FORMATS, ids=lambda t: t.name)
def test_blocks_read_exactly_what_gguf_dequantizes(typ):
    raw = random_blocks(typ, 8, 512)
    blocks = read_blocks(gguf_tensor(raw, typ), "test.gguf")
    assert isinstance(blocks, Q4Blocks if block_types.block_type(typ).form == "q4" else Q8Blocks)
    # bit for bit: the same float32 operations as gguf.quants (d·q + m, with m = −dmin·mn)
    np.testing.assert_array_equal(blocks.dequantize().numpy(), gguf.quants.dequantize(raw, typ))


@pytest.mark.parametrize("typ", FORMATS, ids=lambda t: t.name)
def test_loader_conversion_on_the_kernels_is_numpys_bit_for_bit(typ, monkeypatch):
    """`convert_blocks` on gguf_blocks.cpp writes every array (codes, d, m and the K-quants'
    factors) as the numpy functions do, and counts the same non-finite scales (inf, NaN in d,
    and in Q4_K's dmin)."""
    raw = random_blocks(typ, 24, 512, seed=3)
    kind = block_types.block_type(typ)
    b = raw.view(kind.block)                                            # (rows, blocks)
    field = "dmin" if "dmin" in kind.block.names else "d"
    for row, value in ((5, np.inf), (9, np.nan), (17, -np.inf)):
        b[field][row, 1] = value
    ours = kind.arrays(24, 512)
    n = block_types.convert_blocks(b, typ, ours)
    monkeypatch.setattr(kernels, "available", lambda: False)
    numpys = kind.arrays(24, 512)
    assert n == block_types.convert_blocks(b, typ, numpys) > 0
    for x, y in zip(ours, numpys):
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("typ", FORMATS, ids=lambda t: t.name)
def test_kernel_equals_float64_matmul_within_activation_rounding(typ):
    N, K = 40, 768
    raw = random_blocks(typ, N, K, seed=3)
    w = gguf.quants.dequantize(raw, typ).astype(np.float64)               # (N, K) oracle
    x = np.random.default_rng(4).standard_normal((5, K)).astype(np.float32)
    x[2, :32] = 0.0                                                        # a zero block
    y = linear_for(read_blocks(gguf_tensor(raw, typ), "t"))(torch.from_numpy(x)).numpy()
    reference = x.astype(np.float64) @ w.T
    err = np.abs(y - reference)
    assert (err <= activation_bound(x.astype(np.float64), w)).all(), err.max()
    assert np.abs(reference).max() > 1                                     # not a vacuous test


def test_quantized_activations_equal_the_numpy_reference():
    x = np.random.default_rng(5).standard_normal((3, 96)).astype(np.float32) * 3
    x[1, 32:64] = 0.0
    q, d, s = (t.numpy() for t in torch.ops.torchllama.quantize_act(torch.from_numpy(x)))
    blocks = x.reshape(3, 3, 32)
    d_ref = np.abs(blocks).max(-1) / np.float32(127)                       # float32 division
    inv = np.where(d_ref != 0, np.float32(1) / np.where(d_ref != 0, d_ref, 1), 0).astype(np.float32)
    q_ref = np.rint(blocks * inv[..., None]).astype(np.int8)               # half to even
    np.testing.assert_array_equal(q.reshape(3, 3, 32), q_ref)
    np.testing.assert_array_equal(d, d_ref)
    np.testing.assert_array_equal(s, d_ref * q_ref.astype(np.int32).sum(-1).astype(np.float32))


@pytest.mark.parametrize("kind", ["q4", "q8", "q8-16", "q8-16-small", "q8-16-six", "q8-six"])
def test_integer_dot_products_are_exact(kind):
    """With unit scales and integer activations whose block maxima are 127 (so d_x = 1 and
    q_x = x), the kernel's output is the integer matmul, which NumPy computes in int64: decode
    rows (M ≤ 3) and prefill tiles. "six": codes in [−32, 31] (Q6_K's; Q5_0's [−16, 15]) kept
    in 6 bits."""
    rng = np.random.default_rng(6)
    N, K, M = 24, 224, 6                     # 7 blocks: the pairs of blocks and a lone last one
    x = rng.integers(-127, 128, (M, K)).astype(np.float32)
    x.reshape(M, K // 32, 32)[..., 0] = 127                                # d_x = 1 everywhere
    if kind == "q4":
        q = rng.integers(0, 16, (N, K))
        q[0], q[1] = 15, 0                                                 # max and min codes
        ones = torch.ones(N, K // 32)
        blocks = Q4Blocks.from_values(torch.from_numpy(q), ones, torch.zeros(N, K // 32))
    else:
        B = 32 if kind in ("q8", "q8-six") else 16
        lo, hi = {"q8-16-small": (-32, 32), "q8-16-six": (-32, 31), "q8-six": (-16, 15)}.get(
            kind, (-128, 127))                              # small: int16 sums run longer
        q = rng.integers(lo, hi + 1, (N, K))
        q[0], q[1] = hi, lo
        blocks = Q8Blocks(torch.from_numpy(q.astype(np.int8)), torch.ones(N, K // B))
    linear = linear_for(blocks)
    assert kind == "q4" or bool(linear.small) == kind.endswith(("small", "six"))
    if kind != "q4":
        assert linear.codes.shape[-1] == (192 if kind.endswith("six") else 256)
    expected = (x.astype(np.int64) @ q.T).astype(np.float32)
    for rows in (slice(0, 1), slice(1, 4), slice(0, M)):
        np.testing.assert_array_equal(linear(torch.from_numpy(x[rows])).numpy(), expected[rows])


def test_six_bit_codes_pack_and_read_back():
    """Codes in [−32, 31] are kept in 6 bits: the op's one-pass packing equals the readable
    `pack_six(pack_rows(…))` (rows padded to a group of 8 included), reads back exactly (every
    row, or a tied embedding's rows), and a code outside the range is refused."""
    from torchllama.blocks.packing import pack_six, unpack_codes, unpack_six

    g = torch.Generator().manual_seed(12)
    for N in (13, 64):
        codes = torch.randint(-32, 32, (N, 96), generator=g, dtype=torch.int8)
        codes[0, :2] = torch.tensor([-32, 31])
        packed = torch.ops.torchllama.pack_six(codes)
        assert packed.shape == ((N + 7) // 8, 3, 192)
        assert torch.equal(packed, pack_six(pack_rows(codes, 3, 4)))
        assert torch.equal(unpack_six(packed), pack_rows(codes, 3, 4))
        assert torch.equal(unpack_codes(packed, N), codes)
        rows = torch.tensor([N - 1, 0, 5, 5])
        assert torch.equal(unpack_codes(packed, rows), codes[rows])
    six = Q8Linear(Q8Blocks(codes, torch.ones(64, 3)))
    with pytest.raises(RuntimeError, match="6- and 2-bit codes are small"):    # the flag must agree
        torch.ops.torchllama.q8_linear(torch.randn(1, 96), six.codes, six.d,
                                       torch.tensor(False))
    with pytest.raises(RuntimeError, match=r"lie in \[-32, 31\], got \[0, 32\]"):
        bad = torch.zeros(16, 32, dtype=torch.int8)
        bad[9, 3] = 32
        torch.ops.torchllama.pack_six(bad)


def test_two_bit_codes_pack_and_read_back():
    """Codes in [0, 3] (Q2_K's) are kept in 2 bits: each chunk's codes at the bits
    `two_to_eight` reads them from, read back exactly (every row, or a tied embedding's rows),
    and the products of 2-bit and 8-bit storage of the same codes are the same bits."""
    from torchllama.blocks.packing import pack_two, unpack_codes, unpack_two

    g = torch.Generator().manual_seed(13)
    codes = torch.randint(0, 4, (13, 96), generator=g, dtype=torch.int8)
    packed = pack_two(pack_rows(codes, 3, 4))
    assert packed.shape == (2, 3, 64) and packed.dtype == torch.int8
    eight = pack_rows(codes, 3, 4)                                          # (2, 3, 256)
    u = packed.view(torch.uint8)
    c, lane = 5, 7                                          # chunk 5 = 4·1 + 2·0 + 1: bits 6, 7
    assert torch.equal(((u[..., lane] >> 6) & 3).to(torch.int8), eight[..., 32 * c + lane])
    assert torch.equal(unpack_two(packed), eight)
    assert torch.equal(unpack_codes(packed, 13), codes)
    rows = torch.tensor([12, 0, 5, 5])
    assert torch.equal(unpack_codes(packed, rows), codes[rows])
    x = torch.randn(5, 96, generator=g)
    d = torch.rand(13, 3, generator=g)
    two = Q8Linear(Q8Blocks(codes, d))
    assert two.codes.shape[-1] == 64
    for M in (1, 5):
        y = torch.ops.torchllama.q8_linear(x[:M], two.codes, two.d, two.small)
        y8 = torch.ops.torchllama.q8_linear(x[:M], eight.contiguous(), two.d, two.small)
        assert torch.equal(y, y8)


@pytest.mark.parametrize("typ", FORMATS, ids=lambda t: t.name)
def test_rows_are_batch_invariant(typ):
    """Each output row is the same bits whether it is computed alone, in a batch of M rows
    (M = 1..64: every tile shape and remainder; 255–300: across the prefill's chunk of 256 rows,
    blocks_impl.h's MC) or in chunks (chunked prefill)."""
    raw = random_blocks(typ, 72, 256, seed=7)       # 9 groups: 4-group tiles and singles
    linear = linear_for(read_blocks(gguf_tensor(raw, typ), "t"))
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([linear(x[i:i + 1]) for i in range(300)])
    for M in list(range(1, 65)) + [255, 256, 257, 300]:
        assert torch.equal(linear(x[:M]), alone[:M]), M
    chunks = torch.cat([linear(c) for c in x.split([5, 17, 1, 41, 236])])
    assert torch.equal(chunks, alone)


@pytest.mark.parametrize("kind", ["q4", "q8", "q8-16"])
def test_an_odd_number_of_blocks_is_batch_invariant(kind):
    """Rows of 7 blocks (three pairs and a lone last block, see the lane map in
    blocks_impl.h): the same bits alone and in every tile shape."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(20, 224, generator=g)
    if kind == "q4":
        blocks = Q4Blocks.from_float(w)
    elif kind == "q8":
        blocks = Q8Blocks.from_float(w)
    else:                                                   # Q6_K-like: a scale per 16
        d = w.view(20, 14, 16).abs().amax(-1) / 127                             # (N, K/16)
        q = torch.round(w.view(20, 14, 16) / d[..., None]).view(20, 224).to(torch.int8)
        blocks = Q8Blocks(q, d)
    linear = linear_for(blocks)
    x = torch.randn(13, 224, generator=g)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(13)])
    for M in range(1, 14):
        assert torch.equal(linear(x[:M]), alone[:M]), M
    # within the int8 activation rounding (a block left out would be off by ~5)
    torch.testing.assert_close(alone.double(), x.double() @ blocks.dequantize().double().T,
                               rtol=0, atol=0.5)


ISA_SCRIPT = """
import sys, torch, numpy as np
from torchllama import kernels
from torchllama.blocks.forms import Q4Blocks, Q8Blocks
from torchllama.blocks.linear import Q4Linear, Q8Linear
from torchllama.transforms.quantize import quantized_linear
assert kernels.available()
g = torch.Generator().manual_seed(0)
x = torch.randn(7, 256, generator=g)
q4 = Q4Blocks.from_float(torch.randn(20, 256, generator=g))
q8 = Q8Blocks(torch.randint(-128, 128, (20, 256), generator=g, dtype=torch.int8),
              torch.rand(20, 16, generator=g))
half = Q8Blocks(q8.codes, torch.rand(20, 8, generator=g).half().float())   # kept as float16
assert Q8Linear(half).d.dtype == torch.float16 and Q8Linear(q8).d.dtype == torch.float32
small = Q8Blocks(torch.randint(-32, 33, (20, 256), generator=g, dtype=torch.int8),
                 torch.rand(20, 16, generator=g))                       # Q6_K-like codes
assert bool(Q8Linear(small).small) and not bool(Q8Linear(q8).small)
six = Q8Blocks(torch.randint(-32, 32, (20, 256), generator=g, dtype=torch.int8),
               torch.rand(20, 16, generator=g))                         # 6-bit codes (Q6_K)
five = Q8Blocks(torch.randint(-16, 16, (20, 256), generator=g, dtype=torch.int8),
                torch.rand(20, 8, generator=g).half().float())          # (Q5_0)
assert Q8Linear(six).codes.shape[-1] == Q8Linear(five).codes.shape[-1] == 192
y = torch.cat([Q4Linear(q4)(x), Q8Linear(q8)(x), Q8Linear(half)(x), Q8Linear(small)(x)] +
              [Q8Linear(w)(x[:m]).ravel()[None].expand(7, -1)        # decode rows too
               for w in (six, five, q8, small) for m in (1, 3, 7)], 1)
from torchllama.blocks.forms import ScaleFactors                         # the scale forms:
sup = lambda sign: (sign * torch.rand(20, 1, generator=g) * 0.01).half()
sub = lambda n, lo, hi, t: torch.randint(lo, hi, (20, n), generator=g, dtype=t)
fd, fm = ScaleFactors(sup(1), sub(8, 0, 64, torch.uint8)), ScaleFactors(sup(-1), sub(8, 0, 64, torch.uint8))
f6 = ScaleFactors(sup(1), sub(16, -128, 128, torch.int8))
d0 = torch.rand(20, 8, generator=g).half().float()
forms = [Q4Linear(Q4Blocks(q4.codes, fd.values(), fm.values(), fd, fm)),   # Q4_K super-blocks
         Q4Linear(Q4Blocks(q4.codes, d0, -8 * d0)),                         # Q4_0: m = -8 d
         Q8Linear(Q8Blocks(small.codes, f6.values(), f6))]                  # Q6_K super-blocks
assert [f.d.dtype for f in forms] == [torch.uint8, torch.float16, torch.int8] and forms[1].m.dim() == 0
y = torch.cat([y] + [f(x) for f in forms], 1)
wide = torch.randn(72, 256, generator=g)                 # 9 row groups: two 4-group decode
d9 = torch.rand(72, 8, generator=g).half().float()       # tiles (VNNI's pairs) and a lone one
wides = [Q4Linear(Q4Blocks.from_float(wide)), Q4Linear(Q4Blocks(q4.codes.repeat(4, 1)[:72], d9,
                                                                 -8 * d9))]
y = torch.cat([y] + [f(x[:m]).ravel()[None].expand(7, -1)
                     for f in wides for m in (1, 2, 3, 7)], 1)
x7 = torch.randn(9, 224, generator=g)                       # 7 blocks: a lone last block
q7 = Q4Linear(Q4Blocks.from_float(torch.randn(12, 224, generator=g)))
y7 = torch.cat([q7(x7), Q8Linear(Q8Blocks.from_float(torch.randn(12, 224, generator=g)))(x7)], 1)
y7 = torch.cat([y7.ravel(), q7(x7[:1]).ravel()])  # one row: VNNI's group-by-group decode
from torchllama import blocks                          # every registered type's kernel form:
rng = np.random.default_rng(5)                         # 5-bit Q4 codes, 4-bit Q8 indices, …
xt = torch.randn(11, 768, generator=g)                 # 72 rows, 9 groups: a thread's 4-group
for kind in sorted(blocks.TYPES.values(), key=lambda t: t.ggml.value):   # tiles (decode and
    for K in (768, 224) if kind.weights == 32 else (768,):               # prefill) and a lone
        raw = rng.integers(0, 256, (72, K // kind.weights * kind.block.itemsize), dtype=np.uint8)
        b = raw.view(kind.block)
        for f in kind.block.names:
            if kind.block.fields[f][0] == np.float16:
                b[f] = (rng.choice([-1.0, 1.0], b.shape) * rng.uniform(1e-3, 5e-2, b.shape))
        arrays = kind.arrays(72, K)                          # group; 7 blocks: a lone one
        kind.convert(b, arrays)
        lin = quantized_linear(kind.weight(arrays))
        y7 = torch.cat([y7] + [lin(xt[:m, :K]).ravel() for m in (1, 2, 4, 11)])  # decode, prefill
ops = torch.ops.torchllama
w = torch.randn(256, generator=g)
q, k, v = (torch.randn(2, s, 5, 48, generator=g).transpose(1, 2) for s in (3, 9, 9))
cs = torch.randn(3, 20, 2, generator=g)
layers = [ops.rms_norm(x, w, 1e-6, False), ops.rms_norm(x, w, 1e-6, True),
          ops.rope(q.transpose(1, 2), cs), ops.attention(q, k, v, None, 0.3, 0.0),
          ops.attention(q, k, v, torch.rand(3, 9, generator=g) > 0.5, 0.3, 20.0)]
q, k, v = (torch.randn(2, 4, s, 64, generator=g) for s in (1, 37, 37))   # four keys side by
layers += [ops.attention(q, k, v, None, 0.125, 0.0),                   # side, 64-wide PV sums
           ops.attention(q, k, v, torch.rand(2, 1, 1, 37, generator=g) > 0.2, 0.125, 0.0,
                         torch.tensor([3, 30]))]                        # a ring, oldest first
from torchllama.nn.kv_cache import q8_0_quantize                        # the cache storages:
q, k, v = (torch.randn(2, 4, s, 64, generator=g) for s in (3, 150, 150))  # 3 tiles of keys
layers += [ops.attention(q, store(k), store(v), None, 0.125, 0.0)
           for store in (torch.Tensor.half, torch.Tensor.bfloat16, q8_0_quantize)]
q, k, v = (torch.randn(1, h, s, 64, generator=g) for h, s in ((12, 20), (2, 90), (2, 90)))
layers += [ops.attention(q, k.bfloat16(), v.bfloat16(), None, 0.125, 0.0),  # 6 heads a group:
           ops.attention(q[:, :, -1:], k, v, None, 0.125, 0.0)]             # 4 scored at once
q, k, v = (torch.randn(1, 2, s, 40, generator=g) for s in (2, 70, 70))    # widths off the lanes
layers += [ops.attention(q, k.half(), v.half(), None, 0.3, 20.0),
           ops.attention(torch.randn(1, 4, 12, 40, generator=g), k.half(), v.half(), None,
                         0.3, 0.0)]                           # 12 queries: keys in blocks of 16
xa = torch.randn(7, 160, generator=g) * 5                               # activations with
xa[2, :32] = 0.0                                                        # a zero block and
xa[4, :32] = torch.arange(-15.5, 16.5)                                  # ties (scale 1 when
xa[4, 0] = 127.0                                                        # amax is 127)
layers += [t.float() for t in ops.quantize_act(xa)]                     # quantized per ISA
wl = torch.randn(37, 100, generator=g)                  # f32_linear: K and N off the vectors,
xl = torch.randn(65, 100, generator=g)                  # both layouts, alone and in tiles
wc = wl.t().contiguous().t()                            # (65 rows: a packed column-major W)
layers += [ops.f32_linear(xl[:m], w_) for m in (1, 2, 3, 7, 9, 65) for w_ in (wl, wc)]
layers += [ops.f32_linear(xl[:m], wl.to(t)) for m in (1, 3, 65)          # half-precision W
           for t in (torch.float16, torch.bfloat16)]
np.save(sys.argv[1], np.concatenate([y.numpy().ravel(), y7.numpy().ravel()] +
                                    [t.numpy().ravel() for t in layers]))
print(kernels.isa())
"""


def test_every_instruction_set_gives_the_same_bits(tmp_path):
    results = {}
    for forced in ("scalar", "avx2", "avx512", ""):   # a level the CPU lacks falls lower
        env = dict(os.environ, TORCHLLAMA_KERNELS_ISA=forced)
        out = tmp_path / f"{forced or 'best'}.npy"
        run = subprocess.run([sys.executable, "-c", ISA_SCRIPT, str(out)], env=env,
                             capture_output=True, text=True, check=True)
        results[run.stdout.strip()] = np.load(out)
    assert "scalar" in results and len(results) >= 2 or kernels.isa() == "scalar", results.keys()
    first = next(iter(results.values()))
    for isa, y in results.items():
        np.testing.assert_array_equal(y, first, err_msg=isa)


def test_each_kernel_comes_from_the_highest_level_that_has_it():
    """The tables of every level, this CPU's or not (assembled, never run): without VNNI an
    AVX-512 CPU runs the float32 kernels on AVX-512 and the block kernels on AVX2; with VNNI
    the block products are that level's (VNNI tiles); rope_head is the
    scalar one everywhere, f32_to_f16 (F16C) AVX2's above scalar."""
    floats = ("rms_norm_rows", "attend_tiles", "attend_fold", "linear_rows",
              "linear_cols")
    expected = {"scalar": ("scalar", "scalar", "scalar", "scalar"),
                "avx2": ("avx2", "avx2", "avx2", "avx2"),
                "avx512": ("avx2", "avx2", "avx2", "avx512"),
                "avx512_vnni": ("avx512_vnni", "avx512_vnni", "avx512_vnni", "avx512")}
    for isa, (quantize_level, q4_level, q8_level, float_level) in expected.items():
        assert kernels.kernel_levels(isa) == {"quantize_block": quantize_level,
                                              "q4_rows": q4_level, "q8_rows": q8_level,
                                              **dict.fromkeys(floats, float_level),
                                              "rope_head": "scalar",
                                              "f32_to_f16": "scalar" if isa == "scalar"
                                              else "avx2"}, isa
    assert kernels.kernel_levels() == kernels.kernel_levels(kernels.isa())


def test_every_source_file_is_in_the_build_key():
    """The cache folder's name hashes SOURCES: a file left out would keep a stale build."""
    on_disk = {p.relative_to(kernels.CSRC).as_posix() for p in kernels.CSRC.rglob("*")
               if p.suffix in (".h", ".cpp")}
    assert on_disk == set(kernels.SOURCES)
    assert set(kernels.COMPILED) == {name for name in on_disk if name.endswith(".cpp")}


def test_weights_off_the_packed_layout_are_refused():
    with pytest.raises(RuntimeError, match=r"codes must be contiguous int8 \(N/8, K/32, 256\) "
                                            r"\(the packed layout\)"):
        torch.ops.torchllama.q8_linear(torch.randn(1, 48), torch.zeros(4, 48, dtype=torch.int8),
                                       torch.ones(4, 1), torch.tensor(False))
    with pytest.raises(RuntimeError, match="x has 64 columns, the weight has K = 32"):
        torch.ops.torchllama.q4_linear(torch.randn(1, 64),
                                       torch.zeros(1, 1, 128, dtype=torch.uint8),
                                       torch.ones(1, 1, 8), torch.ones(1, 1, 8))


@pytest.mark.parametrize("typ", [Q.Q4_1, Q.Q6_K], ids=lambda t: t.name)
def test_a_non_finite_block_scale_names_the_tensor(typ):
    raw = random_blocks(typ, 4, 256)
    block, size = gguf.GGML_QUANT_SIZES[typ]
    at = 0 if typ == Q.Q4_1 else size - 2                                 # the f16 d field
    raw.reshape(4, -1, size)[2, -1, at:at + 2] = np.array([np.inf], np.float16).view(np.uint8)
    with pytest.raises(ModelFileError, match=r"m\.gguf: tensor 'blk\.3\.ffn_up\.weight' "
                                             rf"\({typ.name}\) has \d+ block scale"):
        read_blocks(gguf_tensor(raw, typ, "blk.3.ffn_up.weight"), "m.gguf")


def test_a_type_without_kernel_loads_as_float_and_is_reported():
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS]
    raw = np.random.default_rng(0).integers(0, 256, (4, size), dtype=np.uint8)   # K = 256
    no_kernel = set()
    assert block_types.block_type(Q.IQ2_XXS) is None
    assert _quantized(gguf_tensor(raw, Q.IQ2_XXS), "auto", "m.gguf", no_kernel) is None
    assert no_kernel == {"IQ2_XXS"}


def test_linear_modules_use_the_kernels_and_keep_bias():
    torch.manual_seed(0)
    w, b = torch.randn(64, 128), torch.randn(64)
    x = torch.randn(2, 3, 128)
    for blocks in (Q4Blocks.from_float(w), Q8Blocks.from_float(w)):
        linear = quantized_linear(blocks, b)
        assert isinstance(linear, (Q4Linear, Q8Linear))
        y = linear(x)
        reference = x @ blocks.dequantize().t() + b
        assert y.shape == (2, 3, 64)
        err = (y - reference).abs().reshape(-1, 64).numpy()
        assert (err <= activation_bound(x.reshape(-1, 128).double().numpy(),
                                        blocks.dequantize().double().numpy())).all()


def test_fake_implementations_give_shapes_on_the_meta_device():
    x = torch.empty(3, 64, device="meta")
    y = torch.ops.torchllama.q4_linear(x, torch.empty(2, 2, 128, dtype=torch.uint8,
                                                      device="meta"),
                                       torch.empty(2, 2, 8, device="meta"),
                                       torch.empty(2, 2, 8, device="meta"))
    assert y.shape == (3, 16) and y.device.type == "meta"


# ---- the float32 layer ops (csrc/layers.cpp) ----------------------------------------------------

def reference_attention(q, k, v, allowed, scale, softcap=None):
    """softmax(q·kᵀ·scale) v in float64 with GQA; allowed (B|1, 1|H, T, S) bool."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(n_rep, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale                      # (B, H, T, S)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v                               # (B, H, T, dv)


def test_rms_norm_equals_float64_reference():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 3, 576, generator=g) * 5, torch.randn(576, generator=g)
    for unit_offset in (False, True):
        y = torch.ops.torchllama.rms_norm(x, w, 1e-6, unit_offset)
        x64 = x.double()
        gain = 1 + w.double() if unit_offset else w.double()
        ref = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * gain
        torch.testing.assert_close(y.double(), ref, rtol=2e-6, atol=2e-6)


def test_rope_rotates_pairs_as_the_complex_product():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 4, 64, generator=g)
    angles = torch.rand(2, 5, 24, generator=g) * 100                     # partial: 48 of 64
    freqs = torch.polar(torch.ones_like(angles), angles)                 # (B, T, pairs)
    y = torch.ops.torchllama.rope(x, torch.view_as_real(freqs))
    rotated = torch.view_as_complex(x[..., :48].double().reshape(2, 5, 4, 24, 2).contiguous()) \
        * freqs.cdouble()[:, :, None]
    ref = torch.cat([torch.view_as_real(rotated).flatten(3), x[..., 48:].double()], -1)
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_attention_equals_float64_reference(softcap):
    g = torch.Generator().manual_seed(3)
    B, H, KV, T, S, hd, dv = 2, 6, 2, 5, 40, 64, 48
    q = torch.randn(B, H, T, hd, generator=g) * 2
    k, v = torch.randn(B, KV, S, hd, generator=g) * 2, torch.randn(B, KV, S, dv, generator=g)
    causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    itself = torch.zeros(T, S, dtype=torch.bool)
    itself[torch.arange(T), S - T + torch.arange(T)] = True              # every query sees a key
    mask = (torch.rand(B, 1, T, S, generator=g) > 0.4) | itself
    for m, allowed in ((None, causal), (mask, mask)):
        y = torch.ops.torchllama.attention(q, k, v, m, 0.125, softcap or 0.0)
        ref = reference_attention(q, k, v, allowed, 0.125, softcap)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hd,dtype,H,KV,L", [(64, torch.float32, 9, 3, 37),
                                             (40, torch.float16, 9, 3, 37),
                                             (128, torch.bfloat16, 9, 3, 37),
                                             (128, torch.float16, 3, 3, 203),
                                             (40, torch.float32, 2, 2, 150)])
def test_attention_is_the_same_bits_alone_padded_and_chunked(hd, dtype, H, KV, L):
    """A row's answer alone equals its answer left-padded (NaN in the padding slots, as an
    unwritten cache) in a batch with another row, and its queries split into chunks (a prompt
    of 8 or more queries scores its keys 16 at a time, fewer key by key: the same bits). With
    one query head a KV head (H = KV), 4 rows score the 64-key tiles they share together
    (layers.cpp ROWS_TOGETHER): L = 203 and 150 give rows with 0–3 shared tiles."""
    g = torch.Generator().manual_seed(4)
    pad = 11
    q = torch.randn(1, H, L, hd, generator=g)
    k, v = (torch.randn(1, KV, L, hd, generator=g).to(dtype) for _ in range(2))
    alone = torch.ops.torchllama.attention(q, k, v, None, 0.125, 0.0)        # causal
    unwritten = torch.full((2, KV, pad + L, hd), float("nan"), dtype=dtype)
    kb, vb = unwritten.clone(), unwritten.clone()
    kb[0, :, pad:], vb[0, :, pad:] = k[0], v[0]
    kb[1], vb[1] = torch.randn(2, KV, pad + L, hd, generator=g).to(dtype)
    qb = torch.cat([q, torch.randn(1, H, L, hd, generator=g)])
    slots = torch.arange(pad + L)
    allowed = (slots[None, :] <= slots[pad:, None]) & (slots[None, :] >= pad)   # (L, S)
    mask = torch.stack([allowed, slots[None, :] <= slots[pad:, None]])[:, None]  # (2, 1, L, S)
    batched = torch.ops.torchllama.attention(qb, kb, vb, mask, 0.125, 0.0)
    assert torch.equal(batched[:1], alone)
    for c in (1, 7, 16):                                # chunked prefill, then decode steps
        parts = [torch.ops.torchllama.attention(q[:, :, t:t + c], k[:, :, :t + c],
                                                v[:, :, :t + c], None, 0.125, 0.0)
                 for t in range(0, L, c)]
        assert torch.equal(torch.cat(parts, dim=2), alone), c


def test_attention_visits_a_ring_oldest_slot_first():
    """Keys stored in a ring (rotated by r) with key_start = r give the bits of the same keys
    stored in slot order: the sums run in slot order whatever the layout."""
    g = torch.Generator().manual_seed(6)
    B, H, KV, S, hd = 3, 4, 2, 23, 64
    q = torch.randn(B, H, 1, hd, generator=g)
    k, v = torch.randn(B, KV, S, hd, generator=g), torch.randn(B, KV, S, hd, generator=g)
    allowed = torch.rand(B, 1, 1, S, generator=g) > 0.3
    allowed[..., -1] = True
    in_order = torch.ops.torchllama.attention(q, k, v, allowed, 0.125, 0.0)
    r = torch.tensor([0, 5, 21])                                     # each row its own turn
    ring = [torch.stack([t[b].roll(int(r[b]), dims=1) for b in range(B)]) for t in (k, v)]
    mask = torch.stack([allowed[b].roll(int(r[b]), dims=-1) for b in range(B)])
    rotated = torch.ops.torchllama.attention(q, *ring, mask, 0.125, 0.0, r)
    assert torch.equal(rotated, in_order)
    plain = torch.ops.torchllama.attention(q, *ring, mask, 0.125, 0.0)   # storage order
    assert not torch.equal(plain, in_order)             # (the order does change the bits)
    with pytest.raises(RuntimeError, match="key_start"):
        torch.ops.torchllama.attention(q, *ring, mask, 0.125, 0.0, torch.tensor([0, 5, 23]))


@pytest.mark.parametrize("scheme", [None, "int8"])
def test_a_sliding_window_prompt_has_the_same_bits_whole_chunked_or_token_by_token(scheme):
    """Gemma-style local layers (a ring of window + margin slots): prefilling a prompt at
    once, in chunks that wrap the ring, or one token at a time gives every position the same
    logits bit for bit (what the serving engine's chunked prefill needs to answer exactly as
    `generate` does). float32 modules on the attention kernel, and the one-op layers."""
    from torchllama.config import ModelArgs
    from torchllama.model import Transformer
    from torchllama.transforms.quantize import quantize_model

    torch.manual_seed(1)
    model = Transformer(ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                                  max_seq_len=192, **GEMMA_LIKE))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3 if p.ndim == 1 else 0.05)
    if scheme:
        model = quantize_model(model, scheme)
    prompt = torch.randint(0, 256, (1, 150))

    def logits(chunk):
        model.setup_caches(1, 192)
        with torch.inference_mode():
            return torch.cat([model(prompt[:, t:t + chunk], t)
                              for t in range(0, prompt.shape[1], chunk)], dim=1)

    assert type(model.layers[0].attention.make_cache(1, 192, torch.float32, "cpu")).__name__ \
        == "SlidingWindowKVCache"
    whole = logits(150)
    for chunk in (40, 1):               # 1: decode steps appending to the ring
        assert torch.equal(logits(chunk), whole), chunk


def test_fused_projections_equal_the_separate_ones_bit_for_bit():
    from torchllama.transforms.fuse import fuse_rows

    g = torch.Generator().manual_seed(5)
    parts = [Q4Linear(Q4Blocks.from_float(torch.randn(n, 128, generator=g)), torch.randn(n))
             for n in (64, 16, 16)]
    x = torch.randn(3, 128, generator=g)
    separate = [lin(x) for lin in parts]
    fused = fuse_rows(parts)
    assert torch.equal(fused(x), torch.cat(separate, 1))
    for lin, y in zip(parts, separate):                  # the parts now view the fused buffers
        assert torch.equal(lin(x), y)
        assert lin.codes.untyped_storage().data_ptr() == fused.codes.untyped_storage().data_ptr()
    q8 = Q8Linear(Q8Blocks.from_float(torch.randn(16, 128, generator=g)))
    assert fuse_rows([parts[0], q8]) is None                # different kinds stay apart


GEMMA_LIKE = dict(norm_unit_offset=True, norm_placement="sandwich", qk_norm=True,
                  mlp="geglu_tanh", embed_scale=True, attn_scale=0.07, attn_logit_softcap=50.0,
                  rope_local_theta=10000.0, sliding_window=6, layer_types=["local", "global"])


#: A Mixtral / Qwen3-MoE-style mixture of experts (renormalized top-k), and OLMoE's (raw
#: top-k weights, QK-norm over all heads' dims).
MIXTRAL_LIKE = dict(n_experts=8, n_experts_per_token=3, moe_hidden_dim=64)
OLMOE_LIKE = dict(MIXTRAL_LIKE, moe_norm_topk=False, qk_norm=True, qk_norm_span="projection")
FAMILIES = {"llama": {}, "gemma": GEMMA_LIKE, "mixtral": MIXTRAL_LIKE, "olmoe": OLMOE_LIKE}


@pytest.mark.parametrize("scheme, family, kv", [
    ("int4", "llama", "auto"), ("int8", "llama", "auto"), ("int4", "gemma", "auto"),
    ("int8", "gemma", "auto"),                          # auto: float16 (quantized weights)
    ("int4", "llama", "q8_0"), ("int8", "gemma", "q8_0"), ("int8", "llama", "bfloat16"),
    ("int4", "gemma", "float32"), ("mixed", "llama", "auto"), ("mixed", "gemma", "q8_0"),
    ("int4", "mixtral", "auto"), ("int8", "olmoe", "q8_0"), ("int4", "olmoe", "float32")])
def test_one_op_layer_equals_the_modules_bit_for_bit(scheme, family, kv, monkeypatch):
    """`decoder_layer` (csrc/decoder.cpp) gives the modules' bits: prefill, decode, a left-padded
    batch and a chunk written into another cache row; for a Llama layer and a Gemma-3-style one
    (sandwich norms with gains 1 + w, QK-norm, tanh GeGLU, soft-capping, and a sliding-window
    ring cache that decode steps wrap around); and it stores the keys and values as the
    modules' cache does (each kv_cache_dtype), byte for byte. "mixed": Q4 blocks with wv and
    w3 in Q8 blocks (llama.cpp's Q4_K_M mix has wv in Q6_K), so q/k/v and w1/w3 are separate
    products, stacked in the op's call. "mixtral", "olmoe": a softmax-routed mixture of experts
    (every expert's projection one `q4_linear_experts` / `q8_linear_experts` call), OLMoE's
    with QK-norm over all heads."""
    from torchllama.config import ModelArgs
    from torchllama.model import Transformer
    from torchllama.transforms.fuse import FusedTransformerBlock
    from torchllama.blocks.forms import Q8Blocks
    from torchllama.blocks.linear import Q8Linear
    from torchllama.transforms.quantize import quantize_model

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                                  max_seq_len=96, **FAMILIES[family]))
    for p in model.parameters():                      # the gains away from 1 + 0
        torch.nn.init.normal_(p, std=0.3 if p.ndim == 1 else 0.05)
    model = quantize_model(model, "int4" if scheme == "mixed" else scheme)
    with torch.inference_mode():
        for layer in model.layers:
            if scheme == "mixed":                       # two types: no fused product
                a, f = layer.attention, layer.feed_forward
                a.wqkv = f.w13 = None
                a.wv = Q8Linear(Q8Blocks.from_float(a.wv.dequantize()))
                f.w3 = Q8Linear(Q8Blocks.from_float(f.w3.dequantize()))
            assert isinstance(layer, FusedTransformerBlock), layer.layer_id
            weights = layer.weights()
            assert weights is not None, layer.layer_id
            assert len(weights[0].wqkv) == (9 if scheme == "mixed" else 3)
            assert len(weights[0].experts) == (9 if family in ("mixtral", "olmoe") else 0)
    prompt = torch.randint(0, 256, (2, 9))

    def run():
        model.setup_caches(3, 96, kv)
        model.caches.zero(slice(0, 3), 0, 96)           # the slots never written compare too
        with torch.inference_mode():
            yield model(prompt, 0)                                          # prefill
            for t in range(9, 80):                      # decode, past the ring's 6 + 64 slots
                yield model(prompt[:, t % 9:t % 9 + 1], t)
            yield model(prompt, 0, pad=torch.tensor([4, 0]))                # left-padded
            yield model(prompt[:1, :3], 0, cache_rows=slice(2, 3))          # row 2: a chunk,
            yield model(prompt[:1, 3:8], 3, cache_rows=slice(2, 3))         # then the next

    calls = []
    op = torch.ops.torchllama.decoder_layer
    monkeypatch.setattr(torch.ops.torchllama, "decoder_layer",
                        lambda *a: calls.append(1) or op(*a), raising=False)
    fused = list(run())
    assert len(calls) >= 71 * 2                       # every decode step, each layer
    stored = [(c.k_cache.clone(), c.v_cache.clone()) for c in model.caches]
    monkeypatch.setattr(FusedTransformerBlock, "cache_slots", lambda self, x, inputs: None)
    for i, (a, b) in enumerate(zip(fused, run())):
        assert torch.equal(a, b), i
    for (k, v), cache in zip(stored, model.caches):
        assert torch.equal(k, cache.k_cache) and torch.equal(v, cache.v_cache)


# ---- the float32 linear product (f32_linear, torchllama.nn.linear.Linear) ----------------------

def column_major(w: torch.Tensor) -> torch.Tensor:
    """The same (N, K) matrix stored as the transpose of a contiguous (K, N) (the loaders')."""
    return w.t().contiguous().t()


@pytest.mark.parametrize("N, K", [(40, 64), (37, 100), (70, 576), (33, 17), (5, 3)])
def test_f32_linear_equals_float64_reference(N, K):
    """Row- and column-major weights, K off the 16 lanes (100, 17, 3), N off the 16-column
    vectors (37, 33, 5): within float32 accumulation of the float64 product."""
    g = torch.Generator().manual_seed(10)
    x, w = torch.randn(23, K, generator=g), torch.randn(N, K, generator=g)
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T                          # Σ |x_k·w_k|
    for weight in (w, column_major(w)):
        y = torch.ops.torchllama.f32_linear(x, weight)
        assert y.shape == (23, N) and y.dtype == torch.float32
        assert ((y.double() - ref).abs() <= 1e-5 * scale + 1e-30).all()


@pytest.mark.parametrize("N, K", [(40, 64), (37, 100), (130, 576), (2048, 24)])
def test_f32_linear_rows_are_batch_invariant(N, K):
    """Each output row is the same bits computed alone, among M = 1..70 rows (every tile shape
    and remainder, the in-place and the packed paths of a column-major weight: packed from 64
    rows on, or when N is a multiple of 2048), shuffled, in slices and in a strided view, and
    for either layout of the weight."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(70, K, generator=g), torch.randn(N, K, generator=g)
    op = torch.ops.torchllama.f32_linear
    alone = torch.cat([op(x[i:i + 1], w) for i in range(70)])
    for weight in (w, column_major(w)):
        for M in range(1, 71):
            assert torch.equal(op(x[:M], weight), alone[:M]), M
        perm = torch.randperm(70, generator=g)
        assert torch.equal(op(x[perm], weight), alone[perm])
        assert torch.equal(op(x[13:50], weight), alone[13:50])
        assert torch.equal(op(x[::3], weight), alone[::3])                  # copied contiguous
        assert torch.equal(torch.cat([op(c, weight) for c in x.split([9, 1, 31, 29])]), alone)


def test_f32_linear_refuses_mismatched_shapes_and_gives_fake_shapes():
    with pytest.raises(RuntimeError, match="f32_linear: x must be"):
        torch.ops.torchllama.f32_linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.torchllama.f32_linear(torch.randn(2, 8).double(), torch.randn(4, 8).double())
    y = torch.ops.torchllama.f32_linear(torch.empty(3, 64, device="meta"),
                                        torch.empty(8, 64, device="meta"))
    assert y.shape == (3, 8) and y.device.type == "meta"
    assert torch.ops.torchllama.f32_linear(torch.randn(0, 8), torch.randn(4, 8)).shape == (0, 4)
    assert torch.equal(torch.ops.torchllama.f32_linear(torch.randn(2, 0), torch.randn(4, 0)),
                       torch.zeros(2, 4))


def test_linear_module_uses_the_kernel_at_inference_only(monkeypatch):
    """torchllama.nn.linear.Linear: an nn.Linear (same state-dict keys), the kernel plus bias
    under no_grad in float32, F.linear when a gradient is tracked (training) or switched off."""
    from torchllama.nn import linear as linear_mod

    torch.manual_seed(12)
    lin = linear_mod.Linear(100, 37)
    assert isinstance(lin, torch.nn.Linear) and set(lin.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 5, 100)
    calls = []
    op = torch.ops.torchllama.f32_linear
    monkeypatch.setattr(torch.ops.torchllama, "f32_linear",
                        lambda *a: calls.append(1) or op(*a), raising=False)
    with torch.no_grad():
        y = lin(x)
    assert calls and y.shape == (2, 5, 37)
    assert torch.equal(y, op(x.reshape(10, 100), lin.weight).view(2, 5, 37) + lin.bias)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, lin.weight, lin.bias))
    calls.clear()
    y = lin(x)                                                 # training: differentiable
    y.sum().backward()
    assert not calls and lin.weight.grad is not None
    monkeypatch.setattr(linear_mod, "use_kernel", False)
    with torch.no_grad():
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert not calls


@pytest.mark.parametrize("layout", ["row", "column"])
def test_float32_model_gives_the_same_logits_one_token_at_a_time(layout):
    """A float32 Transformer's logits are the same bits fed one token at a time through the KV
    cache (decode), all at once (prefill, a speculative verification), in chunks, and for a
    row alone or batched with another (the serving engine's batches)."""
    from torchllama.config import ModelArgs
    from torchllama.transforms.layout import set_weight_layout
    from torchllama.model import Transformer

    torch.manual_seed(13)
    # hidden 192, a multiple of 16: torch's F.silu computes the last elements of a buffer whose
    # length is not a multiple of its vector width by another route (1 ulp apart), so with
    # hidden 200 a row's gate depends on where the row lies in the batch (not our kernels)
    model = Transformer(ModelArgs(dim=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=200,
                                  hidden_dim=192, max_seq_len=64)).eval()
    set_weight_layout(model, layout)
    tokens = torch.randint(0, 200, (2, 21))

    def logits(rows, chunks):
        model.setup_caches(2, 64)
        with torch.inference_mode():
            out, t = [], 0
            for c in chunks:
                out.append(model(tokens[rows, t:t + c], t))
                t += c
            return torch.cat(out, dim=1)

    whole = logits(slice(0, 2), [21])
    assert torch.equal(logits(slice(0, 2), [1] * 21), whole)
    assert torch.equal(logits(slice(0, 2), [5, 1, 9, 1, 5]), whole)
    assert torch.equal(logits(slice(1, 2), [21]), whole[1:])
    assert torch.equal(logits(slice(0, 1), [1] * 21), whole[:1])


# ---- the packed layout (transforms/quantize.py pack_rows, blocks_impl.h) -----------------------

def test_packing_rows_round_trips_and_pads_with_zero_rows():
    codes = torch.randint(0, 256, (13, 64), dtype=torch.uint8)             # 4 blocks of Q4
    packed = pack_rows(codes, 4, 4)
    assert packed.shape == (2, 4, 128)
    assert torch.equal(unpack_rows(packed, 4, 13), codes)
    assert not unpack_rows(packed, 4, 16)[13:].any()                        # padding: zeros
    ids = torch.tensor([12, 0, 7, 8, 7])
    assert torch.equal(unpack_rows(packed, 4, ids), codes[ids])
    # group 1, block 2, chunk 3 holds bytes 12..15 of block 2 of rows 8..15, row by row
    assert torch.equal(packed[1, 2, 96:96 + 20].view(5, 4), codes[8:13, 2 * 16 + 12:2 * 16 + 16])


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_a_row_count_off_the_groups_gives_the_same_rows(kind):
    """N = 13: the last group padded with zero rows, their outputs cut off; each row equals
    the same row inside a multiple-of-8 matrix, bit for bit."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(16, 96, generator=g)
    make = Q4Blocks.from_float if kind == "q4" else Q8Blocks.from_float
    full, cut = linear_for(make(w)), linear_for(make(w[:13]))
    x = torch.randn(5, 96, generator=g)
    assert cut(x).shape == (5, 13)
    assert torch.equal(cut(x), full(x)[:, :13])
    assert torch.equal(cut.weight_blocks().dequantize(), make(w[:13]).dequantize())


def test_a_tied_embedding_reads_the_packed_rows():
    blocks = Q4Blocks.from_float(torch.randn(40, 64, generator=torch.Generator().manual_seed(12)))
    linear = linear_for(blocks)
    embedding = quantized_embedding(blocks, linear)
    assert embedding.codes.data_ptr() == linear.codes.data_ptr()           # one copy
    ids = torch.tensor([[3, 39, 8], [0, 0, 17]])
    assert torch.equal(embedding(ids), blocks.dequantize()[ids])


@pytest.mark.parametrize("typ", [Q.Q4_K, Q.Q6_K, Q.Q4_0], ids=lambda t: t.name)
def test_compact_scales_give_the_bits_of_float32_scales(typ):
    """Q4_K / Q6_K scales kept as the file's factors (f16 super-scale × small integer, formed
    in the kernel) and Q4_0's m kept as −8·d give the outputs of the float32 d and m bit for
    bit, in fewer bytes; rows read back (weights, a tied embedding) are the same, and so are
    a last group padded with zero rows (N = 13)."""
    raw = random_blocks(typ, 13, 512, seed=21)
    blocks = read_blocks(gguf_tensor(raw, typ), "t")
    compact = linear_for(blocks)
    ops, q4 = torch.ops.torchllama, typ != Q.Q6_K
    scales = [pack_rows(t, t.shape[1], 1) for t in ([blocks.d, blocks.m] if q4 else [blocks.d])]
    assert all(t.dtype == torch.float32 for t in scales)                   # the reference form
    if q4:
        plain = lambda x: ops.q4_linear(x, compact.codes, *scales)[:, :13]  # noqa: E731
    else:
        plain = lambda x: ops.q8_linear(x, compact.codes, *scales, torch.tensor(True))[:, :13]  # noqa: E731
    forms = {Q.Q4_K: torch.uint8, Q.Q6_K: torch.int8, Q.Q4_0: torch.float16}
    assert compact.d.dtype == forms[typ]
    if typ == Q.Q4_0:
        assert compact.m.dim() == 0 and float(compact.m) == -8.0
    nbytes = sum(t.numel() * t.element_size() for t in compact.packed()[1:3 if q4 else 2])
    assert nbytes < 0.6 * sum(t.numel() * t.element_size() for t in scales)
    g = torch.Generator().manual_seed(22)
    for M in (1, 3, 9):
        x = torch.randn(M, 512, generator=g)
        assert torch.equal(compact(x), plain(x)), M
        assert compact(x).abs().max() > 0.1                                # not all zeros
    assert torch.equal(compact.weight_blocks().dequantize(), blocks.dequantize())
    ids = torch.tensor([[12, 0, 7], [8, 8, 3]])
    assert torch.equal(quantized_embedding(blocks, compact)(ids), blocks.dequantize()[ids])


def test_a_killed_builds_lock_never_blocks_the_next_build(tmp_path):
    """cpp_extension waits forever on the `lock` file of a build killed mid-way (kill -9 of a
    server while it builds): under the build lock, which the OS frees when its holder dies, the
    file is removed; while a live process holds the build lock, the next build waits."""
    import fcntl

    lock = tmp_path / "lock"
    lock.touch()                                             # left by a killed build
    with kernels._build_lock(tmp_path):
        assert not lock.exists()
        lock.touch()                                         # this build's own baton
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(tmp_path / 'build.lock')!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / "build.lock", "a") as f:        # a live build: the lock is taken
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert lock.exists()
    finally:
        holder.kill()                                        # kill -9: the OS frees its lock
        holder.wait()
    with kernels._build_lock(tmp_path):
        assert not lock.exists()


def test_a_build_says_so_on_a_terminal_only_and_only_when_it_compiles(tmp_path, monkeypatch):
    """The first load on a machine compiles the kernels for about a minute: one line says so on
    a terminal's stderr, none when they are found built or stderr is a log."""
    class Stderr:
        def __init__(self, tty: bool):
            self.tty, self.text = tty, ""

        def isatty(self) -> bool:
            return self.tty

        def write(self, s: str) -> int:
            self.text += s
            return len(s)

        def flush(self) -> None:
            pass

    for tty, built, says in ((True, False, True), (True, True, False), (False, False, False)):
        (tmp_path / f"{kernels.LIBRARY}.so").unlink(missing_ok=True)
        if built:
            (tmp_path / f"{kernels.LIBRARY}.so").touch()
        err = Stderr(tty)
        monkeypatch.setattr(sys, "stderr", err)
        kernels._say_building(tmp_path)
        monkeypatch.undo()
        assert (err.text.startswith("building torchllama's CPU kernels") and
                str(tmp_path) in err.text and err.text.count("\n") == 1) if says else \
            err.text == "", (tty, built, err.text)


def test_every_build_runs_the_ninja_beside_this_python():
    """Two ninja versions read each other's build logs as foreign and rebuild everything: the
    kernels are built with one, the `ninja` package's beside the interpreter, whatever PATH."""
    beside = Path(sys.executable).parent / "ninja"
    if not beside.is_file():
        pytest.skip("no ninja beside this Python")
    assert kernels._ninja_dir() == str(beside.parent)
    before = os.environ["PATH"]
    with kernels._path_first(kernels._ninja_dir()):
        assert shutil.which("ninja") == str(beside)
    assert os.environ["PATH"] == before


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_weights_give_the_float32_weights_bits(dtype):
    """f32_linear on F16 / BF16 weights as stored (converted as they are loaded) equals it on
    the same weights in float32, bit for bit, alone and in tiles; and both are the product."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(37, 100, generator=g) * 0.1).to(dtype)             # K, N off the vectors
    x = torch.randn(9, 100, generator=g)
    for m in (1, 3, 9):
        ours = torch.ops.torchllama.f32_linear(x[:m], w)
        assert torch.equal(ours, torch.ops.torchllama.f32_linear(x[:m], w.float()))
        torch.testing.assert_close(ours, x[:m].double().mm(w.double().t()).float())
