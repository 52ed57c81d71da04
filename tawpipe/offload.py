"""Host offload of a chunk owner's float32 state: master weights, gradient accumulator and AdamW
state live in pinned host memory; the device holds only compute-dtype weights and incoming
gradients, streamed in pieces through the prefetcher (csrc/kernels/prefetch.h).

Interface (all the engine needs; ``numel = layout.numel``)::

    off = HostOffload(layout, device, init=flat_fp32)  # state for the tensors of `layout`
    off.load_weights_into(buf)        # buf[:numel] = master, cast to buf.dtype; stream-ordered:
                                      # the current stream of buf's device waits, the host does not
    off.accumulate_grad(gbuf, alpha)  # grad += alpha * gbuf[:numel]; returns when added (timeout)
    off.grad                          # the float32 accumulator on the host: scale or clip in place
    off.grad_sq_norm()                # its squared L2 norm (float64), for clipping
    off.step(AdamWConfig(...), lr)    # one AdamW step of the whole chunk, on the host
    off.zero_grad()
    off.state_dict() / off.load_state_dict(state)
    off.memory()                      # bytes on the host and on the device
    off.close()

Where the optimizer runs: on the host, where its state lives. The step reads and writes 16 bytes
per parameter (master, grad, two moments); running it on the device would move 28 bytes per
parameter across PCIe every step instead, and the step is memory-bound on either side. It is
torch's own AdamW (the functional ``torch.optim.adamw.adamw``, single-tensor by default, as torch.optim.AdamW
picks for CPU tensors) applied per tensor of the layout, so it equals torch.optim.AdamW with
param groups {>= 2-D tensors: weight_decay} and {the rest: no decay} (the paper's setting),
bit for bit on the CPU.

Overlap: a load waits for the current stream's earlier work (it overwrites buf) and makes that
stream wait for it, so compute queued later on the *same* stream waits too. To load chunk k+1
while chunk k computes, call it with another stream current (a comm channel's, or
``with torch.cuda.stream(side):``) and have the compute stream wait on that stream (or an event
recorded there) before it reads buf; ``tawpipe bench prefetch`` measures exactly this.

Without CUDA (CPU builds, or ``device="cpu"``) the same calls run through the host prefetcher:
plain copies, nothing pinned, so the engine's exactness tests can run with offload on a CPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from . import ops  # noqa: F401  (loads tawpipe._C, which registers the prefetch ops)
from .ops import SUPPORTED_DTYPES, ShardLayout

DEFAULT_PIECE_NUMEL = 1 << 22  # 16 MiB of float32 per staging buffer


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyper-parameters; defaults are the paper's (decay applies to >= 2-D tensors only).

    ``fused=True`` uses torch's fused CPU kernel: faster on large chunks, but it rounds
    differently from torch.optim.AdamW's default, so exactness against it is then lost.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    fused: bool = False


@dataclass(frozen=True)
class OffloadMemory:
    host_bytes: int  # master, accumulator, moments, pinned staging
    device_bytes: int  # staging only


def default_decay(shape: torch.Size) -> bool:
    """Weight decay on matrices (and higher), not on vectors: the paper's AdamW setting."""
    return len(shape) >= 2


class HostOffload:
    """The float32 state of one chunk (the tensors of ``layout``) in host memory; see the module
    docstring for the interface and where the optimizer runs."""

    def __init__(
        self,
        layout: ShardLayout,
        device: torch.device | str,
        *,
        init: Tensor | None = None,
        decay: Callable[[torch.Size], bool] = default_decay,
        piece_numel: int = DEFAULT_PIECE_NUMEL,
        num_threads: int = 0,
        timeout: float = 300.0,
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

        self.master, self.grad, self.exp_avg, self.exp_avg_sq = host(), host(), host(), host()
        if init is not None:
            if init.numel() != self.numel:
                raise ValueError(f"HostOffload: init has {init.numel()} elements, the layout {self.numel}")
            self.master.copy_(init.reshape(-1))
        self._prefetcher = torch.ops.tawpipe._prefetch_create(
            device.index if device.type == "cuda" else -1, piece_numel, num_threads
        )
        self._load_lock = threading.Lock()
        self._acc_lock = threading.Lock()
        # Per-tensor views, split into the two AdamW groups, with torch's per-tensor step counts.
        self._groups: dict[bool, dict[str, list[Tensor]]] = {}
        for shape, m, g, a, s in zip(
            layout.shapes, *(layout.views(t) for t in (self.master, self.grad, self.exp_avg, self.exp_avg_sq))
        ):
            group = self._groups.setdefault(bool(decay(shape)), {"p": [], "g": [], "m": [], "v": [], "step": []})
            for key, t in zip(("p", "g", "m", "v"), (m, g, a, s)):
                group[key].append(t)
            group["step"].append(torch.tensor(0.0))
        self.steps = 0

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

    @property
    def _handle(self) -> Tensor:
        if self._prefetcher is None:
            raise RuntimeError("HostOffload is closed")
        return self._prefetcher

    @torch.no_grad()
    def load_weights_into(self, dst: Tensor) -> None:
        """``dst[:numel] = master`` cast to dst's dtype. On CUDA the copies are queued on side
        streams and the current stream waits for them; the host returns at once."""
        dst = self._device_buffer("load_weights_into", dst)
        with self._load_lock:
            torch.ops.tawpipe._prefetch_load(self._handle, self.master, dst)

    @torch.no_grad()
    def accumulate_grad(self, src: Tensor, alpha: float = 1.0) -> None:
        """``grad += alpha * src[:numel]`` (float32 on the host), after the current stream's work
        that produces src; returns when done (raises after ``timeout`` seconds)."""
        src = self._device_buffer("accumulate_grad", src)
        with self._acc_lock:
            torch.ops.tawpipe._prefetch_accumulate(self._handle, src, self.grad, float(alpha), self.timeout)

    def synchronize(self) -> None:
        """Wait until queued loads have read the master (before the host changes it)."""
        torch.ops.tawpipe._prefetch_synchronize(self._handle, self.timeout)

    # ------------------------------------------------------------------ optimizer

    def zero_grad(self) -> None:
        self.grad.zero_()

    def grad_sq_norm(self) -> float:
        return self.grad.double().square().sum().item()

    @torch.no_grad()
    def step(self, config: AdamWConfig, lr: float | None = None) -> None:
        """One AdamW step over every tensor of the layout (``lr`` overrides config.lr, e.g. from
        a scheduler). Waits for queued loads first: they read the master this step rewrites."""
        self.synchronize()
        beta1, beta2 = config.betas
        for decays, g in self._groups.items():
            adamw(
                g["p"], g["g"], g["m"], g["v"], [], g["step"],
                foreach=False, fused=config.fused or None, amsgrad=False, beta1=beta1, beta2=beta2,
                lr=config.lr if lr is None else lr, weight_decay=config.weight_decay if decays else 0.0,
                eps=config.eps, maximize=False,
            )
        self.steps += 1

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Copies of the master and AdamW state (the accumulator is transient: zero between steps)."""
        self.synchronize()
        return {
            "numel": self.numel, "steps": self.steps, "master": self.master.clone(),
            "exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("numel") != self.numel:
            raise ValueError(
                f"HostOffload.load_state_dict: state holds {state.get('numel')} elements, this offload "
                f"{self.numel}: load the shard of the same chunk"
            )
        self.synchronize()
        for name in ("master", "exp_avg", "exp_avg_sq"):
            getattr(self, name).copy_(state[name])
        self.steps = int(state["steps"])
        for g in self._groups.values():
            for t in g["step"]:
                t.fill_(float(self.steps))

    def memory(self) -> OffloadMemory:
        _, device_bytes, staging_host = torch.ops.tawpipe._prefetch_info(self._handle)
        return OffloadMemory(host_bytes=4 * 4 * self.numel + staging_host, device_bytes=device_bytes)

    def close(self) -> None:
        """Finish queued loads and free the staging buffers (also done when collected)."""
        if self._prefetcher is not None:
            self.synchronize()
            self._prefetcher = None
