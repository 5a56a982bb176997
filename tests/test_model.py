"""The model against independent oracles: HF transformers' LlamaForCausalLM on random tiny
configs (weights converted with the q/k permutation), and the invariants the seeds check
(KV-cached decoding = full recompute, RoPE norms and relative positions)."""

import pytest
import torch
import torch.nn.functional as F

from torchllama.checkpoint.hf import from_hf_state_dict
from torchllama.transforms.layout import set_weight_layout
from torchllama.families import LLAMA, permute_hf_to_meta, permute_meta_to_hf
from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError, ContextLengthError
from torchllama.model import Transformer
from torchllama.nn import apply_rotary_emb, precompute_freqs_cis, repeat_kv
from torchllama.nn.position import RotaryEmbedding

transformers = pytest.importorskip("transformers")


def hf_pair(n_heads=4, n_kv_heads=2, tie=False, dim=64, layers=3, vocab=300, hidden=176,
            theta=5000.0, seed=0):
    """A random HF LlamaForCausalLM and our Transformer holding the same weights."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_hidden_layers=layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, rms_norm_eps=1e-5,
        rope_theta=theta, max_position_embeddings=128, tie_word_embeddings=tie,
        attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(config).eval()
    args = ModelArgs(dim=dim, n_layers=layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                     vocab_size=vocab, hidden_dim=hidden, norm_eps=1e-5, rope_theta=theta,
                     max_seq_len=128, tie_embeddings=tie)
    ours = Transformer(args).eval()
    ours.load_state_dict(from_hf_state_dict(LLAMA, hf.state_dict(), args), strict=True)
    return hf, ours


@pytest.mark.parametrize("n_heads, n_kv_heads, tie", [
    (4, 4, False),   # multi-head attention
    (4, 2, False),   # grouped-query attention
    (4, 1, True),    # multi-query attention, tied embeddings
    (8, 2, False),   # 4 query heads per KV head
])
def test_logits_equal_hf_llama(n_heads, n_kv_heads, tie):
    hf, ours = hf_pair(n_heads, n_kv_heads, tie)
    tokens = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert got.dtype == torch.float32 and got.shape == (2, 40, 300)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_wrong_kv_head_count_in_permutation_breaks_parity():
    # The trap the design notes warn about: un-permuting wk with n_heads instead of n_kv_heads.
    hf, ours = hf_pair(4, 2)
    sd = from_hf_state_dict(LLAMA, hf.state_dict(), ours.args)
    sd["layers.0.attention.wk.weight"] = permute_hf_to_meta(
        hf.state_dict()["model.layers.0.self_attn.k_proj.weight"], 4)
    ours.load_state_dict(sd)
    tokens = torch.randint(0, 300, (1, 20))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() > 1e-3


def test_permutations_are_inverse():
    w = torch.randn(6 * 8, 16)
    assert torch.equal(permute_hf_to_meta(permute_meta_to_hf(w, 6), 6), w)
    assert not torch.equal(permute_meta_to_hf(w, 6), w)


def test_column_major_weights_give_the_same_logits():
    _, ours = hf_pair()
    tokens = torch.randint(0, 300, (2, 30))
    with torch.no_grad():
        row = ours(tokens)
        set_weight_layout(ours, "column")
        assert ours.layers[0].attention.wq.weight.stride() == (1, 64)
        col = ours(tokens)
    torch.testing.assert_close(col, row, atol=1e-5, rtol=1e-5)
    with pytest.raises(ArgumentError):
        set_weight_layout(ours, "diagonal")


def test_tied_embeddings_share_one_parameter():
    _, ours = hf_pair(tie=True)
    assert ours.output.weight is ours.tok_embeddings.weight


@pytest.mark.parametrize("splits", [[40], [1] * 40, [17, 1, 1, 5, 16], [20, 20]])
def test_kv_cached_decoding_equals_full_recompute(splits):
    _, ours = hf_pair(4, 2)
    tokens = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        full = ours(tokens)                                   # no cache: causal over all 40
        ours.setup_caches(max_batch_size=2, max_seq_len=64)
        pieces, pos = [], 0
        for n in splits:                                      # prefill, chunks, single tokens
            pieces.append(ours(tokens[:, pos:pos + n], pos))
            pos += n
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)


def test_last_only_returns_the_last_position():
    _, ours = hf_pair()
    tokens = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens, last_only=True), ours(tokens)[:, -1:])


def test_context_and_cache_limits():
    _, ours = hf_pair()
    with torch.no_grad():
        with pytest.raises(ContextLengthError, match="exceed the context of 128"):
            ours(torch.zeros(1, 129, dtype=torch.long))
        with pytest.raises(ArgumentError, match="needs a KV cache"):
            ours(torch.zeros(1, 2, dtype=torch.long), start_pos=3)
        ours.setup_caches(1, 16)
        with pytest.raises(ContextLengthError, match="exceed the context of 16"):
            ours(torch.zeros(1, 4, dtype=torch.long), start_pos=14)
        with pytest.raises(ArgumentError, match="batch size 2"):
            ours(torch.zeros(2, 4, dtype=torch.long))
        with pytest.raises(ArgumentError):
            ours.setup_caches(1, 1000)


def test_bfloat16_model_runs_and_returns_float32_logits():
    hf, ours = hf_pair()
    ours = ours.to(torch.bfloat16)
    tokens = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        got = ours(tokens)
        expected = hf(tokens).logits
    assert got.dtype == torch.float32
    assert (got - expected).abs().max() < 0.1


# ---- RoPE: the seeds' own checks ---------------------------------------------------------------

def test_freqs_cis_angles():
    # e^{i·m·θ_i} with θ_i = theta^(-2i/d): check a few entries against the formula directly.
    d, theta = 16, 10000.0
    fc = precompute_freqs_cis(d, 10, theta)
    assert fc.shape == (10, 8) and fc.dtype == torch.complex64
    for m, i in [(0, 0), (1, 0), (3, 5), (9, 7)]:
        angle = m * theta ** (-2 * i / d)
        assert abs(fc[m, i].real - torch.tensor(angle).cos()) < 1e-6
        assert abs(fc[m, i].imag - torch.tensor(angle).sin()) < 1e-6


def test_rope_equals_explicit_rotation_matrices():
    # Independent oracle: rotate each interleaved pair (x[2i], x[2i+1]) by a 2x2 matrix.
    d, T = 16, 7
    x = torch.randn(2, T, 3, d)
    theta_i = 10000.0 ** (-torch.arange(0, d, 2).double() / d)               # (d/2,)
    expected = torch.empty_like(x, dtype=torch.float64)
    for m in range(T):
        c, s = torch.cos(m * theta_i), torch.sin(m * theta_i)                # (d/2,)
        rotation = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)
        pairs = x[:, m].double().reshape(2, 3, d // 2, 2, 1)                 # (B, H, d/2, 2, 1)
        expected[:, m] = (rotation @ pairs).reshape(2, 3, d)
    got = apply_rotary_emb(x, precompute_freqs_cis(d, T))
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_model_to_bfloat16_keeps_exact_rope():
    _, ours = hf_pair()
    ours = ours.to(torch.bfloat16)
    rope = ours.rope[0]
    assert rope.freqs_cis.dtype == torch.complex64                      # not cast to bf16
    torch.testing.assert_close(rope.freqs_cis, precompute_freqs_cis(16, 128, 5000.0))


def test_rope_preserves_norms():
    x = torch.randn(1, 50, 4, 32)
    rotated = apply_rotary_emb(x, precompute_freqs_cis(32, 50))
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(rotated[:, 1:], x[:, 1:])                # it did rotate


def test_rotated_dot_products_depend_only_on_relative_position():
    q, k = torch.randn(32), torch.randn(32)
    fc = precompute_freqs_cis(32, 100)

    def rot(v, pos):
        return apply_rotary_emb(v.view(1, 1, 1, 32), fc[pos:pos + 1]).flatten()

    base = rot(q, 10) @ rot(k, 3)                                      # distance 7
    for m in (7, 20, 50, 92):
        torch.testing.assert_close(rot(q, m) @ rot(k, m - 7), base, atol=1e-4, rtol=1e-4)
    assert abs(rot(q, 10) @ rot(k, 5) - base) > 1e-3                  # distance 5 differs


def test_gqa_attention_equals_repeat_kv():
    q = torch.randn(2, 8, 5, 16)
    k, v = torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    expected = F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), is_causal=True)
    got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, expected)
    assert torch.equal(repeat_kv(k, 4)[:, 5], k[:, 1])                 # head 5 uses KV head 1


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_output_cross_entropy_equals_autograd(autocast):
    """forward(targets=...) = F.cross_entropy of forward()'s logits: same loss and gradients for
    every parameter (chunks smaller than B·T, a tied output matrix, bf16 autocast)."""
    import torch.nn.functional as F

    from torchllama.nn.loss import linear_cross_entropy
    from torchllama.train.optim import init_weights

    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, multiple_of=16,
                     max_seq_len=32, tie_embeddings=True)
    model = Transformer(args)
    init_weights(model, args.n_layers)
    tokens = torch.randint(0, 300, (3, 21))
    x, y = tokens[:, :-1], tokens[:, 1:]
    grads = []
    for fused in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if fused:
                loss = model(x, targets=y)
            else:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ref_loss, ref), (loss, got) = grads
    tol = 2e-2 if autocast else 1e-5
    assert loss == pytest.approx(ref_loss, rel=tol / 10)
    for name in ref:
        scale = ref[name].abs().max().item()
        assert (got[name] - ref[name]).abs().max().item() <= tol * scale + 1e-8, name
    # chunking does not change the result; shapes are checked
    h = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(5, 8, requires_grad=True)
    t = torch.randint(0, 5, (10,))
    a = linear_cross_entropy(h, w, t, chunk_size=3)
    b = F.cross_entropy(h @ w.t(), t)
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    # ignored targets (a chat prompt's), rows past their count included: every chunk is scored
    t[:6] = -100
    a = linear_cross_entropy(h, w, t, chunk_size=3)
    a.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b = F.cross_entropy(h2 @ w2.t(), t)
    b.backward()
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    assert torch.allclose(h.grad, h2.grad, atol=1e-6) and torch.allclose(w.grad, w2.grad, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        linear_cross_entropy(h, w[:, :4], t)


def test_real_arithmetic_rope_for_compile_equals_the_complex_product():
    # apply_rotary_emb with (cos, sin) pairs (what forward passes under torch.compile) computes
    # exactly Meta's complex multiplication, also with per-row positions (left padding)
    torch.manual_seed(0)
    table = precompute_freqs_cis(16, 32, 10000.0)                  # (32, 8) complex64
    x = torch.randn(3, 5, 4, 16)
    for freqs in (table[7:12], table[torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7],
                                                   [9, 9, 10, 11, 12]])]):
        expected = apply_rotary_emb(x, freqs)
        assert torch.equal(apply_rotary_emb(x, torch.view_as_real(freqs)), expected)
    model = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=50, max_seq_len=16))
    rope = model.rope[0]
    rope.for_compile(torch.device("cpu"))
    assert torch.equal(rope.freqs_cos_sin, torch.view_as_real(rope.freqs_cis))
    assert rope.freqs_cos_sin.shape == (16, 8, 2)


def test_the_rotations_table_grows_as_positions_are_asked_for_with_the_same_bits():
    """A long context's table starts at FIRST_ROWS positions and doubles when a later one is
    asked for, up to max_seq_len (Llama 3's scaling, 128k positions: not 33 MB at load); its
    rows are those of Meta's whole precomputed table, bit for bit."""
    scaling = {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_seq_len": 8192}
    rope = RotaryEmbedding(64, 20000, 500000.0, scaling)
    whole = precompute_freqs_cis(64, 20000, 500000.0, scaling)             # (S, 32) c64
    cpu = torch.device("cpu")
    assert rope.freqs_cis.shape[0] == RotaryEmbedding.FIRST_ROWS
    assert torch.equal(rope.span(10, 4096, cpu), whole[10:4096])
    assert rope.freqs_cis.shape[0] == 4096
    assert torch.equal(rope.span(4000, 4100, cpu), whole[4000:4100])       # doubled
    assert rope.freqs_cis.shape[0] == 8192
    positions = torch.tensor([[3, 17000, 9000]])
    assert torch.equal(rope(positions, 17001), whole[positions])            # to 17001
    assert rope.freqs_cis.shape[0] == 17001
    assert torch.equal(rope.table(cpu), whole) and rope.freqs_cis.shape[0] == 20000
    with pytest.raises(IndexError):
        rope.span(19990, 20001, cpu)[10]
