"""The host optimizer's step in pieces (design §6.1): with the own chunk's state on the host, a
piece of the chunk steps, and its weights start loading for the next iteration while the host
steps the next piece. The loads then hide behind the step, all but the last piece's.

A torch optimizer skips a parameter whose ``.grad`` is None, so stepping the parameters piece by
piece, each call seeing only its piece's gradients, steps each parameter once with the same
arithmetic as one call: the optimizers below update each parameter from its own gradient and
state alone. Any other optimizer (a subclass too: it may couple its parameters), or one whose step
runs more than the update (hooks, a wrapper: they would run once a piece), steps at once; its
loads follow the whole step.

On a GPU the engine steps the pieces on a thread of their own, beside the next iteration
(``step_beside``): the device's parameters step at once, and the next iteration's forward of the
own chunk runs each layer once the piece that holds it is loaded. The pieces step through a
second optimizer object that shares the optimizer's state and sees a copy of its groups as they
were at the step: the learning-rate scheduler, or the caller, may change the groups meanwhile
for the next step.
"""

from __future__ import annotations

import copy
import functools
import itertools
import threading
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from ..plan.plan import STEP_PIECES

# Stepped a parameter at a time: each update reads only the parameter's gradient and state.
PER_PARAMETER = frozenset(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop",
    "Adafactor") if hasattr(torch.optim, name))  # Adafactor: torch 2.5 on


def steps_in_pieces(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` may step a piece of its parameters at a time with the same result: a
    per-parameter class, no step hooks, and no ``step`` wrapped on the instance (an EMA wrapper, a
    compiled step) but a learning-rate scheduler's, which only notes that the step ran."""
    hooks = (getattr(optimizer, "_optimizer_step_pre_hooks", None), _global_optimizer_pre_hooks,
             getattr(optimizer, "_optimizer_step_post_hooks", None), _global_optimizer_post_hooks)  # torch's registries
    wrapped = vars(optimizer).get("step")
    return (type(optimizer) in PER_PARAMETER and not any(hooks)
            and (wrapped is None or getattr(wrapped, "_wrapped_by_lr_sched", False)))


def pieces(sizes: Sequence[int], count: int = STEP_PIECES) -> list[tuple[int, int]]:
    """Consecutive runs of parameters (index ranges) of ``sizes`` elements, about ``count`` of
    them and each at least 1/count of the whole (fewer where the parameters are fewer)."""
    target, runs, start, filled = sum(sizes) / count, [], 0, 0
    for i, n in enumerate(sizes):
        filled += n
        if filled >= target:
            runs.append((start, i + 1))
            start, filled = i + 1, 0
    if start < len(sizes):  # the rest: a run of its own, or the last run's where it holds no element
        runs = [*runs[:-1], (runs[-1][0], len(sizes))] if runs and filled == 0 else [*runs, (start, len(sizes))]
    return runs


def piece_ranges(params: Sequence[torch.Tensor]) -> list[tuple[list[torch.Tensor], int, int]]:
    """``params``, consecutive in one flat buffer, in the pieces the host steps them in: each
    piece's parameters and its elements start..stop of the buffer."""
    sizes = [p.numel() for p in params]
    at = [0, *itertools.accumulate(sizes)]
    return [(list(params[i:j]), at[i], at[j]) for i, j in pieces(sizes)]


def step_in_pieces(optimizer: torch.optim.Optimizer, runs: Sequence[Sequence[nn.Parameter]],
                   stepped: Callable[[int], None]) -> None:
    """``optimizer.step()`` one run of parameters at a time, calling ``stepped(i)`` after run i;
    every ``.grad`` is as it was afterwards. The optimizer's parameters outside every run (the
    replicated ones, on the device) step with the first run that has a gradient to step: a call
    then sees the devices one step would (torch picks its implementation by them)."""
    grads = {p: p.grad for group in optimizer.param_groups for p in group["params"]}
    listed = {p for run in runs for p in run}
    rest = [p for p in grads if p not in listed]
    first = next((i for i, run in enumerate(runs) if any(grads.get(p) is not None for p in run)), 0)
    try:
        for i, run in enumerate(runs):
            now = {*run, *rest} if i == first else set(run)
            for p, g in grads.items():
                p.grad = g if p in now else None
            optimizer.step()
            stepped(i)
    finally:
        for p, g in grads.items():
            p.grad = g


def _stepping(optimizer: torch.optim.Optimizer, groups: list[dict], params: set[torch.Tensor]) -> None:
    """One step of ``params`` alone, with the hyper-parameters of ``groups`` (copies of the
    optimizer's), through an optimizer object that shares ``optimizer``'s state."""
    view = copy.copy(optimizer)  # the optimizer's pickling state: its defaults, state and groups
    view.param_groups = []
    for g in groups:
        kept = [p for p in g["params"] if p in params]
        if kept:
            view.param_groups.append({**g, "params": kept})
    view.step()


class BesideStep:
    """The host's step of the own chunk, a piece at a time, on a thread of its own (design §6.1):
    piece i steps, then ``loaded(i)`` queues its load; ``finish()`` runs after the last. A failure
    or a wait past ``timeout`` seconds is raised to whoever waits for it."""

    def __init__(self, pieces: list[Callable[[], None]], loaded: Callable[[int], None], finish: Callable[[], None],
                 timeout: float) -> None:
        self.timeout = timeout
        self._ready = [threading.Event() for _ in pieces]
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(pieces, loaded, finish), name="tawpipe host step",
                                        daemon=True)
        self._thread.start()

    def _run(self, pieces: list[Callable[[], None]], loaded: Callable[[int], None], finish: Callable[[], None]) -> None:
        try:
            for i, piece in enumerate(pieces):
                piece()
                loaded(i)
                self._ready[i].set()
            finish()
        except BaseException as e:  # noqa: BLE001 - raised to whoever waits
            self._error = e
        finally:
            for ready in self._ready:
                ready.set()
            self._done.set()

    def _wait(self, event: threading.Event, what: str) -> None:
        if not event.wait(self.timeout):
            raise TimeoutError(f"the host's step of the own chunk has not {what} after {self.timeout:g} s "
                               "(CommPolicy.timeout): the host is overloaded or the step hangs")
        if self._error is not None:
            raise RuntimeError("the host's step of the own chunk failed (see the cause); the engine's "
                               "parameters and optimizer state are not usable") from self._error

    def wait_piece(self, i: int) -> None:
        """Until piece ``i`` is stepped and its load queued."""
        self._wait(self._ready[i], f"loaded piece {i}")

    def join(self) -> None:
        """Until every piece is stepped and ``finish`` has run."""
        self._wait(self._done, "finished")


def step_beside(optimizer: torch.optim.Optimizer, runs: Sequence[Sequence[nn.Parameter]],
                loaded: Callable[[int], None], finish: Callable[[], None], timeout: float) -> BesideStep:
    """``step_in_pieces`` with the runs stepped on a thread (``BesideStep``), ``loaded(i)`` after
    run i. The optimizer's parameters outside every run (the replicated ones, on the device) step
    here, before it returns, in one ``optimizer.step()`` that sees no run's gradient (so a
    learning-rate scheduler sees the optimizer step); the runs step with the hyper-parameters the
    groups have now."""
    groups = [dict(g) for g in optimizer.param_groups]
    listed = [p for run in runs for p in run]
    grads = [p.grad for p in listed]
    try:
        for p in listed:
            p.grad = None
        optimizer.step()
    finally:
        for p, g in zip(listed, grads):
            p.grad = g
    pieces = [functools.partial(_stepping, optimizer, groups, set(run)) for run in runs]
    return BesideStep(pieces, loaded, finish, timeout)
