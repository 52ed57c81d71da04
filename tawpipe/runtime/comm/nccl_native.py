"""Native NCCL backend: tawpipe's own communicators and grouped launches (tawpipe._nccl, C++ in
csrc/kernels/nccl_group.*), behind the engine's Comm interface and callable on its own.

Why not torch.distributed's NCCL: one slot's operations (the rail P2P sends and receives, and
the group broadcast or reduce) go out in one ncclGroupStart/End on the channel's stream, from
one call, with no per-call process-group bookkeeping.

Bootstrap: rank 0 of a gloo group makes an ncclUniqueId and broadcasts it over that group (the
CPU group torch.distributed already has); every rank then joins the world communicator on its
device. Topology groups are ncclCommSplit's of it (color = node), and so is each group that
``add_groups`` names (one split per group, members ordered by rank). ``channel_comm(name)`` splits
a fresh world and set of groups for each channel, so channels never share a communicator.

Blocking and timeouts: every communicator is non-blocking; each call polls
ncclCommGetAsyncError and a CUDA event against the timeout, aborts its communicators on an error
or at the deadline, and raises (``CommTimeout`` for the deadline). Ops called through ``NcclComm``
return when complete on the device (the engine calls them from its channel threads, never from
the compute thread); ``Batch.run(wait=False)`` plus ``synchronize`` queue several first.

Bad input fails before any communication: tensors on the wrong device or of an unsupported
dtype, peers or roots outside the group, a rank calling a group it is not in. Sizes that must
agree across ranks are compared over gloo before NCCL sees them (``check="always"``, the default:
one small gloo exchange with the same peers per call, which also waits for them, as the blocking
NCCL call would; ``check="off"`` skips it once a configuration is known to be good). The check
runs on every call, not once per signature: if one side skipped a signature it had seen, its
peer's next exchange would pair with the wrong call and report a misleading mismatch.

One NCCL per process: the extension links libnccl.so.2 by SONAME with an rpath to the
nvidia-nccl wheel that torch loads; importing this module fails if a second libnccl is mapped
or if torch's NCCL version differs.

Multi-rank NCCL needs one GPU per rank: this backend is tested at world size 1 on a GPU and with
gloo for its checks; torch.distributed stays the engine's default.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ...plan.actions import Channel
from ...plan.topology import Topology
from .base import P2P, Comm, CommTimeout, Group
from .torch_dist import check_job, check_same

try:
    from tawpipe import _nccl
except ImportError as _exc:
    raise ImportError(
        "tawpipe.runtime.comm.nccl_native needs the tawpipe._nccl extension, which is built only where a CUDA "
        "build of torch, nvcc and NCCL's nccl.h (the nvidia-nccl-cu* wheel that CUDA torch installs) are "
        f"found; this installation has none ({_exc}). Install them and rebuild with "
        "`pip install --no-build-isolation -e .` (TAWPIPE_BUILD_NCCL=1 turns a missing NCCL into a build "
        "error), or use the torch.distributed backend (tawpipe.runtime.comm.torch_dist.TorchDistComm)."
    ) from _exc

NcclError = _nccl.NcclError
CHECK_MODES = ("always", "off")


def loaded_nccl_libraries() -> list[str]:
    """Distinct libnccl files mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(maxsplit=5)[-1].strip() for line in f if "libnccl.so" in line}
    except OSError:
        return []
    # libnccl.so* only: network plugins (libnccl-net*.so) are not a second NCCL
    return sorted({os.path.realpath(p) for p in paths if os.path.basename(p).startswith("libnccl.so")})


def _check_one_nccl() -> None:
    libs = loaded_nccl_libraries()
    if len(libs) > 1:
        raise ImportError(
            f"two NCCL libraries are loaded ({', '.join(libs)}): tawpipe._nccl must use torch's. Rebuild tawpipe "
            "with the nvidia-nccl wheel that torch depends on installed (setup.py links it by SONAME)"
        )
    ours = _nccl.version()
    if torch.cuda.is_available() and torch.version.cuda is not None:
        major, minor, patch = torch.cuda.nccl.version()
        theirs = major * 10000 + minor * 100 + patch
        if theirs != ours:
            raise ImportError(
                f"tawpipe._nccl runs NCCL {_nccl.version_string()} but torch uses {major}.{minor}.{patch}: "
                "two NCCLs in one process. Rebuild tawpipe against torch's nvidia-nccl wheel"
            )


_check_one_nccl()


def nccl_version() -> str:
    """Version of the NCCL library this backend (and torch) runs, e.g. '2.27.3'."""
    return _nccl.version_string()


def _dtype_code(dtype: torch.dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    try:
        return _nccl.dtypes[name]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be communicated; supported: {sorted(_nccl.dtypes)}") from None


def _as_timeout(error: Exception) -> Exception:
    return CommTimeout(str(error)) if isinstance(error, _nccl.NcclTimeout) else error


def _abort_live_communicators() -> None:
    """At interpreter exit, free the communicators while CUDA still works: a communicator freed
    later, by the garbage collector during teardown, crashes the exiting process."""
    for c in list(_LIVE):
        if not c._native.aborted:
            c._native.abort("process exit")


_LIVE: weakref.WeakSet = weakref.WeakSet()
atexit.register(_abort_live_communicators)


class Communicator:
    """One NCCL communicator on one CUDA device; ranks, peers and roots are its own ranks.

    Each op call checks its tensors, then runs alone in one NCCL group and returns when complete
    (raising after ``timeout`` seconds); ``Batch`` groups several.
    """

    def __init__(self, native: _nccl.Communicator, timeout: float) -> None:
        self._native = native
        self.timeout = timeout
        _LIVE.add(self)

    @classmethod
    def from_process_group(
        cls, group: dist.ProcessGroup | None = None, device: int | None = None, timeout: float = 300.0
    ) -> Communicator:
        """Join a communicator of the ranks of ``group``: a gloo (CPU) group; None: a new gloo
        group of the whole job. Collective over the group's ranks."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first")
        if group is None:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        device = torch.cuda.current_device() if device is None else int(device)
        uid = torch.zeros(128, dtype=torch.uint8)
        if dist.get_rank(group) == 0:
            uid = torch.frombuffer(bytearray(_nccl.unique_id()), dtype=torch.uint8)
        root = dist.get_global_rank(group, 0)
        dist.broadcast(uid, src=root, group=group, async_op=True).wait(timedelta(seconds=timeout))
        native = _nccl.Communicator.create(
            bytes(uid.tolist()), dist.get_world_size(group), dist.get_rank(group), device, timeout
        )
        return cls(native, timeout)

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def size(self) -> int:
        return self._native.size

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._native.device)

    def split(self, color: int | None, key: int) -> Communicator | None:
        """ncclCommSplit (collective over this communicator): ranks of equal ``color`` form a
        new communicator ordered by ``key``; ``color=None`` joins none and returns None."""
        try:
            native = self._native.split(-1 if color is None else int(color), int(key), self.timeout)
        except _nccl.NcclError as e:
            raise _as_timeout(e) from e
        return None if native is None else Communicator(native, self.timeout)

    def abort(self, reason: str = "aborted by the caller") -> None:
        self._native.abort(reason)

    def _run(self, fill) -> None:
        b = Batch()
        fill(b)
        b.run(self.timeout)

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self._run(lambda b: b.send(self, tensor, peer))

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        self._run(lambda b: b.recv(self, tensor, peer))

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self._run(lambda b: b.broadcast(self, tensor, root))

    def reduce(self, tensor: torch.Tensor, root: int) -> None:
        self._run(lambda b: b.reduce(self, tensor, root))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self._run(lambda b: b.all_reduce(self, tensor))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._run(lambda b: b.all_gather(self, output, input))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._run(lambda b: b.reduce_scatter(self, output, input))


class Batch:
    """Operations issued together in one ncclGroupStart/End (communicators of one device).

    In-place collectives (broadcast, reduce and all_reduce work on ``tensor`` itself); sums.
    All checks that need no other rank run when an op is added.
    """

    def __init__(self) -> None:
        self._ops: list[tuple] = []
        self._tensors: list[torch.Tensor] = []  # alive until the batch has run
        self._comms: list[Communicator] = []

    def __len__(self) -> int:
        return len(self._ops)

    def _tensor(self, comm: Communicator, t: torch.Tensor, what: str) -> int:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"nccl {what}: expected a tensor, got {type(t).__name__}")
        if t.device != comm.device:
            raise ValueError(
                f"nccl {what}: tensor is on {t.device} but the communicator is on {comm.device}; "
                "move the tensor to the communicator's device"
            )
        if not t.is_contiguous():
            raise ValueError(f"nccl {what}: tensor must be contiguous (call .contiguous())")
        if self._comms and comm.device != self._comms[0].device:
            raise ValueError(f"nccl {what}: a batch runs on one device, got {self._comms[0].device} and {comm.device}")
        self._tensors.append(t)
        self._comms.append(comm)
        return _dtype_code(t.dtype)

    @staticmethod
    def _rank(comm: Communicator, r: int, role: str, what: str) -> int:
        if not isinstance(r, int) or not 0 <= r < comm.size:
            raise ValueError(f"nccl {what}: {role} {r!r} is not a rank of this communicator of {comm.size}")
        return r

    def _add(self, kind: str, comm: Communicator, send: int, recv: int, count: int, dtype: int, peer: int) -> Batch:
        self._ops.append((_nccl.kinds[kind], comm._native, send, recv, count, dtype, peer))
        return self

    def send(self, comm: Communicator, tensor: torch.Tensor, peer: int) -> Batch:
        d = self._tensor(comm, tensor, "send")
        peer = self._rank(comm, peer, "peer", "send")
        return self._add("send", comm, tensor.data_ptr(), 0, tensor.numel(), d, peer)

    def recv(self, comm: Communicator, tensor: torch.Tensor, peer: int) -> Batch:
        d = self._tensor(comm, tensor, "recv")
        peer = self._rank(comm, peer, "peer", "recv")
        return self._add("recv", comm, 0, tensor.data_ptr(), tensor.numel(), d, peer)

    def broadcast(self, comm: Communicator, tensor: torch.Tensor, root: int) -> Batch:
        d = self._tensor(comm, tensor, "broadcast")
        root = self._rank(comm, root, "root", "broadcast")
        return self._add("broadcast", comm, tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), d, root)

    def reduce(self, comm: Communicator, tensor: torch.Tensor, root: int) -> Batch:
        d = self._tensor(comm, tensor, "reduce")
        root = self._rank(comm, root, "root", "reduce")
        return self._add("reduce", comm, tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), d, root)

    def all_reduce(self, comm: Communicator, tensor: torch.Tensor) -> Batch:
        d = self._tensor(comm, tensor, "all_reduce")
        return self._add("all_reduce", comm, tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), d, 0)

    def _pair(self, comm: Communicator, output: torch.Tensor, input: torch.Tensor, what: str, big: str) -> int:
        d = self._tensor(comm, output, what)
        if self._tensor(comm, input, what) != d:
            raise ValueError(f"nccl {what}: input is {input.dtype} but output is {output.dtype}")
        small, large = (input, output) if big == "output" else (output, input)
        if large.numel() != small.numel() * comm.size:
            raise ValueError(
                f"nccl {what}: {big} has {large.numel()} elements, need {comm.size} x {small.numel()} "
                f"(communicator size x per-rank elements)"
            )
        return d

    def all_gather(self, comm: Communicator, output: torch.Tensor, input: torch.Tensor) -> Batch:
        d = self._pair(comm, output, input, "all_gather", "output")
        return self._add("all_gather", comm, input.data_ptr(), output.data_ptr(), input.numel(), d, 0)

    def reduce_scatter(self, comm: Communicator, output: torch.Tensor, input: torch.Tensor) -> Batch:
        d = self._pair(comm, output, input, "reduce_scatter", "input")
        return self._add("reduce_scatter", comm, input.data_ptr(), output.data_ptr(), output.numel(), d, 0)

    def run(self, timeout: float, *, wait: bool = True, stream: torch.cuda.Stream | None = None) -> None:
        """Issue every op in one NCCL group on ``stream`` (default: the device's current one);
        with ``wait``, return when they have completed. Raises CommTimeout after ``timeout``."""
        if not self._ops:
            return
        device = self._comms[0].device
        stream = stream if stream is not None else torch.cuda.current_stream(device)
        try:
            _nccl.run_group(self._ops, stream.cuda_stream, float(timeout), wait)
        except _nccl.NcclError as e:
            raise _as_timeout(e) from e


def synchronize(comms: Sequence[Communicator], timeout: float, stream: torch.cuda.Stream | None = None) -> None:
    """Wait for the work queued on ``stream`` (default: current), aborting ``comms`` at the
    deadline or on an asynchronous NCCL error; bounds runs of ``Batch.run(wait=False)``."""
    stream = stream if stream is not None else torch.cuda.current_stream(comms[0].device)
    try:
        _nccl.synchronize([c._native for c in comms], stream.cuda_stream, float(timeout))
    except _nccl.NcclError as e:
        raise _as_timeout(e) from e


@dataclass(frozen=True)
class GroupOp:
    """A broadcast or reduce over a topology group, to batch with P2P (see NcclComm.batch)."""

    op: str  # "broadcast" | "reduce"
    tensor: torch.Tensor
    root: int
    group: Group


class _SizeCheck:
    """Compares, over gloo, what each rank is about to communicate with what its peers are,
    so that a size, dtype or root mismatch is an error naming both sides instead of a hang."""

    _SEND_TAG, _RECV_TAG = 7301, 7302

    def __init__(self, rank: int, world: dist.ProcessGroup, groups: dict[Group, dist.ProcessGroup],
                 timeout: float) -> None:
        self.rank, self.world, self.groups = rank, world, groups
        self.timeout = timedelta(seconds=timeout)

    def _wait(self, works: list, what: str) -> None:
        try:
            for w in works:
                w.wait(self.timeout)
        except RuntimeError as e:
            raise CommTimeout(
                f"rank {self.rank}: the size check of {what} got no answer within "
                f"{self.timeout.total_seconds():.0f}s: a peer did not post the matching operation ({e})"
            ) from e

    def p2p(self, ops: Sequence[P2P]) -> None:
        ops = [o for o in ops if o.peer != self.rank]
        if not ops:
            return
        works, theirs = [], []
        for o in ops:
            mine = torch.tensor([o.tensor.numel(), _dtype_code(o.tensor.dtype)], dtype=torch.int64)
            other = torch.empty(2, dtype=torch.int64)
            # A send's description travels with SEND_TAG, a receive's with RECV_TAG, so a rank
            # that both sends to and receives from one peer pairs each with its counterpart.
            out_tag, in_tag = (self._SEND_TAG, self._RECV_TAG) if o.op == "send" else (self._RECV_TAG, self._SEND_TAG)
            works.append(dist.isend(mine, o.peer, group=self.world, tag=out_tag))
            works.append(dist.irecv(other, o.peer, group=self.world, tag=in_tag))
            theirs.append(other)
        self._wait(works, f"{len(ops)} point-to-point transfer(s)")
        for o, other in zip(ops, theirs):
            numel, code = other.tolist()
            if numel != o.tensor.numel() or code != _dtype_code(o.tensor.dtype):
                way = "to" if o.op == "send" else "from"
                raise ValueError(
                    f"rank {self.rank}: {o.op} of {o.tensor.numel()} x {o.tensor.dtype} {way} rank {o.peer}, but "
                    f"rank {o.peer} posted {numel} elements of NCCL type {code}: sizes and dtypes must match"
                )

    def collective(self, op: str, tensor: torch.Tensor, root: int, group: Group) -> None:
        if len(group) == 1:
            return
        mine = torch.tensor([tensor.numel(), _dtype_code(tensor.dtype), root], dtype=torch.int64)
        everyone = [torch.empty(3, dtype=torch.int64) for _ in group]
        self._wait([dist.all_gather(everyone, mine, group=self.groups[group], async_op=True)], f"{op} over {group}")
        rows = [t.tolist() for t in everyone]
        if any(row != rows[0] for row in rows):
            seen = ", ".join(f"rank {r}: {n} x type {c} root {rt}" for r, (n, c, rt) in zip(group, rows))
            raise ValueError(f"{op} over {group}: ranks disagree on size, dtype or root ({seen})")


class NcclComm(Comm):
    """The engine's Comm over tawpipe's own NCCL communicators (global ranks throughout)."""

    # add_groups makes a communicator for any group, but replicas on this backend (their channel,
    # their all-reduces) have not run on GPUs: the engine keeps them to comm='torch'
    supports_replicas = False

    @classmethod
    def create(cls, topology: Topology, timeout: float, device: torch.device) -> NcclComm:
        # no per-call size exchange: every size comes from the engine's plan, which the setup
        # program's CHECK proves identical on every rank
        return cls(topology, timeout, device=device, check="off")

    def __init__(
        self,
        topology: Topology,
        timeout: float,
        *,
        device: torch.device | int | None = None,
        check: str = "always",
        _channel: str = Channel.WEIGHTS,
        _parent: NcclComm | None = None,
    ) -> None:
        check_job(topology)
        if check not in CHECK_MODES:
            raise ValueError(f"check must be one of {CHECK_MODES}, got {check!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("the nccl-native backend needs a CUDA device; on the CPU use TorchDistComm (gloo)")
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"device must be a CUDA device with an index, got {device!r}")
        self.topology, self.timeout, self.name, self._check_mode = topology, timeout, _channel, check
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._world_ranks: Group = tuple(range(self.world_size))
        self._topology_groups = tuple(topology.group_ranks(g) for g in range(topology.nodes))
        self._my_group: Group = topology.group_ranks(topology.group_of(self.rank))
        self._added: dict[Group, Communicator | None] = {}  # add_groups' groups; None: not a member
        # CPU groups of this channel (every rank creates them, in the same order): the unique id
        # exchange and the size checks.
        td = timedelta(seconds=timeout)
        gloo_world = dist.new_group(list(self._world_ranks), timeout=td, backend="gloo")
        gloo_groups = {self._world_ranks: gloo_world}
        for g in range(topology.nodes):
            ranks = topology.group_ranks(g)
            if ranks != self._world_ranks:
                gloo_groups[ranks] = dist.new_group(list(ranks), timeout=td, backend="gloo")
        self._check = _SizeCheck(self.rank, gloo_world, gloo_groups, timeout) if check == "always" else None
        if _parent is None:
            self._world = Communicator.from_process_group(gloo_world, self.device.index, timeout)
        else:
            self._world = _parent._world.split(0, self.rank)
        self._group = self._world.split(topology.group_of(self.rank), self.rank)
        self._channels: dict[str, NcclComm] = {_channel: self}

    def channel_comm(self, name: str) -> Comm:
        if name not in self._channels:
            channel = NcclComm(
                self.topology, self.timeout, device=self.device, check=self._check_mode, _channel=name, _parent=self
            )
            channel._split(list(self._added))
            self._channels[name] = channel
        return self._channels[name]

    def add_groups(self, groups: Sequence[Group]) -> None:
        if not groups:  # nothing to make (the engine's plans without replicas): no collective either
            return
        groups = [tuple(g) for g in groups]
        check_same(self.rank, self.world_size, groups, "groups", "give every rank the same groups, in the same order")
        for comm in self._channels.values():
            comm._split(groups)

    def _split(self, groups: Sequence[Group]) -> None:
        """A communicator (and, with checks on, a gloo group) for each of ``groups`` beyond the world
        and the topology's: one ncclCommSplit of the world each, which every rank joins."""
        for g in groups:
            if g == self._world_ranks or g in self._topology_groups or g in self._added:
                continue
            self._added[g] = self._world.split(0 if self.rank in g else None, self.rank)
            if self._check is not None and len(g) > 1:
                self._check.groups[g] = dist.new_group(list(g), timeout=timedelta(seconds=self.timeout),
                                                       backend="gloo")

    def _resolve(self, group: Group, root: int | None, what: str) -> tuple[Communicator, int]:
        group = tuple(group)
        if group == self._world_ranks:
            comm = self._world
        elif group == self._my_group:
            comm = self._group
        elif self._added.get(group) is not None:
            comm = self._added[group]
        elif self.rank not in group and (group in self._added or group in self._topology_groups):
            raise ValueError(f"{what}: rank {self.rank} is not in group {group}; only its members call it")
        else:
            raise ValueError(f"{what}: group {group} is not a topology group, the world or a group added with "
                             f"add_groups ({self.topology})")
        if root is not None and root not in group:
            raise ValueError(f"{what}: root {root} is not in group {group}")
        return comm, (sorted(group).index(root) if root is not None else 0)

    def _p2p_rank(self, peer: int, what: str) -> int:
        if not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise ValueError(f"{what}: peer {peer!r} is outside 0..{self.world_size - 1}")
        return peer

    def batch(self, items: Sequence[P2P | GroupOp]) -> None:
        """Run P2P transfers and group broadcasts/reduces in one NCCL group; return when done.

        The items must not depend on each other (a broadcast of what a receive of the same batch
        brings in is not ordered after it): batch a slot's rail transfers with the broadcast of
        a chunk that is already here.
        """
        b = Batch()
        p2p = []
        for item in items:
            if isinstance(item, P2P):
                peer = self._p2p_rank(item.peer, item.op)
                (b.send if item.op == "send" else b.recv)(self._world, item.tensor, peer)
                p2p.append(item)
            elif isinstance(item, GroupOp):
                comm, root = self._resolve(item.group, item.root, item.op)
                (b.broadcast if item.op == "broadcast" else b.reduce)(comm, item.tensor, root)
            else:
                raise TypeError(f"batch items are P2P or GroupOp, got {type(item).__name__}")
        if self._check is not None:
            self._check.p2p(p2p)
            for item in items:
                if isinstance(item, GroupOp):
                    self._check.collective(item.op, item.tensor, item.root, tuple(item.group))
        b.run(self.timeout)

    def batch_p2p(self, ops: Sequence[P2P]) -> None:
        self.batch(ops)

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self.batch([P2P("send", tensor, peer)])

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        self.batch([P2P("recv", tensor, peer)])

    def broadcast(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        self.batch([GroupOp("broadcast", tensor, root, tuple(group))])

    def reduce(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        self.batch([GroupOp("reduce", tensor, root, tuple(group))])

    def all_reduce(self, tensor: torch.Tensor, group: Group) -> None:
        self._rootless("all_reduce", group, tensor, lambda b, comm: b.all_reduce(comm, tensor))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group) -> None:
        self._rootless("all_gather", group, input, lambda b, comm: b.all_gather(comm, output, input))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: Group) -> None:
        self._rootless("reduce_scatter", group, input, lambda b, comm: b.reduce_scatter(comm, output, input))

    def _rootless(self, what: str, group: Group, tensor: torch.Tensor, add: Callable[[Batch, Communicator], Batch]
                  ) -> None:
        """A collective of the whole ``group`` (``tensor``: what every member sends, the same size
        everywhere), alone in one NCCL group; returns when done."""
        comm, _ = self._resolve(group, None, what)
        b = add(Batch(), comm)
        if self._check is not None:
            self._check.collective(what, tensor, -1, tuple(group))
        b.run(self.timeout)
