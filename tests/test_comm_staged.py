"""The gloo-staged backend (several ranks on one GPU): every call staged through host memory
gives what the ranks' tensors say it must, and training through it equals single-process
training. On the CPU the staging copies are host copies; the same code runs on a GPU."""

from __future__ import annotations

import torch

from tawpipe.plan.topology import Topology
from tawpipe.runtime import comm as comms
from tawpipe.runtime.comm.base import P2P
from tawpipe.runtime.launch import run_local

from engine_cases import exactness
from test_engine import _check, _check_traffic

WORLD, N = 4, 37  # odd sizes on purpose


def _mine(rank: int, salt: int, n: int = N) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * salt + rank))


def _primitives(rank: int) -> dict[str, float]:
    """Each primitive over the staged backend against what the ranks' seeded tensors make it."""
    comm = comms.create("gloo-staged", Topology(2, 2), 60.0, torch.device("cpu"))
    group, world = (0, 1), tuple(range(WORLD))  # node 0's ranks, and everyone
    err = {}

    t = _mine(rank, 1)
    comm.all_reduce(t, world)
    err["all_reduce"] = (t - sum(_mine(r, 1) for r in world)).abs().max().item()

    t = _mine(rank, 2)
    comm.broadcast(t, 3, world)
    err["broadcast"] = (t - _mine(3, 2)).abs().max().item()

    if rank in group:
        t = _mine(rank, 3)
        comm.reduce(t, 1, group)
        err["reduce"] = (t - _mine(0, 3) - _mine(1, 3)).abs().max().item() if rank == 1 else 0.0

    out = torch.empty(WORLD * N)
    comm.all_gather(out, _mine(rank, 4), world)
    err["all_gather"] = (out - torch.cat([_mine(r, 4) for r in world])).abs().max().item()

    piece = torch.empty(N)
    comm.reduce_scatter(piece, _mine(rank, 5, WORLD * N), world)
    whole = sum(_mine(r, 5, WORLD * N) for r in world)
    err["reduce_scatter"] = (piece - whole[rank * N:(rank + 1) * N]).abs().max().item()

    # a ring, sending and receiving in one batch, on a channel of its own
    grads = comm.channel_comm("grads")
    got = torch.empty(N)
    grads.batch_p2p([P2P("send", _mine(rank, 6), (rank + 1) % WORLD), P2P("recv", got, (rank - 1) % WORLD)])
    err["batch_p2p"] = (got - _mine((rank - 1) % WORLD, 6)).abs().max().item()

    if rank < 2:  # one blocking pair
        t = _mine(rank, 7)
        (comm.send if rank == 0 else comm.recv)(t, 1 - rank)
        err["send/recv"] = (t - _mine(0, 7)).abs().max().item()
    return err


def test_every_call_through_host_memory_gives_the_collectives_result() -> None:
    results = run_local(_primitives, WORLD, timeout=120)
    for rank, err in enumerate(results):
        assert set(err) >= {"all_reduce", "broadcast", "all_gather", "reduce_scatter", "batch_p2p"}, err
        assert max(err.values()) < 1e-5, (rank, err)


def test_training_over_it_equals_single_process_training() -> None:
    """Its messages go in batches on their channel (no single posted ones): the traffic is still
    the plan's, and the result single-process training's, with the memory savers it serves."""
    assert comms.backend("gloo-staged").async_p2p is False
    cases = [dict(nodes=2, acc=2, layers=5, comm="gloo-staged", max_grad_norm=0.05),
             dict(nodes=2, acc=4, layers=8, comm="gloo-staged", recompute="layer", offload_activations=True,
                  offload_state=True, mb_per_fetch=2)]
    results = run_local(exactness, WORLD, cases, timeout=240)
    _check(results)
    _check_traffic(results)
