"""Which ranks can split a sequence (context parallelism, design §3.6): the context groups of a
topology, and the check that a plan runs each group's forwards and backwards in the same slots."""

from __future__ import annotations

from .actions import Op
from .plan import Plan
from .topology import Topology


def context_groups(topology: Topology, degree: int) -> list[tuple[int, ...]]:
    """The context groups: each node's ranks in runs of ``degree`` consecutive ranks."""
    if topology.per_node % degree:
        raise ValueError(f"context_parallel={degree} does not divide the {topology.per_node} ranks of a node: "
                         f"a context group is {degree} ranks of one node; choose a divisor of {topology.per_node}")
    return [tuple(range(first, first + degree)) for first in range(0, topology.world_size, degree)]


def check_plan(plan: Plan, degree: int) -> None:
    """The ranks of each context group run the same forwards and backwards in the same slots: the
    exchanges inside them then pair up at once, and each waits only for work of its own slot (a
    schedule where they do not, WeiPipe's ring, would wait across slots, and deadlock). Replica
    0's groups stand for every replica's (their plans are its own, shifted)."""
    for group in context_groups(plan.topology, degree):
        if group[-1] >= plan.replica_size:
            break
        runs = [[(a.slot, a.op, a.chunk, a.mb) for a in plan.actions[r] if a.op in (Op.F, Op.B)] for r in group]
        if any(run != runs[0] for run in runs[1:]):
            raise ValueError(f"context_parallel={degree}: in the {plan.algo!r} plan ranks {group} do not run the same "
                             "chunks in the same slots, so they cannot compute one micro-batch together; use the "
                             "'tawpipe' schedule, whose node's ranks run each chunk in the same slot")
