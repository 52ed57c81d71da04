"""Comm over torch.distributed: gloo on the CPU, NCCL on CUDA.

Process groups are created eagerly (every rank must create them in the same order): one world
clone for point-to-point traffic, one subgroup per topology group and one per extra group the
caller names (a plan's replica groups), per channel, so that each channel's operations never
interleave with another channel's. A topology group of one rank needs none; a group of one that
the caller names gets one (``tawpipe bench comm`` times the backend's call over it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ...plan.actions import Channel
from ...plan.topology import Topology
from .base import P2P, Comm, CommTimeout, Group


def check_job(topology: Topology) -> None:
    """torch.distributed is up, with as many processes as ``topology`` names (every backend
    builds on its process group)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call tawpipe.runtime.launch.init_distributed() "
            "(or dist.init_process_group) before building the engine"
        )
    if dist.get_world_size() != topology.world_size:
        raise ValueError(
            f"topology has {topology.world_size} ranks ({topology.nodes} nodes x "
            f"{topology.per_node}) but the job has {dist.get_world_size()}; "
            "launch as many processes as the topology names"
        )


class TorchDistComm(Comm):
    """torch.distributed's process groups (gloo on the CPU, NCCL on GPUs), one set per channel."""

    @classmethod
    def create(cls, topology: Topology, timeout: float, device: torch.device) -> TorchDistComm:
        check_job(topology)  # before the backend is asked of a process group that may not be there
        return cls(topology, timeout, backend=_backend_for(device))

    def __init__(self, topology: Topology, timeout: float, _channel: str = Channel.WEIGHTS,
                 _groups: tuple[Group, ...] = (), *, backend: str | None = None) -> None:
        """``backend``: the process groups' (gloo, nccl); None: the job's default."""
        check_job(topology)
        self.topology = topology
        self.timeout = timeout
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.name = _channel
        self._backend = backend
        if _channel == Channel.WEIGHTS:  # the first channel: agree on the groups before creating them
            check_same(self.rank, self.world_size, (topology.nodes, topology.per_node), "topology",
                       "give every rank the same Topology(nodes, per_node)")
        td = timedelta(seconds=timeout)
        world = tuple(range(self.world_size))
        self._groups: dict[Group, dist.ProcessGroup] = {world: dist.new_group(list(world), timeout=td,
                                                                              backend=backend)}
        self._extra: tuple[Group, ...] = ()  # groups added beyond the topology's
        self._create(self.topology_groups, own=True)
        self._create(_groups)
        # Point-to-point messages from a lower to a higher rank go on one connection per pair, the
        # other way on a second: a connection then carries bulk data one way only. On one shared
        # connection, the control messages a transfer needs (gloo's "ready to receive") queue
        # behind the other direction's payload, and a two-way swap ran at half speed (design §5.2).
        self._up, self._down = self._groups[world], dist.new_group(list(world), timeout=td, backend=backend)
        self._channels: dict[str, Comm] = {_channel: self}

    def channel_comm(self, name: str) -> Comm:
        # Created on first use; every rank asks for the same channels in the same order.
        if name not in self._channels:
            self._channels[name] = type(self)(self.topology, self.timeout, _channel=name, _groups=self._extra,
                                              backend=self._backend)
        return self._channels[name]

    def add_groups(self, groups: Sequence[Group]) -> None:
        check_same(self.rank, self.world_size, [tuple(g) for g in groups], "groups",
                   "give every rank the same plan options (replicas)")
        for comm in self._channels.values():
            comm._create(groups)

    def _create(self, groups: Iterable[Group], own: bool = False) -> None:
        """A process group for each of ``groups`` this comm lacks (every rank, the same order);
        of the topology's ``own`` groups, only those of two ranks or more."""
        td = timedelta(seconds=self.timeout)
        for ranks in map(tuple, groups):
            if ranks in self._groups or (own and len(ranks) == 1):
                continue
            self._groups[ranks] = dist.new_group(list(ranks), timeout=td, backend=self._backend)
            self._extra += () if own else (ranks,)

    @property
    def topology_groups(self) -> tuple[Group, ...]:
        return tuple(self.topology.group_ranks(g) for g in range(self.topology.nodes))

    def _pg(self, group: Group) -> dist.ProcessGroup:
        try:
            return self._groups[tuple(group)]
        except KeyError:
            raise ValueError(f"group {group} is not a topology group, the world or a group added with "
                             "add_groups") from None

    def _line(self, src: int, dst: int) -> dist.ProcessGroup:
        return self._up if src < dst else self._down

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        dist.send(tensor, dst=peer, group=self._line(self.rank, peer))

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        dist.recv(tensor, src=peer, group=self._line(peer, self.rank))

    @property
    def async_p2p(self) -> bool:
        """gloo matches messages by (peer, tag) whatever the order they are posted in."""
        return dist.get_backend(self._up) == "gloo"

    def _isend_irecv(self, op: P2P, tag: int = 0) -> dist.Work:
        if op.op == "send":
            return dist.isend(op.tensor, op.peer, group=self._line(self.rank, op.peer), tag=tag)
        return dist.irecv(op.tensor, op.peer, group=self._line(op.peer, self.rank), tag=tag)

    def post(self, op: P2P, tag: int) -> _Posted:
        return _Posted(self._isend_irecv(op, tag))

    def batch_p2p(self, ops: Sequence[P2P]) -> None:
        works = [self._isend_irecv(o) for o in ops]
        for w in works:
            w.wait()

    def broadcast(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        dist.broadcast(tensor, src=root, group=self._pg(group))

    def reduce(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        dist.reduce(tensor, dst=root, op=dist.ReduceOp.SUM, group=self._pg(group))

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._pg(group))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group) -> None:
        dist.all_gather(_pieces(output, input, group, "all_gather", "output"), input, group=self._pg(group))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: Group) -> None:
        dist.reduce_scatter(output, _pieces(input, output, group, "reduce_scatter", "input"), op=dist.ReduceOp.SUM,
                            group=self._pg(group))


def _pieces(whole: torch.Tensor, piece: torch.Tensor, group: Group, what: str, name: str) -> list[torch.Tensor]:
    """``whole`` as one view per member of ``group``, each the size of ``piece``."""
    if whole.numel() != piece.numel() * len(group):
        raise ValueError(f"{what}: {name} has {whole.numel()} elements, need {len(group)} x {piece.numel()} "
                         "(group size x per-rank elements)")
    return list(whole.view(-1).split(piece.numel()))


def _backend_for(device: torch.device) -> str | None:
    """The process groups' backend for tensors on ``device``: the job's default where it serves
    them (None), else gloo for the CPU or NCCL for CUDA (a local job's gloo with GPU tensors)."""
    want = "nccl" if device.type == "cuda" else "gloo"
    return None if want in dist.get_backend() else want


class _Posted:
    """A posted torch.distributed message whose wait has a limit."""

    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def wait(self, timeout: float) -> None:
        try:
            self._work.wait(timedelta(seconds=timeout))
        except RuntimeError as e:
            if "timeout" not in str(e).lower():  # gloo: "Application timeout caused pair closure"
                raise
            raise CommTimeout(f"timed out after {timeout:.0f}s ({e}); a peer is missing or stuck "
                              "(raise the timeout with TAWPIPE_TIMEOUT for slow links)") from e


def check_same(rank: int, world: int, mine: object, what: str, fix: str) -> None:
    """Every rank creates the same process groups in the same order; ranks that disagree on them
    would create different groups and hang, so compare first (one small all-gather)."""
    seen: list = [None] * world
    dist.all_gather_object(seen, mine)
    for r, theirs in enumerate(seen):
        if theirs != seen[0]:
            raise ValueError(f"rank {r} has {what} {_short(theirs)} but rank 0 has {_short(seen[0])} (this is rank "
                             f"{rank}): {fix}")


def _short(value: object) -> str:
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return f"{value[0]}x{value[1]}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
