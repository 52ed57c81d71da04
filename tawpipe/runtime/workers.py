"""How a local job's workers start (``launch.run_local``): forked by a server that imported torch
once, given what they would have inherited from the launcher, and dying with it.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections.abc import Sequence
from multiprocessing import reduction
from typing import Any


def die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG), and exit now
    if ``parent`` is already gone. ``parent`` may also be the parent's parent: a local job's
    workers are forked by a server that ends when its launcher does (``start_context``)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if parent not in (os.getppid(), parent_of(os.getppid())):
        os._exit(1)


def parent_of(pid: int) -> int | None:
    """``pid``'s parent, from /proc (None where there is no /proc or ``pid`` is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state": the parent


class Inherited:
    """What a worker would inherit from its launcher if the launcher started it: the environment
    and the standard output and error as they are now. A worker forked by the fork server
    inherits the server's, which are the launcher's when the server started (this process's first
    job): a later job run with another environment, or with its output redirected (pytest's
    capture, a log file), would not see it."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.fds = [fd for fd in (1, 2) if _is_open(fd)]

    def __getstate__(self) -> tuple:
        # pickled as the worker starts: each descriptor travels with it (a DupFd made now)
        return self.environ, {fd: reduction.DupFd(fd) for fd in self.fds}

    def __setstate__(self, state: tuple) -> None:
        self.environ, self.streams = state

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        for fd, dup in self.streams.items():
            os.dup2(dup.detach(), fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def start_context(preload: Sequence[str] = ()) -> Any:
    """multiprocessing's fork server, which has imported torch once (``fork_server``), the parts
    of tawpipe this process has imported and the modules ``preload`` names, not spawn: a spawned
    worker is a new interpreter that imports torch again (2-3 s of CPU each: 4 ranks on 2 cores
    waited 10 s to start), which dominated short jobs and a test run of many. The server is started
    by this process's first job (or by ``start_server``, before it) and shared by its later ones.
    Only the main thread starts it: a parent's death signal follows the thread that started the
    child, and a server that died with a finished thread would take later jobs' workers with it."""
    if "forkserver" not in mp.get_all_start_methods() or threading.current_thread() is not threading.main_thread():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # what this process has of tawpipe is what its workers run (the engine, a model, the training
    # loop), which each of them would import again
    ours = sorted(name for name in sys.modules if name.startswith("tawpipe."))
    ctx.set_forkserver_preload(["tawpipe.runtime.fork_server", *ours, *(m for m in preload if m not in ours)])
    return ctx


def start_server(preload: Sequence[str] = ()) -> None:
    """Start the fork server now, with what this process has imported so far and the modules
    ``preload`` names (what its workers will run), so that its imports (torch's, 4-5 s of CPU)
    overlap what this process does before its first job (``tawpipe train``'s own imports and
    checks) instead of following it. Needs no torch here. A refused run loses nothing: the server
    dies with this process from its first line (``fork_server``)."""
    ctx = start_context(preload)
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
