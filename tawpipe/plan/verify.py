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

from collections import Counter
from dataclasses import dataclass

from . import registry
from .actions import OPS, Action, Channel, Names, Op, PlanError, describe, host_buf, no_gc
from .execution import _Simulation
from .plan import Plan
from .screen import _ACC_G, _B, _F, _check_compute_order, _check_shifts, _check_static, _fail, _Seen

EXHAUSTIVE_ACTIONS = 200_000  # above this many actions in all, a plan of replicas is proven on replica 0
# above this many actions simulated, the channel model's liveness is derived from the serial run
# (design §5.3) instead of simulated: every plan the engine proves itself is below it
CHANNEL_ACTIONS = 1_000_000

_PAIRS = {(Op.SEND_W, Op.RECV_W), (Op.SEND_G, Op.RECV_G), (Op.SEND_MASTER, Op.RECV_MASTER)}
# members of the replicated all-reduce join it at different slots (after their last B), and so do
# a chunk's owners in the replicas (after their last ACC_G)
_ANY_SLOT = frozenset({Op.ALLREDUCE_REPLICATED, Op.ALLREDUCE_G})
# the ops the hot loops compare with, looked up once (``Op.X`` costs a descriptor call per use)
_LOAD_W, _SEND_W, _SEND_G = Op.LOAD_W, Op.SEND_W, Op.SEND_G
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
        elif op is Op.STASH_W:  # the chunk a device buffer holds, kept in host memory
            self._weight(a, a.buf)  # type: ignore[arg-type]
            self.bufs[a.rank][host_buf(a.chunk)] = (a.chunk, a)  # type: ignore[arg-type]
        elif op is Op.RESTORE_W:  # and brought back into a device buffer
            self._weight(a, host_buf(a.chunk))  # type: ignore[arg-type]
            self.bufs[a.rank][a.buf] = (a.chunk, a)  # type: ignore[index]

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
