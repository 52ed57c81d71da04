"""verify: it passes every plan the schedules build, fast, and catches every kind of broken plan."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tawpipe.plan.actions import OPS, Op, PlanError
from tawpipe.plan.plan import Plan
from tawpipe.plan.schedule import build_plan
from tawpipe.plan.topology import Topology
from tawpipe.plan.screen import _check_rank, _Screen
from tawpipe.plan.verify import verify


# -------------------------------------------------------------------------------- property matrix


@st.composite
def shapes(draw):
    n = draw(st.integers(1, 32))
    G = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    algo = draw(st.sampled_from(["tawpipe", "weipipe"] if n >= 2 else ["tawpipe"]))
    return (G, n // G, draw(st.integers(n, 3 * n)), draw(st.integers(1, 4)),
            draw(st.sampled_from(["rail", "leader"])), algo)


@settings(max_examples=60, deadline=None)
@given(shapes())
def test_verify_passes_on_the_property_matrix(shape):
    G, s, L, acc, route, algo = shape
    plan = build_plan(Topology(G, s), L, acc, algo=algo, grad_route=route, layer_numel=3)
    report = verify(plan)
    n = G * s
    assert report.contributions == n * n * acc
    sizes = sorted({e - b for b, e in plan.chunk_layers})
    assert sizes == ([L // n] if L % n == 0 else [L // n, L // n + 1])
    if algo == "tawpipe":
        assert report.weight_buffers <= 3


@pytest.mark.parametrize("G", [2, 4, 8])
def test_verify_n64_in_a_few_seconds(G):
    t0 = time.process_time()  # CPU time: robust to other jobs sharing the machine
    plan = build_plan(Topology(G, 64 // G), 128, 4)
    report = verify(plan)
    elapsed = time.process_time() - t0
    assert report.contributions == 64 * 64 * 4
    assert elapsed < 10, f"build + verify took {elapsed:.1f}s of CPU"


# --------------------------------------------------------------------------------- verify catches


def _edit(plan: Plan, rank: int, edit) -> Plan:
    acts = list(plan.actions[rank])
    edit(acts)
    actions = list(plan.actions)
    actions[rank] = tuple(acts)
    return dataclasses.replace(plan, actions=tuple(actions))


def _index(acts, pred) -> int:
    return next(i for i, a in enumerate(acts) if pred(a))


@pytest.fixture
def n4():
    return build_plan(Topology(2, 2), 4, 2, grad_route="leader")


def test_verify_catches_a_dropped_recv(n4):
    bad = _edit(n4, 0, lambda acts: acts.pop(_index(acts, lambda a: a.op is Op.RECV_W)))
    with pytest.raises(PlanError, match="deadlock|matched by|needs tag"):
        verify(bad)


def test_verify_catches_swapped_buffers(n4):
    def swap(acts):
        i = _index(acts, lambda a: a.op is Op.F and a.chunk == 1)
        acts[i] = dataclasses.replace(acts[i], buf="w0" if acts[i].buf == "w1" else "w1")
    with pytest.raises(PlanError, match=r"slot 1 rank 0 F W1 .* holding W2"):
        verify(_edit(n4, 0, swap))


def test_verify_catches_a_wrong_chunk(n4):
    def wrong(acts):
        i = _index(acts, lambda a: a.op is Op.BCAST_W and a.chunk == 2)
        acts[i] = dataclasses.replace(acts[i], chunk=3)
    with pytest.raises(PlanError, match="differ|holding|needs"):
        verify(_edit(n4, 0, wrong))


def test_verify_catches_a_wrong_compute_order(n4):
    # relabel the model so that chunk 2 comes before chunk 1: every buffer is still consistent,
    # but the forward now visits the layers out of order
    layers = list(n4.chunk_layers)
    layers[1], layers[2] = layers[2], layers[1]
    with pytest.raises(PlanError, match=r"forward visits chunks \[0, 1, 2, 3\], expected \[0, 2, 1, 3\]"):
        verify(dataclasses.replace(n4, chunk_layers=tuple(layers)))


def test_verify_catches_a_duplicated_contribution(n4):
    def dup(acts):
        i = _index(acts, lambda a: a.op is Op.ACC_G)
        acts.insert(i + 1, acts[i])
    with pytest.raises(PlanError, match="count twice"):
        verify(_edit(n4, 0, dup))


def test_verify_catches_a_missing_contribution(n4):
    last_acc = lambda acts: max(i for i, a in enumerate(acts) if a.op is Op.ACC_G)  # noqa: E731
    bad = _edit(n4, 0, lambda acts: acts.pop(last_acc(acts)))
    with pytest.raises(PlanError, match=r"rank 0 .* accumulated 6 .* instead of 8; missing .*\[\(0, 2, 1\), \(0, 3, 1\)\]"):
        verify(bad)


def test_verify_catches_a_reorder_that_deadlocks(n4):
    def reorder(acts):  # slot 0: r0 receives W1 from r2, then sends W0 to r2; make it send first
        i = _index(acts, lambda a: a.op is Op.RECV_W and a.slot == 0)
        j = _index(acts, lambda a: a.op is Op.SEND_W and a.slot == 0)
        acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(PlanError, match="deadlock"):
        verify(_edit(n4, 0, reorder))


def test_verify_catches_an_overwritten_pending_gradient(n4):
    # without its ACC_G, the reduced gradient stays pending in g* until a later B overwrites it
    bad = _edit(n4, 0, lambda acts: acts.pop(_index(acts, lambda a: a.op is Op.ACC_G)))
    with pytest.raises(PlanError, match=r"B chunk .* overwrites \[g\d\] while it still holds the pending"):
        verify(bad)


def test_verify_catches_a_gradient_in_the_wrong_buffer(n4):
    def other_buf(acts):
        i = _index(acts, lambda a: a.op is Op.B and a.chunk == 2)
        acts[i] = dataclasses.replace(acts[i], grad_buf="g0" if acts[i].grad_buf == "g1" else "g1")
    with pytest.raises(PlanError, match=r"REDUCE_G chunk 2 .* reads \[g1\], which was never written"):
        verify(_edit(n4, 1, other_buf))


def test_verify_catches_mismatched_bytes_and_missing_allreduce(n4):
    def fat(acts):
        i = _index(acts, lambda a: a.op is Op.SEND_G)
        acts[i] = dataclasses.replace(acts[i], bytes=acts[i].bytes + 1)
    with pytest.raises(PlanError, match="bytes"):
        verify(_edit(n4, 0, fat))
    bad = _edit(n4, 3, lambda acts: acts.pop(_index(acts, lambda a: a.op is Op.ALLREDUCE_REPLICATED)))
    with pytest.raises(PlanError, match="ALLREDUCE_REPLICATED"):
        verify(bad)


def test_verify_catches_a_fourth_weight_buffer(n4):
    def extra(acts):  # from slot 8 on, stage into a fresh buffer instead of w1
        for i, a in enumerate(acts):
            if a.buf == "w1" and a.slot >= 8:
                acts[i] = dataclasses.replace(a, buf="w2")
    plan = n4
    for r in range(4):
        plan = _edit(plan, r, extra)
    with pytest.raises(PlanError, match="at most 3"):
        verify(plan)


def test_verify_catches_swapped_message_tags(n4):
    """Floating messages are matched by tag: two sends to one peer with their tags swapped would
    deliver each payload into the other's buffer."""
    def swap(acts):
        i = _index(acts, lambda a: a.op is Op.SEND_G)
        j = _index(acts[i + 1:], lambda a: a.op is Op.SEND_G and a.peer == acts[i].peer) + i + 1
        acts[i], acts[j] = dataclasses.replace(acts[i], tag=acts[j].tag), dataclasses.replace(acts[j], tag=acts[i].tag)
    bad = _edit(n4, 2, swap)
    with pytest.raises(PlanError, match="needs tag"):
        verify(bad)


@pytest.mark.parametrize("op, chunk, buf", [(Op.SEND_W, 1, "w2"), (Op.RECV_W, 2, "w3")],
                         ids=["a send reading what a receive overwrites", "two receives into one buffer"])
def test_verify_catches_a_batch_whose_messages_touch_a_buffer_one_of_them_writes(op, chunk, buf):
    """WeiPipe on 2 x 2, rank 0, slot 4 receives W3 into w1 in the batch that sends W1 from w2 and
    receives W2 into w3. A batch's messages are posted together, so moved to w1 the send reads what
    the receive overwrites (verify's bookkeeping passed it: w1 holds W1 too, and the engine trained
    1% off), or the two receives race (the contents check caught it only at the next slot's send,
    as if W2 had been written last)."""
    plan = build_plan(Topology(2, 2), 4, 2, algo="weipipe")

    def into_w1(acts):
        i = _index(acts, lambda a: a.op is op and a.slot == 4 and a.chunk == chunk and a.buf == buf)
        assert any(a.op is Op.RECV_W and a.slot == 4 and a.buf == "w1" for a in acts)
        acts[i] = dataclasses.replace(acts[i], buf="w1")

    with pytest.raises(PlanError, match="touches w1, which .* of the same batch"):
        verify(_edit(plan, 0, into_w1))


# ------------------------------------------------------------------------- the one-pass static checks


def _edits(plan: Plan, rng: random.Random, count: int):
    """Random single edits of one rank's list: every field an action has, and its place."""
    n = plan.topology.world_size
    for _ in range(count):
        r = rng.randrange(n)
        acts = list(plan.actions[r])
        i = rng.randrange(len(acts))
        a = acts[i]
        kind = rng.choice(["drop", "swap", "move", "slot", "rank", "chunk", "mb", "peer", "root", "group", "buf",
                           "grad_buf", "bytes", "tag", "none"])
        if kind == "drop":
            acts.pop(i)
        elif kind == "swap" and i + 1 < len(acts):
            acts[i], acts[i + 1] = acts[i + 1], acts[i]
        elif kind == "move":
            acts.insert(rng.randrange(len(acts)), acts.pop(i))
        elif kind == "slot":
            acts[i] = dataclasses.replace(a, slot=a.slot + rng.choice([-2, -1, 1, plan.num_slots]))
        elif kind == "rank":
            acts[i] = dataclasses.replace(a, rank=(a.rank + 1) % n)
        elif kind == "chunk":
            acts[i] = dataclasses.replace(a, chunk=rng.choice([None, -1, 0, 1, plan.replica_size]))
        elif kind == "mb":
            acts[i] = dataclasses.replace(a, mb=rng.choice([None, -1, 0, plan.micro_batches]))
        elif kind == "peer":
            acts[i] = dataclasses.replace(a, peer=rng.choice([None, r, rng.randrange(n), n]))
        elif kind == "root":
            acts[i] = dataclasses.replace(a, root=rng.choice([None, rng.randrange(n)]))
        elif kind == "group":
            acts[i] = dataclasses.replace(a, group=rng.choice([None, (r,), tuple(range(n))]))
        elif kind in ("buf", "grad_buf"):
            acts[i] = dataclasses.replace(a, **{kind: rng.choice([None, "w0", "g1"])})
        elif kind == "bytes":
            acts[i] = dataclasses.replace(a, bytes=a.bytes + 1)
        elif kind == "tag":
            acts[i] = dataclasses.replace(a, tag=rng.choice([None, 0, 1, 5]))
        yield r, tuple(acts)


@pytest.mark.parametrize("shape", [((2, 2), {}), ((3, 2), {"grad_route": "leader", "prefetch_depth": 2}),
                                   ((1, 4), {"algo": "weipipe"}), ((4, 1), {"mb_per_fetch": 2}),
                                   ((2, 2), {"replicas": 2})])
def test_the_one_pass_screen_passes_exactly_what_the_checks_pass(shape):
    """``_check_static`` reads each list once (``_Screen``) and goes back to ``_check_rank`` only to
    name a fault: the screen must pass exactly the lists that ``_check_rank`` passes."""
    topo, options = shape
    plan = build_plan(Topology(*topo), 6, 2, layer_numel=3, **options)
    screen, rng, refused = _Screen(plan), random.Random(repr(shape)), 0
    for r, acts in _edits(plan, rng, 300):
        try:
            _check_rank(plan, r, acts)
            passed = True
        except PlanError:
            passed = False
        except (TypeError, IndexError):  # a field of the wrong type: both trip over it
            continue
        try:
            screened = screen(r, acts) is not None
        except (TypeError, IndexError):
            screened = False
        assert screened == passed, (r, acts)
        refused += not passed
    assert refused >= 100  # the edits find faults: the comparison is not vacuous


def test_names_asked_once_per_key_are_the_names_of_every_action():
    """verify asks ``plan.reads``/``plan.writes`` once per ``_names_key`` (``OpSpec``): on every op
    of the table, in iterations, replicas and the small programs, the key decides the names."""
    from tawpipe.plan.programs import eval_program, gather_program, setup_program
    from tawpipe.plan.screen import _names_key
    from tawpipe.plan.verify import Verifier

    asked = set()
    for plan in (build_plan(Topology(2, 2), 5, 2, layer_numel=3, replicated_numel=2),
                 build_plan(Topology(1, 3), 3, 2, algo="weipipe"),
                 build_plan(Topology(2, 2), 4, 4, replicas=2, mb_per_fetch=2, prefetch_depth=2),
                 build_plan(Topology(2, 2), 4, 2, reuse_weights="host")):
        programs = [plan.actions, setup_program(plan, 8), gather_program(plan), eval_program(plan, "w0")]
        names: dict = {}
        for acts in (a for program in programs for rank in program for a in rank):
            got = names.setdefault(_names_key(acts), (plan.reads(acts), plan.writes(acts)))
            assert got == (plan.reads(acts), plan.writes(acts)), acts
        asked |= {op for op, *_ in names}
        v = Verifier(plan)
        for acts in (a for program in programs for rank in program for a in rank):
            reads, writes = v.masks(acts)
            assert {b for b, bit in v._bits.items() if bit & reads} == set(plan.reads(acts))
            assert {b for b, bit in v._bits.items() if bit & writes} == set(plan.writes(acts))
    assert asked == set(OPS)  # every op of the table was asked
