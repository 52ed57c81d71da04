"""TawPipe with context parallelism in the simulator (design §3.6, §9.3): each forward's and
backward's K/V exchanged among a context group over the node's links, the bytes the cost model
counts; the inter-node bytes those of the plan without it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tawpipe.cost.traffic import context_bytes, plan_traffic
from tawpipe.sim import compare
from tawpipe.sim.hardware import Cluster, device, link
from tawpipe.sim.network import simulate
from tawpipe.sim.play import engine_plan, plan_graph
from tawpipe.sim.workload import Workload, model
from tawpipe.cost.memory import Savers, gathered_kv_bytes

DEV = device("h100")
FULL = model("1b", seq=16384, micro_batch=1)
CLUSTER = Cluster(2, 4, DEV, link("nvlink"), link("100gb"))


@pytest.mark.parametrize("c", [2, 4])
@pytest.mark.parametrize("recompute", ["chunk", "layer", "block", "none"])
def test_the_kv_exchange_sends_what_the_cost_model_counts_inside_the_node(c, recompute):
    work = Workload(FULL, DEV).sliced(c)
    plan = engine_plan(CLUSTER, work, 2, mb_per_fetch=1, prefetch_depth=1, reuse_weights=False)
    graph, _ = plan_graph(plan, CLUSTER, work, host=False, savers=Savers(recompute))
    sent = {r: sum(f.bytes for t in graph.tasks if t.lane == "cp" for f in t.flows if f.src == r)
            for r in range(CLUSTER.world_size)}
    for r in range(CLUSTER.world_size):
        assert sent[r] == pytest.approx(context_bytes(plan, r, FULL, c, recompute), rel=1e-12) and sent[r] > 0
    for t in graph.tasks:  # every exchange stays inside a node
        if t.lane == "cp":
            assert len({r // CLUSTER.per_node for f in t.flows for r in (f.src, f.dst)}) == 1


def test_context_parallelism_keeps_the_plans_inter_node_bytes_and_cuts_activation_memory():
    whole, sliced = Workload(FULL, DEV), Workload(FULL, DEV).sliced(4)
    settings = dict(mb_per_fetch=1, prefetch_depth=1, reuse_weights=False)
    rows = [compare.run("tawpipe", CLUSTER, w, 2, settings=settings) for w in (whole, sliced)]
    plans = [engine_plan(CLUSTER, w, 2, **settings) for w in (whole, sliced)]
    assert plan_traffic(plans[0]).flows == plan_traffic(plans[1]).flows
    assert rows[1].inter_bytes == pytest.approx(rows[0].inter_bytes, rel=1e-9)
    # a quarter of the activations, and one layer's keys and values of the whole sequence gathered
    kv = gathered_kv_bytes(sliced.dims, 4)
    assert kv == 2 * 2 * FULL.seq * FULL.hidden // FULL.heads * FULL.kv_heads * FULL.dtype_bytes
    assert rows[1].memory.activations == pytest.approx(rows[0].memory.activations / 4 + kv, rel=1e-9)


def test_weipipe_cannot_split_a_sequence():
    work = Workload(replace(FULL, layers=16), DEV).sliced(2)
    plan = engine_plan(CLUSTER, work, 2, algo="weipipe")
    with pytest.raises(ValueError, match="same slots"):
        plan_graph(plan, CLUSTER, work, host=False)
