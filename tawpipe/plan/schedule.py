"""Building a plan: pure functions (topology, layers, micro-batches, options) -> Plan.

``build_plan`` chunks the layers, asks the schedule registered as ``algo`` (``plan.registry``:
TawPipe, design §3.1-§3.3, and the corrected WeiPipe-Interleave ring, design §3.4) for the chunks'
layout and one iteration's events, projects them onto every rank and joins the replicas.

[Note: replica shift] A plan of R replicas holds replica 0's lists only. Replica i runs the same
lists on ranks + i·N/R, so every tool that needs another replica's actions shifts replica 0's
(``Programs``), and ``verify`` proves the shifts instead of running them (design §3.5): a
1,024-rank plan costs one pipeline's memory and proof.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import registry
from .actions import OPS, Action, Op, no_gc, settle
from .plan import Plan, Programs
from .topology import Topology, divisors

RESIDENT = "resident"
HOST = "host"  # reuse_weights: reuse, and keep what the staging buffers cannot hold in pinned host memory
REUSE = (False, True, HOST)
SETTLE_ACTIONS = 1_000_000  # from this many actions, a new plan goes straight to the oldest generation (settle)


def resident_depth(topology: Topology) -> int:
    """The least prefetch depth at which ``reuse_weights`` keeps every chunk in a staging buffer
    once fetched: d + 1 >= N buffers. Each rank then receives each chunk once per iteration,
    whatever k, so no depth sends fewer bytes (gradients still go once per k micro-batches). It
    costs N + 1 weight and N + 1 gradient buffers of a chunk per rank on several nodes (N of each
    on one): about the model's weights and gradients (design §3.2)."""
    return max(1, topology.world_size - 1)


def check_depth_gains(job: Topology, prefetch_depth: int | str, replicas: int = 1) -> None:
    """ValueError for a prefetch depth beyond the resident one of a pipeline of ``job``'s nodes
    as ``replicas`` (a word, "resident" or "auto", passes): the plan is valid (the verifier's tests build such plans), but it costs
    buffers and gains nothing, so the commands refuse it."""
    n = job.world_size // replicas
    most = resident_depth(Topology(job.nodes // replicas, job.per_node))
    if isinstance(prefetch_depth, int) and prefetch_depth > most:
        raise ValueError(f"prefetch_depth={prefetch_depth} is beyond {most}, where {most + 1} staging buffers already "
                         f"hold every chunk of a pipeline of {n} ranks: a deeper one costs buffers and fetches nothing "
                         f"sooner; use at most {most} (or {RESIDENT!r})")


def depth_text(plan: Plan, asked: int | str) -> str:
    """The prefetch depth ``plan`` was built with, naming ``"resident"`` where that was asked."""
    return f"{plan.options['prefetch_depth']}{' (resident)' if asked == RESIDENT else ''}"


@no_gc()
def build_plan(
    topology: Topology,
    num_layers: int,
    micro_batches: int,
    *,
    algo: str = "tawpipe",
    grad_route: str = "rail",
    prefetch_depth: int | str = 1,
    mb_per_fetch: int = 1,
    reuse_weights: bool | str = False,
    layer_numel: int = 1,
    weight_bytes: int = 2,
    grad_bytes: int = 4,
    replicated_numel: int = 0,
    replicas: int = 1,
) -> Plan:
    """Build the plan of one iteration.

    ``replicas`` R: the G nodes form R replicas of G/R whole nodes; each runs this schedule over
    its N/R ranks on its own micro-batches, and a chunk's R owners add up their gradients once per
    iteration (``ALLREDUCE_G``, design §3.5). One replica's lists are built; the others are shifts.

    ``prefetch_depth`` d: weights for slot t+d are fetched during slot t, through d+1 weight and
    d+1 gradient staging buffers (design §3.2); ``"resident"`` is ``resident_depth(topology)``,
    which needs ``reuse_weights``. ``mb_per_fetch`` k: a resident chunk runs k
    micro-batches back to back, so each fetch and each gradient route serves k micro-batches;
    k = 1 is the paper's schedule. ``reuse_weights``: a chunk still in a staging buffer when it is
    needed again is not fetched again (design §3.2); off, the plan is the paper's; ``"host"``: as
    True, and a fetched chunk that its buffer cannot keep until its next use is kept in the rank's
    pinned host memory and brought back from there (``STASH_W``/``RESTORE_W``), so that every chunk
    crosses the network once per iteration, as at the resident depth, through d + 1 buffers. Chunks are
    balanced: the first ``num_layers mod N`` chunks hold one extra layer. Message sizes are
    layers x ``layer_numel`` x the dtype size of weights or gradients.
    """
    job, schedule = topology, registry.get(algo)
    topology = _replica_topology(job, replicas, num_layers, schedule)
    if not (isinstance(reuse_weights, bool) or reuse_weights == HOST):
        raise ValueError(f"reuse_weights must be True, False or {HOST!r}, got {reuse_weights!r}")
    if prefetch_depth == RESIDENT and isinstance(topology, Topology):
        if not reuse_weights:
            raise ValueError("prefetch_depth='resident' keeps fetched chunks only if they are reused: "
                             "pass reuse_weights=True, or give the depth as a number")
        prefetch_depth = resident_depth(topology)
    _check_args(topology, num_layers, micro_batches, prefetch_depth, mb_per_fetch, layer_numel, weight_bytes,
                grad_bytes, replicated_numel)
    schedule.check(topology, dict(prefetch_depth=prefetch_depth, mb_per_fetch=mb_per_fetch,
                                  reuse_weights=reuse_weights, grad_route=grad_route))
    n = topology.world_size
    base, extra = divmod(num_layers, n)
    positions, start = [], 0
    for p in range(n):
        stop = start + base + (1 if p < extra else 0)
        positions.append((start, stop))
        start = stop
    sizes = dict(w=weight_bytes, g=grad_bytes, replica=grad_bytes)  # accumulators cross as every gradient does
    options: dict[str, Any] = {
        "layer_numel": layer_numel, "weight_bytes": weight_bytes, "grad_bytes": grad_bytes,
        "replicated_numel": replicated_numel, "prefetch_depth": prefetch_depth,
        "mb_per_fetch": mb_per_fetch, "reuse_weights": reuse_weights,
    }
    if schedule.routes_gradients:
        options["grad_route"] = grad_route
    chunk_layers, owner = schedule.layout(topology, positions)
    nbytes = {kind: [(e - s) * layer_numel * b for s, e in chunk_layers] for kind, b in sizes.items()}
    rbytes = replicated_numel * grad_bytes  # the replicated gradients cross as every gradient does
    events, num_slots = schedule.events(topology, micro_batches, owner, nbytes, rbytes, options)
    programs = events.project(n)
    large = sum(map(len, programs)) >= SETTLE_ACTIONS  # a plan this large lives on: no collection need walk it
    if replicas > 1:
        programs = _join_replicas(programs, replicas, owner, nbytes["replica"])
    if large:
        settle()
    return Plan(
        algo=algo, topology=job, num_layers=num_layers, micro_batches=micro_batches,
        chunk_layers=chunk_layers, owner=owner, num_slots=num_slots,
        actions=Programs(programs, replicas), options=options, replicas=replicas,
    )


def check_replicas(job: Topology, replicas: object) -> int:
    """The ranks of one replica, or a ValueError naming the replica counts that fit."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    if job.nodes % replicas:
        raise ValueError(f"replicas={replicas} does not divide the {job.nodes} nodes: every replica is the same "
                         f"number of whole nodes; pick one of {divisors(job.nodes)}")
    return job.world_size // replicas


def compute_actions(job: Topology, micro_batches: int, replicas: int = 1) -> int:
    """Forwards and backwards in one replica's plan, 2 x (N/R)^2 x micro-batches: what sets the
    time and memory it takes to build and prove (about twice as many transfers come with them)."""
    n = job.world_size // replicas
    return 2 * n * n * micro_batches


def _replica_topology(job: Topology, replicas: int, num_layers: int, schedule: registry.Schedule) -> Topology:
    """The topology of one replica: G/R whole nodes, as many ranks as ``schedule`` needs at least
    and no more than the layers (a ValueError naming the fix otherwise)."""
    if not isinstance(job, Topology):
        return job  # _check_args names the problem
    size = check_replicas(job, replicas)
    if replicas > 1 and num_layers < size:
        raise ValueError(f"num_layers={num_layers} < {size} ranks per replica: every rank "
                         f"owns one chunk of at least one layer; use more replicas (each of fewer nodes)")
    if replicas > 1 and size < schedule.min_ranks:
        raise ValueError(f"{schedule.name} needs at least {schedule.min_ranks} ranks per replica, and {replicas} "
                         f"replicas of the {job.world_size} ranks leave {size}: use fewer replicas")
    return Topology(job.nodes // replicas, job.per_node)


def _join_replicas(programs: tuple[tuple[Action, ...], ...], replicas: int, owner: tuple[int, ...],
                   replica_bytes: list[int]) -> tuple[tuple[Action, ...], ...]:
    """Replica 0's lists in a job of ``replicas`` replicas: the all-reduces that span every rank
    span the job's ranks, and each owner adds its chunk's gradient with the other replicas' owners
    right after the last write of its accumulator (``ALLREDUCE_G``, on its own channel)."""
    size = len(programs)
    everyone = tuple(range(size * replicas))
    out = []
    for r, acts in enumerate(programs):
        chunk = owner.index(r)
        last = next(i for i in reversed(range(len(acts))) if acts[i].op is Op.ACC_G)
        rail = tuple(r + i * size for i in range(replicas))
        exchange = Action(acts[last].slot, r, Op.ALLREDUCE_G, chunk=chunk, group=rail, bytes=replica_bytes[chunk])
        joined = [dataclasses.replace(a, group=everyone) if OPS[a.op].scope == "job" else a for a in acts]
        joined.insert(last + 1, exchange)
        out.append(tuple(joined))
    return tuple(out)


def _check_args(topology: Topology, num_layers: int, micro_batches: int, prefetch_depth: int, mb_per_fetch: int,
                layer_numel: int, weight_bytes: int, grad_bytes: int, replicated_numel: int) -> None:
    """ValueError naming the argument and the fix, for anything ``build_plan`` cannot build with
    any schedule (each schedule checks its own options)."""
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a Topology, got {type(topology).__name__}")
    n = topology.world_size
    for name, value, low in (
        ("num_layers", num_layers, 1), ("micro_batches", micro_batches, 1),
        ("prefetch_depth", prefetch_depth, 1), ("mb_per_fetch", mb_per_fetch, 1),
        ("layer_numel", layer_numel, 1), ("weight_bytes", weight_bytes, 1),
        ("grad_bytes", grad_bytes, 1), ("replicated_numel", replicated_numel, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            also = f" or {RESIDENT!r}" if name == "prefetch_depth" else ""
            raise ValueError(f"{name} must be an integer >= {low}{also}, got {value!r}")
    if num_layers < n:
        raise ValueError(
            f"num_layers={num_layers} < world size {n}: every rank owns one chunk of at least one "
            f"layer; use at most {num_layers} ranks or a deeper model"
        )
    if micro_batches % mb_per_fetch:
        raise ValueError(
            f"mb_per_fetch={mb_per_fetch} does not divide micro_batches={micro_batches}: each fetch "
            "serves the same number of micro-batches; pick a divisor"
        )
