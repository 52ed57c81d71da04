"""Traffic accounting of plans against the cost model (design §7.1) and the peer estimates."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tawpipe.plan.actions import Action, Op
from tawpipe.plan.schedule import build_plan
from tawpipe.plan.topology import Topology
from tawpipe.cost.traffic import (busiest_node_sent, crossover_tokens, estimate, methods, plan_traffic, ring_next,
                                  weight_passing_bytes)
from tawpipe.models.shape import ModelDims
from tawpipe.plan.schedule import RESIDENT


MODEL = ("weights", "grads", "replicated")  # the model's traffic; "stats" is 16 bytes whatever the units


def elements(topo: Topology, layers: int, acc: int, **kw):
    """Traffic in elements: with one parameter per layer, Psi = layers."""
    return plan_traffic(build_plan(topo, layers, acc, layer_numel=1, weight_bytes=1, grad_bytes=1, **kw))


def test_tawpipe_paper_setup_n24_g3_acc64():
    """The paper's setup: ~123-128 Psi across nodes per node, of which acc·N·(G-1)/G chunks are
    gradients (design §7.1)."""
    psi = 24
    t = elements(Topology(3, 8), psi, 64)
    per_node = t.per_node(kind=MODEL)
    assert all(122 * psi <= v <= 128 * psi for v in per_node), [v / psi for v in per_node]
    assert max(per_node) == pytest.approx(3 * 64 * (3 - 1) / 3 * psi, rel=0.01)
    assert t.per_node(kind="grads") == [64 * 24 * 2 / 3] * 3  # 1024 chunks = 42.7 Psi
    weights = t.per_node(kind="weights")  # 80-85 Psi are weights
    assert all(80 * psi <= v <= 85.5 * psi for v in weights), [v / psi for v in weights]
    # weight traffic spreads over the rails: at most 2·acc·(G-1) chunks per device
    assert t.busiest(kind="weights")[1] == 2 * 64 * 2


@pytest.mark.parametrize("G,s,acc", [(2, 4, 4), (4, 2, 3), (3, 3, 2), (8, 1, 2), (4, 4, 4)])
def test_tawpipe_inter_node_volume_is_about_3_acc_g_minus_1_over_g_psi(G, s, acc):
    n = G * s
    t = elements(Topology(G, s), n, acc)
    mean = sum(t.per_node(kind=MODEL)) / G
    # exactly: every chunk is fetched 2·acc·(N-1)+1 times per group (design §7.1), by G-1 groups from
    # another node; every group sends acc·(N-s) gradients to other nodes
    assert mean == pytest.approx((G - 1) / G * (2 * acc * (n - 1) + 1 + acc * n))
    assert mean == pytest.approx(3 * acc * (G - 1) / G * n, rel=1 / n)
    assert sum(t.per_node()) == pytest.approx(t.total(inter=True))
    assert t.total(inter=True) == pytest.approx(t.total(inter=True, direction="received"))
    assert t.total(kind="stats", inter=True) > 0  # the step's statistics cross nodes too


@pytest.mark.parametrize("acc", [4, 8, 16])
def test_weipipe_ring_link_across_nodes_carries_about_3_acc_plus_1_psi(acc):
    psi, topo = 8, Topology(2, 4)
    plan = build_plan(topo, psi, acc, algo="weipipe", layer_numel=1, weight_bytes=1, grad_bytes=1)
    link = sum(a.bytes for acts in plan.actions for a in acts
               if a.op in (Op.SEND_W, Op.SEND_G) and (a.rank, a.peer) == (3, 4))
    # the paper counts the reference's sends (acc+1 rounds); the plan drops the unconsumed ones
    assert 3 * acc * psi * 0.95 <= link <= 3 * (acc + 1) * psi


def test_rail_routing_cuts_the_busiest_ranks_inter_node_gradients_by_s():
    for G, s, acc in [(3, 8, 8), (2, 4, 3), (4, 2, 2)]:
        leader = elements(Topology(G, s), G * s, acc, grad_route="leader")
        rail = elements(Topology(G, s), G * s, acc, grad_route="rail")
        r_lead, v_lead = leader.busiest(kind="grads")
        _, v_rail = rail.busiest(kind="grads")
        assert Topology(G, s).local_index(r_lead) == 0
        assert v_lead == acc * G * s * (G - 1) / G  # everything leaves from local index 0
        assert v_lead / v_rail == pytest.approx(s)
        assert rail.per_rail(kind="grads") == [v_rail * G] * s  # balanced over the rails
        assert rail.total(kind="grads", inter=True) == leader.total(kind="grads", inter=True)


def test_collectives_stay_inside_nodes_and_p2p_between_them():
    single = elements(Topology(1, 4), 8, 2)
    assert single.total(inter=True) == 0 and single.total(inter=False) > 0
    pure_p2p = elements(Topology(4, 1), 8, 2)
    assert pure_p2p.total(inter=False) == 0 and pure_p2p.total(inter=True) > 0


def test_chain_model_of_a_broadcast_and_received_equals_sent():
    # G=1, s=4, one chunk of one layer per rank: every broadcast is 3 hops, every reduce 3 hops
    plan = build_plan(Topology(1, 4), 4, 1, layer_numel=1, weight_bytes=1, grad_bytes=1)
    t = plan_traffic(plan)
    bcasts = sum(a.op is Op.BCAST_W for a in plan.actions[0])
    reduces = sum(a.op is Op.REDUCE_G for a in plan.actions[0])
    assert t.total(kind="weights") == 3 * bcasts
    assert t.total(kind="grads") == 3 * reduces
    assert t.total(direction="received") == t.total(direction="sent")
    intra, inter = t.node_bytes(0)
    assert inter == 0 and intra == t.total(0)


def test_replicated_allreduce_is_a_world_ring():
    t = plan_traffic(build_plan(Topology(2, 2), 4, 1, replicated_numel=10, grad_bytes=4))
    for r in range(4):
        assert t.total(r, kind="replicated") == pytest.approx(2 * 3 / 4 * 40)
    assert t.total(kind="replicated", inter=True) == pytest.approx(2 * 2 * 3 / 4 * 40)  # 1->2, 3->0


def test_ring_next_is_the_next_member_of_any_group():
    """Ascending groups (a job's ring of every rank), and groups in any order, as a search finds it."""
    rng = random.Random()
    for _ in range(200):
        members = rng.sample(range(10_000), rng.randint(2, 300))
        for group in (tuple(sorted(members)), tuple(members)):
            a = Action(0, group[0], Op.ALLREDUCE_G, group=group, bytes=1)
            for m in rng.sample(group, min(20, len(group))):
                assert ring_next(a, m) == group[(group.index(m) + 1) % len(group)]


def test_model_dims_match_the_spec_model_sizes():
    small = ModelDims(hidden=1024, layers=48)
    assert small.ffn_hidden == 2752
    assert small.decoder_numel + small.replicated_numel == pytest.approx(640e6, rel=0.002)
    big = ModelDims(hidden=4096, layers=48)
    assert big.decoder_numel + big.replicated_numel == pytest.approx(9.81e9, rel=0.002)
    gqa = ModelDims(hidden=1024, layers=48, heads=16, kv_heads=4)
    assert small.layer_numel - gqa.layer_numel == 2 * 1024 * (1024 - 256)
    with pytest.raises(ValueError, match=r"heads=32 \(or give head_dim\)"):
        ModelDims(hidden=1000, layers=2, heads=32)
    for field in ("hidden", "kv_heads", "seq", "dtype_bytes", "ffn", "head_dim"):  # named, not the whole shape
        with pytest.raises(ValueError, match=rf"^{field}=0: every dimension of a model must be >= 1$"):
            replace(small, **{field: 0})
    # a head size of its own: the attention's widths follow it, not H / heads
    own = ModelDims(hidden=1000, layers=2, heads=32, kv_heads=8, head_dim=40)
    assert (own.q_dim, own.kv_dim) == (1280, 320)
    assert own.layer_numel == 2 * 1000 * 1280 + 2 * 1000 * 320 + 3 * 1000 * own.ffn_hidden + 2 * 1000
    # a head size of H / heads, given, changes nothing
    assert ModelDims(hidden=1024, layers=2, heads=16, head_dim=64).layer_numel == ModelDims(
        hidden=1024, layers=2, heads=16).layer_numel


def test_estimates_agree_with_plans_and_with_each_other():
    topo, acc = Topology(3, 8), 8
    dims = ModelDims(hidden=256, layers=24, heads=8, vocab=1000, seq=1024)
    plan = build_plan(topo, dims.layers, acc, layer_numel=dims.layer_numel, weight_bytes=dims.dtype_bytes,
                      grad_bytes=dims.grad_bytes, replicated_numel=dims.replicated_numel)
    t = plan_traffic(plan)
    taw = estimate("tawpipe", dims, topo, acc)
    assert max(t.per_node()) == pytest.approx(taw.inter_node_per_node, rel=0.05)
    assert t.total() / topo.world_size == pytest.approx(taw.sent_per_rank, rel=0.05)
    wplan = build_plan(topo, dims.layers, acc, algo="weipipe", layer_numel=dims.layer_numel,
                       weight_bytes=dims.dtype_bytes, grad_bytes=dims.grad_bytes,
                       replicated_numel=dims.replicated_numel)
    wei = estimate("weipipe", dims, topo, acc)
    assert plan_traffic(wplan).total() / topo.world_size == pytest.approx(wei.sent_per_rank, rel=0.15)
    est = {m: estimate(m, dims, topo, acc) for m in methods()}
    assert est["tawpipe"].inter_node_per_node < est["weipipe"].inter_node_per_node
    assert est["hsdp"].inter_node_per_node < est["fsdp"].inter_node_per_node
    p = dims.decoder_numel + dims.replicated_numel
    assert est["ddp"].inter_node_per_node == pytest.approx(2 * 23 / 24 * p * 4)
    longer = ModelDims(hidden=256, layers=24, heads=8, vocab=1000, seq=2048)
    for m in methods():  # only activation passing grows with the sequence length
        ratio = estimate(m, longer, topo, acc).sent_per_rank / est[m].sent_per_rank
        assert ratio == pytest.approx(2.0 if m == "1f1b" else 1.0)
    with pytest.raises(ValueError, match="unknown method"):
        estimate("zero-bubble", dims, topo, acc)


@pytest.mark.parametrize("nodes,per_node,acc", [(2, 2, 2), (3, 2, 2), (2, 4, 4), (4, 1, 2)])
def test_resident_depth_sends_the_fewest_bytes_of_any_depth(nodes, per_node, acc):
    """Deeper prefetch with reuse keeps more chunks, down to the resident depth and not beyond;
    only the weights fall: the gradients do not depend on the depth."""
    topo = Topology(nodes, per_node)
    n = topo.world_size
    for k in (1, acc):
        by_depth = {d: elements(topo, 2 * n, acc, prefetch_depth=d, mb_per_fetch=k, reuse_weights=True)
                    for d in (*range(1, n + 2), "resident")}
        busiest = {d: max(t.per_node()) for d, t in by_depth.items()}
        assert busiest["resident"] == busiest[n - 1] == busiest[n] == busiest[n + 1] < busiest[n - 2]
        assert busiest["resident"] < busiest[1]
        assert len({t.total(kind="grads") for t in by_depth.values()}) == 1
        assert by_depth["resident"].total(kind="weights") < by_depth[1].total(kind="weights")


@pytest.mark.parametrize("nodes", [2, 3])
@pytest.mark.parametrize("k", [1, 2])
def test_crossover_closed_form_agrees_with_the_plan(nodes, k):
    """Design §7.4: the tokens per micro-batch at which 1F1B's busiest link carries as much as
    TawPipe's, from the closed form and from a real plan's bytes (k = 1 fetches again in the
    backward; k = acc keeps every chunk resident), and the anchors' G = 2 formula 6LH(f_w·b_w + b_g)
    / (b_a·N·k) when the replicated part is left out."""
    topo, acc = Topology(nodes, 2), 2
    dims = ModelDims(hidden=128, layers=topo.world_size, heads=4, vocab=512, seq=4096, dtype_bytes=4, grad_bytes=4)
    kw = dict(mb_per_fetch=k, reuse_weights=True, prefetch_depth=RESIDENT) if k > 1 else {}
    plan = build_plan(topo, dims.layers, acc, layer_numel=dims.layer_numel, weight_bytes=4, grad_bytes=4,
                      replicated_numel=dims.replicated_numel, **kw)
    t = plan_traffic(plan)
    planned = max(max(t.per_node(direction="sent")), max(t.per_node(direction="received")))
    f_w = 2 if k == 1 else 1
    closed = weight_passing_bytes(dims, topo, acc, k, f_w)
    # k = 1: the turnaround chunk is not fetched twice, so the closed form is a little high
    assert closed == pytest.approx(planned, rel=0.1 if k == 1 else 0.01)
    from_plan, from_formula = (crossover_tokens(b, dims, topo, acc) for b in (planned, closed))
    assert from_formula == pytest.approx(from_plan, rel=0.1 if k == 1 else 0.01)
    one_f_one_b = estimate("1f1b", dims, topo, acc).inter_node_per_node
    assert one_f_one_b == pytest.approx(planned * dims.seq / from_plan)  # equal at the crossover
    if nodes == 2:
        bare = weight_passing_bytes(replace(dims, vocab=1), topo, acc, k, f_w) - 2 * 3 / 4 * (2 * dims.hidden) * 4  # the ring of E = 2H
        psi_per_12lh2 = dims.decoder_numel / (12 * dims.layers * dims.hidden ** 2)
        anchors = 6 * dims.layers * dims.hidden * (f_w * 4 + 4) / (4 * topo.world_size * k) * psi_per_12lh2
        assert crossover_tokens(bare, dims, topo, acc) == pytest.approx(anchors, rel=1e-9)


def test_the_busiest_node_counted_on_replica_zero_is_the_whole_jobs():
    """``busiest_node_sent`` counts replica 0's sends only: on random plans of replicas (both
    schedules, uneven chunks, k > 1, the replicated modules' ring) it equals the busiest node of
    the whole job's count, and replica 0's ranks send exactly what they send in it."""
    rng = random.Random()
    for _ in range(12):
        replicas, per_node = rng.choice([2, 3, 4]), rng.randint(1, 3)
        nodes = replicas * rng.randint(1, 2)
        algo = "weipipe" if nodes // replicas * per_node >= 2 and rng.random() < 0.5 else "tawpipe"
        acc = rng.choice([2, 4])
        size = nodes // replicas * per_node
        plan = build_plan(Topology(nodes, per_node), rng.randint(size, 2 * size), acc, algo=algo, replicas=replicas,
                          mb_per_fetch=rng.choice([1, 2]) if algo == "tawpipe" else 1,
                          layer_numel=rng.randint(1, 1000), replicated_numel=rng.randint(0, 500))
        whole, zero = plan_traffic(plan), plan_traffic(plan, replica_zero=True)
        assert busiest_node_sent(plan) == max(whole.per_node()) > 0, (plan.topology, replicas, algo)
        for r in range(size):
            assert zero.total(r) == whole.total(r) and zero.total(r, inter=True) == whole.total(r, inter=True)
        assert sum(zero.per_node()) * replicas == pytest.approx(sum(whole.per_node()))
