"""Communication backends behind one interface (see base.Comm)."""

from .base import P2P, ChannelQueue, Comm, CommTimeout, Handle
from .instrument import CommRecord, DelayComm, RecordingComm

__all__ = ["P2P", "ChannelQueue", "Comm", "CommRecord", "CommTimeout", "DelayComm", "Handle", "RecordingComm"]
