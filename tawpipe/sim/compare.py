"""Every method on one cluster: what ``tawpipe simulate`` prints per row (design §9.4).

A row plays one iteration of a method (TawPipe or WeiPipe from the engine's own plan, the peers
from ``peers``) and reads off its time, bytes and memory. ``advise`` searches TawPipe's
settings (k, prefetch depth and reuse, replicas) for the fastest that fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..cost.memory import (AUTO, MemoryEstimate, Savers, gathered_kv_bytes, loss_bytes, memory_per_rank, savers_ladder,
                           staging_buffers)
from ..models.shape import ModelDims
from ..plan import registry
from ..plan.plan import Plan
from ..plan.schedule import HOST, RESIDENT, compute_actions
from ..plan.topology import Topology, divisors
from .hardware import Cluster
from .network import Result, simulate
from .peers import PEERS, peer_graph, peer_memory
from .play import engine_plan, plan_graph
from .workload import Workload

# What the engine and tawpipe train do by default: the fewest inter-node bytes that fit (design §7.3).
AUTO_SETTINGS = {"mb_per_fetch": AUTO, "prefetch_depth": AUTO, "reuse_weights": AUTO}
BEST = {"mb_per_fetch": "acc", "prefetch_depth": RESIDENT, "reuse_weights": True}  # the fewest bytes
PAPER: dict[str, Any] = {}  # the paper's schedule: k = 1, depth 1, no reuse
TAWPIPE = ("tawpipe", "tawpipe-paper")  # TawPipe's rows; the others are its peers
NAMES = {"ddp": "DDP", "fsdp": "FSDP2", "fsdp-mm": "FSDP2-mm", "fsdp-node": "FSDP2-node", "hsdp": "HSDP", "1f1b": "1F1B"}
PAPER_SUFFIX = "-paper"  # a tunable schedule at the paper's settings: "tawpipe-paper"


def methods() -> tuple[str, ...]:
    """Every method ``run`` plays: each registered schedule (a tunable one also at the paper's
    settings, NAME-paper), then the peers."""
    out: list[str] = []
    for name in registry.names():
        out += [name, name + PAPER_SUFFIX] if registry.get(name).tunable else [name]
    return (*out, *PEERS)


def title(method: str) -> str:
    """``method`` as tables and verdicts name it."""
    if method in NAMES:
        return NAMES[method]
    return registry.get(method.removesuffix(PAPER_SUFFIX) if method not in registry.names() else method).title


def schedule_of(method: str) -> tuple[str, dict[str, Any]] | None:
    """The schedule ``method`` plays and its default settings ("auto" for a tunable one, which the
    engine then chooses; the paper's for NAME-paper and the others); None for a peer."""
    if method in registry.names():
        return method, dict(AUTO_SETTINGS if registry.get(method).tunable else PAPER)
    base = method.removesuffix(PAPER_SUFFIX)
    if base != method and base in registry.names() and registry.get(base).tunable:
        return base, dict(PAPER)
    return None
TIE = 0.02  # margins within 2% of 1 are a tie (the settings search's and the model's resolution)
MOST_COMPUTE_ACTIONS = 600_000  # a replica's forwards and backwards the player takes (about a minute)


@dataclass
class Row:
    """One method's simulated iteration."""

    method: str
    settings: dict[str, Any]
    time_s: float
    compute_s: float  # the busiest device's compute
    inter_bytes: float  # busiest node port, one direction
    intra_bytes: float  # busiest device port, one direction
    memory: MemoryEstimate
    fits: bool  # on the device, and what the node's ranks offload in its host memory
    pcie_bytes: float = 0.0  # busiest device's copies to and from its host, both directions
    tokens_per_s_per_device: float = 0.0
    mfu: float = 0.0
    bottleneck: str = ""
    result: Result | None = field(default=None, repr=False)

    @property
    def exposed_comm_s(self) -> float:
        return max(self.time_s - self.compute_s, 0.0)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("result", "memory")}
        d["exposed_comm_s"] = self.exposed_comm_s
        d["memory"] = {**self.memory.__dict__, "total": self.memory.total}
        return d


@dataclass(frozen=True)
class Refusal:
    """A method the simulator did not play, and why."""

    method: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "error": self.reason}


@dataclass(frozen=True)
class Verdict:
    """Which of the rows wins: ``winner`` the fastest that fits, ``tawpipe`` TawPipe's fastest
    that fits (else its fastest), ``peer`` the fastest other method that fits."""

    winner: Row | None
    tawpipe: Row | None
    peer: Row | None

    @property
    def margin(self) -> float | None:
        """The fastest peer's time over TawPipe's (> 1: TawPipe is faster), where both fit."""
        if self.peer is None or self.tawpipe is None or not self.tawpipe.fits:
            return None
        return self.peer.time_s / self.tawpipe.time_s


def verdict(rows: Iterable[Row]) -> Verdict:
    """The ``Verdict`` of ``rows`` (the methods' and any of ``advise``'s)."""
    rows = list(rows)
    fit = [r for r in rows if r.fits]
    taw = [r for r in rows if r.method in TAWPIPE]

    def fastest(some: list[Row]) -> Row | None:
        return min(some, key=lambda r: r.time_s, default=None)

    return Verdict(fastest(fit), fastest([r for r in taw if r.fits]) or fastest(taw),
                   fastest([r for r in fit if r.method not in TAWPIPE]))


def run(method: str, cluster: Cluster, work: Workload, acc: int, *, host: bool = False,
        settings: dict[str, Any] | None = None, savers: Savers | None = None, chunked_loss: bool = False) -> Row:
    """Simulate ``method`` (one of ``methods()``) for one iteration of ``acc`` micro-batches per
    device. ``settings``: a schedule's (``mb_per_fetch``, ``prefetch_depth``, ``reuse_weights``,
    ``replicas``; ``schedule_of``'s defaults: "auto" for a tunable one, chosen as the engine
    does); 1F1B's ``stages`` per pipeline (default: every rank, as the bench runs it). ``savers``:
    a schedule's memory savers (default ``default_savers``); a peer reads their
    ``offload_activations`` only (``save_on_cpu``, ``peers.OFFLOADING``), and recomputes as
    ``work.recompute`` says. ``chunked_loss``: every method's head and loss a slice at a time."""
    dims = work.dims
    scheduled = schedule_of(method)
    if scheduled is not None:
        algo, defaults = scheduled
        opts = defaults if settings is None else dict(settings)
        if opts.get("mb_per_fetch") == "acc":
            opts["mb_per_fetch"] = acc
        _check_size(algo, cluster, dims, acc, int(opts.get("replicas", 1)))
        savers = savers or default_savers(work)
        plan = engine_plan(cluster, work, acc, algo=algo, **opts,
                           memory=lambda p: plan_memory(p, dims, savers, chunked_loss, context=work.context))
        opts["prefetch_depth"] = plan.options["prefetch_depth"]
        if AUTO in opts.values():  # what "auto" chose
            opts.update({k: plan.options[k] for k in AUTO_SETTINGS})
        return play(method, plan, cluster, work, acc, opts, host=host, savers=savers, chunked_loss=chunked_loss)
    stages = (settings or {}).get("stages")
    offload = savers is not None and savers.offload_activations
    graph, fabric = peer_graph(method, cluster, work, acc, host=host, stages=stages, offload=offload)
    memory = peer_memory(method, dims, cluster, acc, work.recompute, stages=stages, offload=offload,
                         chunked_loss=chunked_loss, context=work.context)
    ranks = sorted({t.rank for t in graph.tasks if t.rank is not None})
    shown = {**({"stages": stages} if stages else {}), **({"offload_activations": True} if offload else {})}
    return read_off(method, shown, simulate(graph, fabric), ranks, memory, cluster, dims, acc, work.context)


def default_savers(work: Workload) -> Savers:
    """A schedule's memory savers where none are given: recompute from each chunk's input where
    ``work`` recomputes, else none."""
    return Savers("chunk" if work.recompute else "none")


def play(method: str, plan: Plan, cluster: Cluster, work: Workload, acc: int, settings: dict[str, Any], *,
         host: bool = False, memory: MemoryEstimate | None = None, savers: Savers | None = None,
         chunked_loss: bool = False) -> Row:
    """The row of a TawPipe or WeiPipe ``plan`` built already (real byte sizes), run with
    ``savers`` (default ``default_savers``); ``memory`` defaults to the plan's with the head and
    loss (``with_loss``)."""
    savers = savers or default_savers(work)
    graph, fabric = plan_graph(plan, cluster, work, host=host, savers=savers)
    memory = memory or plan_memory(plan, work.dims, savers, chunked_loss, context=work.context)
    shown = {**settings, **(_savers_shown(savers) if savers != default_savers(work) else {})}
    return read_off(method, shown, simulate(graph, fabric), range(plan.replica_size), memory, cluster,
                    work.dims, acc, work.context)


def _savers_shown(savers: Savers) -> dict[str, Any]:
    """``savers`` as a row's settings name them (the flags of ``tawpipe simulate``)."""
    return {"recompute": savers.recompute, **{k: True for k in ("offload_activations", "offload_state")
                                              if getattr(savers, k)}}


def dominates(a: Savers, b: Savers) -> bool:
    """Whether savers ``a`` make an iteration of the same plan no slower than ``b``: no more
    forwards in a backward, and no offload that ``b`` does not have (a copy or the host's step
    never shortens an iteration here; "chunk" and "block" compute alike)."""
    return (a.forwards_in_backward <= b.forwards_in_backward and b.offload_activations >= a.offload_activations
            and b.offload_state >= a.offload_state)


def fits(memory: MemoryEstimate, cluster: Cluster) -> bool:
    """Whether a rank's ``memory`` fits its device and, every rank of a node alike, the node's host."""
    return memory.total <= cluster.device.memory and memory.host * cluster.per_node <= cluster.host.memory


def read_off(method: str, settings: dict[str, Any], result: Result, ranks: Iterable[int], memory: MemoryEstimate,
             cluster: Cluster, dims: ModelDims, acc: int, context: int = 1) -> Row:
    """A played iteration's row: its time, the busiest of ``ranks``' compute, the busiest ports'
    bytes, tokens/s per device, MFU and the bottleneck (``context``: as ``model_flops`` takes it)."""
    inter = max((v for port, v in result.port_bytes.items() if port[0].startswith("node")), default=0.0)
    intra = max((v for port, v in result.port_bytes.items() if port[0] in ("out", "in")), default=0.0)
    pcie: dict[int, float] = {}
    for port, v in result.port_bytes.items():
        if port[0].startswith("pcie"):
            pcie[port[1]] = pcie.get(port[1], 0.0) + v
    row = Row(method, settings, result.makespan, result.busiest(ranks), inter, intra, memory, fits(memory, cluster),
              pcie_bytes=max(pcie.values(), default=0.0), result=result)
    tokens = acc * dims.seq * dims.micro_batch
    row.tokens_per_s_per_device = tokens / row.time_s if row.time_s else 0.0
    row.mfu = model_flops(dims, context) * tokens / row.time_s / cluster.device.peak_flops if row.time_s else 0.0
    row.bottleneck = bottleneck(row, cluster)
    return row


def plan_memory(plan: Plan, dims: ModelDims, savers: Savers, chunked_loss: bool, *,
                buffers: tuple[int, int] | None = None, context: int = 1) -> MemoryEstimate:
    """A TawPipe or WeiPipe row's memory: ``memory_per_rank`` under ``savers`` with the head and
    loss (``with_loss``); ``buffers`` as ``memory_per_rank`` takes them; with context parallelism
    (``dims.seq`` a slice of ``context``), one layer's gathered keys and values too."""
    m = with_loss(memory_per_rank(plan, dims, savers, buffers=buffers), dims, chunked_loss)
    return dataclasses.replace(m, activations=m.activations + gathered_kv_bytes(dims, context)) if context > 1 else m


def with_loss(m: MemoryEstimate, dims: ModelDims, chunked: bool) -> MemoryEstimate:
    """``memory_per_rank``'s estimate with what the head and loss hold (``loss_bytes``), which it
    leaves out and ``peer_memory`` and the engine's ``rank_memory`` count."""
    return dataclasses.replace(m, activations=m.activations + loss_bytes(dims, chunked=chunked))


def model_flops(dims: ModelDims, context: int = 1) -> float:
    """Training FLOPs per token, forward and backward, without recompute: 6 per decoder and head
    parameter plus causal attention's 6·S·H per layer (the usual MFU count; H the queries' width);
    ``context``: ``dims.seq`` is a context-parallel slice of a sequence that many times as long."""
    return 6 * (dims.decoder_numel + dims.vocab * dims.hidden) + 6 * dims.layers * dims.seq * context * dims.q_dim


def bottleneck(row: Row, cluster: Cluster) -> str:
    """What sets the time: the device's compute, a link's bytes, or neither (waiting on
    dependencies: pipeline fill and drain, bubbles, latency)."""
    inter = row.inter_bytes / cluster.inter.bandwidth
    intra = row.intra_bytes / cluster.intra.bandwidth
    name, busiest = max((("compute", row.compute_s), ("inter-node link", inter), ("intra-node link", intra)),
                        key=lambda x: x[1])
    return name if busiest >= 0.8 * row.time_s else f"dependencies ({name} {busiest / row.time_s:.0%} busy)"


def taw_settings(nodes: int, per_node: int, layers: int, acc: int) -> list[dict[str, Any]]:
    """TawPipe's settings worth trying: replicas over the divisors of the nodes whose pipelines
    have no more ranks than layers (and a plan the player takes), k over the divisors of acc,
    every chunk resident (with reuse), or depth 1 without reuse or with the fetched chunks kept on
    the host (the resident depth's inter-node bytes through two buffers)."""
    out = []
    for r in divisors(nodes):
        if nodes * per_node // r > layers or compute_actions(Topology(nodes, per_node), acc, r) > MOST_COMPUTE_ACTIONS:
            continue
        for k in reversed(divisors(acc)):
            for depth, reuse in ((RESIDENT, True), (1, HOST), (1, False)):
                out.append({"replicas": r, "mb_per_fetch": k, "prefetch_depth": depth, "reuse_weights": reuse})
    return out


def advise(cluster: Cluster, work: Workload, acc: int, *, host: bool = False, chunked_loss: bool = False,
           ladder: Sequence[Savers] | None = None, settings: Sequence[dict[str, Any]] | None = None) -> list[Row]:
    """Every one of ``settings`` (default ``taw_settings``; fewer where some are given) played with
    each of the memory savers of ``ladder`` (default ``savers_ladder()``) that fit and that no
    savers fitting before them ``dominates``, or with the leanest where none fits; fastest first
    among those that fit."""
    ladder = tuple(ladder or savers_ladder())
    if settings is None:
        settings = taw_settings(cluster.nodes, cluster.per_node, work.dims.layers, acc)
    rows = []
    for s in settings:
        plan = engine_plan(cluster, work, acc, **s)
        s = {**s, "prefetch_depth": plan.options["prefetch_depth"]}  # "resident" as the depth it is
        buffers = staging_buffers(plan)  # the same under every savers
        fitting: list[Savers] = []
        for savers in ladder:
            memory = plan_memory(plan, work.dims, savers, chunked_loss, buffers=buffers, context=work.context)
            if fits(memory, cluster) and not any(dominates(f, savers) for f in fitting):
                fitting.append(savers)
                rows.append(play("tawpipe", plan, cluster, work, acc, s, host=host, memory=memory, savers=savers))
        if not fitting:
            rows.append(play("tawpipe", plan, cluster, work, acc, s, host=host, savers=ladder[-1],
                             chunked_loss=chunked_loss))
    rows.sort(key=lambda r: (not r.fits, r.time_s))
    return rows


def _check_size(method: str, cluster: Cluster, dims: ModelDims, acc: int, replicas: int) -> None:
    """ValueError where ``method``'s pipeline is longer than the model or more than the player
    takes, naming the flags that shorten it."""
    size = cluster.world_size // replicas
    if size > dims.layers:
        fix = _more_replicas(method, cluster, dims, acc) or (
            f"{registry.get(method).title} runs one pipeline over every device" if not registry.get(method).tunable
            else "no number of replicas (--replicas) makes a pipeline that short")
        raise ValueError(f"a pipeline of {size} ranks needs at least {size} layers, the model has {dims.layers}: "
                         f"{fix}")
    n = compute_actions(Topology(cluster.nodes, cluster.per_node), acc, replicas)
    if n > MOST_COMPUTE_ACTIONS:
        more = _more_replicas(method, cluster, dims, acc)
        raise ValueError(f"a pipeline of {size} ranks at {acc} micro-batches holds {n:,} forwards and backwards, more "
                         f"than the {MOST_COMPUTE_ACTIONS:,} the simulator plays: use fewer micro-batches "
                         f"(--micro-batches){f', or {more}' if more else ''}")


def _more_replicas(method: str, cluster: Cluster, dims: ModelDims, acc: int) -> str | None:
    """The replicas ``advise`` would try, as a way to shorten a tunable schedule's pipelines (None
    for one at the paper's settings, whose pipeline spans every rank, or where no replica count
    is short enough)."""
    if not registry.get(method).tunable:
        return None
    tried = sorted({s["replicas"] for s in taw_settings(cluster.nodes, cluster.per_node, dims.layers, acc)})
    if not tried:
        return None
    return f"use more replicas, each pipeline over fewer nodes (--replicas {', '.join(map(str, tried))})"
