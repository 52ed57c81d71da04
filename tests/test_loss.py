"""The chunked linear cross-entropy (models.loss): the plain loss and its gradients to 1e-6, no
[tokens, vocabulary] float32 tensor ever, and the engine training with it as with the plain loss."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from engine_cases import TinyLM, global_batch, lm_loss, make_engine, reference_run, rel_err
from tawpipe.models.llama import Head, LlamaConfig, chunked_head_loss, llama_loss
from tawpipe.models.loss import linear_cross_entropy
from tawpipe.plan.topology import Topology
from test_engine_errors import NoComm


def _inputs(seed: int, shape=(3, 37), hidden=16, vocab=50):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    t = torch.randint(0, vocab, shape, generator=g)
    t.view(-1)[torch.randperm(t.numel(), generator=g)[:5]] = -100  # some ignored targets
    return h, w, t


def _loss_and_grads(fn, h, w, t):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(h, w, t)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 7, 64, 111, 1000])
def test_equals_the_plain_loss_and_its_gradients(chunk) -> None:
    h, w, t = _inputs(chunk)
    plain = _loss_and_grads(lambda h, w, t: F.cross_entropy((h @ w.t()).flatten(0, 1), t.flatten()), h, w, t)
    mine = _loss_and_grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk=chunk), h, w, t)
    assert abs(mine[0] - plain[0]) <= 1e-6 * abs(plain[0])
    assert rel_err(mine[1], plain[1]) <= 1e-6 and rel_err(mine[2], plain[2]) <= 1e-6
    with torch.no_grad():  # a validation pass: the loss alone
        assert abs(linear_cross_entropy(h, w, t, chunk=chunk) - plain[0]) <= 1e-6 * abs(plain[0])


def test_targets_all_ignored_give_0_and_no_gradient_where_the_plain_loss_is_nan() -> None:
    """The README's one exception to equal losses: nothing to count is a loss of 0 that moves
    nothing (the plain loss divides 0 by 0)."""
    h, w, t = _inputs(5)
    t.fill_(-100)
    plain = _loss_and_grads(lambda h, w, t: F.cross_entropy((h @ w.t()).flatten(0, 1), t.flatten()), h, w, t)
    mine = _loss_and_grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk=7), h, w, t)
    assert plain[0].isnan()
    assert mine[0] == 0 and not mine[1].any() and not mine[2].any()


class _Sizes(TorchDispatchMode):
    """Records the largest float32 tensor any op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(x) and x.dtype == torch.float32:
                self.largest = max(self.largest, x.numel())
        return out


def test_never_holds_the_float32_logits() -> None:
    tokens, vocab, chunk = 512, 300, 64
    h, w, t = _inputs(0, shape=(2, tokens // 2), vocab=vocab)
    plain, mine = _Sizes(), _Sizes()
    with plain:
        F.cross_entropy((h @ w.t()).flatten(0, 1), t.flatten()).backward()
    with mine:
        linear_cross_entropy(h, w, t, chunk=chunk).backward()
    assert plain.largest >= tokens * vocab  # the detector sees the plain loss's logits
    assert mine.largest <= chunk * vocab  # one chunk's logits at the most


def test_llama_head_loss_equals_llama_loss_under_autocast_too() -> None:
    cfg = LlamaConfig(vocab_size=97, hidden=32, n_layers=1, max_seq_len=16)
    head = Head(cfg)
    torch.nn.init.normal_(head.norm.weight, 1.0, 0.1)
    h, _, t = _inputs(5, shape=(2, 16), hidden=32, vocab=97)
    ref = _loss_and_grads(lambda h, w, t: llama_loss(head(h), t), h, head.out.weight, t)
    head.zero_grad()
    mine = _loss_and_grads(lambda h, w, t: chunked_head_loss(head, h, t), h, head.out.weight, t)
    assert abs(mine[0] - ref[0]) <= 1e-6 * abs(ref[0]) and rel_err(mine[1], ref[1]) <= 1e-6
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the projection in bfloat16, as nn.Linear runs it
        low, plain = chunked_head_loss(head, h, t), llama_loss(head(h), t)
    assert low.dtype == torch.float32 and abs(low - plain) <= 1e-2 * abs(plain)


def test_the_engine_trains_with_it_exactly() -> None:
    torch.manual_seed(0)
    model = TinyLM(3)
    ref, ref_losses = reference_run(model, 8, 2, None)

    def head_loss(head, hidden, targets):
        return linear_cross_entropy(head.norm(hidden), head.proj.weight, targets, chunk=5)

    m = copy.deepcopy(model)
    engine = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=2, comm=NoComm(1),
                         block_context=m.context, head_loss=head_loss,
                         optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6))
    losses = [engine.step(global_batch(step, 8)) for step in range(2)]
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    params = dict(ref.named_parameters())
    assert max(rel_err(p.detach(), params[n].detach()) for n, p in engine.named_parameters()) <= 1e-5
    x, y = global_batch(7, 4)
    assert engine.evaluate([(x, y)]) == pytest.approx(lm_loss(ref(x), y).item(), rel=1e-5)
