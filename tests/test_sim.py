"""The simulator's core against closed forms (design §9): one link and one transfer, fair sharing,
dependencies, and plans played as the engine runs them (their bytes are the plan's)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tawpipe.cost.traffic import plan_traffic

from tawpipe.models.shape import ModelDims
from tawpipe.plan.actions import OPS, Op
from tawpipe.sim import compare
from tawpipe.sim.hardware import Cluster, Device, Link, link
from tawpipe.sim.network import Fabric, Flow, Graph, Port, _Active, _share, simulate
from tawpipe.sim.play import compute_seconds, engine_plan, plan_graph
from tawpipe.sim.workload import Workload

DEV = Device("test", matmul_flops=2e10, attention_flops=1e10, memory_bandwidth=2e9, memory=1e10)
DIMS = ModelDims(hidden=64, layers=8, heads=4, vocab=128, seq=256, micro_batch=1, dtype_bytes=4, grad_bytes=4)


def _fabric(inter: float = 1e6, intra: float = 1e8, per_node: int = 2) -> Fabric:
    return Fabric(per_node=per_node, intra=intra, inter=inter)


def test_one_transfer_on_one_link_takes_bytes_over_rate_plus_latency():
    rng = random.Random(1)
    nbytes, rate, lat = rng.uniform(1e5, 1e7), rng.uniform(1e6, 1e8), rng.uniform(1e-5, 1e-2)
    g = Graph()
    g.add("x", flows=[Flow(0, 2, nbytes)], latency=lat)
    assert simulate(g, _fabric(inter=rate)).makespan == pytest.approx(nbytes / rate + lat, rel=1e-12)


def test_two_flows_share_a_port_and_the_shorter_one_frees_it():
    # a and b leave node 0 together: each gets rate/2 until a ends at 2a/rate; b then has the port
    rate, a, b = 1e6, 3e5, 8e5
    g = Graph()
    ta = g.add("a", flows=[Flow(0, 2, a)])
    tb = g.add("b", flows=[Flow(1, 3, b)])
    r = simulate(g, _fabric(inter=rate))
    assert r.end[ta] == pytest.approx(2 * a / rate, rel=1e-12)
    assert r.end[tb] == pytest.approx((a + b) / rate, rel=1e-12)


def test_max_min_fairness_gives_a_flow_what_its_neighbour_cannot_use():
    # flows 0->2 and 1->3 share node 0's uplink; 1->3 is also limited by rank 3's... no: make the
    # second flow bottlenecked elsewhere: 4->3 and 1->3 share node 1's downlink with 0->2.
    # Node 1 (ranks 2, 3) receives three flows: each gets 1/3; node 0 sends two of them.
    rate, size = 3e6, 1e6
    g = Graph()
    for src, dst in ((0, 2), (1, 3), (4, 3)):
        g.add(f"{src}->{dst}", flows=[Flow(src, dst, size)])
    r = simulate(g, _fabric(inter=rate))
    assert r.makespan == pytest.approx(3 * size / rate, rel=1e-12)  # node 1's downlink is the bottleneck
    # full duplex: the opposite direction does not slow anything down
    g2 = Graph()
    g2.add("there", flows=[Flow(0, 2, size)])
    g2.add("back", flows=[Flow(2, 0, size)])
    assert simulate(g2, _fabric(inter=rate)).makespan == pytest.approx(size / rate, rel=1e-12)


def _max_min_rates(flows: list[tuple[Port, ...]], cap: dict[Port, float]) -> list[float]:
    """Progressive filling, port by port: the reference ``network._share`` must match to the bit
    (the ports scanned in order of first use, the first of equal shares taken)."""
    rate: list[float | None] = [None] * len(flows)
    left = dict(cap)
    first_used = list(dict.fromkeys(p for f in flows for p in f))
    while None in rate:
        open_ports = [p for p in first_used if any(r is None and p in f for f, r in zip(flows, rate))]

        def fair(p: Port) -> float:
            return left[p] / sum(1 for f, r in zip(flows, rate) if r is None and p in f)

        best = min(open_ports, key=fair)
        share = max(fair(best), 1e-9 * cap[best])
        for i, f in enumerate(flows):
            if rate[i] is None and best in f:
                rate[i] = share
                for q in f:
                    left[q] -= share
    return rate  # type: ignore[return-value]


def test_fair_shares_match_progressive_filling_to_the_bit():
    """Many flows over shared ports with equal capacities (ties) and uneven ones."""
    rng = random.Random()
    for _ in range(300):
        ports = [("port", i) for i in range(rng.randint(1, 25))]
        cap = {p: rng.choice([1.0, 3.0, 1.25e10, rng.uniform(0.1, 10.0)]) for p in ports}
        flows = [tuple(rng.sample(ports, rng.randint(1, min(4, len(ports))))) for _ in range(rng.randint(1, 30))]
        active = [_Active(i, 1.0, f) for i, f in enumerate(flows)]
        _share(active, cap)
        assert [a.rate for a in active] == _max_min_rates(flows, cap)


def test_intra_node_flows_use_the_devices_own_ports():
    g = Graph()
    g.add("a", flows=[Flow(0, 1, 4e6)])
    g.add("b", flows=[Flow(2, 3, 4e6)])  # another node: its own ports
    g.add("c", flows=[Flow(0, 2, 1e3)])  # across nodes: the node port, not the devices'
    r = simulate(g, _fabric(inter=1e6, intra=4e6))
    assert r.end[0] == pytest.approx(1.0, rel=1e-12) and r.end[1] == pytest.approx(1.0, rel=1e-12)
    assert r.end[2] == pytest.approx(1e-3, rel=1e-12)


def test_dependencies_chain_compute_and_transfers():
    g = Graph()
    f = g.add("F", seconds=0.5, rank=0)
    t = g.add("send", [f], flows=[Flow(0, 2, 2e6)], latency=0.01)
    b = g.add("B", [t], seconds=0.25, rank=2)
    r = simulate(g, _fabric(inter=1e6))
    assert r.start[t] == pytest.approx(0.5) and r.start[b] == pytest.approx(2.51)
    assert r.makespan == pytest.approx(2.76)


def test_a_cycle_is_named():
    g = Graph()
    a = g.add("a")
    b = g.add("b", [a])
    g.add_deps(a, [b])
    with pytest.raises(ValueError, match="never starts"):
        simulate(g, _fabric())


def test_folded_fabric_sends_mirror_flows_to_the_simulated_node():
    # 2 simulated nodes stand for 4: a flow from node 1 to node 2 arrives at node 0's port
    fab = Fabric(per_node=2, intra=1e9, inter=1e6, fold=2)
    ports = dict(fab.ports(Flow(3, 4, 1.0)))
    assert set(ports) == {("node out", 1), ("node in", 0)}


def test_link_presets_and_rates():
    assert link("14mbit").rate == pytest.approx(14e6 / 8)
    assert link("25gbit@5*0.9").bandwidth == pytest.approx(25e9 / 8 * 0.9)
    assert link("25gbit@5*0.9").latency == pytest.approx(5e-6)
    with pytest.raises(ValueError, match="expected one of"):
        link("fast")


# ------------------------------------------------------------------------------------ plans


@pytest.mark.parametrize("nodes,per_node,options", [
    (2, 2, {}),
    (2, 2, {"mb_per_fetch": 2, "prefetch_depth": "resident", "reuse_weights": True}),
    (3, 2, {"algo": "weipipe"}),
    (4, 2, {"replicas": 2}),
    (2, 1, {"prefetch_depth": 2}),
])
def test_a_plans_simulated_bytes_are_its_traffic(nodes, per_node, options):
    cl = Cluster(nodes, per_node, DEV, Link("intra", 1e9, 1e-5), Link("inter", 1e7, 1e-4))
    dims = dataclasses.replace(DIMS, layers=nodes * per_node + 1)
    work = Workload(dims, DEV)
    plan = engine_plan(cl, work, 2, **options)
    g, fabric = plan_graph(plan, cl, work, host=True)
    r = simulate(g, fabric)
    traffic = plan_traffic(plan)
    fold = nodes // plan.replicas
    for node, sent in enumerate(traffic.per_node()[:fold]):
        assert r.port_bytes.get(("node out", node), 0.0) == pytest.approx(sent, rel=1e-9)
    for node, got in enumerate(traffic.per_node(direction="received")[:fold]):
        assert r.port_bytes.get(("node in", node), 0.0) == pytest.approx(got, rel=1e-9)


@pytest.mark.parametrize("host", [True, False])
def test_with_free_links_a_plan_takes_its_busiest_ranks_compute_or_more(host):
    cl = Cluster(2, 2, DEV, Link("intra", 1e15, 0.0), Link("inter", 1e15, 0.0))
    work = Workload(DIMS, DEV)
    plan = engine_plan(cl, work, 2, mb_per_fetch=2, prefetch_depth="resident", reuse_weights=True)
    r = simulate(*plan_graph(plan, cl, work, host=host))
    compute = [sum(compute_seconds(plan, a, work) for a in plan.actions[q] if OPS[a.op].channel.value == "compute")
               for q in range(4)]
    assert r.busy(0) == pytest.approx(compute[0], rel=1e-9)
    assert max(compute) <= r.makespan <= 1.05 * max(compute)


@pytest.mark.parametrize("host", [False, True])
def test_one_rank_runs_its_list_back_to_back(host):
    # 1 x 1: the cast of the master into w0, then F, B, F, B, ... and the step, which waits for
    # the last accumulation. A single device has one gradient buffer: on a GPU each accumulation
    # overlaps the next forward on its own stream; the CPU executor reaches it only after that
    # forward, and the next backward, which refills the buffer, waits for it
    cl = Cluster(1, 1, DEV, Link("intra", 1e9, 0.0), Link("inter", 1e9, 0.0))
    work = Workload(DIMS, DEV)
    plan = engine_plan(cl, work, 3)
    r = simulate(*plan_graph(plan, cl, work, host=host))
    acts = plan.actions[0]
    cost = {op: [compute_seconds(plan, a, work) for a in acts if a.op is op] for op in Op}
    assert len(cost[Op.F]) == 3 and len(cost[Op.ACC_G]) == 3
    accumulations = sum(cost[Op.ACC_G]) if host else cost[Op.ACC_G][-1]
    expected = cost[Op.LOAD_W][-1] + sum(cost[Op.F]) + sum(cost[Op.B]) + accumulations + sum(cost[Op.STEP])
    assert r.makespan == pytest.approx(expected, rel=1e-12)


def test_a_token_bucket_sends_its_burst_at_the_peak_rate_then_the_rate():
    # an idle shaped port holds `burst` bytes of credit: they pass at `peak`, the rest at `inter`;
    # the credit drains at peak - rate while the burst lasts
    rate, peak, burst, size = 1e6, 1e8, 2e5, 1e6
    fab = Fabric(per_node=1, intra=1e9, inter=rate, burst=burst, peak=peak)
    g = Graph()
    g.add("x", flows=[Flow(0, 1, size)])
    t_burst = burst / (peak - rate)  # credit gone
    sent = peak * t_burst
    assert simulate(g, fab).makespan == pytest.approx(t_burst + (size - sent) / rate, rel=1e-9)
    # after a pause long enough to refill, a second transfer bursts again
    g2 = Graph()
    a = g2.add("a", flows=[Flow(0, 1, size)])
    wait = g2.add("pause", [a], seconds=burst / rate)
    g2.add("b", [wait], flows=[Flow(0, 1, size)])
    one = t_burst + (size - sent) / rate
    assert simulate(g2, fab).makespan == pytest.approx(2 * one + burst / rate, rel=1e-9)


def test_a_host_ranks_transfers_take_the_compute_they_share_its_cpu_with():
    # a CPU rank moves `cpu` bytes/s through gloo when it does nothing else; a flow crosses its
    # sender's and its receiver's CPU, a task of s seconds is s * cpu through its rank's alone.
    # Compute s on rank 0 beside a flow of b bytes 0 -> 1 on a fast link: each gets cpu / 2 until
    # the flow ends at 2b / cpu, having cost the compute b / cpu: the compute ends at s + b / cpu.
    rng = random.Random(7)
    cpu, s = rng.uniform(1e8, 1e9), rng.uniform(0.5, 2.0)
    b = rng.uniform(0.1, 0.4) * s * cpu
    fab = Fabric(per_node=1, intra=1e12, inter=1e12, cpu=cpu)
    g = Graph()
    work = g.add("compute", seconds=s, rank=0)
    move = g.add("send", flows=[Flow(0, 1, b)], rank=0, lane="send")
    r = simulate(g, fab)
    assert r.end[move] == pytest.approx(2 * b / cpu, rel=1e-9)
    assert r.end[work] == pytest.approx(s + b / cpu, rel=1e-9)
    assert r.port_bytes[("node out", 0)] == pytest.approx(b)  # the compute is not a link's bytes
    # the receiver pays too: compute on rank 1 instead is slowed the same way
    g2 = Graph()
    work2 = g2.add("compute", seconds=s, rank=1)
    g2.add("send", flows=[Flow(0, 1, b)], rank=0, lane="send")
    assert simulate(g2, fab).end[work2] == pytest.approx(s + b / cpu, rel=1e-9)
    # a transfer held to cpu / 10 by its link leaves the compute the rest: 0.9 cpu while it lasts
    slow = Fabric(per_node=1, intra=1e12, inter=cpu / 10, cpu=cpu)
    g3 = Graph()
    work3 = g3.add("compute", seconds=s, rank=0)
    g3.add("send", flows=[Flow(0, 1, s * cpu)], rank=0, lane="send")  # 10 s: it outlasts the compute
    assert simulate(g3, slow).end[work3] == pytest.approx(s / 0.9, rel=1e-9)
    # without a CPU model (a GPU), compute and transfers do not meet
    assert simulate(g, Fabric(per_node=1, intra=1e12, inter=1e12)).end[work] == pytest.approx(s, rel=1e-12)


def test_a_rank_under_a_quota_gets_part_of_a_wait_back_and_ranks_that_burst_at_once_share_the_cores():
    # a CPU port with credit C seconds (C * cpu bytes) runs at burst x its rate while credit lasts:
    # after an idle spell a long task of s seconds takes s - C, a short one s / burst
    rng = random.Random(11)
    cpu, burst, credit = rng.uniform(1e8, 1e9), rng.uniform(1.5, 4.0), rng.uniform(0.005, 0.02)
    fab = Fabric(per_node=1, intra=1e12, inter=1e12, cpu=cpu, cpu_credit=credit * cpu, cpu_peak=burst * cpu)
    longest = credit * burst / (burst - 1)  # sustained seconds of work the credit speeds up
    s = rng.uniform(2, 5) * longest
    g = Graph()
    g.add("long", seconds=s, rank=0)
    assert simulate(g, fab).makespan == pytest.approx(s - credit, rel=1e-9)
    g = Graph()
    g.add("short", seconds=0.5 * longest, rank=0)
    assert simulate(g, fab).makespan == pytest.approx(0.5 * longest / burst, rel=1e-9)
    # the credit refills second for second while the rank waits: a wait w < C after a long task
    # gives the next one w back
    w = rng.uniform(0.2, 0.8) * credit
    g = Graph()
    first = g.add("first", seconds=s, rank=0)
    wait = g.add("wait", [first], seconds=w)  # no rank: a timer, the CPU idles
    second = g.add("second", [wait], seconds=s, rank=0)
    r = simulate(g, fab)
    assert r.end[second] - r.start[second] == pytest.approx(s - w, rel=1e-9)
    # two ranks bursting at once on a machine whose cores hold one rank's rate each (cores = cpu per
    # rank): the cores port keeps both at their sustained rate
    full = dataclasses.replace(fab, cores=cpu)
    g = Graph()
    g.add("a", seconds=s, rank=0)
    g.add("b", seconds=s, rank=1)
    assert simulate(g, full).makespan == pytest.approx(s, rel=1e-9)
    # with twice the cores both burst, as alone
    assert simulate(g, dataclasses.replace(fab, cores=burst * cpu)).makespan == pytest.approx(s - credit, rel=1e-9)
    # a fabric whose credit has no faster rate to spend it at is refused
    with pytest.raises(ValueError, match="cpu_peak"):
        Fabric(per_node=1, intra=1e12, inter=1e12, cpu=cpu, cpu_credit=credit * cpu)


def test_a_cluster_of_quota_ranks_gives_the_fabric_their_credit_and_the_machines_cores():
    dev = dataclasses.replace(DEV, transfer_rate=5e8, idle_credit=0.01, burst=2.0, host_ranks=4.0)
    cluster = Cluster(2, 2, dev, link("pcie"), link("10gbe"))
    fab = cluster.fabric(host=True)
    assert fab.cpu == 5e8 and fab.cpu_credit == pytest.approx(0.01 * 5e8) and fab.cpu_peak == pytest.approx(1e9)
    assert fab.cores == pytest.approx(5e8)  # 4 ranks' worth of cores over 4 ranks
    # a GPU (no host) pays nothing of this; a device without a credit only has its CPU port
    assert cluster.fabric().cpu is None and cluster.fabric().cpu_credit == 0
    plain = Cluster(2, 2, dataclasses.replace(DEV, transfer_rate=5e8), link("pcie"), link("10gbe")).fabric(host=True)
    assert plain.cpu_credit == 0 and plain.cores is None


def test_a_folded_fabric_puts_a_mirror_ranks_cpu_on_the_simulated_rank():
    fab = Fabric(per_node=2, intra=1e9, inter=1e6, fold=2, cpu=1e9)
    ports = dict(fab.ports(Flow(3, 5, 1.0)))
    assert ("cpu", 3) in ports and ("cpu", 1) in ports  # rank 5 (node 2) is rank 1's mirror image


def test_a_stream_sends_its_messages_one_at_a_time_in_the_order_they_became_ready():
    # one TCP connection: a then b, each at the whole rate; a second connection shares the port
    rng = random.Random(3)
    rate, a, b, c = 1e6, rng.uniform(1e5, 5e5), rng.uniform(1e5, 5e5), rng.uniform(2e6, 3e6)
    g = Graph()
    ta = g.add("a", flows=[Flow(0, 1, a, stream=("weights", 0, 1))])
    tb = g.add("b", flows=[Flow(0, 1, b, stream=("weights", 0, 1))])
    r = simulate(g, _fabric(inter=rate, per_node=1))
    assert r.end[ta] == pytest.approx(a / rate, rel=1e-12) and r.end[tb] == pytest.approx((a + b) / rate, rel=1e-12)
    # beside another connection's message c (longer than both), the stream gets half the port
    tc = g.add("c", flows=[Flow(0, 1, c, stream=("grads", 0, 1))])
    r = simulate(g, _fabric(inter=rate, per_node=1))
    assert r.end[ta] == pytest.approx(2 * a / rate, rel=1e-12)
    assert r.end[tb] == pytest.approx(2 * (a + b) / rate, rel=1e-12)
    assert r.end[tc] == pytest.approx((a + b + c) / rate, rel=1e-12)
    # a message that becomes ready later queues behind the one on the wire
    g2 = Graph()
    first = g2.add("first", flows=[Flow(0, 1, a, stream=("w", 0, 1))])
    later = g2.add("later", [g2.add("wait", seconds=a / rate / 2)], flows=[Flow(0, 1, b, stream=("w", 0, 1))])
    r2 = simulate(g2, _fabric(inter=rate, per_node=1))
    assert r2.end[first] == pytest.approx(a / rate, rel=1e-12)
    assert r2.end[later] == pytest.approx((a + b) / rate, rel=1e-12)


def test_tawpipe_rows_default_to_the_engines_auto_choice():
    """Left "auto", TawPipe's row is what the engine would choose: among every k, depth and reuse,
    the fewest inter-node bytes whose memory fits the device less 10%, then the fewest bytes to and
    from the host (found here by trying them all). On a device too small for every chunk resident,
    the fetched chunks are kept on the host instead, for the same inter-node bytes."""
    from tawpipe.cost.memory import MARGIN, memory_per_rank
    from tawpipe.plan.schedule import RESIDENT
    from tawpipe.sim.workload import model

    dims = model("7b", seq=4096, micro_batch=1)
    for memory in (80e9, 40e9):
        dev = Device("gpu", 4e14, 3e14, 2e12, memory, 1e15)
        cluster = Cluster(2, 4, dev, link("nvlink"), link("25gbe"))
        work = Workload(dims, dev)
        row = compare.run("tawpipe", cluster, work, 4)
        tried = {}
        for k in (1, 2, 4):
            for depth, reuse in ((1, False), (1, True), (1, "host"), (RESIDENT, True)):
                plan = engine_plan(cluster, work, 4, mb_per_fetch=k, prefetch_depth=depth, reuse_weights=reuse)
                mem = compare.with_loss(memory_per_rank(plan, dims), dims, False)
                if mem.total <= (1 - MARGIN) * memory:
                    tried[(k, plan.options["prefetch_depth"], reuse)] = (max(plan_traffic(plan).per_node()),
                                                                         mem.host_traffic, mem.total)
        best = min(tried, key=lambda c: tried[c])
        assert (row.settings["mb_per_fetch"], row.settings["prefetch_depth"], row.settings["reuse_weights"]) == best
        assert row.fits
        if memory == 80e9:
            assert best == (4, 7, True)  # every chunk resident on the device
    assert best == (4, 1, "host")  # 40 GB: two buffers on the device, the rest on the host
    given = compare.run("tawpipe", cluster, work, 4, settings={**compare.AUTO_SETTINGS, "mb_per_fetch": 2})
    assert given.settings["mb_per_fetch"] == 2
