"""The variant zoo against independent oracles: transformers' own implementations of GPT-2, Qwen2,
Mistral, Gemma 2, Gemma 3, DeepSeek-V3 (MLA), MPT (ALiBi), GPT-J (parallel block, partial
RoPE), Llama with each RoPE scaling, T5's attention; transformers' RoPE initialisation functions;
the formulas of the papers (ALiBi slopes, sinusoidal embeddings); and published parameter
counts. Random tiny weights, logits within 1e-5 in float32.

Weights go from the transformers model into ours through the family adapters
(`torchllama.families`), the same tables the loaders use.
"""

from __future__ import annotations

import math

import pytest
import torch

from torchllama.checkpoint.hf import from_hf_state_dict
from torchllama.config import ModelArgs, get_preset
from torchllama.families import DEEPSEEK_V3, LLAMA, family_for_hf
from torchllama.families.base import hf_rope
from torchllama.model import Transformer
from torchllama.nn import alibi_slopes, rope_inv_freq, sinusoidal_embeddings
from torchllama.nn.position import t5_relative_position_bucket

transformers = pytest.importorskip("transformers")


def perturbed(hf_model, seed: int = 0):
    """A transformers model whose every parameter is moved off its init (norm gains ≠ 1,
    biases ≠ 0), in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return hf_model.eval()


def ours_from(hf_model, family=None) -> Transformer:
    """Our model from a transformers model: its config through the family's args_from_hf, its
    weights through the family's table. (Mixtures of experts: transformers keeps experts fused
    in memory but saves one tensor per expert, as the hub's files are: through its
    `save_pretrained` and our loader.)"""
    config = hf_model.config.to_dict()
    family = family or family_for_hf(config, "config")
    args = family.args_from_hf(config, "config.json")
    state = hf_model.state_dict()
    if args.n_experts:
        import tempfile

        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory() as tmp:
            hf_model.save_pretrained(tmp)
            state = load_file(f"{tmp}/model.safetensors")
    model = Transformer(args).eval()
    model.load_state_dict(from_hf_state_dict(family, state, args), strict=True)
    return model


def assert_same_logits(hf_model, ours, T: int = 40, atol: float = 1e-5, batch: int = 2):
    tokens = torch.randint(0, ours.args.vocab_size, (batch, T),
                           generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        got = ours(tokens)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)


def test_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=300,
                                     n_positions=64, attn_implementation="eager")
    hf = perturbed(transformers.GPT2LMHeadModel(config))
    ours = ours_from(hf)
    assert ours.args.position == "learned" and ours.args.norm == "layernorm"
    assert ours.output.weight is ours.tok_embeddings.weight
    assert_same_logits(hf, ours, T=50)


def test_qwen2_biases_on_qkv():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=300, max_position_embeddings=128,
                                      rope_theta=5000.0)
    hf = perturbed(transformers.Qwen2ForCausalLM(config))
    ours = ours_from(hf)
    assert ours.args.qkv_bias and not ours.args.out_bias
    assert ours.layers[0].attention.wq.bias is not None and ours.layers[0].attention.wo.bias is None
    assert_same_logits(hf, ours)


@pytest.mark.parametrize("bias", [False, True])
def test_qwen3_qk_norm_and_head_dim(bias):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                      vocab_size=300, max_position_embeddings=128,
                                      rope_theta=5000.0, attention_bias=bias)
    hf = perturbed(transformers.Qwen3ForCausalLM(config))       # q/k norm gains ≠ 1
    ours = ours_from(hf)
    assert ours.args.qk_norm and ours.args.head_dim == 24 and ours.args.qkv_bias == bias
    assert_same_logits(hf, ours)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mixtral", "olmoe"])
def test_greedy_continuation_equals_transformers(name):
    torch.manual_seed(1)
    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                 max_position_embeddings=128)
    hf = perturbed({
        "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **small, head_dim=32, tie_word_embeddings=True)),
        "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **small, head_dim=32, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=False)),
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **small, num_local_experts=4, num_experts_per_tok=2)),
        "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **small, num_experts=4, num_experts_per_tok=2)),
    }[name]())
    ours = ours_from(hf)
    prompt = torch.tensor([[5, 17, 42, 7]])
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=32, do_sample=False)[0, 4:].tolist()
        tokens = prompt
        for _ in range(32):
            tokens = torch.cat([tokens, ours(tokens)[:, -1:].argmax(-1)], dim=1)
    assert tokens[0, 4:].tolist() == expected


@pytest.mark.parametrize("window", [6, 200])
def test_mistral_sliding_window(window):
    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1,
                                        vocab_size=300, max_position_embeddings=128,
                                        sliding_window=window, attn_implementation="eager")
    hf = perturbed(transformers.MistralForCausalLM(config))
    ours = ours_from(hf)
    assert ours.args.sliding_window == window
    assert_same_logits(hf, ours, T=40)


def _gemma2_config(**changes):
    return transformers.Gemma2Config(**{**dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=300, max_position_embeddings=128,
        sliding_window=7, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0, attn_implementation="eager"), **changes})


def test_gemma2_sandwich_softcap_local_global():
    torch.manual_seed(0)
    hf = perturbed(transformers.Gemma2ForCausalLM(_gemma2_config()))
    ours = ours_from(hf)
    a = ours.args
    assert (a.norm_placement, a.norm_unit_offset, a.mlp, a.embed_scale) == \
        ("sandwich", True, "geglu_tanh", True)
    assert a.layer_types == ["local", "global", "local", "global"]
    assert a.attn_scale == pytest.approx(24 ** -0.5)
    assert_same_logits(hf, ours, T=30)


def test_gemma3_qk_norm_and_two_rope_bases():
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, vocab_size=300, max_position_embeddings=128,
        sliding_window=5, query_pre_attn_scalar=32, layer_types=None,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}},
        attn_implementation="eager")
    hf = perturbed(transformers.Gemma3ForCausalLM(config))
    ours = ours_from(hf)
    a = ours.args
    assert a.qk_norm and a.rope_local_theta == 300.0 and a.rope_theta == 100000.0
    assert a.rope_scaling == {"type": "linear", "factor": 2.0}
    assert a.layer_types == ["local"] * 5 + ["global"]
    assert_same_logits(hf, ours, T=30)


def test_gemma_embedding_scale_is_rounded_to_the_dtype():
    # Gemma multiplies by √dim cast to the embedding dtype (bf16: √64 = 8 exactly, √640 rounds)
    args = ModelArgs(dim=640, n_layers=1, n_heads=4, head_dim=32, vocab_size=10, embed_scale=True,
                     max_seq_len=8)
    model = Transformer(args).to(torch.bfloat16)
    with torch.no_grad():
        model.tok_embeddings.weight.fill_(1.0)
        h = model.tok_embeddings(torch.tensor([[1]])) * torch.tensor(640 ** 0.5,
                                                                      dtype=torch.bfloat16)
    assert h[0, 0, 0].item() == torch.tensor(640 ** 0.5).to(torch.bfloat16).item() == 25.25


@pytest.mark.parametrize("q_lora_rank, scaling", [
    (24, None),
    (None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
])
def test_deepseek_v3_multi_head_latent_attention(q_lora_rank, scaling):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=300, max_position_embeddings=128,
        q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=12, first_k_dense_replace=2, n_routed_experts=4, rope_parameters=scaling,
        attn_implementation="eager")
    hf = perturbed(transformers.DeepseekV3ForCausalLM(config))
    ours = ours_from(hf)
    assert ours.args.attention == "mla" and ours.args.kv_lora_rank == 16
    assert_same_logits(hf, ours, T=40)
    # The KV cache holds only c_kv (16) and the shared RoPE key (4) per token
    ours.setup_caches(1, 64)
    assert ours.caches[0].k_cache.shape == (1, 1, 64, 16)
    assert ours.caches[0].v_cache.shape == (1, 1, 64, 4)


def test_deepseek_v2_routers_are_refused():
    from torchllama.errors import ModelFileError

    config = transformers.DeepseekV3Config(num_hidden_layers=4, first_k_dense_replace=1)
    assert DEEPSEEK_V3.args_from_hf(config.to_dict(), "config.json").n_experts == 256
    with pytest.raises(ModelFileError, match="scoring_func 'softmax'"):
        DEEPSEEK_V3.args_from_hf({**config.to_dict(), "scoring_func": "softmax"}, "config.json")


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
])
def test_llama_rope_scaling(scaling):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
        rope_parameters={**scaling, "rope_theta": 500.0})
    hf = perturbed(transformers.LlamaForCausalLM(config))
    ours = ours_from(hf, LLAMA)
    assert ours.args.rope_scaling["type"] == scaling["rope_type"]
    # past the original 16 positions (yarn, llama3); dynamic NTK: past the trained 64, where
    # it rescales (its context becomes 2 × 64)
    dynamic = scaling["rope_type"] == "dynamic"
    assert ours.args.max_seq_len == (128 if dynamic else 64)
    assert_same_logits(hf, ours, T=100 if dynamic else 60)


@pytest.mark.parametrize("kind, params", [
    ("linear", {"factor": 3.0}),
    ("dynamic", {"factor": 2.0}),
    ("yarn", {"factor": 8.0, "original_max_position_embeddings": 64}),
    ("yarn", {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
              "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.3}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
])
def test_rope_inverse_frequencies_equal_transformers_init_functions(kind, params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2,
                                      max_position_embeddings=128,
                                      rope_parameters={"rope_type": kind, "rope_theta": 10000.0,
                                                       **params})
    theta, scaling, _ = hf_rope(config.rope_parameters, None, 128, "config")
    for seq_len in ([None, 100, 300] if kind == "dynamic" else [None]):
        expected, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
        got, our_factor = rope_inv_freq(128, theta, scaling, seq_len=seq_len)
        torch.testing.assert_close(got, expected.float(), atol=0, rtol=1e-6)
        assert our_factor == pytest.approx(factor)


def test_ntk_aware_base_is_bloc97s_formula():
    inv, _ = rope_inv_freq(64, 10000.0, {"type": "ntk", "factor": 4.0})
    base = 10000.0 * 4.0 ** (64 / 62)
    expected = torch.tensor([base ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    torch.testing.assert_close(inv.double(), expected, rtol=1e-6, atol=0)
    assert inv[0] == 1.0 and inv[-1] == pytest.approx(10000.0 ** (-62 / 64) / 4.0, rel=1e-5)


@pytest.mark.parametrize("n_heads, dim", [(8, 64), (12, 96), (20, 80)])
def test_mpt_alibi_whole_model(n_heads, dim):
    torch.manual_seed(0)
    config = transformers.MptConfig(d_model=dim, n_heads=n_heads, n_layers=2, vocab_size=300,
                                    max_seq_len=64)
    hf = perturbed(transformers.MptForCausalLM(config))
    ours = ours_from(hf)
    assert ours.args.position == "alibi" and ours.args.norm == "layernorm"
    assert_same_logits(hf, ours, T=40)


def _paper_alibi_slopes(n: int) -> list[float]:
    # Press et al. 2022, the authors' get_slopes (github.com/ofirpress/attention_with_linear_biases)
    def get_slopes_power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (get_slopes_power_of_2(closest_power_of_2)
            + _paper_alibi_slopes(2 * closest_power_of_2)[0::2][:n - closest_power_of_2])


@pytest.mark.parametrize("n_heads", [8, 12, 20])
def test_alibi_slopes_and_biases_are_the_papers(n_heads):
    from torchllama.nn import ALiBi

    slopes = alibi_slopes(n_heads)
    assert slopes.tolist() == pytest.approx(_paper_alibi_slopes(n_heads), rel=1e-6)
    if n_heads == 8:
        assert slopes.tolist() == pytest.approx([2 ** -k for k in range(1, 9)])
    bias = ALiBi(n_heads)(torch.arange(5, 8), torch.arange(8))          # (1, H, 3, 8)
    for h in range(n_heads):
        for i, q in enumerate(range(5, 8)):
            for k in range(8):
                assert bias[0, h, i, k].item() == pytest.approx(-slopes[h].item() * (q - k))


def test_t5_buckets_equal_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 300)[:, None] - torch.arange(0, 2)[None, :]
    for buckets, distance in ((32, 128), (8, 20)):
        for bidirectional in (False, True):
            expected = T5Attention._relative_position_bucket(
                rel, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance)
            got = t5_relative_position_bucket(rel, bidirectional, buckets, distance)
            assert torch.equal(got, expected)
    # unidirectional: all keys at or before the query, all buckets used
    got = t5_relative_position_bucket(-torch.arange(0, 400), False, 32, 128)
    assert got[:16].tolist() == list(range(16)) and got.max() == 31 and got.min() == 0


def test_t5_relative_bias_attention_equals_t5_attention():
    """Our attention with position "t5" (scale 1 and no RoPE, as T5) against transformers'
    T5Attention of a decoder layer, with a causal mask, the same weights."""
    from transformers.models.t5.modeling_t5 import T5Attention

    torch.manual_seed(0)
    config = transformers.T5Config(d_model=64, d_kv=16, num_heads=4, is_decoder=True,
                                   relative_attention_num_buckets=8,
                                   relative_attention_max_distance=20, dropout_rate=0.0)
    t5 = perturbed(T5Attention(config, has_relative_attention_bias=True))
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=300, position="t5", t5_buckets=8,
                     t5_max_distance=20, attn_scale=1.0, max_seq_len=64)
    ours = Transformer(args).eval()
    attention = ours.layers[0].attention
    with torch.no_grad():
        for mine, theirs in ((attention.wq, t5.q), (attention.wk, t5.k), (attention.wv, t5.v),
                             (attention.wo, t5.o)):
            mine.weight.copy_(theirs.weight)
        ours.position_bias.weight.copy_(t5.relative_attention_bias.weight)
    x = torch.randn(2, 30, 64)
    causal = torch.full((30, 30), float("-inf")).triu(1)[None, None]      # (1, 1, T, S)
    with torch.no_grad():
        expected = t5(x, mask=causal)[0]
        inputs = ours._attention_inputs(x.device, 1, 0, 30, None, None, None)[0]
        got = attention(x, inputs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_gptj_parallel_block_with_partial_interleaved_rope():
    """GPT-J: x + Attn(LN(x)) + MLP(LN(x)), RoPE on the first rotary_dim dims of each head in
    Meta's interleaved layout, LayerNorm and MLP biases. Its lm_head has a bias, which our
    output projection has not: the test sets it to 0. (Names mapped here: GPT-J is not a
    family torchllama loads.)"""
    torch.manual_seed(0)
    config = transformers.GPTJConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                     vocab_size=300, n_positions=64)
    hf = perturbed(transformers.GPTJForCausalLM(config))
    with torch.no_grad():
        hf.lm_head.bias.zero_()
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=300, max_seq_len=64,
                     norm="layernorm", norm_bias=True, parallel_block=True, rotary_dim=8,
                     mlp="gelu_tanh", mlp_bias=True, hidden_dim=256)
    sd = hf.state_dict()
    names = {"tok_embeddings.weight": "transformer.wte.weight",
             "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias",
             "output.weight": "lm_head.weight"}
    for i in range(2):
        h, l = f"transformer.h.{i}.", f"layers.{i}."
        names.update({l + "attention_norm.weight": h + "ln_1.weight",
                      l + "attention_norm.bias": h + "ln_1.bias",
                      l + "attention.wq.weight": h + "attn.q_proj.weight",
                      l + "attention.wk.weight": h + "attn.k_proj.weight",
                      l + "attention.wv.weight": h + "attn.v_proj.weight",
                      l + "attention.wo.weight": h + "attn.out_proj.weight"})
        for ours_name, theirs in (("w1", "fc_in"), ("w2", "fc_out")):
            for p in ("weight", "bias"):
                names[f"{l}feed_forward.{ours_name}.{p}"] = f"{h}mlp.{theirs}.{p}"
    ours = Transformer(args).eval()
    ours.load_state_dict({k: sd[v] for k, v in names.items()}, strict=True)
    assert_same_logits(hf, ours, T=40)


def test_sinusoidal_embeddings_are_vaswanis_formula():
    table = sinusoidal_embeddings(50, 16)
    for pos in (0, 1, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def _count(args: ModelArgs) -> int:
    with torch.device("meta"):
        model = Transformer(args)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset, expected", [
    ("gpt2-124m", 124_439_808),        # GPT-2 small (OpenAI's 124M, tied, 1024 positions)
    ("gemma3-270m", 268_098_176),      # google/gemma-3-270m
    ("gemma2-2b", 2_614_341_888),      # google/gemma-2-2b
    ("qwen2-0.5b", 494_032_768),       # Qwen/Qwen2-0.5B
    ("mistral-7b", 7_241_732_096),     # mistralai/Mistral-7B-v0.1
    ("llama3.1-8b", 8_030_261_248),    # meta-llama/Llama-3.1-8B
    ("qwen3-0.6b", 596_049_920),       # Qwen/Qwen3-0.6B
    ("mixtral-8x7b", 46_702_792_704),  # mistralai/Mixtral-8x7B-v0.1
    ("qwen3-30b-a3b", 30_532_122_624),  # Qwen/Qwen3-30B-A3B
    ("olmoe-1b-7b", 6_919_161_856),     # allenai/OLMoE-1B-7B-0924
    # deepseek-ai/DeepSeek-V3 without its MTP module: 671,026,419,200 in its files, which also
    # hold the 58 × 256 routers' correction biases (a buffer here, not a parameter)
    ("deepseek-v3", 671_026_419_200 - 58 * 256),
    # deepseek-ai/DeepSeek-V2-Lite: "15.7B total" (its softmax router has no correction bias)
    ("deepseek-v2-lite", 15_706_484_224),
])
def test_parameter_counts_of_published_configurations(preset, expected):
    assert _count(get_preset(preset)) == expected


@pytest.mark.parametrize("preset, active", [
    ("mixtral-8x7b", 12_879_925_248),   # "12.9B active" (Mistral AI)
    ("qwen3-30b-a3b", 3_353_032_704),   # "3.3B activated" (Qwen3 report)
    ("olmoe-1b-7b", 1_282_017_280),     # "1.3B active" (OLMoE paper)
    ("deepseek-v3", 37_552_282_624),    # "37B activated" (DeepSeek-V3 report)
    # "2.4B activated" (DeepSeek-V2 report): 2,451,435,008 without the input embeddings
    ("deepseek-v2-lite", 2_661_150_208),
    ("qwen3-0.6b", 596_049_920),        # dense: all of them
])
def test_active_parameters_of_mixtures_of_experts(preset, active):
    from torchllama.model import parameter_counts

    total, got = parameter_counts(get_preset(preset))
    assert got == active and total == _count(get_preset(preset))


def test_info_prints_total_and_active_parameters(capsys):
    from torchllama.cli import main

    assert main(["info", "--preset", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    assert "61 layers (3 dense, 58 mixture of experts)" in out and "MLA" in out
    assert "671,026,404,352" in out and "37,552,282,624" in out and "8 of 256 experts + 1 " \
        "shared" in out
    assert main(["info", "--preset", "nope"]) == 1


def test_deepseek_v3_attention_parameters_per_layer():
    # q_a 7168·1536 + q_a_norm 1536 + q_b 1536·(128·192) + kv_a 7168·576 + kv_a_norm 512
    # + kv_b 512·(128·256) + o 128·128·7168 = 187,107,328 (DeepSeek-V3's config.json)
    args = get_preset("deepseek-v3")
    with torch.device("meta"):
        attention = Transformer(args.replace(n_layers=1)).layers[0].attention
    assert sum(p.numel() for p in attention.parameters()) == 187_107_328


def _tiny_hf_models():
    """(name, transformers model) of every family torchllama writes, tiny and random."""
    torch.manual_seed(0)
    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                 max_position_embeddings=64)
    return [
        ("llama", transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **small, rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 16,
                                      "rope_theta": 500.0}))),
        ("qwen2", transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small))),
        ("qwen3", transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**small, head_dim=32))),
        ("mixtral", transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **{**small, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2))),
        ("qwen3_moe", transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **small, head_dim=32, num_experts=6, num_experts_per_tok=3,
            moe_intermediate_size=32, norm_topk_prob=True))),
        ("olmoe", transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **{**small, "intermediate_size": 64}, num_experts=4, num_experts_per_tok=2))),
        ("mistral", transformers.MistralForCausalLM(transformers.MistralConfig(
            **small, sliding_window=6))),
        ("gemma2", transformers.Gemma2ForCausalLM(_gemma2_config())),
        ("gemma3", transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **{**small, "num_hidden_layers": 3}, head_dim=32, sliding_window=5,
            sliding_window_pattern=3))),
        ("gpt2", transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=64))),
        ("deepseek_v3", transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **{**small, "num_key_value_heads": 4}, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, first_k_dense_replace=2))),
        ("deepseek_v3", transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **{**small, "num_key_value_heads": 4, "num_hidden_layers": 3}, q_lora_rank=24,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
            first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
            routed_scaling_factor=2.5))),
        ("mpt", transformers.MptForCausalLM(transformers.MptConfig(
            d_model=64, n_heads=4, n_layers=2, vocab_size=300, max_seq_len=64))),
    ]


@pytest.mark.parametrize("name, hf", _tiny_hf_models(), ids=lambda x: x if isinstance(x, str)
                         else "")
def test_our_hf_export_loads_in_transformers_with_the_same_logits(tmp_path, name, hf):
    """transformers model → ours (family adapter) → our HF writer → transformers' own loader:
    the family is recognised and both give the same logits."""
    from torchllama.checkpoint.hf import save_hf

    hf = perturbed(hf.float(), seed=1)
    ours = ours_from(hf)
    save_hf(ours, tmp_path, torch.float32, bos_id=1, eos_id=2)
    config = __import__("json").loads((tmp_path / "config.json").read_text())
    assert family_for_hf(config, "config.json").name == name
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert_same_logits(back, ours, T=30)


@pytest.mark.parametrize("name, hf", _tiny_hf_models(), ids=lambda x: x if isinstance(x, str)
                         else "")
def test_transformers_save_pretrained_loads_with_the_same_logits(tmp_path, name, hf):
    """transformers' own `save_pretrained` of each family (config.json + safetensors) →
    `torchllama.load` (format detection, the family's adapter, strict names and shapes): the
    same logits."""
    import torchllama
    from tests.test_gemma3 import tiny_sp_tokenizer

    hf = perturbed(hf.float(), seed=2)
    for config in (hf.config, hf.generation_config):     # GPT-2's defaults name id 50256
        config.bos_token_id, config.eos_token_id = 2, 1
    hf.save_pretrained(tmp_path)
    tiny_sp_tokenizer(hf.config.vocab_size).save_hf(tmp_path)   # a tokenizer of the same size
    ours, _ = torchllama.load(tmp_path, progress=False)
    assert_same_logits(hf, ours, T=30)


def test_variants_no_format_holds_are_refused_by_the_hf_and_gguf_writers(tmp_path):
    from torchllama.checkpoint.gguf import save_gguf
    from torchllama.checkpoint.hf import save_hf
    from torchllama.errors import ArgumentError

    model = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=50, max_seq_len=16,
                                  position="alibi", norm_placement="post"))
    with pytest.raises(ArgumentError, match=r"no hf architecture can hold this model \(llama: "
                                            r"norm_placement='post'.*save it with --to meta"):
        save_hf(model, tmp_path)
    with pytest.raises(ArgumentError, match="no gguf architecture can hold this model"):
        save_gguf(model, {}, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
