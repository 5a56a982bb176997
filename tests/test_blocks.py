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


@pytest.mark.parametrize("kind", ROWS, ids=lambda t: t.name)
def test_an_untied_embedding_of_each_type_gives_ggmls_rows(kind):
    """An embedding table of its own (an untied model: Llama 2's token_embd, IQ4_XS in
    llama.cpp's IQ4_XS mix) looks its ids' rows up in the blocks as they are: each row is
    `gguf`'s dequantization of the file's row (4-bit indices through their table too)."""
    from torchllama.blocks.linear import BlockEmbedding

    b = random_file_blocks(kind, 10, 2, seed=3)
    arrays = kind.arrays(10, 2 * kind.weights)
    kind.convert(b, arrays)
    table = BlockEmbedding(kind.weight(arrays))
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
