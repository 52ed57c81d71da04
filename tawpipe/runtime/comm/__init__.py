"""Communication backends behind one interface (``base.Comm``), registered by name (``registry``).

The names below are loaded on first use (PEP 562): the registry's names cost no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import P2P, ChannelQueue, Comm, CommTimeout, Handle
    from .instrument import CommRecord, DelayComm, RecordingComm
    from .registry import backend, create, names, register, unregister

_LAZY = {  # public name: the module of this package that defines it
    **dict.fromkeys(("P2P", "ChannelQueue", "Comm", "CommTimeout", "Handle"), "base"),
    **dict.fromkeys(("CommRecord", "DelayComm", "RecordingComm"), "instrument"),
    **dict.fromkeys(("backend", "create", "names", "register", "unregister"), "registry"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
