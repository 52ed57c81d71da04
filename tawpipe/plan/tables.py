"""Plans printed as markdown tables, slot by slot, in the notation of design §3.3 and §3.4."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .actions import G_RECV, OPS, W_OWN, WEIPIPE_F_BUFS, Action, Op

if TYPE_CHECKING:
    from .plan import Plan


def plan_table(plan: Plan) -> str:
    return _tawpipe_table(plan) if plan.algo == "tawpipe" else _weipipe_table(plan)


def _by_slot(plan: Plan) -> list[dict[int, list[Action]]]:
    per_rank: list[dict[int, list[Action]]] = []
    for acts in plan.actions[:plan.replica_size]:
        d: dict[int, list[Action]] = {}
        for a in acts:
            d.setdefault(a.slot, []).append(a)
        per_rank.append(d)
    return per_rank


def _row(cells: list[str]) -> str:
    return "|" + "".join(f" {c} |" if c else " |" for c in cells)


def _tawpipe_table(plan: Plan) -> str:
    """Columns are groups (nodes), rows are slots; the STEP slot is not drawn. A plan of replicas
    shows replica 0's nodes: the others run the same, shifted."""
    topo = plan.topology
    nodes = topo.nodes // plan.replicas
    per_rank = _by_slot(plan)
    head = ["slot"]
    for g in range(nodes):
        ranks = topo.group_ranks(g)
        listed = ", ".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]}–{ranks[-1]}"
        head.append(f"group {g} ({'rank' if len(ranks) == 1 else 'ranks'} {listed})")
    lines = [_row(head), "|" + "---|" * len(head)]
    for slot in range(-1, plan.num_slots - 1):
        row = ["−1" if slot == -1 else str(slot)]
        for g in range(nodes):
            acts = [a for r in topo.group_ranks(g) for a in per_rank[r].get(slot, ())]
            row.append("; ".join(_tawpipe_cell(acts, slot, plan.micro_batches)))
        lines.append(_row(row))
    return "\n".join(lines)


def _compute_word(acts: list[Action], acc: int) -> str:
    comps = [a for a in acts if a.op in (Op.F, Op.B)]
    if not comps:
        return "idle"
    first = comps[0]
    mbs = sorted({a.mb for a in comps if a.rank == first.rank})
    shown = "" if acc == 1 else "(" + ",".join(f"m{m}" for m in mbs) + ")"
    return f"**{first.op.value}{first.chunk}**{shown}"


def _tawpipe_cell(acts: list[Action], slot: int, acc: int) -> list[str]:
    parts = [_compute_word(acts, acc)] if slot >= 0 else []
    staged = set()
    for a in acts:
        if a.op is Op.RECV_W:
            parts.append(f"P2P W{a.chunk} r{a.peer}→r{a.rank}")
            staged.add((a.chunk, a.rank))
    bcasts = list(dict.fromkeys((a.chunk, a.root) for a in acts if a.op is Op.BCAST_W))
    for chunk, root in bcasts:  # "bcast from rX" right after the one P2P that staged it
        short = len(bcasts) == 1 and (chunk, root) in staged
        parts.append(f"bcast from r{root}" if short else f"bcast W{chunk} from r{root}")
    if not bcasts and not staged:
        parts += [f"load W{a.chunk} on r{a.rank}" for a in acts if a.op is Op.LOAD_W and a.buf != W_OWN]
    reduce = next((a for a in acts if a.op is Op.REDUCE_G), None)
    if reduce is not None:
        parts.append(f"reduce G{reduce.chunk}→r{reduce.root}")
    for a in acts:
        if a.op is Op.SEND_G:
            parts.append(f"P2P G{a.chunk} r{a.rank}→r{a.peer}")
    if reduce is None:
        parts += [f"acc G{a.chunk} on r{a.rank}" for a in acts if a.op is Op.ACC_G and a.buf != G_RECV]
    summed = [f"G{a.chunk}" for a in acts if a.op is Op.ALLREDUCE_G]
    if summed:
        parts.append(f"all-reduce {','.join(summed)} across replicas")
    return parts


def _weipipe_table(plan: Plan) -> str:
    """Rows are steps; "⇒" lists what a worker sends: f/b ring weights, g partial sums (sent in
    the step after the B that produced them), seeds and the final gradient delivery."""
    n, acc = plan.topology.world_size, plan.micro_batches
    per_rank = _by_slot(plan)
    head = ["step"] + [f"worker {w}" for w in range(n)]
    lines = [_row(head), "|" + "---|" * len(head)]
    for slot in range(0, plan.num_slots - 1):
        recv_bufs: dict[tuple[Op, int, int], deque[str]] = {}
        for w in range(n):
            for a in per_rank[w].get(slot, ()):
                if OPS[a.op].transfer == "recv":
                    recv_bufs.setdefault((a.op, a.peer, w), deque()).append(a.buf)
        row = [str(slot)]
        for w in range(n):
            acts = per_rank[w].get(slot, [])
            comps = sorted((a for a in acts if a.op in (Op.F, Op.B)), key=lambda a: a.op.value, reverse=True)
            words = [f"{a.op.value}:W{a.chunk}" + (f"(m{a.mb})" if acc > 1 else "") for a in comps]
            sends = []
            for a in acts:
                if a.op is Op.SEND_W:
                    rbuf = recv_bufs[(Op.RECV_W, w, a.peer)].popleft()
                    if rbuf in WEIPIPE_F_BUFS:
                        sends.append(f"f{a.chunk}")
                    elif a.buf == W_OWN:
                        sends.append(f"seed W{a.chunk}→{a.peer}")
                    else:
                        sends.append(f"b{a.chunk}")
                elif a.op is Op.SEND_G:
                    final = recv_bufs[(Op.RECV_G, w, a.peer)].popleft() == G_RECV
                    sends.append(f"final G{a.chunk}→{a.peer}" if final else f"g{a.chunk}")
            if sends:
                words.append("⇒ " + ",".join(sends))
            row.append(" ".join(words))
        lines.append(_row(row))
    return "\n".join(lines)
