"""Bad input fails with a clear message before any communication (no process group here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tawpipe.comm import Comm
from tawpipe.engine import TawPipe
from tawpipe.topology import Topology

from engine_cases import HIDDEN, TinyLM, lm_loss


class NoComm(Comm):
    """A backend that fails the test if anything is communicated (world size 1 ops are local)."""

    def __init__(self, world_size: int) -> None:
        self.rank, self.world_size = 0, world_size

    def _local_only(self, group=(0,)):
        assert self.world_size == 1 and tuple(group) == (0,), "communication before validation"

    def send(self, tensor, peer):
        self._local_only(group=(0, peer))

    def recv(self, tensor, peer):
        self._local_only(group=(0, peer))

    def broadcast(self, tensor, root, group):
        self._local_only(group)

    def reduce(self, tensor, root, group):
        self._local_only(group)

    def all_reduce(self, tensor, group):
        self._local_only(group)

    def channel_comm(self, name):
        return self


def _make(layers=4, topo=Topology(2, 2), comm=None, **kw):
    torch.manual_seed(0)
    m = TinyLM(layers)
    return TawPipe(m.blocks, m.embed, m.head, lm_loss, topology=topo, micro_batches=kw.pop("acc", 2),
                   comm=comm or NoComm(topo.world_size), block_context=m.context, **kw)


@pytest.mark.parametrize("kwargs, message", [
    (dict(layers=3), "layers"),
    (dict(acc=0), "micro"),
    (dict(compute_dtype=torch.float64), "compute_dtype"),
    (dict(recompute="layer"), "recompute"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"),
    (dict(loss_scale="sometimes"), "loss_scale"),
    (dict(comm=NoComm(2)), "ranks"),
])
def test_bad_arguments(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        _make(**kwargs)


def test_blocks_of_different_structure() -> None:
    m = TinyLM(4)
    blocks = list(m.blocks)
    blocks[2] = nn.Linear(HIDDEN, HIDDEN)
    with pytest.raises(ValueError, match="block 2 differs in structure"):
        TawPipe(blocks, m.embed, m.head, lm_loss, topology=Topology(2, 2), micro_batches=1, comm=NoComm(4))
    with pytest.raises(ValueError, match="empty"):
        TawPipe([], m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=1, comm=NoComm(1))


def test_bad_batch_and_resume_shard() -> None:
    eng = _make(layers=2, topo=Topology(1, 1), acc=2)
    x = torch.randint(0, 10, (3, 5))
    with pytest.raises(ValueError, match="multiple of micro_batches"):
        eng.step((x, x))
    with pytest.raises(ValueError, match="differ in shape"):
        eng.step((x[:2], x[:2, :4]))
    good = torch.randint(0, 10, (4, 5))
    loss = eng.step((good, good))  # a world of one still trains, with local-only collectives
    assert loss == loss and loss > 0
    state = eng.state_dict()
    state["chunk"] = 7
    with pytest.raises(ValueError, match="owns chunk"):
        eng.load_state_dict(state)
    eng.close()


def test_fp16_overflow_skips_the_step_and_backs_off() -> None:
    """Dynamic loss scaling: an overflowing step changes nothing and halves the scale, until
    steps fit in float16 again."""
    torch.manual_seed(0)
    m = TinyLM(2)
    huge = lambda logits, targets: 3e4 * lm_loss(logits, targets)  # noqa: E731
    eng = TawPipe(m.blocks, m.embed, m.head, huge, topology=Topology(1, 1), micro_batches=1,
                  comm=NoComm(1), block_context=m.context, compute_dtype=torch.float16)
    before = {n: p.detach().clone() for n, p in eng.named_parameters()}
    x = torch.randint(0, 10, (2, 5))
    eng.step((x, x))
    assert eng.skipped_steps == 1
    assert all(torch.equal(p, before[n]) for n, p in eng.named_parameters())
    for _ in range(20):
        eng.step((x, x))
    assert 1 < eng.skipped_steps < 21  # backed off, then took steps
    assert any(not torch.equal(p, before[n]) for n, p in eng.named_parameters())
    eng.close()
