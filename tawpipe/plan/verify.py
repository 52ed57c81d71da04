"""Proof by execution that a plan is right: ``verify(plan)`` raises ``PlanError`` or returns a report.

The verifier runs the plan symbolically in two execution models (design §5.3):

* **serial**: every rank runs its actions one at a time, each transfer blocking until its peers
  take part (the replicated all-reduce excepted, which always has its own channel). This is the
  engine with ``overlap=False`` and any backend whose batches run one transfer at a time. Buffers
  hold symbolic contents (which chunk's weights; which (chunk, device, micro-batch) gradient
  contributions), so every compute is checked to see the right weights and every owner to
  accumulate exactly its N x acc contributions.
* **channels**: what the engine runs with overlap: compute in list order on one thread, and
  one in-order queue per channel (design §5.1) whose units wait for the dataflow dependencies of
  ``plan.Hazards``. Point-to-point batches are modelled one transfer at a time, the strictest
  reading. This model proves the engine cannot deadlock; contents need no second check, because
  dataflow order gives every action the same inputs as list order does.

The channel model is simulated too on plans of at most ``CHANNEL_ACTIONS`` simulated actions,
every plan the engine proves itself among them. Above, its liveness is derived from the serial
run (design §5.3): where no message touches a name the serial model queues, the order in which
the serial run completes actions is a run of the channel model, and every run of that model ends
alike. Where that condition fails, the channel model is simulated whatever the size.

A plan of R replicas (design §3.5) is proven on replica 0 alone unless ``exhaustive``: every other
replica's lists are replica 0's shifted (by construction for ``Programs``, checked action by action
otherwise), and the only actions that join replicas are collectives every replica's copy reaches at
the same point of the same list; so an execution of the whole job is R copies of replica 0's, a
collective completes when replica 0's members reach it, and an ``ALLREDUCE_G`` hands each owner the
other replicas' contributions as the shifts of its own. The exhaustive proof runs every rank.

A plan of millions of actions costs more in memory traffic than in checks: the static checks read
each rank's list once (``_Screen``), the serial simulation once more, and nothing else reads it all.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from . import registry
from .actions import GRAD_OPS, OPS, WEIGHT_OPS, Action, Channel, Names, Op, PlanError, batch_end, describe, no_gc
from .plan import Plan, Programs, shift

EXHAUSTIVE_ACTIONS = 200_000  # above this many actions in all, a plan of replicas is proven on replica 0
# above this many actions simulated, the channel model's liveness is derived from the serial run
# (design §5.3) instead of simulated: every plan the engine proves itself is below it
CHANNEL_ACTIONS = 1_000_000

_SENDS = frozenset(op for op, s in OPS.items() if s.transfer == "send")
_PAIRS = {(Op.SEND_W, Op.RECV_W), (Op.SEND_G, Op.RECV_G), (Op.SEND_MASTER, Op.RECV_MASTER)}
_TRANSFER = {op: s.transfer for op, s in OPS.items()}  # a plain dict: OpSpec's properties cost a call each
_P2P = ("send", "recv")
_LOCAL, _MESSAGE, _COLLECTIVE = 0, 1, 2  # how an op moves bytes, as the simulation asks it
_HOW = {op: _LOCAL if s.transfer is None else _MESSAGE if s.is_p2p else _COLLECTIVE for op, s in OPS.items()}
_CHANNEL = {op: s.channel for op, s in OPS.items()}
# members of the replicated all-reduce join it at different slots (after their last B), and so do
# a chunk's owners in the replicas (after their last ACC_G)
_ANY_SLOT = frozenset({Op.ALLREDUCE_REPLICATED, Op.ALLREDUCE_G})
_ROUTE = {op: (s.channel, s.transfer) for op, s in OPS.items() if s.is_p2p}  # how tags count a message
# the ops the hot loops compare with, looked up once (``Op.X`` costs a descriptor call per use)
_F, _B, _LOAD_W, _ACC_G, _SEND_W, _SEND_G = Op.F, Op.B, Op.LOAD_W, Op.ACC_G, Op.SEND_W, Op.SEND_G
_BCAST_W, _REDUCE_G = Op.BCAST_W, Op.REDUCE_G
# What the channel model's proof from the serial run rests on (design §5.3): a message and its
# match run on one channel, and the channels the serial model queues (``always_overlaps``) carry
# neither compute nor messages.
_QUEUED_IN_SERIAL = frozenset(s.channel for s in OPS.values() if s.always_overlaps)
assert all(OPS[s].channel is OPS[d].channel for s, d in _PAIRS)
assert Channel.COMPUTE not in _QUEUED_IN_SERIAL and not any(
    s.is_p2p and s.channel in _QUEUED_IN_SERIAL for s in OPS.values())


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` established about a plan (all of it, or it would have raised)."""

    actions: int
    p2p_messages: int
    collectives: int
    weight_buffers: int  # max distinct weight buffer names on one rank, w_own included
    grad_buffers: int  # max distinct gradient buffer names on one rank, g_recv included
    contributions: int  # gradient contributions that reached each chunk's owner, summed over chunks
    ranks_run: int = 0  # ranks simulated: every rank, or replica 0's
    channels_simulated: bool = True  # the channel model simulated, or proven from the serial run (design §5.3)


def verify(plan: Plan, *, exhaustive: bool | None = None, simulate_channels: bool | None = None) -> VerifyReport:
    """Check ``plan`` in both execution models; raise ``PlanError`` on the first thing wrong.

    ``exhaustive``: simulate every rank (True) or, for a plan of replicas, replica 0's after
    proving the others its shifts (False); None: every rank where the plan has at most
    ``EXHAUSTIVE_ACTIONS`` actions (or one replica).

    ``simulate_channels``: simulate the channel model too (True), or, where the plan allows it,
    derive its liveness from the serial run (False; design §5.3); None: simulate it where at most
    ``CHANNEL_ACTIONS`` actions are simulated, every plan the engine proves itself among them."""
    if exhaustive is None:
        exhaustive = plan.replicas == 1 or (
            len(plan.actions) * max(len(acts) for acts in plan.actions[:plan.replica_size]) <= EXHAUSTIVE_ACTIONS)
    with no_gc():
        return Verifier(plan, exhaustive, simulate_channels).run()


def _fail(a: Action, msg: str) -> PlanError:
    return PlanError(f"{describe(a)}: {msg}")


class _Grad:
    """Symbolic content of a gradient buffer: the multiset of (chunk, device, micro-batch)
    contributions it holds, and whether it was passed on (read by a reduce, send or ACC_G). A
    weight buffer's content is a plain tuple (chunk, writer): it is read, never consumed."""

    __slots__ = ("chunk", "items", "consumed", "writer")

    def __init__(self, chunk: int, items: tuple, writer: Action) -> None:
        self.chunk, self.items, self.consumed, self.writer = chunk, items, False, writer


class Verifier:
    """One verification of one plan; ``run`` is the whole of it."""

    def __init__(self, plan: Plan, exhaustive: bool = True, simulate_channels: bool | None = True) -> None:
        self.plan = plan
        self.n = plan.topology.world_size if exhaustive or plan.replicas == 1 else plan.replica_size
        self.exhaustive = self.n == plan.topology.world_size
        if simulate_channels is None:
            simulate_channels = sum(len(acts) for acts in plan.actions[:self.n]) <= CHANNEL_ACTIONS
        self.simulate_channels = simulate_channels
        self.bufs: list[dict[str, tuple | _Grad]] = [{} for _ in range(self.n)]
        self.accum: list[list[tuple[int, int, int]]] = [[] for _ in range(self.n)]
        # the accumulator holds its chunk's sum over every replica (after ALLREDUCE_G); simulating
        # replica 0 alone, its items stand for themselves and their shifts into the other replicas
        self.summed = [False] * self.n
        self.computes: list[list[Action]] = [[] for _ in range(self.n)]
        self.p2p = self.collectives = 0
        self._masks: dict[tuple, tuple[int, int]] = {}  # what an action reads and writes, as bits of names
        self._bits: dict[str, int] = {}

    def run(self) -> VerifyReport:
        seen = _check_static(self.plan, self.n)
        if not self.exhaustive:
            _check_shifts(self.plan)
        self.run_serial()
        derived = not self.simulate_channels and self._channels_follow(seen)
        if not derived:
            self.run_channels()
        _check_compute_order(self.plan, self.computes)
        self._check_contributions()
        wmax = max(len(x.weight_buffers) for x in seen)
        gmax = max(len(x.grad_buffers) for x in seen)
        limit = registry.get(self.plan.algo).max_weight_buffers(self.plan)
        if limit is not None and wmax > limit:
            raise PlanError(f"a rank uses {wmax} weight buffers; this {self.plan.algo} plan needs at most {limit}")
        return VerifyReport(
            actions=sum(len(r) for r in self.plan.actions[:self.n]), p2p_messages=self.p2p,
            collectives=self.collectives, weight_buffers=wmax, grad_buffers=gmax,
            contributions=sum(len(x) * (1 if self.exhaustive or not done else self.plan.replicas)
                              for x, done in zip(self.accum[:self.plan.replica_size], self.summed)),
            ranks_run=self.n, channels_simulated=not derived,
        )

    def _channels_follow(self, seen: list[_Seen]) -> bool:
        """Whether the serial run, just completed, proves the channel model live (design §5.3):
        it does where no rank has a message that touches a name its ``always_overlaps`` actions
        (which the serial model queues) touch. Then every message's dependencies are done by the
        time the serial run reaches the message's batch, and the serial run's order of completions
        is a run of the channel model."""
        for x in seen:
            queued = messages = 0
            for a in x.overlapping.values():
                queued |= self.masks(a)[0] | self.masks(a)[1]
            for a in x.messages.values():
                messages |= self.masks(a)[0] | self.masks(a)[1]
            if queued & messages:
                return False
        return True

    # ------------------------------------------------------------------ names an action touches

    def masks(self, a: Action) -> tuple[int, int]:
        """The names ``a`` reads and writes (``plan.reads``/``plan.writes``), one bit per name. They
        depend only on what ``_names_key`` holds (``OpSpec``), so each distinct key is asked once."""
        key = (a.op, a.buf, a.grad_buf, a.accumulate, a.chunk, a.root == a.rank)  # _names_key, inlined
        m = self._masks.get(key)
        if m is None:
            m = self._masks[key] = (self._mask(self.plan.reads(a)), self._mask(self.plan.writes(a)))
        return m

    def _mask(self, names: Names) -> int:
        m = 0
        for b in names:
            bit = self._bits.get(b)
            if bit is None:
                bit = self._bits[b] = 1 << len(self._bits)
            m |= bit
        return m

    # ------------------------------------------------------------------ symbolic contents

    def _weight(self, a: Action, name: str) -> None:
        c = self.bufs[a.rank].get(name)
        if c.__class__ is tuple and c[0] == a.chunk:  # type: ignore[union-attr,index]
            return
        if c is None:
            raise _fail(a, f"reads [{name}], which was never written")
        if isinstance(c, _Grad):
            raise _fail(a, f"reads [{name}] as weights but it holds gradients of chunk {c.chunk}")
        raise _fail(a, f"reads [{name}] holding W{c[0]} (written by {describe(c[1])}), expected W{a.chunk}")

    def _grad(self, a: Action, name: str) -> _Grad:
        c = self.bufs[a.rank].get(name)
        if c is None:
            raise _fail(a, f"reads [{name}], which was never written")
        if not isinstance(c, _Grad):
            raise _fail(a, f"reads [{name}] as a gradient but it holds weights W{c[0]}")
        if c.chunk != a.chunk:
            raise _fail(a, f"reads [{name}] holding the gradient of chunk {c.chunk} "
                           f"(written by {describe(c.writer)}), expected chunk {a.chunk}")
        if c.consumed:
            raise _fail(a, f"reads [{name}] whose gradient was already passed on: it would count twice")
        return c

    def _overwrite(self, a: Action, name: str) -> None:
        c = self.bufs[a.rank].get(name)
        if c is not None and c.__class__ is _Grad and not c.consumed:  # type: ignore[union-attr]
            raise _fail(a, f"overwrites [{name}] while it still holds the pending gradient of chunk "
                           f"{c.chunk} (written by {describe(c.writer)})")  # type: ignore[union-attr]

    def _local(self, a: Action) -> None:
        op = a.op
        if op is _F:
            c = self.bufs[a.rank].get(a.buf)  # type: ignore[arg-type]
            if c.__class__ is not tuple or c[0] != a.chunk:  # type: ignore[index]
                self._weight(a, a.buf)  # type: ignore[arg-type]
            self.computes[a.rank].append(a)
        elif op is _B:
            r = a.rank
            bufs = self.bufs[r]
            c = bufs.get(a.buf)  # type: ignore[arg-type]
            if c.__class__ is not tuple or c[0] != a.chunk:  # type: ignore[index]
                self._weight(a, a.buf)  # type: ignore[arg-type]
            self.computes[r].append(a)
            mine = ((a.chunk, r, a.mb),)
            if a.accumulate:
                bufs[a.grad_buf] = _Grad(a.chunk, self._grad(a, a.grad_buf).items + mine, a)  # type: ignore
            else:
                self._overwrite(a, a.grad_buf)  # type: ignore[arg-type]
                bufs[a.grad_buf] = _Grad(a.chunk, mine, a)  # type: ignore
        elif op is _LOAD_W:
            r = a.rank
            if self.plan.own_chunk(r) != a.chunk:
                raise _fail(a, f"loads W{a.chunk} but the rank owns W{self.plan.own_chunk(r)}")
            self.bufs[r][a.buf] = (a.chunk, a)  # type: ignore[index]
        elif op is _ACC_G:
            r = a.rank
            if self.plan.own_chunk(r) != a.chunk:
                raise _fail(a, f"accumulates chunk {a.chunk} but the rank owns chunk {self.plan.own_chunk(r)}")
            if self.summed[r]:
                raise _fail(a, "accumulates after its chunk's gradient was added across replicas: the other "
                               "replicas' owners would miss this contribution")
            c = self._grad(a, a.buf)  # type: ignore[arg-type]
            c.consumed = True
            self.accum[r].extend(c.items)

    def _pair(self, s: Action, d: Action) -> None:
        if (s.op, d.op) not in _PAIRS:
            raise _fail(s, f"is matched by {describe(d)}")
        if s.slot != d.slot or s.chunk != d.chunk or s.bytes != d.bytes or s.tag != d.tag:
            raise _fail(s, f"is matched by {describe(d)}: slot, chunk, bytes or tag differ")

    def _transfer(self, s: Action, d: Action) -> None:
        self._pair(s, d)
        if s.op is _SEND_W:
            self._weight(s, s.buf)  # type: ignore[arg-type]
            self.bufs[d.rank][d.buf] = (s.chunk, d)  # type: ignore[index]
        elif s.op is _SEND_G:
            c = self._grad(s, s.buf)  # type: ignore[arg-type]
            self._overwrite(d, d.buf)  # type: ignore[arg-type]
            c.consumed = True
            self.bufs[d.rank][d.buf] = _Grad(c.chunk, c.items, d)  # type: ignore[index]
        self.p2p += 1

    def _check_collective(self, acts: list[Action]) -> None:
        a0 = acts[0]
        op, chunk, root, nbytes, buf = a0.op, a0.chunk, a0.root, a0.bytes, a0.buf
        slot = None if op in _ANY_SLOT else a0.slot
        for a in acts:
            if (a.op != op or a.chunk != chunk or a.root != root or a.bytes != nbytes or a.buf != buf
                    or (slot is not None and a.slot != slot)):
                raise _fail(a, f"meets {describe(a0)} in the same collective: they differ")

    def _collective(self, acts: list[Action]) -> None:
        self._check_collective(acts)
        a0 = acts[0]
        if a0.op is _BCAST_W:
            root = next(a for a in acts if a.rank == a0.root)
            self._weight(root, root.buf)  # type: ignore[arg-type]
            bufs = self.bufs
            for a in acts:
                if a.rank != a0.root:
                    bufs[a.rank][a.buf] = (a0.chunk, a)  # type: ignore[index]
        elif a0.op is _REDUCE_G:
            items: tuple = ()
            for a in acts:
                c = self._grad(a, a.buf)  # type: ignore[arg-type]
                items += c.items
                c.consumed = True
            self.bufs[a0.root][a0.buf] = _Grad(a0.chunk, items, a0)  # type: ignore[index]
        elif a0.op is Op.ALLREDUCE_G:
            if self.exhaustive:  # every owner adds the others' accumulators
                total = [item for a in acts for item in self.accum[a.rank]]
                for a in acts:
                    self.accum[a.rank] = list(total)
            for a in acts:
                self.summed[a.rank] = True
        self.collectives += 1

    # ------------------------------------------------------------------ execution models

    def run_serial(self, contents: bool = True) -> None:
        """Blocking execution, one action at a time; the replicated all-reduce keeps its channel.
        ``contents``: track and check buffer contents too (else only that transfers pair up)."""
        inline = frozenset(c for c in Channel if c not in _QUEUED_IN_SERIAL)
        _Simulation(self, inline, batched=False, contents=contents).run("serial")

    def run_channels(self) -> None:
        """The engine's model: compute thread + one in-order queue per channel, dataflow waits."""
        _Simulation(self, frozenset({Channel.COMPUTE}), batched=True, contents=False).run("channels")

    def _check_contributions(self) -> None:
        """Every owner holds each (chunk, device, micro-batch) of every rank once; simulating
        replica 0 alone, each of its own replica's once, the rest being their shifts (summed)."""
        n = self.plan.topology.world_size if self.exhaustive else self.plan.replica_size
        acc = self.plan.micro_batches
        for r in range(self.n):
            k = self.plan.own_chunk(r)
            items = self.accum[r]
            if len(items) == len(set(items)) == n * acc:  # the fast test: n x acc distinct items, all expected
                chunks, devices, mbs = zip(*items) if items else ((), (), ())
                if set(chunks) <= {k} and set(devices) <= set(range(n)) and set(mbs) <= set(range(acc)):
                    continue
            expected = Counter((k, d, m) for d in range(n) for m in range(acc))
            got = Counter(items)
            if got != expected:
                missing = sorted((expected - got).elements())[:4]
                extra = sorted((got - expected).elements())[:4]
                raise PlanError(
                    f"rank {r} (owner of chunk {k}) accumulated {sum(got.values())} gradient "
                    f"contributions instead of {n * acc}; missing (chunk, device, mb) {missing}, "
                    f"unexpected or duplicated {extra}"
                )


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


def _check_static(plan: Plan, ranks: int) -> list[_Seen]:
    """Shape of the plan and of the first ``ranks`` ranks' actions; replicated all-reduce,
    statistics, the replicas' gradient all-reduce and STEP. Returns what each rank's list uses.

    Each list is read once, by ``_Screen``; only a list it doubts is read again, by
    ``_check_rank``, which names the first fault. The screen passes only lists that ``_check_rank``
    passes."""
    topo, n, size = plan.topology, plan.topology.world_size, plan.replica_size
    if not (isinstance(plan.replicas, int) and plan.replicas >= 1 and n % plan.replicas == 0
            and topo.nodes % plan.replicas == 0):
        raise PlanError(f"replicas={plan.replicas} does not divide the {topo.nodes} nodes into equal replicas")
    if len(plan.actions) != n or len(plan.owner) != size or len(plan.chunk_layers) != size:
        raise PlanError(f"need one action list per rank (N={n}) and one owner and one chunk per rank of a replica "
                        f"({size}), got {len(plan.actions)}, {len(plan.owner)}, {len(plan.chunk_layers)}")
    if sorted(plan.owner) != list(range(size)):
        raise PlanError(f"owner {plan.owner} is not a permutation of replica 0's ranks")
    pos = 0
    for k in plan.model_order:
        start, stop = plan.chunk_layers[k]
        if start != pos or stop <= start:
            raise PlanError(f"chunk_layers {plan.chunk_layers} do not tile 0..{plan.num_layers} in order")
        pos = stop
    if pos != plan.num_layers:
        raise PlanError(f"chunk_layers {plan.chunk_layers} do not cover {plan.num_layers} layers")
    screen = _Screen(plan)
    seen = []
    for r in range(ranks):
        acts = plan.actions[r]
        got = screen(r, acts)
        if got is None:
            _check_rank(plan, r, acts)  # raises on the first fault
            raise AssertionError(f"the one-pass checks refused rank {r}'s list, which the checks one by one pass")
        seen.append(got)
    return seen


@dataclass
class _Seen:
    """What one rank's list uses: its weight and gradient buffer names, and the actions that
    stand for the names its messages and its ``always_overlaps`` actions touch (one per key of
    ``_names_key``)."""

    weight_buffers: set
    grad_buffers: set
    messages: dict
    overlapping: dict


def _names_key(a: Action) -> tuple:
    """What an op's ``reads`` and ``writes`` may depend on (``OpSpec``): equal keys, equal names."""
    return (a.op, a.buf, a.grad_buf, a.accumulate, a.chunk, a.root == a.rank)


_COMPUTE, _MSG, _COLL, _LOCALOP, _FRAMING, _EXCHANGE = range(6)  # what the static checks ask of an op
_FRAMES = (Op.STEP, Op.ALLREDUCE_REPLICATED, Op.ALLREDUCE_STATS)
_CATEGORY = {op: (_FRAMING if op in _FRAMES else _EXCHANGE if op is Op.ALLREDUCE_G else _COMPUTE if op in (_F, _B)
                  else _MSG if s.is_p2p else _COLL if s.transfer == "collective" else _LOCALOP)
             for op, s in OPS.items()}
_OVERLAPS = frozenset(op for op, s in OPS.items() if s.always_overlaps)


class _Screen:
    """Every check of ``_check_rank`` in one pass over a list, and what the list uses: a plan of
    millions of actions is read once (each pass costs more in memory traffic than in checks)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        size = plan.replica_size
        sized = "layer_numel" in plan.options
        # message bytes per op and chunk (None: not checked)
        self.bytes = {op: [plan.message_bytes(op, c) for c in range(size)] if sized and s.transfer else None
                      for op, s in OPS.items()}
        self.sized = sized
        self.everyone = tuple(range(plan.topology.world_size))

    def __call__(self, r: int, acts: tuple[Action, ...]) -> _Seen | None:  # noqa: C901 (one pass, by design)
        plan, topo = self.plan, self.plan.topology
        size, acc, num_slots = plan.replica_size, plan.micro_batches, plan.num_slots
        home = range(plan.replica_of(r) * size, (plan.replica_of(r) + 1) * size)
        node = topo.group_ranks(topo.group_of(r))
        category, nbytes, weights, grads, route = _CATEGORY, self.bytes, WEIGHT_OPS, GRAD_OPS, _ROUTE
        sized = self.sized
        wbufs: set = set()
        gbufs: set = set()
        messages: dict = {}
        overlapping: dict = {}
        tags: dict = {}
        prev, i = -1, -1
        last_b = last_acc = first_exchange = first_allreduce = -1
        exchanges = allreduces = stats = steps = 0
        for a in acts:
            i += 1
            op = a.op
            if a.rank != r:
                return None
            slot = a.slot
            if slot < prev or slot >= num_slots:
                return None
            prev = slot
            cat = category[op]
            if cat == _COMPUTE:
                chunk, mb, buf = a.chunk, a.mb, a.buf
                if chunk is None or not 0 <= chunk < size or buf is None or mb is None or not 0 <= mb < acc:
                    return None
                wbufs.add(buf)
                if op is _B:
                    gbuf = a.grad_buf
                    if gbuf is None:
                        return None
                    gbufs.add(gbuf)
                    last_b = i
                continue
            if cat == _FRAMING:
                if sized and OPS[op].transfer and a.bytes != plan.message_bytes(op, a.chunk):
                    return None
                if op is Op.STEP:
                    steps += 1
                else:
                    if a.group != self.everyone:
                        return None
                    if op is Op.ALLREDUCE_STATS:
                        stats += 1
                    else:
                        allreduces += 1
                        if first_allreduce < 0:
                            first_allreduce = i
                if op in _OVERLAPS:
                    overlapping.setdefault(_names_key(a), a)
                continue
            chunk = a.chunk
            if chunk is None or not 0 <= chunk < size:
                return None
            table = nbytes[op]
            if table is not None and a.bytes != table[chunk]:
                return None
            if cat == _EXCHANGE:
                if chunk != plan.own_chunk(r) or a.group != plan.owners(chunk):
                    return None
                exchanges += 1
                if first_exchange < 0:
                    first_exchange = i
                continue
            buf = a.buf
            if buf is None:
                return None
            if cat == _MSG:
                peer = a.peer
                if peer is None or peer not in home or peer == r:
                    return None
                key = (route[op], peer)
                k = tags.get(key, 0)
                if a.tag != k:
                    return None
                tags[key] = k + 1
                messages.setdefault(_names_key(a), a)
            elif cat == _COLL:
                if a.group != node or a.root not in a.group:
                    return None
            elif op is _ACC_G:
                last_acc = i
            if op in weights:
                wbufs.add(buf)
            elif op in grads:
                gbufs.add(buf)
            if op in _OVERLAPS:
                overlapping.setdefault(_names_key(a), a)
        if (exchanges != (plan.replicas > 1) or 0 <= first_exchange < last_acc or allreduces != 1
                or first_allreduce < last_b or stats != 1 or steps != 1 or len(acts) < 2
                or acts[-2].op != Op.ALLREDUCE_STATS or acts[-1].op != Op.STEP):
            return None
        return _Seen(wbufs, gbufs, messages, overlapping)


def _check_rank(plan: Plan, r: int, acts: tuple[Action, ...]) -> None:
    """Rank r's list, action by action: its frame, its tags, then each action's fields; raises on
    the first fault."""
    topo, n, acc, size = plan.topology, plan.topology.world_size, plan.micro_batches, plan.replica_size
    everyone = tuple(range(n))
    sized = "layer_numel" in plan.options
    computes = (_F, _B)
    step, exchange, num_slots = Op.STEP, Op.ALLREDUCE_G, plan.num_slots
    _check_rank_frame(plan, r, acts)
    _check_tags(acts)
    prev_slot = -1
    home = range(plan.replica_of(r) * size, (plan.replica_of(r) + 1) * size)
    node = topo.group_ranks(topo.group_of(r))
    for a in acts:
        op = a.op
        if a.rank != r:
            raise _fail(a, f"is in the list of rank {r}")
        slot = a.slot
        if not -1 <= slot < num_slots or slot < prev_slot:
            raise _fail(a, f"slot out of order or outside -1..{num_slots - 1}")
        prev_slot = slot
        how = _TRANSFER[op]
        if op in _FRAMES:
            if how is not None and sized and a.bytes != plan.message_bytes(op, a.chunk):
                raise _fail(a, f"carries {a.bytes} bytes, {op.value} needs {plan.message_bytes(op, a.chunk)}")
            if op is not step and a.group != everyone:
                raise _fail(a, "must span all ranks")
            continue
        if a.chunk is None or not 0 <= a.chunk < size:
            raise _fail(a, "needs a valid chunk")
        if how is not None and sized and a.bytes != plan.message_bytes(op, a.chunk):
            raise _fail(a, f"carries {a.bytes} bytes, {op.value} needs {plan.message_bytes(op, a.chunk)}")
        if op is exchange:
            if a.chunk != plan.own_chunk(r) or a.group != plan.owners(a.chunk):
                raise _fail(a, f"must add the rank's own chunk {plan.own_chunk(r)} with its owners in every "
                               f"replica {list(plan.owners(plan.own_chunk(r)))}")
            continue
        if a.buf is None:
            raise _fail(a, "needs a buffer")
        if op in computes:
            if a.mb is None or not 0 <= a.mb < acc:
                raise _fail(a, f"micro-batch outside 0..{acc - 1}")
            if op is _B and a.grad_buf is None:
                raise _fail(a, "has no grad_buf")
        elif how in _P2P:
            if a.peer is None or a.peer not in home or a.peer == r:
                raise _fail(a, f"needs a peer rank other than itself in its replica ({home.start}..{home.stop - 1})")
        elif how == "collective":
            if a.group != node or a.root not in a.group:
                g = topo.group_of(r)
                raise _fail(a, f"must span exactly group {g} {list(topo.group_ranks(g))} with a root in it")


def _check_shifts(plan: Plan) -> None:
    """Every replica's lists are replica 0's, shifted: by construction for ``Programs``, else
    checked action by action."""
    if isinstance(plan.actions, Programs):
        return
    size = plan.replica_size
    for r in range(size, plan.topology.world_size):
        want = plan.actions[r % size]
        got = plan.actions[r]
        offset = r - r % size
        if len(got) != len(want):
            raise PlanError(f"rank {r} has {len(got)} actions, but replica 0's rank {r % size} has {len(want)}: "
                            "replicas must run the same lists")
        for a, b in zip(got, want):
            if a != shift(b, offset):
                raise _fail(a, f"differs from replica 0's {describe(b)} shifted by {offset} ranks")


def _check_tags(acts: tuple[Action, ...]) -> None:
    """Floating messages are matched by tag (design §5.2): on each channel, the messages between
    two ranks in one direction must be tagged 0, 1, 2, ... in list order."""
    count: dict[tuple[tuple[str, str], int | None], int] = {}
    for a in acts:
        route = _ROUTE.get(a.op)
        if route is not None:
            key = (route, a.peer)
            k = count.get(key, 0)
            if a.tag != k:
                raise _fail(a, f"has tag {a.tag}; as message {k} to/from rank {a.peer} on the "
                               f"{route[0]} channel it needs tag {k}")
            count[key] = k + 1


def _check_rank_frame(plan: Plan, r: int, acts: tuple[Action, ...]) -> None:
    """One replicated all-reduce after the last B; with replicas, one gradient all-reduce after the
    last ACC_G; the statistics, then STEP, close the list."""
    ops = [a.op for a in acts]
    exchange, acc_g, allreduce_replicated = Op.ALLREDUCE_G, Op.ACC_G, Op.ALLREDUCE_REPLICATED
    exchanges = [i for i, op in enumerate(ops) if op is exchange]
    if len(exchanges) != (plan.replicas > 1):
        raise PlanError(f"rank {r} has {len(exchanges)} ALLREDUCE_G actions; a plan of {plan.replicas} replica(s) "
                        f"needs {int(plan.replicas > 1)}")
    accs = [i for i, op in enumerate(ops) if op is acc_g]
    if exchanges and accs and exchanges[0] < accs[-1]:
        raise _fail(acts[exchanges[0]], "comes before the rank's last ACC_G: a contribution would miss the "
                                        "other replicas")
    allreduce = [i for i, op in enumerate(ops) if op is allreduce_replicated]
    backs = [i for i, op in enumerate(ops) if op is _B]
    if len(allreduce) != 1:
        raise PlanError(f"rank {r} has {len(allreduce)} ALLREDUCE_REPLICATED actions, expected 1")
    if backs and allreduce[0] < backs[-1]:
        raise _fail(acts[allreduce[0]], "comes before the rank's last B")
    if ops[-2:] != [Op.ALLREDUCE_STATS, Op.STEP] or ops.count(Op.STEP) != 1 or ops.count(Op.ALLREDUCE_STATS) != 1:
        raise PlanError(f"rank {r} must end with exactly one ALLREDUCE_STATS and then one STEP")


def _check_compute_order(plan: Plan, computes: list[list[Action]]) -> None:
    """Per micro-batch: forward in model order, then backward in reverse, all micro-batches."""
    order = plan.model_order
    for r, acts in enumerate(computes):
        fwd: dict[int, list[int]] = {}
        bwd: dict[int, list[int]] = {}
        first_b: dict[int, Action] = {}
        for a in acts:
            if a.op is _F:
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
