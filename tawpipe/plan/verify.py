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

A plan of R replicas (design §3.5) is proven on replica 0 alone unless ``exhaustive``: every other
replica's lists are replica 0's shifted (by construction for ``Programs``, checked action by action
otherwise), and the only actions that join replicas are collectives every replica's copy reaches at
the same point of the same list; so an execution of the whole job is R copies of replica 0's, a
collective completes when replica 0's members reach it, and an ``ALLREDUCE_G`` hands each owner the
other replicas' contributions as the shifts of its own. The exhaustive proof runs every rank.
"""

from __future__ import annotations

import functools
from collections import Counter, deque
from dataclasses import dataclass
from itertools import accumulate

from .actions import GRAD_OPS, OPS, WEIGHT_OPS, Action, Channel, Hazards, Names, Op, PlanError, batches, describe
from .plan import Plan, Programs, shift

EXHAUSTIVE_ACTIONS = 200_000  # above this many actions in all, a plan of replicas is proven on replica 0

_SENDS = frozenset(op for op, s in OPS.items() if s.transfer == "send")
_RECVS = frozenset(op for op, s in OPS.items() if s.transfer == "recv")
_PAIRS = {(Op.SEND_W, Op.RECV_W), (Op.SEND_G, Op.RECV_G), (Op.SEND_MASTER, Op.RECV_MASTER)}
_TRANSFER = {op: s.transfer for op, s in OPS.items()}  # a plain dict: OpSpec's properties cost a call each
_P2P = ("send", "recv")
# members of the replicated all-reduce join it at different slots (after their last B), and so do
# a chunk's owners in the replicas (after their last ACC_G)
_ANY_SLOT = frozenset({Op.ALLREDUCE_REPLICATED, Op.ALLREDUCE_G})
_ROUTE = {op: (s.channel, s.transfer) for op, s in OPS.items() if s.is_p2p}  # how tags count a message
# the ops the hot loops compare with, looked up once (``Op.X`` costs a descriptor call per use)
_F, _B, _LOAD_W, _ACC_G, _SEND_W, _SEND_G = Op.F, Op.B, Op.LOAD_W, Op.ACC_G, Op.SEND_W, Op.SEND_G


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


def verify(plan: Plan, *, exhaustive: bool | None = None) -> VerifyReport:
    """Check ``plan`` in both execution models; raise ``PlanError`` on the first thing wrong.

    ``exhaustive``: simulate every rank (True) or, for a plan of replicas, replica 0's after
    proving the others its shifts (False); None: every rank where the plan has at most
    ``EXHAUSTIVE_ACTIONS`` actions (or one replica)."""
    if exhaustive is None:
        exhaustive = plan.replicas == 1 or (
            len(plan.actions) * max(len(acts) for acts in plan.actions[:plan.replica_size]) <= EXHAUSTIVE_ACTIONS)
    return Verifier(plan, exhaustive).run()


def _fail(a: Action, msg: str) -> PlanError:
    return PlanError(f"{describe(a)}: {msg}")


class _Content:
    """Symbolic content of a buffer: a weight chunk, or a multiset of gradient contributions."""

    __slots__ = ("chunk", "items", "consumed", "writer")

    def __init__(self, chunk: int, items: tuple | None, writer: Action) -> None:
        self.chunk, self.items, self.consumed, self.writer = chunk, items, False, writer


class Verifier:
    """One verification of one plan; ``run`` is the whole of it."""

    def __init__(self, plan: Plan, exhaustive: bool = True) -> None:
        self.plan = plan
        self.n = plan.topology.world_size if exhaustive or plan.replicas == 1 else plan.replica_size
        self.exhaustive = self.n == plan.topology.world_size
        self.bufs: list[dict[str, _Content]] = [{} for _ in range(self.n)]
        self.accum: list[list[tuple[int, int, int]]] = [[] for _ in range(self.n)]
        # the accumulator holds its chunk's sum over every replica (after ALLREDUCE_G); simulating
        # replica 0 alone, its items stand for themselves and their shifts into the other replicas
        self.summed = [False] * self.n
        self.computes: list[list[Action]] = [[] for _ in range(self.n)]
        self.p2p = self.collectives = 0

    def run(self) -> VerifyReport:
        _check_static(self.plan, self.n)
        if not self.exhaustive:
            _check_shifts(self.plan)
        self.run_serial()
        self.run_channels()
        _check_compute_order(self.plan, self.computes)
        self._check_contributions()
        acts = self.plan.actions[:self.n]
        wmax = max(len({a.buf for a in r if a.op in WEIGHT_OPS}) for r in acts)
        gmax = max(len({a.grad_buf if a.op is _B else a.buf for a in r if a.op is _B or a.op in GRAD_OPS})
                   for r in acts)
        if self.plan.algo == "tawpipe":
            limit = 2 + int(self.plan.options.get("prefetch_depth", 1))
            if wmax > limit:
                raise PlanError(f"a rank uses {wmax} weight buffers; this TawPipe plan needs at most "
                                f"{limit} (w_own + prefetch_depth + 1)")
        return VerifyReport(
            actions=sum(len(r) for r in acts), p2p_messages=self.p2p, collectives=self.collectives,
            weight_buffers=wmax, grad_buffers=gmax,
            contributions=sum(len(x) * (1 if self.exhaustive or not done else self.plan.replicas)
                              for x, done in zip(self.accum[:self.plan.replica_size], self.summed)),
            ranks_run=self.n,
        )

    # ------------------------------------------------------------------ symbolic contents

    def _weight(self, a: Action, name: str) -> None:
        c = self.bufs[a.rank].get(name)
        if c is None:
            raise _fail(a, f"reads [{name}], which was never written")
        if c.items is not None:
            raise _fail(a, f"reads [{name}] as weights but it holds gradients of chunk {c.chunk}")
        if c.chunk != a.chunk:
            raise _fail(a, f"reads [{name}] holding W{c.chunk} (written by {describe(c.writer)}), "
                           f"expected W{a.chunk}")

    def _grad(self, a: Action, name: str) -> _Content:
        c = self.bufs[a.rank].get(name)
        if c is None:
            raise _fail(a, f"reads [{name}], which was never written")
        if c.items is None:
            raise _fail(a, f"reads [{name}] as a gradient but it holds weights W{c.chunk}")
        if c.chunk != a.chunk:
            raise _fail(a, f"reads [{name}] holding the gradient of chunk {c.chunk} "
                           f"(written by {describe(c.writer)}), expected chunk {a.chunk}")
        if c.consumed:
            raise _fail(a, f"reads [{name}] whose gradient was already passed on: it would count twice")
        return c

    def _overwrite(self, a: Action, name: str) -> None:
        c = self.bufs[a.rank].get(name)
        if c is not None and c.items is not None and not c.consumed:
            raise _fail(a, f"overwrites [{name}] while it still holds the pending gradient of chunk "
                           f"{c.chunk} (written by {describe(c.writer)})")

    def _local(self, a: Action) -> None:
        r, bufs, op = a.rank, self.bufs[a.rank], a.op
        if op is _LOAD_W:
            if self.plan.own_chunk(r) != a.chunk:
                raise _fail(a, f"loads W{a.chunk} but the rank owns W{self.plan.own_chunk(r)}")
            bufs[a.buf] = _Content(a.chunk, None, a)
        elif op is _F:
            self._weight(a, a.buf)
            self.computes[r].append(a)
        elif op is _B:
            self._weight(a, a.buf)
            self.computes[r].append(a)
            mine = ((a.chunk, r, a.mb),)
            if a.accumulate:
                bufs[a.grad_buf] = _Content(a.chunk, self._grad(a, a.grad_buf).items + mine, a)
            else:
                self._overwrite(a, a.grad_buf)
                bufs[a.grad_buf] = _Content(a.chunk, mine, a)
        elif op is _ACC_G:
            if self.plan.own_chunk(r) != a.chunk:
                raise _fail(a, f"accumulates chunk {a.chunk} but the rank owns chunk {self.plan.own_chunk(r)}")
            if self.summed[r]:
                raise _fail(a, "accumulates after its chunk's gradient was added across replicas: the other "
                               "replicas' owners would miss this contribution")
            c = self._grad(a, a.buf)
            c.consumed = True
            self.accum[r].extend(c.items)

    def _pair(self, s: Action, d: Action) -> None:
        if (s.op, d.op) not in _PAIRS:
            raise _fail(s, f"is matched by {describe(d)}")
        if (s.slot, s.chunk, s.bytes, s.tag) != (d.slot, d.chunk, d.bytes, d.tag):
            raise _fail(s, f"is matched by {describe(d)}: slot, chunk, bytes or tag differ")

    def _transfer(self, s: Action, d: Action) -> None:
        self._pair(s, d)
        if s.op is _SEND_W:
            self._weight(s, s.buf)
            self.bufs[d.rank][d.buf] = _Content(s.chunk, None, d)
        elif s.op is _SEND_G:
            c = self._grad(s, s.buf)
            self._overwrite(d, d.buf)
            c.consumed = True
            self.bufs[d.rank][d.buf] = _Content(c.chunk, c.items, d)
        self.p2p += 1

    def _check_collective(self, acts: list[Action]) -> None:
        a0 = acts[0]
        slot = None if a0.op in _ANY_SLOT else a0.slot
        key = (a0.op, slot, a0.chunk, a0.root, a0.bytes, a0.buf)
        for a in acts[1:]:
            if (a.op, None if slot is None else a.slot, a.chunk, a.root, a.bytes, a.buf) != key:
                raise _fail(a, f"meets {describe(a0)} in the same collective: they differ")

    def _collective(self, acts: list[Action]) -> None:
        self._check_collective(acts)
        a0 = acts[0]
        if a0.op is Op.BCAST_W:
            root = next(a for a in acts if a.rank == a0.root)
            self._weight(root, root.buf)
            for a in acts:
                if a.rank != a0.root:
                    self.bufs[a.rank][a.buf] = _Content(a0.chunk, None, a)
        elif a0.op is Op.REDUCE_G:
            items: tuple = ()
            for a in acts:
                c = self._grad(a, a.buf)
                items += c.items
                c.consumed = True
            self.bufs[a0.root][a0.buf] = _Content(a0.chunk, items, a0)
        elif a0.op is Op.ALLREDUCE_G:
            if self.exhaustive:  # every owner adds the others' accumulators
                total = [item for a in acts for item in self.accum[a.rank]]
                for a in acts:
                    self.accum[a.rank] = list(total)
            for a in acts:
                self.summed[a.rank] = True
        self.collectives += 1

    # ------------------------------------------------------------------ execution models

    def run_serial(self) -> None:
        """Blocking execution, one action at a time; the replicated all-reduce keeps its channel."""
        own_channel = {s.channel for s in OPS.values() if s.always_overlaps}
        inline = frozenset(c for c in Channel if c not in own_channel)
        _Simulation(self, self._units(batched=False), inline, contents=True).run("serial")

    def run_channels(self) -> None:
        """The engine's model: compute thread + one in-order queue per channel, dataflow waits."""
        _Simulation(self, self._units(batched=True), frozenset({Channel.COMPUTE}), contents=False).run("channels")

    @functools.cached_property
    def _reads_writes(self) -> list[list[tuple[Names, Names]]]:
        """What each action reads and writes, rank by rank: computed once for both models."""
        plan = self.plan
        return [[(plan.reads(a), plan.writes(a)) for a in acts] for acts in plan.actions[:self.n]]

    def _units(self, batched: bool) -> list[_Rank]:
        """Every rank's actions cut into units (P2P batches, or single actions), each waiting for
        the units its actions depend on by ``Hazards``."""
        ranks = []
        for acts, rw in zip(self.plan.actions[:self.n], self._reads_writes):
            rk = _Rank(acts, [len(b) for b in batches(acts)] if batched else [1] * len(acts))
            hz: Hazards[int] = Hazards()
            waits, first, to, nxt = rk.waits, rk.first, rk.to, rk.nxt
            for u, (start, end) in enumerate(zip(rk.starts, rk.ends)):
                if end - start == 1:  # most units
                    reads, writes = rw[start]
                    deps = hz.deps(reads, writes)
                    hz.record(u, reads, writes)
                else:
                    unit = rw[start:end]
                    deps = [d for reads, writes in unit for d in hz.deps(reads, writes)]
                    for reads, writes in unit:
                        hz.record(u, reads, writes)
                if len(deps) > 1:  # a unit may name another twice (B += reads and writes its grad_buf)
                    deps = set(deps)
                waits[u] = len(deps)
                for d in deps:  # u joins the front of d's list of dependents
                    nxt.append(first[d])
                    first[d] = len(to)
                    to.append(u)
            ranks.append(rk)
        return ranks

    def _check_contributions(self) -> None:
        """Every owner holds each (chunk, device, micro-batch) of every rank once; simulating
        replica 0 alone, each of its own replica's once, the rest being their shifts (summed)."""
        n = self.plan.topology.world_size if self.exhaustive else self.plan.replica_size
        acc = self.plan.micro_batches
        for r in range(self.n):
            k = self.plan.own_chunk(r)
            items = self.accum[r]
            distinct = set(items)
            if len(items) == len(distinct) == n * acc and all(  # each (chunk, device, mb) once: the fast test
                    c == k and 0 <= d < n and 0 <= m < acc for c, d, m in distinct):
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
    """One rank's units and where its simulation stands, in flat lists of ints: an object per
    unit would make Python's cycle collector traverse them all, many times over.

    Unit u is ``acts[starts[u]:ends[u]]``; ``pos[u]`` is its next action. It starts once the
    ``waits[u]`` units it depends on are done; a unit's completion counts down its dependents,
    ``to[e]`` for e = ``first[u]``, ``nxt[e]``, ... (a linked list, -1 ending it)."""

    __slots__ = ("acts", "starts", "ends", "pos", "done", "waits", "first", "to", "nxt", "pc", "queues", "parked")

    def __init__(self, acts: tuple[Action, ...], sizes: list[int]) -> None:
        self.acts = acts
        self.ends = list(accumulate(sizes))
        self.starts = [0, *self.ends[:-1]] if sizes else []
        self.pos = list(self.starts)
        self.done = [False] * len(sizes)
        self.waits = [0] * len(sizes)
        self.first = [-1] * len(sizes)
        self.to: list[int] = []
        self.nxt: list[int] = []
        self.pc = 0  # the driver's next unit
        self.queues: dict[str, deque[int]] = {}  # the units queued on each channel, in order
        self.parked: set[int] = set()  # units at a collective that not every member has reached yet


class _Simulation:
    """Runs units of actions per rank until everything has finished or nothing can move.

    A rank's units are consumed in order by its *driver* (the compute thread). Units on the
    channels in ``inline`` run on the driver, blocking it; the others go to their channel's queue
    and the driver moves on. A queued unit starts when its dependencies (units of the same rank)
    are done. Its transfers complete one at a time: a send meets the matching receive at the head
    of the peer's queue on the same channel; a collective completes when every member is at it.
    In the serial model the simulation also tracks buffer contents (``Verifier``); in the channel
    model it only checks that transfers pair up and that nothing deadlocks.

    The order in which ranks move decides which of several faults is reported first, so it is
    kept as plain as above; what makes it fast is only that a failed try is not repeated while
    it must fail again: a unit whose dependencies are not done waits on a count, and a unit at a
    collective not every member has reached is *parked* until the last one comes.
    """

    def __init__(self, v: Verifier, ranks: list[_Rank], inline: frozenset[str], contents: bool) -> None:
        self.v, self.ranks, self.contents = v, ranks, contents
        self.lane = {op: None if s.channel in inline else s.channel for op, s in OPS.items()}  # None: the driver
        self.colls: Counter[tuple] = Counter()  # completed collectives per (rank, channel, group)
        self.arrived: dict[tuple, dict[int, int]] = {}  # per collective, who has reached it: rank -> unit
        self.groups: dict[tuple[int, ...], tuple[int, ...]] = {}  # a group -> its simulated members

    def run(self, model: str) -> None:
        n = len(self.ranks)
        work, queued = deque(range(n)), [True] * n
        while work:
            r = work.popleft()
            queued[r] = False
            for peer in self._advance(r):
                if not queued[peer]:
                    queued[peer] = True
                    work.append(peer)
        stuck = []
        for rk in self.ranks:
            u = next((u for u, d in enumerate(rk.done) if not d), None)
            if u is not None:
                stuck.append(rk.acts[rk.pos[u]])
        if stuck:
            shown = "; ".join(describe(a) for a in stuck[:8])
            raise PlanError(f"deadlock in the {model} model: {len(stuck)} ranks blocked, e.g. {shown}")

    def _advance(self, r: int) -> set[int]:
        """Move rank r as far as it can go; returns the ranks that may now move too."""
        woken: set[int] = set()
        rk, lane, finish = self.ranks[r], self.lane, self._finish
        acts, starts, waits, queues, parked = rk.acts, rk.starts, rk.waits, rk.queues, rk.parked
        progress = True
        while progress:
            progress = False
            while rk.pc < len(starts):  # the driver
                u = rk.pc
                channel = lane[acts[starts[u]].op]
                if channel is not None:
                    queues.setdefault(channel, deque()).append(u)
                elif waits[u] or u in parked or not finish(rk, r, u, woken):
                    break
                rk.pc += 1
                progress = True
            for q in queues.values():  # the channels
                while q and not waits[q[0]] and q[0] not in parked and finish(rk, r, q[0], woken):
                    q.popleft()
                    progress = True
        return woken

    def _finish(self, rk: _Rank, r: int, u: int, woken: set[int]) -> bool:
        """Run unit u of rank r (``rk``) as far as peers allow; True once all of it is done."""
        acts, pos, end = rk.acts, rk.pos, rk.ends[u]
        i = pos[u]
        while i < end:
            a = acts[i]
            how = _TRANSFER[a.op]
            if how is None:
                if self.contents:
                    self.v._local(a)
                pos[u] = i = i + 1
            elif self._meet(r, u, a, woken) if how in _P2P else self._gather(r, u, a, woken):
                i = pos[u]
            else:
                return False
        rk.done[u] = True
        waits, to, nxt, e = rk.waits, rk.to, rk.nxt, rk.first[u]
        while e >= 0:
            waits[to[e]] -= 1
            e = nxt[e]
        return True

    def _blocked_at(self, r: int, a: Action) -> tuple[int, Action] | None:
        """(unit, action) where rank r waits on a's channel, if it waits there."""
        rk, channel = self.ranks[r], self.lane[a.op]
        if channel is not None:
            q = rk.queues.get(channel)
            if not q or rk.waits[q[0]]:
                return None
            u = q[0]
        else:
            u = rk.pc
            if u >= len(rk.starts) or self.lane[rk.acts[rk.starts[u]].op] is not None or rk.waits[u]:
                return None
        i = rk.pos[u]
        if i >= rk.ends[u]:  # finished; its rank has yet to notice
            return None
        return u, rk.acts[i]

    def _meet(self, r: int, u: int, a: Action, woken: set[int]) -> bool:
        head = self._blocked_at(a.peer, a)
        if head is None:
            return False
        pu, b = head
        how = _TRANSFER[b.op]
        if b.peer != r or how not in _P2P or how == _TRANSFER[a.op]:
            return False
        s, d = (a, b) if a.op in _SENDS else (b, a)
        if self.contents:
            self.v._transfer(s, d)
        else:
            self.v._pair(s, d)
        self.ranks[r].pos[u] += 1
        self.ranks[a.peer].pos[pu] += 1
        woken.add(a.peer)
        return True

    def _gather(self, r: int, u: int, a: Action, woken: set[int]) -> bool:
        channel = OPS[a.op].channel
        group = self.groups.get(a.group)
        if group is None:  # the members simulated: every replica's copy reaches it with them
            group = self.groups[a.group] = tuple(m for m in a.group if m < len(self.ranks))
        key = (channel, group, self.colls[r, channel, group])
        members = self.arrived.get(key)
        if members is None:
            members = self.arrived[key] = {}
        members[r] = u
        if len(members) < len(group):  # parked: trying again fails until the last member comes
            self.ranks[r].parked.add(u)
            return False
        for m, mu in members.items():
            self.ranks[m].parked.discard(mu)
        heads = [(u, a) if m == r else self._blocked_at(m, a) for m in group]
        if any(h is None or _TRANSFER[h[1].op] != "collective" for h in heads):
            return False
        acts = [b for _, b in heads]
        if self.contents:
            self.v._collective(acts)
        else:
            self.v._check_collective(acts)
        del self.arrived[key]
        for m, (mu, _) in zip(group, heads):
            rk = self.ranks[m]
            rk.pos[mu] += 1
            rk.parked.discard(mu)
            self.colls[m, channel, group] += 1
            woken.add(m)
        return True


def _check_static(plan: Plan, ranks: int) -> None:
    """Shape of the plan and of the first ``ranks`` ranks' actions; replicated all-reduce,
    statistics, the replicas' gradient all-reduce and STEP."""
    topo, n, acc, size = plan.topology, plan.topology.world_size, plan.micro_batches, plan.replica_size
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
    everyone = tuple(range(n))
    sized, sizes = "layer_numel" in plan.options, {}  # message bytes per (op, chunk)
    framing, computes = (Op.STEP, Op.ALLREDUCE_REPLICATED, Op.ALLREDUCE_STATS), (_F, _B)
    step, exchange, num_slots = Op.STEP, Op.ALLREDUCE_G, plan.num_slots
    for r in range(ranks):
        acts = plan.actions[r]
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
            if how is not None and sized:
                want = sizes.get((op, a.chunk))
                if want is None:
                    want = sizes[op, a.chunk] = plan.message_bytes(op, a.chunk)
                if a.bytes != want:
                    raise _fail(a, f"carries {a.bytes} bytes, {op.value} needs {want}")
            if op in framing:
                if op is not step and a.group != everyone:
                    raise _fail(a, "must span all ranks")
                continue
            if a.chunk is None or not 0 <= a.chunk < size:
                raise _fail(a, "needs a valid chunk")
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
