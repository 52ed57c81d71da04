"""What an emulated cluster is: its shape, its links, its compute, and the names of everything it
creates, so that every other part of ``tawpipe.cluster`` derives them from one place."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from itertools import count

PREFIX = "tpc"
SUBNET = "10.213.7"  # a /24 that exists only inside this package's namespaces
NODE_LINK = "tplink"  # the node's end of its veth, the same name in every node namespace
# a namespace (<run id>-br, <run id>-n<g>) and a run's cgroup (<run id>); a run id is tpc<launcher pid>x<n>
NAMESPACE_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d+)-(br|n\d+)$")
RUN_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d+)$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_RATE_SCALE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_runs = count()
MIN_RATE_BITS = 800  # the acknowledgements' class gets 1% of the rate, and tc sets no class below 1 byte/s
QUEUE_LIMIT = 2**32 - 1  # the most bytes a tc bfifo holds (its limit is 32 bits)


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


def shaper_burst(rate_bytes: float) -> int:
    """The shaper's bucket, bytes: it must exceed the largest GSO packet (64 KiB plus a header per
    segment); smaller ones shape each packet late and the link runs below its rate."""
    return max(256 * 1024, int(rate_bytes * 0.004))


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
        if self.rate is not None and parse_rate(self.rate) < MIN_RATE_BITS:
            raise ValueError(f"link rate {self.rate!r} is below {MIN_RATE_BITS}bit, the slowest the links' shaper "
                             "can set (its class for acknowledgements gets 1% of the rate, and tc sets no class "
                             "below 1 byte/s): give a faster rate, or 'none'")
        if self.rate is not None and self.queue_bytes > QUEUE_LIMIT:
            most = (QUEUE_LIMIT - shaper_burst(self.rate_bits / 8)) * 1000 // (self.rate_bits / 8)
            raise ValueError(f"queue-ms {self.queue_ms} at {self.rate} queues {self.queue_bytes:,} bytes, more than "
                             f"the {QUEUE_LIMIT:,} a tc bfifo holds: give a queue-ms of at most {int(most)}")
        if self.compute not in ("fixed", "shared"):
            raise ValueError(f"compute must be 'fixed' (a CPU quota per rank) or 'shared', got {self.compute!r}")
        if self.cpus_per_rank is not None:
            if self.compute == "shared":
                raise ValueError("cpus-per-rank sets the quota of fixed compute; leave it out with compute 'shared'")
            if not 0.01 <= self.cpus_per_rank <= os.cpu_count():
                raise ValueError(f"cpus-per-rank must lie in 0.01..{os.cpu_count()} (cores), "
                                 f"got {self.cpus_per_rank!r}")
        if NAMESPACE_NAME.match(f"{self.run_id}-br") is None:
            raise ValueError(f"run id {self.run_id!r} must look like '{PREFIX}<pid>x<n>'")

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def rate_bits(self) -> int | None:
        return None if self.rate is None else parse_rate(self.rate)

    @property
    def queue_bytes(self) -> int:
        """The bulk queue of each direction of a link, bytes: ``queue_ms`` at the rate, plus the
        shaper's bucket (0 without a rate)."""
        if self.rate_bits is None:
            return 0
        rate_bytes = self.rate_bits / 8
        return int(rate_bytes * self.queue_ms / 1000) + shaper_burst(rate_bytes)

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


def describe_compute(spec: ClusterSpec) -> str:
    """How the ranks' compute is set, in words."""
    if spec.compute == "shared":
        return f"compute shared (ranks borrow idle cores; {spec.threads} thread(s) each)"
    return f"compute fixed at {spec.rank_cpus:.2f} core(s) per rank ({spec.threads} thread(s) each)"
