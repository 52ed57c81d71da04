"""The two execution models of ``verify``, simulated (design §5.3): the serial one (every rank
one action at a time, each transfer blocking until its peers take part) and the channel one (the
engine with overlap: compute in list order, one in-order queue per channel whose units wait for
their dataflow dependencies).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .actions import OPS, Action, Channel, Op, PlanError, batch_end, describe

if TYPE_CHECKING:
    from .verify import Verifier

_SENDS = frozenset(op for op, s in OPS.items() if s.transfer == "send")
_LOCAL, _MESSAGE, _COLLECTIVE = 0, 1, 2  # how an op moves bytes, as the simulation asks it
_HOW = {op: _LOCAL if s.transfer is None else _MESSAGE if s.is_p2p else _COLLECTIVE for op, s in OPS.items()}
_CHANNEL = {op: s.channel for op, s in OPS.items()}


class _Rank:
    """Where one rank's simulation stands.

    Its units are consumed in list order by its *driver* (the compute thread): ``pc`` is the first
    action of the next unit the driver has not reached. A unit on the driver runs there, blocking
    it (``cur``, once reached); a unit of a queued lane joins that lane's queue, and the driver moves
    on. A unit is a list ``[pos, end, waits, reads, writes, index, lane]``: its next action and the
    end of its actions; what it waits for (None, or ``(lane, index)`` pairs: that lane's unit
    ``index`` must be done); the names its actions read and write (bits); its index in its lane, and
    its lane. Lanes finish their units in order, so ``done[lane]`` is all there is to know of the
    past. The driver's lane (0) is never waited for: its units are done when the driver goes on."""

    __slots__ = ("acts", "pc", "cur", "queues", "done", "count", "pending", "parked", "colls")

    def __init__(self, acts: tuple[Action, ...], lanes: int) -> None:
        self.acts = acts
        self.pc = 0
        self.cur: list | None = None  # the driver's unit, once reached and until done
        self.queues: list[deque[list]] = [deque() for _ in range(lanes)]  # [0], the driver's, stays empty
        self.done = [0] * lanes  # units finished per queued lane
        self.count = [0] * lanes  # units reached per queued lane
        self.pending = 0  # units queued and not finished, on every lane
        self.parked = [False] * lanes  # the lane's unit waits at a collective not every member has reached
        self.colls: dict[int, int] = {}  # collectives finished per (channel, group), by its id


def _ready(done: list[int], waits: tuple[tuple[int, int], ...]) -> bool:
    for lane, index in waits:
        if done[lane] <= index:
            return False
    return True


class _Simulation:
    """Runs units of actions per rank until everything has finished or nothing can move.

    A rank's units are consumed in order by its *driver* (the compute thread). Units on the
    channels in ``inline`` run on the driver, blocking it; the others go to their channel's queue
    and the driver moves on. A queued unit starts when its dependencies (units of the same rank)
    are done. Its transfers complete one at a time: a send meets the matching receive at the head
    of the peer's queue on the same channel; a collective completes when every member is at it.
    In the serial model the simulation also tracks buffer contents (``Verifier``); in the channel
    model it only checks that transfers pair up and that nothing deadlocks.

    **Dependencies.** ``Hazards`` makes a unit wait for the last writer of every name it touches
    and for the readers since of every name it writes. Here a unit waits, from the moment the
    driver reaches it, for the queued units not yet finished that *conflict* with it: that write a
    name it touches, or read a name it writes. The two waits end together (design §5.3). Every unit
    ``Hazards`` names conflicts, and is finished or queued when the driver gets there (the driver
    finishes its own units before it moves on); a conflicting unit it does not name is followed,
    before the unit, by a writer of that name that waited for it and that the unit waits for, and
    by induction over the list that writer is done only after it. So the units already done need no
    record, and while nothing is queued on a rank (in the serial model, nearly always) its units
    need not even be asked which names they touch.

    The order in which ranks move decides which of several faults is reported first, so it is
    kept as plain as above; what makes it fast is only that a failed try is not repeated while
    it must fail again: a unit at a collective not every member has reached is *parked* until the
    last one comes.
    """

    def __init__(self, v: Verifier, inline: frozenset[Channel], batched: bool, contents: bool) -> None:
        self.v, self.contents, self.batched = v, contents, batched
        queues = [c for c in Channel if c not in inline]
        lane = {c: 0 if c in inline else 1 + queues.index(c) for c in Channel}
        self.lane = {op: lane[s.channel] for op, s in OPS.items()}  # 0: the driver
        self.lanes = range(1, 1 + len(queues))
        # how an op moves bytes where it is a unit of its own on the driver (None: it is not)
        self.free = {op: None if self.lane[op] or (batched and _HOW[op] == _MESSAGE) else _HOW[op] for op in OPS}
        self.ranks = [_Rank(acts, 1 + len(queues)) for acts in v.plan.actions[:v.n]]
        self.arrived: dict[tuple[int, int], dict[int, list]] = {}  # per collective: who reached it, in which unit
        # per op, a group -> (id of its channel and group, its simulated members)
        self.groups: dict[Op, dict[tuple[int, ...], tuple[int, tuple[int, ...]]]] = {op: {} for op in OPS}
        self.cids: dict[tuple[Channel, tuple[int, ...]], int] = {}
        self.work: deque[int] = deque()  # ranks that may move
        self.queued = [False] * len(self.ranks)  # whether a rank is in ``work``

    def run(self, model: str) -> None:
        n = len(self.ranks)
        work, queued, advance = self.work, self.queued, self._advance
        work.extend(range(n))
        queued[:] = [True] * n
        while work:
            r = work.popleft()
            queued[r] = False
            advance(r)
        stuck = []
        for rk in self.ranks:
            heads = [q[0][0] for q in rk.queues if q]
            if rk.cur is not None:
                heads.append(rk.cur[0])
            elif rk.pc < len(rk.acts):
                heads.append(rk.pc)
            if heads:  # the first unit not done, at its next action
                stuck.append(rk.acts[min(heads)])
        if stuck:
            shown = "; ".join(describe(a) for a in stuck[:8])
            raise PlanError(f"deadlock in the {model} model: {len(stuck)} ranks blocked, e.g. {shown}")

    def _wake(self, r: int) -> None:
        if not self.queued[r]:
            self.queued[r] = True
            self.work.append(r)

    def _reach(self, rk: _Rank) -> list:
        """The unit at the driver's ``pc``: its actions, and what it waits for."""
        acts, pc = rk.acts, rk.pc
        op = acts[pc].op
        end = batch_end(acts, pc) if self.batched and _HOW[op] == _MESSAGE else pc + 1
        lane = self.lane[op]
        reads = writes = 0
        waits = None
        if rk.pending or lane:  # names are needed to wait for a queued unit, or to be waited for
            masks = self.v.masks
            for i in range(pc, end):
                rm, wm = masks(acts[i])
                reads |= rm
                writes |= wm
            if rk.pending:
                touched, queues = reads | writes, rk.queues
                for other in self.lanes:
                    q = queues[other]
                    if q and other != lane:  # its own lane is in order anyway
                        for u in reversed(q):  # the last unfinished one it conflicts with
                            if touched & u[4] or writes & u[3]:
                                waits = (*(waits or ()), (other, u[5]))
                                break
        unit = [pc, end, waits, reads, writes, rk.count[lane], lane]
        rk.count[lane] += 1
        rk.pc = end
        return unit

    def _advance(self, r: int) -> None:
        """Move rank r as far as it can go, waking the ranks that may now move too."""
        rk = self.ranks[r]
        acts, parked = rk.acts, rk.parked
        n, free, contents, local, gather = len(acts), self.free, self.contents, self.v._local, self._gather
        while True:
            u = rk.cur
            if u is not None and u[0] >= u[1]:  # finished by its peers since this rank last moved
                rk.cur = u = None
            while True:  # the driver, until it blocks
                if u is None:
                    pc = rk.pc
                    if pc >= n:
                        break
                    a = acts[pc]
                    how = free[a.op] if not rk.pending else None
                    if how == _LOCAL:  # a local action on the driver, and nothing to wait for
                        if contents:
                            local(a)
                        rk.pc = pc + 1
                        continue
                    if how is not None:  # one transfer on the driver, nothing to wait for: no names needed
                        rk.cur = u = [pc, pc + 1, None, 0, 0, 0, 0]
                        rk.pc = pc + 1
                        if not (gather(r, u, a) if how == _COLLECTIVE else self._meet(r, u, a)):
                            break
                        rk.cur = u = None
                        continue
                    u = self._reach(rk)
                    if u[6]:
                        rk.queues[u[6]].append(u)
                        rk.pending += 1
                        u = None
                        continue
                    rk.cur = u
                waits = u[2]
                if waits is not None:
                    if not _ready(rk.done, waits):
                        break
                    u[2] = None
                if parked[0] or not self._run(rk, r, u):
                    break
                rk.cur = u = None
            if not rk.pending:
                return
            progress = False
            queues, done = rk.queues, rk.done
            for lane in self.lanes:  # the channels
                q = queues[lane]
                while q:
                    u = q[0]
                    waits = u[2]
                    if waits is not None:
                        if not _ready(done, waits):
                            break
                        u[2] = None
                    if parked[lane] or not self._run(rk, r, u):
                        break
                    q.popleft()
                    done[lane] += 1
                    rk.pending -= 1
                    progress = True
            if not progress:  # the driver waits for nothing that moved
                return

    def _run(self, rk: _Rank, r: int, u: list) -> bool:
        """Run unit u of rank r (``rk``) as far as peers allow; True once all of it is done."""
        acts, end = rk.acts, u[1]
        i = u[0]
        while i < end:
            a = acts[i]
            how = _HOW[a.op]
            if how == _LOCAL:
                if self.contents:
                    self.v._local(a)
                u[0] = i = i + 1
            elif self._meet(r, u, a) if how == _MESSAGE else self._gather(r, u, a):
                i = u[0]
            else:
                return False
        return True

    def _head(self, r: int, lane: int) -> list | None:
        """The unit where rank r waits on ``lane``, if it waits there: reached, at the head of
        its lane, its dependencies done, and not finished (else its rank has yet to notice)."""
        rk = self.ranks[r]
        if lane:
            q = rk.queues[lane]
            if not q:
                return None
            u = q[0]
        else:
            u = rk.cur
            if u is None:
                return None
        waits = u[2]
        if waits is not None:
            if not _ready(rk.done, waits):
                return None
            u[2] = None
        return u if u[0] < u[1] else None

    def _meet(self, r: int, u: list, a: Action) -> bool:
        peer = a.peer
        pu = self._head(peer, u[6])  # type: ignore[arg-type]
        if pu is None:
            return False
        b = self.ranks[peer].acts[pu[0]]  # type: ignore[index]
        if b.peer != r or _HOW[b.op] != _MESSAGE or (a.op in _SENDS) == (b.op in _SENDS):
            return False
        s, d = (a, b) if a.op in _SENDS else (b, a)
        if self.contents:
            self.v._transfer(s, d)
        else:
            self.v._pair(s, d)
        u[0] += 1
        pu[0] += 1
        self._wake(peer)  # type: ignore[arg-type]
        return True

    def _gather(self, r: int, u: list, a: Action) -> bool:
        groups = self.groups[a.op]
        g = groups.get(a.group)  # type: ignore[arg-type]
        if g is None:
            g = groups[a.group] = self._group(a)  # type: ignore[index]
        cid, group = g
        ranks = self.ranks
        colls = ranks[r].colls
        key = (cid, colls.get(cid, 0))  # this rank's next collective of the group on the channel
        members = self.arrived.get(key)
        if members is None:
            members = self.arrived[key] = {}
        members[r] = u  # a member's unit stays at the head of its lane until the collective completes
        lane = u[6]
        if len(members) < len(group):  # parked: trying again fails until the last member comes
            ranks[r].parked[lane] = True
            return False
        for m in members:
            ranks[m].parked[lane] = False
        heads = [members.get(m) for m in group]
        if None in heads:  # a rank outside the group came instead
            return False
        acts = [ranks[m].acts[h[0]] for m, h in zip(group, heads)]  # type: ignore[index]
        if self.contents:
            self.v._collective(acts)
        else:
            self.v._check_collective(acts)
        del self.arrived[key]
        work, queued = self.work, self.queued
        for m, h in zip(group, heads):
            h[0] += 1  # type: ignore[index]
            colls = ranks[m].colls
            colls[cid] = colls.get(cid, 0) + 1
            if not queued[m]:
                queued[m] = True
                work.append(m)
        return True

    def _group(self, a: Action) -> tuple[int, tuple[int, ...]]:
        """(id, simulated members) of a's group on a's channel; every replica's copy of a collective
        reaches it with the members simulated."""
        channel = _CHANNEL[a.op]
        cid = self.cids.setdefault((channel, a.group), len(self.cids))
        return cid, tuple(m for m in a.group if m < len(self.ranks))  # type: ignore[union-attr]
