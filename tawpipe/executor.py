"""Runs a rank's action list: the engine's execution model (design §5).

The calling thread walks the list in order. Compute units run on it; communication units go to
their channel (``plan.OPS[op].channel``), an in-order queue on its own thread (and CUDA stream),
so they overlap compute. Every unit first waits for the dataflow dependencies ``plan.Hazards``
derives from the names it reads and writes; that is the only ordering there is, and it gives
every action the inputs it would see if the list ran one action at a time (design §5.1).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence

import torch

from . import progress
from .comm.base import Channel, Handle
from .plan import CHANNELS, OPS, Action, Hazards, Plan, batches, describe

Work = Callable[[list[Action]], Callable[[], None]]


class Executor:
    """Channels of one rank and the loop that feeds them.

    ``overlap=False`` waits for every transfer right after issuing it (the replicated all-reduce
    excepted: it always overlaps, see design §5.3), the serial model that ``verify`` checks too.
    """

    def __init__(self, plan: Plan, timeout: float, device: torch.device, overlap: bool = True,
                 rank: int = 0) -> None:
        self.plan, self.timeout, self.device, self.overlap, self.rank = plan, timeout, device, overlap, rank
        self.channels = {name: Channel(name, timeout, device) for name in CHANNELS if name != "compute"}
        # TAWPIPE_TRACE=DIR: every unit's host start and end, written as DIR/trace_rank<r>.json
        # (Chrome trace format, one row per channel) when the executor closes
        self._trace_dir = os.environ.get("TAWPIPE_TRACE")
        self._trace: list[tuple[str, str, Handle]] = []

    def run(self, actions: Sequence[Action], work: Work) -> None:
        """Execute ``actions``; ``work(unit)`` returns the callable that performs one unit.

        Returns when every unit has finished, so nothing of this list is in flight afterwards.
        """
        hazards: Hazards[Handle] = Hazards()
        issued: list[Handle] = []
        for unit in batches(actions):
            rw = [(self.plan.reads(a), self.plan.writes(a)) for a in unit]
            deps = [d for reads, writes in rw for d in hazards.deps(reads, writes)]
            channel, label = OPS[unit[0].op].channel, describe(unit[0])
            fn = work(unit)
            if channel == "compute":
                for d in deps:
                    self._wait(d)
                progress.publish(label)
                start = time.perf_counter()
                fn()
                handle = self._compute_done(label)
                handle.start, handle.end = start, time.perf_counter()
            else:
                handle = self.channels[channel].submit(fn, deps, label)
                issued.append(handle)
                if not self.overlap and channel != "replicated":
                    self._wait(handle)
            for reads, writes in rw:
                hazards.record(handle, reads, writes)
            if self._trace_dir:
                self._trace.append((channel, label, handle))
        for h in issued:
            self._wait(h)
        progress.publish(progress.OUTSIDE)

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
        if self._trace_dir and self._trace:
            self._write_trace()

    def _write_trace(self) -> None:
        t0 = min(h.start for _, _, h in self._trace if h.start)
        events = [{"name": label, "ph": "X", "pid": self.rank, "tid": channel, "ts": (h.start - t0) * 1e6,
                   "dur": max(h.end - h.start, 0.0) * 1e6} for channel, label, h in self._trace if h.start]
        os.makedirs(self._trace_dir, exist_ok=True)
        with open(os.path.join(self._trace_dir, f"trace_rank{self.rank}.json"), "w") as f:
            json.dump({"traceEvents": events}, f)
        self._trace.clear()
