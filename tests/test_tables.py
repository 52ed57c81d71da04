"""Printed plans: TawPipe's tables reproduce the paper's worked examples cell by cell (design §3.3).

The WeiPipe worked schedule is checked action by action in test_schedule.py; design §3.3's and
§3.4's printed tables are checked against the code in test_docs.py.
"""

from __future__ import annotations

import pytest
from plan_cases import parse_table
from tawpipe.plan import registry
from tawpipe.plan.schedule import build_plan
from tawpipe.plan.topology import Topology
from tawpipe.plan.verify import verify

# The paper's worked schedules N=4/G=2 and N=6/G=3 with the paper's leader route, verbatim (the
# first is design §3.3's table but for the router of remote gradients).
PAPER_N4_G2_ACC2 = """
| slot | group 0 (ranks 0, 1) | group 1 (ranks 2, 3) |
|---|---|---|
| −1 | bcast W0 from r0 | |
| 0 | **F0**(m0); P2P W1 r2→r0; bcast from r0 | idle; P2P W0 r0→r2; bcast from r2 |
| 1 | **F1**(m0); bcast W2 from r1 | **F0**(m0); bcast W1 from r2 |
| 2 | **F2**(m0); P2P W3 r3→r1; bcast from r1 | **F1**(m0); P2P W2 r1→r3; bcast from r3 |
| 3 | **F3**(m0) | **F2**(m0); bcast W3 from r3 |
| 4 | **B3**(m0); bcast W2 from r1 | **F3**(m0) |
| 5 | **B2**(m0); P2P W1 r2→r0; bcast from r0; reduce G3→r0; P2P G3 r0→r3 | **B3**(m0); P2P W2 r1→r3; bcast from r3 |
| 6 | **B1**(m0); bcast W0 from r0; reduce G2→r1 | **B2**(m0); bcast W1 from r2; reduce G3→r3 |
| 7 | **B0**(m0); reduce G1→r0; P2P G1 r0→r2 | **B1**(m0); P2P W0 r0→r2; bcast from r2; reduce G2→r2; P2P G2 r2→r1 |
| 8 | **F0**(m1); P2P W1 r2→r0; bcast from r0; reduce G0→r0 | **B0**(m0); reduce G1→r2 |
| 9 | **F1**(m1); bcast W2 from r1 | **F0**(m1); bcast W1 from r2; reduce G0→r2; P2P G0 r2→r0 |
| 10 | **F2**(m1); P2P W3 r3→r1; bcast from r1 | **F1**(m1); P2P W2 r1→r3; bcast from r3 |
| 11 | **F3**(m1) | **F2**(m1); bcast W3 from r3 |
| 12 | **B3**(m1); bcast W2 from r1 | **F3**(m1) |
| 13 | **B2**(m1); P2P W1 r2→r0; bcast from r0; reduce G3→r0; P2P G3 r0→r3 | **B3**(m1); P2P W2 r1→r3; bcast from r3 |
| 14 | **B1**(m1); bcast W0 from r0; reduce G2→r1 | **B2**(m1); bcast W1 from r2; reduce G3→r3 |
| 15 | **B0**(m1); reduce G1→r0; P2P G1 r0→r2 | **B1**(m1); P2P W0 r0→r2; bcast from r2; reduce G2→r2; P2P G2 r2→r1 |
| 16 | idle; reduce G0→r0 | **B0**(m1); reduce G1→r2 |
| 17 | idle | idle; reduce G0→r2; P2P G0 r2→r0 |
"""

PAPER_N6_G3_ACC1 = """
| slot | group 0 (ranks 0, 1) | group 1 (ranks 2, 3) | group 2 (ranks 4, 5) |
|---|---|---|---|
| −1 | bcast W0 from r0 | | |
| 0 | **F0**; P2P W1 r2→r0; bcast from r0 | idle; P2P W0 r0→r2; bcast from r2 | idle |
| 1 | **F1**; P2P W2 r4→r0; bcast from r0 | **F0**; bcast W1 from r2 | idle; P2P W0 r0→r4; bcast from r4 |
| 2 | **F2**; bcast W3 from r1 | **F1**; P2P W2 r4→r2; bcast from r2 | **F0**; P2P W1 r2→r4; bcast from r4 |
| 3 | **F3**; P2P W4 r3→r1; bcast from r1 | **F2**; P2P W3 r1→r3; bcast from r3 | **F1**; bcast W2 from r4 |
| 4 | **F4**; P2P W5 r5→r1; bcast from r1 | **F3**; bcast W4 from r3 | **F2**; P2P W3 r1→r5; bcast from r5 |
| 5 | **F5** | **F4**; P2P W5 r5→r3; bcast from r3 | **F3**; P2P W4 r3→r5; bcast from r5 |
| 6 | **B5**; P2P W4 r3→r1; bcast from r1 | **F5** | **F4**; bcast W5 from r5 |
| 7 | **B4**; bcast W3 from r1; reduce G5→r0; P2P G5 r0→r5 | **B5**; bcast W4 from r3 | **F5** |
| 8 | **B3**; P2P W2 r4→r0; bcast from r0; reduce G4→r0; P2P G4 r0→r3 | **B4**; P2P W3 r1→r3; bcast from r3; reduce G5→r2; P2P G5 r2→r5 | **B5**; P2P W4 r3→r5; bcast from r5 |
| 9 | **B2**; P2P W1 r2→r0; bcast from r0; reduce G3→r1 | **B3**; P2P W2 r4→r2; bcast from r2; reduce G4→r3 | **B4**; P2P W3 r1→r5; bcast from r5; reduce G5→r5 |
| 10 | **B1**; bcast W0 from r0; reduce G2→r0; P2P G2 r0→r4 | **B2**; bcast W1 from r2; reduce G3→r2; P2P G3 r2→r1 | **B3**; bcast W2 from r4; reduce G4→r4; P2P G4 r4→r3 |
| 11 | **B0**; reduce G1→r0; P2P G1 r0→r2 | **B1**; P2P W0 r0→r2; bcast from r2; reduce G2→r2; P2P G2 r2→r4 | **B2**; P2P W1 r2→r4; bcast from r4; reduce G3→r4; P2P G3 r4→r1 |
| 12 | idle; reduce G0→r0 | **B0**; reduce G1→r2 | **B1**; P2P W0 r0→r4; bcast from r4; reduce G2→r4 |
| 13 | idle | idle; reduce G0→r2; P2P G0 r2→r0 | **B0**; reduce G1→r4; P2P G1 r4→r2 |
| 14 | idle | idle | idle; reduce G0→r4; P2P G0 r4→r0 |
"""


def assert_tables_equal(got: str, want: str) -> None:
    got_head, got_rows = parse_table(got)
    want_head, want_rows = parse_table(want)
    assert got_head == want_head
    assert list(got_rows) == list(want_rows)
    for slot, cells in want_rows.items():
        for g, (a, b) in enumerate(zip(got_rows[slot], cells, strict=True)):
            assert a.split("; ") == b.split("; "), f"slot {slot} group {g}: {a!r} != {b!r}"


def test_tawpipe_n4_g2_acc2_matches_the_papers_worked_example_cell_by_cell():
    plan = build_plan(Topology(2, 2), 4, 2, grad_route="leader")
    assert plan.owner == (0, 2, 1, 3)
    assert_tables_equal(plan.table(), PAPER_N4_G2_ACC2)
    assert plan.table().strip() == PAPER_N4_G2_ACC2.strip()  # the rendering itself, too
    verify(plan)


def test_tawpipe_n6_g3_acc1_matches_the_papers_worked_example_cell_by_cell():
    plan = build_plan(Topology(3, 2), 6, 1, grad_route="leader")
    assert plan.owner == (0, 2, 4, 1, 3, 5)
    assert_tables_equal(plan.table(), PAPER_N6_G3_ACC1)
    verify(plan)


@pytest.mark.parametrize("algo", registry.names())
def test_a_plan_of_replicas_prints_replica_0s_table(algo):
    """Each replica runs the one-replica plan on its own nodes (design §3.5), so the table of a plan
    of two replicas is the one-replica plan's, plus the all-reduces across the replicas."""
    one = build_plan(Topology(2, 2), 8, 2, algo=algo).table()
    two = build_plan(Topology(4, 2), 8, 2, algo=algo, replicas=2).table()
    one_head, one_rows = parse_table(one)
    two_head, two_rows = parse_table(two)
    assert two_head == one_head and list(two_rows) == list(one_rows)
    for slot, cells in two_rows.items():
        kept = ["; ".join(p for p in c.split("; ") if not p.endswith("across replicas")) for c in cells]
        assert kept == one_rows[slot], f"slot {slot}"
