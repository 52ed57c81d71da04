"""Cross-entropy of a linear head that never holds the [tokens, vocabulary] logits in float32.

At S = 16k and a 32k vocabulary one micro-batch's float32 logits are 2 GiB, and the plain loss
keeps them, their log-softmax and their gradient. ``linear_cross_entropy`` runs the projection and
the loss ``chunk`` tokens at a time and computes both gradients on the way (as in the fused
linear cross-entropy of Liger and Apple's cut cross-entropy): its extra memory is one chunk's
logits, the gradient of the hidden states and a float32 gradient of the weight.
"""

from __future__ import annotations

import torch

from .shape import LOSS_CHUNK_TOKENS

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it count for nothing


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``; gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                dtype: torch.dtype, grads: bool) -> torch.Tensor:
        w = weight.to(dtype)
        count = (targets != IGNORE_INDEX).sum().clamp_min(1)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        with torch.autocast(hidden.device.type, enabled=False):  # the casts are explicit here
            for start in range(0, hidden.shape[0], chunk):
                h, t = hidden[start:start + chunk].to(dtype), targets[start:start + chunk]
                logits = (h @ w.t()).float()
                keep = t != IGNORE_INDEX
                safe = torch.where(keep, t, 0)
                lse = torch.logsumexp(logits, dim=-1)
                total += torch.where(keep, lse - logits.gather(1, safe[:, None]).squeeze(1), 0).sum()
                if not grads:  # a validation pass
                    continue
                # d(sum of losses)/d logits = softmax - one-hot, zero on ignored rows
                dlogits = logits.sub_(lse[:, None]).exp_()
                dlogits[torch.arange(len(t), device=t.device), safe] -= 1
                dlogits.mul_(keep[:, None])
                grad_hidden[start:start + chunk] = (dlogits.to(dtype) @ w).to(hidden.dtype)
                grad_weight.addmm_(dlogits.t(), h.float())
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad / count
        return (grad_hidden * scale.to(grad_hidden.dtype), (grad_weight * scale).to(ctx.weight_dtype),
                None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk: int = LOSS_CHUNK_TOKENS) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), targets)`` over all leading dimensions (mean
    over the targets that are not -100), computed ``chunk`` tokens at a time. Under autocast the
    projection runs in the autocast dtype, as ``nn.Linear`` would; the loss is float32."""
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk!r}")
    if hidden.shape[:-1] != targets.shape or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets "
                         f"{tuple(targets.shape)} do not fit: expected (..., H), (V, H) and (...)")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                     chunk, dtype, grads)
