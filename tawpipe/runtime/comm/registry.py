"""The communication backends by name; ``create(name, topology, timeout, device)`` builds one.

The engine (``CommPolicy.backend``), ``tawpipe train --comm`` and ``tawpipe bench comm
--backend`` all choose through this registry. Built-in backends are named by import path, so
that reading the names imports nothing (``tawpipe train --help`` stays free of torch) and a backend
whose extension is not built here (``nccl-native``) costs nothing until it is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ...plan.topology import Topology
    from .base import Comm

_BACKENDS: dict[str, type[Comm] | str] = {
    "torch": "tawpipe.runtime.comm.torch_dist:TorchDistComm",  # torch.distributed: gloo, or NCCL on GPUs
    "nccl-native": "tawpipe.runtime.comm.nccl_native:NcclComm",  # tawpipe's own NCCL: a grouped launch per batch
    # gloo with GPU tensors staged through pinned host memory: several ranks sharing one GPU
    "gloo-staged": "tawpipe.runtime.comm.staged:StagedComm",
}


def register(name: str, backend: type[Comm] | str) -> None:
    """Make ``name`` a backend: a ``Comm`` subclass whose ``create`` builds it, or its
    ``"module:Class"`` path, imported when it is first asked for."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a backend's name must be a non-empty string, got {name!r}")
    _BACKENDS[name] = backend


def unregister(name: str) -> None:
    """Forget the backend ``name`` (a test's, say)."""
    _BACKENDS.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered backends, the default first."""
    return tuple(_BACKENDS)


def backend(name: str) -> type[Comm]:
    """The ``Comm`` class registered as ``name``; ValueError naming the known ones otherwise."""
    try:
        entry = _BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown comm backend {name!r}; registered: {', '.join(_BACKENDS)} "
                         "(tawpipe.runtime.comm.register adds one)") from None
    if isinstance(entry, str):
        module, _, cls = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), cls)
        except ImportError as e:
            raise ValueError(f"comm backend {name!r} is not available in this installation: {e}") from None
        _BACKENDS[name] = entry
    return entry


def create(name: str, topology: Topology, timeout: float, device: torch.device) -> Comm:
    """The backend registered as ``name``, built for this job (see ``Comm.create``)."""
    return backend(name).create(topology, timeout, device)
