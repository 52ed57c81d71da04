"""Causal attention of a run of queries to the keys before them (context parallelism's slices,
``tawpipe.models.attention``) against attention written out with its dense causal mask."""

from __future__ import annotations

import pytest
import torch

from tawpipe.models.attention import prefix_causal_attention


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float | None = None) -> torch.Tensor:
    n, keys, group = q.shape[-2], k.shape[-2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    visible = (torch.arange(n)[:, None] + offset) >= torch.arange(keys)[None, :]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("heads, kv_heads, n, offset, keys, scale", [
    (4, 2, 5, 7, 12, None),  # the run ends the sequence
    (4, 4, 8, 0, 8, None),  # at the start: plain causal
    (2, 1, 3, 20, 29, None),  # keys past the run (a slice's second run), grouped 2:1
    (4, 2, 16, 48, 64, None),
    (4, 2, 5, 7, 12, 0.21),  # a model's own score scale (Hugging Face's ``scaling``)
    (4, 4, 8, 0, 8, 0.6),
])
def test_a_run_attends_to_every_key_before_it_and_back_propagates_exactly(dtype, tol, heads, kv_heads, n, offset, keys,
                                                                           scale):
    g = torch.Generator().manual_seed(n * 100 + offset)
    q, k, v = (torch.randn(2, h, t, 8, generator=g, dtype=dtype).requires_grad_()
               for h, t in ((heads, n), (kv_heads, keys), (kv_heads, keys)))
    upstream = torch.randn(2, heads, n, 8, generator=g, dtype=dtype)
    out = prefix_causal_attention(q, k, v, offset, scale)
    got = [out, *torch.autograd.grad(out, (q, k, v), upstream)]
    ref = _dense(q, k, v, offset, scale)
    want = [ref, *torch.autograd.grad(ref, (q, k, v), upstream)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert (a - b).abs().max() <= tol * b.abs().max(), (name, (a - b).abs().max().item())
    # keys after the run get no gradient: they are never attended to
    assert torch.count_nonzero(got[2][..., offset + n:, :]) == 0
