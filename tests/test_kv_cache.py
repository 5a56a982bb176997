"""The KV cache's storage (`kv_cache_dtype`: float32, float16, bfloat16, q8_0; torchllama.nn.kv_cache)
against independent oracles: NumPy's float32 arithmetic for the q8_0 rounding (bit for bit),
a float64 softmax over the stored keys for the attention kernel, the float32 cache for the
real model's logits (within the measured rounding of each storage), and a row alone for the
same row in a batch of 8 (bit for bit)."""

import numpy as np
import pytest
import torch

from torchllama import kernels
from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError
from torchllama.generation.session import Session
from torchllama.model import Transformer
from torchllama.nn import attend
from torchllama.nn.attention_inputs import AttentionInputs
from torchllama.nn.kv_cache import (KVCache, q8_0_dequantize, q8_0_quantize, stored_to_float)
from torchllama.transforms.quantize import quantize_model

needs_kernels = pytest.mark.skipif(not kernels.available(),
                                   reason=f"kernels unavailable: {kernels.unavailable_reason()}")
STORAGES = {"float32": lambda t: t, "float16": torch.Tensor.half,
            "bfloat16": torch.Tensor.bfloat16, "q8_0": q8_0_quantize}


def numpy_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The q8_0 rounding in NumPy float32: per block of 32, d = max|x| / 127, q = rint(x · (1/d))
    (ties to even; 0 where d = 0). Returns (codes int8 (..., w), scales float32 (..., w/32))."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    d = np.abs(blocks).max(-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int8)
    return q.reshape(x.shape), d.astype(np.float32)


def test_q8_0_slot_quantization_equals_numpy_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 5, 96, generator=g) * torch.rand(3, 2, 5, 1, generator=g) * 30
    x[0, 0, 0, :32] = 0.0                                      # a zero block: d = 0, codes 0
    x[0, 0, 1, :32] = torch.arange(-15.5, 16.5)                # ties, with amax 127: d = 1
    x[0, 0, 1, 0] = 127.0
    x[1, 1, 2, 40] = 1e4                                       # an outlier in one block only
    records = q8_0_quantize(x)
    assert records.dtype == torch.uint8 and records.shape == (3, 2, 5, 96 + 12)
    codes, scales = numpy_q8_0(x.numpy())
    np.testing.assert_array_equal(records[..., :96].contiguous().view(torch.int8).numpy(), codes)
    np.testing.assert_array_equal(records[..., 96:].contiguous().view(torch.float32).numpy(),
                                  scales)
    assert codes[0, 0, 1, 16] == 0 and codes[0, 0, 1, 17] == 2     # 0.5 → 0, 1.5 → 2 (even)
    back = q8_0_dequantize(records)                            # d · q, within d/2 of x
    d = torch.from_numpy(scales).repeat_interleave(32, -1)
    assert torch.all((back - x).abs() <= d / 2 * (1 + 1e-6))
    if kernels.available():                                    # the kernels' own rounding
        q, dk, _ = torch.ops.torchllama.quantize_act(x.reshape(-1, 96))
        np.testing.assert_array_equal(q.view(3, 2, 5, 96).numpy(), codes)
        np.testing.assert_array_equal(dk.view(3, 2, 5, 3).numpy(), scales)


def test_a_slot_is_quantized_alone_and_read_back_as_stored():
    """A row's cache holds the same bytes whoever shares the batch; `update` returns keys as
    stored, for every storage."""
    g = torch.Generator().manual_seed(1)
    xk, xv = torch.randn(4, 2, 3, 64, generator=g), torch.randn(4, 2, 3, 64, generator=g)
    for name, store in STORAGES.items():
        storage = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                   "float32": torch.float32}.get(name, name)
        batch, alone = (KVCache(4, 8, 2, 64, 64, storage) for _ in range(2))
        k, v = batch.update(0, xk, xv)
        alone.update(0, xk[2:3], xv[2:3], slice(2, 3))
        assert torch.equal(batch.k_cache[2, :, :3], alone.k_cache[2, :, :3]), name
        assert torch.equal(k, store(xk)) and torch.equal(v, store(xv)), name
    with pytest.raises(ArgumentError, match="multiples of 32"):
        KVCache(1, 8, 2, 48, 48, "q8_0")


def reference(q, k, v, allowed, scale):
    """softmax(q·kᵀ·scale)·v in float64 with GQA over keys and values already in float."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(n_rep, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def int8_queries(q):
    """q rounded to int8 per 32 as the kernel rounds it for q8_0 keys (then as floats)."""
    return q8_0_dequantize(q8_0_quantize(q))


@needs_kernels
@pytest.mark.parametrize("name", list(STORAGES))
def test_attention_kernel_reads_each_storage_as_the_float64_reference(name, monkeypatch):
    """The kernel over stored keys equals a float64 softmax over the same keys in float (for
    q8_0 with the query rounded to int8 per 32, as the kernel scores it), and torch's fallback
    on the same cache (`attend` without the kernels) within float32 rounding — for q8_0 within
    what rounding the query moves (the fallback keeps the query in float32)."""
    g = torch.Generator().manual_seed(2)
    B, H, KV, T, S, hd = 2, 6, 2, 5, 150, 64                  # 3 tiles: one partial
    q = torch.randn(B, H, T, hd, generator=g)
    k, v = torch.randn(B, KV, S, hd, generator=g) * 2, torch.randn(B, KV, S, hd, generator=g)
    allowed = (torch.rand(B, 1, T, S, generator=g) > 0.3) | \
        (torch.arange(S) == S - 1)                             # every query sees a key
    ks, vs = STORAGES[name](k), STORAGES[name](v)
    y = torch.ops.torchllama.attention(q, ks, vs, allowed, 0.125, 0.0)
    kf, vf = stored_to_float(ks, torch.float32), stored_to_float(vs, torch.float32)
    qf = int8_queries(q) if name == "q8_0" else q
    torch.testing.assert_close(y.double(), reference(qf, kf, vf, allowed, 0.125),
                               rtol=1e-5, atol=2e-6)
    monkeypatch.setattr(kernels, "layer_ops_apply", lambda *a: False)
    fallback = attend(q, ks, vs, AttentionInputs(0, None, allowed), scale=0.125)
    torch.testing.assert_close(y, fallback, rtol=1e-5, atol=3e-2 if name == "q8_0" else 3e-6)


def real_logits(model, ids, kv):
    """Logits of a 48-token prefill, then 8 teacher-forced decode steps, through a kv cache."""
    model.setup_caches(1, ids.shape[1], kv)
    with torch.inference_mode():
        out = [model(ids[:, :48], 0)] + [model(ids[:, p:p + 1], p)
                                         for p in range(48, ids.shape[1])]
    return torch.cat(out, dim=1)[0]                            # (56, V)


SMOLLM2_TEXT = ("The history of the Roman Empire spans more than a thousand years. It began "
                "when Augustus became the first emperor, after a century of civil wars had "
                "ended the Republic. Over the following centuries the empire grew to cover the "
                "whole Mediterranean, from Britain in the north to Egypt in the south, and its "
                "roads, laws and language shaped Europe long after its fall.")


def test_each_kv_cache_dtype_keeps_smollm2_close_to_the_float32_cache(smollm2):
    """SmolLM2 with float32 weights (so that the difference is the cache's alone: on the
    default path, int8 activations re-round whatever reaches them and scatter any small
    change), 56 positions against the float32 cache. Measured max |Δlogit| 0.016 (float16),
    0.13 (bfloat16), 0.82 (q8_0, whose query is rounded to int8 too), top token the same at
    56, 56 and 55 of 56 positions, mean NLL 2.8665 → +0.00006, +0.0013, −0.008: float16's 10
    mantissa bits keep it ~8× closer than bfloat16's 7, hence the default. Bounds: ~3× those."""
    model, tokenizer = smollm2
    ids = torch.tensor([tokenizer.encode(SMOLLM2_TEXT, bos=True)[:56]])
    exact = real_logits(model, ids, "float32")

    def nll(logits):
        return torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]).item()

    for name, bound, agree in (("float16", 0.05, 1.0), ("bfloat16", 0.4, 1.0),
                               ("q8_0", 2.5, 0.95)):
        logits = real_logits(model, ids, name)
        assert (logits - exact).abs().max() < bound, name
        assert (logits.argmax(-1) == exact.argmax(-1)).float().mean() >= agree, name
        assert abs(nll(logits) - nll(exact)) < 0.03, name
    model.clear_caches()


@needs_kernels
@pytest.mark.parametrize("name", ["float16", "q8_0"])
def test_a_row_is_the_same_bits_alone_and_in_a_batch_of_8(smollm2_auto, name):
    """The default path (quantized weights, one-op layers): 8 prompts of different lengths,
    each prefilled into its own row of an 8-row cache and decoded together at their own
    positions (the serving engine's steps), give each row the logits it gets alone."""
    model, _ = smollm2_auto
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (1, n), generator=g) for n in (5, 17, 9, 30, 1, 12, 64, 3)]
    steps = 4

    def alone(p):
        model.setup_caches(1, 80, name)
        with torch.inference_mode():
            out = [model(p, 0)[:, -1]]
            token = out[-1].argmax(-1, keepdim=True)
            for s in range(steps):
                out.append(model(token, p.shape[1] + s)[:, -1])
                token = out[-1].argmax(-1, keepdim=True)
        return torch.cat(out)                                          # (1 + steps, V)

    expected = [alone(p) for p in prompts]
    model.setup_caches(8, 80, name)
    with torch.inference_mode():
        firsts = [model(p, 0, cache_rows=slice(b, b + 1))[:, -1] for b, p in enumerate(prompts)]
        got = [[f] for f in firsts]
        tokens = torch.cat([f.argmax(-1, keepdim=True) for f in firsts])          # (8, 1)
        for s in range(steps):
            pos = torch.tensor([p.shape[1] + s for p in prompts])
            logits = model(tokens, pos)[:, -1]                                    # (8, V)
            for b in range(8):
                got[b].append(logits[b:b + 1])
            tokens = logits.argmax(-1, keepdim=True)
    for b in range(8):
        assert torch.equal(torch.cat(got[b]), expected[b]), b
    model.clear_caches()


def test_auto_is_float16_for_quantized_weights_and_the_weights_dtype_otherwise():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64,
                                  max_seq_len=16)).eval()
    assert model.kv_cache_storage() == torch.float32                  # the exact path
    assert model.to(torch.bfloat16).kv_cache_storage() == torch.bfloat16
    quantized = quantize_model(model.float(), "int8")
    assert quantized.kv_cache_storage() == torch.float16
    assert quantized.kv_cache_storage("q8_0") == "q8_0"
    quantized.setup_caches(1, 16, "bfloat16")
    assert quantized.caches.kv_dtype == torch.bfloat16
    with pytest.raises(ArgumentError, match="use one of auto, float32, float16, bfloat16, q8_0"):
        quantized.setup_caches(1, 16, "fp8")
    with pytest.raises(ArgumentError, match="kv_cache_dtype 'int4'"):
        Session(quantized, None, kv_cache_dtype="int4")
