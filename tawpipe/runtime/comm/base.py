"""The communication interface the engine talks to, and the in-order channel that runs it.

A backend (`Comm`) offers blocking primitives over global ranks. The engine never calls them on
its own thread: it submits them to a `ChannelQueue`, which runs them one after another in submission
order (like a CUDA stream) on a worker thread, so communication overlaps the compute running on
the caller's thread. Every submission returns a `Handle`; work that needs the result waits on it,
always with a timeout.
"""

from __future__ import annotations

import abc
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from ...plan.topology import Topology
from .. import progress

Group = tuple[int, ...]


@dataclass(frozen=True)
class P2P:
    """One half of a point-to-point transfer, as posted in a batch (see Comm.batch_p2p)."""

    op: str  # "send" | "recv"
    tensor: torch.Tensor
    peer: int


class Comm(abc.ABC):
    """Blocking communication over the ranks of one job (global rank numbers throughout).

    A backend registered by name (``tawpipe.runtime.comm.register``) is built by ``create``, the
    one constructor the engine, ``tawpipe train --comm`` and ``tawpipe bench comm`` call."""

    rank: int
    world_size: int
    # collectives over groups beyond the topology's (a plan's replicas, design §3.5; context groups
    # smaller than a node, §3.6)
    supports_replicas = True

    @classmethod
    def create(cls, topology: Topology, timeout: float, device: torch.device) -> Comm:
        """The backend for the job ``topology`` describes, on ``device``, every wait bounded by
        ``timeout`` seconds; after ``torch.distributed`` is initialised (the launchers do it)."""
        raise NotImplementedError(f"{cls.__name__} is built by hand: pass an instance")

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, peer: int) -> None: ...

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, peer: int) -> None: ...

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int, group: Group) -> None: ...

    @abc.abstractmethod
    def reduce(self, tensor: torch.Tensor, root: int, group: Group) -> None:
        """Sum over `group` into `tensor` on `root`; other members' tensors are undefined after."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, group: Group) -> None: ...

    # Optional: context parallelism gathers a layer's keys and values and scatters their gradients
    # (design §3.6); ``tawpipe bench comm`` measures both. A plan's own programs use neither.
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group) -> None:
        """``output`` = every member's ``input``, concatenated in the order of their ranks
        (``output`` holds len(group) times ``input``'s elements)."""
        raise NotImplementedError(f"{type(self).__name__} has no all_gather")

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: Group) -> None:
        """``output`` = this member's piece of the sum over ``group`` of ``input``, cut into
        len(group) equal pieces in the order of the members' ranks."""
        raise NotImplementedError(f"{type(self).__name__} has no reduce_scatter")

    def batch_p2p(self, ops: Sequence[P2P]) -> None:
        """Post every send and receive of ``ops`` at once; return when all have completed.

        A batch lets a rank send and receive at the same time (full duplex, one NCCL group call).
        This default runs them one after another, which is correct for every plan (``verify``
        proves the blocking order deadlock-free too) but gives up the concurrency.
        """
        for o in ops:
            (self.send if o.op == "send" else self.recv)(o.tensor, o.peer)

    async_p2p = False  # True: post() works, and the executor posts each message when it is ready

    def post(self, op: P2P, tag: int) -> "Pending":
        """Post one send or receive, matched with its peer's by ``tag``, and return at once.

        Messages posted this way may be posted in any order, so a rank never holds a transfer
        back behind an unrelated one (design §5.2). Backends whose calls must be issued in the
        same order on every rank (NCCL) keep ``async_p2p = False`` and run ``batch_p2p`` in
        order on their channel instead."""
        raise NotImplementedError(f"{type(self).__name__} posts no single messages (async_p2p is False)")

    def add_groups(self, groups: Sequence[Group]) -> None:
        """Make collectives over ``groups`` possible, on this comm and every channel it has made
        or will make (a plan's ``replica_groups``, context groups smaller than a node). Every rank
        calls it with the same groups. This default has none beyond the world and the topology's
        groups (the engine refuses what would need them before building a backend)."""
        if any(len(g) > 1 for g in groups):
            raise NotImplementedError(f"{type(self).__name__} has no collectives over groups beyond the topology's "
                                      "(replicas, context groups smaller than a node): use comm='torch'")

    @abc.abstractmethod
    def channel_comm(self, name: str) -> "Comm":
        """The Comm of channel ``name``: its operations never interleave with another channel's
        (its own process groups or communicators), so channels may run concurrently. Every rank
        must ask for the same channels in the same order."""


class CommTimeout(RuntimeError):
    pass


class Pending(Protocol):
    """A posted message: ``wait`` returns once it has completed, or raises after ``timeout`` s."""

    def wait(self, timeout: float) -> None: ...


class Handle:
    """Completion of one piece of work. On CUDA it also carries an event for stream ordering."""

    __slots__ = ("_done", "_error", "_event", "label", "start", "end", "_callbacks", "_lock")

    def __init__(self, label: str = "") -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._event: torch.cuda.Event | None = None
        self.label = label
        self.start = self.end = 0.0  # host time the work ran (issued, on CUDA), for traces
        self._callbacks: list[Callable[[Handle], None]] = []
        self._lock = threading.Lock()

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Call ``fn(self)`` once done: now if it is, else on the thread that finishes it."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    @property
    def error(self) -> BaseException | None:
        return self._error

    @staticmethod
    def completed(event: "torch.cuda.Event | None" = None, label: str = "") -> "Handle":
        h = Handle(label)
        h._event = event
        h._done.set()
        return h

    def _finish(self, error: BaseException | None = None, event: "torch.cuda.Event | None" = None) -> None:
        with self._lock:
            self._error, self._event = error, event
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float, stream: "torch.cuda.Stream | None" = None) -> None:
        """Block the host until issued (CPU: finished), then order `stream` (or the current CUDA
        stream) after the work's event."""
        if not self._done.wait(timeout):
            raise CommTimeout(
                f"timed out after {timeout:.0f}s waiting for {self.label or 'communication'}; "
                "a peer is missing or stuck (raise the timeout with TAWPIPE_TIMEOUT for slow links)"
                + progress.hint(min_age=timeout / 2)
            )
        if self._error is not None:
            timed_out = "timed out" in str(self._error).lower()  # the backend's own timeout came first
            cause = str(self._error) or type(self._error).__name__  # KeyboardInterrupt says nothing itself
            raise RuntimeError(f"{self.label} failed: {cause}"
                               + (progress.hint(min_age=timeout / 2) if timed_out else "")) from self._error
        if self._event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self._event)


class ChannelQueue:
    """Runs submitted work strictly in order on one worker thread.

    Before a piece of work starts, the channel waits for its dependencies (handles of earlier
    compute or of other channels). On CUDA, work runs on the channel's own stream and each handle
    records an event there; dependencies become stream waits, so the host never blocks on the GPU.
    """

    def __init__(self, name: str, timeout: float, device: torch.device) -> None:
        self.name = name
        self.timeout = timeout
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._queue: queue.Queue = queue.Queue()
        self._failed: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"tawpipe-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None], deps: Sequence[Handle] = (), label: str = "") -> Handle:
        if self._closed:
            raise RuntimeError(f"channel {self.name} is closed: work submitted now would never run")
        if self._failed is not None:
            raise RuntimeError(f"channel {self.name} failed earlier: {self._failed}") from self._failed
        handle = Handle(label)
        self._queue.put((fn, tuple(deps), handle))
        return handle

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, deps, handle = item
            if self._failed is not None:
                handle._finish(error=self._failed)
                continue
            try:
                event = None
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        for d in deps:
                            d.wait(self.timeout, self.stream)
                        handle.start = time.perf_counter()
                        fn()
                        event = torch.cuda.Event()
                        event.record(self.stream)
                else:
                    for d in deps:
                        d.wait(self.timeout)
                    handle.start = time.perf_counter()
                    fn()
                handle.end = time.perf_counter()
                handle._finish(event=event)
            except BaseException as e:  # noqa: BLE001 - surfaced to the waiter
                self._failed = e
                handle._finish(error=e)

    def drain(self) -> None:
        """Wait until everything submitted so far has finished (host-side)."""
        self.submit(lambda: None, label=f"{self.name} drain").wait(self.timeout)
        if self.stream is not None:
            self.stream.synchronize()

    def close(self, wait: float = 5.0) -> None:
        """Stop the worker after the work queued so far; a worker stuck in a transfer is left
        behind after ``wait`` seconds (it is a daemon thread, and its transfer has a timeout)."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=wait)
