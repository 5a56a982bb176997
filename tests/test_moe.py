"""The mixture-of-experts feed-forward (`torchllama.nn.moe`) against transformers' own blocks —
Mixtral's, Qwen3-MoE's (renormalized or not), OLMoE's (softmax top-k) and DeepSeek-V3's
(sigmoid scores, a correction bias, group-limited choice, shared experts, routed scaling) —
on the same weights; a token's output the same bits alone and in any batch; the decoder with
MoE layers (dense first layers) decoding step by step as it computes whole sequences."""

from __future__ import annotations

import pytest
import torch

from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError
from torchllama.model import Transformer
from torchllama.nn.moe import MoE

transformers = pytest.importorskip("transformers")

D, F_, E = 64, 64, 8   # (F a multiple of 32: torch's element-wise SiLU runs 32 floats a step,
#                        and a row shorter than that meets its scalar tail, other bits)
SMALL = dict(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=300, max_position_embeddings=64)


def ours_like(hf_block, **moe) -> MoE:
    """Our MoE with `hf_block`'s weights (router, 3-D experts split into each expert's
    w1/w3/w2, shared experts)."""
    args = ModelArgs(dim=D, n_layers=1, n_heads=4, vocab_size=300, hidden_dim=F_,
                     n_experts=E, **moe)
    ours = MoE(args).eval()
    gate_up, down = hf_block.experts.gate_up_proj.detach(), hf_block.experts.down_proj.detach()
    with torch.no_grad():
        ours.gate.weight.copy_(hf_block.gate.weight)
        for e, expert in enumerate(ours.experts):           # (E, 2F, D): gate rows, then up
            expert.w1.weight.copy_(gate_up[e, :F_])
            expert.w3.weight.copy_(gate_up[e, F_:])
            expert.w2.weight.copy_(down[e])                 # (E, D, F)
        if hasattr(hf_block.gate, "e_score_correction_bias"):
            ours.e_score_correction_bias.copy_(hf_block.gate.e_score_correction_bias)
        shared = getattr(hf_block, "shared_experts", None)
        if shared is not None:
            ours.shared_experts.w1.weight.copy_(shared.gate_proj.weight)
            ours.shared_experts.w3.weight.copy_(shared.up_proj.weight)
            ours.shared_experts.w2.weight.copy_(shared.down_proj.weight)
    return ours


def randomized(block, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in block.named_buffers():
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return block.eval()


def _same_output(hf_block, ours, atol=1e-5):
    """(float32 products summed in other orders: within 1e-5 of outputs of order 1)"""
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_block(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        torch.testing.assert_close(ours(x), expected, atol=atol, rtol=0)


def test_mixtral_softmax_top2_renormalized():
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(**SMALL, intermediate_size=F_, num_local_experts=E,
                                        num_experts_per_tok=2)
    hf = randomized(MixtralSparseMoeBlock(config))
    _same_output(hf, ours_like(hf, n_experts_per_token=2))


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_top_k_with_and_without_renormalizing(norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(**SMALL, moe_intermediate_size=F_, num_experts=E,
                                         num_experts_per_tok=3, norm_topk_prob=norm)
    hf = randomized(Qwen3MoeSparseMoeBlock(config))
    _same_output(hf, ours_like(hf, n_experts_per_token=3, moe_norm_topk=norm))


def test_olmoe_keeps_the_softmax_weights():
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    config = transformers.OlmoeConfig(**SMALL, intermediate_size=F_, num_experts=E,
                                      num_experts_per_tok=2)
    assert not config.norm_topk_prob
    hf = randomized(OlmoeSparseMoeBlock(config))
    _same_output(hf, ours_like(hf, n_experts_per_token=2, moe_norm_topk=False))


@pytest.mark.parametrize("groups, group_topk, norm", [(4, 2, True), (2, 1, False), (1, 1, True)])
def test_deepseek_v3_sigmoid_grouped_routing_and_shared_experts(groups, group_topk, norm):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = transformers.DeepseekV3Config(
        **SMALL, moe_intermediate_size=F_, n_routed_experts=E, num_experts_per_tok=2,
        n_group=groups, topk_group=group_topk, n_shared_experts=1, norm_topk_prob=norm,
        routed_scaling_factor=2.5)
    hf = randomized(DeepseekV3MoE(config))
    _same_output(hf, ours_like(hf, n_experts_per_token=2, moe_router="sigmoid",
                               moe_groups=groups, moe_group_topk=group_topk,
                               moe_norm_topk=norm, moe_scale=2.5, n_shared_experts=1))


def test_a_tokens_output_is_the_same_bits_in_any_batch():
    args = ModelArgs(dim=D, n_layers=1, n_heads=4, vocab_size=300, hidden_dim=F_, n_experts=E,
                     n_experts_per_token=2)
    torch.manual_seed(0)
    moe = MoE(args).eval()
    x = torch.randn(1, 9, D)
    with torch.inference_mode():
        alone = moe(x[:, 4:5])
        in_batch = moe(x)[:, 4:5]
        mixed = moe(torch.cat([torch.randn(5, 1, D), x[:, 4:5]], dim=0))[-1:]
    assert torch.equal(alone, in_batch) and torch.equal(alone, mixed)


def test_decoder_with_moe_layers_decodes_as_it_computes_whole():
    torch.manual_seed(0)
    args = ModelArgs(dim=D, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=300, hidden_dim=96,
                     n_experts=E, n_experts_per_token=2, moe_hidden_dim=F_, first_dense_layers=1,
                     max_seq_len=64)
    model = Transformer(args).eval()
    assert type(model.layers[0].feed_forward).__name__ == "FeedForward"
    assert isinstance(model.layers[1].feed_forward, MoE)
    tokens = torch.randint(0, 300, (1, 12))
    with torch.inference_mode():
        whole = model(tokens)[0]
        model.setup_caches(1, 64)
        steps = [model(tokens[:, :8], 0)[0]]
        steps += [model(tokens[:, i:i + 1], i)[0] for i in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fields, field", [
    (dict(n_experts=4, n_experts_per_token=5), "n_experts_per_token"),
    (dict(n_experts=4, moe_router="noisy"), "moe_router"),
    (dict(n_experts=6, moe_groups=4), "moe_groups"),
    (dict(n_experts=4, mlp="gelu"), "n_experts"),
    (dict(n_experts=-1), "n_experts"),
])
def test_bad_moe_fields_name_the_field(fields, field):
    with pytest.raises(ArgumentError, match=f"ModelArgs.{field}"):
        ModelArgs(dim=D, n_layers=1, n_heads=4, vocab_size=300, **fields)


@pytest.mark.parametrize("experts, message", [(2, "unexpected tensor 'model.layers.0.block_"
                                                  "sparse_moe.experts.2.w1.weight'"),
                                              (6, "block_sparse_moe.gate.weight. has shape "
                                                  r"\(4, 64\), expected \(6, 64\)")])
def test_an_expert_count_that_does_not_match_the_files_names_the_tensor(tmp_path, experts,
                                                                        message):
    import json

    import torchllama
    from torchllama.errors import ModelFileError
    from tests.test_gemma3 import tiny_sp_tokenizer

    config = transformers.MixtralConfig(**SMALL, intermediate_size=F_, num_local_experts=4,
                                        num_experts_per_tok=2)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path)
    tiny_sp_tokenizer(300).save_hf(tmp_path)
    assert torchllama.load(tmp_path, progress=False)[0].args.n_experts == 4
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "num_local_experts": experts}))
    with pytest.raises(ModelFileError, match=message):
        torchllama.load(tmp_path, progress=False)


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral", "olmoe"])
def test_llama_cpp_computes_our_moe_gguf_files_as_we_do(tmp_path, name):
    """Our float32 GGUF of a random Qwen3-MoE (`qwen3moe`) and Mixtral (`llama` with experts):
    llama.cpp (llama-cpp-python, `make bench-peer`) gives the same logits within 1e-3 and the
    same top-1 token at every position."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np

    import torchllama
    from tests.test_gguf_families import OLMOE, SMALL, random_model, tiny_bpe_tokenizer, tokens

    tok = tiny_bpe_tokenizer(tmp_path)
    fields = dict(SMALL, n_experts=4, n_experts_per_token=2)
    if name == "qwen3moe":
        fields.update(qk_norm=True, head_dim=128, moe_hidden_dim=768)
    if name == "olmoe":
        fields.update(OLMOE, n_experts=4, n_experts_per_token=2)
    model = random_model(fields)
    torchllama.save(model, tok, tmp_path / "m.gguf", to="gguf", progress=False)
    ids = tokens(40)[0].tolist()
    llm = llama_cpp.Llama(str(tmp_path / "m.gguf"), n_ctx=64, logits_all=True, verbose=False,
                          n_threads=2)
    llm.eval(ids)
    theirs = np.array(llm.scores[:len(ids)])
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0].numpy()
    assert np.abs(theirs - ours).max() < 1e-3
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()
