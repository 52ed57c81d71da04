"""Starting ranks: a local emulated cluster (processes + gloo on this machine) or torchrun.

``run_local(fn, world_size, *args)`` starts one process per rank, joins them with gloo over
loopback and returns every rank's return value, so tests and the default ``tawpipe train`` run
a real multi-process job without a launcher. Under torchrun, ``init_distributed()`` reads the
environment.

A local job has no deadline: liveness is per wait (every wait of the engine times out after
``TAWPIPE_TIMEOUT`` seconds), so a job runs as long as it makes progress. It ends at its first
failure, which it names: a rank that died ("rank 3 died (SIGKILL)"), a rank that raised, or, when
a wait timed out, the rank the progress board (``tawpipe.runtime.progress``) shows stuck. Workers are
forked by a server that imported torch once (``workers``, shared by the launcher's jobs; they
get the launcher's environment and output as they are at each job's start), lead their own
process groups and die with the launcher (PR_SET_PDEATHSIG, through the server). A worker's stderr notes
whether it left a line open (a progress bar): the launcher ends that line before the job's end is
told, so that the message starts a line of its own. The store and gloo bind to loopback only.
Return values travel pickled to bytes by the standard pickler (tensors included: no shared memory
that the worker's exit could take away).

Stopping on request (preemption, Ctrl-C): a rank's loop asks ``stop_requested()`` at each
iteration boundary. Its first call arms handlers: from then on SIGTERM, and a first SIGINT, only
set the flag (a second SIGINT stops at once); before it, and in ranks that never ask, they end
the process as they always did. SIGINT, SIGTERM and SIGHUP to ``run_local``'s launcher are
forwarded to every worker as SIGTERM; the launcher waits up to ``grace`` seconds for them to end
by themselves, then stops what is left. When ranks returned it raises ``JobStopped`` (their
results); when none did (they never ask), it ends as the signal would have ended it. Under
torchrun the workers get torchrun's SIGTERM directly, and the same handlers apply.

Under torchrun, ``init_distributed()`` also makes an uncaught exception end the rank at once
after its traceback (exit code 1): left to the interpreter's exit, communication threads still
inside gloo were killed mid-call and aborted the process ("terminate called without an active
exception"). Before exiting, a rank that failed because of a peer names it: a peer that failed
first, or one whose heartbeat stopped (killed).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, TextIO

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401 - its reductions: tensors passed to workers go through shared memory

from . import progress
from .comm.base import CommTimeout
from .timeout import timeout_seconds
from .workers import Inherited, die_with_parent, start_context

LOOPBACK = "127.0.0.1"
_GRACE = 1.0  # after a first failure, how long to look for the rank that caused it
_STOP_WAIT = 2.0  # SIGTERM, then SIGKILL after this many seconds
GRACE_ENV = "TAWPIPE_GRACE"
DEFAULT_GRACE = 60.0  # after a stop request, how long the launcher waits for the workers to end
# Start-up, and the default process group, wait at least this long: ranks start at different
# speeds, and one that dies is seen at once anyway. The engine's own groups use the timeout.
_RENDEZVOUS_MIN = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what init_distributed reads


def missing_torchrun_env() -> list[str]:
    """The variables of ``TORCHRUN_ENV`` this process's environment lacks."""
    return [k for k in TORCHRUN_ENV if k not in os.environ]


def init_distributed(timeout: float | None = None, cpu: bool = False) -> torch.device:
    """Initialise torch.distributed from torchrun's environment; returns this rank's device
    (``cpu=True``: gloo on the CPU even where CUDA is available).

    Also publishes this rank's progress to the job's store, so that a rank whose wait times out
    can name the peer that holds it up (``tawpipe.runtime.progress``)."""
    if not dist.is_initialized():
        missing = missing_torchrun_env()
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
            timeout=timedelta(seconds=timeout_seconds(timeout)),
            **({"device_id": device} if use_cuda else {}),
        )
        _mirror_progress()
        _exit_at_once_on_failure()
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
    global _mirror
    _mirror = progress.StoreMirror(store, dist.get_rank(), dist.get_world_size(),
                                   attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT", "")).start()
    atexit.register(_mirror.end)  # before exit stops daemon threads mid-call (see StoreMirror.close)
    progress.install(dist.get_rank(), _mirror.local, 0, _mirror)
    progress.publish(progress.OUTSIDE)


_mirror: progress.StoreMirror | None = None


def _exit_at_once_on_failure() -> None:
    """Under torchrun: an uncaught exception prints its traceback, names the peer to blame when
    the error is about one, runs the atexit functions and ends the process with exit code 1 (by
    SIGINT for KeyboardInterrupt, as Python does), skipping the interpreter's finalization. That
    finalization killed communication threads still inside a gloo call when they came back for
    the GIL, which aborted the process ("terminate called without an active exception")."""
    previous, rank = sys.excepthook, dist.get_rank()
    if getattr(previous, "_tawpipe", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        try:
            previous(kind, value, tb)
            headline, _timed_out, about_a_peer = _classify(value)
            if about_a_peer:  # a broken connection or a timeout: say whose fault it is
                culprit = progress.blame_after_failure(within=progress.GONE_AFTER + 2.0)
                if culprit:
                    print(f"tawpipe: rank {rank}: {culprit}; this rank's error above follows from it",
                          file=sys.stderr, flush=True)
            if _mirror is not None:  # so that this rank's silence does not read as a death
                _mirror.end(("after a peer: " if about_a_peer else progress.FAILED) + headline)
                if _hosts_the_store(rank):  # ranks blocked on this one fail when it exits, the store with it
                    progress.linger_for_the_others(within=3 * _mirror.interval + 2.0)
        finally:
            _exit_now(1, interrupted=issubclass(kind, KeyboardInterrupt))

    hook._tawpipe = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _hosts_the_store(rank: int) -> bool:
    """Whether the job's TCPStore lives in this process: rank 0's, unless torchrun's agent hosts it."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"


def _exit_now(code: int, interrupted: bool = False) -> None:
    """End this process without the interpreter's finalization (see _exit_at_once_on_failure)."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: nothing more to say
                pass
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


# ------------------------------------------------------------------------- stopping on request

_stop_asked = False
_armed = _warned = False


def stop_requested(agree: bool = False) -> bool:
    """Whether this rank was asked to stop: by SIGTERM (the launcher's, torchrun's, a scheduler's
    preemption), or by a first SIGINT. Ask it at each iteration boundary, then save and return.

    The first call, on the main thread, arms the handlers; until then SIGTERM and SIGINT end the
    process as ever, so ranks that never ask are not waited for. A second SIGINT raises
    KeyboardInterrupt at once. ``agree=True`` is a collective (every rank calls it at the same
    point): every rank gets True if any rank was asked, so all stop at the same iteration (with
    the local flag alone a rank may stop one iteration early and leave its peers waiting). The
    answer is the all-reduced flag alone: a signal that lands after this rank sent its flag
    counts at the next call, on every rank."""
    global _stop_asked
    _arm_stop_handlers()
    if agree and dist.is_available() and dist.is_initialized():
        cuda = dist.get_backend() == "nccl"
        flag = torch.tensor([int(_stop_asked)], dtype=torch.int32,
                            device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        agreed = bool(flag.item())
        _stop_asked = _stop_asked or agreed
        return agreed
    return _stop_asked


def _arm_stop_handlers() -> None:
    global _armed, _warned
    if _armed:
        return
    if threading.current_thread() is not threading.main_thread():
        if not _warned:
            _warned = True
            warnings.warn("stop_requested() was first called on a thread other than the main one, where signal "
                          "handlers cannot be installed: SIGTERM and SIGINT still end this process at once",
                          RuntimeWarning, stacklevel=3)
        return
    _armed = True
    for sig, ours in ((signal.SIGTERM, (signal.SIG_DFL,)), (signal.SIGINT, (signal.SIG_DFL, signal.default_int_handler))):
        if signal.getsignal(sig) in ours:  # not one the program installed, nor an ignored one (nohup)
            signal.signal(sig, _on_stop_signal)


def _on_stop_signal(signum: int, _frame: Any) -> None:
    global _stop_asked
    if signum == signal.SIGINT and _stop_asked:
        raise KeyboardInterrupt  # a second Ctrl-C: stop now
    _stop_asked = True


def _loopback_interface() -> str | None:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


class JobFailed(RuntimeError):
    """A local job's first failure: ``rank`` and ``kind`` ("died", "stuck", "failed")."""

    def __init__(self, summary: str, rank: int, kind: str, details: str = "") -> None:
        super().__init__(summary + (f"\n{details}" if details else ""))
        self.summary, self.rank, self.kind = summary, rank, kind


class JobStopped(Exception):
    """A local job stopped on request: ``signal`` reached the launcher, which forwarded SIGTERM to
    every worker, and ranks returned. ``results[rank]`` is that rank's return value, None for
    ``missing`` ranks: those that did not end within the grace (killed), or died. Not a failure:
    a rank that raised while stopping makes a JobFailed instead."""

    def __init__(self, signum: int, results: list[Any], missing: list[int], grace: float) -> None:
        self.signal = signal.Signals(signum)
        self.results, self.missing = results, missing
        how = ("every rank returned" if not missing else
               f"rank(s) {missing} did not return within the {grace:g} s grace and were stopped")
        super().__init__(f"stopped on request ({self.signal.name}): {how}")

    @property
    def complete(self) -> bool:
        """Every rank returned."""
        return not self.missing


@dataclass
class _Report:
    ok: bool
    value: Any  # the return value, or the error's traceback
    headline: str = ""  # "Type: message", first line
    timed_out: bool = False  # a wait timed out
    about_a_peer: bool = False  # ... or a connection to a peer broke: the cause may lie elsewhere


_PEER_TROUBLE = ("connection reset by peer", "connection closed by peer", "broken pipe", "timed out")


def _classify(e: BaseException) -> tuple[str, bool, bool]:
    """(headline, a wait timed out, the error is about a peer) of an error and its causes."""
    chain, cause = [], e
    while cause is not None and len(chain) < 20:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    timed_out = any(isinstance(c, CommTimeout) or "timed out" in str(c).lower() for c in chain)
    peer = timed_out or any(isinstance(c, dist.DistError) or getattr(c, "about_a_peer", False)
                            or any(t in str(c).lower() for t in _PEER_TROUBLE) for c in chain)
    return f"{type(e).__name__}: {e}".splitlines()[0], timed_out, peer


def _failure(e: BaseException) -> _Report:
    """The report of the error being handled."""
    headline, timed_out, peer = _classify(e)
    return _Report(False, traceback.format_exc(), headline, timed_out, peer)


def _pickled(report: _Report) -> bytes:
    """The standard pickler, not multiprocessing's: torch registers reductions there that move
    tensors to shared memory handed over by the sender's process, which may have exited by the
    time the launcher reads ("rank 2 exited with code 0 before returning")."""
    return pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)


class _LineEnds:
    """A worker's stderr that notes, in a byte the job shares, whether what was written last left
    its line open: a progress bar (tqdm) ends its line only when it closes, and a rank killed
    mid-bar never does, so the launcher's "rank 0 died (SIGKILL)" was printed at the end of the
    bar. The launcher ends that line first (``_LocalJob.end_open_line``)."""

    def __init__(self, stream: TextIO, line_open: Any) -> None:
        self._stream, self._open = stream, line_open

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        if text:
            self._open.value = int(not text.endswith("\n"))
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _worker(rank: int, world_size: int, parent: int, port: int, timeout: float, board: Any, line_open: Any,
            launcher: Inherited, conn: Connection, fn: Callable, args: tuple) -> None:
    die_with_parent(parent)
    launcher.restore()
    if sys.stderr is not None:
        sys.stderr = _LineEnds(sys.stderr, line_open)
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
        # every rank done connecting before any runs fn: a rank whose fn returns at once and exits
        # broke the connections a slower peer was still making ("Gloo connectFullMesh failed")
        dist.barrier()
        progress.publish(progress.OUTSIDE)
        value = fn(rank, *args)
        try:
            report = _pickled(_Report(True, value))
        except Exception as e:  # noqa: BLE001 - e.g. a lambda, an open file
            raise TypeError(f"rank {rank}'s return value cannot be pickled for the launcher: "
                            f"{type(e).__name__}: {e}") from e
        conn.send_bytes(report)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher, which ends the job
        try:
            conn.send_bytes(_pickled(_failure(e)))
        finally:
            os._exit(1)  # not a clean exit: channel threads may sit in a transfer
    if dist.is_initialized():
        dist.destroy_process_group()


class _LocalJob:
    """The launcher's side of a local job: processes, their reports, the board, and stopping."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world, self.timeout = world_size, timeout
        self.ctx = start_context()
        self.board_buffer = self.ctx.RawArray("b", progress.Board.nbytes(world_size))
        self.board = progress.Board(self.board_buffer, world_size)
        self.line_open = self.ctx.RawValue("b", 0)  # a worker left a line open on stderr (``_LineEnds``)
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
        self.groups: set[int] = set()  # workers seen leading their process group

    def start(self, fn: Callable, args: tuple) -> None:
        for rank in range(self.world):
            reader, writer = self.ctx.Pipe(duplex=False)
            p = self.ctx.Process(
                target=_worker, name=f"tawpipe-rank{rank}",
                args=(rank, self.world, os.getpid(), self.port, self.timeout, self.board_buffer, self.line_open,
                      Inherited(), writer, fn, args),
            )
            p.start()
            writer.close()
            self.procs.append(p)
            self.readers[reader] = rank

    def wait(self, signals: "_Signals") -> list[Any]:
        """Every rank's return value, or JobFailed at the first failure, or _Stop at a stop signal."""
        failed_at: float | None = None
        board: list[progress.Entry] = []
        while failed_at is not None or len(self.reports) < self.world:
            if signals.first is not None:
                raise _Stop(signals.first)
            self._collect(0.2)
            if failed_at is None and (self._dead() or any(not r.ok for r in self.reports.values())
                                      or self._overdue() is not None):
                failed_at = time.monotonic()
                board = self.board.entries()  # before the others notice and move on
            if failed_at is not None and time.monotonic() - failed_at >= _GRACE:
                raise self._diagnose(board)
        return [self.reports[r].value for r in range(self.world)]

    def _collect(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a report or an exit; read the reports that came."""
        pending = [r for r, rank in self.readers.items() if rank not in self.reports]
        running = [p.sentinel for rank, p in enumerate(self.procs) if rank not in self.reports and p.exitcode is None]
        for r in wait(pending + running, timeout=timeout):
            if r not in self.readers:
                continue
            rank = self.readers[r]
            try:
                data = r.recv_bytes()
            except (EOFError, OSError):  # died before or while sending: seen as a dead rank
                self.readers.pop(r)
                continue
            try:
                self.reports[rank] = pickle.loads(data)
            except Exception as e:  # noqa: BLE001 - a class the launcher cannot import, ...
                self.reports[rank] = _Report(False, traceback.format_exc(),
                                             f"its return value cannot be unpickled in the launcher: {type(e).__name__}: {e}")

    def stop_on_request(self, signum: int, grace: float, signals: "_Signals") -> None:
        """Forward SIGTERM to every running worker (the process, not its group: its children are its
        own business) and wait up to ``grace`` s (less at a second SIGINT) for each to report or
        end; then stop what is left. Raises JobStopped when ranks returned, JobFailed when one
        raised meanwhile; returns when none returned (they did not ask: the signal ended them)."""
        name = signal.Signals(signum).name
        for rank, p in enumerate(self.procs):
            if rank not in self.reports and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    if os.getpgid(p.pid) == p.pid:  # for stop(), after the worker is gone
                        self.groups.add(p.pid)
                    os.kill(p.pid, signal.SIGTERM)
        t0, told = time.monotonic(), False
        while not signals.again and time.monotonic() - t0 < grace:
            if all(rank in self.reports or p.exitcode is not None for rank, p in enumerate(self.procs)):
                break
            if not told and time.monotonic() - t0 >= 1.0:
                self.say(f"{name}: asked the local job's {self.world} workers to stop; waiting up to {grace:g} s "
                         f"for them to end by themselves ({'Ctrl-C again' if signum == signal.SIGINT else 'SIGINT'} "
                         "stops them now)")
                told = True
            self._collect(0.2)
        doing = {e.rank: e for e in self.board.entries()}
        for rank, p in enumerate(self.procs):  # what a rank still running was at: the likeliest hang
            if rank not in self.reports and p.exitcode is None and rank in doing:
                self.say(f"{name}: {progress.stuck(doing[rank])} when stopped")
        self.stop()
        self._collect(0.0)  # a report sent at the last moment
        returned = [r for r in range(self.world) if r in self.reports and self.reports[r].ok]
        self.say(f"{name}: stopped the local job's {self.world} workers"
                 + (f" ({len(returned)} of them returned)" if returned else ""))
        failures = [(r, self.reports[r]) for r in sorted(self.reports) if not self.reports[r].ok]
        if failures:  # its own error first, as in _diagnose
            rank, report = next(((r, rep) for r, rep in failures if not rep.about_a_peer), failures[0])
            raise JobFailed(f"rank {rank} failed while stopping on {name}: {report.headline}", rank, "failed",
                            f"traceback of rank {rank}:\n{report.value}")
        if returned:
            raise JobStopped(signum, [self.reports[r].value if r in returned else None for r in range(self.world)],
                             [r for r in range(self.world) if r not in returned], grace)

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
            for pid in self.groups - {p.pid for p in alive}:  # a worker gone, its children maybe not
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, sig)
            deadline = time.monotonic() + wait_s
            for p in alive:
                p.join(max(0.0, deadline - time.monotonic()))

    def end_open_line(self) -> None:
        """End the line a worker left open on stderr (a progress bar), so that what is printed next
        starts a line of its own."""
        if self.line_open.value:
            self.line_open.value = 0
            print(file=sys.stderr, flush=True)

    def say(self, message: str) -> None:
        """A launcher message on a line of its own, after a newline whether or not a worker left
        one open: Ctrl-C echoes ^C on the terminal's line, which no process sees."""
        print(f"\ntawpipe: {message}", file=sys.stderr, flush=True)
        self.line_open.value = 0

    def close(self) -> None:
        for r in self.readers:
            r.close()
        del self.store


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:  # the worker leads its group (it set that up first thing)
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


class _Stop(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """SIGINT, SIGTERM and SIGHUP to the launcher, noted for the job's loop to act on. A SIGINT
    ignored because the job was started in the background is taken over too; a SIGTERM or SIGHUP
    ignored on purpose (nohup) is not, nor a handler the caller installed. Only possible on the
    main thread. After the first signal, a SIGINT (Ctrl-C again) cuts the grace short; repeats of
    SIGTERM and SIGHUP are ignored (timeout(1) signals the launcher, then its whole group)."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.again = False
        self.old: dict[int, Any] = {}

    def install(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for sig, ours in ((signal.SIGINT, (signal.SIG_DFL, signal.SIG_IGN, signal.default_int_handler)),
                              (signal.SIGTERM, (signal.SIG_DFL,)), (signal.SIGHUP, (signal.SIG_DFL,))):
                if signal.getsignal(sig) in ours:
                    self.old[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, _frame: Any) -> None:
        if self.first is None:
            self.first = signum
        elif signum == signal.SIGINT:
            self.again = True

    def restore(self) -> None:
        for sig, handler in self.old.items():
            signal.signal(sig, handler)
        self.old = {}


def grace_seconds(grace: float | None = None) -> float:
    """``grace``, else ``TAWPIPE_GRACE``, else 60 s: how long a stopped job's workers may take."""
    if grace is None:
        text = os.environ.get(GRACE_ENV, "")
        try:
            grace = float(text) if text.strip() else DEFAULT_GRACE
        except ValueError:
            raise ValueError(f"{GRACE_ENV}={text!r} is not a number of seconds") from None
    if not grace >= 0:
        raise ValueError(f"the grace period must be >= 0 seconds, got {grace}")
    return float(grace)


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None,
              grace: float | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` local CPU processes joined by gloo; every rank's
    return value (pickled: CPU tensors, lists, dicts, ...).

    ``fn`` must be importable (module level). ``timeout`` (default ``TAWPIPE_TIMEOUT``, 300 s)
    bounds every wait, not the job: the workers see it as ``TAWPIPE_TIMEOUT``. Raises JobFailed
    naming the first failure.

    SIGINT, SIGTERM or SIGHUP to this process is forwarded to every worker as SIGTERM, and the
    workers get up to ``grace`` seconds (default ``TAWPIPE_GRACE``, else 60) to end by
    themselves: ranks that check ``stop_requested()`` stop at an iteration boundary and return.
    Then what is left is stopped, and:

    * ranks returned: JobStopped (``.signal``, ``.results``, ``.missing``), which a training tool
      reports as stopped on request (e.g. exit status 128 + the signal) after saving;
    * a rank raised meanwhile: JobFailed (``... (while stopping on SIGTERM)``);
    * none returned (they do not check: the SIGTERM ended them): as before, the signal takes its
      course: KeyboardInterrupt for SIGINT, else the process ends by the signal.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_local: world_size must be an integer >= 1 (the number of ranks), got {world_size!r}")
    timeout = timeout_seconds(timeout)
    grace = grace_seconds(grace)
    job = _LocalJob(world_size, timeout)
    signals = _Signals().install()
    try:
        job.start(fn, args)
        return job.wait(signals)
    except _Stop as s:
        job.stop_on_request(s.signum, grace, signals)  # raises JobStopped or JobFailed where ranks reported
        signals.restore()
        if s.signum == signal.SIGINT:
            raise KeyboardInterrupt from None
        signal.raise_signal(s.signum)  # its previous disposition now: usually, to end this process
        raise SystemExit(128 + s.signum) from None
    finally:
        job.stop()
        job.end_open_line()  # before the caller's message of how the job ended
        job.close()
        signals.restore()
