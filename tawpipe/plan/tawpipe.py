"""TawPipe (design §3.1-§3.3): the schedule this package is named for, registered as "tawpipe".

Chunk k is model position k, owned by rank (k mod G)·s + ⌊k/G⌋, so consecutive chunks live on
consecutive nodes. Every group runs every chunk in model order, one slot behind the previous
group: a chunk is fetched from its owner by rail-aligned P2P, broadcast inside the group, run for
k micro-batches, and its gradients are reduced to a router and sent back to the owner.

[Note: resident reuse] With ``reuse_weights`` a chunk still in a staging buffer when it is needed
again is not fetched again, and the fetch that needs a buffer evicts the chunk needed again the
latest (``_place_weights``). At the resident depth (d + 1 >= N buffers) every chunk stays once
fetched: each rank then receives each chunk once per iteration whatever k, the fewest bytes, for
about the model's weights in staging memory (design §3.2, §7.3). With ``reuse_weights="host"`` the
same bytes cross the network through depth + 1 buffers: a chunk evicted while still needed was
kept in host memory by the fetch that brought it (STASH_W), and comes back from there (RESTORE_W).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from .actions import G_RECV, W_OWN, Action, Op, grad_buf, new_action, weight_buf
from .events import Events, finish
from .plan import GRAD_ROUTES, Plan
from .registry import ChunkLayout, Schedule, register
from .schedule import HOST
from .tables import by_slot, compute_word, table_row
from .topology import Topology

if TYPE_CHECKING:
    from ..models.shape import ModelDims


class TawPipeSchedule(Schedule):
    """Design §3.2 with rail or leader gradient routing, any prefetch depth, k and reuse."""

    name, title = "tawpipe", "TawPipe"
    tunable = routes_gradients = True

    def layout(self, topology: Topology, positions: Any) -> ChunkLayout:
        owner = tuple(topology.rank_of(k % topology.nodes, k // topology.nodes)
                      for k in range(topology.world_size))  # design §3.1
        return tuple(positions), owner

    def check(self, topology: Topology, options: dict[str, Any]) -> None:
        if options["grad_route"] not in GRAD_ROUTES:
            raise ValueError(f"grad_route must be one of {GRAD_ROUTES}, got {options['grad_route']!r}")

    def events(self, topology: Topology, micro_batches: int, owner: tuple[int, ...], nbytes: dict[str, list[int]],
               rbytes: int, options: dict[str, Any]) -> tuple[Events, int]:
        return _events(topology, micro_batches, owner, nbytes, rbytes, options["grad_route"],
                       options["prefetch_depth"], options["mb_per_fetch"], options["reuse_weights"])

    def table(self, plan: Plan) -> str:
        return _table(plan)

    def closed_form(self, dims: ModelDims, topology: Topology, micro_batches: int) -> tuple[float, float]:
        """Design §7.1: a chunk crosses nodes twice per micro-batch (forward and backward) and
        its gradient once; inside a node the broadcasts and reduces move the rest."""
        n, G, s, acc = topology.world_size, topology.nodes, topology.per_node, micro_batches
        psi, wb, gb = dims.decoder_numel, dims.dtype_bytes, dims.grad_bytes
        inter_node = (G - 1) / G * (2 * acc * (n - 1) / n * psi * wb + acc * psi * gb)
        intra_rank = (s - 1) / s * acc * psi * (2 * wb + gb)
        return intra_rank + inter_node / s, inter_node

    def max_weight_buffers(self, plan: Plan) -> int:
        return 2 + int(plan.options.get("prefetch_depth", 1))  # w_own + prefetch_depth + 1


class TawPhase(enum.IntEnum):
    """Work inside one TawPipe slot, in order (design §3.2)."""

    REPLICATED = 0  # all-reduce of the replicated gradients, after a group's last B
    LOAD = 1  # owners cast their master into a staging buffer
    FETCH = 2  # remote chunks: owner -> staging device P2P
    BCAST = 3  # staging device -> group broadcast
    STASH = 4  # reuse_weights="host": what was just staged, also kept in host memory
    REDUCE = 5  # gradients of the previous slot's B: group reduce to the router
    ROUTE = 6  # router -> owner P2P
    COMPUTE = 7  # F or B of the resident chunk, k micro-batches
    ACC = 8  # owners add routed gradients into their accumulator
    STATS = 9
    STEP = 10


def _events(topo: Topology, acc: int, owner: tuple[int, ...], nbytes: dict[str, list[int]],
            rbytes: int, grad_route: str, depth: int, k: int, reuse: bool) -> tuple[Events, int]:
    """Design §3.2 with rail or leader gradient routing; degenerate groups skip collectives."""
    G, s, n = topo.nodes, topo.per_node, topo.world_size
    span = 2 * (acc // k) * n  # compute slots of one group
    step_slot = span + G  # after the last group's last gradient route (slot span + G - 1)
    everyone = tuple(range(n))
    groups = [topo.group_ranks(g) for g in range(G)]  # one tuple per group, shared by its collectives
    out = Events(TawPhase, frozenset({TawPhase.FETCH, TawPhase.ROUTE}))
    if G > 1:  # the own chunk's copy is what owners send to other nodes; inside one node, nothing reads it
        for r in everyone:
            out.add(TawPhase.LOAD, new_action(-1, r, Op.LOAD_W, chunk=owner.index(r), buf=W_OWN))

    def fetch(need: int, g: int, chunk: int, buf: str, how: str, stash: bool) -> None:
        """Stage ``chunk`` for slot ``need``, issued ``depth`` slots earlier. Fetches for the first
        slots all start before slot 0; they go in the order compute needs them, so a remote fetch
        never holds up the broadcast of a chunk needed before it. ``how``: over the links
        (``_FETCH``), or from every member's host memory (``_RESTORE``); ``stash``: what was
        fetched is kept in host memory too."""
        slot = max(need - depth, -1)
        order = need if slot == -1 else 0
        members, o, nb = groups[g], owner[chunk], nbytes["w"][chunk]
        if how == _RESTORE:
            for r in members:
                out.add(TawPhase.LOAD, new_action(slot, r, Op.RESTORE_W, chunk=chunk, buf=buf), order=order)
            return
        if topo.group_of(o) == g:  # local chunk: the owner stages its own copy
            out.add(TawPhase.LOAD, new_action(slot, o, Op.LOAD_W, chunk=chunk, buf=buf), order=order)
            src = o
        else:  # remote chunk: rail-aligned P2P to the staging device with the owner's local index
            src = topo.rank_of(g, topo.local_index(o))
            out.pair(TawPhase.FETCH, slot, o, src, Op.SEND_W, Op.RECV_W, chunk, W_OWN, buf, nb, order=order)
        if s > 1:
            out.collective(TawPhase.BCAST, slot, Op.BCAST_W, members, src, chunk, buf, nb, order=order)
        if stash:
            for r in members:
                out.add(TawPhase.STASH, new_action(slot, r, Op.STASH_W, chunk=chunk, buf=buf), order=order)

    def route(slot: int, g: int, chunk: int, buf: str) -> None:
        members, o, nb = groups[g], owner[chunk], nbytes["g"][chunk]
        if topo.group_of(o) == g:
            root = o
        else:  # the owner's rail peer in this group, or its first device
            root = topo.rank_of(g, topo.local_index(o) if grad_route == "rail" else 0)
        if s > 1:
            out.collective(TawPhase.REDUCE, slot, Op.REDUCE_G, members, root, chunk, buf, nb)
        if root == o:
            out.add(TawPhase.ACC, new_action(slot, o, Op.ACC_G, chunk=chunk, buf=buf))
        else:
            out.pair(TawPhase.ROUTE, slot, root, o, Op.SEND_G, Op.RECV_G, chunk, buf, G_RECV, nb)
            out.add(TawPhase.ACC, new_action(slot, o, Op.ACC_G, chunk=chunk, buf=G_RECV))

    uses = [(Op.F, v) if v < n else (Op.B, 2 * n - 1 - v) for v in range(2 * n)] * (acc // k)
    placement, stashed = _place_weights([c for _, c in uses], depth, reuse)
    # d + 1 gradient buffers, so that a B never waits for the reduce of the one before; a single
    # device reduces nothing, and its one buffer is added to the accumulator before the next B
    gbufs, b_op, computes = [grad_buf(j) for j in range(depth + 1 if n > 1 else 1)], Op.B, TawPhase.COMPUTE
    for g in range(G):
        members = groups[g]
        backwards = 0
        for u, ((op, chunk), (wbuf, how)) in enumerate(zip(uses, placement)):
            slot = g + u
            first = u // (2 * n) * k  # the round's first micro-batch
            if how is not None:
                fetch(slot, g, chunk, wbuf, how, u in stashed)
            gbuf = None
            if op is b_op:
                gbuf = gbufs[backwards % len(gbufs)]
                backwards += 1
                route(slot + 1, g, chunk, gbuf)
            out.computes(computes, slot, members, op, chunk, first, k, wbuf, gbuf)
        for r in members:  # right after the group's last B (of chunk 0)
            out.add(TawPhase.REPLICATED,
                    new_action(g + span, r, Op.ALLREDUCE_REPLICATED, group=everyone, bytes=rbytes))
    finish(out, TawPhase.STEP, TawPhase.STATS, n, step_slot)
    return out, step_slot + 1


_FETCH, _RESTORE = "fetch", "restore"  # how a chunk reaches its staging buffer


def _place_weights(chunks: list[int], depth: int, reuse: bool | str) -> tuple[list[tuple[str, str | None]], set[int]]:
    """For the chunk each compute slot uses: its weight buffer and how it gets there (None: it is
    still there; ``_FETCH``; ``_RESTORE``), and the slots whose fetch is also stashed.

    There are depth + 1 buffers, and the fetch for slot t is issued at slot t - depth, so it must
    go to a buffer no slot from t - depth on still uses (one always exists: d slots use at most d
    buffers). The paper's schedule fills them in turn and keeps a chunk only across a turnaround
    (F then B of the same chunk); where the turn's buffer is still in use (a turnaround held it
    one slot longer, at depth >= 2) the fetch takes the free buffer used longest ago instead. With
    ``reuse``, the fetch goes to a free buffer evicting the chunk needed again the latest, and a
    chunk still in its buffer when it is needed again is not fetched again (design §3.2). With
    ``reuse="host"``, a chunk evicted while still needed was stashed by the fetch that brought it,
    and every later fetch of it is a restore from host memory."""
    nbuf = depth + 1
    held: list[int | None] = [None] * nbuf  # chunk in each buffer
    last = [-nbuf - depth] * nbuf  # last slot that uses each buffer
    filled = [0] * nbuf  # the slot whose fetch filled each buffer
    on_host: set[int] = set()
    stashed: set[int] = set()
    where: list[tuple[str, str | None]] = []
    fetches = 0

    def next_use(b: int, t: int) -> int:
        return next((u for u in range(t, len(chunks)) if chunks[u] == held[b]), len(chunks))

    for t, c in enumerate(chunks):
        how: str | None = None
        if c in held and (reuse or chunks[t - 1] == c):
            b = held.index(c)
        else:
            free = [b for b in range(nbuf) if last[b] < t - depth]
            if reuse:
                b = max(free, key=lambda b: (next_use(b, t), -b))
            else:
                b = fetches % nbuf if fetches % nbuf in free else min(free, key=lambda b: (last[b], b))
            evicted = held[b]
            if reuse == HOST and evicted is not None and evicted not in on_host and next_use(b, t) < len(chunks):
                stashed.add(filled[b])
                on_host.add(evicted)
            how, filled[b] = (_RESTORE if c in on_host else _FETCH), t
            fetches += 1
        held[b], last[b] = c, t
        where.append((weight_buf(b), how))
    return where, stashed


def _table(plan: Plan) -> str:
    """Columns are groups (nodes), rows are slots; the STEP slot is not drawn. A plan of replicas
    shows replica 0's nodes: the others run the same, shifted."""
    topo = plan.topology
    nodes = topo.nodes // plan.replicas
    per_rank = by_slot(plan)
    head = ["slot"]
    for g in range(nodes):
        ranks = topo.group_ranks(g)
        listed = ", ".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]}–{ranks[-1]}"
        head.append(f"group {g} ({'rank' if len(ranks) == 1 else 'ranks'} {listed})")
    lines = [table_row(head), "|" + "---|" * len(head)]
    for slot in range(-1, plan.num_slots - 1):
        row = ["−1" if slot == -1 else str(slot)]
        for g in range(nodes):
            acts = [a for r in topo.group_ranks(g) for a in per_rank[r].get(slot, ())]
            row.append("; ".join(_cell(acts, slot, plan.micro_batches)))
        lines.append(table_row(row))
    return "\n".join(lines)




def _cell(acts: list[Action], slot: int, acc: int) -> list[str]:
    parts = [compute_word(acts, acc)] if slot >= 0 else []
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
    parts += [f"W{c} {word} host" for word, op in (("to", Op.STASH_W), ("from", Op.RESTORE_W))
              for c in dict.fromkeys(a.chunk for a in acts if a.op is op)]
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


register(TawPipeSchedule())
