"""Training a mixture of experts: Switch Transformers' load-balancing loss (against
transformers' `load_balancing_loss_func`), its gradient into the router, DeepSeek-V3's
bias update (a training run with the balance loss: tests/test_train.py)."""

from __future__ import annotations

import pytest
import torch

from torchllama.config import ModelArgs
from torchllama.errors import ArgumentError
from torchllama.nn.moe import MoE, balance_loss, update_biases

D, F_, E = 64, 64, 8


def _moe(**fields) -> MoE:
    torch.manual_seed(0)
    args = ModelArgs(dim=D, n_layers=1, n_heads=4, vocab_size=300, hidden_dim=F_, n_experts=E,
                     n_experts_per_token=2, **fields)
    return MoE(args)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_balance_loss_is_transformers_switch_loss(k):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    moe = _moe(moe_aux_loss_coef=0.3)
    moe.top_k = k
    x = torch.randn(37, D)
    moe.train()
    moe.route(x)
    ours = balance_loss(moe)
    logits = moe.gate(x).float()                                           # (N, E)
    theirs = 0.3 * load_balancing_loss_func((logits,), E, k)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert balance_loss(moe) is None                                       # taken once


def test_balance_loss_trains_the_router_and_only_in_training():
    moe = _moe(moe_aux_loss_coef=0.01)
    x = torch.randn(2, 5, D)
    moe.train()
    moe(x)
    balance_loss(moe).backward()                         # the balance loss alone
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    moe.eval()
    moe(x)
    assert balance_loss(moe) is None                     # evaluation: none recorded
    assert balance_loss(_moe()) is None                  # α = 0: none


def test_deepseek_bias_update_moves_each_bias_by_gamma_toward_balance():
    moe = _moe(moe_router="sigmoid", moe_bias_update_speed=0.001)
    assert "e_score_correction_bias" not in dict(moe.named_parameters())   # a buffer
    moe.train()
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])                    # loads 4 2 1 1 0…
    moe.record(torch.full((4, E), 1 / E), ids)
    update_biases(moe)
    load = torch.tensor([4., 2, 1, 1, 0, 0, 0, 0])
    expected = 0.001 * torch.sign(load.mean() - load)
    assert torch.equal(moe.e_score_correction_bias, expected)
    assert moe.e_score_correction_bias[0] < 0 < moe.e_score_correction_bias[5]
    update_biases(moe)                                   # loads cleared: no second move
    assert torch.equal(moe.e_score_correction_bias, expected)
    still = _moe(moe_router="sigmoid")                   # γ = 0: the bias stays
    still.train()
    still(torch.randn(1, 6, D))
    update_biases(still)
    assert torch.equal(still.e_score_correction_bias, torch.zeros(E))


@pytest.mark.parametrize("field", ["moe_aux_loss_coef", "moe_bias_update_speed"])
def test_balancing_settings_must_be_non_negative(field):
    with pytest.raises(ArgumentError, match=field):
        ModelArgs(dim=D, n_layers=1, n_heads=4, vocab_size=300, n_experts=E,
                  n_experts_per_token=2, **{field: -0.1})


def test_balance_loss_alone_spreads_an_overloaded_router():
    """Gradient descent on the balance loss alone (α = 1) moves a router that sends nearly
    every token to expert 0 toward equal loads: the loss falls to near its balanced value k·α
    and the busiest expert's share of the N·k choices from ~1/k = 0.5 toward 1/E (oracle:
    the counts of the choices)."""
    moe = _moe(moe_aux_loss_coef=1.0)
    u = torch.randn(D)
    u = u / u.norm()                                                       # (D,) unit
    x = torch.randn(256, D) + 3 * u                                        # (N, D)
    with torch.no_grad():
        moe.gate.weight[0] = 2 * u                                         # expert 0: logit ~6
    moe.train()
    opt = torch.optim.SGD(moe.gate.parameters(), lr=0.05)

    def step() -> tuple[float, float]:
        _, ids = moe.route(x)                                              # (N, k)
        loss = balance_loss(moe)
        opt.zero_grad()
        loss.backward()
        opt.step()
        busiest = torch.bincount(ids.reshape(-1), minlength=E).max() / ids.numel()
        return loss.item(), busiest.item()

    first = step()
    for _ in range(40):
        last = step()
    assert first[1] > 0.45 and last[1] < 0.2                               # balanced: 1/8
    assert first[0] > 3 * 2 and last[0] < 2 * 1.0 * 1.1                   # k·α = 2


def test_ablation_moe_variant_has_the_baselines_active_parameters():
    """The ablation's `moe` variant: 8 experts of half the baseline's MLP width (a multiple of
    32), 2 per token, so each token's experts hold exactly the baseline MLP's parameters; its
    active non-embedding parameters exceed the baseline's by the routers alone (6 · 8 · 256),
    within the ±0.3 % the other variants keep, while its total is ~3× larger."""
    from torchllama.model import parameter_counts
    from torchllama.train.ablate import ablation_args, non_embedding_params

    base, moe = ablation_args("baseline", 4096, 512), ablation_args("moe", 4096, 512)
    assert moe.expert_hidden_dim % 32 == 0 and moe.moe_aux_loss_coef == 0.01
    assert moe.n_experts_per_token * moe.expert_hidden_dim == base.ffn_hidden_dim
    total, active = parameter_counts(moe)
    moe_active = non_embedding_params(moe) - (total - active)
    target = non_embedding_params(base)
    assert moe_active - target == base.n_layers * moe.n_experts * base.dim     # the routers
    assert abs(moe_active - target) / target < 0.003
    assert non_embedding_params(moe) > 3 * target


def test_ablation_table_gives_a_mixture_of_experts_active_parameters():
    """The ablation table's parameters column: total (non-embedding; active) for a mixture of
    experts, total (non-embedding) for a dense model (results.json of older runs, without the
    active count, read as dense)."""
    from torchllama.train.ablate import markdown_table

    row = dict(description="d", val_loss=5.0, val_loss_2x=5.0, val_loss_4x=5.0,
               tokens_per_s=1000.0, parameters=15_219_968, non_embedding_parameters=14_171_392,
               kv_bytes_per_token=3072)
    moe = dict(row, name="moe", active_non_embedding_parameters=4_439_296)
    old = dict(row, name="old")
    lines = markdown_table([moe, old], 128).splitlines()
    assert "| 15,219,968 (14,171,392; 4,439,296 active) |" in lines[2]
    assert "| 15,219,968 (14,171,392) |" in lines[3]
