"""The plan: one iteration of training for every rank, written down in advance (design §4).

It is built by ``schedule`` (TawPipe and WeiPipe), proven by ``verify``, printed by ``tables``,
counted by ``tawpipe.cost.memory`` and executed by ``tawpipe.runtime``; what each action means is the op
table in ``actions``. A plan is plain data: it prints, and it round-trips through JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from .actions import ACC, MASTER, OPS, Action, Names, Op
from .tables import plan_table
from .topology import Topology

GRAD_ROUTES = ("rail", "leader")
_JSON_FORMAT = "tawpipe-plan/3"
_JSON_FORMAT_ONE_REPLICA = "tawpipe-plan/2"  # before replicas: still read
STATS_BYTES = 24  # three float64: the squared gradient norm of the own chunk, the non-finite flag, the loss sum
EVAL_BYTES = 16  # two float64: a rank's validation loss sum and its count of batches
# With the own chunk's state on the host, STEP steps it in about this many pieces (at parameter
# boundaries), each loading its part of ``Plan.carried_load`` once stepped: all but the last
# piece's load hides behind the step (design §6.1; the engine's ``host_step``, the simulator's play).
STEP_PIECES = 8


def shift(a: Action, offset: int) -> Action:
    """Replica 0's action ``a`` as the rank ``offset`` ranks further runs it, in its own replica."""
    node = OPS[a.op].scope == "node"
    return dataclasses.replace(
        a, rank=a.rank + offset,
        peer=None if a.peer is None else a.peer + offset,
        root=None if a.root is None else a.root + offset,
        group=tuple(m + offset for m in a.group) if node and a.group is not None else a.group,
    )


class Programs(Sequence[tuple[Action, ...]]):
    """Every rank's action list, replica by replica: replica 0's lists are held, and another
    replica's are replica 0's shifted by whole replicas, made when first asked for (design §3.5).
    A rank that runs the plan makes only its own list; ``verify`` proves replica 0's."""

    def __init__(self, template: Sequence[tuple[Action, ...]], replicas: int) -> None:
        self.template, self.replicas = tuple(template), replicas
        self._made: dict[int, tuple[Action, ...]] = {}

    def __len__(self) -> int:
        return len(self.template) * self.replicas

    @overload
    def __getitem__(self, rank: int) -> tuple[Action, ...]: ...
    @overload
    def __getitem__(self, rank: slice) -> Sequence[tuple[Action, ...]]: ...
    def __getitem__(self, rank: int | slice) -> Any:
        if isinstance(rank, slice):
            return tuple(self[r] for r in range(len(self))[rank])
        if not -len(self) <= rank < len(self):
            raise IndexError(f"rank {rank} is outside 0..{len(self) - 1}")
        rank %= len(self)
        replica, local = divmod(rank, len(self.template))
        if replica == 0:
            return self.template[local]
        if rank not in self._made:
            self._made[rank] = tuple(shift(a, replica * len(self.template)) for a in self.template[local])
        return self._made[rank]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Programs):
            return (self.template, self.replicas) == (other.template, other.replicas)
        return isinstance(other, Sequence) and len(other) == len(self) and all(
            tuple(x) == y for x, y in zip(other, self))

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Plan:
    """One iteration of the schedule for every rank, plus what is needed to interpret it.

    ``num_slots`` counts slots 0..num_slots-1 (the last holds the step's statistics and STEP);
    slot -1 is the prologue that loads the own chunk and stages the first weights. ``options``
    records the build parameters (``layer_numel``, ``weight_bytes``, ``grad_bytes``,
    ``replicated_numel``, ``prefetch_depth``, ``mb_per_fetch`` and, for TawPipe, ``grad_route``)
    so that byte counts can be checked and recomputed.

    ``replicas`` R (design §3.5): the job's nodes form R replicas of G/R nodes, each running the
    same pipeline over its N/R ranks on its own micro-batches; there are N/R chunks, ``owner``
    names their owners in replica 0, and the rank ``offset`` = replica x N/R further owns the same
    chunk in its replica. ``actions`` is then usually a ``Programs``.
    """

    algo: str
    topology: Topology
    num_layers: int
    micro_batches: int
    chunk_layers: tuple[tuple[int, int], ...]
    owner: tuple[int, ...]
    num_slots: int
    actions: Sequence[tuple[Action, ...]]
    options: dict[str, Any] = field(default_factory=dict)
    replicas: int = 1

    @functools.cached_property
    def model_order(self) -> tuple[int, ...]:
        """Chunk ids in the order a micro-batch's forward visits them."""
        return tuple(sorted(range(len(self.chunk_layers)), key=lambda k: self.chunk_layers[k][0]))

    @property
    def replica_size(self) -> int:
        """Ranks per replica: N/R, also the number of chunks."""
        return self.topology.world_size // self.replicas

    def replica_of(self, rank: int) -> int:
        return rank // self.replica_size

    @functools.cached_property
    def _chunk_of(self) -> dict[int, int]:
        return {o: k for k, o in enumerate(self.owner)}

    def own_chunk(self, rank: int) -> int:
        try:
            return self._chunk_of[rank % self.replica_size]
        except KeyError:
            raise ValueError(f"rank {rank} owns no chunk (owner {self.owner})") from None

    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups of ``ALLREDUCE_G``: each chunk's owners (none for one replica)."""
        return tuple(self.owners(k) for k in range(self.replica_size)) if self.replicas > 1 else ()

    def owners(self, chunk: int) -> tuple[int, ...]:
        """The ranks that own ``chunk``: one per replica, on the rail of replica 0's owner."""
        return tuple(self.owner[chunk] + i * self.replica_size for i in range(self.replicas))

    def reads(self, a: Action) -> Names:
        return OPS[a.op].reads(a, self)

    def writes(self, a: Action) -> Names:
        return OPS[a.op].writes(a, self)

    def carried_load(self, rank: int) -> Action | None:
        """The LOAD_W that ``rank``'s STEP, its last action, can run for the next iteration from
        the master it leaves, where the state is on the host (design §6.1): the first LOAD_W of
        the own chunk whose buffer no earlier action reads or writes, the master unchanged before
        it. None where there is none."""
        actions, own = self.actions[rank], self.own_chunk(rank)
        touched: set[str] = set()
        if not actions or actions[-1].op is not Op.STEP:
            return None
        for a in actions:
            writes = self.writes(a)
            if a.op is Op.LOAD_W and a.chunk == own and a.buf not in touched:
                return a
            if MASTER in writes:
                return None
            touched.update(self.reads(a), writes)
        return None

    def leaves_carried(self, carried: Action, actions: Iterable[Action]) -> bool:
        """Whether ``actions`` (another program, run between two steps) leave the buffer that
        ``carried`` loads and the master as they are."""
        return not any(carried.buf in self.reads(a) or carried.buf in self.writes(a) or MASTER in self.writes(a)
                       for a in actions)

    def streamed_accumulations(self, rank: int) -> dict[Action, Action]:
        """Each B of ``rank`` whose gradient buffer the ACC_G after it adds to the accumulator with
        nothing touching either between them, mapped to that ACC_G: a backward that runs a layer
        at a time may start the addition of each layer's slice as the layer finishes it, since no
        later unit changes the slice before the ACC_G reads it (design §6.1)."""
        out: dict[Action, Action] = {}
        pending: dict[str, Action] = {}  # gradient buffer -> the B that wrote it, untouched since
        for a in self.actions[rank]:
            touched = {*self.reads(a), *self.writes(a)}
            if a.op is Op.ACC_G and a.buf in pending:
                out[pending[a.buf]] = a
            if ACC in touched:
                pending.clear()
            for b in touched:
                pending.pop(b, None)
            if a.op is Op.B:
                pending[a.grad_buf] = a
        return out

    def accumulated_in_place(self, rank: int) -> frozenset[str]:
        """The gradient buffers of ``rank`` whose backwards may add straight into the own
        accumulator, their ACC_Gs then doing nothing: every action that touches one is a B of the
        own chunk writing it or an ACC_G adding it, and while a B's gradient waits for its ACC_G
        nothing but an ACC_G touches the accumulator (it would see the gradient early). All of
        the rank's ACC_Gs or none, so that nothing adds into the accumulator beside a backward.
        Only a rank alone in its replica qualifies (world size 1, or one rank per replica): an
        owner's ACC_G elsewhere adds what other ranks reduced or sent into its buffers."""
        if self.replica_size > 1:
            return frozenset()
        if rank not in self._in_place:  # the simulator asks at every ACC_G
            self._in_place[rank] = self._accumulated_in_place(rank)
        return self._in_place[rank]

    @functools.cached_property
    def _in_place(self) -> dict[int, frozenset[str]]:
        return {}

    def _accumulated_in_place(self, rank: int) -> frozenset[str]:
        acts, own = self.actions[rank], self.own_chunk(rank)
        grads = {a.buf for a in acts if a.op is Op.ACC_G}
        waiting: set[str] = set()  # buffers holding a gradient not yet added
        for a in acts:
            touched = {*self.reads(a), *self.writes(a)}
            if a.op is Op.B and a.chunk == own and a.grad_buf in grads:
                waiting.add(a.grad_buf)
            elif a.op is Op.ACC_G:
                waiting.discard(a.buf)
            elif touched & grads or (ACC in touched and waiting):
                return frozenset()
        return frozenset(grads)

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
        if kind == "eval":
            return EVAL_BYTES
        if kind == "replica":  # the float32 accumulators, summed over the replicas in the wire dtype
            return self.chunk_numel(chunk) * int(self.options.get("grad_bytes", 1))
        if kind == "state":  # float32 masters
            return self.chunk_numel(chunk) * 4
        return 0  # "setup": sized by the engine's fingerprint

    def to_json(self, indent: int | None = None, *, actions: bool = True) -> str:
        """The plan as one JSON document; actions are a flat list, rank by rank, in list order:
        replica 0's (the others are its shifts), or none with ``actions=False`` (a summary)."""
        listed = self.actions[:self.replica_size] if actions else []
        doc = {
            "format": _JSON_FORMAT,
            "algo": self.algo,
            "topology": {"nodes": self.topology.nodes, "per_node": self.topology.per_node},
            "num_layers": self.num_layers,
            "micro_batches": self.micro_batches,
            "chunk_layers": [list(c) for c in self.chunk_layers],
            "owner": list(self.owner),
            "num_slots": self.num_slots,
            "replicas": self.replicas,
            "options": self.options,
            "actions": [a.to_json() for acts in listed for a in acts],
        }
        return json.dumps(doc, indent=indent, ensure_ascii=False)

    @staticmethod
    def from_json(text: str) -> "Plan":
        doc = json.loads(text)
        if doc.get("format") not in (_JSON_FORMAT, _JSON_FORMAT_ONE_REPLICA):
            raise ValueError(f"not a tawpipe plan (format {doc.get('format')!r}, expected {_JSON_FORMAT!r})")
        topo = Topology(**doc["topology"])
        replicas = int(doc.get("replicas", 1))
        per_rank: list[list[Action]] = [[] for _ in range(topo.world_size // replicas)]
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
            actions=Programs([tuple(acts) for acts in per_rank], replicas),
            options=dict(doc["options"]), replicas=replicas,
        )

    def table(self) -> str:
        """Markdown table of the schedule, slot by slot (design §3.3)."""
        return plan_table(self)
