"""Causal attention of a run of a sequence's queries to the keys before them, without a dense mask.

Under context parallelism (design §3.6) a rank holds the queries of two runs of positions and,
gathered, every key and value of the sequence. A run at ``offset`` attends causally to keys
``0 .. offset + n - 1``: the lower-right corner of the causal square. Torch's SDPA takes that as
``causal_lower_right``, which CUDA's fused kernels run natively but the CPU runs as a dense
(n, offset + n) float mask, O(S^2 / c) bytes at long S. So on the CPU the run's attention is two
fused calls, one to the keys before it (no mask) and one causal to its own keys, merged by their
log-sum-exps; the backward calls the fused backward of each with the merged output and
log-sum-exp, which gives each part's exact gradient (the same identity ring attention uses).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .parts import SequenceSlice

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                            scale: float | None = None) -> torch.Tensor:
    """Queries (B, heads, n, d) at positions ``offset .. offset + n - 1`` attending causally to
    the keys and values (B, kv_heads, >= offset + n, d) at positions 0 on (grouped-query: heads a
    multiple of kv_heads); ``scale`` multiplies the scores (None: 1 / sqrt(d), as SDPA's)."""
    n, gqa = q.shape[-2], q.shape[1] != k.shape[1]
    if offset == 0:
        return F.scaled_dot_product_attention(q, k[..., :n, :], v[..., :n, :], is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    if q.device.type == "cpu":
        return _PrefixCausal.apply(q, k[..., :offset, :], v[..., :offset, :], k[..., offset:offset + n, :],
                                   v[..., offset:offset + n, :], scale)
    from torch.nn.attention.bias import causal_lower_right  # here: it imports torch._dynamo (2.6 s of CPU)

    return F.scaled_dot_product_attention(q, k[..., :offset + n, :], v[..., :offset + n, :],
                                          attn_mask=causal_lower_right(n, offset + n), scale=scale, enable_gqa=gqa)


def sliced_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: SequenceSlice,
                     scale: float | None = None) -> torch.Tensor:
    """Attention of a slice's queries (B, heads, tokens, d) to the whole sequence: ``seq.gather``
    brings every key and value, and each run of the slice's positions attends causally to the
    keys before it. The output is laid out like ``q``."""
    k, v = seq.gather(k, v)
    return torch.cat([prefix_causal_attention(q[..., i:i + n, :], k, v, start, scale) for i, start, n in seq.runs],
                     dim=-2)


class _PrefixCausal(torch.autograd.Function):
    """The CPU's two fused calls and their merge (module doc)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k_before: torch.Tensor, v_before: torch.Tensor, k_own: torch.Tensor,
                v_own: torch.Tensor, scale: float | None) -> torch.Tensor:
        o_before, lse_before = _flash(q, k_before, v_before, 0.0, False, scale=scale)
        o_own, lse_own = _flash(q, k_own, v_own, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_before, lse_own)
        wide = torch.promote_types(q.dtype, torch.float32)  # the merge in float32 at least
        out = ((lse_before - lse).exp().unsqueeze(-1) * o_before.to(wide)
               + (lse_own - lse).exp().unsqueeze(-1) * o_own.to(wide)).to(q.dtype)
        ctx.save_for_backward(q, k_before, v_before, k_own, v_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k_before, v_before, k_own, v_own, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq_before, dk_before, dv_before = _flash_backward(grad, q, k_before, v_before, out, lse, 0.0, False,
                                                          scale=ctx.scale)
        dq_own, dk_own, dv_own = _flash_backward(grad, q, k_own, v_own, out, lse, 0.0, True, scale=ctx.scale)
        return dq_before + dq_own, dk_before, dv_before, dk_own, dv_own, None
