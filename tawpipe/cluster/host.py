"""Whether this host can build the emulated cluster, asked in one place.

Every caller (``Cluster.up``, ``tawpipe cluster run``, ``tawpipe bench cluster``, the tests' skip
marks) reads ``unavailable_reason`` from this module at the time it asks, directly or through
``tawpipe.cluster.unavailable_reason``, which forwards here: replacing it here (as
``tests/conftest.py`` does, so that tests change the host's network only when asked) reaches all.
"""

from __future__ import annotations

import os
import shutil

from .cgroups import CGROUP_ROOTS, cpu_controller
from .spec import ClusterSpec

_PROC_STATUS = "/proc/self/status"
# `ip link`/`tc` need CAP_NET_ADMIN; `ip netns add` (unshare, bind mount) needs CAP_SYS_ADMIN too
_CAPABILITIES = ((12, "CAP_NET_ADMIN"), (21, "CAP_SYS_ADMIN"))


def unavailable_reason(spec: ClusterSpec | None = None) -> str | None:
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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a launcher whose namespaces and cgroups are not stale)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
