"""The static checks of a plan: every rank's list read once, each action's fields, frames, tags
and the replicas' shifts, before anything runs (``verify``'s first step, design §5.3).

A plan of millions of actions costs more in memory traffic than in checks, so ``_Screen`` makes
every check in one pass over a list and keeps what the simulations need (the buffers and the
messages a rank uses); only a list it refuses is read again, by ``_check_rank``, which names the
first fault.
"""

from __future__ import annotations

from dataclasses import dataclass

from .actions import GRAD_OPS, OPS, WEIGHT_OPS, Action, Op, PlanError, describe
from .plan import Plan, Programs, shift

_TRANSFER = {op: s.transfer for op, s in OPS.items()}  # a plain dict: OpSpec's properties cost a call each
_P2P = ("send", "recv")
_ROUTE = {op: (s.channel, s.transfer) for op, s in OPS.items() if s.is_p2p}  # how tags count a message
_NAMES = {op: (s.reads, s.writes) for op, s in OPS.items()}  # the names an op reads and writes (OpSpec)
# the ops the hot loops compare with, looked up once (``Op.X`` costs a descriptor call per use)
_F, _B, _ACC_G = Op.F, Op.B, Op.ACC_G


def _fail(a: Action, msg: str) -> PlanError:
    return PlanError(f"{describe(a)}: {msg}")


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

    def __call__(self, r: int, acts: tuple[Action, ...]) -> _Seen | None:
        """What rank ``r``'s list uses, or None where any check fails (``_check_rank`` then names
        it). The loop keeps the common actions inline; the few framing and exchange actions of a
        list are counted by ``_Frame``."""
        plan, topo = self.plan, self.plan.topology
        size, acc, num_slots = plan.replica_size, plan.micro_batches, plan.num_slots
        home = range(plan.replica_of(r) * size, (plan.replica_of(r) + 1) * size)
        node = topo.group_ranks(topo.group_of(r))
        category, nbytes, weights, grads, route = _CATEGORY, self.bytes, WEIGHT_OPS, GRAD_OPS, _ROUTE
        frame = _Frame(self, r)
        wbufs: set = set()
        gbufs: set = set()
        messages: dict = {}
        overlapping: dict = {}
        tags: dict = {}
        batch = _Batch(plan)
        prev = i = last_b = last_acc = -1
        for a in acts:
            i += 1
            op = a.op
            slot = a.slot
            if a.rank != r or slot < prev or slot >= num_slots:
                return None
            prev = slot
            cat = category[op]
            if cat == _COMPUTE:
                chunk, mb, buf = a.chunk, a.mb, a.buf
                if chunk is None or not 0 <= chunk < size or buf is None or mb is None or not 0 <= mb < acc:
                    return None
                wbufs.add(buf)
                if op is _B:
                    if a.grad_buf is None:
                        return None
                    gbufs.add(a.grad_buf)
                    last_b = i
                continue
            if cat == _FRAMING:
                if not frame.framing(a, i, overlapping):
                    return None
                continue
            chunk = a.chunk
            if chunk is None or not 0 <= chunk < size:
                return None
            table = nbytes[op]
            if table is not None and a.bytes != table[chunk]:
                return None
            if cat == _EXCHANGE:
                if not frame.exchange(a, i):
                    return None
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
                names = _names_key(a)
                messages.setdefault(names, a)
                if batch.clash(a, i, names) is not None:
                    return None
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
        return _Seen(wbufs, gbufs, messages, overlapping) if frame.complete(acts, last_b, last_acc) else None


class _Batch:
    """The batch a list's messages are in, met one message at a time: a batch's messages are posted
    together (design §5.2), so none of them may touch a name that another of them writes (a send
    would read what a receive is overwriting)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.names: dict = {}  # (reads, writes) per ``_names_key``
        self.end = self.slot = -1
        self.channel = None
        self.reads: dict = {}
        self.writes: dict = {}

    def clash(self, a: Action, i: int, key: tuple | None = None) -> tuple[str, Action] | None:
        """Message ``a``, the ``i``-th action of the list: a name it shares with an earlier message
        of its batch, one of them writing it, and that message; or None. ``key``: ``_names_key(a)``,
        where the caller has it."""
        channel = _ROUTE[a.op][0]
        if i != self.end + 1 or a.slot != self.slot or channel is not self.channel:
            self.slot, self.channel, self.reads, self.writes = a.slot, channel, {}, {}
        self.end = i
        key = _names_key(a) if key is None else key
        rw = self.names.get(key)
        if rw is None:
            reads, writes = _NAMES[a.op]
            rw = self.names[key] = (reads(a, self.plan), writes(a, self.plan))
        reads, writes = rw
        for name in reads:
            if name in self.writes:
                return name, self.writes[name]
        for name in writes:
            other = self.writes.get(name) or self.reads.get(name)
            if other is not None:
                return name, other
        for name in reads:
            self.reads.setdefault(name, a)
        for name in writes:
            self.writes.setdefault(name, a)
        return None


class _Frame:
    """What frames a rank's list, counted as ``_Screen`` meets it: one statistics all-reduce and one
    step at its end, one replicated all-reduce after its last backward, and (with replicas) its
    own chunk's exchange after its last accumulation."""

    def __init__(self, screen: _Screen, r: int) -> None:
        self.plan, self.sized, self.everyone, self.r = screen.plan, screen.sized, screen.everyone, r
        self.first_exchange = self.first_allreduce = -1
        self.exchanges = self.allreduces = self.stats = self.steps = 0

    def framing(self, a: Action, i: int, overlapping: dict) -> bool:
        """A step, a statistics or a replicated all-reduce: counted; whether it is well formed."""
        op = a.op
        if self.sized and OPS[op].transfer and a.bytes != self.plan.message_bytes(op, a.chunk):
            return False
        if op is Op.STEP:
            self.steps += 1
        else:
            if a.group != self.everyone:
                return False
            if op is Op.ALLREDUCE_STATS:
                self.stats += 1
            else:
                self.allreduces += 1
                if self.first_allreduce < 0:
                    self.first_allreduce = i
        if op in _OVERLAPS:
            overlapping.setdefault(_names_key(a), a)
        return True

    def exchange(self, a: Action, i: int) -> bool:
        """The own chunk's exchange across replicas: counted; whether it is this rank's."""
        if a.chunk != self.plan.own_chunk(self.r) or a.group != self.plan.owners(a.chunk):
            return False
        self.exchanges += 1
        if self.first_exchange < 0:
            self.first_exchange = i
        return True

    def complete(self, acts: tuple[Action, ...], last_b: int, last_acc: int) -> bool:
        """Whether the counts and positions make one whole frame (``last_b``, ``last_acc``: the
        list's last backward and last accumulation)."""
        return not (self.exchanges != (self.plan.replicas > 1) or 0 <= self.first_exchange < last_acc
                    or self.allreduces != 1 or self.first_allreduce < last_b or self.stats != 1
                    or self.steps != 1 or len(acts) < 2 or acts[-2].op != Op.ALLREDUCE_STATS
                    or acts[-1].op != Op.STEP)


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
    _check_batches(plan, acts)
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


def _check_batches(plan: Plan, acts: tuple[Action, ...]) -> None:
    """A batch's messages are posted together (design §5.2): none may touch a name another writes."""
    batch = _Batch(plan)
    for i, a in enumerate(acts):
        if a.op in _ROUTE:
            clash = batch.clash(a, i)
            if clash is not None:
                name, other = clash
                raise _fail(a, f"touches {name}, which {describe(other)} of the same batch (slot {a.slot}, "
                               f"{_ROUTE[a.op][0].value} channel) also touches, one of them writing it: a batch's "
                               "messages are posted together, so give them different buffers or slots")


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
