"""The training loss, fused with the output projection: next-token cross-entropy computed a chunk of
positions at a time, so the (B·T, vocab_size) logits never exist whole.

For final hidden states h (N, D), output matrix W (V, D) and targets y (N,):

    logits = h·Wᵀ                                    (N, V)
    loss   = (1/N) Σ_n [logsumexp(logits_n) − logits_n[y_n]]
    ∂loss/∂logits_n = (softmax(logits_n) − onehot(y_n)) / N
    ∂loss/∂h        = ∂loss/∂logits · W               (N, D)
    ∂loss/∂W        = (∂loss/∂logits)ᵀ · h            (V, D)

The loss is the last node of the graph, so both gradients can be computed in the forward pass,
chunk by chunk, while each chunk's logits are at hand (the approach of Liger Kernel's fused linear
cross-entropy, Hsu et al. 2024, and of Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary
Language Models"). Backward then only scales them by the incoming gradient. Compared with
`F.cross_entropy(h @ W.T, y)` this keeps one (chunk, V) block of float32 logits alive instead of
(N, V) logits plus their float32 copy and softmax, and skips the bf16 → fp32 logits copy under
autocast; `torchllama bench train` measures the training step against transformers', which
takes the unfused path.
"""

from __future__ import annotations

import torch

#: targets with this value are left out of the loss (torch's F.cross_entropy default)
IGNORE_INDEX = -100


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_size: int, want_grads: bool, softcap: float | None) -> torch.Tensor:
        # Targets equal to IGNORE_INDEX (prompt tokens of chat data) add nothing to the loss
        # nor to the gradients; the mean is over the others: n of them, kept on the device (a
        # Python count would wait for the device and break a compiled graph).
        n = (targets != IGNORE_INDEX).sum().clamp(min=1).float()               # () fp32
        want_grad_w = want_grads and weight.requires_grad
        # Matmuls in the autocast dtype when autocast is on (as nn.Linear would), else W's.
        dtype = (torch.get_autocast_dtype(h.device.type)
                 if torch.is_autocast_enabled(h.device.type) else weight.dtype)
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)                                        # (V, D)
            grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)          # (N, D)
            grad_w = torch.zeros(weight.shape if want_grad_w else (0,), dtype=torch.float32,
                                 device=h.device)                        # (V, D) or none
            loss_sum = torch.zeros((), dtype=torch.float32, device=h.device)
            for start in range(0, h.shape[0], chunk_size):                  # every row
                hc = h[start:start + chunk_size].to(dtype)               # (n, D)
                yc = targets[start:start + chunk_size]                   # (n,)
                keep = yc != IGNORE_INDEX                                # (n,) bool
                yc = yc.clamp(min=0)                                     # ignored: any id
                logits = (hc @ w.t()).float()                            # (n, V) fp32
                if softcap is not None:                                  # c·tanh(z/c)
                    capped = torch.tanh(logits / softcap)                # (n, V)
                    logits = capped * softcap
                lse = torch.logsumexp(logits, dim=-1)                    # (n,)
                loss_sum += ((lse - logits.gather(1, yc[:, None]).squeeze(1)) * keep).sum()
                if not want_grads:                                       # evaluation
                    continue
                # softmax − onehot, in place of the logits: (n, V)
                g = logits.sub_(lse[:, None]).exp_()
                g[torch.arange(len(yc), device=g.device), yc] -= 1.0
                g *= keep[:, None]                                       # ignored rows: 0
                if softcap is not None:                                  # d(c·tanh(z/c))/dz
                    g *= 1.0 - capped.square_()
                g = g.to(dtype)
                grad_h[start:start + chunk_size] = g @ w                 # (n, D)
                if want_grad_w:
                    grad_w += (g.t() @ hc).float()                       # (V, D)
        ctx.save_for_backward(grad_h, grad_w, n)
        ctx.want_grad_w = want_grad_w
        return loss_sum / n

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w, n = ctx.saved_tensors
        scale = grad_loss / n                                            # d loss / d loss_sum
        grad_weight = (grad_w * scale).to(grad_w.dtype) if ctx.want_grad_w else None
        return grad_h * scale.to(grad_h.dtype), grad_weight, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk_size: int = 512, softcap: float | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits h·Wᵀ against targets, without materialising the logits.

    Equal to `F.cross_entropy(F.linear(h, weight).float(), targets)` (to float rounding) in value
    and gradients (tested against autograd). With `softcap` c the logits are c·tanh(h·Wᵀ/c)
    first (Gemma 2's final-logit soft-capping), and the gradient carries the factor
    1 − tanh²(h·Wᵀ/c).

    Args:
        h: (N, D) final hidden states, any float dtype.
        weight: (V, D) output projection (requires grad for training).
        targets: (N,) int64 token ids in [0, V), or IGNORE_INDEX (−100, as torch's
            cross_entropy) for positions left out of the loss; the mean is over the others
            (0 when none is left).
        chunk_size: positions per chunk; each chunk holds a (chunk_size, V) float32 block.
        softcap: c of the final-logit soft-capping, or None.

    Returns:
        scalar float32 loss in nats per token.

    Raises:
        ValueError: shapes that do not fit, or an empty batch.
    """
    if h.ndim != 2 or weight.ndim != 2 or h.shape[1] != weight.shape[1] or \
            targets.shape != h.shape[:1] or h.shape[0] == 0:
        raise ValueError(f"linear_cross_entropy: h (N, D) {tuple(h.shape)}, weight (V, D) "
                         f"{tuple(weight.shape)} and targets (N,) {tuple(targets.shape)} "
                         "do not fit")
    # Gradients are formed in the forward pass only when backward can happen (not under
    # torch.no_grad, e.g. during evaluation, where the loss alone is computed).
    want_grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(h, weight, targets, chunk_size, want_grads, softcap)
