"""How a schedule writes its plan: events per (slot, phase), projected onto every rank.

A schedule (``tawpipe.plan.registry.Schedule``) emits *events* per (slot, phase): one
point-to-point pair, one collective (all members' actions) or one local action. Each rank's
action list is its projection of that single global order, which is what makes a blocking
execution deadlock-free by construction (design §5.3).
"""

from __future__ import annotations

import enum

from .actions import OPS, Action, Channel, Op, _new, _Unfrozen, new_action
from .plan import STATS_BYTES

_READY, _COLLECTIVE, _COMPUTES, _SEND, _RECV = range(5)  # what an event holds (see Events)


class Events:
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
    """Rank r's actions, from its share of the events (see ``Events.project``). Each is made as
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


def finish(events: Events, phase: enum.IntEnum, stats_phase: enum.IntEnum, n: int, slot: int) -> None:
    """The step's statistics (one collective) and the optimizer step, which close every plan."""
    everyone = tuple(range(n))
    events.collective(stats_phase, slot, Op.ALLREDUCE_STATS, everyone, None, None, None, STATS_BYTES)
    for r in everyone:
        events.add(phase, new_action(slot, r, Op.STEP))
