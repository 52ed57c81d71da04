"""The schedules: pure functions (topology, layers, micro-batches, options) -> Plan.

``build_plan`` chunks the layers, maps chunks to owners and calls one builder per algorithm:
TawPipe (design §3.1-§3.3) and the corrected WeiPipe-Interleave ring (design §3.4). A builder
emits *events* per (slot, phase): one point-to-point pair, one collective (all members' actions)
or one local action. Each rank's action list is its projection of that single global order,
which is what makes a blocking execution deadlock-free by construction (design §5.3).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
from typing import Any

from .actions import (
    G_RECV,
    OPS,
    W_OWN,
    WEIPIPE_B_BUFS,
    WEIPIPE_F_BUFS,
    Action,
    Channel,
    Op,
    grad_buf,
    _new,
    _Unfrozen,
    new_action,
    no_gc,
    settle,
    weight_buf,
)
from .plan import ALGOS, GRAD_ROUTES, STATS_BYTES, Plan, Programs
from .topology import Topology

RESIDENT = "resident"
SETTLE_ACTIONS = 1_000_000  # from this many actions, a new plan goes straight to the oldest generation (settle)


def resident_depth(topology: Topology) -> int:
    """The least prefetch depth at which ``reuse_weights`` keeps every chunk in a staging buffer
    once fetched: d + 1 >= N buffers. Each rank then receives each chunk once per iteration,
    whatever k, so no depth sends fewer bytes (gradients still go once per k micro-batches). It
    costs N + 1 weight and N gradient buffers of a chunk per rank: about the model's weights and
    gradients (design §3.2)."""
    return max(1, topology.world_size - 1)


def prefetch_depth_arg(text: str) -> int | str:
    """The argparse type of every ``--prefetch-depth``: a number of slots, or 'resident'."""
    if text == RESIDENT:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of slots or {RESIDENT!r}, got {text!r}") from None


def depth_text(plan: Plan, asked: int | str) -> str:
    """The prefetch depth ``plan`` was built with, naming ``"resident"`` where that was asked."""
    return f"{plan.options['prefetch_depth']}{' (resident)' if asked == RESIDENT else ''}"


@no_gc()
def build_plan(
    topology: Topology,
    num_layers: int,
    micro_batches: int,
    *,
    algo: str = "tawpipe",
    grad_route: str = "rail",
    prefetch_depth: int | str = 1,
    mb_per_fetch: int = 1,
    reuse_weights: bool = False,
    layer_numel: int = 1,
    weight_bytes: int = 2,
    grad_bytes: int = 4,
    replicated_numel: int = 0,
    replicas: int = 1,
) -> Plan:
    """Build the plan of one iteration.

    ``replicas`` R: the G nodes form R replicas of G/R whole nodes; each runs this schedule over
    its N/R ranks on its own micro-batches, and a chunk's R owners add up their gradients once per
    iteration (``ALLREDUCE_G``, design §3.5). One replica's lists are built; the others are shifts.

    ``prefetch_depth`` d: weights for slot t+d are fetched during slot t, through d+1 weight and
    d+1 gradient staging buffers (design §3.2); ``"resident"`` is ``resident_depth(topology)``,
    which needs ``reuse_weights``. ``mb_per_fetch`` k: a resident chunk runs k
    micro-batches back to back, so each fetch and each gradient route serves k micro-batches;
    k = 1 is the paper's schedule. ``reuse_weights``: a chunk still in a staging buffer when it is
    needed again is not fetched again (design §3.2); off, the plan is the paper's. Chunks are
    balanced: the first ``num_layers mod N`` chunks hold one extra layer. Message sizes are
    layers x ``layer_numel`` x the dtype size of weights or gradients.
    """
    job = topology
    topology = _replica_topology(job, replicas, num_layers)
    if prefetch_depth == RESIDENT and isinstance(topology, Topology):
        if not reuse_weights:
            raise ValueError("prefetch_depth='resident' keeps fetched chunks only if they are reused: "
                             "pass reuse_weights=True, or give the depth as a number")
        prefetch_depth = resident_depth(topology)
    _check_args(topology, num_layers, micro_batches, algo, grad_route, prefetch_depth, mb_per_fetch,
                reuse_weights, layer_numel, weight_bytes, grad_bytes, replicated_numel)
    n = topology.world_size
    base, extra = divmod(num_layers, n)
    positions, start = [], 0
    for p in range(n):
        stop = start + base + (1 if p < extra else 0)
        positions.append((start, stop))
        start = stop
    sizes = dict(w=weight_bytes, g=grad_bytes, replica=4)  # the replicas add float32 accumulators
    options: dict[str, Any] = {
        "layer_numel": layer_numel, "weight_bytes": weight_bytes, "grad_bytes": grad_bytes,
        "replicated_numel": replicated_numel, "prefetch_depth": prefetch_depth,
        "mb_per_fetch": mb_per_fetch, "reuse_weights": reuse_weights,
    }
    if algo == "tawpipe":
        chunk_layers = tuple(positions)
        owner = tuple(topology.rank_of(k % topology.nodes, k // topology.nodes) for k in range(n))  # design §3.1
        options["grad_route"] = grad_route
    else:
        chunk_layers = tuple(positions[(-x) % n] for x in range(n))
        owner = tuple(range(n))
    nbytes = {kind: [(e - s) * layer_numel * b for s, e in chunk_layers] for kind, b in sizes.items()}
    rbytes = replicated_numel * grad_bytes
    if algo == "tawpipe":
        events, num_slots = _tawpipe(topology, micro_batches, owner, nbytes, rbytes, grad_route,
                                     prefetch_depth, mb_per_fetch, reuse_weights)
    else:
        events, num_slots = _weipipe(n, micro_batches, nbytes, rbytes)
    programs = events.project(n)
    large = sum(map(len, programs)) >= SETTLE_ACTIONS  # a plan this large lives on: no collection need walk it
    if replicas > 1:
        programs = _join_replicas(programs, replicas, owner, nbytes["replica"])
    if large:
        settle()
    return Plan(
        algo=algo, topology=job, num_layers=num_layers, micro_batches=micro_batches,
        chunk_layers=chunk_layers, owner=owner, num_slots=num_slots,
        actions=Programs(programs, replicas), options=options, replicas=replicas,
    )


def check_replicas(job: Topology, replicas: object) -> int:
    """The ranks of one replica, or a ValueError naming the replica counts that fit."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    if job.nodes % replicas:
        fits = [r for r in range(1, job.nodes + 1) if job.nodes % r == 0]
        raise ValueError(f"replicas={replicas} does not divide the {job.nodes} nodes: every replica is the same "
                         f"number of whole nodes; pick one of {fits}")
    return job.world_size // replicas


def compute_actions(job: Topology, micro_batches: int, replicas: int = 1) -> int:
    """Forwards and backwards in one replica's plan, 2 x (N/R)^2 x micro-batches: what sets the
    time and memory it takes to build and prove (about twice as many transfers come with them)."""
    n = job.world_size // replicas
    return 2 * n * n * micro_batches


def _replica_topology(job: Topology, replicas: int, num_layers: int) -> Topology:
    """The topology of one replica: G/R whole nodes (a ValueError naming the fix otherwise)."""
    if not isinstance(job, Topology):
        return job  # _check_args names the problem
    size = check_replicas(job, replicas)
    if replicas > 1 and num_layers < size:
        raise ValueError(f"num_layers={num_layers} < {size} ranks per replica: every rank "
                         f"owns one chunk of at least one layer; use more replicas (each of fewer nodes)")
    return Topology(job.nodes // replicas, job.per_node)


def _join_replicas(programs: tuple[tuple[Action, ...], ...], replicas: int, owner: tuple[int, ...],
                   replica_bytes: list[int]) -> tuple[tuple[Action, ...], ...]:
    """Replica 0's lists in a job of ``replicas`` replicas: the all-reduces that span every rank
    span the job's ranks, and each owner adds its chunk's gradient with the other replicas' owners
    right after the last write of its accumulator (``ALLREDUCE_G``, on its own channel)."""
    size = len(programs)
    everyone = tuple(range(size * replicas))
    out = []
    for r, acts in enumerate(programs):
        chunk = owner.index(r)
        last = next(i for i in reversed(range(len(acts))) if acts[i].op is Op.ACC_G)
        rail = tuple(r + i * size for i in range(replicas))
        exchange = Action(acts[last].slot, r, Op.ALLREDUCE_G, chunk=chunk, group=rail, bytes=replica_bytes[chunk])
        joined = [dataclasses.replace(a, group=everyone) if OPS[a.op].scope == "job" else a for a in acts]
        joined.insert(last + 1, exchange)
        out.append(tuple(joined))
    return tuple(out)


def _check_args(topology: Topology, num_layers: int, micro_batches: int, algo: str, grad_route: str,
                prefetch_depth: int, mb_per_fetch: int, reuse_weights: bool, layer_numel: int,
                weight_bytes: int, grad_bytes: int, replicated_numel: int) -> None:
    """ValueError naming the argument and the fix, for anything ``build_plan`` cannot build."""
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a Topology, got {type(topology).__name__}")
    n = topology.world_size
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if grad_route not in GRAD_ROUTES:
        raise ValueError(f"grad_route must be one of {GRAD_ROUTES}, got {grad_route!r}")
    for name, value, low in (
        ("num_layers", num_layers, 1), ("micro_batches", micro_batches, 1),
        ("prefetch_depth", prefetch_depth, 1), ("mb_per_fetch", mb_per_fetch, 1),
        ("layer_numel", layer_numel, 1), ("weight_bytes", weight_bytes, 1),
        ("grad_bytes", grad_bytes, 1), ("replicated_numel", replicated_numel, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            also = f" or {RESIDENT!r}" if name == "prefetch_depth" else ""
            raise ValueError(f"{name} must be an integer >= {low}{also}, got {value!r}")
    if num_layers < n:
        raise ValueError(
            f"num_layers={num_layers} < world size {n}: every rank owns one chunk of at least one "
            f"layer; use at most {num_layers} ranks or a deeper model"
        )
    if micro_batches % mb_per_fetch:
        raise ValueError(
            f"mb_per_fetch={mb_per_fetch} does not divide micro_batches={micro_batches}: each fetch "
            "serves the same number of micro-batches; pick a divisor"
        )
    if algo == "weipipe":
        if n < 2:
            raise ValueError("weipipe needs a ring of at least 2 ranks")
        if prefetch_depth != 1 or mb_per_fetch != 1 or reuse_weights:
            raise ValueError(
                "weipipe is the paper's lock-step ring: prefetch_depth and mb_per_fetch must be 1 and "
                "reuse_weights off (they are tawpipe options)"
            )


_READY, _COLLECTIVE, _COMPUTES, _SEND, _RECV = range(5)  # what an event holds (see _Events)


class _Events:
    """Events per (slot, phase); ``project`` turns them into per-rank action lists.

    ``phases`` is the algorithm's phase enum (the order of work inside a slot); ``p2p`` names the
    phases made of point-to-point pairs, which are ordered in rounds (see ``_in_rounds``). An
    event is kept as its fields (a collective, a group's computes, a pair) or as ready actions;
    ``project`` makes each rank's actions one rank after the other, so that a rank's list lies
    together in memory: every pass over a plan of millions of actions reads it rank by rank.
    """

    def __init__(self, phases: type[enum.IntEnum], p2p: frozenset[enum.IntEnum]) -> None:
        self._phases, self._p2p, self._width = phases, p2p, len(phases)
        self._events: dict[tuple[int, int], list[list[tuple]]] = {}

    def _phase(self, slot: int, order: int, phase: enum.IntEnum) -> list[tuple]:
        key = (slot, order)
        phases = self._events.get(key)
        if phases is None:
            phases = self._events[key] = [[] for _ in range(self._width)]
        return phases[phase]

    def add(self, phase: enum.IntEnum, *actions: Action, order: int = 0) -> None:
        """Add one event of ready actions (a local action, say); a slot's events run in
        (``order``, phase) order."""
        self._phase(actions[0].slot, order, phase).append((_READY, actions))

    def collective(self, phase: enum.IntEnum, slot: int, op: Op, members: tuple[int, ...], root: int | None,
                   chunk: int | None, buf: str | None, nbytes: int, order: int = 0) -> None:
        """Add one collective: an action of ``op`` for every member."""
        self._phase(slot, order, phase).append((_COLLECTIVE, slot, op, members, root, chunk, buf, nbytes))

    def computes(self, phase: enum.IntEnum, slot: int, members: tuple[int, ...], op: Op, chunk: int, first: int,
                 k: int, wbuf: str, gbuf: str | None) -> None:
        """Add the F or B of ``chunk`` that every member runs for micro-batches first .. first + k - 1,
        in that order (a B adds into ``gbuf`` from the second on)."""
        self._phase(slot, 0, phase).append((_COMPUTES, slot, members, op, chunk, first, k, wbuf, gbuf))

    def pair(self, phase: enum.IntEnum, slot: int, src: int, dst: int, send: Op, recv: Op, chunk: int, sbuf: str,
             rbuf: str, nbytes: int, order: int = 0) -> None:
        """Add one point-to-point pair: ``src`` sends ``chunk`` from ``sbuf`` into ``dst``'s ``rbuf``."""
        self._phase(slot, order, phase).append((slot, src, dst, send, recv, chunk, sbuf, rbuf, nbytes))

    def project(self, n: int) -> tuple[tuple[Action, ...], ...]:
        """Each rank's actions in the global order; point-to-point pairs get their tags here: the
        k-th message from src to dst on a channel, counted in that same order.

        First every rank's share of each event is listed, in the global order (the events are
        dropped as they are listed); then each rank's actions are made from its list."""
        shares: list[list] = [[] for _ in range(n)]
        add = [share.append for share in shares]
        sent: dict[tuple[Channel, int, int], int] = {}
        channel = {op: spec.channel for op, spec in OPS.items()}
        for key in sorted(self._events):
            for phase, events in zip(self._phases, self._events.pop(key)):
                if not events:
                    continue
                if phase in self._p2p:
                    for pair in _in_rounds(events):
                        src, dst = pair[1], pair[2]
                        route = (channel[pair[3]], src, dst)
                        tag = sent.get(route, 0)
                        sent[route] = tag + 1
                        add[src]((_SEND, pair, tag))
                        add[dst]((_RECV, pair, tag))
                else:
                    for ev in events:
                        kind = ev[0]
                        if kind == _READY:
                            for a in ev[1]:
                                add[a.rank](a)
                        else:
                            for r in ev[3] if kind == _COLLECTIVE else ev[2]:
                                add[r](ev)
        lists = []
        for r in range(n):
            lists.append(_make(shares[r], r))
            shares[r] = []  # type: ignore[call-overload]
        return tuple(lists)


def _make(share: list, r: int) -> tuple[Action, ...]:
    """Rank r's actions, from its share of the events (see ``_Events.project``). Each is made as
    ``new_action`` makes it, inlined: millions of calls would cost a second."""
    out: list[Action] = []
    add, blank, cls, b_op = out.append, _Unfrozen, Action, Op.B
    for e in share:
        if e.__class__ is cls:
            add(e)
            continue
        kind = e[0]
        a = _new(blank)
        if kind == _COLLECTIVE:
            _, a.slot, a.op, a.group, a.root, a.chunk, a.buf, a.bytes = e
            a.rank, a.mb, a.peer, a.grad_buf, a.accumulate, a.tag = r, None, None, None, False, None
        elif kind == _COMPUTES:
            _, slot, _, op, chunk, first, k, wbuf, gbuf = e
            a.slot, a.rank, a.op, a.chunk, a.mb, a.peer, a.root, a.group = slot, r, op, chunk, first, None, None, None
            a.buf, a.grad_buf, a.accumulate, a.bytes, a.tag = wbuf, gbuf, False, 0, None
            for m in range(first + 1, first + k):  # k > 1: the next micro-batches add into grad_buf
                a.__class__ = cls
                add(a)
                a = _new(blank)
                a.slot, a.rank, a.op, a.chunk, a.mb, a.peer, a.root, a.group = slot, r, op, chunk, m, None, None, None
                a.buf, a.grad_buf, a.accumulate, a.bytes, a.tag = wbuf, gbuf, op is b_op, 0, None
        else:
            slot, src, dst, send, recv, chunk, sbuf, rbuf, nbytes = e[1]
            a.slot, a.chunk, a.mb, a.root, a.group, a.grad_buf, a.accumulate, a.bytes, a.tag = (
                slot, chunk, None, None, None, None, False, nbytes, e[2])
            if kind == _SEND:
                a.rank, a.op, a.peer, a.buf = src, send, dst, sbuf
            else:
                a.rank, a.op, a.peer, a.buf = dst, recv, src, rbuf
        a.__class__ = cls
        add(a)
    return tuple(out)


def _in_rounds(pairs: list[tuple]) -> list[tuple]:
    """Order P2P pairs in rounds in which every rank appears at most once (greedy edge colouring).

    Under blocking semantics a round's pairs proceed in parallel: a ring becomes two or three
    rounds instead of a chain of N dependent transfers.
    """
    if len(pairs) == 1:
        return pairs
    used: dict[int, set[int]] = {}
    keyed = []
    for idx, pair in enumerate(pairs):
        a, b = pair[1], pair[2]
        ua, ub = used.setdefault(a, set()), used.setdefault(b, set())
        r = 0
        while r in ua or r in ub:
            r += 1
        ua.add(r)
        ub.add(r)
        keyed.append((r, idx, pair))
    keyed.sort(key=lambda t: (t[0], t[1]))
    return [pair for _, _, pair in keyed]


def _finish(events: _Events, phase: enum.IntEnum, stats_phase: enum.IntEnum, n: int, slot: int) -> None:
    """The step's statistics (one collective) and the optimizer step, closing every plan."""
    everyone = tuple(range(n))
    events.collective(stats_phase, slot, Op.ALLREDUCE_STATS, everyone, None, None, None, STATS_BYTES)
    for r in everyone:
        events.add(phase, new_action(slot, r, Op.STEP))


# ---------------------------------------------------------------------------------- TawPipe


class TawPhase(enum.IntEnum):
    """Work inside one TawPipe slot, in order (design §3.2)."""

    REPLICATED = 0  # all-reduce of the replicated gradients, after a group's last B
    LOAD = 1  # owners cast their master into a staging buffer
    FETCH = 2  # remote chunks: owner -> staging device P2P
    BCAST = 3  # staging device -> group broadcast
    REDUCE = 4  # gradients of the previous slot's B: group reduce to the router
    ROUTE = 5  # router -> owner P2P
    COMPUTE = 6  # F or B of the resident chunk, k micro-batches
    ACC = 7  # owners add routed gradients into their accumulator
    STATS = 8
    STEP = 9


def _tawpipe(topo: Topology, acc: int, owner: tuple[int, ...], nbytes: dict[str, list[int]],
             rbytes: int, grad_route: str, depth: int, k: int, reuse: bool) -> tuple[_Events, int]:
    """Design §3.2 with rail or leader gradient routing; degenerate groups skip collectives."""
    G, s, n = topo.nodes, topo.per_node, topo.world_size
    span = 2 * (acc // k) * n  # compute slots of one group
    step_slot = span + G  # after the last group's last gradient route (slot span + G - 1)
    everyone = tuple(range(n))
    groups = [topo.group_ranks(g) for g in range(G)]  # one tuple per group, shared by its collectives
    out = _Events(TawPhase, frozenset({TawPhase.FETCH, TawPhase.ROUTE}))
    for r in everyone:
        out.add(TawPhase.LOAD, new_action(-1, r, Op.LOAD_W, chunk=owner.index(r), buf=W_OWN))

    def fetch(need: int, g: int, chunk: int, buf: str) -> None:
        """Stage ``chunk`` for slot ``need``, issued ``depth`` slots earlier. Fetches for the first
        slots all start before slot 0; they go in the order compute needs them, so a remote fetch
        never holds up the broadcast of a chunk needed before it."""
        slot = max(need - depth, -1)
        order = need if slot == -1 else 0
        members, o, nb = groups[g], owner[chunk], nbytes["w"][chunk]
        if topo.group_of(o) == g:  # local chunk: the owner stages its own copy
            out.add(TawPhase.LOAD, new_action(slot, o, Op.LOAD_W, chunk=chunk, buf=buf), order=order)
            src = o
        else:  # remote chunk: rail-aligned P2P to the staging device with the owner's local index
            src = topo.rank_of(g, topo.local_index(o))
            out.pair(TawPhase.FETCH, slot, o, src, Op.SEND_W, Op.RECV_W, chunk, W_OWN, buf, nb, order=order)
        if s > 1:
            out.collective(TawPhase.BCAST, slot, Op.BCAST_W, members, src, chunk, buf, nb, order=order)

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
    placement = _place_weights([c for _, c in uses], depth, reuse)
    gbufs, b_op, computes = [grad_buf(j) for j in range(depth + 1)], Op.B, TawPhase.COMPUTE
    for g in range(G):
        members = groups[g]
        backwards = 0
        for u, ((op, chunk), (wbuf, fetched)) in enumerate(zip(uses, placement)):
            slot = g + u
            first = u // (2 * n) * k  # the round's first micro-batch
            if fetched:
                fetch(slot, g, chunk, wbuf)
            gbuf = None
            if op is b_op:
                gbuf = gbufs[backwards % (depth + 1)]
                backwards += 1
                route(slot + 1, g, chunk, gbuf)
            out.computes(computes, slot, members, op, chunk, first, k, wbuf, gbuf)
        for r in members:  # right after the group's last B (of chunk 0)
            out.add(TawPhase.REPLICATED,
                    new_action(g + span, r, Op.ALLREDUCE_REPLICATED, group=everyone, bytes=rbytes))
    _finish(out, TawPhase.STEP, TawPhase.STATS, n, step_slot)
    return out, step_slot + 1


def _place_weights(chunks: list[int], depth: int, reuse: bool) -> list[tuple[str, bool]]:
    """For the chunk each compute slot uses: its weight buffer, and whether it must be fetched.

    There are depth + 1 buffers, and the fetch for slot t is issued at slot t - depth, so it must
    go to a buffer no slot from t - depth on still uses (one always exists: d slots use at most d
    buffers). The paper's schedule fills them in turn and keeps a chunk only across a turnaround
    (F then B of the same chunk); where the turn's buffer is still in use (a turnaround held it
    one slot longer, at depth >= 2) the fetch takes the free buffer used longest ago instead. With
    ``reuse``, the fetch goes to a free buffer evicting the chunk needed again the latest, and a
    chunk still in its buffer when it is needed again is not fetched again (design §3.2)."""
    nbuf = depth + 1
    held: list[int | None] = [None] * nbuf  # chunk in each buffer
    last = [-nbuf - depth] * nbuf  # last slot that uses each buffer
    where: list[tuple[str, bool]] = []
    fetches = 0

    def next_use(b: int, t: int) -> int:
        return next((u for u in range(t, len(chunks)) if chunks[u] == held[b]), len(chunks))

    for t, c in enumerate(chunks):
        if c in held and (reuse or chunks[t - 1] == c):
            b, fetched = held.index(c), False
        else:
            free = [b for b in range(nbuf) if last[b] < t - depth]
            if reuse:
                b = max(free, key=lambda b: (next_use(b, t), -b))
            else:
                b = fetches % nbuf if fetches % nbuf in free else min(free, key=lambda b: (last[b], b))
            fetched = True
        fetches += fetched
        held[b], last[b] = c, t
        where.append((weight_buf(b), fetched))
    return where


# ---------------------------------------------------------------------------------- WeiPipe


class WeiPhase(enum.IntEnum):
    """Work inside one WeiPipe step, in order (design §3.4)."""

    REPLICATED = 0
    LOAD = 1  # owners reload their chunk; seeding the B-ring with the own chunk
    GRAD_RING = 2  # the gradient partial sums move one hop (and the final delivery)
    RINGS = 3  # the F-ring and the B-ring move one hop (and the B-ring's seed exchange)
    COMPUTE = 4
    ACC = 5
    STATS = 6
    STEP = 7


def _f_active(n: int, acc: int, w: int, t: int) -> bool:
    return w <= t < w + acc * n


def _b_active(n: int, acc: int, w: int, t: int) -> bool:
    return w + n <= t < w + n + acc * n


def _ring_needs(n: int, acc: int, last: int) -> tuple[list[list[bool]], list[list[bool]]]:
    """need[t][w]: worker w must hold its F-ring (B-ring) chunk at step t, because it uses it or
    because a later worker on the ring will; the other ring transfers are dropped."""
    need_f = [[False] * n for _ in range(last + 2)]
    need_b = [[False] * n for _ in range(last + 2)]
    for t in range(last, -1, -1):
        for w in range(n):
            nxt = (w + 1) % n
            need_f[t][w] = _f_active(n, acc, w, t) or ((t + 1) % n != 0 and need_f[t + 1][nxt])
            need_b[t][w] = t >= n and (_b_active(n, acc, w, t) or need_b[t + 1][nxt])
    return need_f, need_b


def _weipipe(n: int, acc: int, nbytes: dict[str, list[int]], rbytes: int) -> tuple[_Events, int]:
    """Corrected WeiPipe-Interleave: three same-direction rings w -> w+1 (design §3.4).

    Step t = slot t. Ring transfers nobody consumes are dropped. Each chunk's gradient partial sum
    starts at worker 0 with a fresh buffer, collects one contribution per B, keeps moving along the
    ring until the last step and is then delivered by the exchange u <-> (N-1-u) mod N.
    """
    last = (acc + 2) * n - 2  # last compute step
    step_slot = last + 2
    everyone = tuple(range(n))
    out = _Events(WeiPhase, frozenset({WeiPhase.GRAD_RING, WeiPhase.RINGS}))
    wb, gb = nbytes["w"], nbytes["g"]

    def f_active(w: int, t: int) -> bool:
        return _f_active(n, acc, w, t)

    def b_active(w: int, t: int) -> bool:
        return _b_active(n, acc, w, t)

    def fbuf(t: int) -> str:
        return W_OWN if t % n == 0 else WEIPIPE_F_BUFS[t % 2]

    def bbuf(t: int) -> str:
        return WEIPIPE_B_BUFS[t % 2]

    need_f, need_b = _ring_needs(n, acc, last)

    for r in everyone:
        out.add(WeiPhase.LOAD, new_action(-1, r, Op.LOAD_W, chunk=r, buf=W_OWN))
    for w in range(n):  # B-ring seed: w <-> (N+1-w) mod N, for use at step N
        if need_b[n][w]:
            c = (1 - w) % n
            if c == w:
                out.add(WeiPhase.LOAD, new_action(n - 1, w, Op.LOAD_W, chunk=c, buf=bbuf(n)))
            else:
                out.pair(WeiPhase.RINGS, n - 1, c, w, Op.SEND_W, Op.RECV_W, c, W_OWN, bbuf(n), wb[c])

    tokens: list[int | None] = [None] * n  # chunk of the partial sum each worker holds
    for t in range(last + 1):
        arriving = [tokens[(w - 1) % n] for w in range(n)]
        for w in range(n):
            nxt = (w + 1) % n
            if t < last and (t + 1) % n != 0 and need_f[t + 1][nxt]:
                c = (w - t) % n
                out.pair(WeiPhase.RINGS, t, w, nxt, Op.SEND_W, Op.RECV_W, c, fbuf(t), fbuf(t + 1), wb[c])
            if t >= n and t < last and need_b[t + 1][nxt]:
                c = (t - w + 1) % n
                out.pair(WeiPhase.RINGS, t, w, nxt, Op.SEND_W, Op.RECV_W, c, bbuf(t), bbuf(t + 1), wb[c])
            inc = arriving[w]
            if inc is not None:  # the partial sum from w-1's step t-1 arrives for this step
                prev = (w - 1) % n
                out.pair(WeiPhase.GRAD_RING, t, prev, w, Op.SEND_G, Op.RECV_G, inc, grad_buf((t - 1) % 2),
                         grad_buf(t % 2), gb[inc])
            if b_active(w, t):
                c = (t - w + 1) % n
                if inc is not None and inc != c:
                    raise AssertionError(f"gradient ring out of step at worker {w}, step {t}")
                out.add(WeiPhase.COMPUTE, new_action(t, w, Op.B, chunk=c, mb=(t - w - n) // n, buf=bbuf(t),
                                                 grad_buf=grad_buf(t % 2), accumulate=inc is not None))
                tokens[w] = c
            else:
                tokens[w] = inc
            if f_active(w, t):
                out.add(WeiPhase.COMPUTE, new_action(t, w, Op.F, chunk=(w - t) % n, mb=(t - w) // n, buf=fbuf(t)))
    final = last + 1  # each worker u holds the complete sum of chunk (-1-u) mod N
    for u, c in enumerate(tokens):
        if c is None:
            raise AssertionError(f"worker {u} holds no gradient at the end of the ring")
        if c == u:
            out.add(WeiPhase.ACC, new_action(final, u, Op.ACC_G, chunk=c, buf=grad_buf(last % 2)))
        else:
            out.pair(WeiPhase.GRAD_RING, final, u, c, Op.SEND_G, Op.RECV_G, c, grad_buf(last % 2), G_RECV, gb[c])
            out.add(WeiPhase.ACC, new_action(final, c, Op.ACC_G, chunk=c, buf=G_RECV))
    for w in range(n):  # right after the worker's last B (of chunk 0)
        out.add(WeiPhase.REPLICATED,
                new_action(w + n + acc * n, w, Op.ALLREDUCE_REPLICATED, group=everyone, bytes=rbytes))
    _finish(out, WeiPhase.STEP, WeiPhase.STATS, n, step_slot)
    return out, step_slot + 1
