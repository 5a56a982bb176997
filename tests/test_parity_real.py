"""The real checkpoint: SmolLM2-135M-Instruct (Q4_1 GGUF) loaded by torchllama and by HF
transformers' own GGUF loader (the oracle, dequantizing the same file) must agree: logits, greedy
continuations, attention probabilities (the anatomy report's), a LoRA adapter read by PEFT.
Every test that needs transformers' SmolLM2 is in this file, so that `make test`'s two workers
load it once."""

import pytest
import torch

from torchllama.generation.session import Session, encode_prompt

pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Water boils at 100 degrees Celsius and freezes at",
]
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves."]


def all_prompt_ids(tokenizer):
    return ([encode_prompt(tokenizer, p) for p in PROMPTS]
            + [encode_prompt(tokenizer, p, chat=True) for p in CHAT_PROMPTS])


def test_loaded_shapes(smollm2):
    model, tokenizer = smollm2
    args = model.args
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (576, 30, 9, 3)
    assert args.rope_theta == 100000.0 and args.tie_embeddings and args.vocab_size == 49152
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_logits_match_transformers(smollm2, hf_smollm2):
    model, tokenizer = smollm2
    hf_model, _ = hf_smollm2
    for ids in all_prompt_ids(tokenizer):
        tokens = torch.tensor([ids])
        with torch.inference_mode():
            ours = model(tokens)                              # (1, T, V)
            theirs = hf_model(tokens).logits.float()          # (1, T, V)
        assert (ours[0, -1] - theirs[0, -1]).abs().max() < 1e-3
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))   # same argmax at every position


def hf_greedy(hf_model, ids, n):
    """Greedy decoding with transformers' model and its KV cache (DynamicCache).

    Not `hf_model.generate`: in transformers 5.23 it picks a different token than the argmax of
    its own model's logits on one of these prompts (top-2 logits 0.1 apart), while this loop, a
    full forward pass and torchllama all agree.
    """
    from transformers import DynamicCache

    cache, new = DynamicCache(), []
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(n):
            logits = hf_model(tokens, past_key_values=cache, use_cache=True).logits
            tokens = logits[:, -1].argmax(-1, keepdim=True)          # (1, 1)
            new.append(int(tokens))
    return new


@pytest.mark.parametrize("prompts", [slice(0, 6, 2), pytest.param(slice(1, 6, 2),
                                                                   marks=pytest.mark.slow)])
def test_greedy_continuations_match_transformers(smollm2, hf_smollm2, prompts):
    """Three of the six prompts (two plain, one chat) by default, the others in test-all."""
    model, tokenizer = smollm2
    hf_model, _ = hf_smollm2
    session = Session(model, tokenizer)
    for ids in all_prompt_ids(tokenizer)[prompts]:
        # No stop tokens: 32 tokens each, compared token for token.
        ours = list(session.generate(ids, max_new_tokens=32, stop_ids=frozenset()))
        theirs = hf_greedy(hf_model, ids, 32)
        assert len(ours) == 32
        assert ours == theirs, (tokenizer.decode(ours), tokenizer.decode(theirs))


def test_bfloat16_close_to_float32(smollm2_gguf, smollm2):
    import torchllama

    model32, tokenizer = smollm2
    model16, _ = torchllama.load(smollm2_gguf, dtype="bfloat16", progress=False)
    assert model16.tok_embeddings.weight.dtype == torch.bfloat16
    tokens = torch.tensor([encode_prompt(tokenizer, PROMPTS[0])])
    with torch.inference_mode():
        a, b = model32(tokens)[0, -1], model16(tokens)[0, -1]
    assert b.dtype == torch.float32
    # Same prediction and nearly the same distribution. The logits themselves may move by a
    # near-constant offset (softmax ignores it) whose size depends on the CPU's bf16 kernels
    # (0.3 on AVX512-BF16 machines, 0.6 without), so compare distributions: KL(p32 ‖ p16),
    # measured ≈ 2e-4 – 8e-4 nats here.
    log_a, log_b = a.log_softmax(-1), b.log_softmax(-1)
    kl = (log_a.exp() * (log_a - log_b)).sum()
    assert a.argmax() == b.argmax() and kl < 5e-3


def test_attention_probabilities_equal_transformers(smollm2, hf_smollm2):
    """The anatomy report's attention maps: every layer's and head's softmax(QKᵀ/√d) equals
    transformers' eager attention (output_attentions)."""
    from torchllama.anatomy.attention import attention_probs

    model, tok = smollm2
    hf, _ = hf_smollm2
    tokens = torch.tensor([tok.encode("The capital of France is Paris, and the capital of")])
    previous = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            expected = torch.stack(hf(tokens, output_attentions=True).attentions)
    finally:
        hf.set_attn_implementation(previous)
    torch.testing.assert_close(attention_probs(model, tokens), expected, atol=2e-5, rtol=0)


def test_peft_loads_our_adapter(smollm2, hf_smollm2, tmp_path):
    """The real SmolLM2 (GQA 9/3 heads, q/k rows permuted in HF's layout, tied embeddings): our
    adapter on our float32 model equals PEFT's on transformers' model of the same GGUF, to the
    base models' own agreement."""
    import copy

    from torchllama.transforms.lora import LoRAConfig, apply_lora, lora_modules, save_adapter

    peft = pytest.importorskip("peft")
    hf, _ = hf_smollm2
    model, tokenizer = copy.deepcopy(smollm2[0]), smollm2[1]      # the shared one stays as is
    tokens = torch.tensor([tokenizer.encode("The quick brown fox jumps over the lazy dog")])
    with torch.no_grad():
        base_ours = model(tokens)
    config = LoRAConfig(r=4, alpha=8, targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
    apply_lora(model, config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():                     # non-zero B: a trained adapter's state
        for m in lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)
    save_adapter(model, config, tmp_path)
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    with torch.no_grad():
        base_theirs = hf(tokens).logits
        theirs = peft_model(tokens).logits
        ours = model(tokens)
    assert (ours - base_ours).abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert (ours - theirs).abs().max() <= 2 * (base_ours - base_theirs).abs().max() + 1e-5
