"""Bytes on the wire: measured from a Plan, and closed-form estimates for the peer methods.

TawPipe's claim is about *where* bytes flow (inside a node vs across nodes, and over which rail),
not only how many, so every byte of a plan is attributed to the rank that sends it, the rank that
receives it, a kind (weights, gradients, replicated, the step's statistics) and a scope (intra- or
inter-node). The
closed forms put DDP, FSDP, HSDP, 1F1B, WeiPipe and TawPipe side by side on one LLaMA-like model.

Collectives are counted with NCCL's bandwidth-optimal ring/chain model: a broadcast or reduce of
M bytes over k ranks is a chain of k-1 hops of M bytes (root first for a broadcast, root last for
a reduce, members in ascending order from the root); an all-reduce over n ranks is a ring in which
every rank sends 2(n-1)/n x M bytes to the next rank.
"""

from __future__ import annotations

import bisect
import functools
from collections import defaultdict
from dataclasses import dataclass, field, replace

from ..models.shape import ModelDims
from ..plan import registry
from ..plan.actions import OPS, Action, Op
from ..plan.plan import Plan
from ..plan.topology import Topology
from .units import decimal

KINDS = ("weights", "grads", "replica", "replicated", "stats")
LAYER_KINDS = ("weights", "grads", "replica")  # the kinds that move layers (of a chunk, or of its gradient)
Kind = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Traffic:
    """Per-iteration bytes of a plan, keyed by (rank, direction, kind, inter-node?); and the
    inter-node bytes of every node's link per slot, keyed by (slot, node, direction)."""

    topology: Topology
    flows: dict[tuple[int, str, str, bool], float]
    node_slots: dict[tuple[int, int, str], float] = field(default_factory=dict)

    def link_seconds(self, rate_bytes_per_s: float) -> tuple[float, float]:
        """(floor, bursts) at one link of ``rate`` per node and direction (full duplex).

        floor: the busiest node link's bytes in one direction / rate, the least an iteration can
        take on that network. bursts: the sum over slots of each slot's busiest link time, what
        the iteration takes if every slot's transfers must finish inside their slot (design §7.2).
        """
        per_link: dict[tuple[int, str], float] = defaultdict(float)
        per_slot: dict[int, float] = defaultdict(float)
        for (slot, node, d), v in self.node_slots.items():
            per_link[(node, d)] += v
            per_slot[slot] = max(per_slot[slot], v)
        floor = max(per_link.values(), default=0.0) / rate_bytes_per_s
        return floor, sum(per_slot.values()) / rate_bytes_per_s

    @functools.cached_property
    def _by_rank(self) -> dict[int, list[tuple[tuple[int, str, str, bool], float]]]:
        out: dict[int, list[tuple[tuple[int, str, str, bool], float]]] = defaultdict(list)
        for key, v in self.flows.items():
            out[key[0]].append((key, v))
        return out

    def total(self, rank: int | None = None, *, direction: str = "sent", kind: Kind = None,
              inter: bool | None = None) -> float:
        """Bytes matching every given filter (None = any; ``kind`` may name several kinds)."""
        kinds = (kind,) if isinstance(kind, str) else kind
        items = self.flows.items() if rank is None else self._by_rank.get(rank, ())
        return sum(
            v for (r, d, k, x), v in items
            if d == direction and (kinds is None or k in kinds) and (inter is None or x == inter)
        )

    def node_bytes(self, rank: int) -> tuple[float, float]:
        """(intra-node, inter-node) bytes that ``rank`` sends per iteration."""
        return self.total(rank, inter=False), self.total(rank, inter=True)

    def busiest(self, *, direction: str = "sent", kind: Kind = None,
                inter: bool | None = True) -> tuple[int, float]:
        """The rank with the most matching bytes (lowest rank on ties) and its bytes."""
        per = [self.total(r, direction=direction, kind=kind, inter=inter)
               for r in range(self.topology.world_size)]
        best = max(range(len(per)), key=lambda r: (per[r], -r))
        return best, per[best]

    def per_node(self, *, direction: str = "sent", kind: Kind = None) -> list[float]:
        """Inter-node bytes of each node (group)."""
        t = self.topology
        return [sum(self.total(r, direction=direction, kind=kind, inter=True) for r in t.group_ranks(g))
                for g in range(t.nodes)]

    def per_rail(self, *, direction: str = "sent", kind: Kind = None) -> list[float]:
        """Inter-node bytes of each rail (all ranks with the same local index)."""
        t = self.topology
        return [sum(self.total(t.rank_of(g, i), direction=direction, kind=kind, inter=True)
                    for g in range(t.nodes)) for i in range(t.per_node)]

    def summary(self, in_bytes: bool = True) -> str:
        """A few lines for humans: busiest rank per kind, per node, per rail. Without bytes (a plan
        built with one element per layer and one byte per element) only the kinds that move
        layers are counted, in layers: the statistics and the replicated modules have no such unit."""
        kinds = KINDS if in_bytes else LAYER_KINDS
        lines = []
        for kind in (*kinds, None):
            name = kind or "all"
            r, v = self.busiest(kind=kind or kinds)
            intra = max(self.total(q, kind=kind or kinds, inter=False) for q in range(self.topology.world_size))
            lines.append(f"{name:>10}: busiest rank across nodes r{r} {_fmt(v, in_bytes)}; "
                         f"most within a node by one rank {_fmt(intra, in_bytes)}")
        nodes = _listed(self.per_node(kind=kinds), in_bytes)
        rails = _listed(self.per_rail(kind=kinds), in_bytes)
        lines.append(f"across nodes, per node: {nodes}")
        lines.append(f"across nodes, per rail (local index): {rails}")
        return "\n".join(lines)


def plan_traffic(plan: Plan, *, replica_zero: bool = False) -> Traffic:
    """Attribute every byte of ``plan`` to sender, receiver, kind and scope.

    A plan of replicas is counted on replica 0's lists: the hops inside replica 0 are repeated,
    shifted, in every replica; the collectives that span replicas are counted for every rank.
    ``replica_zero``: only what replica 0's ranks send (``busiest_node_sent``); what they receive
    from other replicas is then left out."""
    topo, size = plan.topology, plan.replica_size
    replicas = 1 if replica_zero else plan.replicas
    inside: tuple[dict, dict] = (defaultdict(float), defaultdict(float))  # replica 0's (flows, node_slots)
    across: tuple[dict, dict] = (defaultdict(float), defaultdict(float))

    def hop(into: tuple[dict, dict], slot: int, src: int, dst: int, kind: str, nbytes: float) -> None:
        flows, node_slots = into
        gs, gd = topo.group_of(src), topo.group_of(dst)
        flows[(src, "sent", kind, gs != gd)] += nbytes
        flows[(dst, "received", kind, gs != gd)] += nbytes
        if gs != gd:
            node_slots[(slot, gs, "sent")] += nbytes
            node_slots[(slot, gd, "received")] += nbytes

    for acts in plan.actions[:size]:
        for a in acts:
            spec = OPS[a.op]
            if spec.transfer == "send":
                hop(inside, a.slot, a.rank, a.peer, spec.kind, a.bytes)
            elif spec.transfer == "collective" and a.root is None:  # an all-reduce: a ring
                k = len(a.group)
                if k < 2:
                    continue
                ring = 2 * (k - 1) / k * a.bytes
                if spec.scope == "job":
                    for r in range(a.rank, replicas * size, size):
                        hop(across, a.slot, r, ring_next(a, r), spec.kind, ring)
                else:
                    hop(inside, a.slot, a.rank, ring_next(a, a.rank), spec.kind, ring)
            elif spec.transfer == "collective" and a.rank == a.root:  # a chain, counted from the root
                for src, dst in chain_hops(a):
                    hop(inside, a.slot, src, dst, spec.kind, a.bytes)
    flows, node_slots = across
    nodes = topo.nodes // plan.replicas
    for i in range(replicas):
        for (r, d, kind, x), v in inside[0].items():
            flows[(r + i * size, d, kind, x)] += v
        for (slot, g, d), v in inside[1].items():
            node_slots[(slot, g + i * nodes, d)] += v
    return Traffic(topology=topo, flows=dict(flows), node_slots=dict(node_slots))


def busiest_node_sent(plan: Plan) -> float:
    """The most inter-node bytes one node sends per iteration of ``plan``. Counted on replica 0's
    nodes: every replica's lists are replica 0's shifted, and a ring over every rank or over a
    chunk's owners crosses nodes at the same places in each replica, so each replica's nodes send
    the same bytes (a plan of thousands of replicas is counted in a thousandth of the time)."""
    return max(plan_traffic(plan, replica_zero=True).per_node())


def chain_hops(a: Action) -> list[tuple[int, int]]:
    """The hops of a broadcast (from the root along the group) or a reduce (towards it): a chain."""
    members = a.group
    i = members.index(a.root)
    order = members[i:] + members[:i]
    links = list(zip(order, order[1:]))
    return links if a.op is Op.BCAST_W else [(d, s) for s, d in reversed(links)]


def ring_next(a: Action, member: int) -> int:
    """Whom ``member`` sends to in the ring of an all-reduce over ``a.group``: its place found by
    bisection in an ascending group (a job's ring holds every rank, and ``plan_traffic`` asks for
    one member per replica), by search in any other."""
    group = a.group
    i = bisect.bisect_left(group, member)
    if i == len(group) or group[i] != member:
        i = group.index(member)
    return group[(i + 1) % len(group)]


def _listed(values: list[float], in_bytes: bool, most: int = 16) -> str:
    """Every value, or for many of them their range."""
    if len(values) <= most:
        return ", ".join(_fmt(v, in_bytes) for v in values)
    return f"{len(values)} values from {_fmt(min(values), in_bytes)} to {_fmt(max(values), in_bytes)}"


def _fmt(v: float, in_bytes: bool) -> str:
    return decimal(v) if in_bytes else f"{v:,.0f} layer{'' if v == 1 else 's'}"


# ---------------------------------------------------------------------------------- closed forms


@dataclass(frozen=True)
class Estimate:
    """Closed-form bytes per iteration (global batch N x acc micro-batches) of one method."""

    method: str
    sent_per_rank: float  # mean over ranks, all links
    inter_node_per_node: float  # leaving the busiest node over inter-node links


def estimate(method: str, dims: ModelDims, topology: Topology, micro_batches: int, replicas: int = 1) -> Estimate:
    """Ring-model estimate for ``method``: a peer (ddp, fsdp, hsdp, 1f1b) or a registered schedule.

    The ring over all ranks is node-major, so it leaves each node over exactly one link. A
    schedule's chunks come from its own closed form (``Schedule.closed_form``: the paper's
    settings, one fetch per use); for other options, and exactly at a few micro-batches, count
    the plan with ``plan_traffic``. With ``replicas`` R, the schedule runs as R pipelines of G/R
    nodes, plus the ring all-reduce of each chunk's float32 gradient over its R owners, which all
    cross nodes (design §3.5); the replicated modules' ring spans every rank.
    """
    n, G, s, acc = topology.world_size, topology.nodes, topology.per_node, micro_batches
    rep = _replicated_ring(dims, n)  # world all-reduce of the replicated gradients, per rank
    cross = 1.0 if G > 1 else 0.0
    if method in PEERS:
        return _peer(method, dims, topology, micro_batches, rep)
    if method not in registry.names():
        raise ValueError(f"unknown method {method!r}; expected one of {methods()}")
    one = Topology(G // replicas, s)
    sent, inter = registry.get(method).closed_form(dims, one, acc)
    exchange = 2 * (replicas - 1) / replicas * dims.decoder_numel / one.world_size * dims.grad_bytes  # per rank
    return Estimate(method, sent + rep + exchange, inter + cross * rep + s * exchange)


def _peer(method: str, dims: ModelDims, topology: Topology, micro_batches: int, rep: float) -> Estimate:
    """The peers' closed forms; ``rep``: the replicated gradients' ring, per rank."""
    n, G, s, acc = topology.world_size, topology.nodes, topology.per_node, micro_batches
    psi, e = dims.decoder_numel, dims.replicated_numel
    wb, gb, ab = dims.dtype_bytes, dims.grad_bytes, dims.dtype_bytes
    cross = 1.0 if G > 1 else 0.0
    ring = (n - 1) / n
    if method == "ddp":  # one all-reduce of all gradients (no_sync during accumulation)
        v = 2 * ring * (psi + e) * gb
        return Estimate(method, v, cross * v)
    if method == "fsdp":  # per micro-batch: all-gather (fwd), all-gather (bwd), reduce-scatter
        v = acc * ring * (psi + e) * (2 * wb + gb)
        return Estimate(method, v, cross * v)
    if method == "hsdp":  # shard inside the node, all-reduce the shards across nodes per iteration
        intra = acc * (s - 1) / s * (psi + e) * (2 * wb + gb)
        inter_rank = 2 * (G - 1) / G * (psi + e) / s * gb
        return Estimate(method, intra + inter_rank, s * inter_rank)
    per_dir = n * acc * dims.activation_numel * ab  # 1F1B: every micro-batch crosses each boundary both ways
    return Estimate(method, 2 * per_dir * (n - 1) / n, cross * per_dir * (2 if G > 2 else 1))


def fsdp_numel(dims: ModelDims, shards: int) -> tuple[int, int]:
    """(a block's, the root's) parameters as FSDP2 moves them over ``shards`` ranks: FSDP2 cuts
    every parameter into equal dim-0 shards, padding dim 0 up to a multiple of ``shards``, and
    gathers and reduce-scatters the padded tensors. Measured on the emulated 3 x 2 cluster, the
    all-gathers of an iteration (H = 128, F = 352, 6 ranks) are exactly these sizes, 2% above the
    unpadded ones. The root is the embedding and head (one tensor where tied) plus the final
    norm, as ``replicated_numel`` counts it."""
    h, f, q, kv = dims.hidden, dims.ffn_hidden, dims.q_dim, dims.kv_dim

    def pad(rows: int) -> int:
        return -(-rows // shards) * shards

    block = pad(q) * h + pad(h) * q + 2 * pad(kv) * h + 2 * pad(f) * h + pad(h) * f + 2 * pad(h)
    return block, (1 if dims.tied else 2) * pad(dims.vocab) * h + pad(h)


def crossover_tokens(weight_bytes: float, dims: ModelDims, topology: Topology, micro_batches: int) -> float:
    """Tokens per micro-batch (B·S) at which 1F1B's inter-node bytes on the busiest node reach
    ``weight_bytes``, a weight-passing method's (its plan's, or a closed form): above it, weight
    passing moves fewer. 1F1B's bytes are linear in the tokens (design §7.4)."""
    per_token = estimate("1f1b", replace(dims, seq=1, micro_batch=1), topology, micro_batches).inter_node_per_node
    return weight_bytes / per_token if per_token else float("inf")


def weight_passing_bytes(dims: ModelDims, topology: Topology, micro_batches: int, mb_per_fetch: int = 1,
                         weight_passes: int = 2) -> float:
    """Design §7.4's closed form of a TawPipe iteration's inter-node bytes, busiest node and
    direction: (G−1)/G·(acc/k)·Ψ·(f_w·b_w + b_g) for the chunks, plus the replicated ring.
    ``weight_passes`` f_w: 2 when the backward fetches a chunk again, 1 when it stays resident."""
    G, n = topology.nodes, topology.world_size
    if G == 1:
        return 0.0
    chunks = (G - 1) / G * micro_batches / mb_per_fetch * dims.decoder_numel * (
        weight_passes * dims.dtype_bytes + dims.grad_bytes)
    return chunks + _replicated_ring(dims, n)


def _replicated_ring(dims: ModelDims, n: int) -> float:
    """Bytes a rank sends in the ring all-reduce of the replicated gradients over ``n`` ranks."""
    return 2 * (n - 1) / n * dims.replicated_numel * dims.grad_bytes


# All-gathers of K/V a backward makes per layer under each recompute (context parallelism, design
# §3.6): "chunk" and "block" run each layer's forward again once, "layer" runs the chunk's layers
# but its last again to keep their inputs and then each layer again, "none" keeps the forward's.
BACKWARD_GATHERS = {"chunk": lambda n: n, "block": lambda n: n, "layer": lambda n: 2 * n - 1, "none": lambda n: 0}


def context_share_bytes(dims: ModelDims, degree: int) -> int:
    """One layer's keys and values of one micro-batch's slice under context parallelism of
    ``degree``: what a rank contributes to each all-gather, and gets back from each reduce-scatter."""
    return 2 * dims.micro_batch * dims.seq // degree * dims.kv_dim * dims.dtype_bytes


def context_bytes(plan: Plan, rank: int, dims: ModelDims, degree: int, recompute: str) -> int:
    """Bytes ``rank`` sends in one iteration's K/V exchanges, inside its node, for sequences of
    ``dims.seq`` tokens split over ``degree`` ranks: every layer's forward all-gathers (and every
    re-run of one), every layer's backward reduce-scatters, each sending (c - 1) shares
    (``context_share_bytes``)."""
    exchanges = 0
    for a in plan.actions[rank]:
        if a.op in (Op.F, Op.B):
            first, end = plan.chunk_layers[a.chunk]
            exchanges += end - first if a.op is Op.F else end - first + BACKWARD_GATHERS[recompute](end - first)
    return (degree - 1) * context_share_bytes(dims, degree) * exchanges


PEERS = ("ddp", "fsdp", "hsdp", "1f1b")  # the methods that pass no weights: closed forms here


def methods() -> tuple[str, ...]:
    """Every method ``estimate`` knows: the peers, then the registered schedules."""
    return (*PEERS, *registry.names())
