"""The host optimizer's step in pieces (design §6.1): with the own chunk's state on the host, a
piece of the chunk steps, and its weights start loading for the next iteration while the host
steps the next piece. The loads then hide behind the step, all but the last piece's.

A torch optimizer skips a parameter whose ``.grad`` is None, so stepping the parameters piece by
piece, each call seeing only its piece's gradients, steps each parameter once with the same
arithmetic as one call: the optimizers below update each parameter from its own gradient and
state alone. Any other optimizer (a subclass too: it may couple its parameters), or one with step
hooks (they would run once a piece), steps at once; its loads follow the whole step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

# Stepped a parameter at a time: each update reads only the parameter's gradient and state.
PER_PARAMETER = frozenset(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop",
    "Adafactor") if hasattr(torch.optim, name))  # Adafactor: torch 2.5 on
# Pieces a chunk steps in: all but the last piece's load hides behind the step (1/8 is left).
STEP_PIECES = 8


def steps_in_pieces(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` may step a piece of its parameters at a time with the same result."""
    hooks = (getattr(optimizer, "_optimizer_step_pre_hooks", None), _global_optimizer_pre_hooks,
             getattr(optimizer, "_optimizer_step_post_hooks", None), _global_optimizer_post_hooks)  # torch's registries
    return type(optimizer) in PER_PARAMETER and not any(hooks)


def pieces(sizes: Sequence[int], count: int = STEP_PIECES) -> list[tuple[int, int]]:
    """Consecutive runs of parameters (index ranges) of ``sizes`` elements, about ``count`` of
    them and each at least 1/count of the whole (fewer where the parameters are fewer)."""
    target, runs, start, filled = sum(sizes) / count, [], 0, 0
    for i, n in enumerate(sizes):
        filled += n
        if filled >= target or i == len(sizes) - 1:
            runs.append((start, i + 1))
            start, filled = i + 1, 0
    return runs


def step_in_pieces(optimizer: torch.optim.Optimizer, runs: Sequence[Sequence[nn.Parameter]],
                   stepped: Callable[[int], None]) -> None:
    """``optimizer.step()`` one run of parameters at a time (the optimizer's parameters outside
    every run step with the first), calling ``stepped(i)`` after run i; every ``.grad`` is as it
    was afterwards."""
    grads = {p: p.grad for group in optimizer.param_groups for p in group["params"]}
    listed = {p for run in runs for p in run}
    first = [p for p in grads if p not in listed]
    try:
        for i, run in enumerate(runs):
            now = {*run, *first} if i == 0 else set(run)
            for p, g in grads.items():
                p.grad = g if p in now else None
            optimizer.step()
            stepped(i)
    finally:
        for p, g in grads.items():
            p.grad = g
