"""What an iteration costs a rank in memory, and which k (micro-batches per fetch) and prefetch
depth fit a budget.

Bytes on the wire are ``tawpipe.cost.traffic``'s; this module adds the other side of the trade-off of
design §7.3: running a resident chunk for k micro-batches cuts weight and gradient traffic by k
and keeps k times as many chunk-boundary activations alive; a deeper prefetch keeps more chunks
resident (fewer bytes again) in more staging buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..plan.actions import GRAD_OPS, WEIGHT_OPS, BufKind, Op, buf_kind
from ..plan.plan import Plan
from ..plan.topology import Topology
from .traffic import ModelDims


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank. ``activations`` = saved chunk inputs (exact) + the recompute working set of
    one chunk for one micro-batch (estimated, see ``working_set_bytes``)."""

    persistent: float  # float32 master, two AdamW moments, float32 gradient accumulator
    staging: float  # the plan's weight and gradient buffers
    replicated: float  # embedding/head/norm: parameters, gradients, AdamW moments (float32)
    activations: float
    transient: float = 0.0  # held only during a step's end: the gradient norm's float64 copies

    @property
    def total(self) -> float:
        return self.persistent + self.staging + self.replicated + self.activations + self.transient


def working_set_bytes(dims: ModelDims, layers: int) -> float:
    """Activations of ``layers`` transformer layers for one micro-batch while backward runs:
    s·b·h·(34 + 5·a·s/h) bytes per layer at 2-byte activations (Korthikanti et al. 2022,
    attention scores materialised), scaled to ``dims.dtype_bytes``. An estimate, not a count."""
    return _working_set(dims.seq, dims.micro_batch, dims.hidden, dims.heads, layers, dims.dtype_bytes)


def _working_set(s: int, b: int, h: int, a: int, layers: int, dtype_bytes: int) -> float:
    return layers * s * b * h * (34 + 5 * a * s / h) * dtype_bytes / 2


def memory_per_rank(plan: Plan, dims: ModelDims) -> MemoryEstimate:
    """The busiest rank's memory for ``plan`` on a model of ``dims`` (same layers as the plan)."""
    programs = plan.actions[:plan.replica_size]  # every replica runs the same lists
    weight_bufs = max(len({a.buf for a in acts if a.op in WEIGHT_OPS}) for acts in programs)
    grad_bufs = max(len({a.grad_buf if a.op is Op.B else a.buf for a in acts
                         if a.op is Op.B or a.op in GRAD_OPS}) for acts in programs)
    return _layout(dims, max(stop - start for start, stop in plan.chunk_layers), plan.replica_size,
                   int(plan.options.get("mb_per_fetch", 1)), weight_bufs, grad_bufs)


def estimate_memory(dims: ModelDims, topology: Topology, *, replicas: int = 1, prefetch_depth: int = 1,
                    mb_per_fetch: int = 1) -> MemoryEstimate:
    """What ``memory_per_rank`` counts for a TawPipe plan without reuse, from the shapes alone:
    for clusters whose plans are too large to build once per choice (``tawpipe plan`` advising R).
    A rank stages w_own + d + 1 weight and d + 1 gradient buffers, plus g_recv where gradients
    arrive from other nodes of its replica (``verify``'s bound)."""
    n = topology.world_size // replicas
    routed = topology.nodes // replicas > 1
    return _layout(dims, -(-dims.layers // n), n, mb_per_fetch, prefetch_depth + 2, prefetch_depth + 1 + routed)


def _layout(dims: ModelDims, chunk_layers: int, chunks: int, k: int, weight_bufs: int,
            grad_bufs: int) -> MemoryEstimate:
    """A rank's memory with the largest chunk of ``chunk_layers`` layers, the given staging buffers
    and the inputs of ``chunks`` chunks for ``k`` micro-batches."""
    chunk = chunk_layers * dims.layer_numel
    return MemoryEstimate(
        persistent=16 * chunk,
        staging=chunk * (weight_bufs * dims.dtype_bytes + grad_bufs * dims.grad_bytes),
        replicated=16 * dims.replicated_numel,
        activations=chunks * k * dims.activation_numel * dims.dtype_bytes + working_set_bytes(dims, chunk_layers),
    )


def rank_memory(plan: Plan, rank: int, *, chunk_numel: Sequence[int], replicated_numel: int, weight_bytes: int,
                grad_bytes: int, scratch_bytes: int, seq: int, micro_batch: int, hidden: int, heads: int,
                vocab: int) -> MemoryEstimate:
    """``rank``'s memory as the engine lays it out for ``plan`` (``tawpipe.engine.storage``): its
    own chunk's float32 master, gradient accumulator and AdamW moments (16 B per parameter, counted
    from ``chunk_numel``, each chunk's parameters); one staging buffer of the largest chunk per
    buffer the plan names on this rank, weights in ``weight_bytes``, gradients in ``grad_bytes``,
    plus a scratch in ``scratch_bytes`` (0: none) when those differ; the replicated parameters at
    16 B each; briefly, 16 B per own parameter more (``transient``): the float64 copy of the
    gradient accumulator and its square that the gradient norm takes (``Precision.local_stats``).
    Activations are estimated: the saved chunk inputs, one chunk's working set
    (``working_set_bytes``) and the head's float32 logits, their log-softmax and gradient."""
    own = chunk_numel[plan.own_chunk(rank)]
    largest = max(chunk_numel)
    names = {b for a in plan.actions[rank] for b in (a.buf, a.grad_buf) if b}
    per_element = {BufKind.WEIGHTS: weight_bytes, BufKind.GRADS: grad_bytes, BufKind.STATE: 4}
    staging = largest * (sum(per_element[buf_kind(b)] for b in names) + scratch_bytes)
    k = int(plan.options.get("mb_per_fetch", 1))
    chunk_layers = max(b - a for a, b in plan.chunk_layers)
    boundary = plan.replica_size * k * micro_batch * seq * hidden * weight_bytes
    logits = 3 * micro_batch * seq * vocab * 4
    return MemoryEstimate(
        persistent=16 * own, staging=staging, replicated=16 * replicated_numel,
        activations=boundary + _working_set(seq, micro_batch, hidden, heads, chunk_layers, weight_bytes) + logits,
        transient=16 * own,
    )


Choice = tuple[int, int, bool]  # (k, prefetch depth, reuse_weights)


def fitting(options: dict[Choice, tuple[float, MemoryEstimate]], budget: float) -> tuple[int | None, Choice | None]:
    """Among ``options`` (busiest node's inter-node bytes and memory per choice), those whose
    memory fits ``budget`` bytes: the largest k, and the choice with the fewest bytes (the least
    memory among equals). None where nothing fits."""
    fits = {c: v for c, v in options.items() if v[1].total <= budget}
    if not fits:
        return None, None
    return max(k for k, _, _ in fits), min(fits, key=lambda c: (fits[c][0], fits[c][1].total))
