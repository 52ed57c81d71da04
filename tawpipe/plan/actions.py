"""What an action is and what each op does: the vocabulary every plan is written in.

``OPS`` is the one op table (design §4.2): which channel runs an op, how it moves bytes, which
traffic kind it counts under, and which named state it reads and writes. The schedules, ``verify``,
the executor, the traffic accounting and the engine all read it, so they cannot disagree. The
channels and the names of the buffers a plan uses are defined here too, once.
"""

from __future__ import annotations

import contextlib
import enum
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from .plan import Plan

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
    ALLREDUCE_STATS = "ALLREDUCE_STATS"
    STEP = "STEP"
    SEND_MASTER = "SEND_MASTER"
    RECV_MASTER = "RECV_MASTER"
    CHECK = "CHECK"
    EVAL_F = "EVAL_F"
    ALLREDUCE_EVAL = "ALLREDUCE_EVAL"
    ALLREDUCE_G = "ALLREDUCE_G"
    STASH_W = "STASH_W"
    RESTORE_W = "RESTORE_W"


@dataclass(frozen=True, slots=True)
class Action:
    """One thing one rank does in one slot (slots: a large plan holds millions)."""

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
    tag: int | None = None  # SEND_*/RECV_*: the k-th message from src to dst on its channel

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


class _Unfrozen:
    """Action's slots without its frozen ``__setattr__``: ``new_action`` fills one and makes it an
    Action. A frozen dataclass sets each field through ``object.__setattr__``, five times slower
    than plain stores, and the schedules make millions of actions."""

    __slots__ = Action.__slots__


_new = object.__new__


def new_action(slot: int, rank: int, op: Op, chunk: int | None = None, mb: int | None = None,
               peer: int | None = None, root: int | None = None, group: tuple[int, ...] | None = None,
               buf: str | None = None, grad_buf: str | None = None, accumulate: bool = False, bytes: int = 0,
               tag: int | None = None) -> Action:
    """``Action(...)``, equal in every respect, made about four times faster: the same slots filled
    by plain stores, then the object's class set to Action (the two classes have one layout)."""
    a = _new(_Unfrozen)
    a.slot, a.rank, a.op, a.chunk, a.mb, a.peer, a.root = slot, rank, op, chunk, mb, peer, root
    a.group, a.buf, a.grad_buf, a.accumulate, a.bytes, a.tag = group, buf, grad_buf, accumulate, bytes, tag
    a.__class__ = Action
    return a  # type: ignore[return-value]


assert [f.name for f in fields(Action)] == list(_Unfrozen.__slots__), "new_action must fill every field of Action"


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Python's cycle collector paused, then as it was. Building and proving a plan allocate millions of
    objects and no cycles, and every collection would walk them again: 40% of a build's time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def settle() -> None:
    """Move every object the collector tracks to its oldest generation at once, where three
    collections would move what lives on, without walking it: for a plan of millions of actions
    just made, the first collection after ``no_gc`` would take seconds. Objects the caller froze
    (``gc.freeze``) would be unfrozen by it, so then it does nothing."""
    if gc.get_freeze_count() == 0:
        gc.freeze()  # every tracked object to the permanent generation, none walked ...
        gc.unfreeze()  # ... and back into the oldest one


# ---------------------------------------------------------------------------------- the op table

# Named state besides the staging buffers an action names in ``buf``/``grad_buf`` (design §4.2):
ACC = "g_acc"  # the owner's float32 gradient accumulator of its own chunk
REP = "rep"  # the replicated modules' gradients
LOSS = "loss"  # this rank's loss sum
STATS = "stats"  # the step's statistics (squared gradient norm, non-finite flag, loss sum)
MASTER = "master"  # the float32 master of the own chunk (and of the replicated modules)
FINGERPRINT = "fingerprint"  # every rank's configuration, compared before the first step
EVAL = "eval"  # a validation pass's hidden states and loss sum



class Channel(str, enum.Enum):
    """Who runs an op (design §5.2): the calling thread, or one of five in-order queues, each with
    its own thread, CUDA stream and communicator."""

    COMPUTE = "compute"
    WEIGHTS = "weights"
    GRADS = "grads"
    REPLICATED = "replicated"
    REPLICAS = "replicas"
    STEP = "step"

    def __str__(self) -> str:  # its name in labels, traces and records, on every Python version
        return self.value


QUEUES = tuple(c for c in Channel if c is not Channel.COMPUTE)  # the channels with a thread


class BufKind(str, enum.Enum):
    """What a staging buffer a plan names holds: weights in the compute dtype, gradients in the wire
    dtype, or a float32 master gathered from another rank (``gather_program``)."""

    WEIGHTS = "w"
    GRADS = "g"
    STATE = "state"


W_OWN = "w_own"  # the owner's compute-dtype copy of its own chunk
G_RECV = "g_recv"  # where an owner receives a routed gradient


def weight_buf(i: int) -> str:
    """The i-th weight staging buffer: ``w0 .. wd``."""
    return f"w{i}"


def host_buf(chunk: int) -> str:
    """Where a rank keeps chunk ``chunk``'s weights in its pinned host memory (``STASH_W``): one
    per chunk, named by the chunk, not by the action's ``buf``, which is the device buffer."""
    return f"host{chunk}"


def grad_buf(i: int) -> str:
    """The i-th gradient staging buffer: ``g0 .. gd``."""
    return f"g{i}"


def state_buf(chunk: int) -> str:
    """Where ``gather_program`` receives chunk ``chunk``'s master."""
    return f"state{chunk}"


def buf_kind(name: str) -> BufKind:
    """The kind of a buffer named by one of the functions above."""
    for kind in (BufKind.STATE, BufKind.WEIGHTS, BufKind.GRADS):  # "state" before a one-letter prefix
        if name.startswith(kind.value):
            return kind
    raise ValueError(f"{name!r} is not the name of a staging buffer")


# WeiPipe's F-ring ping-pongs between two weight buffers, and so does its B-ring (design §3.4).
WEIPIPE_F_BUFS = (weight_buf(0), weight_buf(1))
WEIPIPE_B_BUFS = (weight_buf(2), weight_buf(3))

Names = tuple[str, ...]


@dataclass(frozen=True)
class OpSpec:
    """What an op is, for everyone who handles plans (design §4.2).

    ``channel`` runs it (``compute`` is the calling thread; the others are in-order queues);
    ``transfer`` is how it moves bytes between ranks (``None``: it does not); ``kind`` is the
    traffic class it counts under. ``reads``/``writes`` name the state it touches: the engine
    orders work on those names by dataflow, ``verify`` proves that order safe. They may depend on
    an action's op, chunk, ``buf``, ``grad_buf``, ``accumulate`` and whether it is the root, and on
    nothing else of it: ``verify`` asks them once per distinct such key.
    """

    channel: Channel
    transfer: str | None  # "send" | "recv" | "collective" | None
    kind: str | None  # "weights" | "grads" | "replicated" | "replica" | "stats" | "state" | "setup" | "eval" | None
    reads: Callable[[Action, Plan], Names]
    writes: Callable[[Action, Plan], Names]
    always_overlaps: bool = False  # runs on its channel even with overlap=False (design §5.3)
    # whom a collective's ``group`` names: "node", a topology group inside one replica (another
    # replica's copy of the action names its own node); or "job", ranks of several replicas (every
    # rank, or a chunk's owners in every replica), the same group in every replica's copy
    scope: str = "node"

    @property
    def ordered(self) -> bool:
        """Keeps its place in its channel even where messages float (design §5.2): a collective,
        which every member must post in the same order."""
        return self.transfer == "collective"

    @property
    def is_comm(self) -> bool:
        return self.transfer is not None

    @property
    def is_p2p(self) -> bool:
        return self.transfer in ("send", "recv")


def _buf(a: Action, _p: Plan) -> Names:
    return (a.buf,)


def _none(_a: Action, _p: Plan) -> Names:
    return ()


def _f_writes(a: Action, p: Plan) -> Names:
    return (REP, LOSS) if a.chunk == p.model_order[-1] else ()  # head + loss backward


def _b_reads(a: Action, _p: Plan) -> Names:
    return (a.buf, a.grad_buf) if a.accumulate else (a.buf,)


def _b_writes(a: Action, p: Plan) -> Names:
    return (a.grad_buf, REP) if a.chunk == p.model_order[0] else (a.grad_buf,)  # embedding backward


def _root_reads(a: Action, _p: Plan) -> Names:
    return (a.buf,) if a.op is Op.REDUCE_G or a.root == a.rank else ()


def _bcast_writes(a: Action, _p: Plan) -> Names:
    return () if a.root == a.rank else (a.buf,)


def _reduce_writes(a: Action, _p: Plan) -> Names:
    return (a.buf,) if a.root == a.rank else ()


def _host(a: Action, _p: Plan) -> Names:
    return (host_buf(a.chunk),)  # type: ignore[arg-type]


def _const(*names: str) -> Callable[[Action, Plan], Names]:
    return lambda _a, _p: names


OPS: dict[Op, OpSpec] = {
    Op.F: OpSpec(Channel.COMPUTE, None, None, _buf, _f_writes),
    Op.B: OpSpec(Channel.COMPUTE, None, None, _b_reads, _b_writes),
    # a cast of the own master, on the weights channel: right before the sends or broadcast that
    # read it, and off the compute thread (with host offload it is a stream from host memory)
    Op.LOAD_W: OpSpec(Channel.WEIGHTS, None, None, _const(MASTER), _buf),
    Op.STEP: OpSpec(Channel.COMPUTE, None, None, _const(ACC, REP, STATS), _const(MASTER, ACC, REP, LOSS)),
    Op.SEND_W: OpSpec(Channel.WEIGHTS, "send", "weights", _buf, _none),
    # floats like every message (design §5.2): held in its queue place, a fetch also held back the
    # sends batched with it, which other groups were waiting for
    Op.RECV_W: OpSpec(Channel.WEIGHTS, "recv", "weights", _none, _buf),
    Op.BCAST_W: OpSpec(Channel.WEIGHTS, "collective", "weights", _root_reads, _bcast_writes),
    Op.REDUCE_G: OpSpec(Channel.GRADS, "collective", "grads", _root_reads, _reduce_writes),
    Op.SEND_G: OpSpec(Channel.GRADS, "send", "grads", _buf, _none),
    Op.RECV_G: OpSpec(Channel.GRADS, "recv", "grads", _none, _buf),
    # local arithmetic, but on the gradient channel: right after the receive it consumes, so the
    # compute side never waits for gradients
    Op.ACC_G: OpSpec(Channel.GRADS, None, None, lambda a, _p: (a.buf, ACC), _const(ACC)),
    # its members join at different slots (each right after its last B), so it runs on its own
    # channel even where every other transfer is waited for at once (design §5.3)
    Op.ALLREDUCE_REPLICATED: OpSpec(Channel.REPLICATED, "collective", "replicated", _const(REP), _const(REP),
                                    always_overlaps=True, scope="job"),
    # replicas (design §3.5): a chunk's owners, one per replica, add up their float32 accumulators
    # once the replica's last contribution is in; on its own channel, so the rest of the backward
    # goes on meanwhile
    Op.ALLREDUCE_G: OpSpec(Channel.REPLICAS, "collective", "replica", _const(ACC), _const(ACC), scope="job"),
    Op.ALLREDUCE_STATS: OpSpec(Channel.STEP, "collective", "stats", _const(ACC, LOSS), _const(STATS), scope="job"),
    Op.SEND_MASTER: OpSpec(Channel.STEP, "send", "state", _const(MASTER), _none),
    Op.RECV_MASTER: OpSpec(Channel.STEP, "recv", "state", _none, _buf),
    # every rank's fingerprint of its configuration, compared before the first step (an all-gather
    # written as an all-reduce of one row per rank)
    Op.CHECK: OpSpec(Channel.STEP, "collective", "setup", _none, _const(FINGERPRINT), scope="job"),
    # validation (``eval_program``): a forward of one chunk for every batch, no gradients, then the
    # loss sums of every rank added up
    Op.EVAL_F: OpSpec(Channel.COMPUTE, None, None, lambda a, _p: (a.buf, EVAL), _const(EVAL)),
    Op.ALLREDUCE_EVAL: OpSpec(Channel.STEP, "collective", "eval", _const(EVAL), _const(EVAL), scope="job"),
    # reuse_weights="host" (design §3.2): a fetched chunk needed again after its buffer is refilled
    # is copied to this rank's pinned host memory right after the fetch, and comes back over PCIe,
    # not over the network, for its later uses; on the weights channel, in order with the fetches
    Op.STASH_W: OpSpec(Channel.WEIGHTS, None, None, _buf, _host),
    Op.RESTORE_W: OpSpec(Channel.WEIGHTS, None, None, _host, _buf),
}

WEIGHT_OPS = frozenset({Op.LOAD_W, Op.SEND_W, Op.RECV_W, Op.BCAST_W, Op.F, Op.B, Op.STASH_W, Op.RESTORE_W})  # touch weight bufs
GRAD_OPS = frozenset({Op.REDUCE_G, Op.SEND_G, Op.RECV_G, Op.ACC_G})  # touch gradient bufs


class PlanError(Exception):
    """A plan that would compute wrong gradients, deadlock, or break the engine contract."""


def describe(a: Action) -> str:
    """One-line human description of an action, used in error messages."""
    spec = OPS[a.op]
    parts = [f"slot {a.slot} rank {a.rank} {a.op.value}"]
    if a.chunk is not None:
        parts.append(f"W{a.chunk}" if a.op in WEIGHT_OPS and a.op is not Op.B else f"chunk {a.chunk}")
    if a.mb is not None:
        parts.append(f"m{a.mb}")
    if a.peer is not None:
        parts.append(f"{'to' if spec.transfer == 'send' else 'from'} r{a.peer}")
    if a.root is not None:
        parts.append(f"root r{a.root}")
    if a.group is not None:
        parts.append(f"group {list(a.group)}")
    if a.buf is not None:
        parts.append(f"[{a.buf}]")
    if a.grad_buf is not None:
        parts.append(f"grad->[{a.grad_buf}]{' +=' if a.accumulate else ''}")
    if spec.is_comm:
        parts.append(f"{a.bytes} B")
    return " ".join(parts)


def batches(actions: Sequence[Action]) -> Iterator[list[Action]]:
    """A rank's actions in execution units: consecutive point-to-point actions of one slot on one
    channel form one batch, posted together (design §5.2); every other action is a unit alone.
    A batch's messages carry tags: the k-th message from one rank to another on a channel has
    tag k, so a backend may also post each one as soon as it is ready (design §5.2)."""
    start = 0
    while start < len(actions):
        end = batch_end(actions, start)
        yield list(actions[start:end])
        start = end


def batch_end(actions: Sequence[Action], start: int) -> int:
    """Where the unit that begins at ``start`` ends (``batches``' rule, for those who walk a list
    by index)."""
    spec = OPS[actions[start].op]
    end = start + 1
    if spec.is_p2p:
        slot, channel = actions[start].slot, spec.channel
        while end < len(actions) and OPS[actions[end].op].is_p2p and actions[end].slot == slot and \
                OPS[actions[end].op].channel == channel:
            end += 1
    return end


H = TypeVar("H")


class Hazards(Generic[H]):
    """Dataflow order on named state (design §5.1): an action that reads a name waits for its last
    writer; one that writes it waits for the last writer and every reader since. ``H`` is whatever
    marks completion: engine handles, or unit indices in the tests' plain reference model."""

    def __init__(self) -> None:
        self.writer: dict[str, H] = {}
        self.readers: dict[str, list[H]] = {}

    def deps(self, reads: Names, writes: Names) -> list[H]:
        out = [self.writer[b] for b in (*reads, *writes) if b in self.writer]
        for b in writes:
            out.extend(self.readers.get(b, ()))
        return out

    def record(self, done: H, reads: Names, writes: Names) -> None:
        for b in writes:
            self.writer[b] = done
            self.readers[b] = []
        for b in reads:
            if b not in writes:
                self.readers.setdefault(b, []).append(done)
