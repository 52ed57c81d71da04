"""The own chunk's update (design §6.1): its gradient's additions into the accumulator (ACC_G),
streamed a layer at a time where a backward finishes the gradient so, and the optimizer's step
(STEP). Where the state is on the host the step loads the chunk for the next iteration as it goes
(``Plan.carried_load``): a piece at a time, and on a GPU on a thread beside the next iteration,
whose first forward of the chunk then runs each layer once it is loaded (``gate``) and whose first
unit that touches what the step changes waits for all of it (``waits_for``, ``finish``)."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..plan.actions import ACC, MASTER, Action, Channel
from ..plan.plan import Plan
from ..runtime.comm.base import Handle
from ..runtime.executor import Executor
from .host_step import BesideStep, step_beside, step_in_pieces, steps_in_pieces
from .precision import Precision
from .storage import ChunkStorage


def steps_beside(device: torch.device) -> bool:
    """Whether the host steps the own chunk beside the next iteration: on a GPU, whose compute it
    then overlaps; on a CPU the host is the device, and a thread stepping beside the compute would
    take its cores."""
    return device.type == "cuda"


class Update:
    """ACC_G and STEP of one rank, on ``storage``'s buffers with the engine's optimizer."""

    def __init__(self, plan: Plan, storage: ChunkStorage, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, precision: Precision, executor: Executor,
                 timeout: float) -> None:
        self.plan, self.storage, self.optimizer, self.scheduler = plan, storage, optimizer, scheduler
        self.precision, self.executor, self.timeout, self.device = precision, executor, timeout, storage.device
        self._slices: dict[Action, list[Handle]] = {}  # a streamed ACC_G's slices, queued (``stream_slice``)
        self._beside: BesideStep | None = None  # the host's step of the own chunk, still running
        self._stops: list[int] = []  # where each of its pieces ends, and the event after its load
        self._loaded: list[torch.cuda.Event | None] = []

    @property
    def beside(self) -> bool:
        """Whether the host still steps the own chunk beside this iteration."""
        return self._beside is not None

    def stream_slice(self, addition: Action, layer: int) -> None:
        """A streamed ACC_G's addition of ``layer``'s slice, queued on the gradients' channel
        behind the backward's work so far (an event on the compute stream) and waited for by the
        ACC_G's own unit; with ``overlap=False``, done now."""
        work = lambda: self.storage.accumulate(addition, layer)  # noqa: E731
        if not self.executor.overlap:
            work()
            return
        produced = None
        if self.device.type == "cuda":
            produced = torch.cuda.Event()
            produced.record()
        label = f"{addition.op.value} layer {layer}"
        self._slices.setdefault(addition, []).append(
            self.executor.channels[Channel.GRADS].submit(work, [Handle.completed(produced, label)], label))

    def accumulate(self, a: Action) -> None:
        """ACC_G, once the slices its backward streamed are added."""
        for handle in self._slices.pop(a, ()):
            handle.wait(self.timeout)
        self.storage.accumulate(a)

    def step(self, steps: int, stats: torch.Tensor, loss: float) -> None:
        """STEP: the gradients unscaled, checked and clipped (``Precision.finish``), the
        optimizer's and the scheduler's step, the accumulators zeroed."""
        s = self.storage
        stepping = self.precision.finish(steps, stats, loss, s.rep, s.grad_acc)
        if s.offload is not None:
            s.offload.synchronize()  # streamed loads have finished reading the master
        beside = None
        if s.carried_load is not None:
            beside = self._loading_ahead(stepping)
        elif stepping:
            self.optimizer.step()
        if stepping and self.scheduler is not None:
            self.scheduler.step()  # the pieces still to step keep the groups as they were (host_step)
        s.rep.zero_()
        s.loss_sum.zero_()
        if beside is not None:
            self._beside = beside
            return
        s.grad_acc.zero_()
        if s.carried_load is not None:
            s.carried(self.executor.channels[Channel.WEIGHTS].stream)

    def _loading_ahead(self, stepping: bool) -> BesideStep | None:
        """The host's step of the own chunk, loading it for the next iteration: a piece at a time,
        each loading once stepped, where the optimizer steps alike in pieces (on a GPU beside the
        next iteration: returned, still running); else the whole step, then the whole load."""
        s = self.storage
        self.executor.settle()  # no transfer of this iteration still reads the buffer the loads fill
        if stepping and steps_in_pieces(self.optimizer):
            runs = s.own_pieces()
            if steps_beside(self.device):
                return self._step_beside(runs)
            step_in_pieces(self.optimizer, [params for params, _, _ in runs], lambda i: s.carry(*runs[i][1:]))
            return None
        if stepping:
            self.optimizer.step()
        s.carry(0, s.master.numel())
        return None

    def _step_beside(self, runs: list[tuple[list[nn.Parameter], int, int]]) -> BesideStep:
        """The pieces stepped on a thread, each loaded on the weights channel's stream once
        stepped and an event recorded after it, for the forward's layers that read it (``gate``);
        the accumulator zeroed and the loads' reads of the master awaited last."""
        s, stream = self.storage, self.executor.channels[Channel.WEIGHTS].stream
        self._stops = [stop for _, _, stop in runs]
        self._loaded = [torch.cuda.Event() if stream is not None else None for _ in runs]

        def loaded(i: int) -> None:  # on the step's thread, whose current device is its own
            if stream is None:
                s.carry(*runs[i][1:])
                return
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                s.carry(*runs[i][1:])
                self._loaded[i].record(stream)

        def finish() -> None:
            s.grad_acc.zero_()
            s.offload.synchronize()

        s.carry_beside()
        return step_beside(self.optimizer, [params for params, _, _ in runs], loaded, finish, self.timeout)

    def gate(self, layer: int) -> None:
        """Before a forward runs layer ``layer`` of the own chunk from the carried buffer while the
        host steps beside it: the piece that holds the layer is loaded (the compute stream waits
        for its load)."""
        i = self.storage.piece_of_layer(self._stops, layer)
        self._beside.wait_piece(i)
        if self._loaded[i] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loaded[i])

    def waits_for(self, a: Action) -> bool:
        """Whether ``a`` reads or writes what the host's step beside still changes (the master,
        the accumulator, the carried buffer); the carried LOAD_W, which moves nothing, does not."""
        s = self.storage
        return a != s.carried_load and bool({MASTER, ACC, s.carried_load.buf}
                                            & {*self.plan.reads(a), *self.plan.writes(a)})

    def finish(self) -> None:
        """Wait until the step beside (if any) is done; raises its failure."""
        beside, self._beside = self._beside, None
        if beside is not None:
            beside.join()
            self.storage.carried_beside()
