"""The default ``"auto"`` schedule options: the memory a rank may plan for, and the engine's plan.

The choice itself is ``tawpipe.cost.memory.auto_plan``'s (design §7.3). The budget is this rank's
own: free memory differs from rank to rank, so ranks near a boundary may choose differently. The
setup CHECK compares what every rank chose (``fingerprint``), so that is a ValueError naming
``MemoryPolicy.budget``, never a hang.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..cost.memory import AUTO, MARGIN, MemoryEstimate, Savers, auto_savers_plan, busiest_rank_memory
from ..cost.units import gib
from ..plan.plan import Plan
from ..plan.topology import Topology


def memory_budget(device: torch.device, local_ranks: int, host: tuple[int, str] | None) -> tuple[float, str]:
    """Bytes one rank may plan for, and where the figure comes from: on CUDA the device's free
    memory less MARGIN of its total; elsewhere ``host`` (the host's available bytes and their
    source, ``host_available()``) shared by its ``local_ranks``, less MARGIN; no limit where
    nothing is known."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free - MARGIN * total, f"free on {device} less {MARGIN:.0%} of its {total / 2**30:,.0f} GiB"
    if host is None:
        return math.inf, "the host's memory is unknown"
    available, where = host
    return available / local_ranks * (1 - MARGIN), f"{where}, shared by {local_ranks} rank(s), less {MARGIN:.0%}"


def local_ranks(topology: Topology) -> int:
    """The ranks on this host: torchrun's LOCAL_WORLD_SIZE, else all of them (a local job)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or topology.world_size)


def host_available() -> tuple[int, str] | None:
    """Bytes this host can still give the job, and where the figure comes from: MemAvailable,
    or less where a cgroup (a container's limit) allows less; the free pages where /proc is not
    readable; None where nothing is."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages (sysconf)"
        except (AttributeError, ValueError, OSError):
            return None
    best = (kib * 1024, "MemAvailable in /proc/meminfo")
    # cgroup v2, then v1: the limit less the usage, page cache that can be dropped not counted
    for d, limit_file, usage_file, inactive in ((Path("/sys/fs/cgroup"), "memory.max", "memory.current",
                                                 "inactive_file"),
                                                (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes",
                                                 "memory.usage_in_bytes", "total_inactive_file")):
        try:
            limit = (d / limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 2**60:
                continue
            stat = dict(line.split()[:2] for line in (d / "memory.stat").read_text().splitlines() if " " in line)
            free = int(limit) - int((d / usage_file).read_text()) + int(stat.get(inactive, 0))
        except (OSError, ValueError):
            continue
        if free < best[0]:
            best = (max(free, 0), f"under this cgroup's memory limit of {gib(int(limit))}")
    return best


def engine_plan(topology: Topology, num_layers: int, micro_batches: int, *, device: torch.device,
                budget: float | None, mb_per_fetch: int | str, prefetch_depth: int | str, reuse_weights: bool | str,
                reserve: float = 0.0, batch: Mapping[str, int] | None = None,
                savers: Savers | Sequence[Savers] = Savers(), **plan_args: Any) -> tuple[Plan, Savers, str | None]:
    """The engine's plan, its ``"auto"`` options chosen within ``budget`` bytes per rank (None:
    ``memory_budget``'s measure less ``reserve``, the rank's own bytes besides the model, which may
    fall back to the least memory where nothing fits). The memory counted is the own chunk's state,
    the staging buffers and the replicated parameters (``rank_memory``): what the engine holds
    before it sees a batch; and the activations of ``batch`` (seq, micro_batch, hidden, heads,
    vocab, chunked_loss) where the caller knows it (``tawpipe train``); all as the memory ``savers`` leave it.
    Several ``savers`` (``cost.memory.savers_ladder``, fastest first): the first with which a
    schedule fits, returned with the plan; only where ``batch`` is known, since what they save is
    mostly activations. Off the CPU, ``reuse_weights="host"`` is weighed too (the device's memory is
    what it saves). Returns the plan, the savers and why (None: nothing was left to choose)."""
    asked = dict(mb_per_fetch=mb_per_fetch, prefetch_depth=prefetch_depth, reuse_weights=reuse_weights)
    ladder = (savers,) if isinstance(savers, Savers) else tuple(savers)
    if len(ladder) > 1 and not batch:
        raise ValueError("choosing the memory savers needs the batch (seq, micro_batch, ...): their savings are "
                         "activations")
    if budget is not None:
        measured, where = float(budget), "MemoryPolicy.budget"
    elif AUTO in asked.values() or len(ladder) > 1:
        measured, where = memory_budget(device, local_ranks(topology), host_available())
        if reserve:
            measured, where = measured - reserve, f"{where}, less {gib(reserve)} of runtime"
    else:
        measured, where = math.inf, ""
    wb, gb, layer = plan_args["weight_bytes"], plan_args["grad_bytes"], plan_args["layer_numel"]
    sizes = dict(replicated_numel=plan_args["replicated_numel"], weight_bytes=wb, grad_bytes=gb,
                 scratch_bytes=wb if gb != wb else 0, **(batch or {}))

    def memory(plan: Plan, savers: Savers) -> MemoryEstimate:
        return busiest_rank_memory(plan, chunk_numel=[(b - a) * layer for a, b in plan.chunk_layers], savers=savers,
                                   **sizes)

    return auto_savers_plan(ladder, memory, topology=topology, num_layers=num_layers, micro_batches=micro_batches,
                            budget=measured, budget_text=where, strict=budget is not None,
                            weights_on_host=device.type != "cpu", **asked, **plan_args)
