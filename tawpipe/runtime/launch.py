"""Starting ranks: a local emulated cluster (processes + gloo on this machine) or torchrun.

``run_local(fn, world_size, *args)`` spawns one process per rank, joins them with gloo over
loopback and returns every rank's return value, so tests and the default ``tawpipe train`` run
a real multi-process job without a launcher. Under torchrun, ``init_distributed()`` reads the
environment.

A local job has no deadline: liveness is per wait (every wait of the engine times out after
``TAWPIPE_TIMEOUT`` seconds), so a job runs as long as it makes progress. It ends at its first
failure, which it names: a rank that died ("rank 3 died (SIGKILL)"), a rank that raised, or, when
a wait timed out, the rank the progress board (``tawpipe.runtime.progress``) shows stuck. Workers lead
their own process groups and die with the launcher (PR_SET_PDEATHSIG); SIGINT, SIGTERM and
SIGHUP to the launcher stop them all before it exits. The store and gloo bind to loopback only.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import progress
from .comm.base import CommTimeout
from .timeout import default_timeout

LOOPBACK = "127.0.0.1"
_GRACE = 1.0  # after a first failure, how long to look for the rank that caused it
_STOP_WAIT = 2.0  # SIGTERM, then SIGKILL after this many seconds
# Start-up, and the default process group, wait at least this long: ranks start at different
# speeds, and one that dies is seen at once anyway. The engine's own groups use the timeout.
_RENDEZVOUS_MIN = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def init_distributed(timeout: float | None = None, cpu: bool = False) -> torch.device:
    """Initialise torch.distributed from torchrun's environment; returns this rank's device
    (``cpu=True``: gloo on the CPU even where CUDA is available).

    Also publishes this rank's progress to the job's store, so that a rank whose wait times out
    can name the peer that holds it up (``tawpipe.runtime.progress``)."""
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"environment lacks {', '.join(missing)}: start with torchrun, or use "
                "tawpipe.runtime.launch.run_local for a local emulated cluster"
            )
        use_cuda = torch.cuda.is_available() and not cpu
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            timeout=timedelta(seconds=timeout or default_timeout()),
            **({"device_id": device} if use_cuda else {}),
        )
        _mirror_progress()
    if dist.get_backend() != "gloo":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _mirror_progress() -> None:
    """Publish this rank's progress to the job's store (best effort: without it, a timeout just
    cannot name the peer to blame)."""
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=10), wait_for_workers=False)
    except (RuntimeError, ValueError):
        return
    mirror = progress.StoreMirror(store, dist.get_rank(), dist.get_world_size()).start()
    atexit.register(mirror.close)  # before exit stops daemon threads mid-call (see StoreMirror.close)
    progress.install(dist.get_rank(), mirror.local, 0, mirror)
    progress.publish(progress.OUTSIDE)


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG), and exit now
    if the parent is already gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:
        os._exit(1)


def _loopback_interface() -> str | None:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


class JobFailed(RuntimeError):
    """A local job's first failure: ``rank`` and ``kind`` ("died", "stuck", "failed")."""

    def __init__(self, summary: str, rank: int, kind: str, details: str = "") -> None:
        super().__init__(summary + (f"\n{details}" if details else ""))
        self.summary, self.rank, self.kind = summary, rank, kind


@dataclass
class _Report:
    ok: bool
    value: Any  # the return value, or the error's traceback
    headline: str = ""  # "Type: message", first line
    timed_out: bool = False  # a wait timed out
    about_a_peer: bool = False  # ... or a connection to a peer broke: the cause may lie elsewhere


_PEER_TROUBLE = ("connection reset by peer", "connection closed by peer", "broken pipe", "timed out")


def _failure(e: BaseException) -> _Report:
    chain, cause = [], e
    while cause is not None and len(chain) < 20:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    timed_out = any(isinstance(c, CommTimeout) or "timed out" in str(c).lower() for c in chain)
    peer = timed_out or any(isinstance(c, dist.DistError) or getattr(c, "about_a_peer", False)
                            or any(t in str(c).lower() for t in _PEER_TROUBLE) for c in chain)
    headline = f"{type(e).__name__}: {e}".splitlines()[0]
    return _Report(False, traceback.format_exc(), headline, timed_out, peer)


def _worker(rank: int, world_size: int, parent: int, port: int, timeout: float, board: Any,
            conn: Connection, fn: Callable, args: tuple) -> None:
    die_with_parent(parent)
    faulthandler.enable(all_threads=True)  # a native crash leaves every thread's Python stack in stderr
    os.setpgid(0, 0)  # lead a process group: the launcher stops this rank and its children at once
    env = dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR=LOOPBACK,
               MASTER_PORT=str(port), TAWPIPE_TIMEOUT=str(timeout))
    if (lo := _loopback_interface()) is not None:
        env["GLOO_SOCKET_IFNAME"] = lo
    os.environ.update(env)
    torch.set_num_threads(1)
    shared = progress.Board(board, world_size)
    progress.install(rank, shared, rank, shared)
    progress.publish("start-up (joining the job)")
    try:
        store = dist.TCPStore(LOOPBACK, port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=max(timeout, _RENDEZVOUS_MIN)))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=max(timeout, _RENDEZVOUS_MIN)))
        progress.publish(progress.OUTSIDE)
        conn.send(_Report(True, fn(rank, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which ends the job
        try:
            conn.send(_failure(e))
        finally:
            os._exit(1)  # not a clean exit: channel threads may sit in a transfer
    if dist.is_initialized():
        dist.destroy_process_group()


class _LocalJob:
    """The launcher's side of a local job: processes, their reports, the board, and stopping."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world, self.timeout = world_size, timeout
        self.ctx = mp.get_context("spawn")
        self.board_buffer = self.ctx.RawArray("b", progress.Board.nbytes(world_size))
        self.board = progress.Board(self.board_buffer, world_size)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((LOOPBACK, 0))  # the store listens on loopback only
        listener.listen(max(128, 2 * world_size))
        self.port = listener.getsockname()[1]
        self.store = dist.TCPStore(LOOPBACK, self.port, is_master=True, wait_for_workers=False,
                                   master_listen_fd=listener.detach(),
                                   timeout=timedelta(seconds=max(timeout, _RENDEZVOUS_MIN)))
        self.procs: list[Any] = []
        self.readers: dict[Connection, int] = {}
        self.reports: dict[int, _Report] = {}

    def start(self, fn: Callable, args: tuple) -> None:
        for rank in range(self.world):
            reader, writer = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(
                target=_worker, name=f"tawpipe-rank{rank}",
                args=(rank, self.world, os.getpid(), self.port, self.timeout, self.board_buffer, writer, fn, args),
            )
            p.start()
            writer.close()
            self.procs.append(p)
            self.readers[reader] = rank

    def wait(self) -> list[Any]:
        """Every rank's return value, or JobFailed at the first failure."""
        failed_at: float | None = None
        board: list[progress.Entry] = []
        while failed_at is not None or len(self.reports) < self.world:
            pending = [r for r, rank in self.readers.items() if rank not in self.reports]
            sentinels = [p.sentinel for rank, p in enumerate(self.procs) if rank not in self.reports]
            ready = wait(pending + sentinels, timeout=0.2 if failed_at else 1.0)
            for r in (x for x in ready if x in self.readers):
                try:
                    self.reports[self.readers[r]] = r.recv()
                except (EOFError, OSError):  # died while sending: seen below as a dead rank
                    self.readers.pop(r)
            if failed_at is None and (self._dead() or any(not r.ok for r in self.reports.values())
                                      or self._overdue() is not None):
                failed_at = time.monotonic()
                board = self.board.entries()  # before the others notice and move on
            if failed_at is not None and time.monotonic() - failed_at >= _GRACE:
                raise self._diagnose(board)
        return [self.reports[r].value for r in range(self.world)]

    def _dead(self) -> list[int]:
        """Ranks that exited without a report (in rank order)."""
        return [r for r, p in enumerate(self.procs) if r not in self.reports and p.exitcode is not None]

    def _overdue(self) -> progress.Entry | None:
        """A wait past its timeout (plus slack): its rank should have reported by now."""
        return next((e for e in self.board.entries()
                     if e.waiting and e.rank not in self.reports and e.age > e.limit + 5.0), None)

    def _diagnose(self, board: list[progress.Entry]) -> JobFailed:
        dead = self._dead()
        if dead:  # the likeliest cause: its peers' errors follow from it
            r, code = dead[0], self.procs[dead[0]].exitcode
            how = f"died ({signal.Signals(-code).name})" if code < 0 else f"exited with code {code}"
            return JobFailed(f"rank {r} {how} before returning", r, "died")
        failures = [(r, rep) for r, rep in self.reports.items() if not rep.ok]
        own = [(r, rep) for r, rep in failures if not rep.about_a_peer]
        if own:  # an error of its own, not a broken connection or a timeout caused elsewhere
            return self._failed(*own[0])
        overdue = self._overdue()
        if overdue is not None:  # its wait should have raised long ago: that process is frozen
            return JobFailed(progress.stuck(overdue), overdue.rank, "stuck",
                             f"rank {overdue.rank} is past its wait's timeout ({overdue.limit:.0f} s) without failing")
        timed_out = [(r, rep) for r, rep in failures if rep.timed_out]
        if timed_out:
            waiter, report = timed_out[0]
            culprit = progress.suspect(board, exclude={waiter}, min_age=self.timeout / 2)
            if culprit is not None:
                return JobFailed(progress.stuck(culprit), culprit.rank, "stuck", f"rank {waiter}: {report.headline}")
        return self._failed(*failures[0])

    @staticmethod
    def _failed(rank: int, report: _Report) -> JobFailed:
        return JobFailed(f"rank {rank} failed: {report.headline}", rank, "failed",
                         f"traceback of rank {rank}:\n{report.value}")

    def stop(self) -> None:
        """SIGTERM every worker's process group, SIGKILL what is left after a moment, reap all."""
        for sig, wait_s in ((signal.SIGTERM, _STOP_WAIT), (signal.SIGKILL, 5.0)):
            alive = [p for p in self.procs if p.exitcode is None]
            for p in alive:
                _signal_group(p.pid, sig)
            deadline = time.monotonic() + wait_s
            for p in alive:
                p.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        for r in self.readers:
            r.close()
        del self.store


def _signal_group(pid: int, sig: int) -> None:
    try:
        if os.getpgid(pid) == pid:  # the worker leads its group (it set that up first thing)
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


class _Stop(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _install_stop_handlers() -> dict[int, Any]:
    """SIGINT, SIGTERM and SIGHUP stop the job. A SIGINT ignored because the job was started in
    the background is taken over too; a SIGTERM or SIGHUP ignored on purpose (nohup) is not, nor
    a handler the caller installed. Only possible on the main thread. Returns the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum: int, _frame: Any) -> None:
        raise _Stop(signum)

    old = {}
    for sig, ours in ((signal.SIGINT, (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler)),
                      (signal.SIGTERM, (signal.SIG_DFL,)), (signal.SIGHUP, (signal.SIG_DFL,))):
        if signal.getsignal(sig) in ours:
            old[sig] = signal.signal(sig, stop)
    return old


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` local CPU processes joined by gloo.

    ``fn`` must be importable (module level). ``timeout`` (default ``TAWPIPE_TIMEOUT``, 300 s)
    bounds every wait, not the job: the workers see it as ``TAWPIPE_TIMEOUT``. Raises JobFailed
    naming the first failure; a signal to the launcher stops every worker, then takes its course.
    """
    timeout = float(timeout or default_timeout())
    job = _LocalJob(world_size, timeout)
    handlers = _install_stop_handlers()
    try:
        job.start(fn, args)
        return job.wait()
    except _Stop as s:
        for sig in handlers:  # a repeat must not cut the stop short (timeout(1) signals the whole group)
            signal.signal(sig, signal.SIG_IGN)
        job.stop()
        name = signal.Signals(s.signum).name
        print(f"tawpipe: {name}: stopped the local job's {world_size} workers", file=sys.stderr)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        handlers = {}
        if s.signum == signal.SIGINT:
            raise KeyboardInterrupt from None
        signal.raise_signal(s.signum)  # its previous disposition now: usually, to end this process
        raise SystemExit(128 + s.signum) from None
    finally:
        job.stop()
        job.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
