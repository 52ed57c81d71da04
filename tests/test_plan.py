"""The Plan data type: JSON round trip, message sizes and the Plan's methods (design §4)."""

from __future__ import annotations

import json

import pytest

from tawpipe.plan.actions import OPS, Op
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
