"""Move many tensors into one flat buffer and back, with dtype casts, in one call.

Weight pipelining ships a stage's parameters (hundreds to thousands of tensors) as one flat
buffer per transfer and folds gradients back the same way. A per-tensor copy loop costs one
kernel launch (or thread fork) per tensor; these ops cost one per call.

The four ops are ``torch.ops.tawpipe.{pack, unpack, pack_accumulate, unpack_accumulate}``
(schemas in csrc/torch/ops.cpp). The wrappers here run either the native kernels (default) or
``tawpipe.ops.triton``; the backend is chosen per call or with the environment variable
``TAWPIPE_OPS_BACKEND`` (``native`` or ``triton``). Either way the arguments are checked by the
one C++ validator (csrc/torch/segments.cpp), and the written tensors follow torch's rules for
in-place ops: a leaf that requires grad is refused in grad mode, version counters are bumped
(so backward through a tensor saved before it was overwritten raises), and a written tensor
that requires grad gets a history whose backward raises (the ops have no derivative).

For tensors that persist across steps, ``ShardLayout.bind`` gives a ``BoundShards`` whose calls
skip per-call validation and the per-tensor cost of the op binding (native backend, eager only).
"""

from __future__ import annotations

import importlib
import math
import operator
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

BACKEND_ENV = "TAWPIPE_OPS_BACKEND"
BACKENDS = ("native", "triton")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # by name
SUPPORTED_DTYPES = tuple(DTYPES.values())  # every dtype tawpipe computes, packs and sends in

try:
    from .. import _C  # noqa: F401  (importing registers torch.ops.tawpipe.*)
except ImportError as exc:  # the pure-Python parts (ShardLayout, triton backend) still work
    _NATIVE_IMPORT_ERROR: ImportError | None = exc
else:
    _NATIVE_IMPORT_ERROR = None

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "DTYPES",
    "SUPPORTED_DTYPES",
    "BoundShards",
    "ShardLayout",
    "pack",
    "pack_accumulate",
    "resolve_backend",
    "unpack",
    "unpack_accumulate",
]


def resolve_backend(backend: str | None = None) -> str:
    """The backend a call uses: ``backend`` if given, else ``$TAWPIPE_OPS_BACKEND``, else native."""
    name = backend if backend is not None else os.environ.get(BACKEND_ENV, "native")
    if name not in BACKENDS:
        source = "backend argument" if backend is not None else f"${BACKEND_ENV}"
        raise ValueError(f"unknown tawpipe ops backend {name!r} (from {source}); use one of {BACKENDS}")
    return name


def check_types(op: str, tensors: Sequence[Tensor], flat: Tensor, *, flat_is_dst: bool) -> None:
    """TypeError for non-tensor arguments (the dispatcher would only say 'expected Tensor')."""
    lst, buf = ("srcs", "out") if flat_is_dst else ("dsts", "flat")
    if not isinstance(flat, Tensor):
        raise TypeError(f"{op}: {buf} must be a torch.Tensor, got {type(flat).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {lst}[{i}] must be a torch.Tensor, got {type(t).__name__}")


def _offsets(offsets: Iterable[int]) -> list[int]:
    return [operator.index(o) for o in offsets]


def _native(name: str) -> Callable[..., None]:
    if _NATIVE_IMPORT_ERROR is not None:
        raise RuntimeError(
            f"tawpipe native ops are not built (import tawpipe._C failed: {_NATIVE_IMPORT_ERROR}); "
            "run `pip install --no-build-isolation -e .` (the triton backend needs them too: they "
            "validate its arguments)"
        ) from _NATIVE_IMPORT_ERROR
    return getattr(torch.ops.tawpipe, name)


def _triton(name: str) -> Callable[..., None]:
    try:
        module = importlib.import_module("tawpipe.ops.triton")
    except ImportError as exc:
        raise ImportError(
            f"tawpipe ops backend 'triton' needs tawpipe.ops.triton and triton ({exc}); "
            "install triton or use backend='native'"
        ) from exc
    return getattr(module, name)


def _run(
    name: str,
    tensors: Sequence[Tensor],
    flat: Tensor,
    offsets: Iterable[int],
    backend: str | None,
    *,
    flat_is_dst: bool,
    alpha: float | None = None,
) -> None:
    triton = resolve_backend(backend) == "triton"
    kernel = _triton(name) if triton else _native(name)
    tensors = list(tensors)
    offsets = _offsets(offsets)
    check_types(f"tawpipe::{name}", tensors, flat, flat_is_dst=flat_is_dst)
    if triton:
        # Triton kernels trust their input: the native op's checks and autograd rules run first.
        _native("_prepare")(f"tawpipe::{name}", tensors, flat, offsets, flat_is_dst)
    args = (tensors, flat, offsets) if flat_is_dst else (flat, tensors, offsets)
    if alpha is None:
        kernel(*args)
    else:
        kernel(*args, float(alpha))


def pack(
    srcs: Sequence[Tensor], out: Tensor, offsets: Iterable[int], backend: str | None = None
) -> None:
    """``out[offsets[i] : offsets[i] + srcs[i].numel()] = srcs[i].flatten()`` cast to out's dtype."""
    _run("pack", srcs, out, offsets, backend, flat_is_dst=True)


def unpack(
    flat: Tensor, dsts: Sequence[Tensor], offsets: Iterable[int], backend: str | None = None
) -> None:
    """``dsts[i][...] = flat[offsets[i] : offsets[i] + dsts[i].numel()]`` cast to dsts[i]'s dtype."""
    _run("unpack", dsts, flat, offsets, backend, flat_is_dst=False)


def pack_accumulate(
    srcs: Sequence[Tensor],
    out: Tensor,
    offsets: Iterable[int],
    alpha: float = 1.0,
    backend: str | None = None,
) -> None:
    """``out[segment i] += alpha * srcs[i]``, computed in float32 (e.g. gradient harvesting)."""
    _run("pack_accumulate", srcs, out, offsets, backend, flat_is_dst=True, alpha=alpha)


def unpack_accumulate(
    flat: Tensor,
    dsts: Sequence[Tensor],
    offsets: Iterable[int],
    alpha: float = 1.0,
    backend: str | None = None,
) -> None:
    """``dsts[i] += alpha * flat[segment i]``, computed in float32."""
    _run("unpack_accumulate", dsts, flat, offsets, backend, flat_is_dst=False, alpha=alpha)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_align(align: int) -> None:
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"ShardLayout: align must be a positive number of elements, got {align!r}")


@dataclass(frozen=True)
class ShardLayout:
    """Where each tensor of a group lives in one flat buffer.

    Segment i is ``[offsets[i], offsets[i] + prod(shapes[i]))``; every offset, and ``numel`` (the
    buffer length), is a multiple of ``align`` elements, so segments start on aligned addresses
    (vectorised kernels, NCCL) and equal-length buffers can be split evenly. Gaps are padding.
    """

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    numel: int
    align: int = 1

    def __post_init__(self) -> None:
        n = len(self.names)
        if not (len(self.shapes) == len(self.dtypes) == len(self.offsets) == n):
            raise ValueError(
                "ShardLayout: names, shapes, dtypes and offsets must have one entry per tensor"
            )
        _check_align(self.align)
        bad = [o for o in (*self.offsets, self.numel) if isinstance(o, bool) or not isinstance(o, int)]
        if bad:  # a range is the kernels' to check, with their messages
            raise ValueError(f"ShardLayout: offsets and numel must be whole numbers of elements, got {bad[0]!r}")

    @classmethod
    def from_tensors(
        cls, tensors: Iterable[Tensor], names: Sequence[str] | None = None, align: int = 1
    ) -> ShardLayout:
        """Lay tensors out back to back in the given order, each offset rounded up to ``align``."""
        tensors = list(tensors)
        if names is None:
            names = [str(i) for i in range(len(tensors))]
        if len(names) != len(tensors):
            raise ValueError(f"ShardLayout: got {len(tensors)} tensors but {len(names)} names")
        _check_align(align)
        offsets = []
        cursor = 0
        for t in tensors:
            offset = _round_up(cursor, align)
            offsets.append(offset)
            cursor = offset + t.numel()
        return cls(
            names=tuple(names),
            shapes=tuple(t.shape for t in tensors),
            dtypes=tuple(t.dtype for t in tensors),
            offsets=tuple(offsets),
            numel=_round_up(cursor, align),
            align=align,
        )

    @classmethod
    def from_module(cls, module: nn.Module, align: int = 1) -> ShardLayout:
        """Layout of ``module.named_parameters()`` (shared parameters appear once)."""
        named = list(module.named_parameters())
        return cls.from_tensors([p for _, p in named], names=[name for name, _ in named], align=align)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self.shapes)

    def new_flat(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> Tensor:
        """A zero-filled flat buffer; zeros, so padding never injects NaN into reductions over it."""
        return torch.zeros(self.numel, dtype=dtype, device=device)

    def _check(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        tensors = list(tensors)
        if len(tensors) != len(self):
            raise ValueError(f"ShardLayout: got {len(tensors)} tensors for a layout of {len(self)}")
        for i, (t, shape) in enumerate(zip(tensors, self.shapes)):
            if t.shape != shape:
                raise ValueError(
                    f"ShardLayout: tensor {i} ({self.names[i]!r}) has shape {tuple(t.shape)} "
                    f"but the layout expects {tuple(shape)}; rebuild the layout for these tensors"
                )
        return tensors

    def pack(self, tensors: Sequence[Tensor], flat: Tensor, backend: str | None = None) -> None:
        """Copy ``tensors`` into their segments of ``flat``."""
        pack(self._check(tensors), flat, self.offsets, backend)

    def unpack(self, flat: Tensor, tensors: Sequence[Tensor], backend: str | None = None) -> None:
        """Copy the segments of ``flat`` into ``tensors``."""
        unpack(flat, self._check(tensors), self.offsets, backend)

    def pack_accumulate(
        self, tensors: Sequence[Tensor], flat: Tensor, alpha: float = 1.0, backend: str | None = None
    ) -> None:
        """Add ``alpha * tensors[i]`` into segment i of ``flat``."""
        pack_accumulate(self._check(tensors), flat, self.offsets, alpha, backend)

    def unpack_accumulate(
        self, flat: Tensor, tensors: Sequence[Tensor], alpha: float = 1.0, backend: str | None = None
    ) -> None:
        """Add ``alpha * segment i of flat`` into ``tensors[i]``."""
        unpack_accumulate(flat, self._check(tensors), self.offsets, alpha, backend)

    def bind(self, tensors: Sequence[Tensor], flat: Tensor) -> BoundShards:
        """``tensors`` and ``flat`` bound for repeated pack / unpack calls (see BoundShards)."""
        return BoundShards(self, self._check(tensors), flat)

    def views(self, flat: Tensor) -> list[Tensor]:
        """Per-tensor views into ``flat`` (no copy), e.g. to make module parameters alias it."""
        if flat.dim() != 1 or not flat.is_contiguous() or flat.numel() < self.numel:
            raise ValueError(
                f"ShardLayout.views: need a contiguous 1-D buffer of at least {self.numel} elements, "
                f"got shape {tuple(flat.shape)} (contiguous={flat.is_contiguous()}); use new_flat()"
            )
        return [
            flat.narrow(0, o, n).view(shape) for o, n, shape in zip(self.offsets, self.numels, self.shapes)
        ]


# Modes of torch.ops.tawpipe._run_bound (csrc/torch/bound.cpp).
_BOUND_MODES = {"pack": 0, "unpack": 1, "pack_accumulate": 2, "unpack_accumulate": 3}


class BoundShards:
    """A ShardLayout bound to fixed tensors and one flat buffer: the eager fast path for tensors
    that persist across steps (parameters, master weights, persistent gradients).

    Binding validates once (with the native ops' checks and messages, under the name
    ``ShardLayout.bind``; the tensors are checked as unpack destinations, which covers packing
    from them too) and builds the segment table once, in C++. Each call then passes only that
    table to the native kernels: a constant cost, where the plain ops pass every tensor through
    the op binding (about as long as copying 2000 small tensors takes).

    Each call re-checks in C++ that every tensor and the flat buffer still have the storage
    (address and size), numel, dtype and layout they had when bound, and raises RuntimeError
    otherwise: replacing a tensor's data (``param.data = ...``, ``resize_``, ``set_``) or
    shrinking its storage needs a new ``bind``. Calls follow the ops' autograd rules (a leaf that
    requires grad is refused in grad mode, versions are bumped). The table stays in C++: Python
    holds only a handle, checked on every call, so it can neither read nor change the table's
    pointers. The table keeps the tensors alive until this object is collected; it cannot be
    copied or pickled (bind again instead). Native backend only; the table hides the tensors
    from torch.compile, so calls raise while compiling (use the ShardLayout methods there);
    without ``fullgraph=True``, Dynamo turns that error into a graph break and runs the call eagerly.
    """

    def __init__(self, layout: ShardLayout, tensors: Sequence[Tensor], flat: Tensor) -> None:
        bind_op = _native("_bind")
        self._refuse_compiling("bind")
        tensors = list(tensors)
        check_types("ShardLayout.bind", tensors, flat, flat_is_dst=False)
        self.layout = layout
        self.tensors = tuple(tensors)
        self.flat = flat
        self._table: int = bind_op(tensors, flat, list(layout.offsets))
        self._run_bound = torch.ops.tawpipe._run_bound.default
        # Frees the table when this object goes; at exit the process frees it anyway.
        weakref.finalize(self, torch.ops.tawpipe._unbind.default, self._table).atexit = False

    def __reduce__(self) -> None:
        raise TypeError(
            "BoundShards cannot be copied or pickled (its table belongs to this object); "
            "bind the tensors again with ShardLayout.bind"
        )

    @staticmethod
    def _refuse_compiling(method: str) -> None:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"BoundShards.{method} cannot run under torch.compile: its tensors are hidden from "
                "the graph in a bound table (it is an eager fast path); use the ShardLayout "
                "methods (or tawpipe.ops.pack / unpack / ...) in compiled code"
            )

    def _run(self, mode: str, alpha: float) -> None:
        self._refuse_compiling(mode)
        self._run_bound(self._table, _BOUND_MODES[mode], float(alpha))

    def pack(self) -> None:
        """Copy the bound tensors into their segments of the flat buffer."""
        self._run("pack", 1.0)

    def unpack(self) -> None:
        """Copy the segments of the flat buffer into the bound tensors."""
        self._run("unpack", 1.0)

    def pack_accumulate(self, alpha: float = 1.0) -> None:
        """Add ``alpha * tensors[i]`` into segment i of the flat buffer."""
        self._run("pack_accumulate", alpha)

    def unpack_accumulate(self, alpha: float = 1.0) -> None:
        """Add ``alpha * segment i of the flat buffer`` into ``tensors[i]``."""
        self._run("unpack_accumulate", alpha)
