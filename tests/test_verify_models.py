"""The two execution models of verify (design §5.3): a plan that finishes in the serial model
finishes in the channel model the engine runs, on valid plans and on randomly reordered ones."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tawpipe.plan.actions import Op, PlanError
from tawpipe.plan.plan import Plan
from tawpipe.plan.schedule import build_plan
from tawpipe.plan.topology import Topology
from tawpipe.plan.verify import Verifier


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
