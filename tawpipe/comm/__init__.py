"""Communication backends behind one interface (see base.Comm)."""

from .base import Channel, Comm, CommTimeout, Handle
from .instrument import CommRecord, DelayComm, RecordingComm

__all__ = ["Channel", "Comm", "CommRecord", "CommTimeout", "DelayComm", "Handle", "RecordingComm"]
