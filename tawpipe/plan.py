"""The plan as data: actions, the op table that says what each op does, and the Plan itself.

A plan is one iteration of training for every rank, written down in advance (design §4). It is
built by ``tawpipe.schedule`` (TawPipe and WeiPipe), checked by ``tawpipe.verify``, executed by
``tawpipe.executor`` and counted by ``tawpipe.traffic``. All four read the same op table,
``OPS``, so they cannot disagree about what an op reads, writes, or which channel runs it.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

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
    ALLREDUCE_STATS = "ALLREDUCE_STATS"
    STEP = "STEP"
    SEND_MASTER = "SEND_MASTER"
    RECV_MASTER = "RECV_MASTER"
    CHECK = "CHECK"


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


# ---------------------------------------------------------------------------------- the op table

# Named state besides the staging buffers an action names in ``buf``/``grad_buf`` (design §4.2):
ACC = "g_acc"  # the owner's float32 gradient accumulator of its own chunk
REP = "rep"  # the replicated modules' gradients and this rank's loss sum
STATS = "stats"  # the step's statistics (squared gradient norm, non-finite flag)
MASTER = "master"  # the float32 master of the own chunk (and of the replicated modules)

CHANNELS = ("compute", "weights", "grads", "replicated", "step")

Names = tuple[str, ...]


@dataclass(frozen=True)
class OpSpec:
    """What an op is, for everyone who handles plans (design §4.2).

    ``channel`` runs it (``compute`` is the calling thread; the others are in-order queues);
    ``transfer`` is how it moves bytes between ranks (``None``: it does not); ``kind`` is the
    traffic class it counts under. ``reads``/``writes`` name the state it touches: the engine
    orders work on those names by dataflow, ``verify`` proves that order safe.
    """

    channel: str
    transfer: str | None  # "send" | "recv" | "collective" | None
    kind: str | None  # "weights" | "grads" | "replicated" | "stats" | "state" | None
    reads: Callable[[Action, "Plan"], Names]
    writes: Callable[[Action, "Plan"], Names]

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


def _buf(a: Action, _p: "Plan") -> Names:
    return (a.buf,)


def _none(_a: Action, _p: "Plan") -> Names:
    return ()


def _f_writes(a: Action, p: "Plan") -> Names:
    return (REP,) if a.chunk == p.model_order[-1] else ()  # head + loss backward


def _b_reads(a: Action, _p: "Plan") -> Names:
    return (a.buf, a.grad_buf) if a.accumulate else (a.buf,)


def _b_writes(a: Action, p: "Plan") -> Names:
    return (a.grad_buf, REP) if a.chunk == p.model_order[0] else (a.grad_buf,)  # embedding backward


def _root_reads(a: Action, _p: "Plan") -> Names:
    return (a.buf,) if a.op is Op.REDUCE_G or a.root == a.rank else ()


def _bcast_writes(a: Action, _p: "Plan") -> Names:
    return () if a.root == a.rank else (a.buf,)


def _reduce_writes(a: Action, _p: "Plan") -> Names:
    return (a.buf,) if a.root == a.rank else ()


def _const(*names: str) -> Callable[[Action, "Plan"], Names]:
    return lambda _a, _p: names


OPS: dict[Op, OpSpec] = {
    Op.F: OpSpec("compute", None, None, _buf, _f_writes),
    Op.B: OpSpec("compute", None, None, _b_reads, _b_writes),
    # a cast of the own master, on the weights channel: right before the sends or broadcast that
    # read it, and off the compute thread (with host offload it is a stream from host memory)
    Op.LOAD_W: OpSpec("weights", None, None, _const(MASTER), _buf),
    Op.STEP: OpSpec("compute", None, None, _const(ACC, REP, STATS), _const(MASTER, ACC, REP)),
    Op.SEND_W: OpSpec("weights", "send", "weights", _buf, _none),
    # floats like every message (design §5.2): held in its queue place, a fetch also held back the
    # sends batched with it, which other groups were waiting for
    Op.RECV_W: OpSpec("weights", "recv", "weights", _none, _buf),
    Op.BCAST_W: OpSpec("weights", "collective", "weights", _root_reads, _bcast_writes),
    Op.REDUCE_G: OpSpec("grads", "collective", "grads", _root_reads, _reduce_writes),
    Op.SEND_G: OpSpec("grads", "send", "grads", _buf, _none),
    Op.RECV_G: OpSpec("grads", "recv", "grads", _none, _buf),
    # local arithmetic, but on the gradient channel: right after the receive it consumes, so the
    # compute side never waits for gradients
    Op.ACC_G: OpSpec("grads", None, None, lambda a, _p: (a.buf, ACC), _const(ACC)),
    Op.ALLREDUCE_REPLICATED: OpSpec("replicated", "collective", "replicated", _const(REP), _const(REP)),
    Op.ALLREDUCE_STATS: OpSpec("step", "collective", "stats", _const(ACC), _const(STATS)),
    Op.SEND_MASTER: OpSpec("step", "send", "state", _const(MASTER), _none),
    Op.RECV_MASTER: OpSpec("step", "recv", "state", _none, _buf),
    # every rank's fingerprint of its configuration, compared before the first step (an all-gather
    # written as an all-reduce of one row per rank)
    Op.CHECK: OpSpec("step", "collective", "setup", _none, _const("fingerprint")),
}

WEIGHT_OPS = frozenset({Op.LOAD_W, Op.SEND_W, Op.RECV_W, Op.BCAST_W, Op.F, Op.B})  # touch weight bufs
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
    batch: list[Action] = []
    for a in actions:
        spec = OPS[a.op]
        if batch and not (spec.is_p2p and a.slot == batch[0].slot and spec.channel == OPS[batch[0].op].channel):
            yield batch
            batch = []
        if spec.is_p2p:
            batch.append(a)
        else:
            yield [a]
    if batch:
        yield batch


H = TypeVar("H")


class Hazards(Generic[H]):
    """Dataflow order on named state (design §5.1): an action that reads a name waits for its last
    writer; one that writes it waits for the last writer and every reader since. ``H`` is whatever
    marks completion: engine handles, or action indices in ``verify``'s simulation."""

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


# ---------------------------------------------------------------------------------- the plan

ALGOS = ("tawpipe", "weipipe")
GRAD_ROUTES = ("rail", "leader")
_JSON_FORMAT = "tawpipe-plan/2"


@dataclass(frozen=True)
class Plan:
    """One iteration of the schedule for every rank, plus what is needed to interpret it.

    ``num_slots`` counts slots 0..num_slots-1 (the last holds the step's statistics and STEP);
    slot -1 is the prologue that loads the own chunk and stages the first weights. ``options``
    records the build parameters (``layer_numel``, ``weight_bytes``, ``grad_bytes``,
    ``replicated_numel``, ``prefetch_depth``, ``mb_per_fetch`` and, for TawPipe, ``grad_route``)
    so that byte counts can be checked and recomputed.
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

    @functools.cached_property
    def model_order(self) -> tuple[int, ...]:
        """Chunk ids in the order a micro-batch's forward visits them."""
        return tuple(sorted(range(len(self.chunk_layers)), key=lambda k: self.chunk_layers[k][0]))

    def own_chunk(self, rank: int) -> int:
        return self.owner.index(rank)

    def reads(self, a: Action) -> Names:
        return OPS[a.op].reads(a, self)

    def writes(self, a: Action) -> Names:
        return OPS[a.op].writes(a, self)

    def chunk_numel(self, chunk: int) -> int:
        start, stop = self.chunk_layers[chunk]
        return (stop - start) * int(self.options.get("layer_numel", 1))

    def message_bytes(self, op: Op, chunk: int | None) -> int:
        """Bytes a communication action of ``op`` on ``chunk`` carries (design §4.2)."""
        kind = OPS[op].kind
        if kind == "weights":
            return self.chunk_numel(chunk) * int(self.options.get("weight_bytes", 1))
        if kind == "grads":
            return self.chunk_numel(chunk) * int(self.options.get("grad_bytes", 1))
        if kind == "replicated":
            return int(self.options.get("replicated_numel", 0)) * int(self.options.get("grad_bytes", 1))
        if kind == "stats":
            return STATS_BYTES
        if kind == "state":
            return self.chunk_numel(chunk) * 4
        return 0  # "setup": sized by the engine's fingerprint

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
        """Markdown table of the schedule, slot by slot (design §3.3)."""
        from .tables import plan_table

        return plan_table(self)


STATS_BYTES = 16  # two float64: the squared gradient norm of the own chunk, the non-finite flag


def setup_program(plan: Plan, fingerprint_bytes: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions before the first step: one CHECK of the ranks' fingerprints. It has the
    same shape whatever the ranks' configurations are, so comparing them cannot hang."""
    everyone = tuple(range(plan.topology.world_size))
    return tuple((Action(-1, r, Op.CHECK, group=everyone, bytes=fingerprint_bytes),) for r in everyone)


def gather_program(plan: Plan, root: int = 0) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions that gather all float32 masters on ``root`` (``full_state_dict``);
    chunk k lands in its own buffer ``state{k}``, in model order."""
    n = plan.topology.world_size
    lists: list[list[Action]] = [[] for _ in range(n)]
    for k in plan.model_order:  # every owner sends once: tag 0
        o, nbytes = plan.owner[k], plan.chunk_numel(k) * 4
        if o != root:
            lists[o].append(Action(0, o, Op.SEND_MASTER, chunk=k, peer=root, bytes=nbytes, tag=0))
            lists[root].append(Action(0, root, Op.RECV_MASTER, chunk=k, peer=o, buf=f"state{k}", bytes=nbytes,
                                      tag=0))
    return tuple(tuple(acts) for acts in lists)
