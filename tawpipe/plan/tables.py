"""Plans printed as markdown tables, slot by slot, in the notation of design §3.3 and §3.4: each
schedule prints its own (``Schedule.table``) with the helpers here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import registry
from .actions import Action, Op

if TYPE_CHECKING:
    from .plan import Plan


def plan_table(plan: Plan) -> str:
    """``plan`` as its schedule prints it."""
    return registry.get(plan.algo).table(plan)


def by_slot(plan: Plan) -> list[dict[int, list[Action]]]:
    """Each rank's actions by slot (replica 0's ranks)."""
    per_rank: list[dict[int, list[Action]]] = []
    for acts in plan.actions[:plan.replica_size]:
        d: dict[int, list[Action]] = {}
        for a in acts:
            d.setdefault(a.slot, []).append(a)
        per_rank.append(d)
    return per_rank


def table_row(cells: list[str]) -> str:
    """One markdown row; an empty cell stays empty."""
    return "|" + "".join(f" {c} |" if c else " |" for c in cells)


def compute_word(acts: list[Action], acc: int) -> str:
    """A slot's compute as the tables print it: **F3**(m0,m1), or idle."""
    comps = [a for a in acts if a.op in (Op.F, Op.B)]
    if not comps:
        return "idle"
    first = comps[0]
    mbs = sorted({a.mb for a in comps if a.rank == first.rank})
    shown = "" if acc == 1 else "(" + ",".join(f"m{m}" for m in mbs) + ")"
    return f"**{first.op.value}{first.chunk}**{shown}"
