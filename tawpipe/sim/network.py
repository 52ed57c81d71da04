"""A discrete-event simulation of a task graph on a cluster's links (design §9.1).

A ``Graph`` is what one iteration does, as tasks with dependencies: a task waits for every task
it depends on, then takes ``seconds`` (compute, a copy) or moves its ``flows`` (transfers) and
then waits ``latency``. Whoever builds the graph encodes the order a device runs things in (a
compute stream, a channel's queue) as dependencies; the simulation adds only what the links do.
A ``Fabric`` says which links a flow crosses: every device has its own intra-node port, every
node (or every rail of a node) its own inter-node port, each full duplex. Flows that share a
port share it fairly (max-min: each gets an equal share of its tightest port, and what a flow
cannot use goes to the others), and the rates are recomputed whenever a flow starts or ends.

A host executor (CPU ranks, gloo over TCP) also pays for its transfers with the compute it has:
with ``Fabric.cpu`` set, every rank has a CPU port of that many bytes per second (what its CPU
moves through the transport, sends plus receives, doing nothing else); each flow crosses its
sender's and its receiver's, and a task of ``seconds`` on a rank is a flow of ``seconds · cpu``
through its CPU port alone, so compute and transfers share the rank's CPU fairly. A flow on a
``stream`` (one TCP connection, which gloo fills with one message at a time) waits until the
stream's earlier messages are through.

A rank under a CPU quota gets part of a wait back: the kernel hands out the quota per period, so
a rank that idled computes at its threads' whole speed until the period's share (and the slice its
CPU still holds) is spent. ``Fabric.cpu_credit`` makes each CPU port a token bucket like a shaped
link's: idle, it saves up to that many bytes of credit, and while credit lasts it runs at
``cpu_peak``; all the compute the graph holds also crosses one ``cores`` port, the machine's
cores, which ranks that burst at once share (transfers' CPU does not cross it).

A copy between a device and its host (the memory savers' offload) crosses that device's PCIe port
in its direction (``Flow.pcie``), full duplex, and nothing else: a GPU's copy engines run it
beside compute and the network.
"""

from __future__ import annotations

import heapq
import json
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Flow:
    """``bytes`` from rank ``src`` to rank ``dst``. ``half_duplex``: the two ranks' messages in both
    directions share one connection, whose payloads often take turns (gloo over one TCP
    connection): together they get ``HALF_DUPLEX_SHARE`` times one direction's rate."""

    src: int
    dst: int
    bytes: float
    half_duplex: bool = False
    # the connection it travels on, if it is one that carries one message at a time, in the order
    # they became ready (a TCP stream: gloo sends a pair's messages in one group on one socket)
    stream: tuple | None = None
    # a copy between device ``src`` (= ``dst``) and its host over PCIe: "d2h" or "h2d"
    pcie: str | None = None


@dataclass(slots=True)
class Task:
    label: str
    deps: list[int]
    seconds: float = 0.0
    flows: tuple[Flow, ...] = ()
    latency: float = 0.0
    rank: int | None = None  # whose timeline row shows it
    lane: str = "compute"


class Graph:
    """Tasks in the order they were added; ``add`` returns a task's id."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []

    def add(self, label: str = "", deps: Iterable[int] = (), *, seconds: float = 0.0, flows: Sequence[Flow] = (),
            latency: float = 0.0, rank: int | None = None, lane: str = "compute") -> int:
        if seconds < 0 or latency < 0 or any(f.bytes < 0 for f in flows):
            raise ValueError(f"task {label!r}: negative time or bytes")
        self.tasks.append(Task(label, list(deps), seconds, tuple(flows), latency, rank, lane))
        return len(self.tasks) - 1

    def add_deps(self, task: int, deps: Iterable[int]) -> None:
        """More dependencies for a task added before they existed (the other side of a message)."""
        self.tasks[task].deps.extend(deps)


Port = tuple  # ("out" | "in" | "node out" | "node in", index) or ("connection", rank, rank)
SHAPED = ("node out", "node in", "connection")  # ports with a token bucket where the fabric has a burst
CORES: Port = ("cores",)  # the machine's CPU, which every host rank's compute crosses where ``Fabric.cores`` is set
# What both directions of one gloo connection carry together, in units of one direction's rate:
# a swap of 6.4 MB chunks over one connection took 0.52 s or 1.03 s at random on the emulated
# cluster (design §5.2): the receiver's notice queues behind the other direction's payload or not.
# Two such chunks move in 0.775 s on average, where full duplex takes 0.52 s: 2 x 0.52 / 0.775.
HALF_DUPLEX_SHARE = 2 * 0.52 / 0.775


@dataclass(frozen=True)
class Fabric:
    """The links of ``nodes`` nodes of ``per_node`` devices, in bytes per second per direction.

    ``rails``: every local index has its own inter-node port of ``inter`` (one NIC per device);
    otherwise a node's devices share one port of ``inter``. ``burst``: each inter-node port is a
    token bucket, as a shaper (tc htb) or a policer is: idle, it saves up to ``burst`` bytes of
    credit at ``inter``, and while credit lasts it passes bytes at ``peak``. ``fold``: the simulated nodes stand for
    a larger job whose other nodes behave alike (replicas, data parallelism), so node g's ports
    are node (g mod fold)'s: a flow to a node outside the simulated ones arrives, by symmetry, at
    the matching simulated node from its mirror image.
    """

    per_node: int
    intra: float
    inter: float
    rails: bool = False
    fold: int | None = None
    burst: float = 0.0  # bytes an idle inter-node port saves up and then sends at ``peak`` (a token bucket)
    peak: float | None = None  # the rate of a burst (None: ``intra``)
    cpu: float | None = None  # a host rank's CPU, in bytes/s of transfers (None: transfers cost no compute)
    cpu_credit: float = 0.0  # bytes of CPU an idle host rank saves up (a quota's leftover), spent at ``cpu_peak``
    cpu_peak: float | None = None  # a host rank's CPU while it has credit (its threads' whole speed)
    # the machine's CPU per rank of the job, bytes/s: the compute of the ranks a graph holds shares
    # that many times their number (a graph folded to one rank gets one rank's share; None: no limit)
    cores: float | None = None
    pcie: float | None = None  # each device's link to its host, bytes/s per direction (None: no host copies)
    pcie_d2h: float | None = None  # the device-to-host direction's, where it differs (None: ``pcie``)

    def __post_init__(self) -> None:
        rates = (self.cpu, self.cpu_peak, self.cores, self.pcie, self.pcie_d2h)
        if self.per_node < 1 or self.intra <= 0 or self.inter <= 0 or any(r is not None and r <= 0 for r in rates):
            raise ValueError(f"a fabric needs per_node >= 1 and positive rates: {self}")
        if self.cpu_credit and not (self.cpu and self.cpu_peak and self.cpu_peak > self.cpu):
            raise ValueError(f"a CPU credit needs a CPU rate and a faster cpu_peak: {self}")

    def bucket(self, port: Port) -> tuple[float, float] | None:
        """(credit in bytes, rate while it lasts) of a port that is a token bucket, else None."""
        if port[0] == "cpu":
            return (self.cpu_credit, self.cpu_peak) if self.cpu_credit and self.cpu_peak else None
        if self.burst and port[0] in SHAPED:
            return self.burst, self.peak or self.intra
        return None

    def node(self, rank: int) -> int:
        return rank // self.per_node

    def mirror(self, rank: int) -> int:
        """``rank``, or for a rank outside the simulated nodes its mirror image."""
        if self.fold:
            return (rank // self.per_node) % self.fold * self.per_node + rank % self.per_node
        return rank

    def cpu_port(self, rank: int) -> Port:
        """``rank``'s CPU (a rank outside the simulated nodes: its mirror image's)."""
        return ("cpu", self.mirror(rank))

    def ports(self, f: Flow) -> tuple[tuple[Port, float], ...]:
        """The ports ``f`` crosses, each with its capacity."""
        if f.pcie is not None:
            if not self.pcie or f.pcie not in ("d2h", "h2d") or f.src != f.dst:
                raise ValueError(f"a host copy needs a fabric with PCIe, direction d2h or h2d and one device: {f}")
            rate = self.pcie_d2h if f.pcie == "d2h" and self.pcie_d2h else self.pcie
            return ((("pcie " + f.pcie, self.mirror(f.src)), rate),)
        s = self.per_node
        gs, gd = f.src // s, f.dst // s
        if gs == gd:
            ports: tuple[tuple[Port, float], ...] = ((("out", f.src), self.intra), (("in", f.dst), self.intra))
        else:
            if self.fold:
                gs, gd = gs % self.fold, gd % self.fold
            if self.rails:
                gs, gd = gs * s + f.src % s, gd * s + f.dst % s
            ports = ((("node out", gs), self.inter), (("node in", gd), self.inter))
        if f.half_duplex:
            ports += ((("connection", min(f.src, f.dst), max(f.src, f.dst)), HALF_DUPLEX_SHARE * ports[0][1]),)
        if self.cpu:
            ports += ((self.cpu_port(f.src), self.cpu), (self.cpu_port(f.dst), self.cpu))
        return ports


@dataclass
class Result:
    """When each task started and ended, in seconds from the start of the iteration."""

    graph: Graph
    start: list[float]
    end: list[float]
    port_bytes: dict[Port, float] = field(default_factory=dict)

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)

    def busy(self, rank: int, lane: str = "compute") -> float:
        """Seconds ``rank`` spent running tasks of ``lane``."""
        return self.busiest([rank], lane)

    def busiest(self, ranks: Iterable[int], lane: str = "compute") -> float:
        """The most seconds any of ``ranks`` spent on ``lane``, in one pass over the tasks."""
        busy = dict.fromkeys(ranks, 0.0)
        for t, s, e in zip(self.graph.tasks, self.start, self.end):
            if t.lane == lane and t.rank in busy:
                busy[t.rank] += e - s
        return max(busy.values(), default=0.0)

    def chrome_trace(self) -> str:
        """One iteration as a Chrome trace (chrome://tracing, Perfetto), one row per rank and lane,
        like the engine's ``TAWPIPE_TRACE``."""
        events = [{"name": t.label, "ph": "X", "pid": t.rank, "tid": t.lane, "ts": s * 1e6, "dur": (e - s) * 1e6}
                  for t, s, e in zip(self.graph.tasks, self.start, self.end)
                  if t.rank is not None and t.label and (e > s or t.seconds or t.flows)]
        return json.dumps({"traceEvents": events})


class _Active:
    __slots__ = ("task", "left", "ports", "rate", "stream")

    def __init__(self, task: int, left: float, ports: tuple[Port, ...], stream: tuple | None = None) -> None:
        self.task, self.left, self.ports, self.rate, self.stream = task, left, ports, 0.0, stream


def simulate(graph: Graph, fabric: Fabric) -> Result:
    """Play ``graph`` on ``fabric`` from time 0 until every task has ended.

    Raises ``ValueError`` naming a task that can never start (a dependency cycle)."""
    return _Play(graph, fabric).run()


class _Play:
    """One run of ``simulate``: the tasks waiting, the flows moving, the timers pending and the
    ports' credit, advanced from one event (a flow or a timer ending) to the next."""

    def __init__(self, graph: Graph, fabric: Fabric) -> None:
        self.graph, self.tasks, self.fabric = graph, graph.tasks, fabric
        n = len(self.tasks)
        self.waiting = [len(t.deps) for t in self.tasks]
        self.dependents = _dependents(self.tasks)
        self.start, self.end = [math.nan] * n, [math.nan] * n
        self.timers: list[tuple[float, int, int]] = []  # (time, order, task): a compute or latency ending
        self.flows: list[_Active] = []
        self.queued: dict[tuple, deque[_Active]] = {}  # a busy stream's waiting messages, first ready first
        self.open_flows = [0] * n
        self.cap: dict[Port, float] = {}
        self.tokens: dict[Port, float] = {}  # token buckets' credit (shaped links, host CPUs), bytes
        self.buckets: dict[Port, tuple[float, float]] = {}  # their (most credit, rate while credit lasts)
        self.port_bytes: dict[Port, float] = {}
        self.now, self.order, self.done = 0.0, 0, 0
        # the capacities the flows' rates were shared out at; None once a flow comes or goes or a port opens
        self.shared: dict[Port, float] | None = None
        # the host ranks whose compute the graph holds, which share the machine's cores
        self.computing = len({fabric.cpu_port(t.rank) for t in self.tasks if t.seconds > 0 and t.rank is not None}
                             ) if fabric.cpu and fabric.cores else 0

    def run(self) -> Result:
        n = len(self.tasks)
        for i in range(n):
            if self.waiting[i] == 0:
                self.begin(i)
        while self.timers or self.flows:
            self.step()
        if self.done < n:
            stuck = next(i for i in range(n) if math.isnan(self.end[i]))
            raise ValueError(f"task {self.tasks[stuck].label!r} (#{stuck}) never starts: its dependencies form a "
                             f"cycle")
        return Result(self.graph, self.start, self.end, self.port_bytes)

    def open_port(self, p: Port, capacity: float) -> None:
        self.cap[p] = capacity
        self.shared = None
        if p not in self.buckets and (b := self.fabric.bucket(p)):
            self.buckets[p] = b
            self.tokens[p] = b[0]  # idle before the iteration: full

    def begin(self, i: int) -> None:
        """Task ``i``'s dependencies are done: its flows start (or queue on their stream), its
        compute starts on a host rank's CPU, or its timer starts."""
        t, fabric = self.tasks[i], self.fabric
        self.start[i] = self.now
        moving = [f for f in t.flows if f.bytes > 0]
        for f in moving:
            ports = fabric.ports(f)
            for p, c in ports:
                self.open_port(p, c)
                self.port_bytes[p] = self.port_bytes.get(p, 0.0) + f.bytes
            active = _Active(i, f.bytes, tuple(p for p, _ in ports), f.stream)
            if f.stream is None:
                self.flows.append(active)
            elif f.stream in self.queued:
                self.queued[f.stream].append(active)
            else:
                self.queued[f.stream] = deque()
                self.flows.append(active)
        self.open_flows[i] = len(moving)
        if moving:
            self.shared = None
        if fabric.cpu and t.seconds > 0 and t.rank is not None:  # compute on a host rank's CPU
            p = fabric.cpu_port(t.rank)
            self.open_port(p, fabric.cpu)
            on = (p,)
            if fabric.cores:
                self.open_port(CORES, fabric.cores * self.computing)
                on += (CORES,)
            self.flows.append(_Active(i, t.seconds * fabric.cpu, on))
            self.open_flows[i] += 1
            self.shared = None
        if not self.open_flows[i]:
            self.push_timer(self.now + t.seconds + t.latency, i)

    def push_timer(self, at: float, i: int) -> None:
        heapq.heappush(self.timers, (at, self.order, i))
        self.order += 1

    def finish(self, i: int) -> None:
        self.end[i] = self.now
        self.done += 1
        for j in self.dependents[i]:
            self.waiting[j] -= 1
            if self.waiting[j] == 0:
                self.begin(j)

    def step(self) -> None:
        """Advance to the next event: the flows' fair rates, the time until a flow, a timer or a
        port's credit ends, then the flows that ended and the timers that are due."""
        dt = self.advance()
        for i in self.retire(dt):  # the payload is in; the latency remains
            self.push_timer(self.now + self.tasks[i].latency, i)
        while self.timers and self.timers[0][0] <= self.now + 1e-12:
            self.finish(heapq.heappop(self.timers)[2])

    def advance(self) -> float:
        """Move the clock to the next event and spend or save the ports' credit; the step's length."""
        flows, tokens, buckets, cap = self.flows, self.tokens, self.buckets, self.cap
        usable = {p: buckets[p][1] if p in tokens and tokens[p] > 1e-9 * buckets[p][0] else c
                  for p, c in cap.items()} if tokens else cap
        if self.shared is None or (tokens and usable != self.shared):  # else the rates stand
            _share(flows, usable)
            self.shared = usable
        t_flow = min((f.left / f.rate for f in flows), default=math.inf)
        t_timer = self.timers[0][0] - self.now if self.timers else math.inf
        dt = min(t_flow, t_timer)
        if tokens:
            used = _usage(flows, tokens)
            dt = min((dt, *(b / (used[p] - cap[p]) for p, b in tokens.items()
                            if b > 1e-9 * buckets[p][0] and used[p] > cap[p])))
            for p in tokens:
                tokens[p] = min(buckets[p][0], max(0.0, tokens[p] + (cap[p] - used[p]) * dt))
        self.now += dt
        return dt

    def retire(self, dt: float) -> list[int]:
        """Take ``dt`` seconds of bytes off every flow; the tasks whose last flow ended (a
        stream's next message starts in its place)."""
        ended: list[int] = []
        if not self.flows:
            return ended
        still = []
        for f in self.flows:
            if f.left / f.rate <= dt * (1 + 1e-12) + 1e-15:  # this one ends now
                self.shared = None
                self.open_flows[f.task] -= 1
                if self.open_flows[f.task] == 0:
                    ended.append(f.task)
                if f.stream is not None:  # the stream's next message goes
                    waiting_here = self.queued[f.stream]
                    if waiting_here:
                        still.append(waiting_here.popleft())
                    else:
                        del self.queued[f.stream]
            else:
                f.left -= f.rate * dt
                still.append(f)
        self.flows[:] = still
        return ended


def _dependents(tasks: list[Task]) -> list[list[int]]:
    """Each task's dependents, or a ValueError naming a dependency that does not exist."""
    n = len(tasks)
    dependents: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for d in t.deps:
            if not 0 <= d < n:
                raise ValueError(f"task {t.label!r} depends on task {d}, which does not exist")
            dependents[d].append(i)
    return dependents


def _usage(flows: list[_Active], ports: dict[Port, float]) -> dict[Port, float]:
    """Bytes per second through each of ``ports`` at the flows' current rates."""
    used = dict.fromkeys(ports, 0.0)
    for f in flows:
        for p in f.ports:
            if p in used:
                used[p] += f.rate
    return used


def _share(flows: list[_Active], cap: dict[Port, float]) -> None:
    """Max-min fair rates (progressive filling): the port with the smallest equal share fixes the
    rate of every flow through it; their use is taken off their other ports; repeat. The ports
    wait in a heap by (share, first use), so that ties go to the port first used, and a port's
    entry is renewed whenever its share changes (an entry whose share is no longer the port's is
    stale): a large fabric's many ports are not scanned once per fixed port."""
    if not flows:
        return
    users: dict[Port, list[_Active]] = {}
    for f in flows:
        f.rate = -1.0
        for p in f.ports:
            users.setdefault(p, []).append(f)
    left = {p: cap[p] for p in users}
    count = {p: len(u) for p, u in users.items()}
    first = {p: i for i, p in enumerate(users)}
    heap = [(left[p] / n, first[p], p) for p, n in count.items()]
    heapq.heapify(heap)
    while count:
        fair, _, p = heapq.heappop(heap)
        if p not in count or fair != left[p] / count[p]:
            continue
        share = max(fair, 1e-9 * cap[p])  # rounding must not stall a flow
        changed = set()
        for f in users[p]:
            if f.rate < 0:
                f.rate = share
                for q in f.ports:
                    left[q] -= share
                    count[q] -= 1
                    if count[q] == 0 and q != p:
                        del count[q]
                    else:
                        changed.add(q)
        del count[p]
        for q in changed:
            if q in count:
                heapq.heappush(heap, (left[q] / count[q], first[q], q))
