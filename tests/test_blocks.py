"""The registry of GGUF block types (torchllama.blocks): every row's reference dequantization is
ggml's (the `gguf` library's, bit for bit), its conversion gives the kernel form those values,
and the C++ rows (kernels/csrc/types/) are the Python rows."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from torchllama import blocks, kernels

ROWS = sorted(blocks.TYPES.values(), key=lambda t: t.ggml.value)


def random_file_blocks(kind: blocks.BlockType, rows: int, n_blocks: int, seed: int = 0
                       ) -> np.ndarray:
    """(rows, n_blocks) blocks of random bytes (every code and sub-scale pattern) with finite
    f16 fields of either sign: d, m ~ ±U(1e-3, 5e-2), dmin likewise."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, n_blocks * kind.block.itemsize), dtype=np.uint8)
    b = raw.view(kind.block)
    for field in kind.block.names:
        if kind.block.fields[field][0] == np.float16:
            sign = rng.choice([-1.0, 1.0], b.shape)
            b[field] = (sign * rng.uniform(1e-3, 5e-2, b.shape)).astype(np.float16)
    return b


@pytest.mark.parametrize("kind", ROWS, ids=lambda t: t.name)
def test_reference_is_ggmls_dequantization_bit_for_bit(kind):
    b = random_file_blocks(kind, 6, 4)
    expected = gguf.quants.dequantize(b.view(np.uint8).reshape(6, -1), kind.ggml)
    ours = kind.reference(b)
    assert ours.dtype == np.float32 and ours.shape == (6, 4 * kind.weights)
    np.testing.assert_array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("kind", ROWS, ids=lambda t: t.name)
def test_conversion_gives_the_kernel_form_the_same_values(kind):
    b = random_file_blocks(kind, 8, 3, seed=1)
    arrays = kind.arrays(8, 3 * kind.weights)
    kind.convert(b, arrays)
    weight = kind.weight(arrays)
    assert type(weight).__name__ == {"q4": "Q4Blocks", "q8": "Q8Blocks"}[kind.form]
    np.testing.assert_array_equal(weight.dequantize().numpy(), kind.reference(b))


@pytest.mark.parametrize("packed", [False, True], ids=["as converted", "packed"])
@pytest.mark.parametrize("kind", ROWS, ids=lambda t: t.name)
def test_an_untied_embedding_of_each_type_gives_ggmls_rows(kind, packed):
    """An embedding table of its own (an untied model: Llama 2's token_embd, IQ4_XS in
    llama.cpp's IQ4_XS mix) looks its ids' rows up in the blocks as they are, or in the packed
    table the loader builds (`pack_in_chunks`): each row is `gguf`'s dequantization of the
    file's row (4-bit indices through their table too)."""
    from torchllama.blocks.linear import BlockEmbedding

    if packed and not kernels.available():
        pytest.skip("kernels unavailable")
    b = random_file_blocks(kind, 10, 2, seed=3)
    arrays = kind.arrays(10, 2 * kind.weights)
    kind.convert(b, arrays)
    table = BlockEmbedding(_chunked(kind, b, [10], rows=8)[0] if packed else
                           kind.weight(arrays))
    ids = torch.tensor([[7, 0, 7], [9, 2, 4]])
    expected = gguf.quants.dequantize(b.view(np.uint8).reshape(10, -1), kind.ggml)
    rows = table(ids)
    assert rows.shape == (2, 3, 2 * kind.weights)
    np.testing.assert_array_equal(rows.numpy(), expected[ids.numpy()])


@pytest.mark.skipif(not kernels.available(), reason="kernels unavailable")
def test_the_cpp_rows_are_the_python_rows():
    assert sorted(torch.ops.torchllama.gguf_block_types()) == [t.ggml.value for t in ROWS]


def test_the_fifth_bit_plane_holds_each_weights_bit_where_the_tiles_read_it():
    """fifth_bit_plane's delta swaps against the plane's definition bit by bit: byte j of a
    block's 4 holds at bit c weight 4c + j's fifth bit and at bit 4 + c weight 16 + 4c + j's
    (blocks_impl.h's chunk c, low and high nibbles); high_of_plane takes it back."""
    from torchllama.blocks.packing import fifth_bit_plane, high_of_plane

    high = torch.randint(0, 256, (5, 16), dtype=torch.uint8)               # 5 rows, K = 128
    bits = (high.view(5, 4, 4, 1) >> torch.arange(8, dtype=torch.uint8)) & 1
    bit = bits.reshape(5, 4, 32)                                           # (row, block, weight)
    plane = fifth_bit_plane(high).view(5, 4, 4)                            # (row, block, byte j)
    for j in range(4):
        for c in range(4):
            assert torch.equal((plane[..., j] >> c) & 1, bit[..., 4 * c + j])
            assert torch.equal((plane[..., j] >> (4 + c)) & 1, bit[..., 16 + 4 * c + j])
    assert torch.equal(high_of_plane(fifth_bit_plane(high)), high)


def _chunked(kind: blocks.BlockType, b: np.ndarray, sizes: list[int], rows: int):
    """`pack_in_chunks` of file blocks `b` (rows one part after another)."""
    from torchllama.blocks.chunked import pack_in_chunks

    starts = np.cumsum([0] + sizes[:-1])

    def read(part, a, end, out):
        kind.convert(b[starts[part] + a:starts[part] + end], out)

    return pack_in_chunks(kind, b.shape[1] * kind.weights, sizes, read, rows=rows)


@pytest.mark.skipif(not kernels.available(), reason="kernels unavailable")
@pytest.mark.parametrize("sizes", [[44], [24, 16, 8]], ids=["one matrix", "a fusion group"])
@pytest.mark.parametrize("kind", ROWS, ids=lambda t: t.name)
def test_packing_a_chunk_of_rows_at_a_time_gives_the_whole_matrixs_buffers(kind, sizes):
    """The loader packs a matrix (or a fusion group's) 8 or 16 rows at a time straight into the
    module's buffers: the same bits as packing the whole matrix at once (the last group of 8
    padded), and each part's module the same as `fused_linears` gives."""
    from torchllama.blocks.linear import BlockLinear
    from torchllama.transforms.fuse import fused_linears
    from torchllama.transforms.quantize import quantized_linear

    b = random_file_blocks(kind, sum(sizes), 2, seed=4)
    arrays = kind.arrays(sum(sizes), 2 * kind.weights)
    kind.convert(b, arrays)
    whole = kind.weight(arrays)
    expected = [quantized_linear(whole)] + (fused_linears(whole, sizes)[1:] if len(sizes) > 1
                                            else [quantized_linear(whole)])
    for rows in (8, 16):
        got = _chunked(kind, b, sizes, rows)
        assert len(got) == len(expected)
        for ours, theirs in zip(got, expected):
            assert isinstance(ours, BlockLinear) and type(ours) is type(theirs)
            assert (ours.out_features, ours.in_features) == (theirs.out_features,
                                                             theirs.in_features)
            for x, y in zip(ours.packed(), theirs.packed()):
                assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.skipif(not kernels.available(), reason="kernels unavailable")
def test_chunks_that_would_pack_in_different_forms_give_way_to_the_whole_matrix():
    """Q8_0 codes in [−32, 31] pack in 6 bits: a matrix whose first rows are so and whose last
    are not is packed in 8 bits as a whole, so a chunk at a time gives None (the loader then
    packs the whole); float16 scales likewise where one chunk's are not all exact."""
    kind = blocks.TYPES[gguf.GGMLQuantizationType.Q8_0]
    b = random_file_blocks(kind, 16, 2, seed=5)
    b["qs"][:8] = np.clip(b["qs"][:8], -32, 31)
    b["qs"][8:, :, 0] = 100
    assert _chunked(kind, b, [16], rows=8) is None
    assert _chunked(kind, b, [16], rows=16) is not None
