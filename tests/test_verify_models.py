"""The two execution models of verify (design §5.3): a plan that finishes in the serial model
finishes in the channel model the engine runs, on valid plans and on randomly reordered ones; the
simulation finishes exactly where both models, written plainly, do; and deriving the channel model
from the serial run, as verify does for large plans, agrees with simulating it."""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tawpipe.plan.actions import OPS, REP, Channel, Hazards, Op, PlanError, batches
from tawpipe.plan.plan import Plan
from tawpipe.plan.schedule import build_plan
from tawpipe.plan.topology import Topology
from tawpipe.plan.screen import _check_static
from tawpipe.plan.verify import Verifier, verify

verify_module = importlib.import_module("tawpipe.plan.verify")  # the module: ``tawpipe.plan.verify`` names the function


def _live(plan: Plan, model: str) -> bool:
    """Whether ``model`` runs the plan to the end with every transfer matched."""
    try:
        getattr(Verifier(plan), f"run_{model}")()
    except PlanError:
        return False
    return True


@st.composite
def reordered_plans(draw):
    n = draw(st.sampled_from([2, 3, 4, 6]))
    G = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    acc = draw(st.integers(1, 3))
    algo = draw(st.sampled_from(["tawpipe", "weipipe"] if n > 1 else ["tawpipe"]))
    kw = {}
    if algo == "tawpipe":
        kw = dict(prefetch_depth=draw(st.integers(1, 3)), mb_per_fetch=draw(st.sampled_from(
            [k for k in range(1, acc + 1) if acc % k == 0])), reuse_weights=draw(st.booleans()))
    plan = build_plan(Topology(G, n // G), n + draw(st.integers(0, 2)), acc, algo=algo, **kw)
    actions = [list(a) for a in plan.actions]
    for _ in range(draw(st.integers(1, 4))):  # move one action of one rank elsewhere in its list
        r = draw(st.integers(0, n - 1))
        i = draw(st.integers(0, len(actions[r]) - 2))
        j = draw(st.integers(0, len(actions[r]) - 2))
        actions[r].insert(j, actions[r].pop(i))
    return dataclasses.replace(plan, actions=tuple(tuple(a) for a in actions))


@settings(max_examples=150, deadline=None)
@given(reordered_plans())
def test_serial_liveness_implies_channel_liveness(plan):
    if _live(plan, "serial"):
        assert _live(plan, "channels")


@pytest.mark.parametrize("algo,shape", [("tawpipe", (2, 2)), ("tawpipe", (3, 2)), ("tawpipe", (4, 1)),
                                        ("weipipe", (1, 4))])
def test_both_models_finish_valid_plans(algo, shape):
    plan = build_plan(Topology(*shape), 6, 2, algo=algo)
    assert _live(plan, "serial") and _live(plan, "channels")


def test_the_channel_model_sees_a_lost_message():
    # drop one gradient receive: the sender's channel waits forever in both models
    plan = build_plan(Topology(2, 2), 4, 2)
    acts = list(plan.actions[3])
    acts.pop(next(i for i, a in enumerate(acts) if a.op is Op.RECV_G))
    bad = dataclasses.replace(plan, actions=plan.actions[:3] + (tuple(acts),))
    with pytest.raises(PlanError, match="deadlock in the channels model"):
        Verifier(bad).run_channels()


# ------------------------------------------------------------------- a plain reference of both models


def _plainly_live(plan: Plan, model: str) -> bool:
    """Both execution models written plainly and slowly, as design §5.3 states them: units by
    ``batches`` (channels) or one action each (serial), each waiting for its ``Hazards``
    dependencies; the driver runs its units in order and queues the others; any transfer whose
    sides are at the heads of their lanes runs, until nothing can. No buffer contents."""
    serial = model == "serial"
    inline = {s.channel for s in OPS.values() if not s.always_overlaps} if serial else {Channel.COMPUTE}

    def lane(a):
        return None if OPS[a.op].channel in inline else OPS[a.op].channel

    ranks = []
    for acts in plan.actions:
        units = [[a] for a in acts] if serial else list(batches(acts))
        hazards, deps = Hazards(), []
        for u, unit in enumerate(units):
            deps.append({d for a in unit for d in hazards.deps(plan.reads(a), plan.writes(a))})
            for a in unit:
                hazards.record(u, plan.reads(a), plan.writes(a))
        ranks.append({"units": units, "deps": deps, "pos": [0] * len(units), "driver": 0, "queues": {}})
    colls: Counter = Counter()  # collectives done per (rank, channel, group)

    def done(rk, u):
        return rk["pos"][u] == len(rk["units"][u])

    def head(r, ln):
        """The unit rank r may run on lane ln now, or None."""
        rk = ranks[r]
        if ln is None:
            u = rk["driver"]
            if u >= len(rk["units"]) or lane(rk["units"][u][0]) is not None:
                return None
        else:
            q = rk["queues"].get(ln, [])
            if not q:
                return None
            u = q[0]
        return u if not done(rk, u) and all(done(rk, d) for d in rk["deps"][u]) else None

    def at(r, u):
        rk = ranks[r]
        return rk["units"][u][rk["pos"][u]]

    moved = True
    while moved:
        moved = False
        for rk in ranks:  # drivers pass queued units, and finished ones; queues drop finished heads
            while rk["driver"] < len(rk["units"]):
                u = rk["driver"]
                if lane(rk["units"][u][0]) is None and not done(rk, u):
                    break
                if lane(rk["units"][u][0]) is not None:
                    rk["queues"].setdefault(lane(rk["units"][u][0]), []).append(u)
                rk["driver"] += 1
            for q in rk["queues"].values():
                while q and done(rk, q[0]):
                    q.pop(0)
        for r, rk in enumerate(ranks):
            for ln in [None, *rk["queues"]]:
                u = head(r, ln)
                if u is None:
                    continue
                a = at(r, u)
                how = OPS[a.op].transfer
                if how is None:
                    rk["pos"][u] += 1
                    moved = True
                elif how in ("send", "recv"):
                    pu = head(a.peer, ln)
                    b = None if pu is None else at(a.peer, pu)
                    if b is None or b.peer != r or OPS[b.op].transfer not in ("send", "recv") or \
                            OPS[b.op].transfer == how:
                        continue
                    s, d = (a, b) if how == "send" else (b, a)
                    if OPS[s.op].channel is not OPS[d.op].channel or (s.slot, s.chunk, s.bytes, s.tag) != \
                            (d.slot, d.chunk, d.bytes, d.tag) or OPS[s.op].kind != OPS[d.op].kind:
                        return False  # a mismatched pair: refused
                    rk["pos"][u] += 1
                    ranks[a.peer]["pos"][pu] += 1
                    moved = True
                else:
                    key = (OPS[a.op].channel, a.group)
                    heads = [(m, head(m, ln)) for m in a.group]
                    if any(h is None for _, h in heads):
                        continue
                    acts = [at(m, h) for m, h in heads]
                    if any(OPS[b.op].transfer != "collective" or (OPS[b.op].channel, b.group) != key
                           or colls[(m, *key)] != colls[(r, *key)] for (m, _), b in zip(heads, acts)):
                        continue
                    if len({(b.op, b.chunk, b.root, b.bytes, b.buf) for b in acts}) > 1:
                        return False  # members that differ: refused
                    for m, h in heads:
                        ranks[m]["pos"][h] += 1
                        colls[(m, *key)] += 1
                    moved = True
    return all(done(rk, u) for rk in ranks for u in range(len(rk["units"])))


def _simulated_live(plan: Plan, model: str) -> bool:
    try:
        if model == "serial":
            Verifier(plan).run_serial(contents=False)
        else:
            Verifier(plan).run_channels()
    except PlanError:
        return False
    return True


@settings(max_examples=120, deadline=None)
@given(reordered_plans())
def test_the_simulation_agrees_with_the_plain_models(plan):
    """The simulation waits for the queued units that conflict with a unit instead of keeping
    ``Hazards`` (design §5.3): on plans reordered at random, it finishes exactly where the plain
    models do."""
    for model in ("serial", "channels"):
        assert _simulated_live(plan, model) == _plainly_live(plan, model), model


def _outcome(plan: Plan, simulate_channels: bool) -> str:
    try:
        report = verify(plan, simulate_channels=simulate_channels)
    except PlanError as e:
        return f"refused: {e}"
    assert report.channels_simulated == simulate_channels
    return f"passed: {dataclasses.replace(report, channels_simulated=True)}"


@settings(max_examples=150, deadline=None)
@given(reordered_plans())
def test_the_derived_proof_agrees_with_the_simulated_one(plan):
    """Deriving the channel model from the serial run (design §5.3, as verify does above
    CHANNEL_ACTIONS) passes and refuses exactly what simulating it does, with the same report or
    the same message."""
    assert _outcome(plan, simulate_channels=False) == _outcome(plan, simulate_channels=True)


def test_a_message_on_a_name_the_serial_model_queues_is_simulated():
    """Condition (★) of design §5.3: where a message touches what the replicated all-reduce
    touches, the channel model does not follow from the serial one, and verify simulates it."""
    plan = build_plan(Topology(2, 2), 4, 2)
    v = Verifier(plan, simulate_channels=False)
    assert v._channels_follow(_check_static(plan, v.n))
    acts = list(plan.actions[0])
    i = next(i for i, a in enumerate(acts) if a.op is Op.RECV_W)
    acts[i] = dataclasses.replace(acts[i], buf=REP)
    bad = dataclasses.replace(plan, actions=(tuple(acts), *plan.actions[1:]))
    v = Verifier(bad, simulate_channels=False)
    assert not v._channels_follow(_check_static(bad, v.n))


def test_large_plans_derive_the_channel_model(monkeypatch):
    plan = build_plan(Topology(2, 2), 4, 2)
    assert verify(plan).channels_simulated
    monkeypatch.setattr(verify_module, "CHANNEL_ACTIONS", 10)
    report = verify(plan)
    assert not report.channels_simulated
    assert dataclasses.replace(report, channels_simulated=True) == verify(plan, simulate_channels=True)
