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

from collections import Counter, deque
from dataclasses import dataclass

from .actions import GRAD_OPS, OPS, WEIGHT_OPS, Action, Channel, Hazards, Op, PlanError, batches, describe
from .plan import Plan, Programs, shift

EXHAUSTIVE_ACTIONS = 200_000  # above this many actions in all, a plan of replicas is proven on replica 0

_SENDS = frozenset(op for op, s in OPS.items() if s.transfer == "send")
_RECVS = frozenset(op for op, s in OPS.items() if s.transfer == "recv")
_PAIRS = {(Op.SEND_W, Op.RECV_W), (Op.SEND_G, Op.RECV_G), (Op.SEND_MASTER, Op.RECV_MASTER)}


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
        gmax = max(len({a.grad_buf if a.op is Op.B else a.buf for a in r if a.op is Op.B or a.op in GRAD_OPS})
                   for r in acts)
        if self.plan.algo == "tawpipe":
            limit = 2 + int(self.plan.options.get("prefetch_depth", 1))
            if wmax > limit:
                raise PlanError(f"a rank uses {wmax} weight buffers; this TawPipe plan needs at most "
                                f"{limit} (w_own + prefetch_depth + 1)")
        return VerifyReport(
            actions=sum(len(r) for r in acts), p2p_messages=self.p2p, collectives=self.collectives,
            weight_buffers=wmax, grad_buffers=gmax,
            contributions=sum(len(x) for x in self.accum[:self.plan.replica_size]), ranks_run=self.n,
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
        r, bufs = a.rank, self.bufs[a.rank]
        if a.op is Op.LOAD_W:
            if self.plan.own_chunk(r) != a.chunk:
                raise _fail(a, f"loads W{a.chunk} but the rank owns W{self.plan.own_chunk(r)}")
            bufs[a.buf] = _Content(a.chunk, None, a)
        elif a.op is Op.F:
            self._weight(a, a.buf)
            self.computes[r].append(a)
        elif a.op is Op.B:
            self._weight(a, a.buf)
            self.computes[r].append(a)
            mine = ((a.chunk, r, a.mb),)
            if a.accumulate:
                bufs[a.grad_buf] = _Content(a.chunk, self._grad(a, a.grad_buf).items + mine, a)
            else:
                self._overwrite(a, a.grad_buf)
                bufs[a.grad_buf] = _Content(a.chunk, mine, a)
        elif a.op is Op.ACC_G:
            if self.plan.own_chunk(r) != a.chunk:
                raise _fail(a, f"accumulates chunk {a.chunk} but the rank owns chunk {self.plan.own_chunk(r)}")
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
        if s.op is Op.SEND_W:
            self._weight(s, s.buf)
            self.bufs[d.rank][d.buf] = _Content(s.chunk, None, d)
        elif s.op is Op.SEND_G:
            c = self._grad(s, s.buf)
            self._overwrite(d, d.buf)
            c.consumed = True
            self.bufs[d.rank][d.buf] = _Content(c.chunk, c.items, d)
        self.p2p += 1

    def _check_collective(self, acts: list[Action]) -> None:
        a0 = acts[0]
        # members of the replicated all-reduce join it at different slots (after their last B), and
        # so do a chunk's owners in the replicas (after their last ACC_G)
        slot = None if a0.op in (Op.ALLREDUCE_REPLICATED, Op.ALLREDUCE_G) else a0.slot
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
            size, total = self.plan.replica_size, []
            if self.exhaustive:  # every owner adds the others' accumulators
                for a in acts:
                    total += self.accum[a.rank]
            else:  # replica 0's owner alone: the others' contributions are the shifts of its own
                total = [(k, d + i * size, m) for i in range(self.plan.replicas) for k, d, m in self.accum[a0.rank]]
            for a in acts:
                self.accum[a.rank] = list(total)
        self.collectives += 1

    # ------------------------------------------------------------------ execution models

    def run_serial(self) -> None:
        """Blocking execution, one action at a time; the replicated all-reduce keeps its channel."""
        units, deps = self._units(batched=False)
        own_channel = {s.channel for s in OPS.values() if s.always_overlaps}
        inline = frozenset(c for c in Channel if c not in own_channel)
        _Simulation(self, units, deps, inline, contents=True).run("serial")

    def run_channels(self) -> None:
        """The engine's model: compute thread + one in-order queue per channel, dataflow waits."""
        units, deps = self._units(batched=True)
        _Simulation(self, units, deps, frozenset({Channel.COMPUTE}), contents=False).run("channels")

    def _units(self, batched: bool) -> tuple[list[list[list[Action]]], list[list[set[int]]]]:
        """Every rank's units (P2P batches, or single actions) and each unit's dependencies."""
        units, deps = [], []
        for acts in self.plan.actions[:self.n]:
            hz: Hazards[int] = Hazards()
            rank_units = list(batches(acts)) if batched else [[a] for a in acts]
            rank_deps = []
            for ui, unit in enumerate(rank_units):
                rw = [(self.plan.reads(a), self.plan.writes(a)) for a in unit]
                rank_deps.append({d for r, w in rw for d in hz.deps(r, w)})
                for r, w in rw:
                    hz.record(ui, r, w)
            units.append(rank_units)
            deps.append(rank_deps)
        return units, deps

    def _check_contributions(self) -> None:
        n, acc = self.plan.topology.world_size, self.plan.micro_batches
        for r in range(self.n):
            k = self.plan.own_chunk(r)
            expected = Counter((k, d, m) for d in range(n) for m in range(acc))
            got = Counter(self.accum[r])
            if got != expected:
                missing = sorted((expected - got).elements())[:4]
                extra = sorted((got - expected).elements())[:4]
                raise PlanError(
                    f"rank {r} (owner of chunk {k}) accumulated {sum(got.values())} gradient "
                    f"contributions instead of {n * acc}; missing (chunk, device, mb) {missing}, "
                    f"unexpected or duplicated {extra}"
                )


class _Simulation:
    """Runs units of actions per rank until everything has finished or nothing can move.

    A rank's units are consumed in order by its *driver* (the compute thread). Units on the
    channels in ``inline`` run on the driver, blocking it; the others go to their channel's queue
    and the driver moves on. A queued unit starts when
    its dependencies (unit indices of the same rank, ``deps``) are done. Its transfers complete
    one at a time: a send meets the matching receive at the head of the peer's queue on the same
    channel; a collective completes when every member is at it. In the serial model the
    simulation also tracks buffer contents (``Verifier``); in the channel model it only checks
    that transfers pair up and that nothing deadlocks.
    """

    def __init__(self, v: Verifier, units: list[list[list[Action]]], deps: list[list[set[int]]],
                 inline: frozenset[str], contents: bool) -> None:
        self.v, self.units, self.deps, self.inline, self.contents = v, units, deps, inline, contents
        n = len(units)
        self.pc = [0] * n
        self.done = [[False] * len(u) for u in units]
        self.queues: list[dict[str, deque[int]]] = [{} for _ in range(n)]
        self.pos = [[0] * len(u) for u in units]  # next action inside each unit
        self.colls: Counter[tuple] = Counter()  # completed collectives per (rank, channel, group)
        self.arrived: dict[tuple, set[int]] = {}
        self.groups: dict[tuple[int, ...], tuple[int, ...]] = {}  # a group -> its simulated members

    def _queued(self, a: Action) -> bool:
        return OPS[a.op].channel not in self.inline

    def _ready(self, r: int, u: int) -> bool:
        return all(self.done[r][d] for d in self.deps[r][u])

    def run(self, model: str) -> None:
        n = len(self.units)
        work, queued = deque(range(n)), [True] * n
        while work:
            r = work.popleft()
            queued[r] = False
            for peer in self._advance(r):
                if not queued[peer]:
                    queued[peer] = True
                    work.append(peer)
        stuck = []
        for r in range(n):
            u = next((u for u, d in enumerate(self.done[r]) if not d), None)
            if u is not None:
                stuck.append(self.units[r][u][self.pos[r][u]])
        if stuck:
            shown = "; ".join(describe(a) for a in stuck[:8])
            raise PlanError(f"deadlock in the {model} model: {len(stuck)} ranks blocked, e.g. {shown}")

    def _advance(self, r: int) -> set[int]:
        """Move rank r as far as it can go; returns the ranks that may now move too."""
        woken: set[int] = set()
        units, progress = self.units[r], True
        while progress:
            progress = False
            while self.pc[r] < len(units):  # the driver
                u = self.pc[r]
                if self._queued(units[u][0]):
                    self.queues[r].setdefault(OPS[units[u][0].op].channel, deque()).append(u)
                elif not (self._ready(r, u) and self._finish(r, u, woken)):
                    break
                self.pc[r] += 1
                progress = True
            for q in self.queues[r].values():  # the channels
                while q and self._ready(r, q[0]) and self._finish(r, q[0], woken):
                    q.popleft()
                    progress = True
        return woken

    def _finish(self, r: int, u: int, woken: set[int]) -> bool:
        """Run unit u of rank r as far as peers allow; True once all of it is done."""
        unit, pos = self.units[r][u], self.pos[r]
        while pos[u] < len(unit):
            a = unit[pos[u]]
            spec = OPS[a.op]
            if not spec.is_comm:
                if self.contents:
                    self.v._local(a)
                pos[u] += 1
            elif not (self._meet(r, u, a, woken) if spec.is_p2p else self._gather(r, u, a, woken)):
                return False
        self.done[r][u] = True
        return True

    def _blocked_at(self, r: int, a: Action) -> tuple[int, Action] | None:
        """(unit, action) where rank r waits on a's channel, if it waits there."""
        if self._queued(a):
            q = self.queues[r].get(OPS[a.op].channel)
            if not q or not self._ready(r, q[0]):
                return None
            u = q[0]
        else:
            u = self.pc[r]
            if u >= len(self.units[r]) or self._queued(self.units[r][u][0]) or not self._ready(r, u):
                return None
        if self.pos[r][u] >= len(self.units[r][u]):  # finished; its rank has yet to notice
            return None
        return u, self.units[r][u][self.pos[r][u]]

    def _meet(self, r: int, u: int, a: Action, woken: set[int]) -> bool:
        head = self._blocked_at(a.peer, a)
        if head is None:
            return False
        pu, b = head
        if b.peer != r or not OPS[b.op].is_p2p or OPS[b.op].transfer == OPS[a.op].transfer:
            return False
        s, d = (a, b) if a.op in _SENDS else (b, a)
        if self.contents:
            self.v._transfer(s, d)
        else:
            self.v._pair(s, d)
        self.pos[r][u] += 1
        self.pos[a.peer][pu] += 1
        woken.add(a.peer)
        return True

    def _gather(self, r: int, u: int, a: Action, woken: set[int]) -> bool:
        channel = OPS[a.op].channel
        group = self.groups.get(a.group)
        if group is None:  # the members simulated: every replica's copy reaches it with them
            group = self.groups[a.group] = tuple(m for m in a.group if m < len(self.units))
        key = (channel, group, self.colls[(r, channel, group)])
        members = self.arrived.setdefault(key, set())
        members.add(r)
        if len(members) < len(group):
            return False
        heads = [(u, a) if m == r else self._blocked_at(m, a) for m in group]
        if any(h is None or OPS[h[1].op].transfer != "collective" for h in heads):
            return False
        acts = [b for _, b in heads]
        if self.contents:
            self.v._collective(acts)
        else:
            self.v._check_collective(acts)
        del self.arrived[key]
        for m, (mu, _) in zip(group, heads):
            self.pos[m][mu] += 1
            self.colls[(m, channel, group)] += 1
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
    for r in range(ranks):
        acts = plan.actions[r]
        _check_rank_frame(plan, r, acts)
        _check_tags(acts)
        prev_slot = -1
        home = range(plan.replica_of(r) * size, (plan.replica_of(r) + 1) * size)
        for a in acts:
            if a.rank != r:
                raise _fail(a, f"is in the list of rank {r}")
            if not -1 <= a.slot < plan.num_slots or a.slot < prev_slot:
                raise _fail(a, f"slot out of order or outside -1..{plan.num_slots - 1}")
            prev_slot = a.slot
            spec = OPS[a.op]
            if spec.is_comm and "layer_numel" in plan.options:
                want = plan.message_bytes(a.op, a.chunk)
                if a.bytes != want:
                    raise _fail(a, f"carries {a.bytes} bytes, {a.op.value} needs {want}")
            if a.op in (Op.STEP, Op.ALLREDUCE_REPLICATED, Op.ALLREDUCE_STATS):
                if a.op is not Op.STEP and a.group != everyone:
                    raise _fail(a, "must span all ranks")
                continue
            if a.chunk is None or not 0 <= a.chunk < size:
                raise _fail(a, "needs a valid chunk")
            if a.op is Op.ALLREDUCE_G:
                if a.chunk != plan.own_chunk(r) or a.group != plan.owners(a.chunk):
                    raise _fail(a, f"must add the rank's own chunk {plan.own_chunk(r)} with its owners in every "
                                   f"replica {list(plan.owners(plan.own_chunk(r)))}")
                continue
            if a.buf is None:
                raise _fail(a, "needs a buffer")
            if a.op in (Op.F, Op.B):
                if a.mb is None or not 0 <= a.mb < acc:
                    raise _fail(a, f"micro-batch outside 0..{acc - 1}")
                if a.op is Op.B and a.grad_buf is None:
                    raise _fail(a, "has no grad_buf")
            elif spec.is_p2p:
                if a.peer is None or a.peer not in home or a.peer == r:
                    raise _fail(a, f"needs a peer rank other than itself in its replica ({home.start}..{home.stop - 1})")
            elif spec.transfer == "collective":
                g = topo.group_of(r)
                if a.group != topo.group_ranks(g) or a.root not in a.group:
                    raise _fail(a, f"must span exactly group {g} {list(topo.group_ranks(g))} with a root in it")


def _check_shifts(plan: Plan) -> None:
    """Every replica's lists are replica 0's, shifted: by construction for ``Programs``, else
    checked action by action."""
    if isinstance(plan.actions, Programs) and list(plan.actions.template) == list(plan.actions[:plan.replica_size]):
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
    count: Counter[tuple[str, str | None, int | None]] = Counter()
    for a in acts:
        spec = OPS[a.op]
        if spec.is_p2p:
            key = (spec.channel, spec.transfer, a.peer)
            if a.tag != count[key]:
                raise _fail(a, f"has tag {a.tag}; as message {count[key]} to/from rank {a.peer} on the "
                               f"{spec.channel} channel it needs tag {count[key]}")
            count[key] += 1


def _check_rank_frame(plan: Plan, r: int, acts: tuple[Action, ...]) -> None:
    """One replicated all-reduce after the last B; with replicas, one gradient all-reduce after the
    last ACC_G; the statistics, then STEP, close the list."""
    ops = [a.op for a in acts]
    exchanges = [i for i, op in enumerate(ops) if op is Op.ALLREDUCE_G]
    if len(exchanges) != (plan.replicas > 1):
        raise PlanError(f"rank {r} has {len(exchanges)} ALLREDUCE_G actions; a plan of {plan.replicas} replica(s) "
                        f"needs {int(plan.replicas > 1)}")
    accs = [i for i, op in enumerate(ops) if op is Op.ACC_G]
    if exchanges and accs and exchanges[0] < accs[-1]:
        raise _fail(acts[exchanges[0]], "comes before the rank's last ACC_G: a contribution would miss the "
                                        "other replicas")
    allreduce = [i for i, op in enumerate(ops) if op is Op.ALLREDUCE_REPLICATED]
    backs = [i for i, op in enumerate(ops) if op is Op.B]
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
