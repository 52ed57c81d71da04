"""Bytes that crossed nodes, from the kernel's counters of each node's veth: they see exactly the
inter-node traffic (payload plus TCP/IP headers), since traffic inside a node never uses the veth."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

from .netns import run_ip
from .spec import ClusterSpec

LINK_ENV = "TAWPIPE_CLUSTER_LINK"  # set for workers: the interface whose counters are inter-node


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


def node_link_bytes(spec: ClusterSpec) -> list[LinkBytes]:
    """From the launcher: per node of ``spec``'s cluster, the bytes it sent and received over its
    link so far (bridge-side counters)."""
    r = run_ip(["ip", "-n", spec.bridge_ns, "-s", "-j", "link", "show"])
    stats = {d["ifname"]: d["stats64"] for d in json.loads(r.stdout) if "stats64" in d}
    # The bridge's end receives what the node transmits, and the reverse.
    return [LinkBytes(tx=stats[spec.bridge_link(g)]["rx"]["bytes"],
                      rx=stats[spec.bridge_link(g)]["tx"]["bytes"]) for g in range(spec.nodes)]
