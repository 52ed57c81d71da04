"""The schedule as data: a pure function of (topology, layers, micro-batches) -> Plan.

Contract with the engine (tawpipe/engine.py), which executes a Plan and never re-derives it:

* ``Plan.actions[rank]`` is that rank's ordered action list for one iteration. The engine walks
  it in order. Communication actions go to an in-order communication executor, compute actions
  (F, B, LOAD_W, ACC_G, STEP) run on the compute side. Each rank's communication actions, taken in
  list order with blocking semantics (a send waits for its receive, a collective for all members),
  must not deadlock: this is what ``verify`` checks. ``ALLREDUCE_REPLICATED`` is the exception:
  it runs on an independent channel (it overlaps the tail of the schedule), is not part of that
  ordering, and appears exactly once per rank, right after the rank's last B.
* Within a slot a rank's list holds that slot's communication first (prefetch for the next slot,
  routing of the previous slot's gradient) and its compute last (F/B, then the ACC_G of gradients
  routed in this slot), so the communication of slot t overlaps the compute of slot t. A LOAD_W
  that feeds a send or broadcast of the same slot (a cheap cast of the master) comes before that
  communication.
* Buffers are named. The engine orders work on them by dataflow: an action that reads a buffer
  waits for its last writer; an action that writes it waits for its last writer and every reader
  since. Names:
    - ``w_own``: the owner's compute-dtype copy of its own chunk (source of SEND_W),
    - ``w0``, ``w1``, ...: weight staging buffers (compute dtype, sized to the largest chunk),
    - ``g0``, ``g1``, ...: float32 gradient buffers (harvest, reduce, send),
    - ``g_recv``: float32 landing buffer for gradients from other groups.
* Reads/writes per op (``buf`` is the action's buffer):
    LOAD_W   writes buf (cast of the rank's own float32 master chunk)
    SEND_W   reads buf                RECV_W  writes buf
    BCAST_W  root reads buf, every other member writes buf
    F        reads buf (weights)      B       reads buf, writes grad_buf (overwrite, or += when
                                               ``accumulate``)
    REDUCE_G every member reads buf, the root's buf then holds the sum
    SEND_G   reads buf                RECV_G  writes buf
    ACC_G    reads buf, adds it into the rank's float32 accumulator of its own chunk
    ALLREDUCE_REPLICATED  sums the replicated (embedding/head) gradients over ``group``
    STEP     optimizer step of the own chunk and of the replicated modules

Chunk ids index ``Plan.chunk_layers`` and ``Plan.owner``. For TawPipe chunk k is model position
k. For WeiPipe chunk x is the reference's W_x (owned by worker x), which sits at model position
(-x) mod N (spec §2.2); ``Plan.model_order`` lists the chunks in the order a micro-batch visits
them.
"""

from __future__ import annotations

import enum
import json
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any

from .topology import Topology


class Op(str, enum.Enum):
    F = "F"
    B = "B"
    LOAD_W = "LOAD_W"
    BCAST_W = "BCAST_W"
    SEND_W = "SEND_W"
    RECV_W = "RECV_W"
    REDUCE_G = "REDUCE_G"
    SEND_G = "SEND_G"
    RECV_G = "RECV_G"
    ACC_G = "ACC_G"
    ALLREDUCE_REPLICATED = "ALLREDUCE_REPLICATED"
    STEP = "STEP"


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.LOAD_W, Op.ACC_G, Op.STEP})
COMM_OPS = frozenset(set(Op) - COMPUTE_OPS)


@dataclass(frozen=True)
class Action:
    """One thing one rank does in one slot."""

    slot: int
    rank: int
    op: Op
    chunk: int | None = None
    mb: int | None = None
    peer: int | None = None  # SEND_*/RECV_*
    root: int | None = None  # BCAST_W / REDUCE_G
    group: tuple[int, ...] | None = None  # members of a collective, ascending
    buf: str | None = None
    grad_buf: str | None = None  # B only
    accumulate: bool = False  # B only: grad_buf += local gradient
    bytes: int = 0  # payload of a communication action

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["op"] = self.op.value
        return {k: v for k, v in d.items() if v is not None and v is not False}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Action":
        d = dict(d)
        d["op"] = Op(d["op"])
        if d.get("group") is not None:
            d["group"] = tuple(d["group"])
        return Action(**d)


ALGOS = ("tawpipe", "weipipe")
GRAD_ROUTES = ("rail", "leader")
_SENDS = frozenset({Op.SEND_W, Op.SEND_G})
_RECVS = frozenset({Op.RECV_W, Op.RECV_G})
_COLLECTIVES = frozenset({Op.BCAST_W, Op.REDUCE_G})
_WEIGHT_OPS = frozenset({Op.LOAD_W, Op.SEND_W, Op.RECV_W, Op.BCAST_W, Op.F, Op.B})
_GRAD_OPS = frozenset({Op.REDUCE_G, Op.SEND_G, Op.RECV_G, Op.ACC_G})
# WeiPipe ring buffers: the F-ring and the B-ring each ping-pong between two staging buffers.
_WEIPIPE_F_BUFS = ("w0", "w1")
_WEIPIPE_B_BUFS = ("w2", "w3")
_JSON_FORMAT = "tawpipe-plan/1"


class PlanError(Exception):
    """A plan that would compute wrong gradients, deadlock, or break the engine contract."""


def describe(a: Action) -> str:
    """One-line human description of an action, used in error messages."""
    parts = [f"slot {a.slot} rank {a.rank} {a.op.value}"]
    if a.chunk is not None:
        parts.append(f"W{a.chunk}" if a.op in _WEIGHT_OPS and a.op is not Op.B else f"chunk {a.chunk}")
    if a.mb is not None:
        parts.append(f"m{a.mb}")
    if a.peer is not None:
        parts.append(f"{'to' if a.op in _SENDS else 'from'} r{a.peer}")
    if a.root is not None:
        parts.append(f"root r{a.root}")
    if a.group is not None:
        parts.append(f"group {list(a.group)}")
    if a.buf is not None:
        parts.append(f"[{a.buf}]")
    if a.grad_buf is not None:
        parts.append(f"grad->[{a.grad_buf}]{' +=' if a.accumulate else ''}")
    if a.op in COMM_OPS:
        parts.append(f"{a.bytes} B")
    return " ".join(parts)


@dataclass(frozen=True)
class Plan:
    """One iteration of the schedule for every rank, plus what is needed to interpret it.

    ``num_slots`` counts slots 0..num_slots-1 (the last holds STEP); slot -1 is the prologue that
    loads the own chunk and stages the first weights. ``options`` records the build parameters
    (``layer_numel``, ``weight_bytes``, ``grad_bytes``, ``replicated_numel`` and, for TawPipe,
    ``grad_route``) so that byte counts can be checked and recomputed.
    """

    algo: str
    topology: Topology
    num_layers: int
    micro_batches: int
    chunk_layers: tuple[tuple[int, int], ...]
    owner: tuple[int, ...]
    num_slots: int
    actions: tuple[tuple[Action, ...], ...]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def model_order(self) -> tuple[int, ...]:
        """Chunk ids in the order a micro-batch's forward visits them."""
        return tuple(sorted(range(len(self.chunk_layers)), key=lambda k: self.chunk_layers[k][0]))

    def own_chunk(self, rank: int) -> int:
        return self.owner.index(rank)

    def chunk_numel(self, chunk: int) -> int:
        start, stop = self.chunk_layers[chunk]
        return (stop - start) * int(self.options.get("layer_numel", 1))

    def weight_message_bytes(self, chunk: int) -> int:
        return self.chunk_numel(chunk) * int(self.options.get("weight_bytes", 1))

    def grad_message_bytes(self, chunk: int) -> int:
        return self.chunk_numel(chunk) * int(self.options.get("grad_bytes", 1))

    def to_json(self, indent: int | None = None) -> str:
        """The plan as one JSON document; actions are a flat list, rank by rank, in list order."""
        doc = {
            "format": _JSON_FORMAT,
            "algo": self.algo,
            "topology": {"nodes": self.topology.nodes, "per_node": self.topology.per_node},
            "num_layers": self.num_layers,
            "micro_batches": self.micro_batches,
            "chunk_layers": [list(c) for c in self.chunk_layers],
            "owner": list(self.owner),
            "num_slots": self.num_slots,
            "options": self.options,
            "actions": [a.to_json() for acts in self.actions for a in acts],
        }
        return json.dumps(doc, indent=indent, ensure_ascii=False)

    @staticmethod
    def from_json(text: str) -> "Plan":
        doc = json.loads(text)
        if doc.get("format") != _JSON_FORMAT:
            raise ValueError(f"not a tawpipe plan (format {doc.get('format')!r}, expected {_JSON_FORMAT!r})")
        topo = Topology(**doc["topology"])
        per_rank: list[list[Action]] = [[] for _ in range(topo.world_size)]
        for d in doc["actions"]:
            a = Action.from_json(d)
            per_rank[a.rank].append(a)
        return Plan(
            algo=doc["algo"],
            topology=topo,
            num_layers=doc["num_layers"],
            micro_batches=doc["micro_batches"],
            chunk_layers=tuple((int(s), int(e)) for s, e in doc["chunk_layers"]),
            owner=tuple(doc["owner"]),
            num_slots=doc["num_slots"],
            actions=tuple(tuple(acts) for acts in per_rank),
            options=dict(doc["options"]),
        )

    def table(self) -> str:
        """Markdown table of the schedule in the notation of the spec's worked examples."""
        return _tawpipe_table(self) if self.algo == "tawpipe" else _weipipe_table(self)


# ---------------------------------------------------------------------------------- building


def build_plan(
    topology: Topology,
    num_layers: int,
    micro_batches: int,
    *,
    algo: str = "tawpipe",
    grad_route: str = "rail",
    layer_numel: int = 1,
    weight_bytes: int = 2,
    grad_bytes: int = 4,
    replicated_numel: int = 0,
) -> Plan:
    """Build the plan of one iteration (spec §3.4 for TawPipe, corrected §2.3 for WeiPipe).

    Chunks are balanced: the first ``num_layers mod N`` chunks hold one extra layer. Message
    sizes are layers x ``layer_numel`` x the dtype size of weights or gradients.
    """
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a Topology, got {type(topology).__name__}")
    n = topology.world_size
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if grad_route not in GRAD_ROUTES:
        raise ValueError(f"grad_route must be one of {GRAD_ROUTES}, got {grad_route!r}")
    for name, value, low in (
        ("num_layers", num_layers, 1), ("micro_batches", micro_batches, 1),
        ("layer_numel", layer_numel, 1), ("weight_bytes", weight_bytes, 1),
        ("grad_bytes", grad_bytes, 1), ("replicated_numel", replicated_numel, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if num_layers < n:
        raise ValueError(
            f"num_layers={num_layers} < world size {n}: every rank owns one chunk of at least one "
            f"layer; use at most {num_layers} ranks or a deeper model"
        )
    if algo == "weipipe" and n < 2:
        raise ValueError("weipipe needs a ring of at least 2 ranks")

    base, extra = divmod(num_layers, n)
    positions, start = [], 0
    for p in range(n):
        stop = start + base + (1 if p < extra else 0)
        positions.append((start, stop))
        start = stop
    if algo == "tawpipe":
        chunk_layers = tuple(positions)
        owner = tuple((k % topology.nodes) * topology.per_node + k // topology.nodes for k in range(n))
    else:
        chunk_layers = tuple(positions[(-x) % n] for x in range(n))
        owner = tuple(range(n))
    wbytes = [(e - s) * layer_numel * weight_bytes for s, e in chunk_layers]
    gbytes = [(e - s) * layer_numel * grad_bytes for s, e in chunk_layers]
    rbytes = replicated_numel * grad_bytes
    if algo == "tawpipe":
        slots, num_slots = _tawpipe_slots(topology, micro_batches, owner, wbytes, gbytes, rbytes, grad_route)
    else:
        slots, num_slots = _weipipe_slots(n, micro_batches, wbytes, gbytes, rbytes)
    options: dict[str, Any] = {
        "layer_numel": layer_numel, "weight_bytes": weight_bytes,
        "grad_bytes": grad_bytes, "replicated_numel": replicated_numel,
    }
    if algo == "tawpipe":
        options["grad_route"] = grad_route
    return Plan(
        algo=algo, topology=topology, num_layers=num_layers, micro_batches=micro_batches,
        chunk_layers=chunk_layers, owner=owner, num_slots=num_slots,
        actions=slots.project(n), options=options,
    )


# Phases of a slot, in global order. Every event is one P2P pair, one collective (all members'
# actions) or one local action; each rank's list is its projection of this global order, which
# makes the blocking execution deadlock-free by construction.
_FIRST, _LOAD, _P2P_A, _BCAST, _REDUCE, _P2P_B, _P2P_C, _COMPUTE, _ACC, _LAST = range(10)
_P2P_PHASES = (_P2P_A, _P2P_B, _P2P_C)


class _Slots:
    """Events per (slot, phase); ``project`` turns them into per-rank action lists."""

    def __init__(self) -> None:
        self._events: dict[int, list[list[tuple[Action, ...]]]] = {}

    def add(self, phase: int, *actions: Action) -> None:
        slot = actions[0].slot
        self._events.setdefault(slot, [[] for _ in range(_LAST + 1)])[phase].append(actions)

    def project(self, n: int) -> tuple[tuple[Action, ...], ...]:
        lists: list[list[Action]] = [[] for _ in range(n)]
        for slot in sorted(self._events):
            for phase, events in enumerate(self._events[slot]):
                if phase in _P2P_PHASES:
                    events = _in_rounds(events)
                for ev in events:
                    for a in ev:
                        lists[a.rank].append(a)
        return tuple(tuple(acts) for acts in lists)


def _in_rounds(pairs: list[tuple[Action, ...]]) -> list[tuple[Action, ...]]:
    """Order P2P pairs in rounds in which every rank appears at most once (greedy edge colouring).

    Under blocking semantics a round's pairs proceed in parallel: a ring becomes two or three
    rounds instead of a chain of N dependent transfers.
    """
    used: dict[int, set[int]] = {}
    keyed = []
    for idx, pair in enumerate(pairs):
        a, b = pair[0].rank, pair[1].rank
        ua, ub = used.setdefault(a, set()), used.setdefault(b, set())
        r = 0
        while r in ua or r in ub:
            r += 1
        ua.add(r)
        ub.add(r)
        keyed.append((r, idx, pair))
    keyed.sort(key=lambda t: (t[0], t[1]))
    return [pair for _, _, pair in keyed]


def _p2p(slot: int, src: int, dst: int, send: Op, recv: Op, chunk: int, sbuf: str, rbuf: str,
         nbytes: int) -> tuple[Action, Action]:
    return (Action(slot, src, send, chunk=chunk, peer=dst, buf=sbuf, bytes=nbytes),
            Action(slot, dst, recv, chunk=chunk, peer=src, buf=rbuf, bytes=nbytes))


def _collective(slot: int, op: Op, members: tuple[int, ...], root: int, chunk: int, buf: str,
                nbytes: int) -> tuple[Action, ...]:
    return tuple(Action(slot, r, op, chunk=chunk, root=root, group=members, buf=buf, bytes=nbytes)
                 for r in members)


def _tawpipe_slots(topo: Topology, acc: int, owner: tuple[int, ...], wbytes: list[int],
                   gbytes: list[int], rbytes: int, grad_route: str) -> tuple[_Slots, int]:
    """Spec §3.2-§3.4 with rail or leader gradient routing; degenerate groups skip collectives."""
    G, s, n = topo.nodes, topo.per_node, topo.world_size
    span = 2 * acc * n  # compute slots of one group
    step_slot = span + G  # after the last group's last gradient route (slot span + G - 1)
    everyone = tuple(range(n))
    out = _Slots()
    for r in everyone:
        out.add(_LOAD, Action(-1, r, Op.LOAD_W, chunk=owner.index(r), buf="w_own"))

    def fetch(slot: int, g: int, k: int, buf: str) -> None:
        members, o, nb = topo.group_ranks(g), owner[k], wbytes[k]
        if o // s == g:  # local chunk: the owner stages its own copy
            out.add(_LOAD, Action(slot, o, Op.LOAD_W, chunk=k, buf=buf))
            src = o
        else:  # remote chunk: rail-aligned P2P to the staging device with the owner's local index
            src = g * s + k // G
            out.add(_P2P_A, *_p2p(slot, o, src, Op.SEND_W, Op.RECV_W, k, "w_own", buf, nb))
        if s > 1:
            out.add(_BCAST, *_collective(slot, Op.BCAST_W, members, src, k, buf, nb))

    def route(slot: int, g: int, k: int, buf: str) -> None:
        members, o, nb = topo.group_ranks(g), owner[k], gbytes[k]
        if o // s == g:
            root = o
        else:
            root = g * s + (k // G if grad_route == "rail" else 0)
        if s > 1:
            out.add(_REDUCE, *_collective(slot, Op.REDUCE_G, members, root, k, buf, nb))
        if root == o:
            out.add(_ACC, Action(slot, o, Op.ACC_G, chunk=k, buf=buf))
        else:
            out.add(_P2P_B, *_p2p(slot, root, o, Op.SEND_G, Op.RECV_G, k, buf, "g_recv", nb))
            out.add(_ACC, Action(slot, o, Op.ACC_G, chunk=k, buf="g_recv"))

    for g in range(G):
        members = topo.group_ranks(g)
        resident, fetches, backwards, wbuf = None, 0, 0, ""
        for u in range(span):
            slot = g + u
            m, v = divmod(u, 2 * n)
            op, k = (Op.F, v) if v < n else (Op.B, 2 * n - 1 - v)
            if k != resident:  # not a turnaround: prefetch during the previous slot
                wbuf = f"w{fetches % 2}"
                fetches += 1
                fetch(slot - 1, g, k, wbuf)
                resident = k
            gbuf = None
            if op is Op.B:
                gbuf = f"g{backwards % 2}"
                backwards += 1
                route(slot + 1, g, k, gbuf)
            for r in members:
                out.add(_COMPUTE, Action(slot, r, op, chunk=k, mb=m, buf=wbuf, grad_buf=gbuf))
        for r in members:  # right after the group's last B (of chunk 0)
            out.add(_FIRST, Action(g + span, r, Op.ALLREDUCE_REPLICATED, group=everyone, bytes=rbytes))
    for r in everyone:
        out.add(_LAST, Action(step_slot, r, Op.STEP))
    return out, step_slot + 1


def _weipipe_slots(n: int, acc: int, wbytes: list[int], gbytes: list[int],
                   rbytes: int) -> tuple[_Slots, int]:
    """Corrected WeiPipe-Interleave (spec §2.3, §7.1): three same-direction rings w -> w+1.

    Step t = slot t. Ring transfers nobody consumes are dropped. Each chunk's gradient partial sum
    starts at worker 0 with a fresh buffer, collects one contribution per B, keeps moving along the
    ring until the last step and is then delivered by the exchange u <-> (N-1-u) mod N.
    """
    last = (acc + 2) * n - 2  # last compute step
    step_slot = last + 2
    everyone = tuple(range(n))
    out = _Slots()

    def f_active(w: int, t: int) -> bool:
        return w <= t < w + acc * n

    def b_active(w: int, t: int) -> bool:
        return w + n <= t < w + n + acc * n

    def fbuf(t: int) -> str:
        return "w_own" if t % n == 0 else _WEIPIPE_F_BUFS[t % 2]

    def bbuf(t: int) -> str:
        return _WEIPIPE_B_BUFS[t % 2]

    # need_x[t][w]: worker w must hold its ring's chunk at step t (it uses it or passes it on).
    need_f = [[False] * n for _ in range(last + 2)]
    need_b = [[False] * n for _ in range(last + 2)]
    for t in range(last, -1, -1):
        for w in range(n):
            nxt = (w + 1) % n
            need_f[t][w] = f_active(w, t) or ((t + 1) % n != 0 and need_f[t + 1][nxt])
            need_b[t][w] = t >= n and (b_active(w, t) or need_b[t + 1][nxt])

    for r in everyone:
        out.add(_LOAD, Action(-1, r, Op.LOAD_W, chunk=r, buf="w_own"))
    for w in range(n):  # B-ring seed: w <-> (N+1-w) mod N, for use at step N
        if need_b[n][w]:
            c = (1 - w) % n
            if c == w:
                out.add(_LOAD, Action(n - 1, w, Op.LOAD_W, chunk=c, buf=bbuf(n)))
            else:
                out.add(_P2P_C, *_p2p(n - 1, c, w, Op.SEND_W, Op.RECV_W, c, "w_own", bbuf(n), wbytes[c]))

    tokens: list[int | None] = [None] * n  # chunk of the partial sum each worker holds
    for t in range(last + 1):
        arriving = [tokens[(w - 1) % n] for w in range(n)]
        for w in range(n):
            nxt = (w + 1) % n
            if t < last and (t + 1) % n != 0 and need_f[t + 1][nxt]:
                c = (w - t) % n
                out.add(_P2P_B, *_p2p(t, w, nxt, Op.SEND_W, Op.RECV_W, c, fbuf(t), fbuf(t + 1), wbytes[c]))
            if t >= n and t < last and need_b[t + 1][nxt]:
                c = (t - w + 1) % n
                out.add(_P2P_C, *_p2p(t, w, nxt, Op.SEND_W, Op.RECV_W, c, bbuf(t), bbuf(t + 1), wbytes[c]))
            inc = arriving[w]
            if inc is not None:  # the partial sum from w-1's step t-1 arrives for this step
                prev = (w - 1) % n
                out.add(_P2P_A, *_p2p(t, prev, w, Op.SEND_G, Op.RECV_G, inc, f"g{(t - 1) % 2}",
                                      f"g{t % 2}", gbytes[inc]))
            if b_active(w, t):
                c = (t - w + 1) % n
                if inc is not None and inc != c:
                    raise AssertionError(f"gradient ring out of step at worker {w}, step {t}")
                out.add(_COMPUTE, Action(t, w, Op.B, chunk=c, mb=(t - w - n) // n, buf=bbuf(t),
                                         grad_buf=f"g{t % 2}", accumulate=inc is not None))
                tokens[w] = c
            else:
                tokens[w] = inc
            if f_active(w, t):
                out.add(_COMPUTE, Action(t, w, Op.F, chunk=(w - t) % n, mb=(t - w) // n, buf=fbuf(t)))
    final = last + 1  # each worker u holds the complete sum of chunk (-1-u) mod N
    for u, c in enumerate(tokens):
        if c is None:
            raise AssertionError(f"worker {u} holds no gradient at the end of the ring")
        if c == u:
            out.add(_ACC, Action(final, u, Op.ACC_G, chunk=c, buf=f"g{last % 2}"))
        else:
            out.add(_P2P_A, *_p2p(final, u, c, Op.SEND_G, Op.RECV_G, c, f"g{last % 2}", "g_recv", gbytes[c]))
            out.add(_ACC, Action(final, c, Op.ACC_G, chunk=c, buf="g_recv"))
    for w in range(n):  # right after the worker's last B (of chunk 0)
        out.add(_FIRST, Action(w + n + acc * n, w, Op.ALLREDUCE_REPLICATED, group=everyone, bytes=rbytes))
    for r in everyone:
        out.add(_LAST, Action(step_slot, r, Op.STEP))
    return out, step_slot + 1


# ---------------------------------------------------------------------------------- tables


def _by_slot(plan: Plan) -> list[dict[int, list[Action]]]:
    per_rank: list[dict[int, list[Action]]] = []
    for acts in plan.actions:
        d: dict[int, list[Action]] = {}
        for a in acts:
            d.setdefault(a.slot, []).append(a)
        per_rank.append(d)
    return per_rank


def _tawpipe_table(plan: Plan) -> str:
    topo, acc = plan.topology, plan.micro_batches
    per_rank = _by_slot(plan)
    head = ["slot"]
    for g in range(topo.nodes):
        ranks = topo.group_ranks(g)
        listed = ", ".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]}–{ranks[-1]}"
        head.append(f"group {g} ({'rank' if len(ranks) == 1 else 'ranks'} {listed})")
    lines = [_row(head), "|" + "---|" * len(head)]
    for slot in range(-1, plan.num_slots - 1):
        row = ["−1" if slot == -1 else str(slot)]
        for g in range(topo.nodes):
            acts = [a for r in topo.group_ranks(g) for a in per_rank[r].get(slot, ())]
            row.append("; ".join(_tawpipe_cell(acts, slot, acc)))
        lines.append(_row(row))
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return "|" + "".join(f" {c} |" if c else " |" for c in cells)


def _tawpipe_cell(acts: list[Action], slot: int, acc: int) -> list[str]:
    first = {op: next((a for a in acts if a.op is op), None) for op in (Op.BCAST_W, Op.REDUCE_G)}
    comp = next((a for a in acts if a.op in (Op.F, Op.B)), None)
    parts = []
    if slot >= 0:
        parts.append("idle" if comp is None else
                     f"**{comp.op.value}{comp.chunk}**" + (f"(m{comp.mb})" if acc > 1 else ""))
    staged = set()
    for a in acts:
        if a.op is Op.RECV_W:
            parts.append(f"P2P W{a.chunk} r{a.peer}→r{a.rank}")
            staged.add(a.rank)
    bcast = first[Op.BCAST_W]
    if bcast is not None:
        parts.append(f"bcast from r{bcast.root}" if bcast.root in staged
                     else f"bcast W{bcast.chunk} from r{bcast.root}")
    elif not staged:
        parts += [f"load W{a.chunk} on r{a.rank}" for a in acts if a.op is Op.LOAD_W and a.buf != "w_own"]
    reduce = first[Op.REDUCE_G]
    if reduce is not None:
        parts.append(f"reduce G{reduce.chunk}→r{reduce.root}")
    for a in acts:
        if a.op is Op.SEND_G:
            parts.append(f"P2P G{a.chunk} r{a.rank}→r{a.peer}")
    if reduce is None:
        parts += [f"acc G{a.chunk} on r{a.rank}" for a in acts if a.op is Op.ACC_G and a.buf != "g_recv"]
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
                if a.op in _RECVS:
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
                    if rbuf in _WEIPIPE_F_BUFS:
                        sends.append(f"f{a.chunk}")
                    elif a.buf == "w_own":
                        sends.append(f"seed W{a.chunk}→{a.peer}")
                    else:
                        sends.append(f"b{a.chunk}")
                elif a.op is Op.SEND_G:
                    final = recv_bufs[(Op.RECV_G, w, a.peer)].popleft() == "g_recv"
                    sends.append(f"final G{a.chunk}→{a.peer}" if final else f"g{a.chunk}")
            if sends:
                words.append("⇒ " + ",".join(sends))
            row.append(" ".join(words))
        lines.append(_row(row))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` established about a plan (all of it, or it would have raised)."""

    actions: int
    p2p_messages: int
    collectives: int
    weight_buffers: int  # max distinct weight buffer names on one rank, w_own included
    grad_buffers: int  # max distinct gradient buffer names on one rank, g_recv included
    contributions: int  # gradient contributions that reached their owners (N x N x acc)


class _Content:
    """Symbolic content of a buffer: a weight chunk, or a multiset of gradient contributions."""

    __slots__ = ("chunk", "items", "consumed", "writer")

    def __init__(self, chunk: int, items: tuple | None, writer: Action) -> None:
        self.chunk, self.items, self.consumed, self.writer = chunk, items, False, writer


def verify(plan: Plan) -> VerifyReport:
    """Execute ``plan`` symbolically and raise ``PlanError`` on the first thing that is wrong.

    Checks: labels of weights and gradients flow correctly through every buffer; compute order;
    send/receive and collective matching; deadlock freedom of the main channel under blocking
    semantics; no pending gradient is overwritten; every owner accumulates exactly its N x acc
    contributions; TawPipe uses at most 3 weight buffers per rank.
    """
    _check_static(plan)
    n, acc = plan.topology.world_size, plan.micro_batches
    main = [[a for a in acts if a.op is not Op.ALLREDUCE_REPLICATED] for acts in plan.actions]
    bufs: list[dict[str, _Content]] = [{} for _ in range(n)]
    accum: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    computes: list[list[Action]] = [[] for _ in range(n)]
    counts = {"p2p": 0, "coll": 0}

    def fail(a: Action, msg: str) -> PlanError:
        return PlanError(f"{describe(a)}: {msg}")

    def weight(a: Action, name: str) -> None:
        c = bufs[a.rank].get(name)
        if c is None:
            raise fail(a, f"reads [{name}], which was never written")
        if c.items is not None:
            raise fail(a, f"reads [{name}] as weights but it holds gradients of chunk {c.chunk}")
        if c.chunk != a.chunk:
            raise fail(a, f"reads [{name}] holding W{c.chunk} (written by {describe(c.writer)}), "
                          f"expected W{a.chunk}")

    def grad(a: Action, name: str) -> _Content:
        c = bufs[a.rank].get(name)
        if c is None:
            raise fail(a, f"reads [{name}], which was never written")
        if c.items is None:
            raise fail(a, f"reads [{name}] as a gradient but it holds weights W{c.chunk}")
        if c.chunk != a.chunk:
            raise fail(a, f"reads [{name}] holding the gradient of chunk {c.chunk} "
                          f"(written by {describe(c.writer)}), expected chunk {a.chunk}")
        if c.consumed:
            raise fail(a, f"reads [{name}] whose gradient was already passed on: it would count twice")
        return c

    def overwrite(a: Action, name: str) -> None:
        c = bufs[a.rank].get(name)
        if c is not None and c.items is not None and not c.consumed:
            raise fail(a, f"overwrites [{name}] while it still holds the pending gradient of chunk "
                          f"{c.chunk} (written by {describe(c.writer)})")

    def compute(a: Action) -> None:
        r = a.rank
        if a.op is Op.LOAD_W:
            if plan.owner[a.chunk] != r:
                raise fail(a, f"loads W{a.chunk} but the rank owns W{plan.own_chunk(r)}")
            bufs[r][a.buf] = _Content(a.chunk, None, a)
        elif a.op is Op.F:
            weight(a, a.buf)
            computes[r].append(a)
        elif a.op is Op.B:
            weight(a, a.buf)
            computes[r].append(a)
            mine = ((a.chunk, r, a.mb),)
            if a.accumulate:
                c = grad(a, a.grad_buf)
                bufs[r][a.grad_buf] = _Content(a.chunk, c.items + mine, a)
            else:
                overwrite(a, a.grad_buf)
                bufs[r][a.grad_buf] = _Content(a.chunk, mine, a)
        elif a.op is Op.ACC_G:
            if plan.owner[a.chunk] != r:
                raise fail(a, f"accumulates chunk {a.chunk} but the rank owns chunk {plan.own_chunk(r)}")
            c = grad(a, a.buf)
            c.consumed = True
            accum[r].extend(c.items)

    def pair(s: Action, d: Action) -> None:
        if (s.op, d.op) not in ((Op.SEND_W, Op.RECV_W), (Op.SEND_G, Op.RECV_G)):
            raise fail(s, f"is matched by {describe(d)}")
        if (s.slot, s.chunk, s.bytes) != (d.slot, d.chunk, d.bytes):
            raise fail(s, f"is matched by {describe(d)}: slot, chunk or bytes differ")
        if s.op is Op.SEND_W:
            weight(s, s.buf)
            bufs[d.rank][d.buf] = _Content(s.chunk, None, d)
        else:
            c = grad(s, s.buf)
            overwrite(d, d.buf)
            c.consumed = True
            bufs[d.rank][d.buf] = _Content(c.chunk, c.items, d)
        counts["p2p"] += 1

    def collective(acts: list[Action]) -> None:
        a0 = acts[0]
        key = (a0.op, a0.slot, a0.chunk, a0.root, a0.bytes, a0.buf)
        for a in acts[1:]:
            if (a.op, a.slot, a.chunk, a.root, a.bytes, a.buf) != key:
                raise fail(a, f"meets {describe(a0)} in the same collective: they differ")
        root = next(a for a in acts if a.rank == a0.root)
        if a0.op is Op.BCAST_W:
            weight(root, root.buf)
            for a in acts:
                if a.rank != a0.root:
                    bufs[a.rank][a.buf] = _Content(a0.chunk, None, a)
        else:
            items: tuple = ()
            for a in acts:
                c = grad(a, a.buf)
                items += c.items
                c.consumed = True
            bufs[root.rank][root.buf] = _Content(a0.chunk, items, root)
        counts["coll"] += 1

    # Blocking execution of the main channel: run each rank until its next comm action blocks.
    pcs, waiting = [0] * n, [None] * n
    arrived: Counter[tuple[int, ...]] = Counter()
    work = deque(range(n))
    while work:
        r = work.popleft()
        acts = main[r]
        while pcs[r] < len(acts):
            a = acts[pcs[r]]
            if a.op in COMPUTE_OPS:
                compute(a)
                pcs[r] += 1
                continue
            waiting[r] = a
            if a.op in _SENDS or a.op in _RECVS:
                b = waiting[a.peer]
                if b is None or b.peer != r or (b.op in _SENDS) == (a.op in _SENDS):
                    break
                if a.op in _SENDS:
                    pair(a, b)
                else:
                    pair(b, a)
                waiting[r] = waiting[a.peer] = None
                pcs[r] += 1
                pcs[a.peer] += 1
                work.append(a.peer)
                continue
            arrived[a.group] += 1
            if arrived[a.group] < len(a.group):
                break
            arrived[a.group] = 0
            collective([waiting[m] for m in a.group])
            for m in a.group:
                waiting[m] = None
                pcs[m] += 1
                if m != r:
                    work.append(m)
    stuck = [waiting[r] or main[r][pcs[r]] for r in range(n) if pcs[r] < len(main[r])]
    if stuck:
        shown = "; ".join(describe(a) for a in stuck[:8])
        raise PlanError(f"deadlock: {len(stuck)} ranks blocked, e.g. {shown}")

    _check_compute_order(plan, computes)
    for r in range(n):
        k = plan.own_chunk(r)
        expected = Counter((k, d, m) for d in range(n) for m in range(acc))
        got = Counter(accum[r])
        if got != expected:
            missing = sorted((expected - got).elements())[:4]
            extra = sorted((got - expected).elements())[:4]
            raise PlanError(
                f"rank {r} (owner of chunk {k}) accumulated {sum(got.values())} gradient "
                f"contributions instead of {n * acc}; missing (chunk, device, mb) {missing}, "
                f"unexpected or duplicated {extra}"
            )
    wmax = max(len({a.buf for a in acts if a.op in _WEIGHT_OPS}) for acts in plan.actions)
    gmax = max(len({a.grad_buf if a.op is Op.B else a.buf for a in acts
                    if a.op is Op.B or a.op in _GRAD_OPS}) for acts in plan.actions)
    if plan.algo == "tawpipe" and wmax > 3:
        raise PlanError(f"a rank uses {wmax} weight buffers; TawPipe needs at most 3 (w_own + 2)")
    return VerifyReport(
        actions=sum(len(acts) for acts in plan.actions), p2p_messages=counts["p2p"],
        collectives=counts["coll"], weight_buffers=wmax, grad_buffers=gmax,
        contributions=sum(len(x) for x in accum),
    )


def _check_static(plan: Plan) -> None:
    """Shape of the plan and of every action, and the replicated all-reduce / STEP placement."""
    topo, n, acc = plan.topology, plan.topology.world_size, plan.micro_batches
    if plan.algo not in ALGOS:
        raise PlanError(f"unknown algo {plan.algo!r}")
    if len(plan.actions) != n or len(plan.owner) != n or len(plan.chunk_layers) != n:
        raise PlanError(f"need one action list, one owner and one chunk per rank (N={n}), got "
                        f"{len(plan.actions)}, {len(plan.owner)}, {len(plan.chunk_layers)}")
    if sorted(plan.owner) != list(range(n)):
        raise PlanError(f"owner {plan.owner} is not a permutation of the ranks")
    pos = 0
    for k in plan.model_order:
        start, stop = plan.chunk_layers[k]
        if start != pos or stop <= start:
            raise PlanError(f"chunk_layers {plan.chunk_layers} do not tile 0..{plan.num_layers} in order")
        pos = stop
    if pos != plan.num_layers:
        raise PlanError(f"chunk_layers {plan.chunk_layers} do not cover {plan.num_layers} layers")
    has_sizes = "layer_numel" in plan.options
    rep_bytes = int(plan.options.get("replicated_numel", 0)) * int(plan.options.get("grad_bytes", 1))
    everyone = tuple(range(n))

    def fail(a: Action, msg: str) -> PlanError:
        return PlanError(f"{describe(a)}: {msg}")

    for r, acts in enumerate(plan.actions):
        prev_slot = -1
        allreduce = [i for i, a in enumerate(acts) if a.op is Op.ALLREDUCE_REPLICATED]
        steps = [i for i, a in enumerate(acts) if a.op is Op.STEP]
        backs = [i for i, a in enumerate(acts) if a.op is Op.B]
        if len(allreduce) != 1:
            raise PlanError(f"rank {r} has {len(allreduce)} ALLREDUCE_REPLICATED actions, expected 1")
        if steps != [len(acts) - 1]:
            raise PlanError(f"rank {r} must end with exactly one STEP (found at {steps} of {len(acts)})")
        if backs and allreduce[0] < backs[-1]:
            raise fail(acts[allreduce[0]], "comes before the rank's last B")
        for a in acts:
            if a.rank != r:
                raise fail(a, f"is in the list of rank {r}")
            if not -1 <= a.slot < plan.num_slots or a.slot < prev_slot:
                raise fail(a, f"slot out of order or outside -1..{plan.num_slots - 1}")
            prev_slot = a.slot
            if a.op is Op.STEP:
                continue
            if a.op is Op.ALLREDUCE_REPLICATED:
                if a.group != everyone or a.bytes != rep_bytes:
                    raise fail(a, f"must span all ranks with {rep_bytes} bytes")
                continue
            if a.chunk is None or not 0 <= a.chunk < n or a.buf is None:
                raise fail(a, "needs a valid chunk and a buffer")
            if a.op in (Op.F, Op.B):
                if a.mb is None or not 0 <= a.mb < acc:
                    raise fail(a, f"micro-batch outside 0..{acc - 1}")
                if a.op is Op.B and a.grad_buf is None:
                    raise fail(a, "has no grad_buf")
            elif a.op in _SENDS or a.op in _RECVS:
                if a.peer is None or not 0 <= a.peer < n or a.peer == r:
                    raise fail(a, "needs a peer rank other than itself")
            elif a.op in _COLLECTIVES:
                g = topo.group_of(r)
                if a.group != topo.group_ranks(g) or a.root not in a.group:
                    raise fail(a, f"must span exactly group {g} {list(topo.group_ranks(g))} with a root in it")
            if has_sizes and a.op in COMM_OPS:
                sized = plan.weight_message_bytes if a.op in _WEIGHT_OPS else plan.grad_message_bytes
                want = sized(a.chunk)
                if a.bytes != want:
                    raise fail(a, f"carries {a.bytes} bytes, chunk {a.chunk} needs {want}")


def _check_compute_order(plan: Plan, computes: list[list[Action]]) -> None:
    """Per micro-batch: forward in model order, then backward in reverse, all micro-batches."""
    order = plan.model_order
    for r, acts in enumerate(computes):
        fwd: dict[int, list[int]] = {}
        bwd: dict[int, list[int]] = {}
        first_b: dict[int, Action] = {}
        for a in acts:
            if a.op is Op.F:
                if a.mb in first_b:
                    raise PlanError(f"{describe(a)}: forward after the backward of micro-batch {a.mb} began")
                fwd.setdefault(a.mb, []).append(a.chunk)
            else:
                first_b.setdefault(a.mb, a)
                bwd.setdefault(a.mb, []).append(a.chunk)
        for m in range(plan.micro_batches):
            if fwd.get(m) != list(order):
                raise PlanError(f"rank {r} micro-batch {m}: forward visits chunks {fwd.get(m)}, "
                                f"expected {list(order)}")
            if bwd.get(m) != list(reversed(order)):
                raise PlanError(f"rank {r} micro-batch {m}: backward visits chunks {bwd.get(m)}, "
                                f"expected {list(reversed(order))}")

