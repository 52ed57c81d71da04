"""Comm wrappers for measurement: record every operation, or slow every operation down.

Recording is how tests prove that executed traffic equals the plan; the delay emulates a slower
link so overlap can be measured on one machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ...plan.actions import Channel
from .base import P2P, Comm, Group


@dataclass(frozen=True)
class CommRecord:
    op: str  # send | recv | broadcast | reduce | all_reduce
    channel: str
    peer: int | None
    root: int | None
    group: Group | None
    bytes: int


class _Wrapper(Comm):
    def __init__(self, inner: Comm, channel: str = Channel.WEIGHTS) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.channel = channel
        self._channels: dict[str, Comm] = {channel: self}

    @property
    def supports_replicas(self) -> bool:  # type: ignore[override]
        """The wrapped backend's: a wrapper adds no collectives."""
        return self.inner.supports_replicas

    def _wrap(self, inner: Comm, name: str) -> Comm:
        raise NotImplementedError

    def channel_comm(self, name: str) -> Comm:
        if name not in self._channels:
            self._channels[name] = self._wrap(self.inner.channel_comm(name), name)
        return self._channels[name]

    def add_groups(self, groups):
        self.inner.add_groups(groups)

    def _before(self, op: str, tensor: torch.Tensor, peer=None, root=None, group=None) -> None:
        pass

    def send(self, tensor, peer):
        self._before("send", tensor, peer=peer)
        self.inner.send(tensor, peer)

    def recv(self, tensor, peer):
        self._before("recv", tensor, peer=peer)
        self.inner.recv(tensor, peer)

    def broadcast(self, tensor, root, group):
        self._before("broadcast", tensor, root=root, group=tuple(group))
        self.inner.broadcast(tensor, root, group)

    def reduce(self, tensor, root, group):
        self._before("reduce", tensor, root=root, group=tuple(group))
        self.inner.reduce(tensor, root, group)

    def all_reduce(self, tensor, group):
        self._before("all_reduce", tensor, group=tuple(group))
        self.inner.all_reduce(tensor, group)

    def batch_p2p(self, ops: list[P2P]) -> None:
        for o in ops:
            self._before(o.op, o.tensor, peer=o.peer)
        self.inner.batch_p2p(ops)

    def post(self, op: P2P, tag: int):
        self._before(op.op, op.tensor, peer=op.peer)
        return self.inner.post(op, tag)


class RecordingComm(_Wrapper):
    """Appends a CommRecord per operation to a list shared by all its channels."""

    @property
    def async_p2p(self) -> bool:
        return self.inner.async_p2p

    def __init__(self, inner: Comm, channel: str = Channel.WEIGHTS, log: list[CommRecord] | None = None) -> None:
        super().__init__(inner, channel)
        self.log: list[CommRecord] = [] if log is None else log

    def _wrap(self, inner: Comm, name: str) -> Comm:
        return RecordingComm(inner, name, self.log)

    def _before(self, op, tensor, peer=None, root=None, group=None):
        nbytes = tensor.numel() * tensor.element_size()
        self.log.append(CommRecord(op, self.channel, peer, root, group, nbytes))


class DelayComm(_Wrapper):
    """Sleeps `latency + bytes / bandwidth` seconds before each operation (on the comm thread).
    Its messages are not posted one by one (async_p2p False): a sleep must not run on whichever
    thread happens to post."""

    def __init__(self, inner: Comm, latency_s: float, bandwidth_Bps: float = float("inf"),
                 channel: str = Channel.WEIGHTS) -> None:
        super().__init__(inner, channel)
        self.latency_s = latency_s
        self.bandwidth_Bps = bandwidth_Bps

    def _wrap(self, inner: Comm, name: str) -> Comm:
        return DelayComm(inner, self.latency_s, self.bandwidth_Bps, name)

    def _before(self, op, tensor, peer=None, root=None, group=None):
        time.sleep(self.latency_s + tensor.numel() * tensor.element_size() / self.bandwidth_Bps)
