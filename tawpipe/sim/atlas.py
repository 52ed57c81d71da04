"""The map: which method wins where, from 24 to 1,024 GPUs (issue #24, item 4; design §9).

Every cell of a grid (nodes × 8 H100s, NVLink inside a node, one inter-node link per node; a
LLaMA preset; a sequence length S) plays one iteration of every method with the simulator and
keeps, among the methods whose memory fits a device, the fastest: the *winner*, TawPipe's best
settings, and TawPipe's *margin* over the fastest other method that fits (its time over
TawPipe's: > 1 where TawPipe is faster, < 1 where it loses).

Fixed for every cell (``Grid``): micro-batch 1, ``acc`` = 8 micro-batches per device per
iteration, bf16 weights, activations and gradients on the wire, AdamW in float32, the chunked
loss for every method (issue #36), 2 TB of host memory per node (``hardware.HOST``). A method fits
where its memory fits the device and what a node's ranks keep on the host fits the node's.

The methods, and the rules that choose their settings and memory savers (design §9.6):

- TawPipe: replicas R over the divisors of the nodes whose pipelines (8·nodes/R ranks) have no
  more ranks than layers and no more forwards and backwards than ``compare`` plays; k over the
  divisors of acc; prefetch depth 1 without reuse, every chunk resident with reuse, or depth 1
  with the fetched chunks kept in host memory (``reuse_weights="host"``); times the
  memory savers of ``SAVERS``. Per setting, the savers that fit and that no savers fitting before
  them dominate (``compare.dominates``) are candidates. A candidate's memory and a lower bound on
  its time come from its plan without playing it (the largest of rank 0's compute under its
  savers, the busiest node link's bytes, ``plan_traffic``, over its rate, and rank 0's busier
  PCIe direction over its rate); the candidates are played in the order of their bounds,
  skipping any whose bound times 1 + ``PRUNE`` is no less than the best time played so far
  (branch and bound: the best played is within ``PRUNE`` of the best of all). Plans are built
  once per (nodes, model, setting): they depend on neither S nor the link. At S ≥ 32k
  (``Grid.context_from``) each setting is tried with context parallelism c ∈ {1, 2, 4, 8} too
  (design §3.6): c·acc micro-batches of 1/c of each sequence per device (the cell's tokens), its
  plans built for c·acc, the K/V exchange played inside the node.
- WeiPipe: its single pipeline, where it has no more ranks than layers (N ≤ L); else n/a.
- DDP, FSDP2 (``fsdp``: gradients reduce-scattered on the last micro-batch; ``fsdp-mm``: after
  every micro-batch), FSDP2 with intra-node reshard (``fsdp-node``), HSDP: ``compare.run``, with
  or without per-block checkpointing and torch's ``save_on_cpu`` (``peer_entry``); at S ≥ 32k
  also with context parallelism c ∈ {2, 4, 8} inside a node, as torchtitan runs FSDP2 + CP (each
  sequence split over c ranks, c times the micro-batches, K/V all-gathered per layer).
- 1F1B: P stages per pipeline and N/P data-parallel copies; P over the divisors of N that are at
  most L and tile nodes (a multiple or a divisor of 8): the two largest, and the largest that
  divides L (equal stages), each without checkpointing where that fits; the fastest that fits.

``largest_fits`` adds what fits where: the longest S at which each method fits 32 GPUs.

A cell the simulator refuses (a plan too large, more stages than layers) records why instead.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from concurrent.futures import Executor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..atomic import write_atomic
from ..cost.memory import MemoryEstimate, Savers, host_bytes, savers_ladder, staging_buffers
from ..cost.traffic import context_bytes, plan_traffic
from ..plan.actions import OPS, Channel, batches
from ..plan.plan import Plan
from ..plan.schedule import RESIDENT
from . import compare
from .compare import taw_settings
from .hardware import HOST, Cluster, Host, device, link
from .peers import CONTEXT_PARALLEL, peer_memory, stage_counts
from .play import compute_seconds, engine_plan
from .workload import Workload, model

GiB = 2**30
UNPLAYED = ("sim/atlas_report.py", "sim/calibrate.py")  # sources no cell's row depends on
PEERS_ONLY = ("sim/peers.py",)  # sources only the other methods' entries depend on, not TawPipe's
CELL_AXES = ("nodes", "links", "models", "seqs", "link_detail")  # which cells a grid has, not what one holds
PRUNE = 0.005  # a TawPipe setting is played only if its lower bound is below best / (1 + PRUNE)
SAVERS = savers_ladder()  # TawPipe's memory savers on a GPU, fastest first, the host's AdamW last
DP_PEERS = ("ddp", "fsdp", "fsdp-mm", "fsdp-node", "hsdp")
METHODS = ("tawpipe", "weipipe", *DP_PEERS, "1f1b")
SHORT = {"tawpipe": "Taw", "weipipe": "Wei", "ddp": "DDP", "fsdp": "FSDP", "fsdp-mm": "FSDPmm",
         "fsdp-node": "FSDPn", "hsdp": "HSDP", "1f1b": "1F1B"}


@dataclass(frozen=True)
class Grid:
    """The cells: every (nodes, link, model, seq), on ``per_node`` devices per node."""

    nodes: tuple[int, ...] = (3, 16, 64, 128)
    links: tuple[str, ...] = ("10gbe", "100gb", "400gb")
    models: tuple[str, ...] = ("1b", "7b", "13b", "70b")
    seqs: tuple[int, ...] = (4096, 16384, 65536, 131072)
    per_node: int = 8
    device: str = "h100"
    intra: str = "nvlink"
    acc: int = 8
    micro_batch: int = 1
    recompute: bool = True  # WeiPipe's; the others search theirs
    dtype_bytes: int = 2
    grad_bytes: int = 2
    chunked_loss: bool = True  # every method's head and loss a slice of tokens at a time
    host: Host = HOST
    # context parallelism inside a node (design §3.6), searched at S >= context_from: TawPipe and
    # the data-parallel peers with each sequence split over c of a node's ranks
    contexts: tuple[int, ...] = (1, 2, 4, 8)
    context_from: int = 32768

    def contexts_at(self, seq: int) -> tuple[int, ...]:
        """The context-parallel degrees the map tries at S = ``seq``."""
        if seq < self.context_from:
            return (1,)
        return tuple(c for c in self.contexts if self.per_node % c == 0 and seq % (2 * c) == 0)

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d["host"] = {"memory_bytes": self.host.memory, "pcie_bytes_per_s": self.host.pcie.bandwidth,
                     "pcie_d2h_bytes_per_s": self.host.to_host.bandwidth, "adamw_bytes_per_s": self.host.adamw_bandwidth}
        dev, intra = device(self.device), link(self.intra)
        d["device_detail"] = {"memory_bytes": dev.memory, "matmul_flops": dev.matmul_flops,
                              "attention_flops": dev.attention_flops, "peak_flops": dev.peak_flops}
        d["link_detail"] = {li: {"rate_bytes_per_s": link(li).rate, "bandwidth_bytes_per_s": link(li).bandwidth,
                                 "latency_s": link(li).latency, "per": "node"} for li in self.links}
        d["intra_detail"] = {"bandwidth_bytes_per_s": intra.bandwidth, "latency_s": intra.latency}
        return d


FULL = Grid()
QUICK = Grid(nodes=(3,), links=("10gbe", "400gb"), models=("7b",), seqs=(4096,))


# ------------------------------------------------------------------------------------ one cell


def pipeline_stages(nodes: int, per_node: int, layers: int, tries: int = 2) -> list[int]:
    """1F1B's stage counts tried: among the P dividing N with 2 ≤ P ≤ L that tile nodes (P a
    multiple or a divisor of ``per_node``), the ``tries`` largest and the largest that divides L
    (stages of equal layers)."""
    ok = stage_counts(nodes, per_node, layers)[::-1]
    even = [p for p in ok if layers % p == 0][:1]
    return sorted(set(ok[:tries] + even), reverse=True)


def pipeline_row(cluster: Cluster, work: Workload, acc: int, stages: int, chunked_loss: bool = False) -> compare.Row:
    """``compare.run("1f1b")`` with ``stages`` stages per pipeline."""
    return compare.run("1f1b", cluster, work, acc, settings={"stages": stages}, chunked_loss=chunked_loss)


def compute_floor(plan: Plan, work: Workload, rank: int = 0, savers: Savers | None = None) -> float:
    """``rank``'s compute in ``plan`` under ``savers`` (default ``compare.default_savers``): what its
    played iteration cannot beat."""
    savers = savers or compare.default_savers(work)
    return sum(compute_seconds(plan, u[0], work, savers) for u in batches(plan.actions[rank])
               if OPS[u[0].op].channel is Channel.COMPUTE)


def _gib(x: float) -> float:
    return round(x / GiB, 3)


def _entry(row: compare.Row) -> dict[str, Any]:
    return {"time_s": row.time_s, "compute_s": row.compute_s, "exposed_comm_s": row.exposed_comm_s,
            "memory_gib": _gib(row.memory.total), "host_gib": _gib(row.memory.host), "fits": row.fits,
            "settings": row.settings, "tokens_per_s_per_device": row.tokens_per_s_per_device, "mfu": row.mfu,
            "inter_gb": row.inter_bytes / 1e9, "intra_gb": row.intra_bytes / 1e9, "pcie_gb": row.pcie_bytes / 1e9,
            "bottleneck": row.bottleneck}


def _unplayed(memory: MemoryEstimate, cluster: Cluster, settings: dict, why: str) -> dict[str, Any]:
    return {"time_s": None, "memory_gib": _gib(memory.total), "host_gib": _gib(memory.host),
            "fits": compare.fits(memory, cluster), "settings": settings, "note": why}


@dataclass
class _Plans:
    """TawPipe's plans for one (nodes, model), with their S- and link-free facts."""

    plans: dict[int, Plan] = field(default_factory=dict)
    settings: list[dict] = field(default_factory=list)
    busiest_node_bytes: dict[int, float] = field(default_factory=dict)
    buffers: dict[int, tuple[int, int]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)


def _build_plans(cluster: Cluster, work: Workload, acc: int) -> _Plans:
    out = _Plans(settings=taw_settings(cluster.nodes, cluster.per_node, work.dims.layers, acc))
    for i, s in enumerate(out.settings):
        try:
            plan = engine_plan(cluster, work, acc, **s)
        except ValueError as e:
            out.errors[i] = str(e)
            continue
        out.plans[i] = plan
        out.busiest_node_bytes[i] = plan_traffic(plan).link_seconds(1.0)[0]
        out.buffers[i] = staging_buffers(plan)
    return out


def _resolved(s: dict, plan: Plan) -> dict:
    return {**s, "prefetch_depth": plan.options["prefetch_depth"], "resident": s["prefetch_depth"] == RESIDENT}


def _pcie_floor(plan: Plan, work: Workload, savers: Savers, cluster: Cluster) -> float:
    """Rank 0's busier PCIe direction under ``savers``: its bytes over its link's rate."""
    d = work.dims
    moved = host_bytes(plan, 0, own_numel=plan.chunk_numel(plan.own_chunk(0)), weight_bytes=d.dtype_bytes,
                       grad_bytes=d.grad_bytes,
                       input_bytes=d.activation_numel * d.dtype_bytes, savers=savers)
    to_host, from_host = moved
    return max(to_host / cluster.host.to_host.bandwidth, from_host / cluster.host.pcie.bandwidth)


def _short(savers: Savers) -> str:
    """``savers`` as the map's cells name them: the recompute, +act (activations on the host),
    +state (the optimizer on the host)."""
    return f"{savers.recompute}{'+act' * savers.offload_activations}{'+state' * savers.offload_state}"


def _context_floor(plan: Plan, work: Workload, savers: Savers, cluster: Cluster, c: int) -> float:
    """Rank 0's K/V exchanges under context parallelism ``c`` at its intra-node port's whole rate,
    each with its hops' latency: they block its compute (``play._Context``), so they add to it."""
    if c == 1:
        return 0.0
    sent = context_bytes(plan, 0, work.dims, c, savers.recompute)  # (c - 1) shares per exchange, c - 1 hops
    return sent / cluster.intra.bandwidth + sent / work.sliced(c).kv_share_bytes() * cluster.hop_latency(False)


def _tawpipe(plans: dict[int, _Plans], cluster: Cluster, work: Workload, acc: int, stats: dict, *,
             chunked_loss: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """TawPipe's best setting, memory savers and context-parallel degree c that fit (branch and
    bound over ``plans[c]`` × ``SAVERS`` for each c given), and per setting what was tried: the
    savers played (with their time and lower bound), how many were pruned (their bound cannot
    beat the best played by ``PRUNE``), how many do not fit, and how many were dominated by savers
    that fit first (``compare.dominates``), or the planner's error. With context parallelism c a
    device runs c·acc micro-batches of 1/c of each sequence (``plans[c]`` are built for them): the
    cell's tokens per device in one iteration, as the peers run it."""
    tried: dict[tuple[int, int], dict[str, Any]] = {}
    todo: list[tuple[float, int, int, int, MemoryEstimate]] = []  # (bound, context, setting, savers, memory)
    for c, built in plans.items():
        sliced = work.sliced(c)
        for i, s in enumerate(built.settings):
            shown = {**s, **({"context_parallel": c} if c > 1 else {})}
            if i in built.errors:
                tried[(c, i)] = {"settings": shown, "status": f"error: {built.errors[i]}", "fits": False}
                continue
            plan = built.plans[i]
            link = built.busiest_node_bytes[i] / cluster.inter.bandwidth
            floors: dict[tuple, float] = {}
            least: MemoryEstimate | None = None
            t = tried[(c, i)] = {"settings": {**_resolved(s, plan), **shown}, "played": [], "pruned": 0,
                                 "does_not_fit": 0, "dominated": 0}
            fitting: list[Savers] = []
            for j, savers in enumerate(SAVERS):
                mem = compare.plan_memory(plan, sliced.dims, savers, chunked_loss, buffers=built.buffers[i],
                                          context=c)
                least = mem if least is None or mem.total < least.total else least
                if not compare.fits(mem, cluster):
                    t["does_not_fit"] += 1
                    continue
                if any(compare.dominates(other, savers) for other in fitting):
                    t["dominated"] += 1
                    continue
                fitting.append(savers)
                key = (savers.recompute, savers.offload_state)
                if key not in floors:
                    floors[key] = compute_floor(plan, sliced, savers=savers) + \
                        _context_floor(plan, work, savers, cluster, c)
                todo.append((max(floors[key], link, _pcie_floor(plan, sliced, savers, cluster)), c, i, j, mem))
            t["least_memory_gib"] = _gib(least.total) if least else None
    best: tuple[float, dict] | None = None
    for floor, c, i, j, mem in sorted(todo, key=lambda x: x[:4]):
        t = tried[(c, i)]
        if best is not None and floor * (1 + PRUNE) >= best[0]:
            t["pruned"] += 1
            stats["pruned"] += 1
            continue
        row = compare.play("tawpipe", plans[c].plans[i], cluster, work.sliced(c), acc * c, t["settings"], memory=mem,
                           savers=SAVERS[j], chunked_loss=chunked_loss)
        stats["played"] += 1
        if row.time_s < floor * (1 - 1e-6):
            stats["bound_violations"].append({"settings": t["settings"], "savers": str(SAVERS[j]),
                                              "time_s": row.time_s, "bound_s": floor})
        t["played"].append({"savers": str(SAVERS[j]), "time_s": row.time_s, "lower_bound_s": floor})
        if best is None or row.time_s < best[0]:
            best = (row.time_s, {**_entry(row), "savers": str(SAVERS[j]), "savers_short": _short(SAVERS[j]),
                                 "lower_bound_s": floor})
    out = [tried[key] for key in sorted(tried)]
    if best is not None:
        return best[1], out
    if not plans[1].plans:
        return {"error": "; ".join(sorted(set(plans[1].errors.values()))) or "no replica count gives a pipeline of "
                         "at most as many ranks as layers", "fits": False, "time_s": None}, out
    least = min((t for t in out if t.get("least_memory_gib") is not None), key=lambda t: t["least_memory_gib"])
    return {"time_s": None, "fits": False, "memory_gib": least["least_memory_gib"], "settings": least["settings"],
            "note": f"no setting fits (least memory {least['least_memory_gib']:.1f} GiB)"}, out


def _weipipe(cluster: Cluster, work: Workload, acc: int, chunked_loss: bool) -> dict[str, Any]:
    n, layers = cluster.world_size, work.dims.layers
    if n > layers:
        return {"error": f"n/a: WeiPipe's single pipeline of {n} ranks needs at least {n} layers (L = {layers})",
                "fits": False, "time_s": None}
    try:
        plan = engine_plan(cluster, work, acc, algo="weipipe")
        return _entry(compare.play("weipipe", plan, cluster, work, acc, {}, chunked_loss=chunked_loss))
    except ValueError as e:
        return {"error": str(e), "fits": False, "time_s": None}


def _pipeline(cluster: Cluster, work: Workload, acc: int, chunked_loss: bool) -> dict[str, Any]:
    """1F1B's fastest stage count and recompute (per-layer checkpointing, or none) that fit."""
    stages = pipeline_stages(cluster.nodes, cluster.per_node, work.dims.layers)
    if not stages:
        return {"error": "no stage count divides the ranks, tiles nodes and is at most the layers", "fits": False,
                "time_s": None}
    best, unfit = None, []
    for p in stages:
        for recompute in (False, True):  # without checkpointing is faster: with it only where that does not fit
            mem = peer_memory("1f1b", work.dims, cluster, acc, recompute, stages=p, chunked_loss=chunked_loss)
            if not compare.fits(mem, cluster):
                unfit.append(_unplayed(mem, cluster, {"stages": p, "recompute": recompute},
                                       "does not fit: not played"))
                continue
            try:
                e = _entry(pipeline_row(cluster, replace(work, recompute=recompute), acc, p, chunked_loss))
            except ValueError as err:
                unfit.append({"error": str(err), "fits": False, "time_s": None, "settings": {"stages": p}})
                break
            e["settings"] = {**e["settings"], "recompute": recompute}
            if best is None or e["time_s"] < best["time_s"]:
                best = e
            break
    if best is not None:
        return {**best, "stages_tried": stages}
    least = min((u for u in unfit if "memory_gib" in u), key=lambda u: u["memory_gib"], default=unfit[0])
    return {**least, "stages_tried": stages}


# A data-parallel peer's variants: (recompute, offload). One without offload and with no more
# recompute than another is faster than it, so that one is not played where this one fits.
_PEER_VARIANTS = ((False, False), (True, False), (False, True), (True, True))


def peer_entry(method: str, cluster: Cluster, work: Workload, acc: int, chunked_loss: bool,
               contexts: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """``method``'s fastest variant that fits (``_PEER_VARIANTS``): per-layer checkpointing or not,
    the forward's saved tensors on the host (``save_on_cpu``) or not; and for the data-parallel
    peers each of ``contexts``: context parallelism c inside a node as torchtitan runs it, every
    sequence split over c ranks and c times the micro-batches (the cell's tokens per device)."""
    rows, least = [], None
    for c in contexts if method in CONTEXT_PARALLEL else (1,):
        sliced, played = work.sliced(c), []
        for recompute, offload in _PEER_VARIANTS:
            if any(not o and r <= recompute for r, o in played):
                continue  # a faster variant fits
            mem = peer_memory(method, sliced.dims, cluster, acc * c, recompute, offload=offload,
                              chunked_loss=chunked_loss, context=c)
            if not compare.fits(mem, cluster):
                least = least if least is not None and least.total <= mem.total else mem
                continue
            try:
                row = compare.run(method, cluster, replace(sliced, recompute=recompute), acc * c,
                                  chunked_loss=chunked_loss, savers=Savers(offload_activations=True) if offload else None)
            except ValueError as e:
                return {"error": str(e), "fits": False, "time_s": None}
            e = _entry(row)
            e["settings"] = {**e["settings"], "recompute": recompute, **({"context_parallel": c} if c > 1 else {})}
            rows.append(e)
            played.append((recompute, offload))
    if rows:
        return min(rows, key=lambda e: e["time_s"])
    return _unplayed(least, cluster, {}, "does not fit with or without checkpointing, activation offload or "
                                         "context parallelism")


def decide(row: dict[str, Any]) -> dict[str, Any]:
    """The winner (the fastest method that fits), the fastest other method that fits, and
    TawPipe's margin over it (its time / TawPipe's), into ``row``."""
    ok = {m: e for m, e in row["methods"].items() if e.get("fits") and e.get("time_s") is not None}
    row["winner"] = min(ok, key=lambda m: ok[m]["time_s"]) if ok else None
    others = {m: e for m, e in ok.items() if m != "tawpipe"}
    row["best_other"] = min(others, key=lambda m: others[m]["time_s"]) if others else None
    taw = ok.get("tawpipe")
    row["tawpipe_margin"] = (others[row["best_other"]]["time_s"] / taw["time_s"]) if taw and others else None
    return row


def _no_stats() -> dict[str, Any]:
    return {"played": 0, "pruned": 0, "bound_violations": [], "seconds": {}}


def _add_stats(total: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    for key, value in part.items():
        total[key] = {**total[key], **value} if isinstance(value, dict) else total[key] + value
    return total


def fingerprint(grid: Grid, leave_out: tuple[str, ...] = ()) -> str:
    """What a cell's row depends on: the grid, and the source that computes it (the simulator, the
    cost model, the planner, the model shapes; not ``UNPLAYED``, which only presents rows or
    measures a machine; nor which other cells the grid has, so a cell played in a smaller grid of the
    same settings is the same cell). A saved cell of another fingerprint is played again, but for
    TawPipe's search where its own fingerprint (``leave_out=PEERS_ONLY``) is the saved one's."""
    shared = {k: v for k, v in grid.describe().items() if k not in CELL_AXES}  # a cell's row: not the other cells'
    h = hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode())
    root = Path(__file__).resolve().parent.parent
    sources = [f for package in ("sim", "cost", "plan") for f in (root / package).rglob("*.py")
               if f.relative_to(root).as_posix() not in UNPLAYED + leave_out]
    sources += [root / "models" / f"{m}.py" for m in ("shape", "spec", "presets")]
    for f in sorted(sources):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _play_cell(grid: Grid, name: str, li: str, cluster: Cluster, work: Workload, contexts: tuple[int, ...],
               taw: tuple[dict, list[dict]]) -> dict:
    """The row of model ``name`` over link ``li``: TawPipe's entry and what its search tried
    (``taw``), every other method played on ``cluster`` (those with context parallelism at each of
    ``contexts``), the winner decided."""
    methods: dict[str, dict] = {}
    methods["tawpipe"], tried = taw
    methods["weipipe"] = _weipipe(cluster, work, grid.acc, grid.chunked_loss)
    for m in DP_PEERS:
        methods[m] = peer_entry(m, cluster, work, grid.acc, grid.chunked_loss, contexts)
    methods["1f1b"] = _pipeline(cluster, work, grid.acc, grid.chunked_loss)
    d = work.dims
    return decide({"nodes": cluster.nodes, "per_node": grid.per_node, "gpus": cluster.world_size,
                   "link": li, "model": name, "layers": d.layers, "seq": d.seq, "micro_batch": grid.micro_batch,
                   "acc": grid.acc, "tokens_per_device": grid.acc * d.seq * grid.micro_batch,
                   "methods": methods, "tawpipe_tried": tried})


def _group_rows(grid: Grid, nodes: int, name: str, progress: Callable[[dict], None] | None = None,
                cells: Path | None = None, key: str = "", taw_key: str = "") -> tuple[list[dict], dict[str, Any]]:
    """The rows of one model on one node count (its plans are built once for them all, when a cell
    first needs them), and their statistics. With ``cells`` (a folder) each cell played is saved
    there under the fingerprint ``key`` and TawPipe's ``taw_key``; a cell saved under ``key`` is
    read, not played (a map cut short goes on where it stopped), and one saved under ``taw_key``
    only has the other methods played again (TawPipe's search is most of a cell's time)."""
    dev, intra = device(grid.device), link(grid.intra)
    stats = _no_stats()
    rows = []
    base = model(name, seq=grid.seqs[0], micro_batch=grid.micro_batch, dtype_bytes=grid.dtype_bytes,
                 grad_bytes=grid.grad_bytes)
    shape = Cluster(nodes, grid.per_node, dev, intra, link(grid.links[0]))
    plans: dict[int, _Plans] = {}  # per context-parallel degree c: for c·acc micro-batches, built once
    for seq in grid.seqs:
        dims = model(name, seq=seq, micro_batch=grid.micro_batch, dtype_bytes=grid.dtype_bytes,
                     grad_bytes=grid.grad_bytes)
        work = Workload(dims, dev, grid.recompute)
        for li in grid.links:
            saved = cells / f"{nodes}x{grid.per_node}-{name}-{seq}-{li}.json" if cells else None
            cell = json.loads(saved.read_text()) if saved and saved.exists() else {}
            if cell.get("fingerprint") != key or not key:
                t0, contexts = time.perf_counter(), grid.contexts_at(seq)
                cluster = Cluster(nodes, grid.per_node, dev, intra, link(li), host=grid.host)
                kept = bool(taw_key) and cell.get("tawpipe_fingerprint") == taw_key  # TawPipe's search as saved
                if kept:
                    cell_stats, earlier = cell["stats"], cell["searched_seconds"]
                    taw = (cell["row"]["methods"]["tawpipe"], cell["row"]["tawpipe_tried"])
                else:
                    cell_stats, earlier = _no_stats(), 0.0
                    for c in contexts:
                        if c not in plans:
                            plans[c] = _build_plans(shape, Workload(base, dev, grid.recompute).sliced(c), grid.acc * c)
                    taw = _tawpipe({c: plans[c] for c in contexts}, cluster, work, grid.acc, cell_stats,
                                   chunked_loss=grid.chunked_loss)
                row = _play_cell(grid, name, li, cluster, work, contexts, taw)
                played = time.perf_counter() - t0
                # searched_seconds: the play that searched TawPipe's settings; seconds: all the cell's plays
                cell = json.loads(json.dumps({"fingerprint": key, "tawpipe_fingerprint": taw_key, "row": row,
                                              "stats": cell_stats, "searched_seconds": earlier if kept else played,
                                              "seconds": earlier + played}, default=str))
                if saved:
                    write_atomic(saved, json.dumps(cell), ".part")
            rows.append(cell["row"])
            _add_stats(stats, cell["stats"])
            group = f"{nodes}x{grid.per_node} {name}"
            stats["seconds"][group] = round(stats["seconds"].get(group, 0.0) + cell["seconds"], 2)
            if progress:
                progress(cell["row"])
    return rows, stats


def map_rows(grid: Grid = FULL, *, progress: Callable[[dict], None] | None = None,
             pool: Executor | None = None, cells: Path | None = None) -> tuple[list[dict], dict]:
    """One row per cell of ``grid`` (see the module's docstring), and the run's statistics (a
    group's seconds: its cells' when they were played). Given a ``pool`` (``processes``), the
    (nodes, model) groups play in it, the largest models first: the same rows, and ``progress``
    hears of a group's cells when the group ends. Given ``cells``, a folder, every cell is saved
    there once played, and the cells saved there by a run of the same ``fingerprint`` are not
    played again."""
    groups = [(nodes, name) for nodes in grid.nodes for name in grid.models]
    key, taw_key = (fingerprint(grid), fingerprint(grid, PEERS_ONLY)) if cells else ("", "")
    if cells:
        cells.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    done: dict[tuple[int, str], tuple[list[dict], dict]] = {}
    if pool is not None:
        largest_first = sorted(groups, key=lambda g: (grid.models.index(g[1]), g[0]), reverse=True)
        futures = {pool.submit(_group_rows, grid, *g, cells=cells, key=key, taw_key=taw_key): g for g in largest_first}
        for f in as_completed(futures):
            done[futures[f]] = f.result()
            for row in done[futures[f]][0] if progress else ():
                progress(row)
    else:
        done = {g: _group_rows(grid, *g, progress=progress, cells=cells, key=key, taw_key=taw_key) for g in groups}
    rows: list[dict] = []
    stats = _no_stats()
    for g in groups:
        rows += done[g][0]
        _add_stats(stats, done[g][1])
    stats["elapsed_s"] = round(time.perf_counter() - start, 2)
    return rows, stats


# ------------------------------------------------------------------------------------ what fits

FIT_SEQS = tuple(2**k for k in range(12, 21))  # S = 4k to 1M tokens
FIT_MODELS = ("7b", "13b", "70b")


def _fits_at(method: str, cluster: Cluster, work: Workload, acc: int, plans: dict[int, _Plans], chunked_loss: bool,
             contexts: tuple[int, ...] = (1,)) -> bool:
    """Whether any of ``method``'s settings, memory savers and context-parallel degrees that the map
    tries fits ``cluster`` (``plans[c]``: TawPipe's for c·acc micro-batches)."""
    dims = work.dims
    if method == "tawpipe":
        return any(compare.fits(compare.plan_memory(plan, work.sliced(c).dims, savers, chunked_loss,
                                                    buffers=plans[c].buffers[i], context=c), cluster)
                   for c in contexts for i, plan in plans[c].plans.items() for savers in SAVERS)
    if method in CONTEXT_PARALLEL:
        return any(compare.fits(peer_memory(method, work.sliced(c).dims, cluster, acc * c, r, offload=o,
                                            chunked_loss=chunked_loss, context=c), cluster)
                   for c in contexts for r, o in _PEER_VARIANTS)
    if method == "weipipe":
        if cluster.world_size > dims.layers:
            return False
        plan = engine_plan(cluster, work, acc, algo="weipipe")
        return compare.fits(compare.plan_memory(plan, dims, Savers(), chunked_loss), cluster)
    if method == "1f1b":
        return any(compare.fits(peer_memory("1f1b", dims, cluster, acc, r, stages=p, chunked_loss=chunked_loss), cluster)
                   for p in pipeline_stages(cluster.nodes, cluster.per_node, dims.layers) for r in (False, True))
    return any(compare.fits(peer_memory(method, dims, cluster, acc, r, offload=o, chunked_loss=chunked_loss), cluster)
               for r, o in _PEER_VARIANTS)


def largest_fits(grid: Grid = FULL, nodes: int = 4, models: tuple[str, ...] = FIT_MODELS,
                 seqs: tuple[int, ...] = FIT_SEQS) -> dict[str, dict[str, int | None]]:
    """Per model, the largest S of ``seqs`` at which each method fits ``nodes`` of ``grid``'s
    nodes with any of the settings and savers the map tries (memory only: nothing is played);
    None where it fits at none of them."""
    dev, intra = device(grid.device), link(grid.intra)
    cluster = Cluster(nodes, grid.per_node, dev, intra, link(grid.links[0]), host=grid.host)
    out: dict[str, dict[str, int | None]] = {}
    for name in models:
        base = model(name, seq=seqs[0], micro_batch=grid.micro_batch, dtype_bytes=grid.dtype_bytes,
                     grad_bytes=grid.grad_bytes)
        plans = {c: _build_plans(cluster, Workload(base, dev, grid.recompute).sliced(c), grid.acc * c)
                 for c in grid.contexts_at(max(seqs))}
        out[name] = {}
        for method in METHODS:
            fit = [seq for seq in seqs if _fits_at(method, cluster, Workload(replace(base, seq=seq), dev, grid.recompute),
                                                    grid.acc, plans, grid.chunked_loss, grid.contexts_at(seq))]
            out[name][method] = max(fit, default=None)
    return out
