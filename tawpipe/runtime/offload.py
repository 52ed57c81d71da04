"""Host offload, public API: a float32 state (master weights and gradient accumulator) in pinned
host memory, streamed to and from a device in pieces through the prefetcher
(csrc/kernels/prefetch.h). The device holds only compute-dtype weights and incoming gradients.

The public names are ``HostOffload``, ``OffloadMemory`` and ``DEFAULT_PIECE_NUMEL``; the engine
keeps a chunk owner's state in one (``MemoryPolicy(offload_state=True)``, ``tawpipe.engine.storage``) and
``tawpipe bench prefetch`` measures its streaming. Interface (``numel = layout.numel``)::

    off = HostOffload(layout, device, init=flat_fp32)  # state for the tensors of `layout`
    off.master, off.grad              # float32 host tensors (pinned on CUDA)
    off.load_weights_into(buf)        # buf[:numel] = master, cast to buf.dtype; stream-ordered:
                                      # the current stream of buf's device waits, the host does not
    off.load_weights_into(buf, a, b)  # elements a..b only (a piece the host has just stepped)
    off.accumulate_grad(gbuf, alpha)  # grad += alpha * gbuf[:numel]; returns when added (timeout)
    off.accumulate_grad(gbuf, squared_norm=True)  # ... and returns grad's sum of squares after it
                                      # (float64 scalar), taken in the same pass over grad
    off.accumulate_grad(gbuf, start=a, stop=b)  # elements a..b only
    off.synchronize()                 # queued loads have read the master (before it changes)
    off.memory()                      # bytes on the host and on the device
    off.close()

Overlap: a load waits for the current stream's earlier work (it overwrites buf) and makes that
stream wait for it, so compute queued later on the *same* stream waits too. Issue loads on a
stream that is not the compute stream (the engine uses its weights channel's) and make compute
wait on that stream's event before it reads the buffer; ``tawpipe bench prefetch`` measures
exactly this.

Without CUDA (CPU builds, or ``device="cpu"``) the same calls run through the host prefetcher:
plain copies, nothing pinned, so the engine's exactness tests run with offload on a CPU.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import ops  # noqa: F401  (loads tawpipe._C, which registers the prefetch ops)
from ..ops import SUPPORTED_DTYPES, ShardLayout
from .timeout import DEFAULT_TIMEOUT

DEFAULT_PIECE_NUMEL = 1 << 22  # 16 MiB of float32 per staging buffer


@dataclass(frozen=True)
class OffloadMemory:
    host_bytes: int  # master, accumulator, pinned staging
    device_bytes: int  # staging only


class HostOffload:
    """The float32 master and gradient of the tensors of ``layout`` in host memory, streamed to
    and from ``device``; see the module docstring for the interface."""

    def __init__(
        self,
        layout: ShardLayout,
        device: torch.device | str,
        *,
        init: Tensor | None = None,
        piece_numel: int = DEFAULT_PIECE_NUMEL,
        num_threads: int = 0,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"HostOffload: device must be cpu or cuda, got {device}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"HostOffload: device {device} requested but CUDA is not available")
            device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        if not isinstance(piece_numel, int) or piece_numel < 1:
            raise ValueError(f"HostOffload: piece_numel must be a positive int, got {piece_numel!r}")
        self.layout = layout
        self.device = device
        self.numel = layout.numel
        self.timeout = float(timeout)
        pin = device.type == "cuda"

        def host() -> Tensor:
            return torch.zeros(self.numel, dtype=torch.float32, pin_memory=pin)

        self.master, self.grad = host(), host()
        if init is not None:
            if init.numel() != self.numel:
                raise ValueError(f"HostOffload: init has {init.numel()} elements, the layout {self.numel}")
            self.master.copy_(init.reshape(-1))
        self._prefetcher: int | None = torch.ops.tawpipe._prefetch_create(
            device.index if device.type == "cuda" else -1, piece_numel, num_threads
        )
        # destroyed (after its queued work) when this object is collected, or by close()
        self._finalizer = weakref.finalize(self, torch.ops.tawpipe._prefetch_destroy.default, self._prefetcher)
        self._finalizer.atexit = False
        self._load_lock = threading.Lock()
        self._acc_lock = threading.Lock()

    # ------------------------------------------------------------------ streaming

    def _device_buffer(self, what: str, t: Tensor) -> Tensor:
        if not isinstance(t, Tensor):
            raise TypeError(f"HostOffload.{what}: expected a tensor, got {type(t).__name__}")
        if t.device != self.device:
            raise ValueError(
                f"HostOffload.{what}: buffer is on {t.device} but this offload streams to {self.device}; "
                "pass a buffer on that device"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"HostOffload.{what}: dtype {t.dtype} unsupported; use float32, bfloat16 or float16")
        if t.dim() != 1 or not t.is_contiguous() or t.numel() < self.numel:
            raise ValueError(
                f"HostOffload.{what}: need a contiguous 1-D buffer of at least {self.numel} elements, "
                f"got shape {tuple(t.shape)}"
            )
        return t[: self.numel]

    def _piece(self, what: str, start: int, stop: int | None) -> int:
        """``stop`` (None: the end), once start..stop is a piece of the layout's elements."""
        stop = self.numel if stop is None else stop
        if not 0 <= start < stop <= self.numel:
            raise ValueError(f"HostOffload.{what}: elements {start}..{stop} are not a piece of 0..{self.numel}")
        return stop

    @property
    def _handle(self) -> int:
        if self._prefetcher is None:
            raise RuntimeError("HostOffload is closed")
        return self._prefetcher

    @torch.no_grad()
    def load_weights_into(self, dst: Tensor, start: int = 0, stop: int | None = None) -> None:
        """``dst[start:stop] = master[start:stop]`` cast to dst's dtype (all of it by default).
        On CUDA the copies are queued on side streams and the current stream waits for them; the
        host returns at once."""
        dst = self._device_buffer("load_weights_into", dst)
        stop = self._piece("load_weights_into", start, stop)
        with self._load_lock:
            torch.ops.tawpipe._prefetch_load(self._handle, self.master[start:stop], dst[start:stop])

    @torch.no_grad()
    def accumulate_grad(self, src: Tensor, alpha: float = 1.0, *, squared_norm: bool = False, start: int = 0,
                        stop: int | None = None) -> Tensor | None:
        """``grad += alpha * src[:numel]`` (float32 on the host), after the current stream's work
        that produces src; returns when done (raises after ``timeout`` seconds). With ``start``
        and ``stop``, elements start..stop only (a slice whose gradient is whole before the rest
        of src's). With ``squared_norm``, returns the sum of those elements' squares in ``grad``
        after the addition (a float64 scalar on the host, within about 1e-6, not finite if an
        element is not), taken while each block is in cache: the norm of a gradient whose last
        addition this is, without another pass over it."""
        src = self._device_buffer("accumulate_grad", src)
        stop = self._piece("accumulate_grad", start, stop)
        src, grad = src[start:stop], self.grad[start:stop]
        with self._acc_lock:
            if not squared_norm:
                torch.ops.tawpipe._prefetch_accumulate(self._handle, src, grad, float(alpha), self.timeout)
                return None
            squares = torch.ops.tawpipe._prefetch_accumulate_norm(self._handle, src, grad, float(alpha), self.timeout)
        return torch.tensor(squares, dtype=torch.float64)

    def synchronize(self) -> None:
        """Wait until queued loads have read the master (before the host changes it)."""
        torch.ops.tawpipe._prefetch_synchronize(self._handle, self.timeout)

    def memory(self) -> OffloadMemory:
        _, device_bytes, staging_host = torch.ops.tawpipe._prefetch_info(self._handle)
        return OffloadMemory(host_bytes=2 * 4 * self.numel + staging_host, device_bytes=device_bytes)

    def close(self) -> None:
        """Finish queued loads and free the staging buffers (also done when collected)."""
        if self._prefetcher is not None:
            self.synchronize()
            self._prefetcher = None
            self._finalizer()
