"""The ranks of an emulated cluster: started inside their node's namespace with torchrun's
environment, watched with a timeout, and killed with everything the cluster built on exit, error
or signal (workers also die with the launcher: PR_SET_PDEATHSIG, plus a process-group kill)."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from ..atomic import write_atomic
from ..runtime.workers import die_with_parent
from . import cgroups, host
from .cgroups import CpuQuota, cpu_controller, remove_cgroups, stale_cgroups
from .counters import LINK_ENV, LinkBytes, node_link_bytes
from .netns import list_namespaces, remove_namespaces, run_ip, setup_commands, shaping_commands, stale_namespaces
from .spec import NODE_LINK, ClusterError, ClusterSpec, ClusterUnavailable

THREADS_ENV = "TAWPIPE_CLUSTER_THREADS"  # set for workers: torch's thread count to match the quota
# the folder that holds the tawpipe package: first on the workers' PYTHONPATH
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BOOT = ("import sys; from tawpipe.cluster.supervise import _worker_main; "
         "_worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))")


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


def _prepare_worker(parent: int, cpus: set[int] | None, cgroup_procs: str | None = None) -> Callable[[], None]:
    """A preexec_fn: PR_SET_PDEATHSIG, the CPU affinity and the rank's cgroup (its CPU quota)
    survive the exec of ip and python."""

    def prepare() -> None:
        if cgroup_procs is not None:
            cgroups.join(cgroup_procs)
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


def sweep(everything: bool = False) -> tuple[int, int, list[str]]:
    """Remove the namespaces and cgroups of clusters whose launcher is gone (a SIGKILL leaves them;
    ``everything``: of every cluster): (namespaces removed, cgroups removed, the errors met)."""
    names = stale_namespaces(list_namespaces(), host.pid_alive, everything=everything)
    errors = remove_namespaces(names)
    groups = stale_cgroups(host.pid_alive, everything=everything)
    group_errors = remove_cgroups(groups)
    return len(names) - len(errors), len(groups) - len(group_errors), errors + group_errors


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
        reason = host.unavailable_reason(self.spec)
        if reason:
            raise ClusterUnavailable(reason)
        namespaces, groups, _ = sweep()  # what killed launchers left: never clashing with ours, but piling up
        if namespaces or groups:  # an error is left for `tawpipe cluster down` to report
            print(f"tawpipe cluster: removed {namespaces} namespace(s) and {groups} cgroup(s) left by launchers "
                  "that were killed", file=sys.stderr)
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
                run_ip(cmd)
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
            run_ip(cmd)
        try:
            yield
        finally:
            for cmd in shaping_commands(self.spec):
                run_ip(cmd)

    def link_bytes(self) -> list[LinkBytes]:
        """Per node, the bytes it sent and received over its link so far (bridge-side counters)."""
        return node_link_bytes(self.spec)

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
                write_atomic(task, pickle.dumps({"sys_path": list(sys.path), "out": tmp, "timeout": timeout,
                                                 "payload": pickle.dumps({"fn": target, "args": args})}))
                argv = [sys.executable, "-c", _BOOT, task]
            else:
                argv = list(target)
            env_base = dict(os.environ)
            env_base["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env_base.get("PYTHONPATH")]))
            logs = []
            for rank in range(self.spec.world_size):
                log = None if not quiet else open(os.path.join(tmp, f"rank{rank}.log"), "wb")
                logs.append(log)
                # a Python worker joins its rank's cgroup itself once it has imported what it runs, through
                # a descriptor (``ip netns exec`` mounts another /sys); a command joins before it execs
                procs = self._quota.procs_file(rank) if self._quota else None
                procs_fd = os.open(procs, os.O_WRONLY) if procs and callable(target) else -1
                try:
                    self._procs.append(subprocess.Popen(
                        worker_command(self.spec, rank, [*argv, str(rank), str(procs_fd)] if callable(target) else argv),
                        env=worker_env(self.spec, rank, self._port, env_base), stdout=log,
                        stderr=subprocess.STDOUT if log else None, stdin=subprocess.DEVNULL, start_new_session=True,
                        pass_fds=(procs_fd,) if procs_fd >= 0 else (),
                        preexec_fn=_prepare_worker(os.getpid(), worker_cpus(self.spec, rank),
                                                   procs if procs_fd < 0 else None),
                    ))
                finally:
                    if procs_fd >= 0:
                        os.close(procs_fd)
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


def _worker_main(task_path: str, rank: int, procs_fd: int) -> NoReturn:
    """Entry point of a Python worker. It ends with ``os._exit`` once its result and output are
    out, as multiprocessing's workers do: an interpreter's orderly exit with torch loaded took
    1.2-1.5 s of CPU, 6 s at a quarter core."""
    code = _work(task_path, rank, procs_fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _work(task_path: str, rank: int, procs_fd: int) -> int:
    """Join the rank's cgroup (``procs_fd``, -1: none) once the imports are done, initialise
    torch.distributed, run, write the result; the exit code."""
    faulthandler.enable(all_threads=True)  # a native crash leaves every thread's Python stack in the log
    with open(task_path, "rb") as f:
        outer = pickle.load(f)
    out = outer["out"]
    try:
        sys.path[:0] = [p for p in outer["sys_path"] if p not in sys.path]  # before unpickling fn
        task = pickle.loads(outer["payload"])
        import torch
        import torch._dynamo  # noqa: F401 - imported by torch on an optimizer's first step (runtime/fork_server.py)
        import torch.distributed as dist

        from ..runtime.launch import init_distributed

        if procs_fd >= 0:  # the rank's CPU quota from here: starting took 10-16 s at a quarter core
            cgroups.join(procs_fd)
        torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
        init_distributed(timeout=outer["timeout"])
        try:
            value = task["fn"](rank, *task["args"])
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        write_atomic(os.path.join(out, f"result{rank}.json"), json.dumps(value))
        return 0
    except BaseException:  # noqa: BLE001 - reported to the launcher
        write_atomic(os.path.join(out, f"error{rank}.txt"), traceback.format_exc())
        return 1
