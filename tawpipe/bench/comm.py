"""`tawpipe bench comm`: communication primitives in the style of nccl-tests.

For each operation, placement and size: time per operation, algbw and busbw with nccl-tests'
definitions (printed with the table), and, with ``-c 1``, the number of wrong elements against
expected values computed independently on every rank (``#wrong``).

Placements follow the topology (``tawpipe.plan.topology.Topology``): *intra* runs every operation
inside each node's group (n = ranks per node), *inter* on each rail across nodes (n = nodes),
all groups or rails at once. TawPipe's composites use both: *chunk_fetch* (a chunk's owner sends
it by rail P2P to its rail peer in the next node, full duplex around the ring of nodes, then the
peer broadcasts it in its node) and *grad_route* (each node reduces a gradient to its rail-0
rank, which sends it by rail P2P to the owner in the next node).

Ranks: spawned locally (``--nodes``/``--per-node``, the default), or under torchrun or
``tawpipe cluster`` (read from the environment: RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, ...).
Backends: any registered in ``tawpipe.runtime.comm`` (torch.distributed with gloo or NCCL,
tawpipe's native NCCL, or one a user registers), built by ``Comm.create`` and driven through the
``Comm`` interface alone, as the engine drives it: every operation is one call of its method, so
a backend whose calls return only once complete (nccl-native) is timed with that wait in each.
Every wait has a timeout (``-T``). Rank 0 prints the table and writes JSON and a PNG plot into
``--out`` (default ``tawpipe-results/`` in the current directory; the committed results are
rewritten only with ``--out benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..atomic import write_atomic
from ..cluster import LINK_ENV
from ..commands import UsageError, env_timeout, int_at_least, nonnegative_float, positive_float, writable
from ..cost.units import gib
from ..ops import DTYPES
from ..plan.topology import Topology
from ..runtime import comm as comms
from ..runtime.comm import P2P, Comm, CommTimeout
from ..runtime.launch import init_distributed, run_local
from ..train.config import under_torchrun
from ..train.preflight import RUNTIME_BYTES
from . import DEFAULT_OUT, check_memory, provenance

PRIMITIVES = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce", "sendrecv")
COMPOSITES = ("chunk_fetch", "grad_route")
OPS = PRIMITIVES + COMPOSITES
TORCH = "torch"  # the registry's torch.distributed backend: its process groups run gloo or NCCL
TORCH_DEVICES = {"gloo": "cpu", "nccl": "cuda"}  # --backend gloo / nccl: the torch backend on that device
# busbw = algbw x factor(n) (nccl-tests, doc/PERFORMANCE.md)
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "sendrecv": lambda n: 1.0,
    "chunk_fetch": lambda n: 1.0,
    "grad_route": lambda n: 1.0,
}
DEFINITIONS = (
    "time = mean wall-clock time per operation over the timed iterations (host clock, device "
    "synchronised once after them), then aggregated over ranks (-a); algbw = S / time in GB/s "
    "(1 GB = 1e9 B), S = the size column; busbw = algbw x factor: all_reduce 2(n-1)/n; all_gather "
    "and reduce_scatter (n-1)/n with S = n x the per-rank bytes; broadcast, reduce and sendrecv 1; "
    "composites 1 (every rank of every node ends with S bytes, each link carries S once)"
)


def parse_size(text: str) -> int:
    """Bytes from '1024', '1K', '64M', '1G' (binary units, as nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a number with an optional K, M or G suffix")
    return int(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " ")


DESCRIPTION = (
    "Communication primitives in the style of nccl-tests: time, algbw, busbw and wrong elements per operation, "
    "placement (inside a node, across nodes on a rail) and size, including TawPipe's chunk fetch and gradient "
    "route. Ranks are spawned locally or come from torchrun or tawpipe cluster; any registered comm backend: "
    "torch.distributed (gloo, NCCL) or tawpipe's native NCCL."
)


@dataclass(frozen=True)
class Backend:
    """What ``--backend`` names: a registered comm backend, the device it runs on, and the name
    results carry (their "backend" and file name: gloo, nccl, nccl-native, ...)."""

    name: str
    device: str  # cpu | cuda
    label: str


def backend_choice(choice: str | None, cuda: bool) -> Backend:
    """``--backend``'s meaning (None: the default) where CUDA is available or not. The torch
    backend runs gloo on the CPU or NCCL on GPUs, named by that; every other one runs on GPUs."""
    choice = choice or TORCH
    if choice == TORCH:
        choice = "nccl" if cuda else "gloo"
    if choice in TORCH_DEVICES:
        return Backend(TORCH, TORCH_DEVICES[choice], choice)
    return Backend(choice, "cuda", choice)


def _backend_help() -> str:
    return (f"a comm backend of tawpipe.runtime.comm ({', '.join(comms.names())}), or gloo or nccl. {TORCH} (the "
            "default): torch.distributed, on CUDA GPUs with NCCL where there are some, else on the CPU with gloo; "
            f"gloo, nccl: {TORCH} on the CPU with gloo, or on CUDA GPUs with NCCL (results are named by these); "
            "nccl-native: tawpipe's own NCCL, a grouped launch per call, on CUDA GPUs, as is any other backend")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1K"), help="smallest size (1K)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"), help="largest size (64M)")
    p.add_argument("-f", "--stepfactor", type=int_at_least(2), default=2, help="size multiplier between steps (2)")
    p.add_argument("-n", "--iters", type=int_at_least(1), default=20, help="timed iterations, at most (20)")
    p.add_argument("-w", "--warmup_iters", type=int_at_least(0), default=1,
                   help="warm-up iterations (1, as current nccl-tests; 0: none, and no time budget)")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1, help="check results (#wrong)")
    p.add_argument("-a", "--average", type=int, choices=(0, 1, 2, 3), default=1,
                   help="time over ranks: 0 rank 0, 1 mean, 2 min, 3 max")
    p.add_argument("-T", "--timeout", type=positive_float, default=None,
                   help="seconds any wait may take ($TAWPIPE_TIMEOUT)")
    p.add_argument("-d", "--datatype", choices=sorted(DTYPES), default="float32", help="element type of the buffers")
    p.add_argument("--time-budget", type=nonnegative_float, default=0.5,
                   help="seconds per measurement: fewer than -n iterations when the warm-up says they would "
                        "take longer (0: always -n)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--backend", choices=(*comms.names(), *TORCH_DEVICES), default=None, help=_backend_help())
    p.add_argument("--nodes", type=int_at_least(1), default=2, help="emulated nodes when spawning locally")
    p.add_argument("--per-node", type=int_at_least(1), default=2, help="ranks per node when spawning locally")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"directory for comm_<backend>_<G>x<s>.json and .png (default: {DEFAULT_OUT}/ in the current "
                        "directory; the committed results: --out benchmarks/results)")
    p.add_argument("--json", default=None, help="output JSON file instead of the one in --out")
    p.add_argument("--plot", default=None, help="output PNG (default: next to the JSON; '' for none)")


@dataclass(frozen=True)
class Row:
    op: str
    placement: str  # intra | inter | both
    n: int  # ranks per team (composites: the world)
    bytes: int
    count: int  # elements per rank's buffer (all_gather: input; reduce_scatter: output)
    iters: int
    time_us: float
    algbw: float
    busbw: float
    wrong: int


@dataclass(frozen=True)
class Team:
    """The ranks one operation runs over, in order, and this rank's place among them."""

    placement: str
    ranks: tuple[int, ...]
    index: int


def _team_layout(topo: Topology) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Every node's group (intra) and every rail (inter), each a list over all ranks."""
    nodes = [topo.group_ranks(g) for g in range(topo.nodes)]
    rails = [tuple(topo.rank_of(g, i) for g in range(topo.nodes)) for i in range(topo.per_node)]
    return [("intra", nodes), ("inter", rails)]


def _connect(backend: Backend, topo: Topology, rank: int, device: torch.device,
             timeout: float) -> tuple[Comm, dict[str, Team]]:
    """The backend, able to run collectives over every team, and this rank's team per placement."""
    comm = comms.create(backend.name, topo, timeout, device)
    layout = _team_layout(topo)
    comm.add_groups([ranks for _, members in layout for ranks in members])
    teams = {placement: Team(placement, ranks, ranks.index(rank))
             for placement, members in layout for ranks in members if rank in ranks}
    return comm, teams


def _synchronize(device: torch.device, timeout: float) -> None:
    """The device's queued work done (the backend's calls may return before it is)."""
    if device.type == "cuda":
        _wait_event(device, timeout)


def _wait_event(device: torch.device, timeout: float) -> None:
    """Wait for the current stream with a deadline (torch.cuda.synchronize has none)."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + timeout
    while not ev.query():
        if time.monotonic() > deadline:
            raise CommTimeout(f"device work did not finish within {timeout:.0f}s: a peer is missing or stuck")
        time.sleep(1e-4)


# ---------------------------------------------------------------------------- operations


def _pattern(rank: int, count: int, salt: int) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, so every sum over ranks is exact in any dtype."""
    g = torch.Generator().manual_seed(1_000_003 * salt + rank)
    return torch.randint(-8, 9, (count,), generator=g).double()


class _Case:
    """One operation at one size on this rank: buffers, one call, and its expected result."""

    def __init__(self, op: str, team: Team | None, topo: Topology, rank: int, nbytes: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.op, self.team, self.topo, self.rank, self.dtype, self.device = op, team, topo, rank, dtype, device
        esize = torch.empty((), dtype=dtype).element_size()
        self.n = len(team.ranks) if team is not None else topo.world_size
        per_rank = op in ("all_gather", "reduce_scatter")
        self.count = max(1, nbytes // (esize * (self.n if per_rank else 1)))
        self.bytes = self.count * esize * (self.n if per_rank else 1)
        big = self.count * (self.n if per_rank else 1)
        self.a = torch.zeros(big if op == "reduce_scatter" else self.count, dtype=dtype, device=device)
        self.b = torch.zeros(big if op == "all_gather" else self.count, dtype=dtype, device=device)

    def fill(self, salt: int) -> None:
        self.a.copy_(_pattern(self.rank, self.a.numel(), salt))
        self.b.zero_()

    def run(self, comm: Comm) -> None:
        op, team = self.op, self.team
        if op == "broadcast":
            comm.broadcast(self.a, team.ranks[0], team.ranks)
        elif op == "reduce":
            comm.reduce(self.a, team.ranks[0], team.ranks)
        elif op == "all_reduce":
            comm.all_reduce(self.a, team.ranks)
        elif op == "all_gather":
            comm.all_gather(self.b, self.a, team.ranks)
        elif op == "reduce_scatter":
            comm.reduce_scatter(self.b, self.a, team.ranks)
        elif op == "sendrecv":
            n, i = len(team.ranks), team.index
            comm.batch_p2p([P2P("send", self.a, team.ranks[(i + 1) % n]), P2P("recv", self.b, team.ranks[(i - 1) % n])])
        else:
            self._composite(comm)

    def _composite(self, comm: Comm) -> None:
        topo, rank = self.topo, self.rank
        g, nodes = topo.group_of(rank), topo.nodes
        router = topo.rank_of(g, 0)  # the rail-0 rank of this node
        prev, nxt = topo.rank_of((g - 1) % nodes, 0), topo.rank_of((g + 1) % nodes, 0)
        node = topo.group_ranks(g)
        if self.op == "chunk_fetch":  # a owns a chunk; b receives the next node's, then the node shares it
            if rank == router:
                comm.batch_p2p([P2P("send", self.a, prev), P2P("recv", self.b, nxt)])
            comm.broadcast(self.b, router, node)
        else:  # grad_route: a is a gradient; reduce it in the node, route the sum to the next node's owner
            comm.reduce(self.a, router, node)
            if rank == router:
                comm.batch_p2p([P2P("send", self.a, nxt), P2P("recv", self.b, prev)])

    def wrong(self, salt: int) -> int:
        """Elements that differ from the expected result (recomputed here from every input)."""
        op, team, topo = self.op, self.team, self.topo

        def pat(r: int, count: int | None = None) -> torch.Tensor:
            return _pattern(r, count or self.count, salt)

        if op in ("broadcast", "reduce", "all_reduce"):
            if op == "reduce" and team.index != 0:
                return 0  # other ranks' buffers are undefined after a reduce
            want = pat(team.ranks[0]) if op == "broadcast" else sum(pat(r) for r in team.ranks)
            got = self.a
        elif op == "all_gather":
            want, got = torch.cat([pat(r) for r in team.ranks]), self.b
        elif op == "reduce_scatter":
            big = self.count * self.n
            want = sum(pat(r, big) for r in team.ranks).chunk(self.n)[team.index]
            got = self.b
        elif op == "sendrecv":
            want, got = pat(team.ranks[(team.index - 1) % self.n]), self.b
        elif op == "chunk_fetch":
            g = topo.group_of(self.rank)
            want, got = pat(topo.rank_of((g + 1) % topo.nodes, 0)), self.b
        else:  # grad_route: only the owner (rail 0) holds a defined result
            g = topo.group_of(self.rank)
            if self.rank != topo.rank_of(g, 0):
                return 0
            want = sum(pat(r) for r in topo.group_ranks((g - 1) % topo.nodes))
            got = self.b
        return int((got.double().cpu() != want).sum().item())


# ---------------------------------------------------------------------------- the sweep


def _sizes(a: dict) -> list[int]:
    if a["minbytes"] < 1 or a["maxbytes"] < a["minbytes"] or a["stepfactor"] < 2:
        raise ValueError(f"need 1 <= -b <= -e and -f >= 2, got -b {a['minbytes']}, -e {a['maxbytes']} and "
                         f"-f {a['stepfactor']}")
    out, s = [], a["minbytes"]
    while s <= a["maxbytes"]:
        out.append(s)
        s *= a["stepfactor"]
    return out


def _plan(ops: Sequence[str], topo: Topology, backend: Backend) -> list[tuple[str, str]]:
    """(op, placement) pairs to run, in print order; skipped ones with the reason."""
    runs = []
    for placement, n in (("intra", topo.per_node), ("inter", topo.nodes)):
        for op in ops:
            # torch.distributed refuses to send to its own rank; NCCL itself does it within a group
            if op in PRIMITIVES and not (op == "sendrecv" and n == 1 and backend.name == TORCH):
                runs.append((op, placement))
    if topo.nodes >= 2:
        runs += [(op, "both") for op in ops if op in COMPOSITES]
    return runs


class _Control:
    """Agreement between ranks over a gloo group, every wait bounded."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))

    def reduce(self, values: Sequence[float], op: dist.ReduceOp) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.pg, async_op=True).wait(timedelta(seconds=self.timeout))
        return t.tolist()

    def gather(self, value: Any) -> list[Any]:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, value, group=self.pg)
        return out


def _measure(case: _Case, comm: Comm, ctl: _Control, a: dict, salt: int) -> Row:
    wrong = 0
    if a["check"]:
        case.fill(salt)
        case.run(comm)
        _synchronize(case.device, ctl.timeout)
        wrong = case.wrong(salt)
    iters = a["iters"]
    if a["warmup_iters"]:
        t0 = time.perf_counter()
        for _ in range(a["warmup_iters"]):
            case.run(comm)
        _synchronize(case.device, ctl.timeout)
        per_iter = ctl.reduce([(time.perf_counter() - t0) / a["warmup_iters"]], dist.ReduceOp.MAX)[0]
        if 0 < a["time_budget"] < per_iter * iters:  # compared, not divided: any budget, however large
            iters = max(1, int(a["time_budget"] / per_iter))
    ctl.reduce([0.0], dist.ReduceOp.SUM)  # a barrier: every rank starts the timed loop together
    t0 = time.perf_counter()
    for _ in range(iters):
        case.run(comm)
    _synchronize(case.device, ctl.timeout)
    elapsed = (time.perf_counter() - t0) / iters
    if a["average"] == 0:
        t = ctl.reduce([elapsed if dist.get_rank() == 0 else 0.0], dist.ReduceOp.SUM)[0]
    elif a["average"] == 1:
        t = ctl.reduce([elapsed], dist.ReduceOp.SUM)[0] / dist.get_world_size()
    else:
        t = ctl.reduce([elapsed], dist.ReduceOp.MIN if a["average"] == 2 else dist.ReduceOp.MAX)[0]
    wrong = int(ctl.reduce([float(wrong)], dist.ReduceOp.SUM)[0])
    algbw = case.bytes / t / 1e9
    return Row(case.op, case.team.placement if case.op in PRIMITIVES else "both", case.n, case.bytes, case.count,
               iters, t * 1e6, algbw, algbw * BUS_FACTOR[case.op](case.n), wrong)


HEADER = f"{'op':>14} {'placement':>9} {'n':>3} {'size(B)':>12} {'count':>10} {'iters':>5} {'time(us)':>11} " \
         f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6}"


def _format(r: Row) -> str:
    return f"{r.op:>14} {r.placement:>9} {r.n:>3} {r.bytes:>12} {r.count:>10} {r.iters:>5} {r.time_us:>11.2f} " \
           f"{r.algbw:>11.3f} {r.busbw:>11.3f} {r.wrong:>6}"


def _device_for(backend: Backend, local_rank: int) -> torch.device:
    if backend.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"backend {backend.label} needs CUDA; use --backend gloo on the CPU")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def _bench_rank(rank: int, a: dict, topo: Topology, local_rank: int) -> dict | None:
    timeout = a["timeout"]
    backend = backend_choice(a["backend"], torch.cuda.is_available())  # a["backend"]: its label
    device = _device_for(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctl = _Control(timeout)
    hosts = ctl.gather(socket.gethostname())
    if device.type == "cuda":
        devices = ctl.gather(torch.cuda.get_device_properties(device).uuid.__str__())
        if len(set(devices)) != len(devices):
            raise RuntimeError(
                f"backend {backend.label} needs one GPU per rank, but ranks share GPUs ({devices.count(devices[0])} on "
                f"the first): NCCL refuses two ranks on one GPU; use fewer ranks or --backend gloo"
            )
    comm, teams = _connect(backend, topo, rank, device, timeout)
    dtype = DTYPES[a["datatype"]]
    rows = []
    if rank == 0:
        print(f"# tawpipe bench comm: backend {backend.label}, {topo.nodes} nodes x {topo.per_node} ranks "
              f"(hosts: {', '.join(sorted(set(hosts)))}), {a['datatype']}, up to {a['iters']} iterations "
              f"({'time budget %.2f s' % a['time_budget'] if a['time_budget'] else 'fixed'}), warm-up "
              f"{a['warmup_iters']}, check {'on' if a['check'] else 'off'}, -a {a['average']}", flush=True)
        print(f"# {DEFINITIONS}")
        print("# placements: intra = each node's group, inter = each rail across nodes (all at once); "
              "both = chunk_fetch (rail P2P, then broadcast in the node), grad_route (reduce in the node, "
              "then rail P2P)")
        print(HEADER, flush=True)
    for op, placement in _plan(a["ops"], topo, backend):
        for salt, nbytes in enumerate(_sizes(a)):
            team = teams[placement] if placement != "both" else None
            case = _Case(op, team, topo, rank, nbytes, dtype, device)
            row = _measure(case, comm, ctl, a, salt)
            rows.append(row)
            if rank == 0:
                print(_format(row), flush=True)
    if rank != 0:
        return None
    wrong = sum(r.wrong for r in rows)
    print(f"# out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    result = {
        "benchmark": "comm", "backend": backend.label, "nodes": topo.nodes, "per_node": topo.per_node,
        "dtype": a["datatype"], "definitions": DEFINITIONS, "hosts": hosts,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        **provenance(),
        "config": {k: v for k, v in a.items() if k not in ("json", "plot", "out")},
        "rows": [asdict(r) for r in rows], "wrong": wrong,
    }
    if device.type == "cuda":  # the NCCL torch loads: nccl-native refuses to run any other
        result["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return result


def _local_rank(rank: int, a: dict) -> dict | None:
    return _bench_rank(rank, a, Topology(a["nodes"], a["per_node"]), rank)


def title(result: dict) -> str:
    """The plot's title: backend, topology and how the nodes were joined, dtype, device."""
    links = _links(result)
    return (f"tawpipe bench comm: {result['backend']}, {result['nodes']} nodes x {result['per_node']}"
            f"{f' ({links})' if links else ''}, {result['dtype']}, {result['device']}")


def _links(result: dict) -> str:
    """'emulated cluster, 400mbit links', 'local job, loopback', or '' where unknown (torchrun)."""
    emulation = result.get("emulation", "")  # noted in a result by hand: "tawpipe cluster run ... --rate 400mbit"
    if emulation:
        rate = re.search(r"--rate\s+(\S+)", emulation)
        return f"emulated cluster, {rate.group(1) if rate else 'unlimited'} links"
    link = os.environ.get(LINK_ENV)
    if link:  # plotted by rank 0 inside the emulated cluster: the shaper of its node's link
        return f"emulated cluster, {_shaped_rate(link) or 'unlimited'} links"
    if "RANK" not in os.environ and result["backend"] == "gloo" and len(set(result.get("hosts", []))) <= 1:
        return "local job, loopback"  # run_local: every rank on this machine
    return ""


def _shaped_rate(link: str) -> str | None:
    """The rate of the htb class that ``tawpipe cluster`` puts on ``link`` ('400mbit'), if any."""
    try:
        out = subprocess.run(["tc", "class", "show", "dev", link], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"class htb 1:1 .*?\brate (\S+)", out)
    return m.group(1).lower() if m else None


def plot(result: dict, path: str) -> None:
    """busbw against size, one line per op, one panel per placement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("intra", "inter", "both") if any(r["placement"] == p for r in result["rows"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, placement in zip(axes[0], panels):
        rows = [r for r in result["rows"] if r["placement"] == placement]
        for op in dict.fromkeys(r["op"] for r in rows):
            pts = [(r["bytes"], r["busbw"]) for r in rows if r["op"] == op and r["busbw"] > 0]  # n = 1: busbw 0
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=op)
        n = rows[0]["n"]
        ax.set_xscale("log", base=2)
        if any(r["busbw"] > 0 for r in rows):
            ax.set_yscale("log")
        ax.set_title(f"{placement} (n = {n})" if placement != "both" else "composites (rail P2P + node collective)")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title(result), fontsize=10)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def _validated(args: argparse.Namespace) -> dict:
    a = {k: v for k, v in vars(args).items() if k not in ("what", "bench_main")}
    a["ops"] = [o.strip() for o in a["ops"].split(",") if o.strip()]
    unknown = [o for o in a["ops"] if o not in OPS]
    if unknown or not a["ops"]:
        what = f"unknown op(s) {unknown}" if unknown else "--ops names no operation"
        raise UsageError(f"{what}; choose from {', '.join(OPS)}")
    try:
        _sizes(a)
    except ValueError as e:
        raise UsageError(str(e)) from None
    a["timeout"] = a["timeout"] or env_timeout()
    backend = backend_choice(a["backend"], torch.cuda.is_available())
    if backend.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"backend {backend.label} needs CUDA; use --backend gloo on the CPU")
    try:
        comms.backend(backend.name)  # imported here: a backend this installation lacks is refused once
    except ValueError as e:
        raise UsageError(str(e)) from None
    _check_memory(a, backend)
    a["backend"] = backend.label  # what the results say (the ranks read the backend back from it)
    if os.environ.get("RANK", "0") == "0":  # the rank that writes the results (a local job's: this process)
        _check_outputs(a)
    return a


def case_bytes(size: int, dtype: torch.dtype, cpu: bool, check: bool) -> int:
    """Host bytes one rank holds for an operation of ``size`` bytes beyond its runtime: its two
    buffers where they are on the CPU, and with ``check`` the float64 inputs and expected result
    ``_Case.wrong`` recomputes (3 x 8 B per element; all_reduce's, the most of any operation)."""
    return (2 * size if cpu else 0) + (3 * 8 // dtype.itemsize * size if check else 0)


def _check_memory(a: dict, backend: Backend) -> None:
    """A UsageError where this host's ranks would need more memory than it has at -e, before any
    starts."""
    per_rank = RUNTIME_BYTES + case_bytes(a["maxbytes"], DTYPES[a["datatype"]], backend.device == "cpu", a["check"])
    if not under_torchrun():  # a local job: this command starts them all
        ranks, where = a["nodes"] * a["per_node"], f"--nodes {a['nodes']} x --per-node {a['per_node']}"
    elif LINK_ENV in os.environ:  # tawpipe cluster's emulated nodes: every rank of the job is on this host
        ranks, where = int(os.environ["WORLD_SIZE"]), "the emulated cluster's ranks, all on this host"
    else:
        ranks, where = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"]), "this host's ranks"
    check_memory(ranks * per_rank, f"{ranks} rank(s) ({where}) at -e {a['maxbytes']:,} bytes of {a['datatype']}, "
                 f"each {gib(per_rank)}", "use fewer ranks, a smaller -e" + (", or -c 0" if a["check"] else ""))


def _check_outputs(a: dict) -> None:
    """A UsageError naming the flag where the JSON or the plot cannot be written, before any rank starts."""
    if a["json"]:
        writable(Path(a["json"]), "--json", directory=False)
    else:
        writable(Path(a["out"]), "--out", directory=True)
    if a["plot"]:
        writable(Path(a["plot"]), "--plot", directory=False)


def main(args: argparse.Namespace) -> int:
    a = _validated(args)
    if under_torchrun():  # torchrun or tawpipe cluster: this process is one rank
        topo = Topology.from_env()
        backend = backend_choice(a["backend"], torch.cuda.is_available())
        init_distributed(a["timeout"], cpu=backend.device == "cpu")
        try:
            result = _bench_rank(dist.get_rank(), a, topo, int(os.environ.get("LOCAL_RANK", 0)))
            dist.barrier()  # nobody tears its connections down while a peer still uses them
        finally:
            dist.destroy_process_group()
    else:
        result = run_local(_local_rank, a["nodes"] * a["per_node"], a, timeout=a["timeout"])[0]
    if result is None:
        return 0
    topo_name = f"{result['nodes']}x{result['per_node']}"
    path = a["json"] or os.path.join(a["out"], f"comm_{a['backend']}_{topo_name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps(result, indent=1))
    print(f"wrote {path}")
    png = os.path.splitext(path)[0] + ".png" if a["plot"] is None else a["plot"]
    if png:
        plot(result, png)
        print(f"wrote {png}")
    return 0 if result["wrong"] == 0 else 1
