"""`tawpipe cluster`: G emulated nodes on this machine, joined by rate-limited links.

TawPipe's claim is about slow links *between* nodes, so the emulation puts each node in a network
namespace of its own. Node g has one veth link to a bridge that lives in a further namespace; a
tc htb shaper limits both directions of every link, on the node side (node -> bridge)
and on the bridge side (bridge -> node). The ranks of node g run inside namespace g, so:

* traffic between nodes crosses two rate-limited veths and the bridge;
* traffic inside a node goes to a local address and therefore over loopback, never the veth;
* the veth's byte counters measure exactly what crossed nodes (payload plus TCP/IP headers).

Workers get torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT), gloo's GLOO_SOCKET_IFNAME is the node's veth and the TCPStore
rendezvous listens on node 0's veth address, so ``Topology.from_env()`` and
``tawpipe.runtime.launch.init_distributed()`` work unchanged inside. Workers die with the launcher
(PR_SET_PDEATHSIG, plus a process-group kill), and every wait has a timeout.

Compute is fixed by default: each rank runs in a cgroup of its own whose CPU quota is its share of
the machine (``cpus_per_rank``, e.g. 2 cores / 4 ranks = 0.5 core), so time a rank spends waiting
for a message is lost, as a GPU's is, instead of going to the other ranks on its core. The shared
mode (``compute="shared"``) lets ranks borrow each other's idle cores: waiting looks free there.

Needs root and iproute2 (``ip``, ``tc``), and for fixed compute the cgroup cpu controller (v1 or
v2). Addresses are private (``SUBNET``.0/24) and exist only inside the namespaces created here.
Every name (namespaces, cgroups) starts with ``tpc<launcher pid>x<n>``, so a launcher that was
killed outright leaves names that ``tawpipe cluster down`` recognises and removes.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from .commands import UsageError
from .runtime.launch import die_with_parent

PREFIX = "tpc"
SUBNET = "10.213.7"  # a /24 that exists only inside this module's namespaces
NODE_LINK = "tplink"  # the node's end of its veth, the same name in every node namespace
LINK_ENV = "TAWPIPE_CLUSTER_LINK"  # set for workers: the interface whose counters are inter-node
COMMAND_TIMEOUT = 30.0  # seconds for one ip/tc invocation
_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d+)-(br|n\d+)$")
_RUN = re.compile(rf"^{PREFIX}(\d+)x(\d+)$")
CGROUP_ROOTS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup")  # v1 mounts, then v2
CPU_PERIOD_US = 10_000  # short, so a rank over its quota waits at most a few ms, not half of 100 ms
THREADS_ENV = "TAWPIPE_CLUSTER_THREADS"  # set for workers: torch's thread count to match the quota
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_RATE_SCALE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_runs = count()


class ClusterUnavailable(RuntimeError):
    """This machine or user cannot create the emulated cluster (no root, no ip/tc)."""


class ClusterError(RuntimeError):
    """Setting up the cluster failed, or a worker failed or timed out."""


def parse_rate(rate: str) -> int:
    """Bits per second of a tc rate such as '100mbit' or '1gbit' (decimal prefixes, like tc)."""
    m = _RATE.match(rate.strip()) if isinstance(rate, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r} is not a positive tc rate: write e.g. '100mbit', '1gbit', "
                         "'500kbit' (or 'none' for no limit)")
    return int(float(m.group(1)) * _RATE_SCALE[m.group(2).lower()])


def unavailable_reason(spec: "ClusterSpec | None" = None) -> str | None:
    """Why the emulated cluster (``spec``'s, when given: fixed compute needs a cgroup cpu
    controller too) cannot run here, or None when it can."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"the emulated cluster needs iproute2's {' and '.join(missing)}, not found on PATH: "
                "install iproute2")
    if os.geteuid() != 0:
        return ("the emulated cluster needs root (it creates network namespaces, veth links and tc "
                f"rate limits); running as uid {os.geteuid()}: run it as root, e.g. with sudo")
    lacking = [name for bit, name in _CAPABILITIES if not _effective_capabilities() >> bit & 1]
    if lacking:
        return (f"the emulated cluster needs {' and '.join(lacking)} (network namespaces, veth links, tc); "
                "this process is root without them in its effective set (a container started without "
                "--cap-add NET_ADMIN --cap-add SYS_ADMIN or --privileged?)")
    if spec is not None and spec.compute == "fixed" and cpu_controller() is None:
        return ("fixed compute (a CPU quota per rank) needs the cgroup cpu controller, cgroup v1's 'cpu' "
                f"hierarchy or v2 with 'cpu' in cgroup.controllers, under one of {list(CGROUP_ROOTS)}; none "
                "found: mount it, or run with --compute shared (ranks then lend each other their idle cores, "
                "so waiting looks free)")
    return None


_PROC_STATUS = "/proc/self/status"
# `ip link`/`tc` need CAP_NET_ADMIN; `ip netns add` (unshare, bind mount) needs CAP_SYS_ADMIN too
_CAPABILITIES = ((12, "CAP_NET_ADMIN"), (21, "CAP_SYS_ADMIN"))


def _effective_capabilities() -> int:
    """This process's effective capability set (CapEff of /proc/self/status); every bit set where
    it cannot be read (not Linux): then ``ip`` itself reports what is missing."""
    try:
        with open(_PROC_STATUS) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, IndexError, ValueError):
        pass
    return -1


@dataclass(frozen=True)
class ClusterSpec:
    """The shape and links of an emulated cluster, and the names of everything it creates."""

    nodes: int
    per_node: int
    rate: str | None = "100mbit"  # per direction of every node's link; None: no limit
    queue_ms: int = 400  # bulk queue; at 100 Mbit/s a shallow queue drops packets
    # each rank on one core, round-robin over the cores this process may use: ranks sharing a core
    # share it evenly, but a rank's helper threads can no longer use an idle core
    pin_cpus: bool = False
    # "fixed": each rank in a cgroup with ``cpus_per_rank`` cores of quota (default: this process's
    # cores / ranks), so a waiting rank's compute is lost as on a GPU; "shared": no quota
    compute: str = "fixed"
    cpus_per_rank: float | None = None
    run_id: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}x{next(_runs)}")

    def __post_init__(self) -> None:
        for name in ("nodes", "per_node", "queue_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster {name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.nodes > 250:
            raise ValueError(f"at most 250 nodes fit the cluster's /24 subnet, got {self.nodes}")
        if self.rate is not None:
            parse_rate(self.rate)
        if self.compute not in ("fixed", "shared"):
            raise ValueError(f"compute must be 'fixed' (a CPU quota per rank) or 'shared', got {self.compute!r}")
        if self.cpus_per_rank is not None:
            if self.compute == "shared":
                raise ValueError("cpus-per-rank sets the quota of fixed compute; leave it out with compute 'shared'")
            if not 0.01 <= self.cpus_per_rank <= os.cpu_count():
                raise ValueError(f"cpus-per-rank must lie in 0.01..{os.cpu_count()} (cores), "
                                 f"got {self.cpus_per_rank!r}")
        if _NAME.match(f"{self.run_id}-br") is None:
            raise ValueError(f"run id {self.run_id!r} must look like '{PREFIX}<pid>x<n>'")

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def rate_bits(self) -> int | None:
        return None if self.rate is None else parse_rate(self.rate)

    @property
    def bridge_ns(self) -> str:
        return f"{self.run_id}-br"

    def node_ns(self, g: int) -> str:
        return f"{self.run_id}-n{g}"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the cluster, nodes first (deleting a node's removes its veth pair)."""
        return [self.node_ns(g) for g in range(self.nodes)] + [self.bridge_ns]

    @staticmethod
    def bridge_link(g: int) -> str:
        """The bridge's end of node g's veth (in the bridge namespace)."""
        return f"tpb{g}"

    @staticmethod
    def address(g: int) -> str:
        return f"{SUBNET}.{g + 1}"

    @property
    def rank_cpus(self) -> float | None:
        """Cores of quota per rank under fixed compute (None: shared)."""
        if self.compute == "shared":
            return None
        if self.cpus_per_rank is not None:
            return self.cpus_per_rank
        return len(os.sched_getaffinity(0)) / self.world_size

    @property
    def threads(self) -> int:
        """torch threads per rank: the quota's whole cores (at least one); 1 when shared."""
        cpus = self.rank_cpus
        return max(1, int(cpus + 1e-9)) if cpus is not None else 1

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        return rank // self.per_node


def shaper_burst(rate_bytes: float) -> int:
    """The shaper's bucket, bytes: it must exceed the largest GSO packet (64 KiB plus a header per
    segment); smaller ones shape each packet late and the link runs below its rate."""
    return max(256 * 1024, int(rate_bytes * 0.004))


def _shaper(ns: str, dev: str, spec: ClusterSpec) -> list[list[str]]:
    """The link rate on one direction of one link: htb with two classes sharing it. Packets under
    128 bytes (TCP's bare acknowledgements) go first; the rest wait in a byte FIFO ``queue_ms`` deep.

    The deep queue is there because a shallow one drops packets at 100 Mbit/s. Left alone, it
    would also hold the acknowledgements of the other direction's data behind up to ``queue_ms``
    of bulk bytes, so a link busy both ways (a swap of chunks between two nodes) would run far
    below its rate. A switch port with a shallow buffer does not do that."""
    rate_bytes = spec.rate_bits / 8
    burst = str(shaper_burst(rate_bytes))
    tc = ["tc", "-n", ns]
    cls = [*tc, "class", "add", "dev", dev]
    return [
        [*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20", "r2q", "1000"],
        [*cls, "parent", "1:", "classid", "1:1", "htb", "rate", spec.rate, "burst", burst, "cburst", burst],
        [*cls, "parent", "1:1", "classid", "1:10", "htb", "rate", str(int(spec.rate_bits // 100)), "ceil", spec.rate,
         "burst", burst, "cburst", burst, "prio", "0"],
        [*cls, "parent", "1:1", "classid", "1:20", "htb", "rate", str(int(spec.rate_bits * 99 // 100)), "ceil",
         spec.rate, "burst", burst, "cburst", burst, "prio", "1"],
        [*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "bfifo", "limit",
         str(int(rate_bytes * spec.queue_ms / 1000) + int(burst))],
        # IPv4 total length (bytes 2-3 of the header) below 128
        [*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
         "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", "1:10"],
    ]


def cpu_controller(roots: Sequence[str] = CGROUP_ROOTS) -> tuple[str, int] | None:
    """(directory, cgroup version) of the first cpu controller under ``roots`` that root may use."""
    for root in roots:
        if os.path.exists(os.path.join(root, "cpu.cfs_quota_us")):
            return root, 1
        controllers = os.path.join(root, "cgroup.controllers")
        if os.path.exists(controllers):
            with open(controllers) as f:
                if "cpu" in f.read().split():
                    return root, 2
    return None


class CpuQuota:
    """One cgroup per rank, ``<root>/<run id>/r<rank>``, limited to ``spec.rank_cpus`` cores.

    A rank's process joins its cgroup before it execs (its pid into ``procs_file``), so
    everything the rank runs, gloo's threads included, shares the quota, as a GPU's compute
    and its copy engines share one device's time."""

    def __init__(self, spec: ClusterSpec, controller: tuple[str, int]) -> None:
        self.spec = spec
        self.root, self.version = controller
        self.base = os.path.join(self.root, spec.run_id)

    def path(self, rank: int) -> str:
        return os.path.join(self.base, f"r{rank}")

    def create(self) -> None:
        quota = max(1000, round(self.spec.rank_cpus * CPU_PERIOD_US))  # the kernel's minimum is 1 ms
        os.mkdir(self.base)
        if self.version == 2:  # children may only use controllers their parent hands down
            _write(os.path.join(self.root, "cgroup.subtree_control"), "+cpu")
            _write(os.path.join(self.base, "cgroup.subtree_control"), "+cpu")
        for rank in range(self.spec.world_size):
            os.mkdir(self.path(rank))
            if self.version == 1:
                _write(os.path.join(self.path(rank), "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                _write(os.path.join(self.path(rank), "cpu.cfs_quota_us"), str(quota))
            else:
                _write(os.path.join(self.path(rank), "cpu.max"), f"{quota} {CPU_PERIOD_US}")

    def procs_file(self, rank: int) -> str:
        """The file a process writes its pid to, to join ``rank``'s cgroup."""
        return os.path.join(self.path(rank), "cgroup.procs")

    def remove(self) -> list[str]:
        """Delete the cgroups (their processes must be gone); returns the errors met."""
        return remove_cgroups([self.base])


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def remove_cgroups(bases: Sequence[str]) -> list[str]:
    """Delete each run's cgroup directory and the rank cgroups in it, killing what is left inside."""
    errors = []
    for base in bases:
        if not os.path.isdir(base):
            continue
        children = [os.path.join(base, d) for d in sorted(os.listdir(base)) if os.path.isdir(os.path.join(base, d))]
        for cg in [*children, base]:
            for attempt in range(50):  # a killed process leaves its cgroup a moment after SIGKILL
                try:
                    os.rmdir(cg)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if attempt == 0:
                        _kill_cgroup(cg)
                    if attempt == 49:
                        errors.append(f"rmdir {cg}: {e.strerror}")
                    time.sleep(0.1)
    return errors


def _kill_cgroup(cg: str) -> None:
    with contextlib.suppress(OSError), open(os.path.join(cg, "cgroup.procs")) as f:
        for pid in f.read().split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)


def stale_cgroups(alive: Callable[[int], bool], everything: bool = False,
                  controller: tuple[str, int] | None = None) -> list[str]:
    """This module's run cgroups whose launcher is no longer alive (all of them with ``everything``)."""
    controller = controller or cpu_controller()
    if controller is None:
        return []
    root = controller[0]
    return [os.path.join(root, d) for d in sorted(os.listdir(root))
            if (m := _RUN.match(d)) and os.path.isdir(os.path.join(root, d))
            and (everything or not alive(int(m.group(1))))]


def setup_commands(spec: ClusterSpec) -> list[list[str]]:
    """The ip/tc invocations that build ``spec``, in order."""
    br = spec.bridge_ns
    cmds = [["ip", "netns", "add", ns] for ns in spec.namespaces]
    cmds += [
        ["ip", "-n", br, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", br, "link", "set", "br0", "up"],
    ]
    for g in range(spec.nodes):
        ns, peer = spec.node_ns(g), spec.bridge_link(g)
        cmds += [
            ["ip", "link", "add", NODE_LINK, "netns", ns, "type", "veth", "peer", "name", peer, "netns", br],
            ["ip", "-n", br, "link", "set", peer, "master", "br0"],
            ["ip", "-n", br, "link", "set", peer, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{spec.address(g)}/24", "dev", NODE_LINK],
            ["ip", "-n", ns, "link", "set", NODE_LINK, "up"],
            # TCP as a cluster's transport behaves, for every method alike: a link idle for a slot
            # does not restart slow start (a transfer after a pause would ramp up over several
            # round trips, which an RDMA rail never does), and BBR paces at the link rate instead
            # of filling the deep queue. Filled, that queue delays the acknowledgements that ride
            # on the other direction's data, and a swap of chunks (both directions of one
            # connection at once) then ran at half the rate of each direction.
            ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0",
             "net.ipv4.tcp_congestion_control=bbr"],
        ]
    return cmds + shaping_commands(spec)


def _shaped_devices(spec: ClusterSpec) -> list[tuple[str, str]]:
    """(namespace, device) of both ends of every node's link: each shapes one direction."""
    return [end for g in range(spec.nodes)
            for end in ((spec.node_ns(g), NODE_LINK), (spec.bridge_ns, spec.bridge_link(g)))]


def shaping_commands(spec: ClusterSpec, on: bool = True) -> list[list[str]]:
    """The tc invocations that put the rate limit on every link (``on``) or take it off."""
    if spec.rate is None:
        return []
    if on:
        return [cmd for ns, dev in _shaped_devices(spec) for cmd in _shaper(ns, dev, spec)]
    return [["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"] for ns, dev in _shaped_devices(spec)]


def list_namespaces() -> list[str]:
    out = _ip(["ip", "netns", "list"], check=False).stdout
    return parse_netns_list(out)


def parse_netns_list(text: str) -> list[str]:
    """Names from ``ip netns list`` output ("name (id: 3)" or "name" per line)."""
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def stale_namespaces(names: Sequence[str], alive: Callable[[int], bool], everything: bool = False) -> list[str]:
    """This module's namespaces whose launcher is no longer alive (all of them with ``everything``)."""
    out = []
    for name in names:
        m = _NAME.match(name)
        if m and (everything or not alive(int(m.group(1)))):
            out.append(name)
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_namespaces(names: Sequence[str]) -> list[str]:
    """Kill every process inside each namespace, then delete it; returns the errors met."""
    errors = []
    for ns in names:
        pids = _ip(["ip", "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        r = _ip(["ip", "netns", "del", ns], check=False)
        if r.returncode != 0:
            errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
    return errors


def _ip(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{' '.join(cmd)}: no answer within {COMMAND_TIMEOUT:.0f} s") from None
    if check and r.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed (exit {r.returncode}): {r.stderr.strip()}")
    return r


@dataclass(frozen=True)
class LinkBytes:
    """Bytes a node sent (tx) and received (rx) over its inter-node link."""

    tx: int
    rx: int

    def __sub__(self, other: "LinkBytes") -> "LinkBytes":
        return LinkBytes(self.tx - other.tx, self.rx - other.rx)

    @property
    def busiest_direction(self) -> int:
        return max(self.tx, self.rx)


def describe_compute(spec: ClusterSpec) -> str:
    """How the ranks' compute is set, in words."""
    if spec.compute == "shared":
        return f"compute shared (ranks borrow idle cores; {spec.threads} thread(s) each)"
    return f"compute fixed at {spec.rank_cpus:.2f} core(s) per rank ({spec.threads} thread(s) each)"


def network_floor(per_node: Sequence[LinkBytes], rate_bits: float) -> float:
    """Seconds the busiest link direction needs at ``rate_bits``: no schedule can be faster."""
    return max(b.busiest_direction for b in per_node) * 8 / rate_bits


def link_bytes() -> LinkBytes | None:
    """Inside a cluster worker: this node's inter-node bytes so far (None outside a cluster)."""
    dev = os.environ.get(LINK_ENV)
    if not dev:
        return None
    stats = f"/sys/class/net/{dev}/statistics"
    with open(f"{stats}/tx_bytes") as tx, open(f"{stats}/rx_bytes") as rx:
        return LinkBytes(int(tx.read()), int(rx.read()))


def worker_env(spec: ClusterSpec, rank: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """torchrun's environment for ``rank``, plus gloo's interface and the link to count."""
    g = spec.node_of(rank)
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(spec.world_size), LOCAL_RANK=str(rank % spec.per_node),
        LOCAL_WORLD_SIZE=str(spec.per_node), GROUP_RANK=str(g), GROUP_WORLD_SIZE=str(spec.nodes),
        ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=spec.address(0), MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME=NODE_LINK, **{LINK_ENV: NODE_LINK},
    )
    # fixed compute: as many threads as the quota has whole cores; shared: the caller's choice, or 1
    threads = str(spec.threads) if spec.compute == "fixed" else env.get("OMP_NUM_THREADS", "1")
    env.update(OMP_NUM_THREADS=threads, **{THREADS_ENV: threads})
    return env


def worker_command(spec: ClusterSpec, rank: int, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside the namespace of ``rank``'s node."""
    return ["ip", "netns", "exec", spec.node_ns(spec.node_of(rank)), *argv]


_BOOT = "import sys; from tawpipe.cluster import _worker_main; sys.exit(_worker_main(sys.argv[1], int(sys.argv[2])))"


def _prepare_worker(parent: int, cpus: set[int] | None, cgroup_procs: str | None = None) -> Callable[[], None]:
    """A preexec_fn: PR_SET_PDEATHSIG, the CPU affinity and the rank's cgroup (its CPU quota)
    survive the exec of ip and python."""

    def prepare() -> None:
        if cgroup_procs is not None:
            _write(cgroup_procs, str(os.getpid()))
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        die_with_parent(parent)

    return prepare


def worker_cpus(spec: ClusterSpec, rank: int) -> set[int] | None:
    """The core ``rank`` runs on (None: any), see ``ClusterSpec.pin_cpus``."""
    if not spec.pin_cpus:
        return None
    cores = sorted(os.sched_getaffinity(0))
    return {cores[rank % len(cores)]}


class Cluster:
    """An emulated cluster, built on entry and torn down on exit, error or signal.

    ``run(fn, *args)`` runs ``fn(rank, *args)`` on every rank with torch.distributed initialised
    (gloo, CPU) and returns the JSON-able results; ``run([...argv])`` runs a command per rank
    (like torchrun) and returns the exit codes.
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self._procs: list[subprocess.Popen] = []
        self._port = random.randrange(20000, 40000)
        self._old_handlers: dict[int, Any] = {}
        self._signalled: int | None = None
        self._up = False
        self._quota: CpuQuota | None = None

    def __enter__(self) -> "Cluster":
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        reason = unavailable_reason(self.spec)
        if reason:
            raise ClusterUnavailable(reason)
        self._signalled = None
        self._install_signal_handlers()
        self._up = True
        try:
            if self.spec.compute == "fixed":
                self._quota = CpuQuota(self.spec, cpu_controller())
                try:
                    self._quota.create()
                except OSError as e:
                    raise ClusterError(f"could not create the cgroup {e.filename}: {e.strerror}") from None
            for cmd in setup_commands(self.spec):
                _ip(cmd)
        except BaseException as e:
            self.down()
            if isinstance(e, ClusterError):
                raise ClusterError(f"could not build the emulated cluster: {e} (is CAP_NET_ADMIN "
                                   "available, e.g. not inside an unprivileged container?)") from None
            raise

    def down(self) -> None:
        """Kill the workers and delete every namespace (idempotent)."""
        self._signalled = self._signalled or 0  # signals from now on are only noted
        self._kill_workers()
        if self._up:
            existing = list_namespaces()
            errors = remove_namespaces([ns for ns in self.spec.namespaces if ns in existing])
            if self._quota is not None:
                errors += self._quota.remove()
                self._quota = None
            self._up = False
            if errors:
                print("tawpipe cluster: teardown problems (run 'tawpipe cluster down'):\n  "
                      + "\n  ".join(errors), file=sys.stderr)
        self._restore_signal_handlers()

    @contextlib.contextmanager
    def unlimited(self) -> Iterator[None]:
        """The links without their rate limit for the duration: a run inside measures the same job
        with communication (nearly) free, on the same cluster and between the same other runs."""
        for cmd in shaping_commands(self.spec, on=False):
            _ip(cmd)
        try:
            yield
        finally:
            for cmd in shaping_commands(self.spec):
                _ip(cmd)

    def link_bytes(self) -> list[LinkBytes]:
        """Per node, the bytes it sent and received over its link so far (bridge-side counters)."""
        r = _ip(["ip", "-n", self.spec.bridge_ns, "-s", "-j", "link", "show"])
        stats = {d["ifname"]: d["stats64"] for d in json.loads(r.stdout) if "stats64" in d}
        # The bridge's end receives what the node transmits, and the reverse.
        return [LinkBytes(tx=stats[self.spec.bridge_link(g)]["rx"]["bytes"],
                          rx=stats[self.spec.bridge_link(g)]["tx"]["bytes"]) for g in range(self.spec.nodes)]

    def run(self, target: Callable[..., Any] | Sequence[str], *args: Any, timeout: float,
            quiet: bool = True) -> list[Any]:
        """Run ``target`` on every rank; raises ClusterError with the first failure's log."""
        if not self._up:
            raise ClusterError("the cluster is not up: use it as a context manager ('with Cluster(spec) as c')")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self._check_signal()
        self._port += 1
        with tempfile.TemporaryDirectory(prefix=f"{self.spec.run_id}-") as tmp:
            if callable(target):
                task = os.path.join(tmp, "task.pkl")
                with open(task, "wb") as f:
                    pickle.dump({"sys_path": list(sys.path), "out": tmp, "timeout": timeout,
                                 "payload": pickle.dumps({"fn": target, "args": args})}, f)
                argv = [sys.executable, "-c", _BOOT, task]
            else:
                argv = list(target)
            env_base = dict(os.environ)
            package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env_base["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env_base.get("PYTHONPATH")]))
            logs = []
            for rank in range(self.spec.world_size):
                log = None if not quiet else open(os.path.join(tmp, f"rank{rank}.log"), "wb")
                logs.append(log)
                rank_argv = [*argv, str(rank)] if callable(target) else argv
                self._procs.append(subprocess.Popen(
                    worker_command(self.spec, rank, rank_argv), env=worker_env(self.spec, rank, self._port, env_base),
                    stdout=log, stderr=subprocess.STDOUT if log else None, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=_prepare_worker(os.getpid(), worker_cpus(self.spec, rank),
                                               self._quota.procs_file(rank) if self._quota else None),
                ))
            try:
                codes = self._wait(timeout, tmp)
            finally:
                self._kill_workers()
                for log in logs:
                    if log:
                        log.close()
            if not callable(target):
                return codes
            return [self._result(tmp, rank) for rank in range(self.spec.world_size)]

    def _wait(self, timeout: float, tmp: str) -> list[int]:
        deadline = time.monotonic() + timeout
        while True:
            self._check_signal()
            codes = [p.poll() for p in self._procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                raise ClusterError(f"rank {failed[0]} exited with code {codes[failed[0]]}"
                                   + self._log_tail(tmp, failed[0]))
            if all(c == 0 for c in codes):
                return codes
            if time.monotonic() > deadline:
                stuck = [r for r, c in enumerate(codes) if c is None]
                raise ClusterError(f"ranks {stuck} still running after {timeout:.0f} s; stopped them"
                                   + self._log_tail(tmp, stuck[0]))
            time.sleep(0.05)

    @staticmethod
    def _log_tail(tmp: str, rank: int) -> str:
        for name in (f"error{rank}.txt", f"rank{rank}.log"):
            path = os.path.join(tmp, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    return f"; {name}:\n" + f.read()[-4000:]
        return ""

    @staticmethod
    def _result(tmp: str, rank: int) -> Any:
        with open(os.path.join(tmp, f"result{rank}.json")) as f:
            return json.load(f)

    def _kill_workers(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the worker leads its own session
                except ProcessLookupError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                print(f"tawpipe cluster: worker {p.pid} did not exit after SIGKILL", file=sys.stderr)
        self._procs = []

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; try/finally still tears down

        def stop(signum: int, _frame: object) -> None:
            # Raising unwinds through __exit__/finally, which tear down. Python ignores an
            # exception raised inside an at-fork hook (a signal during Popen), so the signal is
            # also recorded and re-raised by the next wait (_check_signal).
            print(f"tawpipe cluster: {signal.Signals(signum).name}, tearing down", file=sys.stderr)
            if self._signalled is None:  # a second signal must not interrupt the teardown
                self._signalled = signum
                self._check_signal()

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, stop)

    def _check_signal(self) -> None:
        if self._signalled == signal.SIGINT:
            raise KeyboardInterrupt
        if self._signalled:
            raise SystemExit(128 + self._signalled)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}


def _worker_main(task_path: str, rank: int) -> int:
    """Entry point of a Python worker: initialise torch.distributed, run, write the result."""
    faulthandler.enable(all_threads=True)  # a native crash leaves every thread's Python stack in the log
    with open(task_path, "rb") as f:
        outer = pickle.load(f)
    out = outer["out"]
    try:
        sys.path[:0] = [p for p in outer["sys_path"] if p not in sys.path]  # before unpickling fn
        task = pickle.loads(outer["payload"])
        import torch
        import torch.distributed as dist

        from .runtime.launch import init_distributed

        torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
        init_distributed(timeout=outer["timeout"])
        try:
            value = task["fn"](rank, *task["args"])
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        part = os.path.join(out, f"result{rank}.json.part")
        with open(part, "w") as f:
            json.dump(value, f)
        os.replace(part, os.path.join(out, f"result{rank}.json"))
        return 0
    except BaseException:  # noqa: BLE001 - reported to the launcher
        with open(os.path.join(out, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        return 1


# ------------------------------------------------------------------------------------ command line


DESCRIPTION = (
    "An emulated multi-node cluster on this machine (root): one network namespace per node, rate-limited links "
    "between them, a CPU quota per rank. 'run' starts a function or a command on every rank with torchrun's "
    "environment and prints the bytes that crossed each node's link; 'down' removes what dead launchers left."
)


def add_link_arguments(p: argparse.ArgumentParser) -> None:
    """The options of every command that builds a cluster: ``ClusterSpec``'s rate (None for
    'none'), queue, pinning and compute (see :func:`spec_from_args`)."""
    p.add_argument("--rate", default="100mbit", type=lambda v: None if v.lower() == "none" else v,
                   help="link rate per direction, tc syntax; 'none': no limit")
    p.add_argument("--queue-ms", type=int, default=400, help="bulk queue length in ms (acknowledgements bypass it)")
    p.add_argument("--pin-cpus", action="store_true",
                   help="pin each rank to one core, round-robin (default: the kernel places them)")
    p.add_argument("--compute", choices=("fixed", "shared"), default="fixed",
                   help="fixed (default): each rank gets a CPU quota of its own (a cgroup), so time it spends "
                        "waiting is lost as on a GPU; shared: ranks lend each other idle cores, and waiting "
                        "looks nearly free")
    p.add_argument("--cpus-per-rank", type=float, default=None, metavar="CORES",
                   help="fixed compute: cores of quota per rank (default: this machine's cores / ranks)")


def spec_from_args(args: argparse.Namespace, nodes: int, per_node: int) -> ClusterSpec:
    """The cluster of ``nodes`` x ``per_node`` that the options of :func:`add_link_arguments` ask for."""
    return ClusterSpec(nodes, per_node, args.rate, args.queue_ms, pin_cpus=args.pin_cpus, compute=args.compute,
                       cpus_per_rank=args.cpus_per_rank)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    r = sub.add_parser("run", help="run a function or a command on every rank of an emulated cluster",
                       description="Build the cluster, run TARGET on every rank, print each node's "
                                   "inter-node bytes, tear everything down.")
    r.add_argument("--nodes", type=int, default=2, help="emulated nodes (network namespaces)")
    r.add_argument("--per-node", type=int, default=2, help="ranks per node")
    add_link_arguments(r)
    r.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are stopped")
    r.add_argument("target", nargs=argparse.REMAINDER, metavar="-- TARGET ...",
                   help="'module:function [ARG ...]' (called as function(rank, *ARGs) after "
                        "torch.distributed is initialised; returns JSON) or a command, e.g. "
                        "'python -m tawpipe train --steps 2'")
    d = sub.add_parser("down", help="remove namespaces (and their processes) left by dead launchers")
    d.add_argument("--all", action="store_true", help="also those of launchers still running")


def _resolve(target: Sequence[str]) -> Callable[..., Any] | None:
    """The function named by 'module:function', or None when ``target`` is a command."""
    if len(target) == 0 or not re.fullmatch(r"[\w.]+:\w+", target[0]):
        return None
    module, name = target[0].split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"cannot import {target[0]}: {e}") from None


def main(args: argparse.Namespace) -> int:
    if args.action == "down":
        names = stale_namespaces(list_namespaces(), _pid_alive, everything=args.all)
        errors = remove_namespaces(names)
        cgroups = stale_cgroups(_pid_alive, everything=args.all)
        cg_errors = remove_cgroups(cgroups)
        print(f"tawpipe cluster down: removed {len(names) - len(errors)} namespace(s) and "
              f"{len(cgroups) - len(cg_errors)} cgroup(s)" + "".join(f"\n  {e}" for e in errors + cg_errors))
        return 1 if errors or cg_errors else 0
    target = [a for a in args.target if a != "--"] if args.target[:1] == ["--"] else list(args.target)
    if not target:
        raise UsageError("nothing to run; give '-- module:function' or '-- command'")
    try:
        spec = spec_from_args(args, args.nodes, args.per_node)
    except ValueError as e:
        raise UsageError(str(e)) from None
    fn = _resolve(target)
    reason = unavailable_reason(spec)
    if reason:
        raise UsageError(reason)
    with Cluster(spec) as c:
        print(f"tawpipe cluster: {spec.nodes} nodes x {spec.per_node} ranks, links {spec.rate or 'unlimited'} "
              f"each way, {describe_compute(spec)}, namespaces {spec.run_id}-*", flush=True)
        before = c.link_bytes()
        t0 = time.perf_counter()
        results = c.run(fn, *target[1:], timeout=args.timeout, quiet=False) if fn else \
            c.run(target, timeout=args.timeout, quiet=False)
        seconds = time.perf_counter() - t0
        moved = [b - a for a, b in zip(before, c.link_bytes())]
    if fn:
        for rank, value in enumerate(results):
            print(f"rank {rank}: {json.dumps(value)}")
    print(f"done in {seconds:.1f} s; inter-node bytes per node (sent / received, veth counters):")
    for g, b in enumerate(moved):
        print(f"  node {g}: {b.tx / 1e6:.3f} MB / {b.rx / 1e6:.3f} MB")
    if spec.rate_bits:
        print(f"network floor of the whole run: {network_floor(moved, spec.rate_bits):.2f} s")
    return 0
