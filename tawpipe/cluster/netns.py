"""The cluster's network: a namespace per node, a veth from each to a bridge in a namespace of its
own, and a tc shaper on both ends of every veth; built, unshaped and removed with ``ip`` and ``tc``.

Traffic between nodes crosses two rate-limited veths and the bridge; traffic inside a node goes to
a local address and therefore over loopback, never the veth.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Sequence

from .spec import NAMESPACE_NAME, NODE_LINK, ClusterError, ClusterSpec, shaper_burst

COMMAND_TIMEOUT = 30.0  # seconds for one ip/tc invocation


def run_ip(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run one ``ip``/``tc`` command, bounded by ``COMMAND_TIMEOUT``; ClusterError when it fails
    (with ``check``) or does not answer."""
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{' '.join(cmd)}: no answer within {COMMAND_TIMEOUT:.0f} s") from None
    if check and r.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed (exit {r.returncode}): {r.stderr.strip()}")
    return r


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
        [*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "bfifo", "limit", str(spec.queue_bytes)],
        # IPv4 total length (bytes 2-3 of the header) below 128
        [*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
         "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", "1:10"],
    ]


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
    out = run_ip(["ip", "netns", "list"], check=False).stdout
    return parse_netns_list(out)


def parse_netns_list(text: str) -> list[str]:
    """Names from ``ip netns list`` output ("name (id: 3)" or "name" per line)."""
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def stale_namespaces(names: Sequence[str], alive: Callable[[int], bool], everything: bool = False) -> list[str]:
    """This package's namespaces whose launcher is no longer alive (all of them with ``everything``)."""
    out = []
    for name in names:
        m = NAMESPACE_NAME.match(name)
        if m and (everything or not alive(int(m.group(1)))):
            out.append(name)
    return out


def remove_namespaces(names: Sequence[str]) -> list[str]:
    """Kill every process inside each namespace, then delete it; returns the errors met."""
    errors = []
    for ns in names:
        pids = run_ip(["ip", "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        r = run_ip(["ip", "netns", "del", ns], check=False)
        if r.returncode != 0:
            errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
    return errors
