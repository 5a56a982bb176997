"""Mixture of experts: the feed-forward of a sparse decoder layer.

A router scores every expert for each token and sends the token to its k best; the layer's
output is the weighted sum of those experts' gated MLPs (plus, in DeepSeek's design, shared
experts every token goes through):

    y = Σ_{e ∈ TopK(x)} g_e(x) · E_e(x)  [+ S(x)]          E_e(x) = W2_e · (act(W1_e·x) ⊙ W3_e·x)

Routers (`ModelArgs.moe_router`):
- "softmax" (Shazeer et al. 2017, "Outrageously Large Neural Networks", eq. 3-5 without the
  noise; Fedus et al. 2021, Switch Transformers, eq. 1-2; Jiang et al. 2024, Mixtral §2.1):
  p = softmax(W_g·x) over all experts, TopK by p, g_e = p_e, renormalized over the k to sum
  to 1 if `moe_norm_topk` (Mixtral, Qwen3-MoE; OLMoE keeps the raw p_e), times `moe_scale`
  (DeepSeek-V2's routed_scaling_factor; 1 elsewhere).
- "sigmoid" (DeepSeek-AI 2024, DeepSeek-V3 §2.1.2, eq. 12-16): s_e = σ(W_g·x)_e; the choice
  ranks s_e + b_e (b: the correction bias of auxiliary-loss-free balancing) among the experts
  of the `moe_group_topk` best of `moe_groups` groups (a group's score: the sum of its two best
  s_e + b_e); g_e = s_e (without b), renormalized if `moe_norm_topk`, times `moe_scale`.

The computation groups tokens by expert (each expert's tokens in one product; with block
weights every expert's projection in one op, llama.cpp's MUL_MAT_ID, `stacked`) and adds each
token's experts in increasing expert order. Each expert is a gated
`FeedForward` (Meta's w1/w2/w3, as Mistral's reference names Mixtral's experts), so its
products are torchllama's batch-invariant ones — float32 or quantized blocks alike: a token's
output is the same bits whatever other tokens are in the batch (for expert widths that are
multiples of 32, as in every released model: torch's vectorized SiLU rounds a row's last
floats differently when the row ends in its scalar tail).

Source: transformers' MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock, OlmoeSparseMoeBlock and
DeepseekV3MoE (the semantics the tests compare against).
"""

from __future__ import annotations

import torch
from torch import nn

from torchllama.nn.linear import Linear
from torchllama.nn.mlp import FeedForward


# --8<-- [start:moe]
class MoE(nn.Module):
    """A mixture-of-experts feed-forward block (see the module docstring).

    Shapes: x (B, T, D) → (B, T, D). Parameters: gate.weight (E, D) the router;
    experts.{e}.w1/w3 (F, D) and .w2 (D, F); e_score_correction_bias (E,) for the sigmoid
    router (a buffer); shared_experts (a `FeedForward` of n_shared·F) if any.

    Args:
        args: `ModelArgs` with n_experts > 0.
    """

    def __init__(self, args):
        super().__init__()
        E, D, Fh = args.n_experts, args.dim, args.expert_hidden_dim
        self.n_experts, self.top_k = E, args.n_experts_per_token
        self.router, self.norm_topk, self.scale = args.moe_router, args.moe_norm_topk, \
            args.moe_scale
        self.groups, self.group_topk = args.moe_groups, args.moe_group_topk
        self.gate = Linear(D, E, bias=False)                               # router (E, D)
        self.experts = nn.ModuleList(FeedForward(D, Fh, args.mlp) for _ in range(E))
        if self.router == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.shared_experts = FeedForward(D, args.n_shared_experts * Fh, args.mlp) \
            if args.n_shared_experts else None
        #: every expert's w1, w3 and w2 as one product each (`expert_outputs`), where
        #: `torchllama.transforms.fuse.stack_experts` made them (block weights)
        self.stacked = None
        self.aux_coef, self.bias_speed = args.moe_aux_loss_coef, args.moe_bias_update_speed
        #: training: this forward's balance loss (`balance_loss`), and the tokens routed to
        #: each expert since the last bias update (`update_bias`)
        self.aux_loss: torch.Tensor | None = None
        self.load: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, k) float32, expert ids (N, k)) of tokens x (N, D); in training, the
        balance loss and the experts' loads recorded too where asked (`record`)."""
        logits = self.gate(x).float()                                      # (N, E)
        if self.router == "softmax":
            probs = torch.softmax(logits, dim=-1)                          # (N, E)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)           # (N, k)
            if self.training and (self.aux_coef or self.bias_speed):
                self.record(probs, ids)
            if self.norm_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return (weights if self.scale == 1.0 else weights * self.scale), ids  # (DeepSeek-V2)
        scores = torch.sigmoid(logits)                                     # (N, E)
        choice = scores + self.e_score_correction_bias                     # (N, E)
        N, G = x.shape[0], self.groups
        group_scores = choice.view(N, G, -1).topk(min(2, self.n_experts // G), dim=-1)[0] \
            .sum(dim=-1)                                                   # (N, G)
        best = torch.topk(group_scores, self.group_topk, dim=-1)[1]       # (N, topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(self.n_experts // G, dim=1),
                                    float("-inf"))
        ids = torch.topk(choice, self.top_k, dim=-1)[1]                    # (N, k)
        weights = scores.gather(1, ids)                                    # (N, k)
        if self.training and (self.aux_coef or self.bias_speed):   # (eq. 18-20: normalized)
            self.record(scores / scores.sum(dim=-1, keepdim=True), ids)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def record(self, probs: torch.Tensor, ids: torch.Tensor) -> None:
        """Training: the balance loss of this batch's routing (probs (N, E) the router's
        probabilities, ids (N, k) its choices) and the loads for `update_bias`.

        Switch Transformers (Fedus et al. 2021, eq. 4-6), as transformers'
        `load_balancing_loss_func` counts it for top-k: aux = α · E · Σ_e f_e · P_e, with
        f_e = (tokens that chose e) / N and P_e = mean_t probs[t, e]; k·α when balanced.
        """
        counts = torch.zeros(self.n_experts, device=ids.device).index_add_(
            0, ids.reshape(-1), torch.ones(ids.numel(), device=ids.device))    # (E,)
        if self.aux_coef:
            f = counts / ids.shape[0]                                      # (E,) Σ = k
            self.aux_loss = self.aux_coef * self.n_experts * (f * probs.mean(dim=0)).sum()
        if self.bias_speed and self.router == "sigmoid":
            self.load = counts if self.load is None else self.load + counts

    @torch.no_grad()
    def update_bias(self) -> None:
        """After an optimizer step, DeepSeek-V3's auxiliary-loss-free balancing (§2.1.2): each
        expert's correction bias b_e += γ·sign(mean load − load_e), the loads those of the
        forwards since the last update (then cleared). No-op without recorded loads."""
        if self.load is None:
            return
        self.e_score_correction_bias += self.bias_speed * torch.sign(
            self.load.mean() - self.load)                                  # (E,)
        self.load = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, D = x.shape, x.shape[-1]
        h = x.reshape(-1, D)                                               # (N, D)
        weights, ids = self.route(h)                                       # (N, k) each
        ids, slot = ids.sort(dim=-1)                   # each token's experts in increasing e
        weights = weights.gather(1, slot)                                  # (N, k)
        y = self.expert_outputs(h, ids)                                    # (N, k, D)
        # Σ_j g_j · E_j(x), j in increasing e: torch sums dim 1 of a contiguous (N, k, D) one
        # j after another for each (token, d), whatever N (batch invariance: tests/test_moe.py)
        out = (y * weights[..., None]).sum(dim=1)                          # (N, D)
        out = out.to(x.dtype).view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def expert_outputs(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """E_e(h_t) (N, k, D) float32 for each token t of h (N, D) and each of its experts
        e = ids[t, j] (N, k): the tokens grouped by expert, each expert's in one product (or,
        where `stacked` is set, every expert's projection in one op)."""
        N, k = ids.shape
        if self.stacked is not None and self.stacked.serves(self.experts):  # MUL_MAT_ID
            pairs, flat = torch.arange(N).repeat_interleave(k), ids.reshape(-1)    # (N·k,)
            gate = self.stacked.w1(h, pairs, flat)                         # (N·k, F)
            up = self.stacked.w3(h, pairs, flat)                           # (N·k, F)
            hidden = self.experts[0].act(gate) * up                        # (N·k, F)
            y = self.stacked.w2(hidden, torch.arange(N * k), flat)         # (N·k, D)
            return y.view(N, k, -1)
        y = h.new_empty((N, k, h.shape[-1]), dtype=torch.float32)          # (N, k, D)
        for e in torch.unique(ids).tolist():                               # increasing e
            tokens, slot = torch.where(ids == e)                           # (n,), (n,)
            y[tokens, slot] = self.experts[e](h.index_select(0, tokens)[None])[0].float()
        return y
# --8<-- [end:moe]


def balance_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the MoE layers' balance losses of the last training forward (`MoE.record`),
    each cleared; None where there are none (no experts, α = 0, or evaluation)."""
    losses = []
    for module in model.modules():
        if isinstance(module, MoE) and module.aux_loss is not None:
            losses.append(module.aux_loss)
            module.aux_loss = None
    return torch.stack(losses).sum() if losses else None


def update_biases(model: nn.Module) -> None:
    """`MoE.update_bias` of every MoE layer of `model` (call after each optimizer step)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.update_bias()


def make_feed_forward(args, layer_id: int) -> nn.Module:
    """Layer `layer_id`'s feed-forward: a `MoE` where `args.is_moe_layer`, else the dense
    MLP of `args.mlp`."""
    from torchllama.nn.mlp import make_mlp

    return MoE(args) if args.is_moe_layer(layer_id) else make_mlp(args)

