"""The plan: one iteration of training for every rank, written down in advance (design §4).

It is built by ``schedule`` (TawPipe and WeiPipe), proven by ``verify``, printed by ``tables``,
counted by ``tawpipe.cost.memory`` and executed by ``tawpipe.runtime``; what each action means is the op
table in ``actions``. A plan is plain data: it prints, and it round-trips through JSON.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from .actions import OPS, Action, Names, Op
from .tables import plan_table
from .topology import Topology

ALGOS = ("tawpipe", "weipipe")
GRAD_ROUTES = ("rail", "leader")
_JSON_FORMAT = "tawpipe-plan/2"
STATS_BYTES = 16  # two float64: the squared gradient norm of the own chunk, the non-finite flag
EVAL_BYTES = 8  # one float64: a rank's validation loss sum


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
        if kind == "eval":
            return EVAL_BYTES
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
        return plan_table(self)
