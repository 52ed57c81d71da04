"""One training iteration of TawPipe's peers as a task graph, and their memory (design §9).

The peers are the methods of ``tawpipe.bench.baselines``, modelled as torch runs them, so that a
simulated iteration can be set beside a measured one. The global batch is N·acc micro-batches
(N = world size): every data-parallel rank runs acc of them; 1F1B feeds P·acc through each of its
N/P pipelines of P stages (P = N by default, as the bench runs it).

- ``ddp``: forward and backward of every micro-batch; on the last one (``no_sync`` before) the
  gradients are all-reduced in buckets (1 MiB first, then 25 MiB, whole parameters in the order
  their gradients become ready), each as soon as its last parameter's gradient is, on a queue of
  their own that overlaps the rest of the backward (a CUDA stream; gloo's worker thread on a
  host); then AdamW over all parameters.
- ``fsdp`` (``fully_shard`` per block over all ranks, the root holding the embedding and head):
  per micro-batch the root is gathered once (it is not resharded after forward), every block
  before its forward and again before its backward; gradients stay unsharded until the last
  micro-batch, whose backward reduce-scatters every block's and then the root's. ``fsdp-mm``
  (memory-matched) reduce-scatters after every micro-batch. ``fsdp-node``
  (``reshard_after_forward=per_node``) keeps each block's node shard after forward, so the
  backward gathers it inside the node. ``hsdp``: the same inside each node, and after each
  reduce-scatter of the last micro-batch the all-reduce of the shard across nodes (one ring per
  local index). AdamW over the rank's shard.
- ``1f1b`` (``Schedule1F1B``, one stage per rank of L/P layers, the embedding on the first stage,
  head and loss on the last): each stage runs the torch schedule's program, posting and waiting
  for its sends and receives where torch does (see ``_stage_program``); a message moves once
  both its send and its receive are posted (gloo's TCP pairs and NCCL both rendezvous). On a
  host both directions between two stages share one gloo connection (one process group), whose
  payloads take turns (``Flow.half_duplex``, measured in design §5.2). With
  N/P > 1 pipelines, each stage then all-reduces its gradient over its copies. Then AdamW.

Collectives are rings, as NCCL and gloo run them at large sizes: an all-reduce over k ranks sends
2(k−1)/k of the buffer from every rank to its ring neighbour, an all-gather or a reduce-scatter
(k−1)/k of the full buffer, all hops at once, then waits 2(k−1) or k−1 hop latencies. A ring
over several nodes is node-major, so it crosses each node boundary once. gloo has no
reduce-scatter: ``ProcessGroupGloo::_reduce_scatter_base`` all-reduces the whole buffer and keeps
a slice, so on a host (``host=True``) a reduce-scatter costs an all-reduce.

Overlap on a host (gloo): FSDP2 issues every all-gather, reduce-scatter and all-reduce with
``async_op=False``; gloo's ``Work.wait`` then blocks the calling thread, and FSDP2's streams are
no-ops on the CPU, so compute and FSDP2's collectives run one after the other. On a GPU the
same calls return at once and run on FSDP2's all-gather, reduce-scatter and all-reduce streams.
DDP's buckets and 1F1B's messages behave alike on both: DDP's reducer never waits for a bucket
until the backward ends, and ``Schedule1F1B`` waits for its messages at fixed points of its
program, which a GPU does as a stream wait and a host as a blocking one.

Scale: data-parallel ranks are identical, so a graph holds rank 0's compute and one node's
flows, on a ``Fabric`` folded to that node (a ring's hop leaving it arrives, by symmetry, from
the node before). 1F1B simulates one pipeline (one node when pipelines are smaller than a node).
Activation offload (``offload``, the data-parallel peers): torch's ``save_on_cpu(pin_memory=True)``
around the forward. Each tensor the forward saves (with checkpointing, each block's input; without,
every block's saved activations) is copied to pinned host memory by ``copy_``, which the host waits
for, and copied back before the backward that reads it on the compute stream: both directions over
the device's PCIe link, in line with compute, never beside it.

Not modelled: local copies (FSDP2's copy-in and copy-out, gradient accumulation into a buffer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..cost.memory import MemoryEstimate, gathered_kv_bytes, loss_bytes, working_set_bytes
from ..cost.traffic import fsdp_numel
from ..models.shape import ModelDims
from .hardware import Cluster
from .network import Fabric, Flow, Graph
from .workload import Workload

PEERS = ("ddp", "fsdp", "fsdp-mm", "fsdp-node", "hsdp", "1f1b")
OFFLOADING = ("ddp", "fsdp", "fsdp-mm", "fsdp-node", "hsdp")  # the peers that run with torch's save_on_cpu
# the methods modelled with context parallelism inside a node (``Workload.context``): the data-
# parallel peers, and TawPipe's schedule (design §3.6; WeiPipe's ranks of a node run other slots)
CONTEXT_PARALLEL = (*OFFLOADING, "tawpipe", "tawpipe-paper")
DDP_FIRST_BUCKET = 2**20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, used once buckets are rebuilt
DDP_BUCKET = 25 * 2**20  # bucket_cap_mb = 25
MAX_PIPELINE_TASKS = 1_000_000  # 1F1B's graph grows as stages x micro-batches; past this, ask for fewer stages


@dataclass(frozen=True)
class Ring:
    """The ring of an aligned group: ranks r, r + stride, ..., r + (size − 1)·stride, in order."""

    size: int
    stride: int = 1

    def next(self, rank: int) -> int:
        if rank // self.stride % self.size < self.size - 1:
            return rank + self.stride
        return rank - (self.size - 1) * self.stride

    def crosses(self, per_node: int) -> bool:
        return (self.size - 1) * self.stride >= per_node


_RING_SHARE = {"all-reduce": (2, 2), "all-gather": (1, 1), "reduce-scatter": (1, 1)}  # (bytes, hops) per k−1


class _Lanes:
    """The order a rank (``rank``) runs things in: a queue per lane (a CUDA stream, gloo's thread), or one
    queue for everything when every call blocks the caller (``serial``); tasks must be added in
    the caller's program order."""

    def __init__(self, graph: Graph, cluster: Cluster, ranks: range, serial: bool, rank: int = 0) -> None:
        self.graph, self.cluster, self.ranks, self.serial, self.rank = graph, cluster, ranks, serial, rank
        self.last: dict[str, int] = {}

    def add(self, lane: str, label: str, deps: Sequence[int], *, seconds: float = 0.0,
            flows: Sequence[Flow] = (), latency: float = 0.0) -> int:
        key = "caller" if self.serial else lane
        before = [self.last[key]] if key in self.last else []
        task = self.graph.add(label, [*deps, *before], seconds=seconds, flows=flows, latency=latency,
                              rank=self.rank, lane=lane)
        self.last[key] = task
        return task

    def collective(self, op: str, ring: Ring, nbytes: float, deps: Sequence[int], label: str,
                   lane: str | None = None) -> list[int]:
        """A ring collective of a buffer of ``nbytes`` (an all-gather's output, a reduce-scatter's
        input) by every simulated rank's group; [] over one rank."""
        k = ring.size
        if k < 2 or nbytes <= 0:
            return []
        share, hops = _RING_SHARE[op]
        per_hop = share * (k - 1) / k * nbytes
        flows = [Flow(r, ring.next(r), per_hop) for r in self.ranks]
        latency = hops * (k - 1) * self.cluster.hop_latency(ring.crosses(self.cluster.per_node))
        return [self.add(lane or op, label, deps, flows=flows, latency=latency)]


def ring_collective(graph: Graph, cluster: Cluster, op: str, nbytes: float, ring: Ring, ranks: range,
                    deps: Sequence[int] = ()) -> list[int]:
    """Add one ring collective (``op`` in all-reduce, all-gather, reduce-scatter) of ``ranks``'
    groups to ``graph``: the building block of every peer, public for tests and other graphs."""
    if op not in _RING_SHARE:
        raise ValueError(f"collective {op!r}: expected one of {', '.join(_RING_SHARE)}")
    return _Lanes(graph, cluster, ranks, serial=False).collective(op, ring, nbytes, deps, op)


def peer_graph(method: str, cluster: Cluster, work: Workload, acc: int, *, host: bool,
               stages: int | None = None, offload: bool = False) -> tuple[Graph, Fabric]:
    """One iteration of ``method`` (one of ``PEERS``) with ``acc`` micro-batches per data-parallel
    rank, and the fabric to play it on. ``host``: gloo on CPU ranks rather than NCCL on GPUs.
    ``stages`` (1F1B only): stages per pipeline, N by default. ``offload``: the forward's saved
    tensors through host memory (``save_on_cpu``; ``OFFLOADING`` peers only)."""
    if method not in PEERS:
        raise ValueError(f"unknown peer {method!r}; expected one of {', '.join(PEERS)}")
    if acc < 1:
        raise ValueError(f"acc must be >= 1, got {acc}")
    if offload and method not in OFFLOADING:
        raise ValueError(f"activation offload is modelled for {', '.join(OFFLOADING)} (torch's save_on_cpu), "
                         f"not {method}")
    if work.context > 1 and (method not in CONTEXT_PARALLEL or cluster.per_node % work.context):
        raise ValueError(f"context parallelism over {work.context} ranks is modelled inside a node for the "
                         f"data-parallel peers: give a degree that divides the {cluster.per_node} ranks per node")
    if method == "1f1b":
        return _one_f_one_b(cluster, work, acc, cluster.world_size if stages is None else stages, host)
    if stages is not None:
        raise ValueError("stages applies to 1f1b only")
    graph = Graph()
    fold = 1 if cluster.nodes > 1 else None
    layer = _Layer(work, saved_bytes(work, offload))
    if method == "ddp":
        _ddp(_Lanes(graph, cluster, range(cluster.per_node), serial=False), layer, acc)
    else:
        _fsdp(_Lanes(graph, cluster, range(cluster.per_node), serial=host), method, layer, acc, host)
    return graph, cluster.fabric(fold, host=host)


def saved_bytes(work: Workload, offload: bool) -> float:
    """What a block's forward saves for its backward, where ``save_on_cpu`` moves it (0: no offload):
    with checkpointing its input, else its activations (``working_set_bytes``)."""
    if not offload:
        return 0.0
    d = work.dims
    return d.activation_numel * d.dtype_bytes if work.recompute else working_set_bytes(d, 1)


@dataclass(frozen=True)
class _Layer:
    """A data-parallel peer's block, forward and backward, with ``save_on_cpu``'s copies of
    ``saved`` bytes (0: none) on the compute stream before the backward and after the forward.
    Under context parallelism (``work.context`` c > 1, the c consecutive ranks of a node) attention
    needs every rank's keys and values: each forward (the backward's re-run one too) all-gathers
    them over the c ranks before it computes, and each backward reduce-scatters their gradients
    after it, on a lane of their own, before the next backward starts (the layer's input
    gradient and its K/V projections' need them, as in TawPipe's engine, design §3.6); all-gather
    CP as Llama 3 ran it (torch's ring attention moves the same bytes in c − 1 steps beside the
    compute; this model exposes them)."""

    work: Workload
    saved: float

    def forward(self, lanes: _Lanes, label: str, deps: list[int]) -> list[int]:
        task = lanes.add("compute", label, [*deps, *self._keys(lanes, f"K/V {label}", deps)],
                         seconds=self.work.layer_forward())
        return [self._copy(lanes, f"save {label}", "d2h", [task])] if self.saved else [task]

    def backward(self, lanes: _Lanes, label: str, deps: list[int]) -> int:
        if self.saved:
            deps = [self._copy(lanes, f"unpack {label}", "h2d", deps)]
        keys = self._keys(lanes, f"K/V {label}", deps) if self.work.recompute else []
        task = lanes.add("compute", label, [*deps, *keys], seconds=self.work.layer_backward())
        return (self._keys(lanes, f"dK/dV {label}", [task], "reduce-scatter") or [task])[0]

    def _keys(self, lanes: _Lanes, label: str, deps: list[int], op: str = "all-gather") -> list[int]:
        """The layer's keys and values of the whole sequence, gathered (or their gradients
        scattered) over the context-parallel ranks; [] without context parallelism."""
        c = self.work.context
        if c < 2:
            return []
        return lanes.collective(op, Ring(c), c * self.work.kv_share_bytes(), deps, label, "cp")

    def _copy(self, lanes: _Lanes, label: str, direction: str, deps: list[int]) -> int:
        return lanes.add("compute", label, deps, flows=[Flow(r, r, self.saved, pcie=direction) for r in lanes.ranks])


# ------------------------------------------------------------------------------------ data parallel


def _layer_params(dims: ModelDims) -> list[int]:
    """A LLaMA block's parameters in the order backward produces their gradients: the MLP's down,
    up and gate projections, its norm, then attention's output, value, key, query and its norm."""
    h, f, q, kv = dims.hidden, dims.ffn_hidden, dims.q_dim, dims.kv_dim
    return [h * f, f * h, f * h, h, h * q, h * kv, h * kv, h * q, h]


def _buckets(ready: list[tuple[int, list[int]]], elem_bytes: int) -> list[tuple[float, int]]:
    """DDP's rebuilt buckets over parameters in gradient-ready order, ``ready`` listing each
    task with the parameters whose gradients it completes: (bytes, task whose end fills it)."""
    out: list[tuple[float, int]] = []
    size = 0.0
    for task, params in ready:
        for numel in params:
            size += numel * elem_bytes
            if size >= (DDP_FIRST_BUCKET if not out else DDP_BUCKET):
                out.append((size, task))
                size = 0.0
    if size:
        out.append((size, ready[-1][0]))
    return out


def _ddp(lanes: _Lanes, layer: _Layer, acc: int) -> None:
    work = layer.work
    d = work.dims
    ready: list[tuple[int, list[int]]] = []  # the last micro-batch's is the one that counts
    chain: list[int] = []
    for m in range(acc):
        chain = [lanes.add("compute", f"embed m{m}", chain, seconds=work.embed() / 3)]
        for i in range(d.layers):
            chain = layer.forward(lanes, f"F{i} m{m}", chain)
        chain = [lanes.add("compute", f"head m{m}", chain, seconds=work.head())]
        ready = [(chain[0], [d.hidden])]  # the final norm; the tied embedding's gradient completes last
        for i in reversed(range(d.layers)):
            chain = [layer.backward(lanes, f"B{i} m{m}", chain)]
            ready.append((chain[0], _layer_params(d)))
        chain = [lanes.add("compute", f"embed grad m{m}", chain, seconds=2 * work.embed() / 3)]
        ready.append((chain[0], [d.replicated_numel - d.hidden]))
    ring, done = Ring(lanes.cluster.world_size), list(chain)
    for b, (nbytes, task) in enumerate(_buckets(ready, d.grad_bytes)):
        done += lanes.collective("all-reduce", ring, nbytes, [task], f"bucket {b}")
    lanes.add("compute", "step", done, seconds=work.step(d.decoder_numel + d.replicated_numel))


def _fsdp(lanes: _Lanes, method: str, layer_: _Layer, acc: int, host: bool) -> None:
    """FSDP2's hooks in program order. On a GPU: the all-gather of the k-th unit of the forward
    (root, block 0, ...) waits until the compute two units back has had its copy-out, i.e. until
    unit k − 3 has run (FSDP2 keeps the previous all-gather's output until the next copy-out);
    a backward block's all-gather is issued once the block after it has been gathered and its
    copy-out run; the compute stream waits for the reduce-scatter two blocks back
    (``reduce_scatter_max_input_buffers`` = 1); ``finalize_backward`` waits for every reduction."""
    c, work = lanes.cluster, layer_.work
    d = work.dims
    n, s = c.world_size, c.per_node
    hsdp = method == "hsdp"
    shard = Ring(s) if hsdp else Ring(n)
    back = Ring(s) if method == "fsdp-node" else shard
    across = Ring(c.nodes, s) if hsdp else None
    reduce_op = "all-reduce" if host else "reduce-scatter"
    layer, root = fsdp_numel(d, s if hsdp else n)  # as FSDP2 pads them
    start: list[int] = []

    def reduce(name: str, numel: int, deps: list[int]) -> tuple[list[int], list[int]]:
        """(the reduce-scatter, it and the all-reduce after it) of one unit's gradient."""
        rs = lanes.collective(reduce_op, shard, numel * d.grad_bytes, deps, f"reduce-scatter {name}", "reduce-scatter")
        if across is None:
            return rs, rs
        return rs, rs + lanes.collective("all-reduce", across, numel / s * d.grad_bytes, rs, f"all-reduce {name}")

    for m in range(acc):
        sync = method == "fsdp-mm" or m == acc - 1
        comp: list[int] = []
        for k, (name, numel) in enumerate([("embed", root)] + [(f"F{i}", layer) for i in range(d.layers)]):
            ag = lanes.collective("all-gather", shard, numel * d.dtype_bytes,
                                  [*start, *(comp[k - 3:k - 2] if k >= 3 else [])], f"all-gather {name} m{m}")
            deps = [*(comp[-1:] or start), *ag]
            comp += layer_.forward(lanes, f"{name} m{m}", deps) if k else \
                [lanes.add("compute", f"{name} m{m}", deps, seconds=work.embed() / 3)]
        before = comp[-1:]  # the compute stream's position: what a copy-out, hence an all-gather, waits for
        comp.append(lanes.add("compute", f"head m{m}", before, seconds=work.head()))
        gathered = {d.layers - 1: lanes.collective("all-gather", back, layer * d.dtype_bytes, before,
                                                   f"all-gather B{d.layers - 1} m{m}")}
        before, scattered, waited = comp[-1:], [], []
        for i in reversed(range(d.layers)):
            if i > 0:  # pre_backward(i) prefetches block i − 1 after block i's copy-out
                gathered[i - 1] = lanes.collective("all-gather", back, layer * d.dtype_bytes, before + waited,
                                                   f"all-gather B{i - 1} m{m}")
            task = layer_.backward(lanes, f"B{i} m{m}", [*before, *waited, *gathered.pop(i)])
            before, waited = [task], scattered  # post_backward(i) waits for block i + 1's reduce-scatter
            if sync:
                scattered = reduce(f"B{i} m{m}", layer, [task])[0]
        task = lanes.add("compute", f"embed grad m{m}", [*before, *waited], seconds=2 * work.embed() / 3)
        start = [task, *(reduce(f"root m{m}", root, [task])[1] if sync else [])]  # each lane ends with the root's
    lanes.add("compute", "step", start, seconds=work.step((d.decoder_numel + d.replicated_numel) / (s if hsdp else n)))


# ------------------------------------------------------------------------------------------ 1F1B


def _stage_ends(dims: ModelDims, stages: int, stage: int) -> int:
    """Parameters of ``stage`` besides its layers: the embedding on the first, the head (its own
    copy of a tied embedding) and the final norm on the last."""
    table = dims.vocab * dims.hidden
    return (table if stage == 0 else 0) + (table + dims.hidden if stage == stages - 1 else 0)


def _stage_layers(layers: int, stages: int, stage: int) -> int:
    """Layers of ``stage``, as ``baselines.stage_layers`` balances them."""
    base, extra = divmod(layers, stages)
    return base + (stage < extra)


def stage_counts(nodes: int, per_node: int, layers: int) -> list[int]:
    """1F1B's stage counts P that the simulator plays on ``nodes`` x ``per_node``, ascending:
    2 <= P <= the layers, P dividing the ranks, pipelines that tile nodes (P a multiple or a divisor
    of ``per_node``)."""
    n = nodes * per_node
    return [p for p in range(2, min(n, layers) + 1) if n % p == 0 and (p % per_node == 0 or per_node % p == 0)]


def _pipeline_shape(cluster: Cluster, stages: int, layers: int) -> None:
    n, s = cluster.world_size, cluster.per_node
    fits = stage_counts(cluster.nodes, s, layers)
    way_out = f"--stages {', '.join(map(str, fits))}" if fits else "no stage count fits this cluster and model"
    if stages > layers:
        raise ValueError(f"1F1B with {stages} stages needs at least {stages} layers, the model has {layers}: "
                         f"use fewer stages per pipeline ({way_out})")
    if stages not in fits:
        raise ValueError(f"1F1B with {stages} stages on {cluster.nodes} x {s}: needs 2 <= stages, stages dividing "
                         f"the {n} ranks, and pipelines that tile nodes (stages a multiple or a divisor of {s}): "
                         f"{way_out}")


def _too_many_tasks(cluster: Cluster, layers: int, stages: int, acc: int) -> str:
    """Why 1F1B's pipeline is too large to play, in the flags' terms: a pipeline of P stages runs
    P x acc micro-batches, about 4 P^2 acc tasks, so fewer stages or fewer micro-batches per device."""
    tasks, fewer = 4 * stages * stages * acc, [p for p in stage_counts(cluster.nodes, cluster.per_node, layers)
                                                if 4 * p * p * acc <= MAX_PIPELINE_TASKS]
    most = MAX_PIPELINE_TASKS // (4 * stages * stages)
    ways = ([f"fewer stages per pipeline (--stages {', '.join(map(str, fewer))}; its data-parallel copies are "
             f"symmetric)"] if fewer else []) + ([f"at most --micro-batches {most}"] if most else [])
    return (f"1F1B with {stages} stages at {acc} micro-batches per device runs {stages * acc:,} micro-batches through "
            f"each pipeline, about {tasks:,} tasks, more than the {MAX_PIPELINE_TASKS:,} the simulator plays: "
            f"{'use ' + ' or '.join(ways) if ways else 'no stage count plays on this cluster'}")


def _one_f_one_b(cluster: Cluster, work: Workload, acc: int, stages: int, host: bool) -> tuple[Graph, Fabric]:
    _pipeline_shape(cluster, stages, work.dims.layers)
    d, s = work.dims, cluster.per_node
    copies, micro = cluster.world_size // stages, stages * acc  # a pipeline runs its devices' micro-batches
    if 4 * stages * micro > MAX_PIPELINE_TASKS:
        raise ValueError(_too_many_tasks(cluster, work.dims.layers, stages, acc))
    graph = Graph()
    act = d.activation_numel * d.dtype_bytes
    fwd = [[graph.add(f"act {p}->{p + 1} m{i}", flows=[Flow(p, p + 1, act, host)], rank=p, lane="send",
                      latency=cluster.hop_latency((p + 1) % s == 0)) for i in range(micro)] for p in range(stages - 1)]
    bwd = [[graph.add(f"grad {p + 1}->{p} m{i}", flows=[Flow(p + 1, p, act, host)], rank=p + 1, lane="send",
                      latency=cluster.hop_latency((p + 1) % s == 0)) for i in range(micro)] for p in range(stages - 1)]
    sim_nodes = max(1, stages // s)  # one pipeline, or the one node that holds several
    for p in range(stages):
        end = _stage_program(graph, work, p, stages, micro, fwd, bwd)
        numel = _stage_layers(d.layers, stages, p) * d.layer_numel + _stage_ends(d, stages, p)
        lanes = _Lanes(graph, cluster, range(p, sim_nodes * s, stages), serial=False, rank=p)
        done = end + lanes.collective("all-reduce", Ring(copies, stages), numel * d.grad_bytes, end, f"grads {p}")
        graph.add(f"step {p}", done, seconds=work.step(numel), rank=p)
    return graph, cluster.fabric(sim_nodes if cluster.nodes > sim_nodes else None, host=host)


def _stage_program(graph: Graph, work: Workload, p: int, stages: int, micro: int,
                   fwd: list[list[int]], bwd: list[list[int]]) -> list[int]:
    """Stage ``p``'s part of ``Schedule1F1B._step_microbatches``: warm-up forwards (each send
    posted after the forward and the previous send's wait, the last one held back), then pairs
    of [post the held forward send with the next gradient's receive, wait both; backward;
    post the gradient's send with the next input's receive, wait both; forward], then the
    cool-down backwards (each receive waited before the backward, the previous send after it).
    A message waits for both of its posts; ``post`` adds this stage's. Returns what its step
    waits for. The first stage adds the embedding, the last the head (forward a third of
    ``Workload.head``, backward the rest)."""
    d = work.dims
    layers = _stage_layers(d.layers, stages, p)
    ends = (work.embed() if p == 0 else 0.0) + (work.head() if p == stages - 1 else 0.0)
    f = layers * work.layer_forward() + ends / 3
    b = layers * work.layer_backward() + 2 * ends / 3
    sends_fwd, recvs_fwd = (fwd[p] if p < stages - 1 else None), (fwd[p - 1] if p > 0 else None)
    sends_bwd, recvs_bwd = (bwd[p - 1] if p > 0 else None), (bwd[p] if p < stages - 1 else None)
    cursor: list[int] = []  # what the stage's next compute waits for

    def post(ops: list[int]) -> list[int]:
        for op in ops:
            graph.add_deps(op, cursor)
        return ops

    def msg(queue: list[int] | None, i: int) -> list[int]:
        return [queue[i]] if queue is not None else []

    warmup = min(micro, stages - p)
    send_work: list[int] = []
    held: list[int] = []
    for i in range(warmup):
        cursor += post(msg(recvs_fwd, i))
        cursor = [graph.add(f"F m{i}", cursor, seconds=f, rank=p)] + send_work
        send_work, held = [], msg(sends_fwd, i)
        if i != warmup - 1:
            send_work, held = post(held), []
    fwd_i, bwd_i = warmup, 0
    while True:
        cursor += post(held + msg(recvs_bwd, bwd_i))
        cursor = [graph.add(f"B m{bwd_i}", cursor, seconds=b, rank=p)]
        held, bwd_i = msg(sends_bwd, bwd_i), bwd_i + 1
        if fwd_i == micro:
            break
        cursor += post(held + msg(recvs_fwd, fwd_i))
        cursor = [graph.add(f"F m{fwd_i}", cursor, seconds=f, rank=p)]
        held, fwd_i = msg(sends_fwd, fwd_i), fwd_i + 1
    send_work = post(held)
    while bwd_i < micro:
        cursor += post(msg(recvs_bwd, bwd_i))
        cursor = [graph.add(f"B m{bwd_i}", cursor, seconds=b, rank=p)] + send_work
        send_work, bwd_i = post(msg(sends_bwd, bwd_i)), bwd_i + 1
    return cursor + send_work


# ---------------------------------------------------------------------------------------- memory


def peer_memory(method: str, dims: ModelDims, cluster: Cluster, acc: int, recompute: bool, *,
                stages: int | None = None, offload: bool = False, chunked_loss: bool = False,
                context: int = 1) -> MemoryEstimate:
    """The busiest rank's memory under ``method``, in the fields of ``cost.memory``:

    - persistent: 16 B per own decoder parameter (float32 weight and gradient, two AdamW moments),
      all of them (DDP), 1/N (FSDP), 1/s (HSDP) or the stage's (1F1B);
    - replicated: the same 16 B for the embedding, head and final norm, sharded alike (1F1B: the
      first stage holds the embedding, the last the head and the final norm);
    - staging: DDP's bucket copy of every gradient; FSDP's root and up to three blocks unsharded
      (one computing, two gathered ahead), the unsharded gradients (all of them while they
      accumulate over micro-batches, else the root's and two blocks'), and for ``fsdp-node`` the
      blocks' node shards kept between forward and backward; 1F1B with data-parallel copies,
      the stage's gradient buckets;
    - activations: with ``recompute`` each layer's input plus one layer's working set, else every
      layer's working set (``working_set_bytes``), for one micro-batch (data parallel) or the
      micro-batches a stage holds (min(M, P − p) on stage p); plus what the head and loss hold
      where the head runs (``cost.memory.loss_bytes``: the whole float32 logits, or with
      ``chunked_loss`` one slice of them). With ``offload`` (``save_on_cpu``) what the layers save
      is on the host (``host``) but for the one layer's brought back. With context parallelism
      (``dims.seq`` a slice of ``context``) one layer's gathered keys and values and their
      gradients (``gathered_kv_bytes``).
    """
    if method not in PEERS:
        raise ValueError(f"unknown peer {method!r}; expected one of {', '.join(PEERS)}")
    if offload and method not in OFFLOADING:
        raise ValueError(f"activation offload is modelled for {', '.join(OFFLOADING)}, not {method}")
    n, s, g = cluster.world_size, cluster.per_node, cluster.nodes
    psi, e, layer = dims.decoder_numel, dims.replicated_numel, dims.layer_numel
    act = dims.activation_numel * dims.dtype_bytes
    loss = loss_bytes(dims, chunked=chunked_loss)

    def held(layers: int, micro_batches: int) -> float:
        if recompute:
            return micro_batches * layers * act + working_set_bytes(dims, 1)
        return micro_batches * working_set_bytes(dims, layers)

    if method == "1f1b":
        p_count = cluster.world_size if stages is None else stages
        _pipeline_shape(cluster, p_count, dims.layers)
        copies, micro = n // p_count, p_count * acc
        out = []
        for p in range(p_count):
            layers = _stage_layers(dims.layers, p_count, p)
            ends = _stage_ends(dims, p_count, p)
            out.append(MemoryEstimate(
                persistent=16 * layers * layer,
                staging=(layers * layer + ends) * dims.grad_bytes if copies > 1 else 0.0,
                replicated=16 * ends,
                activations=held(layers, min(micro, p_count - p)) + (loss if p == p_count - 1 else 0)))
        return max(out, key=lambda m: m.total)
    on_host = 0.0
    if offload:
        saved = act if recompute else working_set_bytes(dims, 1)
        activations, on_host = working_set_bytes(dims, 1) + (saved if recompute else 0.0), dims.layers * saved
    else:
        activations = held(dims.layers, 1)
    activations += loss + gathered_kv_bytes(dims, context)
    if method == "ddp":
        return MemoryEstimate(persistent=16 * psi, staging=(psi + e) * dims.grad_bytes, replicated=16 * e,
                              activations=activations, host=on_host)
    shards = s if method == "hsdp" else n
    unsharded = (e + 3 * layer) * dims.dtype_bytes
    grads = (psi + e if acc > 1 and method != "fsdp-mm" else e + 2 * layer) * dims.grad_bytes
    node_shards = psi * dims.dtype_bytes / s if method == "fsdp-node" and g > 1 else 0.0
    return MemoryEstimate(persistent=16 * psi / shards, staging=unsharded + grads + node_shards,
                          replicated=16 * e / shards, activations=activations, host=on_host)
