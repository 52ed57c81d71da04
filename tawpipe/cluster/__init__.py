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

The modules, one job each: ``spec`` (the cluster's shape and the names of what it creates),
``host`` (whether this machine can build it), ``netns`` (namespaces, links and their shapers),
``cgroups`` (a CPU quota per rank), ``counters`` (the bytes that crossed nodes), ``supervise``
(the ``Cluster`` that runs the ranks and tears everything down) and ``command`` (the command line).
"""

from __future__ import annotations

from typing import Any

from . import host
from .cgroups import CGROUP_ROOTS, CPU_PERIOD_US, CpuQuota, cpu_controller, remove_cgroups, stale_cgroups
from .command import DESCRIPTION, add_arguments, add_link_arguments, main, rate_arg, spec_from_args
from .counters import LINK_ENV, LinkBytes, link_bytes, network_floor
from .netns import (COMMAND_TIMEOUT, list_namespaces, parse_netns_list, remove_namespaces, setup_commands,
                    shaper_burst, shaping_commands, stale_namespaces)
from .spec import (NODE_LINK, PREFIX, SUBNET, ClusterError, ClusterSpec, ClusterUnavailable, describe_compute,
                   parse_rate)
from .supervise import THREADS_ENV, Cluster, worker_command, worker_cpus, worker_env


def __getattr__(name: str) -> Any:
    """``unavailable_reason`` is read from ``host`` each time it is asked for, never copied here,
    so that a replacement there (tests/conftest.py) is what every caller gets."""
    if name == "unavailable_reason":
        return host.unavailable_reason
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CGROUP_ROOTS", "COMMAND_TIMEOUT", "CPU_PERIOD_US", "DESCRIPTION", "LINK_ENV", "NODE_LINK", "PREFIX", "SUBNET",
    "THREADS_ENV", "Cluster", "ClusterError", "ClusterSpec", "ClusterUnavailable", "CpuQuota", "LinkBytes",
    "add_arguments", "add_link_arguments", "cpu_controller", "describe_compute", "link_bytes", "list_namespaces",
    "main", "network_floor", "parse_netns_list", "parse_rate", "rate_arg", "remove_cgroups", "remove_namespaces",
    "setup_commands", "shaper_burst", "shaping_commands", "spec_from_args", "stale_cgroups", "stale_namespaces",
    "unavailable_reason", "worker_command", "worker_cpus", "worker_env",
]
