"""The schedules by name: every tool asks this registry instead of testing a name (design §8.1).

A schedule is one module that makes one ``Schedule`` and registers it. ``build_plan`` then builds
its plans, ``verify`` proves them, ``tawpipe plan --algo`` prints them with its table, the cost
model counts its closed-form bytes and memory, and ``tawpipe simulate --methods`` plays it: the
simulator plays any plan as the engine runs it (``sim.play``), so a schedule needs no player of
its own, and the engine executes any plan (design §5). The built-in schedules are named by
module and imported when first asked for.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .topology import Topology

if TYPE_CHECKING:
    from ..models.shape import ModelDims
    from .events import Events
    from .plan import Plan

ChunkLayout = tuple[tuple[tuple[int, int], ...], tuple[int, ...]]  # each chunk's (first, stop) layers; its owner


class Schedule(abc.ABC):
    """One schedule of the weight pipeline: how chunks are laid out and owned, the events of one
    iteration, its printed table and its closed forms. Subclass it, set the class attributes,
    implement the abstract methods, and ``register`` an instance."""

    name: str = ""  # --algo NAME; Plan.algo
    title: str = ""  # as tables and summaries print it
    tunable: bool = False  # takes mb_per_fetch, prefetch_depth and reuse_weights; "auto" weighs them
    routes_gradients: bool = False  # takes grad_route (the router of inter-node gradients)
    min_ranks: int = 1

    def layout(self, topology: Topology, positions: Sequence[tuple[int, int]]) -> ChunkLayout:
        """Chunk k's layers (from the model positions ``positions``, balanced) and its owner. This
        default: chunk k is model position k, owned by rank k."""
        return tuple(positions), tuple(range(topology.world_size))

    def check(self, topology: Topology, options: dict[str, Any]) -> None:
        """ValueError for options this schedule cannot run (``options``: prefetch_depth,
        mb_per_fetch, reuse_weights, grad_route, as ``build_plan`` took them). This default: a
        schedule that is not ``tunable`` runs the paper's settings only."""
        if topology.world_size < self.min_ranks:
            raise ValueError(f"{self.name} needs at least {self.min_ranks} ranks, got {topology.world_size}")
        if not self.tunable and (options["prefetch_depth"] != 1 or options["mb_per_fetch"] != 1
                                 or options["reuse_weights"]):
            raise ValueError(f"{self.name} runs the paper's settings only: prefetch_depth and mb_per_fetch must be 1 "
                             "and reuse_weights off (they are tawpipe options)")

    @abc.abstractmethod
    def events(self, topology: Topology, micro_batches: int, owner: tuple[int, ...], nbytes: dict[str, list[int]],
               rbytes: int, options: dict[str, Any]) -> tuple[Events, int]:
        """One iteration's events (``plan.events``) and its number of slots. ``nbytes``: each
        chunk's bytes by kind ("w" weights, "g" gradients); ``rbytes``: the replicated gradients'."""

    @abc.abstractmethod
    def table(self, plan: Plan) -> str:
        """The plan as a markdown table, slot by slot (``plan.tables`` has the shared helpers)."""

    @abc.abstractmethod
    def closed_form(self, dims: ModelDims, topology: Topology, micro_batches: int) -> tuple[float, float]:
        """Bytes of one iteration's chunks (weights and gradients), at the paper's settings: sent
        per rank (mean), and leaving the busiest node over inter-node links. The cost model adds
        the replicated modules' ring and, with replicas, the owners' exchange."""

    def staging(self, prefetch_depth: int, routed: bool) -> tuple[int, int]:
        """Closed-form memory layout: the weight and gradient staging buffers of a chunk a rank
        holds at ``prefetch_depth`` (``routed``: other nodes take part). This default: d + 1
        weight buffers and the own chunk's copy that other nodes are sent, d + 1 gradient buffers
        and one to receive gradients from other nodes."""
        return prefetch_depth + 1 + routed, prefetch_depth + 1 + routed

    def max_weight_buffers(self, plan: Plan) -> int | None:
        """The most weight buffers a rank of ``plan`` may use, which ``verify`` holds it to; None:
        no bound beyond the plan's own buffers."""
        return None


_SCHEDULES: dict[str, Schedule | str] = {  # name: the schedule, or the module that registers it
    "tawpipe": "tawpipe.plan.tawpipe",
    "weipipe": "tawpipe.plan.weipipe",
}


def register(schedule: Schedule) -> None:
    """Make ``schedule`` available by its name (replacing one of that name)."""
    if not isinstance(schedule, Schedule) or not schedule.name:
        raise ValueError(f"register a Schedule with a name, got {schedule!r}")
    _SCHEDULES[schedule.name] = schedule


def unregister(name: str) -> None:
    """Forget the schedule ``name`` (a test's, say)."""
    _SCHEDULES.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered schedules, the default (tawpipe) first."""
    return tuple(_SCHEDULES)


def get(name: str) -> Schedule:
    """The schedule registered as ``name``; ValueError naming the registered ones otherwise."""
    entry = _SCHEDULES.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"algo must be one of {names()}, got {name!r}")
    if isinstance(entry, str):
        importlib.import_module(entry)  # registers it
        entry = _SCHEDULES[name]
        if not isinstance(entry, Schedule):
            raise ValueError(f"module {_SCHEDULES[name]} did not register the schedule {name!r}")
    return entry
