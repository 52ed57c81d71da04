"""The Plan data type: JSON round trip, message sizes, the Plan's methods and how actions are made
(design §4)."""

from __future__ import annotations

import dataclasses
import gc
import json

import pytest

from tawpipe.plan.actions import OPS, Action, Op, new_action
from tawpipe.plan.plan import STATS_BYTES, Plan
from tawpipe.plan.schedule import build_plan
from tawpipe.plan.topology import Topology


# ------------------------------------------------------------------------------------------- JSON


@pytest.mark.parametrize("algo", ["tawpipe", "weipipe"])
def test_json_round_trip(algo):
    plan = build_plan(Topology(2, 3), 8, 2, algo=algo, layer_numel=7, replicated_numel=11)
    text = plan.to_json()
    back = Plan.from_json(text)
    assert back == plan
    doc = json.loads(text)
    assert len(doc["actions"]) == sum(len(acts) for acts in plan.actions)
    send = next(d for d in doc["actions"] if d["op"] == "SEND_W")
    assert {"slot", "rank", "op", "chunk", "peer", "bytes", "buf"} <= set(send)
    bcast = next((d for d in doc["actions"] if d["op"] == "BCAST_W"), None)
    assert algo == "weipipe" or {"root", "group", "bytes"} <= set(bcast)
    with pytest.raises(ValueError, match="not a tawpipe plan"):
        Plan.from_json(json.dumps({"format": "other"}))


# ---------------------------------------------------------------------------------------- methods


@pytest.mark.parametrize("algo", ["tawpipe", "weipipe"])
def test_plan_methods_agree_with_the_built_plan(algo):
    plan = build_plan(Topology(2, 2), 7, 2, algo=algo, layer_numel=10, weight_bytes=2, grad_bytes=4,
                      replicated_numel=5)
    assert [plan.own_chunk(plan.owner[k]) for k in range(4)] == [0, 1, 2, 3]
    assert plan.model_order == ((0, 1, 2, 3) if algo == "tawpipe" else (0, 3, 2, 1))  # design §4.1
    first = plan.model_order[0]  # the first chunk holds 2 of the 7 layers
    assert plan.chunk_layers[first] == (0, 2) and plan.chunk_numel(first) == 20
    assert sum(plan.chunk_numel(k) for k in range(4)) == 7 * 10
    assert plan.message_bytes(Op.SEND_W, first) == 20 * 2
    assert plan.message_bytes(Op.REDUCE_G, first) == plan.message_bytes(Op.RECV_G, first) == 20 * 4
    assert plan.message_bytes(Op.ALLREDUCE_REPLICATED, None) == 5 * 4
    assert plan.message_bytes(Op.ALLREDUCE_STATS, None) == STATS_BYTES
    comm = [a for acts in plan.actions for a in acts if OPS[a.op].is_comm]
    assert comm and all(a.bytes == plan.message_bytes(a.op, a.chunk) for a in comm)


@pytest.mark.parametrize("options", [dict(), dict(mb_per_fetch=2, reuse_weights=True),
                                     dict(mb_per_fetch=4, prefetch_depth="resident", reuse_weights=True),
                                     dict(algo="weipipe")])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 1, 3), (1, 2, 1), (2, 2, 1), (2, 2, 2), (4, 1, 2)])
def test_only_a_rank_alone_in_its_replica_adds_its_gradients_in_place(shape, options):
    """``accumulated_in_place``: every gradient buffer of a rank that is its replica's only one,
    none of any other (an owner's ACC_G adds what other ranks sent); and none where something
    reads the accumulator while a backward's gradient still waits for its ACC_G."""
    nodes, per_node, replicas = shape
    try:
        plan = build_plan(Topology(nodes, per_node), 4, 4, replicas=replicas, layer_numel=10, **options)
    except ValueError as e:  # WeiPipe's ring needs two ranks per replica
        assert "weipipe needs at least 2 ranks" in str(e) and nodes * per_node == replicas
        return
    for rank in range(plan.topology.world_size):
        acts = plan.actions[rank]
        grads = {a.buf for a in acts if a.op is Op.ACC_G}
        assert grads and plan.accumulated_in_place(rank) == (grads if plan.replica_size == 1 else set())
        if plan.replica_size == 1:
            b = next(i for i, a in enumerate(acts) if a.op is Op.B)  # the accumulator read before its ACC_G
            early = dataclasses.replace(plan, actions=[(*acts[:b + 1], new_action(0, rank, Op.ALLREDUCE_STATS,
                                                                                  group=(rank,)), *acts[b + 1:])])
            assert early.accumulated_in_place(0) == frozenset()


# ------------------------------------------------------------------------------- making actions


def test_new_action_makes_the_same_action():
    """The schedules make millions of actions with ``new_action`` (and ``_make``, its inlined copy):
    each is an Action in every respect, frozen, equal and hashed like one made by ``Action(...)``."""
    plan = build_plan(Topology(2, 2), 4, 4, mb_per_fetch=2, prefetch_depth=2, layer_numel=3)
    fields = [f.name for f in dataclasses.fields(Action)]
    for a in (a for acts in plan.actions for a in acts):
        twin = Action(**{name: getattr(a, name) for name in fields})
        assert type(a) is Action and a == twin and hash(a) == hash(twin) and repr(a) == repr(twin)
    a = new_action(3, 1, Op.F, chunk=2, mb=0, buf="w0")
    assert a == Action(3, 1, Op.F, chunk=2, mb=0, buf="w0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.slot = 4  # type: ignore[misc]
    assert dataclasses.replace(a, tag=1) == Action(3, 1, Op.F, chunk=2, mb=0, buf="w0", tag=1)
    assert Action.from_json(a.to_json()) == a


def test_building_and_proving_leave_the_collector_as_they_found_it():
    from tawpipe.plan.verify import verify

    enabled = gc.isenabled()
    try:
        for state in (True, False):
            (gc.enable if state else gc.disable)()
            plan = build_plan(Topology(2, 2), 4, 2)
            verify(plan)
            assert gc.isenabled() is state
    finally:
        (gc.enable if enabled else gc.disable)()


def test_a_large_plan_goes_straight_to_the_oldest_generation(monkeypatch):
    """No collection after the build walks a plan of millions of actions (``settle``): its actions
    are in the oldest generation at once; and where the caller froze objects, they stay frozen."""
    import tawpipe.plan.schedule as schedule

    monkeypatch.setattr(schedule, "SETTLE_ACTIONS", 0)  # settle even a small plan
    gc.unfreeze()  # what an earlier test froze (``tawpipe plan`` freezes its plan) would stop settle
    plan = build_plan(Topology(2, 2), 4, 2)
    young = {id(o) for g in (0, 1) for o in gc.get_objects(generation=g)}
    assert not any(id(a) in young for acts in plan.actions for a in acts)
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        build_plan(Topology(2, 2), 4, 2)
        # an unfreeze would move every frozen object back (the count to 0); a few frozen objects an
        # earlier test left may die on their own meanwhile (a full run once lost 2 of 662,399)
        assert frozen - 64 <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
