"""A TawPipe or WeiPipe plan as the engine runs it, as a task graph (design §9.3).

The graph follows the executor (design §5.1–5.2) unit by unit: the same ``batches``, the same
dataflow dependencies (``Hazards`` on the names each op reads and writes), compute in list
order, each channel an in-order queue. ``host=True`` is the CPU executor: the calling thread
reaches a unit only once every compute unit before it has run, point-to-point units and local
channel work float (they wait for their dependencies, not their queue), and a send is done once
gloo has handed its payload to the kernel's socket buffer. ``host=False`` is
a GPU: the host runs ahead, so only streams and dependencies order the work. A message moves once
both of its sides are posted; a collective once all its members are. A plan of replicas is played
on replica 0, whose nodes stand for every replica's (``Fabric.fold``): the collectives that span
replicas send their hops to the mirror images of replica 0's ranks.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ..cost.memory import AUTO, MARGIN, MemoryEstimate, Savers, auto_plan, in_place_gradients
from ..cost.traffic import BACKWARD_GATHERS, chain_hops, ring_next
from ..plan.actions import ACC, MASTER, OPS, Action, Channel, Hazards, Op, batches, describe
from ..plan.context import check_plan as check_context
from ..plan.plan import STEP_PIECES, Plan
from ..plan.schedule import build_plan
from ..plan.topology import Topology
from .hardware import Cluster
from .network import Fabric, Flow, Graph
from .workload import Workload


SOCKET_BUFFER = 4 * 2**20  # Linux's largest TCP send buffer (net.ipv4.tcp_wmem), bytes


@dataclass
class _Message:
    posts: list[int]
    dones: list[tuple[int, bool]]  # (the unit's done, whether it is the sending side of a message)
    action: Action | None = None  # the send's, or the root's / first member's of a collective


def plan_graph(plan: Plan, cluster: Cluster, work: Workload, *, host: bool,
               savers: Savers = Savers()) -> tuple[Graph, Fabric]:
    """The graph of one iteration of ``plan`` (built with real byte sizes) run with the memory
    ``savers``, and the fabric to play it on: replica 0's ranks on ``cluster``'s links."""
    topo = plan.topology
    if (topo.nodes, topo.per_node) != (cluster.nodes, cluster.per_node):
        raise ValueError(f"the plan is for {topo.nodes} x {topo.per_node}, the cluster is "
                         f"{cluster.nodes} x {cluster.per_node}")
    if work.context > 1:
        check_context(plan, work.context)
    g = Graph()
    messages: dict[tuple, _Message] = {}
    exchanges: dict[tuple, _Message] = {}
    for r in range(plan.replica_size):
        _rank(g, plan, r, _Device(work, savers, cluster.host.adamw_bandwidth / cluster.per_node), host, messages,
              exchanges)
    _play_exchanges(g, exchanges, work, cluster, plan.replica_size)
    for key, m in messages.items():
        if m.action is None or len(m.posts) < (2 if key[0] == "p2p" else 1):
            raise ValueError(f"{key}: a message without both sides in the plan")
        flows, hops = _flows(plan, m.action, host)
        crosses = any(topo.group_of(f.src) != topo.group_of(f.dst) for f in flows)
        latency = hops * cluster.hop_latency(crosses)
        t = g.add(describe(m.action), m.posts, flows=flows, latency=latency, rank=m.action.rank,
                  lane=str(OPS[m.action.op].channel))
        # gloo's send is done once its payload is in the kernel's socket buffer: the sender goes
        # on while the bytes cross the link (the receiver has posted: gloo sends only then)
        handed_off = g.add("", m.posts, latency=latency) if host and key[0] == "p2p" and \
            m.action.bytes <= SOCKET_BUFFER else t
        for done, sending in m.dones:
            g.add_deps(done, [handed_off if sending else t])
    fold = topo.nodes // plan.replicas if plan.replicas > 1 else None
    return g, cluster.fabric(fold, host=host)


def compute_seconds(plan: Plan, a: Action, work: Workload, savers: Savers = Savers()) -> float:
    """What ``a`` costs its rank's device under ``savers`` (0 for a transfer, and for the state's
    updates that the host runs with ``offload_state``)."""
    d = work.dims
    if a.op in (Op.F, Op.B):
        start, stop = plan.chunk_layers[a.chunk]
        if a.op is Op.F:
            t = (stop - start) * work.layer_forward()
        else:
            t = (stop - start) * work.layer_backward(forwards=savers.forwards_in_backward)
        if a.op is Op.F and a.chunk == plan.model_order[-1]:
            t += work.head()  # the head's forward and backward run with the last chunk's forward
        if a.op is Op.B and a.chunk == plan.model_order[0]:
            t += work.embed()
        return t
    if a.op is Op.LOAD_W:  # a cast of the float32 master into the compute dtype
        return work.copy(plan.chunk_numel(a.chunk) * (4 + d.dtype_bytes))
    if a.op is Op.ACC_G:  # float32 += a received gradient (on the host with offloaded state; or added by its B)
        if savers.offload_state or a.buf in in_place_gradients(plan, a.rank, d.grad_bytes, savers):
            return 0.0
        return work.copy(plan.chunk_numel(a.chunk) * (8 + d.grad_bytes))
    if a.op is Op.STEP:  # the replicated parameters always, the own chunk's where its state is
        own = 0 if savers.offload_state else plan.chunk_numel(plan.own_chunk(a.rank))
        return work.step(own + d.replicated_numel)
    return 0.0


@dataclass(frozen=True)
class _Device:
    """What a rank's units cost: ``work`` under ``savers``, the host stepping at ``host_bandwidth``."""

    work: Workload
    savers: Savers
    host_bandwidth: float


class _HostCopies:
    """The memory savers' copies over one rank's PCIe link, as the engine issues them (design
    §6.2): each forward's kept inputs stored on a store stream after it; each backward's fetched
    on a fetch stream once the backward two before it has run (one input in use, one coming back;
    under "block" the engine fetches a chunk's layer inputs one at a time during its backward,
    played here as one copy of the same bytes before it); with offloaded state,
    each LOAD_W reads the float32 master before its cast, each ACC_G sends the gradient to the
    host a piece at a time, the host adding each while the next crosses, and the host steps the
    own chunk: where the rank has a ``carried_load``, once every transfer of the rank is done, in
    ``STEP_PIECES`` equal pieces, each piece's part of that load crossing and cast once it is
    stepped (the next iteration's LOAD_W then moves nothing, design §6.1); elsewhere at once.
    A STASH_W or RESTORE_W (``reuse_weights="host"``) is its chunk's weights crossing, in order on
    the weights channel as the engine runs it. A backward a layer at a time streams its gradient
    to the ACC_G after it where the plan allows (``Plan.streamed_accumulations``), each piece
    crossing once whole (``backward``). On a GPU the host steps beside the next iteration: the
    previous step's pieces are played from the start (``_step_before``), the first forward of the
    carried buffer runs each layer once its piece is cast (``forward``), and whatever touches the
    step's state waits for its end (``beside_deps``)."""

    def __init__(self, g: Graph, plan: Plan, r: int, device: _Device, host: bool) -> None:
        self.g, self.plan, self.r, self.savers, self.host = g, plan, r, device.savers, host
        d = device.work.dims
        self.input_bytes = d.activation_numel * d.dtype_bytes
        self.own = plan.chunk_numel(plan.own_chunk(r))
        self.grad_bytes, self.host_bandwidth, self.work = d.grad_bytes, device.host_bandwidth, device.work
        self.weight_bytes = d.dtype_bytes
        self.stored: dict[tuple, int] = {}
        self.lanes: dict[str, int] = {}
        self.backwards: list[int] = []
        self.carried = plan.carried_load(r) if self.savers.offload_state else None
        self.transfers: list[int] = []  # this rank's units off the compute channel: what STEP settles
        self.computed: set[int] = set()  # its compute units
        # A backward a layer at a time hands each layer's gradient to its ACC_G as it finishes it
        self.streamed = (plan.streamed_accumulations(r) if self.savers.offload_state and self.savers.layerwise
                         else {})
        self.whole: dict[Action, list[int]] = {}  # streamed ACC_G -> where its B has made each piece whole
        # On a GPU the host steps the own chunk beside the next iteration: played as the step
        # before this iteration's, from its start, this iteration's STEP then the device's part
        self.beside = self.carried is not None and not host
        self.loaded: list[int] = []  # each piece's cast, which the forward's layers of it wait for
        self.stepped: int | None = None  # that step done, and its loads' reads of the master
        self.released = False  # the rank's thread has gone past a unit that waits for that step
        if self.beside:
            self._step_before()

    def _copy(self, lane: str, label: str, nbytes: float, direction: str, deps: list[int]) -> int:
        before = [self.lanes[lane]] if lane in self.lanes else []
        t = self.g.add(label, [*deps, *before], flows=[Flow(self.r, self.r, nbytes, pcie=direction)], rank=self.r,
                       lane=lane)
        self.lanes[lane] = t
        return t

    def moves(self, a: Action) -> bool:
        """Whether ``a``'s unit does its work here: not the ``carried_load``, which the step
        before it made."""
        return a != self.carried

    def after(self, a: Action, done: int) -> None:
        """Copies that follow unit ``done`` of ``a``."""
        if OPS[a.op].channel is not Channel.COMPUTE:
            self.transfers.append(done)
        else:
            self.computed.add(done)
        if a.op is Op.F and self.savers.offload_activations:
            start, stop = self.plan.chunk_layers[a.chunk]
            nbytes = self.savers.kept_per_forward(stop - start) * self.input_bytes
            self.stored[(a.chunk, a.mb)] = self._copy("store", f"store F{a.chunk} m{a.mb}", nbytes, "d2h", [done])
        elif a.op is Op.B:
            self.backwards.append(done)

    def before(self, a: Action, deps: list[int]) -> list[int]:
        """What ``a``'s unit also waits for: its host copies, added now."""
        if a.op is Op.B and self.savers.offload_activations:
            start, stop = self.plan.chunk_layers[a.chunk]
            nbytes = self.savers.kept_per_forward(stop - start) * self.input_bytes
            freed = self.backwards[-2:-1]  # two fetch buffers: the backward two before frees one
            return [self._copy("fetch", f"fetch B{a.chunk} m{a.mb}", nbytes, "h2d",
                               [self.stored[(a.chunk, a.mb)], *freed])]
        if a.op in (Op.STASH_W, Op.RESTORE_W):
            to_host = a.op is Op.STASH_W
            return [self._copy("stash", f"W{a.chunk} {'to' if to_host else 'from'} host",
                               self.plan.chunk_numel(a.chunk) * self.weight_bytes,  # type: ignore[arg-type]
                               "d2h" if to_host else "h2d", deps)]
        if not self.savers.offload_state:
            return []
        if a.op is Op.LOAD_W:
            return [self._copy("state", "load master", 4 * self.own, "h2d", deps)] if self.moves(a) else []
        if a.op is Op.ACC_G:
            return [self._host_accumulate(deps, self.whole.pop(a, None))]
        if a.op is Op.STEP:
            return self._host_step(deps)
        return []

    def _step_before(self) -> None:
        """The previous iteration's step of the own chunk, on the host beside this one (design
        §6.1): ``STEP_PIECES`` pieces from the start, each loaded and cast once stepped."""
        steps, self.loaded, loaded = self._pieces([], STEP_PIECES, load=True)
        self.stepped = self.g.add("host step done", [steps[-1], loaded], rank=self.r, lane="host")

    def _pieces(self, before: list[int], n: int, load: bool) -> tuple[list[int], list[int], int | None]:
        """The host's AdamW of the own chunk in ``n`` pieces after ``before``; with ``load``, each
        piece's part of the carried load crossing, then cast on the weights lane, once the piece is
        stepped (on a CPU the stepping thread casts it before the next piece). Returns each piece's
        step, each one's cast, and the last load."""
        piece, steps, casts, loaded = self.own / n, [], [], None
        for i in range(1, n + 1):
            step = self.g.add("host AdamW", before, seconds=self.work.host_step(piece, self.host_bandwidth),
                              rank=self.r, lane="host")
            steps.append(step)
            before = [step]
            if load:
                loaded = self._copy("state", f"load master {i}/{n}", 4 * piece, "h2d", [step])
                casts.append(self.g.add(f"cast {i}/{n}", [loaded, *casts[-1:]],
                                        seconds=self.work.copy(piece * (4 + self.weight_bytes)), rank=self.r,
                                        lane=str(Channel.WEIGHTS)))
                before += casts[-1:] if self.host else []
        return steps, casts, loaded

    def beside_deps(self, a: Action) -> list[int]:
        """What ``a``'s unit waits for of the step beside: its end where ``a`` reads or writes what
        it changes (the master, the accumulator, the carried buffer; not the carried load), or
        follows such a unit or a forward it held back (the rank's thread waited there)."""
        if not self.beside or self.stepped is None:
            return []
        touches = {MASTER, ACC, self.carried.buf} & {*self.plan.reads(a), *self.plan.writes(a)}
        if self.released or (touches and a != self.carried):
            self.released = True
            return [self.stepped]
        return []

    def held_back(self, a: Action) -> bool:
        """Whether ``a`` is a forward of the carried buffer while the host still steps: it runs each
        layer once the piece that holds it is loaded (``forward``)."""
        return (self.beside and not self.released and a.op is Op.F and a.buf == self.carried.buf
                and self.savers.recompute != "none")

    def forward(self, a: Action, label: str, deps: list[int], seconds: float) -> int:
        """A held-back forward (``held_back``) in parts: each run of layers once the piece holding
        their last layer is cast, then the head (the last chunk's). Returns the last part."""
        start, stop = self.plan.chunk_layers[a.chunk]
        n = stop - start
        layer = self.work.layer_forward()
        before = deps
        for p, run in itertools.groupby(range(n), key=lambda j: math.ceil((j + 1) * STEP_PIECES / n) - 1):
            before = [self.g.add(label, [*before, self.loaded[p]], seconds=len(list(run)) * layer, rank=self.r)]
        if seconds > n * layer:
            before = [self.g.add(label, before, seconds=seconds - n * layer, rank=self.r)]
        self.released = True
        return before[0]

    def backward(self, a: Action, label: str, deps: list[int], seconds: float) -> int:
        """A streamed B (``Plan.streamed_accumulations``) in parts, each ending where one more
        piece of its gradient is whole, last layers first: after the chunk's re-run ("layer"),
        a layer at a time, then the embedding's backward (the first chunk's). Its ACC_G's pieces
        cross from there. Returns the last part."""
        start, stop = self.plan.chunk_layers[a.chunk]
        n = stop - start
        lead = (self.savers.forwards_in_backward - 1) * n * self.work.layer_forward()
        tail = self.work.embed() if a.chunk == self.plan.model_order[0] else 0.0
        per_layer = (seconds - lead - tail) / n
        whole = [lead + math.ceil((i + 1) * n / STEP_PIECES) * per_layer for i in range(STEP_PIECES)]
        parts, at, before = {}, 0.0, deps
        for cut in sorted({*whole, seconds}):
            before = [self.g.add(label, before, seconds=cut - at, rank=self.r)]
            parts[cut], at = before[0], cut
        self.whole[self.streamed[a]] = [parts[cut] for cut in whole]
        return before[0]

    def _host_accumulate(self, deps: list[int], whole: list[int] | None) -> int:
        """ACC_G with the state on the host: the gradient crosses a piece at a time into one of two
        pinned buffers while the host adds the piece before, a piece's copy waiting for the
        addition two before it, whose buffer it fills (``HostOffload.accumulate_grad`` on a GPU,
        in pieces of its staging size: many more than the ``STEP_PIECES`` played here for a chunk
        of more than 32 M elements, fewer below; on a CPU it adds straight from the gradient,
        played alike). A streamed one's piece crosses once its backward has made it whole (``whole``:
        where each piece is), not after the whole backward or the compute the calling thread ran
        since. Returns the last addition."""
        piece = self.own / STEP_PIECES
        added: list[int] = []
        for i in range(STEP_PIECES):
            ready = deps if whole is None else [*(d for d in deps if d not in self.computed), whole[i]]
            sent = self._copy("state", f"gradient to host {i + 1}/{STEP_PIECES}", self.grad_bytes * piece, "d2h",
                              [*ready, *added[-2:-1]])
            added.append(self.g.add(f"host accumulate {i + 1}/{STEP_PIECES}", [sent, *added[-1:]],
                                    seconds=piece * (8 + self.grad_bytes) / self.host_bandwidth, rank=self.r,
                                    lane="host"))
        return added[-1]

    def _host_step(self, deps: list[int]) -> list[int]:
        """The host's step of the own chunk; with a ``carried_load``, after every transfer (the
        engine's ``settle``) and in pieces, each piece's part of the load crossing, then cast on
        the weights lane, once the piece is stepped (on a CPU the stepping thread copies it before
        the next piece). Returns what the device's part of the step (the replicated parameters,
        stepped in the same call as the first piece: on a CPU by the same thread) waits for
        besides ``deps``."""
        if self.beside:  # played at the start, as the step before this iteration's
            return list(self.transfers)
        carried = self.carried is not None
        settle = list(self.transfers) if carried else []  # no transfer still reads the buffer
        steps, _, _ = self._pieces([*deps, *settle], STEP_PIECES if carried else 1, load=carried)
        return [*settle, steps[0]] if self.host else settle


def _rank(g: Graph, plan: Plan, r: int, device: _Device, host: bool, messages: dict[tuple, _Message],
          exchanges: dict[tuple, _Message]) -> None:
    hazards: Hazards[int] = Hazards()
    last_compute: int | None = None
    queue_last: dict[Channel, int] = {}
    collectives: Counter = Counter()
    copies = _HostCopies(g, plan, r, device, host)
    context = _Context(g, plan, r, device, exchanges) if device.work.context > 1 else None
    for unit in batches(plan.actions[r]):
        rw = [(plan.reads(a), plan.writes(a)) for a in unit]
        deps = [d for reads, writes in rw for d in hazards.deps(reads, writes)]
        held = context is None and copies.held_back(unit[0])  # with context parallelism: played whole, after the step
        if not held:
            deps += sorted({d for a in unit for d in copies.beside_deps(a)})
        spec = OPS[unit[0].op]
        channel = spec.channel
        if channel is Channel.COMPUTE:
            deps += [last_compute] if last_compute is not None else []
            deps += copies.before(unit[0], deps)
            seconds = compute_seconds(plan, unit[0], device.work, device.savers)
            if context is not None and unit[0].op in (Op.F, Op.B):
                done = last_compute = context.compute(unit[0], deps, seconds)
            elif held:
                done = last_compute = copies.forward(unit[0], describe(unit[0]), deps, seconds)
            elif unit[0] in copies.streamed:
                done = last_compute = copies.backward(unit[0], describe(unit[0]), deps, seconds)
            else:
                done = last_compute = g.add(describe(unit[0]), deps, seconds=seconds, rank=r)
        else:
            if host and last_compute is not None:
                deps.append(last_compute)  # the calling thread gets here after the compute before it
            floating = host and not spec.ordered
            if not floating and channel in queue_last:
                deps.append(queue_last[channel])
            if spec.transfer is None:
                deps += copies.before(unit[0], deps)
                seconds = compute_seconds(plan, unit[0], device.work, device.savers) if copies.moves(unit[0]) else 0.0
                done = g.add(describe(unit[0]), deps, seconds=seconds, rank=r, lane=str(channel))
            else:
                post = g.add("", deps)
                done = g.add("", [])
                for a in unit:
                    if spec.is_p2p:
                        src, dst = (r, a.peer) if OPS[a.op].transfer == "send" else (a.peer, r)
                        key: tuple = ("p2p", channel, src, dst, a.tag)
                    else:
                        collectives[(channel, a.group)] += 1
                        key = ("collective", channel, a.group, collectives[(channel, a.group)])
                    m = messages.setdefault(key, _Message([], []))
                    m.posts.append(post)
                    m.dones.append((done, OPS[a.op].transfer == "send"))
                    if OPS[a.op].transfer == "send" or (not spec.is_p2p and (m.action is None or a.rank == a.root)):
                        m.action = a
            queue_last[channel] = done
        copies.after(unit[0], done)
        for reads, writes in rw:
            hazards.record(done, reads, writes)


class _Context:
    """A forward or backward under context parallelism (``work.context`` c, design §3.6). The
    engine runs it layer by layer on the compute stream, each layer's K/V all-gathered among the
    rank's context group before it computes (once per forward, and per re-run of it in the
    backward, ``cost.traffic.context_bytes``), and its gradients reduce-scattered after a backward,
    every exchange blocking the compute. Since each blocks the compute, the player lumps an
    action's gathers into one exchange before its compute and its reduce-scatters into one after:
    the same bytes, hop latencies and blocking, in a graph a layer count smaller (a 70B map cell
    at c = 8 is otherwise millions of tasks); what it gives up is the exchanges' interleaving with
    other traffic on the node's links at a layer's grain. The group's exchanges pair up in order."""

    def __init__(self, g: Graph, plan: Plan, r: int, device: _Device, exchanges: dict[tuple, _Message]) -> None:
        c = device.work.context
        self.g, self.plan, self.r, self.exchanges = g, plan, r, exchanges
        self.group = tuple(range(r - r % c, r - r % c + c))
        self.count = 0
        self.recompute = device.savers.recompute

    def compute(self, a: Action, deps: list[int], seconds: float) -> int:
        start, stop = self.plan.chunk_layers[a.chunk]
        n = stop - start
        gathers = n if a.op is Op.F else BACKWARD_GATHERS[self.recompute](n)
        done, label = self.g.add("", deps), describe(a)
        if gathers:
            done = self._exchange(f"K/V {label}", done, gathers)
        done = self.g.add(f"{label} ({n} layers)", [done], seconds=seconds, rank=self.r)
        if a.op is Op.B:
            done = self._exchange(f"dK/dV {label}", done, n)
        return done

    def _exchange(self, label: str, dep: int, times: int) -> int:
        """``times`` exchanges of the group in one, posted after ``dep``."""
        post, done = self.g.add("", [dep]), self.g.add(label, [])
        m = self.exchanges.setdefault((self.group, self.count, times), _Message([], []))
        m.posts.append(post)
        m.dones.append((done, False))
        self.count += 1
        return done


def _play_exchanges(g: Graph, exchanges: dict[tuple, _Message], work: Workload, cluster: Cluster, size: int) -> None:
    """Each K/V exchange once every member posted it: a ring over the group in which each member
    sends (c − 1) shares to the next, over the node's links, as many times as it lumps."""
    c, share = work.context, work.kv_share_bytes()
    for (group, _, times), m in exchanges.items():
        flows = [Flow(r, group[(i + 1) % c], times * (c - 1) * share) for i, r in enumerate(group) if r < size]
        t = g.add("K/V exchange", m.posts, flows=flows, latency=times * (c - 1) * cluster.hop_latency(False),
                  rank=group[0], lane="cp")
        for done, _ in m.dones:
            g.add_deps(done, [t])


def _flows(plan: Plan, a: Action, host: bool = False) -> tuple[list[Flow], int]:
    """The hops of ``a``'s transfer as the backends run it, and how many hop latencies it waits:
    a message is one hop; a broadcast or reduce a pipelined chain (every hop carries the whole
    buffer, all at once); an all-reduce a ring (each member sends 2(k−1)/k of the buffer to the
    next, 2(k−1) steps). Only replica 0's members send; the others are their mirror images. On a
    host a channel's messages from one rank to another share one gloo connection (a process group
    per channel and direction, ``TorchDistComm``), which sends them one at a time."""
    spec = OPS[a.op]
    if spec.is_p2p:
        return [Flow(a.rank, a.peer, a.bytes, stream=(spec.channel, a.rank, a.peer) if host else None)], 1
    k = len(a.group)
    if k < 2:
        return [], 0
    if a.root is not None:
        return [Flow(s, d, a.bytes) for s, d in chain_hops(a)], k - 1
    size = plan.replica_size
    share = 2 * (k - 1) / k * a.bytes
    return [Flow(m, ring_next(a, m), share) for m in a.group if m < size], 2 * (k - 1)


def engine_plan(cluster: Cluster, work: Workload, micro_batches: int, *,
                memory: Callable[[Plan], MemoryEstimate] | None = None, **options: object) -> Plan:
    """The plan the engine would run for ``work.dims`` on ``cluster``, with real byte sizes;
    ``options`` are ``build_plan``'s (algo, mb_per_fetch, prefetch_depth, reuse_weights, replicas).
    Those left "auto" are chosen as the engine chooses them (``cost.memory.auto_plan``, design
    §7.3), on ``memory``'s estimate within the device's memory less ``MARGIN``; where nothing fits,
    the least memory."""
    d = work.dims
    topology = Topology(cluster.nodes, cluster.per_node)
    sizes = dict(layer_numel=d.layer_numel, weight_bytes=d.dtype_bytes, grad_bytes=d.grad_bytes,
                 replicated_numel=d.replicated_numel)
    if AUTO not in options.values():
        return build_plan(topology, d.layers, micro_batches, **sizes, **options)
    if memory is None:
        raise ValueError("choosing the options left 'auto' needs the memory estimate")
    plan, _ = auto_plan(topology, d.layers, micro_batches, memory=memory, budget=cluster.device.memory * (1 - MARGIN),
                        budget_text=f"{cluster.device.name}'s memory less {MARGIN:.0%}", strict=False,
                        weights_on_host=True, **sizes, **options)
    return plan
