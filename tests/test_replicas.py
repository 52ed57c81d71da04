"""Replicas (design §3.5): plans, their proof and their bytes; the engine exact against
single-process training; checkpoints across replica counts; the options refused."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections import defaultdict

import pytest
import safetensors.torch
import torch

from cli_cases import refused
from engine_cases import exactness, make_engine
from replica_cases import normed_over_replicas, resume_across_replicas
from tawpipe.cli import main
from tawpipe.cost.memory import Savers, estimate_memory, memory_per_rank
from tawpipe.cost.traffic import estimate, plan_traffic
from tawpipe.models.shape import ModelDims
from tawpipe.plan.actions import OPS, Op, PlanError
from tawpipe.plan.plan import Plan, Programs
from tawpipe.plan.schedule import build_plan
from tawpipe.plan.topology import Topology
from tawpipe.plan.verify import verify
from tawpipe.runtime import comm as comm_backends
from tawpipe.runtime.comm.torch_dist import TorchDistComm
from tawpipe.runtime.launch import run_local
from test_engine import _check, _check_traffic

SHAPES = [  # (nodes, per_node, replicas, layers, acc, options)
    (2, 2, 2, 3, 2, {}),
    (4, 2, 2, 5, 2, {"grad_route": "leader"}),
    (3, 2, 3, 2, 1, {}),
    (6, 1, 3, 3, 4, {"mb_per_fetch": 2, "prefetch_depth": 2}),
    (4, 2, 2, 4, 4, {"mb_per_fetch": 2, "prefetch_depth": "resident", "reuse_weights": True}),
    (4, 2, 2, 5, 4, {"mb_per_fetch": 1, "reuse_weights": "host"}),
    (2, 3, 2, 4, 2, {"algo": "weipipe"}),
]


def _plan(shape) -> Plan:
    g, s, r, layers, acc, options = shape
    return build_plan(Topology(g, s), layers, acc, replicas=r, layer_numel=5, **options)


def _materialised(plan: Plan) -> Plan:
    return dataclasses.replace(plan, actions=tuple(plan.actions[r] for r in range(plan.topology.world_size)))


@pytest.mark.parametrize("shape", SHAPES)
def test_both_proofs_pass_and_agree(shape) -> None:
    plan = _plan(shape)
    full, fast = verify(plan, exhaustive=True), verify(plan, exhaustive=False)
    n, size, acc = plan.topology.world_size, plan.replica_size, plan.micro_batches
    assert (full.ranks_run, fast.ranks_run) == (n, size)
    assert full.contributions == fast.contributions == size * n * acc  # every chunk: every rank's micro-batches
    assert (full.weight_buffers, full.grad_buffers) == (fast.weight_buffers, fast.grad_buffers)
    assert full.actions == plan.replicas * fast.actions
    # a chunk's owners, one per replica and all on one rail, add their gradients exactly once
    for r in range(n):
        ex = [a for a in plan.actions[r] if a.op is Op.ALLREDUCE_G]
        assert len(ex) == 1 and ex[0].group == plan.owners(plan.own_chunk(r))
        assert len({plan.topology.local_index(m) for m in ex[0].group}) == 1
        assert len({plan.topology.group_of(m) for m in ex[0].group}) == plan.replicas
    assert verify(_materialised(plan), exhaustive=False) == fast  # shifts checked action by action


def _mutations(plan: Plan, rng: random.Random, count: int, everywhere: bool):
    """Random single edits of one rank's list: drop, swap neighbours, change a field. ``everywhere``:
    the edit is made in replica 0 and so in every replica (a ``Programs`` of the edited lists);
    else in the list of one rank of any replica alone."""
    n = plan.topology.world_size if not everywhere else plan.replica_size
    for _ in range(count):
        r = rng.randrange(n)
        acts = list(plan.actions[r])
        i = rng.randrange(len(acts))
        kind = rng.choice(["drop", "swap", "buf", "chunk", "tag", "mb"])
        a = acts[i]
        if kind == "drop":
            acts.pop(i)
        elif kind == "swap" and i + 1 < len(acts):
            acts[i], acts[i + 1] = acts[i + 1], acts[i]
        elif kind == "buf" and a.buf is not None:
            acts[i] = dataclasses.replace(a, buf="w1" if a.buf != "w1" else "w0")
        elif kind == "chunk" and a.chunk is not None:
            acts[i] = dataclasses.replace(a, chunk=(a.chunk + 1) % plan.replica_size)
        elif kind == "tag" and a.tag is not None:
            acts[i] = dataclasses.replace(a, tag=a.tag + 1)
        elif kind == "mb" and a.mb is not None:
            acts[i] = dataclasses.replace(a, mb=(a.mb + 1) % plan.micro_batches)
        if tuple(acts) == tuple(plan.actions[r]):
            continue  # nothing to change (say, the micro-batch of a plan of one)
        lists = [plan.actions[q] for q in range(n)]
        lists[r] = tuple(acts)
        actions = Programs(lists, plan.replicas) if everywhere else tuple(lists)
        yield (r, kind, i), dataclasses.replace(plan, actions=actions)


def _outcome(plan: Plan, exhaustive: bool, simulate_channels: bool = True) -> str:
    try:
        verify(plan, exhaustive=exhaustive, simulate_channels=simulate_channels)
    except PlanError:
        return "refused"
    return "passed"


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_the_fast_proof_agrees_with_the_exhaustive_one(shape) -> None:
    """Edited in every replica alike, a plan is refused by both proofs or by neither. Edited in
    one replica alone, the fast proof refuses it (the replicas differ; it proves only identical
    ones), and whatever it passes the exhaustive proof passes too."""
    plan = _plan(shape)
    rng = random.Random(sum(map(ord, repr(shape))))
    refused = 0
    for where, bad in _mutations(plan, rng, 40, everywhere=True):
        full, fast = _outcome(bad, True), _outcome(bad, False)
        assert full == fast, (shape, where, full, fast)
        # and the channel model derived from the serial run (design §5.3) agrees with its simulation
        assert _outcome(bad, True, simulate_channels=False) == full, (shape, where)
        assert _outcome(bad, False, simulate_channels=False) == fast, (shape, where)
        refused += full == "refused"
    assert refused >= 10  # many edits are real faults: the comparison is not vacuous
    for where, bad in _mutations(plan, rng, 20, everywhere=False):
        if where[0] >= plan.replica_size:
            assert _outcome(bad, False) == "refused", where
        if _outcome(bad, False) == "passed":
            assert _outcome(bad, True) == "passed", where
        for exhaustive in (True, False):
            assert _outcome(bad, exhaustive, simulate_channels=False) == _outcome(bad, exhaustive), where


def test_json_round_trips_replica_zero_only() -> None:
    plan = _plan(SHAPES[1])
    doc = json.loads(plan.to_json())
    assert doc["replicas"] == 2 and {a["rank"] for a in doc["actions"]} == set(range(plan.replica_size))
    back = Plan.from_json(plan.to_json())
    assert back == plan and isinstance(back.actions, Programs)
    assert [back.actions[r] for r in range(8)] == [plan.actions[r] for r in range(8)]
    assert json.loads(plan.to_json(actions=False))["actions"] == []
    one = build_plan(Topology(2, 2), 4, 2)  # a plan saved before replicas existed still reads
    older = {k: v for k, v in json.loads(one.to_json()).items() if k != "replicas"} | {"format": "tawpipe-plan/2"}
    assert Plan.from_json(json.dumps(older)) == one


def _reference_flows(plan: Plan) -> dict:
    """Every rank's own list, counted without the replica shortcut."""
    topo, out = plan.topology, defaultdict(float)

    def hop(src, dst, kind, nbytes):
        cross = topo.group_of(src) != topo.group_of(dst)
        out[(src, "sent", kind, cross)] += nbytes
        out[(dst, "received", kind, cross)] += nbytes

    for r in range(topo.world_size):
        for a in plan.actions[r]:
            spec = OPS[a.op]
            if spec.transfer == "send":
                hop(r, a.peer, spec.kind, a.bytes)
            elif spec.transfer == "collective" and a.root is None and len(a.group) > 1:
                k = len(a.group)
                hop(r, a.group[(a.group.index(r) + 1) % k], spec.kind, 2 * (k - 1) / k * a.bytes)
            elif spec.transfer == "collective" and a.root == r:
                order = a.group[a.group.index(r):] + a.group[:a.group.index(r)]
                for x, y in zip(order, order[1:]):
                    hop(x, y, spec.kind, a.bytes) if a.op is Op.BCAST_W else hop(y, x, spec.kind, a.bytes)
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("shape", SHAPES)
def test_traffic_counts_every_replica(shape) -> None:
    plan = _plan(shape)
    t = plan_traffic(plan)
    assert {k: v for k, v in t.flows.items() if v} == pytest.approx(_reference_flows(plan))
    # the exchange: each owner sends 2(R-1)/R of its chunk's float32 accumulator, all across nodes
    r = plan.replicas
    for rank in range(plan.topology.world_size):
        chunk = plan.own_chunk(rank)
        want = 2 * (r - 1) / r * plan.chunk_numel(chunk) * 4
        assert t.total(rank, kind="replica", inter=True) == pytest.approx(want)
        assert t.total(rank, kind="replica", inter=False) == 0


@pytest.mark.parametrize("g,s,r,depth,k", [(4, 2, 1, 1, 1), (4, 2, 2, 2, 2), (4, 2, 4, 1, 4), (6, 1, 3, 1, 2),
                                           (2, 3, 2, 3, 1), (3, 1, 3, 1, 2), (1, 1, 1, 2, 4)])
def test_memory_closed_form_equals_the_plan_count(g, s, r, depth, k) -> None:
    """Replicas of one rank (3 x 1 in 3, and 1 x 1) hold their one chunk in one weight buffer
    whatever the depth, and no gradient buffer but with the state on the host."""
    dims = ModelDims(hidden=64, layers=13, heads=4, vocab=100, seq=32)
    plan = build_plan(Topology(g, s), 13, 4, replicas=r, prefetch_depth=depth, mb_per_fetch=k)
    assert estimate_memory(dims, Topology(g, s), replicas=r, prefetch_depth=depth, mb_per_fetch=k) == \
        memory_per_rank(plan, dims)
    host = Savers(offload_state=True)  # the closed form leaves the host's traffic out
    assert estimate_memory(dims, Topology(g, s), replicas=r, prefetch_depth=depth, mb_per_fetch=k,
                           savers=host).staging == memory_per_rank(plan, dims, host).staging


def test_closed_form_bytes_follow_the_plan() -> None:
    """The advice's closed form against the plan: exact where a replica is one node (but for the
    step's 24-byte statistics), within the turnarounds' 10% otherwise (design §7.1)."""
    dims = ModelDims(hidden=64, layers=16, heads=4, vocab=100, seq=32)
    for grad_bytes in (4, 2):  # the replicas' and the replicated sums cross in the gradients' wire dtype
        sizes = dict(layer_numel=dims.layer_numel, weight_bytes=2, grad_bytes=grad_bytes,
                     replicated_numel=dims.replicated_numel)
        for r, tol in ((4, 2e-5), (2, 0.1)):
            plan = build_plan(Topology(4, 2), 16, 8, replicas=r, **sizes)
            sums = [a for rank in plan.actions for a in rank if a.op is Op.ALLREDUCE_G]
            assert sums and all(a.bytes == plan.chunk_numel(a.chunk) * grad_bytes for a in sums)
            replicated = [a for rank in plan.actions for a in rank if a.op is Op.ALLREDUCE_REPLICATED]
            assert len(replicated) == 8 and all(a.bytes == dims.replicated_numel * grad_bytes for a in replicated)
            measured = max(plan_traffic(plan).per_node())
            d = dataclasses.replace(dims, grad_bytes=grad_bytes)
            assert estimate("tawpipe", d, Topology(4, 2), 8, replicas=r).inter_node_per_node == \
                pytest.approx(measured, rel=tol)


def test_plan_command_prints_replicas_and_advice(capsys) -> None:
    main(["plan", "--nodes", "4", "--per-node", "2", "--layers", "8", "--micro-batches", "2", "--replicas", "2",
          "--hidden", "64", "--heads", "4", "--vocab", "100", "--seq-len", "32", "--memory-budget", "0.01"])
    out = capsys.readouterr().out
    assert "replica 0 of 2 (ranks 0-3)" in out and "2 replicas of 4 ranks" in out
    assert "on replica 0's 4 ranks" not in out  # small: proven on every rank
    rows = {int(line.split()[0]): line for line in out.splitlines()
            if line[:5].strip().isdigit() and ("yes" in line or "no:" in line)}
    assert sorted(rows) == [1, 2, 4]
    assert "fewest inter-node bytes within the budget: --replicas" in out
    main(["plan", "--nodes", "4", "--per-node", "2", "--layers", "8", "--micro-batches", "2", "--replicas", "2",
          "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["plan"]["replicas"] == 2 and summary["plan"]["actions"] == []
    assert summary["verified"]["contributions"] == 4 * 8 * 2
    main(["plan", "--nodes", "4", "--per-node", "2", "--layers", "8", "--micro-batches", "2", "--replicas", "2",
          "--json", "--actions"])
    units = dict(layer_numel=1, weight_bytes=1, grad_bytes=1, replicated_numel=0)  # no model: one layer's parameters
    assert Plan.from_json(capsys.readouterr().out) == build_plan(Topology(4, 2), 8, 2, replicas=2, **units)


@pytest.mark.parametrize("kwargs,message", [
    (dict(replicas=3), r"replicas=3 does not divide the 4 nodes.*\[1, 2, 4\]"),
    (dict(replicas=0), "replicas must be an integer >= 1"),
    (dict(replicas=2, num_layers=3), r"num_layers=3 < 4 ranks per replica"),
])
def test_bad_replicas_are_refused(kwargs, message) -> None:
    args = dict(num_layers=8, micro_batches=2) | kwargs
    with pytest.raises(ValueError, match=message):
        build_plan(Topology(4, 2), **args)


def test_replicas_too_small_for_the_schedule_are_refused_per_replica() -> None:
    """WeiPipe needs two ranks in a pipeline: with replicas of one rank each, the message counts
    the replica's ranks, not the job's (it said "got 1" of a job of two)."""
    with pytest.raises(ValueError, match=r"weipipe needs at least 2 ranks per replica, and 2 replicas of the 2 ranks "
                                         r"leave 1: use fewer replicas"):
        build_plan(Topology(2, 1), 4, 2, algo="weipipe", replicas=2)
    assert build_plan(Topology(2, 1), 4, 2, algo="weipipe").replicas == 1  # the same job without replicas is built


CASES = {
    4: [dict(nodes=2, acc=2, layers=3, replicas=2),  # two replicas of 1 x 2, uneven chunks
        dict(nodes=2, acc=1, layers=4, replicas=2, overlap=False, max_grad_norm=0.05),
        dict(nodes=2, acc=4, layers=2, replicas=2, mb_per_fetch=2, prefetch_depth="resident", reuse_weights=True),
        dict(nodes=2, acc=2, layers=3, replicas=2, algo="weipipe"),
        dict(nodes=2, acc=2, layers=6, replicas=2, recompute="layer", max_grad_norm=0.05),  # chunks of 3 layers
        dict(nodes=2, acc=2, layers=4, replicas=2, offload_activations=True, mb_per_fetch=2),
        dict(nodes=2, acc=2, layers=6, replicas=2, recompute="block", offload_activations=True)],
    6: [dict(nodes=3, acc=2, layers=3, replicas=3, max_grad_norm=0.05),
        dict(nodes=3, acc=1, layers=2, replicas=3, algo="weipipe", offload_state=True)],
    8: [dict(nodes=4, acc=2, layers=5, replicas=2, mb_per_fetch=2),  # two replicas of 2 x 2
        dict(nodes=4, acc=4, layers=5, replicas=2, mb_per_fetch=2, prefetch_depth=1, reuse_weights="host",
             max_grad_norm=0.05)],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_replicas_are_exact_vs_single_process(world: int) -> None:
    results = run_local(exactness, world, CASES[world], timeout=300)
    _check(results)
    _check_traffic(results)


def test_with_the_state_on_the_host_the_replicas_sum_is_normed_before_it_goes_there() -> None:
    """ALLREDUCE_G sums the own chunk's gradient over the replicas in a copy on the device, in the
    wire's dtype: the norm (clipping, the non-finite check) is taken from that copy, never from the
    host accumulator (on a CPU only a bfloat16 wire makes a copy: a float32 one sums the
    accumulator itself, the device being the host), and the clipped training equals one
    process's (to bfloat16's rounding where it computes in bfloat16)."""
    for wire, tolerance in (("float32", 1e-5), ("bfloat16", 1e-2)):
        for r in run_local(normed_over_replicas, 4, wire, timeout=300):
            assert r["norms"] > 0 and (wire == "float32" or not r["host_normed"]), (wire, r)
            assert r["err"] <= tolerance, (wire, r)


def test_checkpoints_resume_exactly_and_reshard_to_another_replica_count(tmp_path) -> None:
    results = run_local(resume_across_replicas, 4, str(tmp_path), timeout=300)
    files = results[0]["files"]
    assert files == ["manifest.json"] + [f"rank-{r:05d}.pt" for r in range(4)]
    manifest = json.loads((tmp_path / "step-00000002" / "manifest.json").read_text())
    assert manifest["replicas"] == 2
    assert [manifest["files"][f"rank-{r:05d}.pt"]["layers"] is None for r in range(4)] == [False, False, True, True]
    for rank, r in enumerate(results):
        # the same replica count: this rank's own extra, and the third step bit for bit
        assert r["extra_2"] == {"rank": rank} and not r["resharded_2"]
        assert r["loss3_2"] == r["loss3"]
        assert all(torch.equal(p, r["params3"][n]) for n, p in r["params3_2"].items())
        # one replica: every parameter loaded exactly, re-sharded, and the same step to rounding
        assert r["loaded_equal_1"] and r["loaded_equal_2"] and r["resharded_1"]
        assert r["loss3_1"] == pytest.approx(r["loss3"], rel=1e-6)
    # the export: one shard per chunk (2), not per rank (4), then the replicated one, numbered 1..3 of 3
    exported = tmp_path / "exported"
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in exported.glob("*.safetensors")) == sorted(set(index["weight_map"].values())) == names
    files = {name: safetensors.torch.load_file(exported / name) for name in names}
    assert index["weight_map"] == {n: name for name, held in files.items() for n in held}
    tensors, whole = {n: t for held in files.values() for n, t in held.items()}, results[0]["whole"]
    assert tensors.keys() == whole.keys() and all(torch.equal(t, whole[n]) for n, t in tensors.items())
    two = {n: p for r in results for n, p in r["params3"].items()}
    one = {n: p for r in results for n, p in r["params3_1"].items()}
    assert two.keys() == one.keys()
    assert max(((one[n] - p).norm() / p.norm()).item() for n, p in two.items()) < 1e-5


def test_a_plan_too_large_to_build_names_the_replicas_that_fit(capsys) -> None:
    assert re.search(r"134,217,728 forwards and backwards.*--replicas 8",
                     refused(capsys, "plan", "--nodes", "128", "--per-node", "8", "--layers", "1024",
                             "--micro-batches", "64"))


class _NoReplicas(TorchDistComm):
    """A registered backend without collectives across replicas (as nccl-native is today)."""

    supports_replicas = False

    @classmethod
    def create(cls, topology, timeout, device):
        raise AssertionError("a backend was built: the refusal came too late")


@pytest.mark.parametrize("options,message", [
    (dict(replicas=3), r"replicas=3 does not divide the 2 nodes.*\[1, 2\]"),
    (dict(replicas=2, comm="no-replicas"), r"replicas=2 needs comm='torch'"),
])
def test_the_engine_refuses_replicas_it_cannot_run_before_connecting(options, message) -> None:
    from engine_cases import TinyLM, lm_loss

    comm_backends.register("no-replicas", _NoReplicas)
    m = TinyLM(4)
    try:
        with pytest.raises(ValueError, match=message):
            make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(2, 2), micro_batches=2, **options)
    finally:
        comm_backends.unregister("no-replicas")
