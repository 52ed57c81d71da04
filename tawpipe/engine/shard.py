"""A rank's shard (``TawPipe.state_dict``) as data: taken as a snapshot, checked whole before
``TawPipe.load_state_dict`` changes anything, and loaded without sharing tensors with the caller.

A shard that cannot be loaded must leave the engine as it was. Loaded halfway (the parameters of
the shard, the counters and the loss scale of the engine) it would train on state that belongs to
no step; loaded with another optimizer's state it fails in its next step, and a failed step
leaves the engine unusable for good. So ``check`` reads everything ``load_state_dict`` will read
first: the keys, every parameter's shape, every optimizer state tensor's shape against its
parameter, the optimizer's class (or, in shards that do not record it, its groups'
hyper-parameter names) and whether there is a scheduler state; the error names the key and the
fix.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

# The shard's keys load_state_dict reads, with their types (``scheduler`` may be None).
_KEYS: dict[str, type] = {"params": dict, "optimizer": dict, "precision": dict, "steps": int}
_PRECISION_KEYS = ("scale", "good_steps", "skipped_steps")  # engine.precision.Precision.state_dict
_WHOLE = "load the whole dict TawPipe.state_dict() returned (tawpipe.io.checkpoint.restore reads one from a checkpoint)"


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class as a shard records it (``torch.optim.adamw.AdamW``)."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def snapshot(x: Any) -> Any:
    """``x`` with every tensor copied to the host and every container rebuilt: nothing in it is
    live state, so the engine's later steps do not change it (``Optimizer.state_dict`` and a
    scheduler's ``state_dict`` return the live tensors and lists)."""
    if torch.is_tensor(x):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: snapshot(v) for k, v in x.items()}
    if isinstance(x, list):
        return [snapshot(v) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(snapshot(v) for v in x)
    return copy.deepcopy(x)


def tensors(x: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples."""
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors(v)


def unshare(optimizer: torch.optim.Optimizer, given: Any) -> None:
    """Replace each tensor of ``optimizer``'s state that shares memory with a tensor of ``given``
    by a copy. ``Optimizer.load_state_dict`` keeps a tensor that is already on the parameter's
    device in its dtype as it is: two engines loaded from one dict would step the same moments."""
    storages = {t.untyped_storage().data_ptr() for t in tensors(given) if t.numel()}

    def own(x: Any) -> Any:
        if torch.is_tensor(x):
            return x.clone() if x.numel() and x.untyped_storage().data_ptr() in storages else x
        if isinstance(x, dict):
            return {k: own(v) for k, v in x.items()}
        if isinstance(x, list):
            return [own(v) for v in x]
        return x

    for p, state in optimizer.state.items():
        optimizer.state[p] = own(state)


def _refuse(problem: str, fix: str) -> ValueError:
    return ValueError(f"load_state_dict: {problem}; nothing was loaded: {fix}")


def _fits(state: torch.Tensor, param: torch.Tensor) -> bool:
    """A per-parameter optimizer state tensor that can belong to ``param``: a scalar (a step
    count), the parameter's shape (moments), or that shape with dimensions of 1 (a factored
    second moment, torch's Adafactor)."""
    if state.dim() == 0 or tuple(state.shape) == tuple(param.shape):
        return True
    return state.dim() == param.dim() and all(s in (1, p) for s, p in zip(state.shape, param.shape))


def check(state: Any, *, params: Mapping[str, nn.Parameter], optimizer: torch.optim.Optimizer,
          groups: Sequence[Sequence[str]], scheduler: Any, reshard: bool, rank: int, own_chunk: int) -> None:
    """Refuse, with a ValueError naming the key and the fix, a ``state`` that
    ``TawPipe.load_state_dict`` could not load whole: ``params`` are the engine's parameters by
    name, ``groups`` the names of its optimizer's parameter groups, ``scheduler`` its scheduler
    (None without one). Reads ``state`` only."""
    if not isinstance(state, Mapping):
        raise _refuse(f"the shard is a {type(state).__name__}, not a dict", _WHOLE)
    if not reshard and state.get("chunk") != own_chunk:
        raise ValueError(
            f"shard holds chunk {state.get('chunk')} but rank {rank} owns chunk "
            f"{own_chunk}: load each rank's own shard on the same topology, or re-shard "
            "(tawpipe.io.checkpoint.restore does)"
        )
    for key, kind in _KEYS.items():
        if key not in state:
            raise _refuse(f"the shard has no {key!r}", _WHOLE)
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise _refuse(f"the shard's {key!r} is a {type(state[key]).__name__}, not {kind.__name__}", _WHOLE)
    if state["steps"] < 0:
        raise _refuse(f"the shard's 'steps' is {state['steps']}, below 0", _WHOLE)
    _check_params(state["params"], params, reshard)
    _check_optimizer(state["optimizer"], params, optimizer, groups, reshard)
    _check_scheduler(state.get("scheduler"), scheduler)
    precision = state["precision"]
    for key in _PRECISION_KEYS:
        value = precision.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _refuse(f"the shard's 'precision' has no number {key!r} (it holds {sorted(precision)})", _WHOLE)


def _check_params(saved: Mapping[str, Any], params: Mapping[str, nn.Parameter], reshard: bool) -> None:
    missing = sorted(params.keys() - saved.keys())
    unexpected = [] if reshard else sorted(saved.keys() - params.keys())
    if missing or unexpected:
        raise ValueError(f"the shard's parameters differ from this engine's (different model?): missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}")
    for n, p in params.items():
        t = saved[n]
        if not torch.is_tensor(t) or not t.is_floating_point():
            raise _refuse(f"parameter {n} is {type(t).__name__ if not torch.is_tensor(t) else t.dtype} in the shard, "
                          "not a floating-point tensor", _WHOLE)
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"parameter {n} is {tuple(t.shape)} in the shard but {tuple(p.shape)} "
                             "here: different model?")


def _check_optimizer(saved: Mapping[str, Any], params: Mapping[str, nn.Parameter], optimizer: torch.optim.Optimizer,
                     groups: Sequence[Sequence[str]], reshard: bool) -> None:
    """The optimizer's kind, its groups and every state tensor against its parameter."""
    if not isinstance(saved.get("state"), dict) or not isinstance(saved.get("param_groups"), list):
        raise _refuse("the shard's 'optimizer' has no dict 'state' and list 'param_groups'", _WHOLE)
    mine, theirs = optimizer_class(optimizer), saved.get("class")
    if theirs is not None and theirs != mine:
        raise _refuse(f"the shard's optimizer is a {theirs}, this engine's a {mine}",
                      f"build the engine with the optimizer the shard was trained with (optimizer=lambda params: "
                      f"{theirs.rsplit('.', 1)[-1]}(params, ...)), or load its parameters alone into a model")
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"the shard's optimizer has {len(saved_groups)} parameter groups, this engine's "
                         f"{len(groups)}: different optimizer?")
    for i, (sg, g, names) in enumerate(zip(saved_groups, optimizer.param_groups, groups)):
        if not isinstance(sg, dict) or not isinstance(sg.get("params"), list):
            raise _refuse(f"the shard's optimizer group {i} is no dict with a list 'params'", _WHOLE)
        foreign = sorted(set(sg) - set(g))
        if theirs is None and foreign:  # a shard that does not name its optimizer: its groups' keys do
            raise _refuse(f"the shard's optimizer group {i} has hyper-parameters {foreign} that this engine's "
                          f"{mine} does not know: it was saved by another kind of optimizer",
                          "build the engine with the optimizer the shard was trained with (optimizer=...)")
        moved = sorted((set(sg["params"]) & params.keys()) - set(names))
        if moved:
            raise _refuse(f"the shard's optimizer group {i} holds {moved[:3]}, which this engine's optimizer has in "
                          "another group (other hyper-parameters)",
                          "group the parameters as the optimizer the shard was saved with did")
    state = saved["state"]
    unexpected = [] if reshard else sorted(state.keys() - params.keys())
    if unexpected:
        raise _refuse(f"the shard's optimizer state names parameters this engine does not have: {unexpected[:3]}",
                      "load each rank's own shard of the same model (or re-shard: tawpipe.io.checkpoint.restore)")
    for n in sorted(state.keys() & params.keys()):
        per_param = state[n]
        if not isinstance(per_param, dict):
            raise _refuse(f"the shard's optimizer state of {n} is a {type(per_param).__name__}, not a dict", _WHOLE)
        p = params[n]
        for key, t in per_param.items():
            if torch.is_tensor(t) and not _fits(t, p):
                raise _refuse(f"the shard's optimizer state {key!r} of {n} is {tuple(t.shape)}, but the parameter "
                              f"is {tuple(p.shape)}",
                              "the optimizer state belongs to another model or was altered: load a shard "
                              "TawPipe.state_dict() saved for this model")


def _check_scheduler(saved: Any, scheduler: Any) -> None:
    if scheduler is not None and saved is None:
        raise _refuse("the shard has no learning-rate scheduler state, but this engine has a scheduler",
                      "build the engine without lr_scheduler, as the shard was trained, or set the shard's "
                      "'scheduler' to this engine's scheduler.state_dict() to start that schedule afresh")
    if scheduler is None and saved is not None:
        raise _refuse("the shard holds a learning-rate scheduler's state, but this engine has no scheduler",
                      "build the engine with the lr_scheduler the shard was trained with, or set the shard's "
                      "'scheduler' to None to drop that schedule")
    if saved is not None and not isinstance(saved, dict):
        raise _refuse(f"the shard's 'scheduler' is a {type(saved).__name__}, not a dict", _WHOLE)
