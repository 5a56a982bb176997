"""LoRA / QLoRA / DoRA adapters (torchllama.transforms.lora) against independent oracles: the
base model (B = 0), the merged weights, and PEFT loading our adapter onto transformers' model of
the same checkpoint (the test-only `peft` package; on the real SmolLM2: test_parity_real.py);
QLoRA's frozen quantized base and its input gradient against autograd through the dequantized
weight."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import torchllama
from torchllama.errors import ModelFileError
from torchllama.transforms.lora import (LoRAConfig, LoRALinear, apply_lora, load_adapter, lora_modules,
                             lora_parameters, merge_lora, save_adapter)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_hf_checkpoint import save_tiny, tiny_tokenizer  # noqa: E402,F401  (fixture)

TOKENS = torch.tensor([[1, 17, 45, 200, 9, 33, 120, 7, 64, 250, 3, 88]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_tokenizer):
    """(folder, HF model) of a random tiny Llama (4 heads, 2 KV heads: q and k rows permuted in
    HF's layout)."""
    folder = tmp_path_factory.mktemp("tiny")
    hf = save_tiny(folder, tiny_tokenizer)
    return folder, hf


def _randomize(model, seed=1):
    """Non-zero B (a trained adapter's state), so that the update matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)
            if m.magnitude is not None:
                m.magnitude.mul_(1 + 0.1 * torch.randn(m.magnitude.shape, generator=g))


def _logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(tokens)


def test_lora_layer_with_zero_b_equals_base():
    base = torch.nn.Linear(40, 24)
    layer = LoRALinear(base, LoRAConfig(r=4, alpha=8))
    x = torch.randn(3, 5, 40)
    assert torch.equal(layer(x), base(x))
    assert layer.lora_A.abs().sum() > 0 and layer.lora_B.abs().sum() == 0   # A random, B zero
    with torch.no_grad():
        layer.lora_B.normal_()
    expected = base(x) + (x @ layer.lora_A.T @ layer.lora_B.T) * 2.0          # α/r = 2
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dora", [False, True])
def test_merged_equals_unmerged(tiny, dora):
    folder, _ = tiny
    model, _ = torchllama.load(folder, progress=False)
    apply_lora(model, LoRAConfig(r=4, alpha=8, targets=("wq", "wk", "wv", "wo", "w1", "w2",
                                                        "w3"), dora=dora))
    _randomize(model)
    unmerged = _logits(model)
    merged = _logits(merge_lora(model))
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("targets, dora", [(("wq", "wv"), False), (("wq", "wk", "wv", "wo",
                                                                   "w1", "w2", "w3"), False),
                                           (("wq", "wk", "w2"), True)])
def test_peft_loads_our_adapter(tiny, tmp_path, targets, dora):
    """PEFT puts our adapter on transformers' model of the same checkpoint: same logits."""
    folder, hf = tiny
    model, _ = torchllama.load(folder, progress=False)
    config = LoRAConfig(r=4, alpha=8, targets=targets, dora=dora)
    apply_lora(model, config)
    _randomize(model)
    save_adapter(model, config, tmp_path, base_model=str(folder))
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == 4 and saved["use_dora"] == dora
    peft_model = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(folder).eval(), tmp_path).eval()
    with torch.no_grad():
        theirs = peft_model(TOKENS).logits
        base = hf(TOKENS).logits
    ours = _logits(model)
    assert (ours - base).abs().max() > 1e-3                  # the adapter changes the answer
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_adapter_round_trip(tiny, tmp_path):
    folder, _ = tiny
    model, _ = torchllama.load(folder, progress=False)
    config = LoRAConfig(r=2, alpha=4, targets=("wq", "wk", "w3"))
    apply_lora(model, config)
    _randomize(model)
    save_adapter(model, config, tmp_path)
    again, _ = torchllama.load(folder, progress=False)
    assert load_adapter(again, tmp_path) == config
    assert torch.equal(_logits(again), _logits(model))


def test_adapter_for_another_model_names_first_mismatch(tiny, tmp_path, tiny_tokenizer):
    folder, _ = tiny
    model, _ = torchllama.load(folder, progress=False)
    config = LoRAConfig(r=2, alpha=4)
    apply_lora(model, config)
    (tmp_path / "a").mkdir()
    save_adapter(model, config, tmp_path / "a")
    other_dir = tmp_path / "other"
    save_tiny(other_dir, tiny_tokenizer, n_heads=4, n_kv_heads=1)     # wv (16, 64), not (32, 64)
    other, _ = torchllama.load(other_dir, progress=False)
    with pytest.raises(ModelFileError, match=r"base_model\.model\.model\.layers\.0\.self_attn\."
                       r"v_proj\.lora_B\.weight has shape \(32, 2\) but this model needs "
                       r"\(16, 2\)"):
        load_adapter(other, tmp_path / "a")
    # another number of layers: a tensor with no module
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "x_proj"]
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg))
    fresh, _ = torchllama.load(folder, progress=False)
    with pytest.raises(ModelFileError, match="x_proj"):
        load_adapter(fresh, tmp_path / "a")


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_qlora_trains_adapters_and_keeps_base_bits(tiny, dtype):
    """QLoRA on a quantized base: the input gradient through each frozen quantized linear equals
    autograd through its dequantized weight; a few steps lower the loss; no base bit changes."""
    folder, _ = tiny
    model, _ = torchllama.load(folder, dtype=dtype, progress=False)
    frozen = [(m, [t.clone() for t in (*m.buffers(), *m.parameters())])   # every weight
              for m in model.modules() if not list(m.children())]
    apply_lora(model, LoRAConfig(r=4, alpha=8, targets=("wq", "wv", "w2")))
    model.train()
    params = lora_parameters(model)
    assert params and all(p.requires_grad for p in params)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)

    # the input gradient through a frozen quantized linear (wo: not adapted)
    wo = model.layers[0].attention.wo
    x = torch.randn(3, wo.in_features, requires_grad=True)
    g = torch.randn(3, wo.out_features)
    (wo(x) * g).sum().backward()
    torch.testing.assert_close(x.grad, g @ wo.dequantize(), rtol=1e-5, atol=1e-5)

    opt = torch.optim.AdamW(params, lr=1e-2)
    batch = torch.randint(3, 300, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = model(batch[:, :-1], targets=batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.05
    for module, tensors in frozen:         # the same modules (wrapped or not): same bits
        assert all(torch.equal(a, b) for a, b in
                   zip(tensors, (*module.buffers(), *module.parameters())))


@pytest.mark.parametrize("name", ["mistral", "gemma3", "qwen2", "mla", "gpt2"])
def test_every_family_adapts_merges_and_round_trips(name, tmp_path):
    """LoRA on every family's linears: merged = unmerged, and the adapter files round-trip
    (in our own names where no HF layout stores the adapted weights separately)."""
    from test_engine_families import family_model

    model = family_model(name, "float32")
    targets = ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "w1", "w2", "w3") if name == "mla" \
        else ("wq", "wk", "wv", "wo", "w1", "w2") + (() if name == "gpt2" else ("w3",))
    config = LoRAConfig(r=4, alpha=8, targets=targets)
    apply_lora(model, config)
    _randomize(model)
    tokens = torch.randint(0, model.args.vocab_size, (1, 24), generator=torch.Generator()
                           .manual_seed(0))
    unmerged = _logits(model, tokens)
    save_adapter(model, config, tmp_path)
    again = family_model(name, "float32")
    assert load_adapter(again, tmp_path) == config
    assert torch.equal(_logits(again, tokens), unmerged)
    torch.testing.assert_close(_logits(merge_lora(model), tokens), unmerged, rtol=1e-5,
                               atol=1e-5)
