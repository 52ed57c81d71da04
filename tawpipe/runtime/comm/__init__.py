"""Communication backends behind one interface (``base.Comm``), registered by name (``registry``).

The names below are loaded on first use (PEP 562): the registry's names cost no torch import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy

if TYPE_CHECKING:
    from .base import P2P, ChannelQueue, Comm, CommTimeout, Handle
    from .instrument import CommRecord, DelayComm, RecordingComm
    from .registry import backend, create, names, register, unregister

_NAMES = {  # public name: the module of this package that defines it
    **dict.fromkeys(("P2P", "ChannelQueue", "Comm", "CommTimeout", "Handle"), f"{__name__}.base"),
    **dict.fromkeys(("CommRecord", "DelayComm", "RecordingComm"), f"{__name__}.instrument"),
    **dict.fromkeys(("backend", "create", "names", "register", "unregister"), f"{__name__}.registry"),
}

__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy(__name__, _NAMES)
