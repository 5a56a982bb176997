"""Every architecture choice of the zoo, on a tiny random model: KV-cached decoding in any chunking
equals recomputing the whole sequence, a left-padded batch equals each sequence alone (also
through the continuous-batching engine), sliding-window caches that hold only the window give
the same logits, and a few training steps lower the loss."""

from __future__ import annotations

import pytest
import torch

from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError
from torchllama.generation.session import SamplingParams, Session
from torchllama.model import Transformer
from torchllama.nn import SlidingWindowKVCache
from torchllama.train.optim import init_weights, make_optimizer

BASE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16,
            max_seq_len=160)

# name → ModelArgs changes from BASE (a tiny Llama)
VARIANTS: dict[str, dict] = {
    "llama": {},
    "layernorm": dict(norm="layernorm", norm_bias=True),
    "layernorm-no-bias": dict(norm="layernorm"),
    "rmsnorm-unit-offset": dict(norm_unit_offset=True),
    "post-norm": dict(norm_placement="post"),
    "sandwich": dict(norm_placement="sandwich"),
    "qk-norm": dict(qk_norm=True),
    "biases": dict(qkv_bias=True, out_bias=True, mlp_bias=True),
    "relu": dict(mlp="relu"),
    "gelu": dict(mlp="gelu"),
    "gelu-tanh": dict(mlp="gelu_tanh"),
    "geglu": dict(mlp="geglu"),
    "geglu-tanh": dict(mlp="geglu_tanh"),
    "parallel": dict(parallel_block=True),
    "sinusoidal": dict(position="sinusoidal"),
    "learned": dict(position="learned"),
    "t5-bias": dict(position="t5", t5_buckets=8, t5_max_distance=20),
    "alibi": dict(position="alibi"),
    "nope": dict(position="none"),
    "rope-linear": dict(rope_scaling={"type": "linear", "factor": 2.0}),
    "rope-ntk": dict(rope_scaling={"type": "ntk", "factor": 4.0}),
    "rope-dynamic": dict(rope_scaling={"type": "dynamic", "factor": 2.0,
                                       "original_max_seq_len": 160}),
    "rope-yarn": dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_seq_len": 40}),
    "rope-llama3": dict(rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_seq_len": 32}),
    "partial-rotary": dict(rotary_dim=8),
    "mha": dict(n_kv_heads=4),
    "mqa": dict(n_kv_heads=1),
    "head-dim": dict(head_dim=24),
    "sliding-window": dict(sliding_window=6),
    "local-global": dict(sliding_window=6, layer_types=["local", "global"],
                         rope_local_theta=1000.0),
    "softcap": dict(attn_logit_softcap=2.0, final_logit_softcap=3.0),
    "embed-scale": dict(embed_scale=True, attn_scale=0.3),
    "mla": dict(attention="mla", n_kv_heads=4, q_lora_rank=24, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12),
    "mla-full-rank-q": dict(attention="mla", n_kv_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                            qk_rope_head_dim=4, v_head_dim=12),
    "gemma3-like": dict(head_dim=32, norm_unit_offset=True, norm_placement="sandwich",
                        qk_norm=True, mlp="geglu_tanh", embed_scale=True,
                        attn_scale=32 ** -0.5, rope_local_theta=500.0, sliding_window=5,
                        layer_types=["local", "global"]),
    "gpt2-like": dict(norm="layernorm", norm_bias=True, mlp="gelu_tanh", position="learned",
                      qkv_bias=True, out_bias=True, mlp_bias=True, n_kv_heads=4,
                      tie_embeddings=True),
    "alibi-window-parallel": dict(position="alibi", sliding_window=7, parallel_block=True),
}


def make(name: str, seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    args = ModelArgs(**{**BASE, **VARIANTS[name], **changes})
    model = Transformer(args)
    init_weights(model, args.n_layers)
    with torch.no_grad():                  # norms and biases away from 1/0 as well
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for p in getattr(model, "position_bias", torch.nn.Module()).parameters():
            p.normal_(0, 0.5)
    return model.eval()


@pytest.mark.parametrize("name", VARIANTS)
def test_cached_decoding_in_any_chunking_equals_full_recompute(name):
    model = make(name)
    T = 110                                     # longer than the windows' rings (6 + 64)
    tokens = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)                    # no cache: causal over all T
        for splits in ([T], [1] * 30 + [80], [17, 1, 1, 5, 40, 1, 45]):
            model.setup_caches(max_batch_size=2, max_seq_len=150)
            pieces, pos = [], 0
            for n in splits:                    # prefill, chunks, single tokens
                pieces.append(model(tokens[:, pos:pos + n], pos))
                pos += n
            torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=2e-5, rtol=1e-4,
                                       msg=f"{name}, splits {splits[:4]}...")


def test_window_layers_hold_only_the_window():
    model = make("local-global")
    model.setup_caches(2, 150)
    local, full = model.caches
    assert isinstance(local, SlidingWindowKVCache) and local.k_cache.shape[2] == 6 + 64
    assert not isinstance(full, SlidingWindowKVCache) and full.k_cache.shape[2] == 150


def left_padded_greedy(model, prompts, n):
    """n greedy tokens per prompt from one left-padded batch: the model told each row's padding
    (`Transformer.forward(pad=...)`), one decode step for all rows at a time."""
    T = max(map(len, prompts))
    pad = torch.tensor([T - len(p) for p in prompts])                           # (B,)
    tokens = torch.tensor([[0] * (T - len(p)) + p for p in prompts])            # (B, T)
    model.setup_caches(len(prompts), T + n)
    columns = []
    with torch.inference_mode():
        logits = model(tokens, 0, pad=pad, last_only=True)[:, -1]              # (B, V)
        for step in range(n):
            next_ids = logits.argmax(dim=-1)                                    # (B,)
            columns.append(next_ids.tolist())
            logits = model(next_ids[:, None], T + step, pad=pad)[:, -1]
    return [list(row) for row in zip(*columns)]


@pytest.mark.parametrize("name", ["llama", "local-global", "alibi", "learned", "t5-bias",
                                  "mla", "sinusoidal", "rope-llama3", "gemma3-like"])
def test_left_padded_batch_equals_each_sequence_alone(name):
    model = make(name)
    prompts = [[5, 9, 13, 2, 7, 7, 1, 3, 40, 41, 42, 43], [8, 8], [3, 1, 4, 1, 5, 9, 2, 6]]
    batch = left_padded_greedy(model, prompts, 70)
    session = Session(model, tokenizer=None, max_seq_len=150)
    for prompt, tokens in zip(prompts, batch):
        alone = list(session.generate(prompt, 70, SamplingParams(), stop_ids=frozenset()))
        assert tokens == alone, name


def test_session_rewinds_within_the_window_margin_and_restarts_beyond_it():
    """A sliding-window cache keeps window + 64 slots: a new prompt sharing all but the last few
    cached tokens re-uses the cache; one that diverges further back starts over. Both give the
    tokens a fresh session gives."""
    model = make("local-global")
    session = Session(model, tokenizer=None, max_seq_len=150)
    greedy = SamplingParams()
    prompt = list(range(1, 91))
    first = list(session.generate(prompt, 20, greedy, stop_ids=frozenset()))
    for keep in (105, 40):                      # rewind 4 slots (kept) / 69 slots (restart)
        history = (prompt + first)[:keep] + [11, 12, 13]
        out = list(session.generate(history, 10, greedy, stop_ids=frozenset()))
        assert session.stats.prefilled_tokens == (3 if keep == 105 else len(history))
        fresh = Session(make("local-global"), tokenizer=None, max_seq_len=150)
        assert out == list(fresh.generate(history, 10, greedy, stop_ids=frozenset()))


@pytest.mark.parametrize("name", ["local-global", "alibi", "mla", "learned"])
def test_engine_batches_equal_single_requests(name):
    from torchllama.serving.engine import Engine, Request

    model = make(name)
    prompts = [list(range(3, 3 + n)) for n in (5, 80, 12, 33)]
    session = Session(model, tokenizer=None, max_seq_len=model.args.max_seq_len)
    expected = [list(session.generate(p, 30, SamplingParams(), stop_ids=frozenset()))
                for p in prompts]
    engine = Engine(model, max_batch_size=3).start()
    results = {i: [] for i in range(len(prompts))}
    done = {}
    try:
        for i, p in enumerate(prompts):
            engine.submit(Request(p, 30, SamplingParams(), frozenset(),
                                  on_token=lambda e, i=i: results[i].append(e.token_id),
                                  on_finish=lambda r, i=i: done.__setitem__(i, r)))
        import time
        deadline = time.monotonic() + 120
        while len(done) < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        engine.shutdown()
    assert done == {i: "length" for i in range(len(prompts))}
    assert [results[i] for i in range(len(prompts))] == expected, name


@pytest.mark.parametrize("name", VARIANTS)
def test_training_steps_lower_the_loss(name):
    model = make(name).train()
    optimizer = make_optimizer(model, lr=3e-3, weight_decay=0.0)
    batch = torch.randint(0, 97, (4, 33), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(8):
        loss = model(batch[:, :-1], targets=batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, (name, losses)


def test_fused_loss_with_final_softcap_equals_autograd():
    import torch.nn.functional as F

    model = make("softcap").train()
    tokens = torch.randint(0, 97, (2, 21))
    x, y = tokens[:, :-1], tokens[:, 1:]
    grads = []
    for fused in (False, True):
        model.zero_grad()
        loss = model(x, targets=y) if fused else F.cross_entropy(model(x).flatten(0, 1),
                                                                  y.flatten())
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ref_loss, ref), (loss, got) = grads
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=1e-4, msg=name)


def test_init_gives_norms_their_neutral_values():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**{**BASE, **VARIANTS["gemma3-like"]}))
    init_weights(model, 2)
    assert torch.all(model.layers[0].attention_norm.weight == 0)      # (1 + w) gains: w = 0
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**{**BASE, **VARIANTS["gpt2-like"]}))
    init_weights(model, 2)
    assert torch.all(model.layers[1].ffn_norm.weight == 1) and torch.all(model.norm.bias == 0)
    assert torch.all(model.layers[0].attention.wq.bias == 0)
    std = model.layers[0].feed_forward.w2.weight.std().item()
    assert std == pytest.approx(0.02 / 2, rel=0.15)                   # 0.02 / √(2·n_layers)


# ---- bad configurations: one line naming the field and what it must be -----------------------

@pytest.mark.parametrize("changes, message", [
    (dict(n_heads=5), r"n_heads \(5\) must divide dim \(64\)"),
    (dict(n_kv_heads=3), r"n_kv_heads \(3\) must divide n_heads \(4\)"),
    (dict(norm="batchnorm"), r"norm must be one of rmsnorm, layernorm; got 'batchnorm'"),
    (dict(mlp="swish"), r"mlp must be one of swiglu, geglu, geglu_tanh, relu, gelu, gelu_tanh"),
    (dict(position="xpos"), r"position must be one of rope, sinusoidal, learned, t5, alibi, none"),
    (dict(norm_placement="middle"), r"norm_placement must be one of pre, post, sandwich"),
    (dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
          v_head_dim=8), r"n_kv_heads must equal n_heads with attention: mla"),
    (dict(attention="mla", n_kv_heads=4), r"kv_lora_rank is required with attention: mla"),
    (dict(kv_lora_rank=16), r"kv_lora_rank needs attention: mla"),
    (dict(position="alibi", rope_scaling={"type": "linear", "factor": 2}),
     r"rope_scaling needs position: rope; got position 'alibi'"),
    (dict(rope_scaling={"type": "rotary", "factor": 2}),
     r"rope_scaling must be a mapping with type one of linear, ntk, dynamic, yarn, llama3"),
    (dict(rope_scaling={"type": "yarn", "factor": 2}),
     r"rope_scaling of type 'yarn' needs factor, original_max_seq_len"),
    (dict(rope_scaling={"type": "linear", "factor": 2, "beta": 1}), r"got unknown beta"),
    (dict(layer_types=["local", "global"]), r"layer_types has local layers but sliding_window"),
    (dict(layer_types=["global"]), r"layer_types must be a list of 2 \(n_layers\) values"),
    (dict(norm_bias=True), r"norm_bias needs norm: layernorm"),
    (dict(parallel_block=True, norm_placement="post"), r"parallel_block needs norm_placement"),
    (dict(rotary_dim=7), r"rotary_dim must be even"),
    (dict(attn_logit_softcap=-1.0), r"attn_logit_softcap must be a number > 0"),
    (dict(sliding_window=0), r"sliding_window must be a positive integer"),
])
def test_inconsistent_configs_are_refused_with_one_line(changes, message):
    with pytest.raises(ArgumentError, match=message) as e:
        ModelArgs(**{**BASE, **changes})
    assert "\n" not in str(e.value)
