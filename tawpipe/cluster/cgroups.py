"""Fixed compute: a cgroup per rank whose CPU quota is the rank's share of the machine, so time a
rank spends waiting is lost, as a GPU's is, instead of going to the other ranks on its core."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence

from .spec import RUN_NAME, ClusterSpec

CGROUP_ROOTS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup")  # v1 mounts, then v2
CPU_PERIOD_US = 10_000  # short, so a rank over its quota waits at most a few ms, not half of 100 ms


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

    A rank's process joins its cgroup (its pid into ``procs_file``) before it runs anything of its
    own: a command before it execs, a Python worker once it has imported what it runs (a device's
    time starts with its work, not with an interpreter's start, which took 10-16 s at a quarter
    core). Everything the rank runs from then on, gloo's threads included, shares the quota, as a
    GPU's compute and its copy engines share one device's time."""

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


def join(procs: str | int) -> None:
    """Move this process into a rank's cgroup: ``procs`` is its ``CpuQuota.procs_file``, or a
    descriptor open on it, which this closes (inside ``ip netns exec``, /sys has no cgroups)."""
    if isinstance(procs, str):
        _write(procs, str(os.getpid()))
        return
    try:
        os.write(procs, str(os.getpid()).encode())
    finally:
        os.close(procs)


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
    """This package's run cgroups whose launcher is no longer alive (all of them with ``everything``)."""
    controller = controller or cpu_controller()
    if controller is None:
        return []
    root = controller[0]
    return [os.path.join(root, d) for d in sorted(os.listdir(root))
            if (m := RUN_NAME.match(d)) and os.path.isdir(os.path.join(root, d))
            and (everything or not alive(int(m.group(1))))]
