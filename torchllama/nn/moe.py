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

The computation groups tokens by expert (each expert's tokens in one product, llama.cpp's
MUL_MAT_ID) and adds each token's experts in increasing expert order. Each expert is a gated
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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, k) float32, expert ids (N, k)) of tokens x (N, D)."""
        logits = self.gate(x).float()                                      # (N, E)
        if self.router == "softmax":
            probs = torch.softmax(logits, dim=-1)                          # (N, E)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)           # (N, k)
            if self.norm_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights * self.scale, ids                               # (DeepSeek-V2)
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
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])                                       # (N, D)
        weights, ids = self.route(h)                                       # (N, k) each
        out = torch.zeros_like(h)                                          # (N, D)
        for e in torch.unique(ids).tolist():                               # increasing e
            tokens, slot = torch.where(ids == e)                           # (n,), (n,)
            ye = self.experts[e](h.index_select(0, tokens)[None])[0]       # (n, D)
            out.index_add_(0, tokens, (ye * weights[tokens, slot, None]).to(out.dtype))
        out = out.view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def make_feed_forward(args, layer_id: int) -> nn.Module:
    """Layer `layer_id`'s feed-forward: a `MoE` where `args.is_moe_layer`, else the dense
    MLP of `args.mlp`."""
    from torchllama.nn.mlp import make_mlp

    return MoE(args) if args.is_moe_layer(layer_id) else make_mlp(args)

