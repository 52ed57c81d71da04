"""gloo for tensors on a GPU, staged through pinned host memory: several ranks on one GPU.

NCCL refuses two ranks on one device. A job that runs several processes on a single GPU (to
measure each rank's own device memory, or to run every schedule's CUDA paths, streams, events
and offload beyond world size 1, on one GPU) carries its transfers over gloo instead: each call
copies its tensors into pinned host memory, runs gloo's call there and copies what arrived back,
on the channel's stream. On the CPU the copies are host copies, so the staging runs wherever the
tests do. It exists for measurement and tests, not speed: every byte crosses PCIe twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...plan.topology import Topology
from .base import P2P, Group
from .torch_dist import TorchDistComm


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``tensor`` (pinned where it comes from a GPU); the copy is
    complete when this returns, so the device tensor may change after."""
    return _host_like(tensor).copy_(tensor)


def _host_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)


class StagedComm(TorchDistComm):
    """``TorchDistComm`` over gloo whatever the device, each call staged through host memory."""

    # Messages go in batches on their channel: a staged receive is copied back after its wait,
    # in order on the channel's stream, which single posted messages would not give.
    async_p2p = False

    @classmethod
    def create(cls, topology: Topology, timeout: float, device: torch.device) -> StagedComm:
        return cls(topology, timeout, backend="gloo")

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        super().send(_to_host(tensor), peer)

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        host = _host_like(tensor)
        super().recv(host, peer)
        tensor.copy_(host)

    def batch_p2p(self, ops: Sequence[P2P]) -> None:
        staged = [P2P(o.op, _to_host(o.tensor) if o.op == "send" else _host_like(o.tensor), o.peer) for o in ops]
        super().batch_p2p(staged)
        for o, s in zip(ops, staged):
            if o.op == "recv":
                o.tensor.copy_(s.tensor)

    def broadcast(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        host = _to_host(tensor)
        super().broadcast(host, root, group)
        if self.rank != root:
            tensor.copy_(host)

    def reduce(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        host = _to_host(tensor)
        super().reduce(host, root, group)
        if self.rank == root:
            tensor.copy_(host)

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> None:
        host = _to_host(tensor)
        super().all_reduce(host, group)
        tensor.copy_(host)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group) -> None:
        host = _host_like(output)
        super().all_gather(host, _to_host(input), group)
        output.copy_(host)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: Group) -> None:
        host = _host_like(output)
        super().reduce_scatter(host, _to_host(input), group)
        output.copy_(host)
