"""Triton backend of the fused multi-tensor ops: pack, unpack, pack_accumulate, unpack_accumulate.

Why a second backend: it runs wherever triton does (on CPU tensors under ``TRITON_INTERPRET=1``)
and serves as an independent implementation to check the native C++/CUDA ops against.
``tawpipe.ops`` calls these functions when the backend is "triton", after the native
``tawpipe::_prepare`` (the native ops' validator and autograd rules) has accepted the inputs:
the kernels here check nothing.

Design (few launches): the segments are grouped by the dtype of the list side (the ``srcs`` of a
pack, the ``dsts`` of an unpack; the flat side has one dtype), and each group is one launch. A
host-built int64 descriptor table has one row per tile of ``BLOCK`` elements,
``(address of the tile in its list tensor, element offset of the tile in flat, elements in the
tile)``; program ``i`` handles row ``i``. The list-side address is cast to a typed pointer inside
the kernel, which works on a GPU and under the interpreter on CPU tensors (whose addresses are
real host addresses). So a call makes at most three launches, whatever the number of tensors.

Rounding: every downcast is round-to-nearest-even, as torch's ``Tensor.to``; bfloat16 is rounded
with explicit bit arithmetic because the interpreter truncates float32 -> bfloat16. Accumulating
forms compute ``dst + alpha * src`` in float32 (``alpha`` is passed as float32) and round once.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch

# Bound on first use by _kernel(): importing tawpipe must not import triton, and triton chooses
# between compiling and interpreting when a kernel is defined. The interpreter looks these up in
# the kernel's module globals, so they are module globals rather than closure variables.
triton: Any = None
tl: Any = None

_TL_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_BLOCK = 4096  # elements per tile: 16 KiB of float32, a table row per 16 KiB is negligible
_NUM_WARPS = 8


def _to_f32(x):
    """bfloat16/float16/float32 -> float32, exactly (jitted by _kernel)."""
    if x.dtype == tl.bfloat16:
        # A bfloat16 is the high half of the float32 of the same value.
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


def _cast(x, DT: tl.constexpr):
    """Cast to DT rounding to nearest even, as torch does (jitted by _kernel)."""
    if x.dtype == DT:
        return x
    elif DT == tl.bfloat16:
        # Round on the bits: the interpreter's float32 -> bfloat16 truncates. NaN becomes the
        # canonical quiet NaN, as in torch.
        f = _to_f32(x)
        u = f.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(f != f, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return _to_f32(x).to(DT)


def _segments_kernel(
    table_ptr,
    flat_ptr,
    alpha,
    LIST_DTYPE: tl.constexpr,
    TO_FLAT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program i moves the tile in table row i between its list tensor and flat (jitted)."""
    row = table_ptr + 3 * tl.program_id(0).to(tl.int64)
    list_addr = tl.load(row)
    flat_off = tl.load(row + 1)
    n = tl.load(row + 2)
    list_base = list_addr.to(tl.pointer_type(LIST_DTYPE), bitcast=True)
    if ALIGNED:
        # Host-checked: every tile starts 16-byte aligned on both sides, which lets the compiler
        # use 16-byte vector accesses (the hints are no-ops under the interpreter).
        list_base = tl.multiple_of(list_base, 16)
        flat_off = tl.multiple_of(flat_off, 128 // flat_ptr.dtype.element_ty.primitive_bitwidth)
    idx = tl.arange(0, BLOCK)
    list_ptrs = list_base + idx
    flat_ptrs = flat_ptr + flat_off + idx
    if TO_FLAT:
        src_ptrs = list_ptrs
        dst_ptrs = flat_ptrs
    else:
        src_ptrs = flat_ptrs
        dst_ptrs = list_ptrs
    if n == BLOCK:
        # Full tiles go unmasked so that the compiler can vectorize them.
        _move(src_ptrs, dst_ptrs, None, alpha, ACCUMULATE)
    else:
        _move(src_ptrs, dst_ptrs, idx < n, alpha, ACCUMULATE)


def _move(src_ptrs, dst_ptrs, mask, alpha, ACCUMULATE: tl.constexpr):
    """dst = src or dst += alpha * src, cast to dst's dtype, where mask (jitted by _kernel)."""
    dst_dtype = dst_ptrs.dtype.element_ty
    x = tl.load(src_ptrs, mask=mask)
    if ACCUMULATE:
        y = _cast(_to_f32(tl.load(dst_ptrs, mask=mask)) + alpha * _to_f32(x), dst_dtype)
    else:
        y = _cast(x, dst_dtype)
    tl.store(dst_ptrs, y, mask=mask)


@functools.cache
def _kernel() -> tuple[Any, bool]:
    """Import triton and jit the functions above once; returns (kernel, whether interpreted).

    The jitted functions replace the plain ones under the same module-global names, which is
    where both the compiler and the interpreter resolve the helpers the kernel calls.
    """
    global triton, tl, _to_f32, _cast, _move, _segments_kernel
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise ImportError(
            "tawpipe's triton backend needs the 'triton' package (pip install triton); on CPU "
            "tensors it also needs TRITON_INTERPRET=1 set before triton is imported"
        ) from exc
    _to_f32 = triton.jit(_to_f32)
    _cast = triton.jit(_cast)
    _move = triton.jit(_move)
    _segments_kernel = triton.jit(_segments_kernel)
    return _segments_kernel, bool(triton.knobs.runtime.interpret)


def _tile_table(
    tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat_esize: int
) -> tuple[torch.Tensor, bool]:
    """One int64 row (tile address, flat offset, elements) per BLOCK-element tile, on the CPU,
    and whether every segment starts 16-byte aligned on its list side and in flat (offsets)."""
    esize = tensors[0].element_size()
    addr = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    flat_off = torch.tensor(list(offsets), dtype=torch.int64)
    numel = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    aligned = bool((addr % 16 == 0).all()) and bool((flat_off * flat_esize % 16 == 0).all())
    tiles = (numel + _BLOCK - 1) // _BLOCK
    seg = torch.repeat_interleave(torch.arange(len(tensors)), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    start = (torch.arange(seg.numel()) - first_tile[seg]) * _BLOCK
    count = (numel[seg] - start).clamp(max=_BLOCK)
    table = torch.stack((addr[seg] + start * esize, flat_off[seg] + start, count), dim=1)
    return table.contiguous(), aligned


def _run(
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    offsets: Sequence[int],
    to_flat: bool,
    alpha: float | None,
) -> None:
    """Launch once per list-side dtype; ``alpha`` None means copy, else accumulate."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() > 0:
            groups.setdefault(t.dtype, []).append(i)
    if not groups:
        return
    kernel, interpreted = _kernel()
    on_cpu = flat.device.type == "cpu"
    if on_cpu != interpreted:
        raise RuntimeError(
            "tawpipe triton backend: CPU tensors run only under the triton interpreter "
            "(TRITON_INTERPRET=1 set before triton is imported), device tensors only compiled "
            f"(TRITON_INTERPRET unset); got {flat.device} tensors with interpret={interpreted}"
        )
    for dtype, idx in groups.items():
        table, aligned = _tile_table(
            [tensors[i] for i in idx], [offsets[i] for i in idx], flat.element_size()
        )
        if not on_cpu:
            table = table.pin_memory().to(flat.device, non_blocking=True)
        device_guard = contextlib.nullcontext() if on_cpu else torch.cuda.device(flat.device)
        with device_guard:
            kernel[(table.shape[0],)](
                table,
                flat,
                1.0 if alpha is None else float(alpha),
                LIST_DTYPE=getattr(tl, _TL_DTYPE_NAMES[dtype]),
                TO_FLAT=to_flat,
                ACCUMULATE=alpha is not None,
                ALIGNED=aligned,
                BLOCK=_BLOCK,
                num_warps=_NUM_WARPS,
            )


def pack(srcs: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    """``out[offsets[i]:offsets[i] + srcs[i].numel()] = srcs[i]`` (flattened, cast) for every i."""
    _run(srcs, out, offsets, to_flat=True, alpha=None)


def unpack(flat: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """``dsts[i] = flat[offsets[i]:offsets[i] + dsts[i].numel()]`` (reshaped, cast) for every i."""
    _run(dsts, flat, offsets, to_flat=False, alpha=None)


def pack_accumulate(
    srcs: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int], alpha: float
) -> None:
    """``out[segment i] += alpha * srcs[i]`` in float32 arithmetic for every i."""
    _run(srcs, out, offsets, to_flat=True, alpha=alpha)


def unpack_accumulate(
    flat: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int], alpha: float
) -> None:
    """``dsts[i] += alpha * flat[segment i]`` in float32 arithmetic for every i."""
    _run(dsts, flat, offsets, to_flat=False, alpha=alpha)
