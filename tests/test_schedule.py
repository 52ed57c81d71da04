"""What the schedules build: the paper's WeiPipe worked schedule, the TawPipe rule (design §3.2)
re-derived independently, gradient routes, the per-group counts of design §7.1, degenerate shapes,
prefetch depth, mb_per_fetch, reuse and the resident depth."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from plan_cases import parse_table
from tawpipe.cost.traffic import plan_traffic
from tawpipe.plan.actions import Action, Op, PlanError
from tawpipe.plan.plan import Plan
from tawpipe.plan.schedule import build_plan, resident_depth
from tawpipe.plan.topology import Topology
from tawpipe.plan.verify import verify

# The WeiPipe paper's N=4 worked schedule with every ring send drawn, verbatim (design §3.4).
PAPER_WEIPIPE_N4_ACC2 = """
| step | worker 0 | worker 1 | worker 2 | worker 3 |
|---|---|---|---|---|
| 0 | F:W0(m0) ⇒ f0 | ⇒ f1 | ⇒ f2 | ⇒ f3 |
| 1 | F:W3(m0) ⇒ f3 | F:W0(m0) ⇒ f0 | ⇒ f1 | ⇒ f2 |
| 2 | F:W2(m0) ⇒ f2 | F:W3(m0) ⇒ f3 | F:W0(m0) ⇒ f0 | ⇒ f1 |
| 3 | F:W1(m0) ⇒ seed W0→1 | F:W2(m0) ⇒ seed W1→0 | F:W3(m0) ⇒ seed W2→3 | F:W0(m0) ⇒ seed W3→2 |
| 4 | F:W0(m1) B:W1(m0) ⇒ f0,b1,g1 | F:W1(m0) ⇒ f1,b0 | F:W2(m0) ⇒ f2,b3 | F:W3(m0) ⇒ f3,b2 |
| 5 | F:W3(m1) B:W2(m0) ⇒ f3,b2,g2 | F:W0(m1) B:W1(m0) ⇒ f0,b1,g1 | F:W1(m0) ⇒ f1,b0 | F:W2(m0) ⇒ f2,b3 |
| 6 | F:W2(m1) B:W3(m0) ⇒ f2,b3,g3 | F:W3(m1) B:W2(m0) ⇒ f3,b2,g2 | F:W0(m1) B:W1(m0) ⇒ f0,b1,g1 | F:W1(m0) ⇒ f1,b0 |
| 7 | F:W1(m1) B:W0(m0) ⇒ b0,g0 | F:W2(m1) B:W3(m0) ⇒ b3,g3 | F:W3(m1) B:W2(m0) ⇒ b2,g2 | F:W0(m1) B:W1(m0) ⇒ b1,g1 |
| 8 | B:W1(m1) ⇒ f0,b1,g1 | F:W1(m1) B:W0(m0) ⇒ f1,b0,g0 | F:W2(m1) B:W3(m0) ⇒ f2,b3,g3 | F:W3(m1) B:W2(m0) ⇒ f3,b2,g2 |
| 9 | B:W2(m1) ⇒ f3,b2,g2 | B:W1(m1) ⇒ f0,b1,g1 | F:W1(m1) B:W0(m0) ⇒ f1,b0,g0 | F:W2(m1) B:W3(m0) ⇒ f2,b3,g3 |
| 10 | B:W3(m1) ⇒ f2,b3,g3 | B:W2(m1) ⇒ f3,b2,g2 | B:W1(m1) ⇒ f0,b1,g1 | F:W1(m1) B:W0(m0) ⇒ f1,b0,g0 |
| 11 | B:W0(m1) ⇒ b0,g0 | B:W3(m1) ⇒ b3,g3 | B:W2(m1) ⇒ b2,g2 | B:W1(m1) ⇒ b1,g1 |
| 12 | ⇒ b1 | B:W0(m1) ⇒ b0,g0 | B:W3(m1) ⇒ b3,g3 | B:W2(m1) ⇒ b2,g2 |
| 13 | ⇒ b2 | ⇒ b1 | B:W0(m1) ⇒ b0,g0 | B:W3(m1) ⇒ b3,g3 |
| 14 | | | | B:W0(m1) |
"""


# -------------------------------------------------------------------------------- worked examples


WEI_LAST = (2 + 2) * 4 - 2  # last compute step of N=4, acc=2


def _paper_weipipe() -> tuple[dict, dict]:
    """(step, worker) -> set of compute entries, and -> list of sends, from the paper's table."""
    _, rows = parse_table(PAPER_WEIPIPE_N4_ACC2)
    comp, sends = {}, {}
    for step, cells in rows.items():
        for w, cell in enumerate(cells):
            left, _, right = cell.partition("⇒")
            comp[(int(step), w)] = set(left.split())
            sends[(int(step), w)] = [s for s in right.strip().split(",") if s]
    return comp, sends


def test_weipipe_n4_acc2_reproduces_the_papers_worked_schedule():
    n = 4
    plan = build_plan(Topology(1, n), 4, 2, algo="weipipe")
    assert plan.owner == (0, 1, 2, 3)
    assert plan.model_order == (0, 3, 2, 1)  # position p uses W((-p) mod N)
    paper_comp, paper_sends = _paper_weipipe()

    comp = {(t, w): set() for t in range(WEI_LAST + 1) for w in range(n)}
    weights, grads, finals = set(), set(), set()
    for a in (a for acts in plan.actions for a in acts):
        if a.op in (Op.F, Op.B):
            comp[(a.slot, a.rank)].add(f"{a.op.value}:W{a.chunk}(m{a.mb})")
        elif a.op is Op.SEND_W:
            t, w = a.slot, a.rank
            if t == n - 1:
                weights.add((t, w, f"seed W{a.chunk}→{a.peer}"))
            elif a.chunk == (w - t) % n:  # the F-ring's chunk at (w, t)
                weights.add((t, w, f"f{a.chunk}"))
            else:
                assert a.chunk == (t - w + 1) % n  # the B-ring's chunk at (w, t)
                weights.add((t, w, f"b{a.chunk}"))
        elif a.op is Op.SEND_G and a.slot <= WEI_LAST:
            assert a.peer == (a.rank + 1) % n
            grads.add((a.slot - 1, a.rank, f"g{a.chunk}"))  # sent the step after the B
        elif a.op is Op.SEND_G:
            finals.add((a.rank, a.peer, a.chunk))
    assert comp == paper_comp

    paper_w = {(t, w, s) for (t, w), ss in paper_sends.items() for s in ss if s[0] in "fbs"}
    paper_g = {(t, w, s) for (t, w), ss in paper_sends.items() for s in ss if s[0] == "g"}
    assert weights <= paper_w
    dropped = paper_w - weights
    assert {(8, 0, "f0"), (12, 0, "b1"), (13, 0, "b2")} <= dropped  # nobody consumes these
    for t, w, s in dropped:  # every dropped send is one that nobody consumes
        ring, x = s[0], int(s[1:])
        for j in range(1, WEI_LAST - t + 1):
            if ring == "f" and (t + j) % n == 0:
                break  # the F-ring reloads the owners' chunks
            uses = paper_comp[(t + j, (w + j) % n)]
            assert not any(u.startswith(f"{ring.upper()}:W{x}(") for u in uses), (t, w, s)
    # gradient ring: every paper send is there; the extra ones carry completed sums to the exchange
    assert paper_g <= grads
    for t, w, _ in grads - paper_g:
        assert not any(u.startswith("B:") for u in paper_comp.get((t, w), ())), (t, w)
    # final exchange u <-> (N-1-u): each owner receives its own chunk's complete sum
    assert finals == {(u, (n - 1 - u) % n, (n - 1 - u) % n) for u in range(n)}
    report = verify(plan)
    assert report.contributions == n * n * 2


def test_rail_route_changes_only_the_inter_group_gradient_router():
    leader = parse_table(build_plan(Topology(2, 2), 4, 2, grad_route="leader").table())[1]
    rail = parse_table(build_plan(Topology(2, 2), 4, 2, grad_route="rail").table())[1]
    # slot 5 of design §3.3: the owner of W3 has local index 1
    assert rail["5"][0] == "**B2**(m0); P2P W1 r2→r0; bcast from r0; reduce G3→r1; P2P G3 r1→r3"
    changed = 0
    for slot in leader:
        for g, (a, b) in enumerate(zip(leader[slot], rail[slot])):
            if a == b:
                continue
            changed += 1
            # remote chunk whose owner has local index 1 (W3 for group 0, W2 for group 1): the
            # router moves from local index 0 to local index 1 of the same group
            k = 3 if g == 0 else 2
            lead, peer = 2 * g, 2 * g + 1
            assert b == a.replace(f"reduce G{k}→r{lead}", f"reduce G{k}→r{peer}").replace(
                f"P2P G{k} r{lead}→", f"P2P G{k} r{peer}→")
    assert changed == 4  # W3 and W2, once per micro-batch


# ------------------------------------------------------------------------ the rule, independently


def design_rule_events(n: int, G: int, acc: int, route: str) -> set[tuple]:
    """The TawPipe rule of design §3.2, re-derived here on its own (router: rail peer or local index
    0), as (slot, op, src, dst, chunk)."""
    s = n // G
    owner = lambda k: (k % G) * s + k // G  # noqa: E731

    def chunk(g: int, tau: int):
        u = tau - g
        if not 0 <= u < 2 * acc * n:
            return None
        v = u % (2 * n)
        return ("F", v) if v < n else ("B", 2 * n - 1 - v)

    out = set()
    for tau in range(-1, 2 * acc * n + G):
        for g in range(G):
            cur, nxt = chunk(g, tau), chunk(g, tau + 1)
            if nxt is not None and (cur is None or cur[1] != nxt[1]):
                k = nxt[1]
                if k % G == g:
                    root = owner(k)
                else:
                    root = g * s + k // G
                    out.add((tau, "SEND_W", owner(k), root, k))
                if s > 1:
                    out.add((tau, "BCAST_W", root, g, k))
            prev = chunk(g, tau - 1)
            if prev is not None and prev[0] == "B":
                k = prev[1]
                root = owner(k) if k % G == g else g * s + (k // G if route == "rail" else 0)
                if s > 1:
                    out.add((tau, "REDUCE_G", root, g, k))
                if root != owner(k):
                    out.add((tau, "SEND_G", root, owner(k), k))
    return out


def plan_events(plan: Plan) -> set[tuple]:
    topo = plan.topology
    out = set()
    for a in (a for acts in plan.actions for a in acts):
        if a.op in (Op.SEND_W, Op.SEND_G):
            out.add((a.slot, a.op.value, a.rank, a.peer, a.chunk))
        elif a.op in (Op.BCAST_W, Op.REDUCE_G):
            out.add((a.slot, a.op.value, a.root, topo.group_of(a.rank), a.chunk))
    return out


RULE_MATRIX = [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (9, 3), (12, 3), (12, 4), (16, 2), (16, 4),
               (24, 3), (24, 4), (4, 1), (8, 1), (4, 4), (6, 6)]


@pytest.mark.parametrize("n,G", RULE_MATRIX)
def test_plan_equals_the_design_rule_and_verifies(n, G):
    for acc in (1, 2, 3):
        for route in ("rail", "leader"):
            plan = build_plan(Topology(G, n // G), n, acc, grad_route=route)
            assert plan_events(plan) == design_rule_events(n, G, acc, route)
            report = verify(plan)
            # the own chunk's copy, w_own, only where other nodes are sent it
            assert report.weight_buffers == (3 if G > 1 else 2) and report.contributions == n * n * acc


# ----------------------------------------------------------------------------- design §7.1 counts


@pytest.mark.parametrize("n,G,acc", [(8, 2, 3), (12, 3, 2), (12, 4, 4)])
def test_per_group_counts_of_the_design_7_1_table(n, G, acc):
    s = n // G
    plan = build_plan(Topology(G, s), n, acc)
    topo = plan.topology
    for g in range(G):
        leader = topo.rank_of(g, 0)
        bcasts = [a for a in plan.actions[leader] if a.op is Op.BCAST_W]
        assert len(bcasts) == 1 + 2 * acc * (n - 1)
        mult = {k: sum(a.chunk == k for a in bcasts) for k in range(n)}
        assert mult[0] == 1 + acc and mult[n - 1] == acc
        assert all(mult[k] == 2 * acc for k in range(1, n - 1))
        assert sum(a.op is Op.REDUCE_G for a in plan.actions[leader]) == acc * n
        members = set(topo.group_ranks(g))
        grad_out = [a for r in members for a in plan.actions[r] if a.op is Op.SEND_G]
        assert len(grad_out) == acc * (n - s)
        weight_in = [a for r in members for a in plan.actions[r] if a.op is Op.RECV_W]
        assert len(weight_in) == sum(mult[k] for k in range(n) if k % G != g)
        assert len(weight_in) == pytest.approx(2 * acc * (n - 1) * (G - 1) / G, rel=0.15)
    for acts in plan.actions:  # a device receives at most one weight message per slot, and a
        for op in (Op.RECV_W, Op.BCAST_W, Op.REDUCE_G):  # group runs at most one bcast and reduce
            slots = [a.slot for a in acts if a.op is op]
            assert len(slots) == len(set(slots))


# ------------------------------------------------------------------------------ degenerate shapes


def test_one_device_per_group_is_pure_p2p_and_owner_may_send_three_times():
    plan = build_plan(Topology(6, 1), 6, 2)
    ops = {a.op for acts in plan.actions for a in acts}
    assert Op.BCAST_W not in ops and Op.REDUCE_G not in ops
    verify(plan)
    sends = {}
    for a in (a for acts in plan.actions for a in acts if a.op in (Op.SEND_W, Op.SEND_G)):
        sends[(a.slot, a.rank)] = sends.get((a.slot, a.rank), 0) + 1
    assert max(sends.values()) == 3  # with s = 1 an owner can have 3 sends in one slot


def test_single_group_uses_only_collectives():
    plan = build_plan(Topology(1, 4), 8, 2)
    ops = {a.op for acts in plan.actions for a in acts}
    assert not ops & {Op.SEND_W, Op.RECV_W, Op.SEND_G, Op.RECV_G}
    verify(plan)


def test_single_device():
    plan = build_plan(Topology(1, 1), 3, 2)
    assert [a.op for a in plan.actions[0] if a.op not in (Op.F, Op.B)] == [
        Op.LOAD_W, Op.ACC_G, Op.ALLREDUCE_REPLICATED, Op.ACC_G, Op.ALLREDUCE_STATS, Op.STEP]
    verify(plan)


def test_uneven_layers_size_every_message_to_its_chunk():
    plan = build_plan(Topology(2, 2), 7, 1, layer_numel=10, weight_bytes=2, grad_bytes=4,
                      replicated_numel=5)
    assert plan.chunk_layers == ((0, 2), (2, 4), (4, 6), (6, 7))
    for a in (a for acts in plan.actions for a in acts):
        layers = None if a.chunk is None else plan.chunk_layers[a.chunk][1] - plan.chunk_layers[a.chunk][0]
        if a.op in (Op.SEND_W, Op.RECV_W, Op.BCAST_W):
            assert a.bytes == layers * 10 * 2
        elif a.op in (Op.SEND_G, Op.RECV_G, Op.REDUCE_G):
            assert a.bytes == layers * 10 * 4
        elif a.op is Op.ALLREDUCE_REPLICATED:
            assert a.bytes == 5 * 4 and a.group == (0, 1, 2, 3)
    verify(plan)


def test_replicated_allreduce_follows_the_last_b_and_step_is_last():
    plan = build_plan(Topology(3, 2), 6, 2)
    for acts in plan.actions:
        i = next(i for i, a in enumerate(acts) if a.op is Op.ALLREDUCE_REPLICATED)
        last_b = max(i for i, a in enumerate(acts) if a.op is Op.B)
        assert acts[last_b].chunk == 0 and acts[i].slot == acts[last_b].slot + 1
        assert acts[i - 1].slot == acts[last_b].slot  # first thing of the slot after the last B
        assert acts[-1].op is Op.STEP and acts[-1].slot == plan.num_slots - 1
        assert acts[0] == Action(-1, acts[0].rank, Op.LOAD_W, chunk=plan.own_chunk(acts[0].rank), buf="w_own")


@pytest.mark.parametrize("kwargs,match", [
    (dict(topology=Topology(2, 2), num_layers=3, micro_batches=1), "num_layers=3 < world size 4"),
    (dict(topology=Topology(2, 2), num_layers=4, micro_batches=0), "micro_batches"),
    (dict(topology=Topology(2, 2), num_layers=4, micro_batches=1, algo="gpipe"), "algo"),
    (dict(topology=Topology(2, 2), num_layers=4, micro_batches=1, grad_route="ring"), "grad_route"),
    (dict(topology=Topology(1, 1), num_layers=4, micro_batches=1, algo="weipipe"), "weipipe needs at least 2 ranks"),
    (dict(topology=(2, 2), num_layers=4, micro_batches=1), "Topology"),
])
def test_invalid_arguments_are_rejected_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_plan(**kwargs)


# ---------------------------------------------------------- prefetch depth, reuse, resident depth


@pytest.mark.parametrize("nodes,per_node,depth,reuse", [(2, 2, 3, True), (3, 2, 3, False), (2, 3, 2, True)])
def test_fetches_before_slot_0_go_in_the_order_compute_needs_them(nodes, per_node, depth, reuse):
    """A remote fetch queued before a broadcast needed earlier would hold that broadcast back for a
    whole inter-node transfer (the weights channel runs in order)."""
    topo = Topology(nodes, per_node)
    plan = build_plan(topo, 2 * topo.world_size, 2, prefetch_depth=depth, mb_per_fetch=2, reuse_weights=reuse)
    verify(plan)
    longest = 0
    for acts in plan.actions:
        first_use: dict[int, int] = {}
        for a in acts:
            if a.op is Op.F:
                first_use.setdefault(a.chunk, a.slot)
        needs = [first_use[a.chunk] for a in acts if a.slot == -1 and a.op in (Op.RECV_W, Op.BCAST_W)]
        assert needs == sorted(needs), needs
        longest = max(longest, len(set(needs)))
    assert longest >= 2  # several chunks are staged before slot 0


@pytest.mark.parametrize("nodes,per_node,acc", [(2, 2, 2), (3, 2, 2), (2, 4, 4), (4, 1, 2), (1, 4, 2)])
def test_resident_depth_fetches_each_chunk_once_per_iteration(nodes, per_node, acc):
    """With prefetch_depth='resident' every rank receives each chunk once per iteration, for every
    k; one slot less, and some chunk must be fetched again for its backward."""
    topo = Topology(nodes, per_node)

    def fetches(depth, k):
        plan = build_plan(topo, 2 * topo.world_size, acc, prefetch_depth=depth, mb_per_fetch=k, reuse_weights=True)
        verify(plan)
        if per_node > 1:  # every member of the group joins one broadcast per fetch
            return plan, [Counter(a.chunk for a in acts if a.op is Op.BCAST_W) for acts in plan.actions]
        return plan, [Counter(a.chunk for a in acts if a.op is Op.RECV_W or (a.op is Op.LOAD_W and a.buf != "w_own"))
                      for acts in plan.actions]

    for k in (1, acc):
        plan, counts = fetches("resident", k)
        assert plan.options["prefetch_depth"] == resident_depth(topo) == topo.world_size - 1
        assert all(c == Counter(range(topo.world_size)) for c in counts)
        _, shallower = fetches(resident_depth(topo) - 1, k)
        assert any(max(c.values()) > 1 for c in shallower)
    with pytest.raises(ValueError, match="reuse_weights=True"):
        build_plan(topo, 2 * topo.world_size, acc, prefetch_depth="resident")
    with pytest.raises(ValueError, match="integer >= 1 or 'resident', got 'deep'"):
        build_plan(topo, 2 * topo.world_size, acc, prefetch_depth="deep", reuse_weights=True)


@pytest.mark.parametrize("nodes,per_node,acc", [(2, 2, 2), (3, 2, 4), (2, 4, 4), (4, 1, 2), (1, 4, 2)])
def test_host_reuse_crosses_the_network_as_the_resident_depth_does_through_fewer_buffers(nodes, per_node, acc):
    """reuse_weights="host": whatever the depth and k, every rank receives each chunk once per
    iteration (the resident depth's bytes on every link), through depth + 1 weight buffers; what
    comes back for a later use comes from the rank's host memory, stashed by the fetch that brought it."""
    topo = Topology(nodes, per_node)
    for k in (1, acc):
        resident = build_plan(topo, 2 * topo.world_size + 1, acc, prefetch_depth="resident", mb_per_fetch=k,
                              reuse_weights=True, layer_numel=7)
        for depth in (1, 2):
            plan = build_plan(topo, 2 * topo.world_size + 1, acc, prefetch_depth=depth, mb_per_fetch=k,
                              reuse_weights="host", layer_numel=7)
            report = verify(plan)
            assert report.weight_buffers == verify(build_plan(
                topo, 2 * topo.world_size + 1, acc, prefetch_depth=depth, mb_per_fetch=k, reuse_weights=True)
            ).weight_buffers < verify(resident).weight_buffers
            assert plan_traffic(plan).flows == plan_traffic(resident).flows
            for acts in plan.actions:
                stashed = [a.chunk for a in acts if a.op is Op.STASH_W]
                restored = {a.chunk for a in acts if a.op is Op.RESTORE_W}
                assert len(stashed) == len(set(stashed)) and restored <= set(stashed)
                assert restored, "at depth <= 2 some chunk is needed again after its buffer is refilled"
    with pytest.raises(ValueError, match="True, False or 'host'"):
        build_plan(topo, 2 * topo.world_size, acc, reuse_weights="disk")


def test_verify_catches_a_restore_of_what_was_not_stashed():
    plan = build_plan(Topology(2, 2), 4, 2, mb_per_fetch=2, reuse_weights="host")
    first = next(a for a in plan.actions[0] if a.op is Op.STASH_W)
    actions = list(plan.actions)
    actions[0] = tuple(a for a in plan.actions[0] if a is not first)
    with pytest.raises(PlanError, match=f"RESTORE_W W{first.chunk}.*reads \\[host{first.chunk}\\], which was never written"):
        verify(dataclasses.replace(plan, actions=tuple(actions)))
    # a stash of the wrong chunk: the restore reads another chunk's weights
    swapped = tuple(dataclasses.replace(a, buf="w2") if a is first else a for a in plan.actions[0])
    actions[0] = swapped
    with pytest.raises(PlanError, match="STASH_W"):
        verify(dataclasses.replace(plan, actions=tuple(actions)))


@pytest.mark.parametrize("nodes,per_node", [(2, 1), (1, 2), (1, 3), (3, 1), (2, 2), (3, 2)])
def test_every_prefetch_depth_verifies_without_reuse(nodes, per_node):
    """Deep prefetch without reuse: a turnaround holds its buffer a slot longer than the paper's
    turn-by-turn filling assumes, so at depth >= 2 the turn's buffer may still be in use; the
    fetch must then go to a free one (this used to hand slot 4 of a two-rank plan the wrong chunk)."""
    n = nodes * per_node
    for depth in range(1, 2 * n + 2):
        for acc, k in ((2, 1), (3, 1), (4, 2)):
            plan = build_plan(Topology(nodes, per_node), n + 1, acc, prefetch_depth=depth, mb_per_fetch=k)
            assert verify(plan).contributions == n * n * acc, (depth, acc, k)
