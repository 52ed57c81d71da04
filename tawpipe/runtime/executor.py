"""Runs a rank's action list: the engine's execution model (design §5).

The calling thread walks the list in order. Compute units run on it; communication units go to
their channel (``plan.OPS[op].channel``), an in-order queue on its own thread (and CUDA stream),
so they overlap compute. Where the backend matches messages by tag whatever the order they are
posted in (gloo), point-to-point units skip the queue: each is posted the moment its own
dependencies are done, so no transfer waits behind an unrelated one (design §5.2). Every unit
first waits for the dataflow dependencies ``plan.Hazards`` derives from the names it reads and
writes; that is the only ordering there is, and it gives every action the inputs it would see if
the list ran one action at a time (design §5.1).

[Note: dataflow order] Exactness does not depend on timing. A unit waits for the last earlier
unit that writes a name it reads (read after write), and for every earlier unit that reads or
writes a name it writes (write after read, write after write): a staging buffer is refilled
only once the compute that reads it is done, and a gradient is routed only once its backward
has written it. So however the channels and the compute thread interleave, each action sees what
it would see in list order, and ``verify`` proves that list order correct and deadlock-free.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..atomic import write_atomic
from ..plan.actions import OPS, QUEUES, Action, Channel, Hazards, batches, describe
from ..plan.plan import Plan
from . import progress
from .comm.base import P2P, ChannelQueue, Comm, Handle, Pending


@dataclass(frozen=True)
class Messages:
    """The work of a point-to-point unit: its messages and their tags, on one channel's Comm.
    Called, it runs them as one batch; ``Executor`` may post them one by one instead."""

    comm: Comm
    ops: tuple[P2P, ...]
    tags: tuple[int, ...]
    timeout: float

    def post(self) -> list[Pending]:
        """Post every message, tagged, without waiting (``comm.async_p2p`` backends only)."""
        return [self.comm.post(op, tag) for op, tag in zip(self.ops, self.tags)]

    def __call__(self) -> None:
        if self.comm.async_p2p:  # tagged like the messages posted one by one, which it meets
            for p in self.post():
                p.wait(self.timeout)
        else:
            self.comm.batch_p2p(list(self.ops))


Work = Callable[[list[Action]], Callable[[], None]]


class Executor:
    """Channels of one rank and the loop that feeds them.

    ``overlap=False`` waits for every transfer right after issuing it (except the ops whose
    ``always_overlaps`` the op table sets, design §5.3), the serial model that ``verify`` checks too.
    """

    def __init__(self, plan: Plan, timeout: float, device: torch.device, overlap: bool = True,
                 rank: int = 0) -> None:
        self.plan, self.timeout, self.device, self.overlap, self.rank = plan, timeout, device, overlap, rank
        self.channels = {name: ChannelQueue(name, timeout, device) for name in QUEUES}
        self._issued: list[Handle] = []  # the transfers of the run in progress, issued so far
        self._trace_dir = os.environ.get("TAWPIPE_TRACE")  # see ``run``

    def run(self, actions: Sequence[Action], work: Work, traced: bool = False) -> None:
        """Execute ``actions``; ``work(unit)`` returns the callable that performs one unit.

        Returns when every unit has finished, so nothing of this list is in flight afterwards.
        ``traced``, under TAWPIPE_TRACE=DIR: each unit's host start and end go to
        DIR/trace_rank<r>.json (Chrome trace format, one row per channel) as the run ends or fails,
        in place of the last traced run's. The engine traces its steps: the file is the last one,
        and a run's trace is dropped with it (a trace of every run grew for as long as a job ran).
        """
        trace: list[tuple[str, str, Handle]] | None = [] if traced and self._trace_dir else None
        try:
            self._run(actions, work, trace)
        finally:
            if trace:
                self._write_trace(trace)

    def _run(self, actions: Sequence[Action], work: Work, trace: list[tuple[str, str, Handle]] | None) -> None:
        hazards: Hazards[Handle] = Hazards()
        issued = self._issued = []
        for unit in batches(actions):
            rw = [(self.plan.reads(a), self.plan.writes(a)) for a in unit]
            deps = [d for reads, writes in rw for d in hazards.deps(reads, writes)]
            channel, label = OPS[unit[0].op].channel, describe(unit[0])
            fn = work(unit)
            if channel is Channel.COMPUTE:
                for d in deps:
                    self._wait(d)
                progress.publish(label)
                start = time.perf_counter()
                fn()
                handle = self._compute_done(label)
                handle.start, handle.end = start, time.perf_counter()
            else:
                floating = self.device.type == "cpu" and not any(OPS[a.op].ordered for a in unit)
                if floating and isinstance(fn, Messages) and fn.comm.async_p2p:
                    handle = self._post_when_ready(fn, deps, label)
                elif floating and not isinstance(fn, Messages):
                    handle = self._run_when_ready(fn, deps, label)
                else:
                    handle = self.channels[channel].submit(fn, deps, label)
                issued.append(handle)
                if not self.overlap and not OPS[unit[0].op].always_overlaps:
                    self._wait(handle)
            for reads, writes in rw:
                hazards.record(handle, reads, writes)
            if trace is not None:
                trace.append((channel, label, handle))
        for h in issued:
            self._wait(h)
        self._issued = []
        progress.publish(progress.OUTSIDE)

    def settle(self) -> None:
        """From a compute unit: wait until every transfer the run has issued so far is done (on
        CUDA, order the current stream after them too). The unit may then touch any buffer an
        earlier unit did, which its dependencies alone do not promise (the host step's loads for
        the next iteration, design §6.1)."""
        for h in self._issued:
            self._wait(h)

    def _post_when_ready(self, msgs: Messages, deps: list[Handle], label: str) -> Handle:
        """Post the messages as soon as every dependency is done (on the thread that finishes
        the last one) and finish the handle, from a waiter thread, once they have completed."""

        def complete(handle: Handle, pending: list[Pending]) -> None:
            try:
                for p in pending:
                    p.wait(self.timeout)
            except BaseException as e:  # noqa: BLE001 - surfaced to whoever waits on the handle
                handle._finish(error=e)
                return
            handle.end = time.perf_counter()
            handle._finish()

        def post(handle: Handle) -> None:
            threading.Thread(target=complete, args=(handle, msgs.post()), name=f"tawpipe-p2p {label}",
                             daemon=True).start()

        return _when_ready(deps, label, post)

    def _run_when_ready(self, fn: Callable[[], None], deps: list[Handle], label: str) -> Handle:
        """Run local work (no transfer) as soon as every dependency is done."""

        def run(handle: Handle) -> None:
            fn()
            handle.end = time.perf_counter()
            handle._finish()

        return _when_ready(deps, label, run)

    def _wait(self, handle: Handle) -> None:
        """Wait for ``handle``, telling the progress board what this rank waits for (design §5.4)."""
        if not handle.done():
            progress.publish(handle.label, wait_limit=self.timeout)
        handle.wait(self.timeout)

    def _compute_done(self, label: str) -> Handle:
        """A handle for work already issued on the compute side (an event on CUDA)."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            return Handle.completed(ev, label)
        return Handle.completed(label=label)

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def _write_trace(self, trace: list[tuple[str, str, Handle]]) -> None:
        started = [(channel, label, h) for channel, label, h in trace if h.start]
        if not started:
            return
        t0 = min(h.start for _, _, h in started)
        events = [{"name": label, "ph": "X", "pid": self.rank, "tid": channel, "ts": (h.start - t0) * 1e6,
                   "dur": max(h.end - h.start, 0.0) * 1e6} for channel, label, h in started]
        write_atomic(os.path.join(self._trace_dir, f"trace_rank{self.rank}.json"), json.dumps({"traceEvents": events}))


def _when_ready(deps: Sequence[Handle], label: str, start: Callable[[Handle], None]) -> Handle:
    """A handle that ``start`` finishes, called on the thread that completes the last of ``deps``
    (now, if they are all done). A failed dependency, or a failing ``start``, fails it instead."""
    handle = Handle(label)
    state, lock = {"left": len(deps), "failed": False}, threading.Lock()

    def begin() -> None:
        handle.start = time.perf_counter()
        try:
            start(handle)
        except BaseException as e:  # noqa: BLE001 - surfaced to whoever waits on the handle
            handle._finish(error=e)

    def dep_done(d: Handle) -> None:
        with lock:
            if state["failed"]:
                return
            state["failed"] = failed = d.error is not None  # the first failure, reported once
            state["left"] -= 1
            ready = state["left"] == 0 and not failed
        if failed:
            handle._finish(error=RuntimeError(f"{d.label} failed before {label} could start: {d.error}"))
        elif ready:
            begin()

    if not deps:
        begin()
    for d in deps:
        d.add_done_callback(dep_done)
    return handle
