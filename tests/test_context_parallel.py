"""Context parallelism inside a node (design §3.6) on a real multi-process gloo job: each context
group's ranks split every sequence, and training equals single-process training on whole
sequences; the K/V exchange sends what the cost model counts; bad input is refused up front."""

from __future__ import annotations

import re

import pytest
import torch

from tawpipe.engine.context import slice_positions
from tawpipe.models.llama import chunked_head_loss
from tawpipe.models.parts import position_runs
from tawpipe.plan.context import context_groups
from tawpipe.runtime.launch import run_local

from context_cases import exactness, refusals

PARAM_RTOL = 1e-5
# the chunked loss rounds otherwise than the plain one (its gradients agree to 3e-7, test_loss),
# which AdamW's normalisation lifts to 2e-5 in the weights whose gradients are smallest
CHUNKED_PARAM_RTOL = 5e-5
PAPER = dict(mb_per_fetch=1, prefetch_depth=1, reuse_weights=False)


def test_mirrored_slices_cover_the_sequence_once_and_balance_causal_work():
    for degree in (1, 2, 3, 4):
        seq = 8 * degree
        every = torch.cat([slice_positions(seq, degree, i) for i in range(degree)])
        assert sorted(every.tolist()) == list(range(seq))
        # the keys a slice's queries attend to under a causal mask: the same for every member
        work = {int((slice_positions(seq, degree, i) + 1).sum()) for i in range(degree)}
        assert len(work) == 1, (degree, work)
    with pytest.raises(ValueError, match="multiple of 8"):
        slice_positions(12, 4, 0)


def test_context_groups_are_runs_of_a_nodes_ranks():
    from tawpipe.plan.topology import Topology

    assert context_groups(Topology(2, 4), 2) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert context_groups(Topology(2, 2), 2) == [(0, 1), (2, 3)]
    with pytest.raises(ValueError, match="divisor of 4"):
        context_groups(Topology(1, 4), 3)



def test_a_slices_runs_are_its_positions_cut_where_they_jump():
    """``position_runs`` against a loop over the positions: random ascending positions, and every
    member's slice of a mirrored cut (two runs, or one for the middle member)."""
    def by_loop(positions: list[int]) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        for i, p in enumerate(positions):
            if out and out[-1][1] + out[-1][2] == p:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
            else:
                out.append((i, p, 1))
        return out

    g = torch.Generator().manual_seed(7)
    for n in (1, 2, 17, 300):
        positions = torch.randperm(3 * n, generator=g)[:n].sort().values
        assert list(position_runs(positions)) == by_loop(positions.tolist())
    for degree in (1, 2, 4):
        for i in range(degree):
            positions = slice_positions(64, degree, i)
            assert list(position_runs(positions)) == by_loop(positions.tolist())
            assert len(position_runs(positions)) == (1 if i == degree - 1 else 2)
    assert position_runs(torch.tensor([], dtype=torch.int64)) == ()

CASES = [
    dict(nodes=2, acc=2, context_parallel=2, max_grad_norm=0.05, **PAPER),  # a node's 2 ranks, clipping
    dict(nodes=2, acc=2, context_parallel=2, recompute="layer", offload_activations=True, mb_per_fetch=2,
         prefetch_depth=1, reuse_weights=True),
    dict(nodes=2, acc=1, context_parallel=2, recompute="none", reuse_weights="host", mb_per_fetch=1,
         prefetch_depth=1),
    dict(nodes=2, acc=2, context_parallel=2, recompute="block", replicas=2),  # a replica per node
    dict(nodes=1, acc=2, context_parallel=4, **PAPER),  # the whole node
    # two groups in a node, evaluating 1 and 2 batches
    dict(nodes=1, acc=1, context_parallel=2, max_grad_norm=0.05, uneven_val=True, **PAPER),
    # ignored targets falling unevenly among the slices (all of one member's, in a step and a batch
    # evaluated): the slices' losses weigh by their counted targets
    dict(nodes=1, acc=2, context_parallel=2, max_grad_norm=0.05, ignored=True, **PAPER),
    dict(nodes=2, acc=1, context_parallel=2, ignored=True, head_loss=chunked_head_loss, **PAPER),
]


def test_context_parallel_training_equals_single_process_training_on_whole_sequences():
    results = run_local(exactness, 4, CASES, timeout=240)
    for rank_results in results:
        for r in rank_results:
            c = r["case"]
            rtol = CHUNKED_PARAM_RTOL if "head_loss" in c else PARAM_RTOL
            assert r["param_err"] <= rtol, (c, r["rank"], r["worst"], r["param_err"])
            for a, b in zip(r["losses"], r["ref_losses"]):
                assert abs(a - b) <= 1e-5 * abs(b), (c, r["losses"], r["ref_losses"])
            assert abs(r["val"] - r["want_val"]) <= 1e-5 * r["want_val"], (c, r["val"], r["want_val"])
            # the K/V exchange sent what the cost model counts
            assert r["exchanged"] == r["planned"] > 0, (c, r["rank"], r["exchanged"], r["planned"])


REFUSED = [
    (dict(context_parallel=2, seq=14), "multiple of 4"),  # 14 tokens: not 2c equal pieces
    (dict(context_parallel=2, odd_batch=True), r"ranks \(2, 3\) were given different batches"),
]


def test_bad_batches_are_refused_on_every_rank_and_leave_the_engine_training():
    results = run_local(refusals, 4, [case for case, _ in REFUSED], timeout=120)
    for rank, said in enumerate(results):
        for i, (_, pattern) in enumerate(REFUSED):
            error, unchanged, then = said[3 * i:3 * i + 3]
            assert re.search(pattern, error), (rank, error)
            assert unchanged == "unchanged=True", (rank, error)
            assert then.startswith("then "), then


def test_what_cannot_split_a_sequence_is_refused_before_any_rank_connects():
    import dataclasses

    from tawpipe.engine.engine import TawPipe
    from tawpipe.engine.policy import SchedulePolicy
    from tawpipe.models.llama import llama_parts
    from tawpipe.plan.topology import Topology

    from context_cases import CFG

    parts = llama_parts(CFG, seed=1)
    with pytest.raises(ValueError, match="no sliced_context"):
        TawPipe(dataclasses.replace(parts, sliced_context=None), topology=Topology(1, 2), micro_batches=1,
                schedule=SchedulePolicy(context_parallel=2))
    with pytest.raises(ValueError, match="divisor of 2"):
        TawPipe(parts, topology=Topology(2, 2), micro_batches=1, schedule=SchedulePolicy(context_parallel=4))
    with pytest.raises(ValueError, match="do not run the same chunks in the same slots"):
        TawPipe(parts, topology=Topology(1, 2), micro_batches=1,
                schedule=SchedulePolicy(algo="weipipe", context_parallel=2))
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="context_parallel must be an integer"):
            SchedulePolicy(context_parallel=bad)


def test_a_backend_without_groups_smaller_than_a_node_is_refused_before_it_is_built():
    """Context groups smaller than a node need communicators the topology does not have (as
    nccl-native has none yet): refused before the backend is built, not by a NotImplementedError
    after its communicators exist. A whole node's group is the node's own."""
    from tawpipe.engine.engine import TawPipe
    from tawpipe.engine.policy import CommPolicy, SchedulePolicy
    from tawpipe.models.llama import llama_parts
    from tawpipe.plan.topology import Topology
    from tawpipe.runtime import comm as comm_backends
    from tawpipe.runtime.comm.torch_dist import TorchDistComm

    from context_cases import CFG

    class NodeGroupsOnly(TorchDistComm):
        supports_replicas = False

        @classmethod
        def create(cls, topology, timeout, device):
            raise AssertionError("the backend was built")

    comm_backends.register("node-groups-only", NodeGroupsOnly)
    try:
        parts = llama_parts(CFG, seed=1)
        with pytest.raises(ValueError, match=r"context_parallel=2 on nodes of 4 ranks needs comm='torch'"):
            TawPipe(parts, topology=Topology(1, 4), micro_batches=1, schedule=SchedulePolicy(context_parallel=2),
                    comm=CommPolicy("node-groups-only"))
        with pytest.raises(AssertionError, match="the backend was built"):  # passed every check
            TawPipe(parts, topology=Topology(1, 4), micro_batches=1, schedule=SchedulePolicy(context_parallel=4),
                    comm=CommPolicy("node-groups-only"))
    finally:
        comm_backends.unregister("node-groups-only")
