"""Runs a rank's action list: the engine's execution model (design §5).

The calling thread walks the list in order. Compute units run on it; communication units go to
their channel (``plan.OPS[op].channel``), an in-order queue on its own thread (and CUDA stream),
so they overlap compute. Every unit first waits for the dataflow dependencies ``plan.Hazards``
derives from the names it reads and writes; that is the only ordering there is, and it gives
every action the inputs it would see if the list ran one action at a time (design §5.1).
"""

from __future__ import annotations

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

    def __init__(self, plan: Plan, timeout: float, device: torch.device, overlap: bool = True) -> None:
        self.plan, self.timeout, self.device, self.overlap = plan, timeout, device, overlap
        self.channels = {name: Channel(name, timeout, device) for name in CHANNELS if name != "compute"}

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
                fn()
                handle = self._compute_done(label)
            else:
                handle = self.channels[channel].submit(fn, deps, label)
                issued.append(handle)
                if not self.overlap and channel != "replicated":
                    self._wait(handle)
            for reads, writes in rw:
                hazards.record(handle, reads, writes)
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
