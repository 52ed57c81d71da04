"""The host optimizer's step in pieces (design §6.1): with the own chunk's state on the host, a
piece of the chunk steps, and its weights start loading for the next iteration while the host
steps the next piece. The loads then hide behind the step, all but the last piece's.

A torch optimizer skips a parameter whose ``.grad`` is None, so stepping the parameters piece by
piece, each call seeing only its piece's gradients, steps each parameter once with the same
arithmetic as one call: the optimizers below update each parameter from its own gradient and
state alone. Any other optimizer (a subclass too: it may couple its parameters), or one whose step
runs more than the update (hooks, a wrapper: they would run once a piece), steps at once; its
loads follow the whole step.
"""

from __future__ import annotations

import itertools
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
