"""tawpipe.ops and the native torch.ops.tawpipe.* ops against plain-torch references.

Outputs are poisoned (NaN) before every call and segments sit in shuffled order with gaps, so
the checks see unwritten elements as well as writes outside the segments. Copies must match
torch's casts bit for bit. Accumulation may round differently where a fused multiply-add is used
(CUDA), so it is compared within that rounding. CUDA cases run wherever a GPU is present.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import pickle
import re
import sys
import types
import weakref
import zlib
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from tawpipe import ops
from tawpipe.ops import ShardLayout

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PAIRS = [(a, b) for a in DTYPES for b in DTYPES]
PAIR_IDS = [f"{str(a)[6:]}-{str(b)[6:]}" for a, b in PAIRS]
OPS = ["pack", "unpack", "pack_accumulate", "unpack_accumulate"]
HAS_CUDA = torch.cuda.is_available()
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(autouse=True)
def native_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests pick backends explicitly; TAWPIPE_OPS_BACKEND from the environment must not leak in."""
    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)


@pytest.fixture
def fake_triton(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Replace tawpipe.ops.triton with a recorder of (function name, args)."""
    calls: list[tuple] = []
    module = types.ModuleType("tawpipe.ops.triton")
    for name in OPS:
        setattr(module, name, lambda *args, _name=name: calls.append((_name, args)))
    monkeypatch.setitem(sys.modules, "tawpipe.ops.triton", module)
    return calls


def dtype_id(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def seed_of(*parts: object) -> int:
    """A seed that is stable across runs (unlike hash(), which Python randomises)."""
    return zlib.crc32(repr(parts).encode())


def randint(lo: int, hi: int, gen: torch.Generator) -> int:
    return int(torch.randint(lo, hi, (), generator=gen))


def random_shape(gen: torch.Generator) -> tuple[int, ...]:
    """0-d, zero-element, odd 1-D/2-D/3-D, and sometimes more than one CUDA tile (4096)."""
    kind = randint(0, 10, gen)
    if kind == 0:
        return ()
    if kind == 1:
        return (0,) if randint(0, 2, gen) else (randint(1, 5, gen), 0)
    if kind == 2:
        return (randint(4097, 9000, gen),)
    if kind < 6:
        return (randint(1, 130, gen),)
    if kind < 9:
        return (randint(1, 40, gen), randint(1, 40, gen))
    return (randint(1, 9, gen), randint(1, 9, gen), randint(1, 9, gen))


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str, gen: torch.Generator) -> Tensor:
    """Nonzero values over many magnitudes: casts must round, overflow float16 and go subnormal;
    a quarter are exact ties of the bfloat16 or float16 rounding (round half to even)."""
    magnitude = torch.pow(10.0, torch.empty(shape).uniform_(-7, 5.5, generator=gen))
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    bits = (sign * magnitude * (1 + torch.rand(shape, generator=gen))).view(torch.int32)
    kind = torch.randint(0, 8, shape, generator=gen)
    bits = torch.where(kind == 0, (bits & ~0xFFFF) | 0x8000, bits)  # halfway between two bfloat16
    bits = torch.where(kind == 1, (bits & ~0x1FFF) | 0x1000, bits)  # halfway between two float16
    return bits.view(torch.float32).to(dtype).to(device)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Tensor:
    return torch.full(shape, math.nan, dtype=dtype, device=device)


def layout(numels: list[int], gen: torch.Generator) -> tuple[list[int], int]:
    """Offsets in a shuffled order with 0-3 element gaps (so both aligned and odd starts)."""
    offsets = [0] * len(numels)
    cursor = 0
    for i in torch.randperm(len(numels), generator=gen).tolist():
        cursor += randint(0, 4, gen)
        offsets[i] = cursor
        cursor += numels[i]
    return offsets, cursor + 3


def fits_storage(t: Tensor) -> bool:
    """Whether t's elements lie within its storage (else reading t reads out of bounds)."""
    return (t.storage_offset() + t.numel()) * t.element_size() <= t.untyped_storage().nbytes()


def same_bits(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def reference(op: str, tensors: list[Tensor], flat: Tensor, offsets: list[int], alpha: float):
    """The op in plain torch: float32 arithmetic, one rounding to the destination dtype.

    Returns (tensors, flat) after the op, and |alpha * src| laid out like the destination (the
    scale of the rounding difference a fused multiply-add may make)."""
    tensors = [t.clone() for t in tensors]
    flat = flat.clone()
    flat_scale = torch.zeros(flat.shape, dtype=torch.float64, device=flat.device)
    dst_scales = []
    for t, o in zip(tensors, offsets):
        seg = flat[o : o + t.numel()]
        if op == "pack":
            seg.copy_(t.reshape(-1).to(flat.dtype))
        elif op == "pack_accumulate":
            flat_scale[o : o + t.numel()] = (alpha * t.reshape(-1).double()).abs()
            seg.copy_((seg.float() + alpha * t.reshape(-1).float()).to(flat.dtype))
        elif op == "unpack":
            t.copy_(seg.reshape(t.shape).to(t.dtype))
        else:
            dst_scales.append((alpha * seg.reshape(t.shape).double()).abs())
            t.copy_((t.float() + alpha * seg.reshape(t.shape).float()).to(t.dtype))
    return tensors, flat, (flat_scale if op == "pack_accumulate" else dst_scales)


def assert_accumulated(actual: Tensor, expected: Tensor, scale: Tensor) -> None:
    """Equal up to one rounding of the result plus one float32 rounding of alpha * src (what a
    fused multiply-add changes); NaN exactly where expected."""
    assert actual.dtype == expected.dtype
    a, e = actual.double(), expected.double()
    info = torch.finfo(actual.dtype)
    tol = info.eps * e.abs() + 2.0**-23 * scale.to(a.device) + info.smallest_normal * info.eps
    close = (a == e) | ((a - e).abs() <= tol) | (a.isnan() & e.isnan())
    bad = ~close
    assert not bad.any(), f"{int(bad.sum())} elements differ, e.g. {a[bad][:3]} vs {e[bad][:3]}"


def make_case(
    op: str, list_dtypes: list[torch.dtype], flat_dtype: torch.dtype, device: str, gen: torch.Generator
) -> tuple[list[Tensor], Tensor, list[int]]:
    """Random tensors and a flat buffer for op: sources random, destinations NaN (or random
    where accumulated into), flat NaN in every gap."""
    shapes = [random_shape(gen) for _ in list_dtypes]
    offsets, total = layout([math.prod(s) for s in shapes], gen)
    flat = poisoned((total,), flat_dtype, device)
    tensors = []
    for shape, dtype, o in zip(shapes, list_dtypes, offsets):
        n = math.prod(shape)
        if op != "pack":  # flat is read (unpack*) or accumulated into (pack_accumulate)
            flat[o : o + n] = random_tensor((n,), flat_dtype, device, gen)
        fresh = op.startswith("pack") or op == "unpack_accumulate"
        tensors.append(random_tensor(shape, dtype, device, gen) if fresh else poisoned(shape, dtype, device))
    return tensors, flat, offsets


def call(op: str, tensors: list[Tensor], flat: Tensor, offsets: list[int], alpha: float, **kw) -> None:
    args = (tensors, flat, offsets) if op.startswith("pack") else (flat, tensors, offsets)
    getattr(ops, op)(*args, *([alpha] if "accumulate" in op else []), **kw)


def layout_of(tensors: list[Tensor], offsets: list[int], numel: int) -> ShardLayout:
    """A ShardLayout with the given (shuffled, gapped) offsets."""
    return ShardLayout(
        names=tuple(map(str, range(len(tensors)))),
        shapes=tuple(t.shape for t in tensors),
        dtypes=tuple(t.dtype for t in tensors),
        offsets=tuple(offsets),
        numel=numel,
    )


def call_bound(op: str, tensors: list[Tensor], flat: Tensor, offsets: list[int], alpha: float) -> None:
    """The op through ShardLayout.bind: bind, then call the bound method."""
    bound = layout_of(tensors, offsets, flat.numel()).bind(tensors, flat)
    getattr(bound, op)(*([alpha] if "accumulate" in op else []))


def check_against_reference(
    op: str,
    tensors: list[Tensor],
    flat: Tensor,
    offsets: list[int],
    alpha: float,
    runner: Callable[..., None] = call,
    **kw,
) -> None:
    want_tensors, want_flat, scale = reference(op, tensors, flat, offsets, alpha)
    runner(op, tensors, flat, offsets, alpha, **kw)
    if op.startswith("pack"):
        assert all(same_bits(t, w) for t, w in zip(tensors, want_tensors)), "a source was modified"
        if op == "pack":
            assert same_bits(flat, want_flat)  # every segment, and NaN left in every gap
        else:
            assert_accumulated(flat, want_flat, scale)
    else:
        assert same_bits(flat, want_flat), "the source flat buffer was modified"
        for i, (t, w) in enumerate(zip(tensors, want_tensors)):
            if op == "unpack":
                assert same_bits(t, w), f"dsts[{i}]"
            else:
                assert_accumulated(t, w, scale[i])


def check_op(
    op: str,
    list_dtypes: list[torch.dtype],
    flat_dtype: torch.dtype,
    device: str,
    seed: int,
    runner: Callable[..., None] = call,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors, flat, offsets = make_case(op, list_dtypes, flat_dtype, device, gen)
    alpha = float(torch.empty(()).uniform_(-3, 3, generator=gen))
    check_against_reference(op, tensors, flat, offsets, alpha, runner)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("list_dtype,flat_dtype", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("op", OPS)
def test_op_matches_torch_every_dtype_pair(
    op: str, list_dtype: torch.dtype, flat_dtype: torch.dtype, device: str
) -> None:
    seed = seed_of(op, list_dtype, flat_dtype)
    n = randint(1, 70, torch.Generator().manual_seed(seed))
    check_op(op, [list_dtype] * n, flat_dtype, device, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [0, 1, 2000])
def test_op_mixed_dtypes_many_tensors(op: str, n: int, device: str) -> None:
    """Every tensor its own dtype, in one call (one table, one launch)."""
    gen = torch.Generator().manual_seed(seed_of(op, n))
    list_dtypes = [DTYPES[i] for i in torch.randint(0, 3, (n,), generator=gen).tolist()]
    flat_dtype = DTYPES[randint(0, 3, gen)]
    check_op(op, list_dtypes, flat_dtype, device, seed_of(op, n, "data"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_large_segments_split_across_threads_and_blocks(op: str, device: str) -> None:
    """Totals far above one thread's share and one CUDA tile, with segments straddling the cuts."""
    gen = torch.Generator().manual_seed(seed_of(op, "large"))
    shapes = [(70_001,), (3,), (129_999,), (1,), (40_000,)]
    offsets, total = layout([math.prod(s) for s in shapes], gen)
    flat = poisoned((total,), torch.float32, device)
    for s, o in zip(shapes, offsets):
        if op != "pack":
            flat[o : o + math.prod(s)] = random_tensor(s, torch.float32, device, gen)
    fresh = op.startswith("pack") or op == "unpack_accumulate"
    tensors = [
        random_tensor(s, torch.bfloat16, device, gen) if fresh else poisoned(s, torch.bfloat16, device)
        for s in shapes
    ]
    check_against_reference(op, tensors, flat, offsets, 0.75)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_accumulate_rounds_once_in_float32(dtype: torch.dtype, device: str) -> None:
    """(1+e)(1+e/2) - (1+e) is exact in float32 (so any rounding order agrees), but rounding
    alpha * src to dtype first gives another value."""
    eps = torch.finfo(dtype).eps
    src = torch.full((5,), 1 + eps, dtype=dtype, device=device)
    alpha = 1 + eps / 2
    once = (-src.float() + alpha * src.float()).to(dtype)
    twice = (-src + (alpha * src.float()).to(dtype)).to(dtype)
    assert not torch.equal(once, twice)  # the values do tell the two apart
    flat = -src
    ops.pack_accumulate([src], flat, [0], alpha)
    assert same_bits(flat, once)
    dst = -src
    ops.unpack_accumulate(src.clone(), [dst], [0], alpha)
    assert same_bits(dst, once)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_lists_and_zero_element_tensors_are_noops(device: str) -> None:
    out = poisoned((6,), torch.float32, device)
    before = out.clone()
    ops.pack([], out, [])
    ops.unpack_accumulate(out, [], [], 2.0)
    empties = [torch.empty(0, device=device), torch.empty(3, 0, dtype=torch.float16, device=device)]
    ops.pack(empties, out, [6, 0])  # a zero-element segment may sit at the very end
    ops.unpack(out, empties, [0, 6])
    torch.ops.tawpipe.pack_accumulate(empties, out, [6, 2], 1.0)
    assert same_bits(out, before)


# --- torch.library integration -------------------------------------------------------------


def opcheck_args(op: str, device: str) -> tuple:
    gen = torch.Generator().manual_seed(3)
    specs = [((3, 5), torch.float32), ((), torch.bfloat16), ((7,), torch.float16), ((0,), torch.float32)]
    tensors = [random_tensor(shape, dtype, device, gen) for shape, dtype in specs]
    flat = random_tensor((30,), torch.bfloat16, device, gen)
    offsets = [2, 0, 20, 30]
    args = (tensors, flat, offsets) if op.startswith("pack") else (flat, tensors, offsets)
    return args + ((0.5,) if "accumulate" in op else ())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("grad", [False, True], ids=["plain", "reads-require-grad"])
def test_opcheck(op: str, device: str, grad: bool) -> None:
    """Schema (mutation declared), fake kernel, autograd registration, AOT dispatch."""
    args = opcheck_args(op, device)
    if grad:  # what the op reads requires grad: the autograd registration is checked too
        read = args[0] if op.startswith("unpack") else args[0][0]
        read.requires_grad_()
    torch.library.opcheck(getattr(torch.ops.tawpipe, op).default, args)


def pipeline(
    params: list[Tensor], grads: list[Tensor], flat: Tensor, acc: Tensor, offsets: list[int]
) -> Tensor:
    """A weight round trip: pack params, unpack them back, fold grads into an accumulator."""
    ops.pack(params, flat, offsets)
    ops.unpack(flat, params, offsets)
    torch.ops.tawpipe.pack_accumulate(grads, acc, offsets, 0.25)
    ops.unpack_accumulate(acc, grads, offsets, -1.5)
    return flat.float().sum() + acc.sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_matches_eager(backend: str, device: str) -> None:
    gen = torch.Generator().manual_seed(9)
    shapes = [(4, 3), (5,), (), (2, 2, 2)]
    offsets, total = layout([math.prod(s) for s in shapes], gen)
    params = [random_tensor(s, torch.float32, device, gen) for s in shapes]
    grads = [random_tensor(s, torch.bfloat16, device, gen) for s in shapes]
    flat = torch.zeros(total, dtype=torch.bfloat16, device=device)
    acc = random_tensor((total,), torch.float32, device, gen)

    def state() -> tuple[list[Tensor], list[Tensor], Tensor, Tensor]:
        return [p.clone() for p in params], [g.clone() for g in grads], flat.clone(), acc.clone()

    eager = state()
    eager_out = pipeline(*eager, offsets)
    torch._dynamo.reset()
    compiled = state()
    compiled_out = torch.compile(pipeline, backend=backend, fullgraph=True)(*compiled, offsets)
    torch.testing.assert_close(compiled_out, eager_out)
    for got, want in zip([*compiled[0], *compiled[1], *compiled[2:]], [*eager[0], *eager[1], *eager[2:]]):
        assert same_bits(got, want)


def test_torch_compile_dynamic_shapes_and_bad_input_at_trace_time() -> None:
    """With symbolic sizes the Meta kernels (the one C++ validator, on shapes) guard on them:
    one graph serves several sizes, and overlapping segments are refused while tracing."""

    def step(params: list[Tensor], flat: Tensor, offsets: list[int]) -> Tensor:
        ops.pack(params, flat, offsets)
        ops.unpack_accumulate(flat, params, offsets, 0.5)
        return flat.sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(seed_of("dynamic"))
    for n in (3, 6):
        params = [random_tensor(shape, torch.float32, "cpu", gen) for shape in [(n,), (2, n)]]
        offsets = [0, n + 1]
        flat = poisoned((3 * n + 2,), torch.float32, "cpu")
        eager = ([p.clone() for p in params], flat.clone())
        want = step(*eager, offsets)
        got = compiled(params, flat, offsets)
        assert same_bits(got, want) and same_bits(flat, eager[1])
        assert all(same_bits(p, e) for p, e in zip(params, eager[0]))
    params = [torch.ones(4), torch.ones(2, 4)]
    with pytest.raises(Exception, match=r"tawpipe::pack: segments 0 \[0, .*overlap in out"):
        compiled(params, torch.zeros(20), [0, 1])


# --- bad input: a clear exception before any work, from the wrapper and the raw op ------------


def bad_cases(device: str) -> list[tuple[str, str, tuple, str]]:
    """(name, op, args, message fragment); every one must raise ValueError."""

    def ones(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.ones(*shape, dtype=dtype, device=device)

    out = poisoned((10,), torch.float32, device)
    shared = poisoned((10,), torch.float32, device)
    return [
        ("lengths differ", "pack", ([ones(2), ones(2)], out, [0]), "one offset per tensor"),
        ("negative offset", "pack", ([ones(2), ones(2)], out, [0, -1]), "does not fit"),
        ("past the end", "pack", ([ones(2), ones(4)], out, [0, 7]), "does not fit"),
        ("overlap", "pack", ([ones(4), ones(1), ones(3)], out, [0, 9, 2]), "overlap"),
        ("src dtype", "pack", ([ones(2), ones(2, dtype=torch.float64)], out, [0, 4]), "dtype"),
        ("out dtype", "pack", ([ones(2)], ones(4, dtype=torch.int32), [0]), "dtype"),
        ("out not 1-D", "pack", ([ones(2)], ones(2, 5), [0]), "1-D"),
        ("out not contiguous", "pack", ([ones(2)], ones(20)[::2], [0]), "contiguous"),
        ("src not contiguous", "pack", ([ones(2), ones(3, 2).t()], out, [0, 4]), "not contiguous"),
        ("out aliases a src", "pack", ([ones(2), shared[6:]], shared, [0, 2]), "shares memory"),
        ("dst not contiguous", "unpack", (out, [ones(2), ones(3, 2).t()], [0, 4]), "not contiguous"),
        ("dst aliases flat", "unpack_accumulate", (shared, [ones(2), shared[:3]], [0, 5], 1.0), "shares"),
        ("dsts alias each other", "unpack", (out, [ones(4)[1:]] * 2 + [ones(1)], [0, 3, 6]), "share memory"),
    ]


BAD_CASES = [case[0] for case in bad_cases("cpu")]


def tensors_in(args: tuple) -> list[Tensor]:
    return [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, Tensor)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ["wrapper", "wrapper-triton", "torch.ops"])
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_raises_before_any_work(
    case: str, entry: str, device: str, fake_triton: list[tuple]
) -> None:
    """Every entry rejects it through the one C++ validator: the native wrapper, the triton
    wrapper (tawpipe::_prepare validates before its kernels, which check nothing) and a direct
    torch.ops call."""
    _, op, args, fragment = next(c for c in bad_cases(device) if c[0] == case)
    before = [t.clone() for t in tensors_in(args)]
    with pytest.raises(ValueError, match=fragment):
        if entry == "torch.ops":
            getattr(torch.ops.tawpipe, op)(*args)
        else:
            getattr(ops, op)(*args, backend="triton" if entry == "wrapper-triton" else "native")
    assert fake_triton == []
    for a, b in zip(tensors_in(args), before):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


SHAPE_CASES = [c for c in BAD_CASES if "alias" not in c]  # the others need memory


@pytest.mark.parametrize("case", SHAPE_CASES)
def test_meta_and_fake_kernels_validate_with_the_same_checks(case: str) -> None:
    """torch.compile traces with fake tensors, which run the Meta kernels: the same validator
    on shapes, with the same messages as on real tensors."""
    _, op, args, fragment = next(c for c in bad_cases("cpu") if c[0] == case)
    with pytest.raises(ValueError, match=fragment) as real:
        getattr(torch.ops.tawpipe, op)(*args)
    meta_args = next(c for c in bad_cases("meta") if c[0] == case)[2]
    with pytest.raises(ValueError) as meta:
        getattr(torch.ops.tawpipe, op)(*meta_args)
    with FakeTensorMode() as mode:
        fake_args = pytree.tree_map_only(Tensor, mode.from_tensor, args)
        with pytest.raises(ValueError) as fake:
            getattr(torch.ops.tawpipe, op)(*fake_args)
    assert str(meta.value).splitlines()[0] == str(real.value).splitlines()[0]
    assert str(fake.value).splitlines()[0] == str(real.value).splitlines()[0]


def test_device_mismatch_is_rejected() -> None:
    other = "cuda" if HAS_CUDA else "meta"
    out = torch.zeros(8)
    srcs = [torch.ones(2), torch.ones(2, device=other)]
    for fn in (ops.pack, torch.ops.tawpipe.pack):
        with pytest.raises(ValueError, match="move all tensors to one device"):
            fn(srcs, out, [0, 4])
    assert torch.equal(out, torch.zeros(8))


def test_wrapper_rejects_non_tensors() -> None:
    with pytest.raises(TypeError, match=r"srcs\[1\] must be a torch.Tensor"):
        ops.pack([torch.ones(2), [1.0, 2.0]], torch.zeros(4), [0, 2])
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        ops.pack([torch.ones(2)], [0.0] * 4, [0])


def test_overlap_check_scales_to_many_segments() -> None:
    """200k one-element segments in reverse order with one overlap at the far end: found, and
    fast (a quadratic check would take minutes)."""
    n = 200_000
    srcs = [torch.ones(())] * n
    offsets = list(range(n - 1, -1, -1))
    offsets[0] = 0  # collides with the last segment
    out = torch.zeros(n)
    for fn in (ops.pack, torch.ops.tawpipe.pack):
        with pytest.raises(ValueError, match=f"segments 0 \\[0, 1\\) and {n - 1} \\[0, 1\\) overlap"):
            fn(srcs, out, offsets)
    assert not out.any()


# --- memory safety and autograd: every entry follows torch's rules for in-place ops -----------

ENTRIES = ["wrapper", "wrapper-triton", "torch.ops", "bound"]


def run_entry(
    entry: str, op: str, tensors: list[Tensor], flat: Tensor, offsets: list[int], alpha: float
) -> None:
    """The op through one entry point (wrapper-triton: with the fake_triton fixture, which moves
    no data, so only what tawpipe::_prepare does is seen)."""
    if entry == "bound":
        call_bound(op, tensors, flat, offsets, alpha)
    elif entry == "torch.ops":
        args = (tensors, flat, offsets) if op.startswith("pack") else (flat, tensors, offsets)
        getattr(torch.ops.tawpipe, op)(*args, *([alpha] if "accumulate" in op else []))
    else:
        call(op, tensors, flat, offsets, alpha, backend="triton" if entry == "wrapper-triton" else "native")


def small_case(seed: object) -> tuple[list[Tensor], Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed_of(seed))
    tensors = [random_tensor(s, d, "cpu", gen) for s, d in [((3,), torch.float32), ((2, 2), torch.bfloat16)]]
    return tensors, random_tensor((9,), torch.float32, "cpu", gen), [5, 0]


def target_name(entry: str, op: str) -> str:
    """How errors name the last written tensor (flat, or the last list tensor)."""
    if op.startswith("pack"):
        return "the flat buffer" if entry == "bound" else "out"
    return "bound tensor 1" if entry == "bound" else "dsts[1]"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_overwriting_a_tensor_saved_for_backward_raises(entry: str, op: str, fake_triton: list) -> None:
    """A tensor saved for backward and then overwritten must make backward raise, as after
    torch's own in-place ops: every call bumps the version of exactly the tensors it writes."""
    tensors, flat, offsets = small_case((entry, op))
    written = [flat] if op.startswith("pack") else tensors
    target = written[-1]
    weight = torch.rand(target.shape, dtype=target.dtype).requires_grad_()
    loss = (weight * target).sum()  # saves target: d loss / d weight = target
    versions = [t._version for t in [*tensors, flat]]
    run_entry(entry, op, tensors, flat, offsets, 0.5)
    for t, v in zip([*tensors, flat], versions):
        assert t._version == v + any(t is w for w in written)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_leaf_that_requires_grad_is_refused_as_output(entry: str, op: str, fake_triton: list) -> None:
    """As torch refuses in-place ops on such leaves: before any work, naming the tensor and the
    fix. Under torch.no_grad(), or through a .detach()ed alias, the write is allowed."""
    tensors, flat, offsets = small_case((entry, op, "leaf"))
    target = (flat if op.startswith("pack") else tensors[-1]).requires_grad_()
    before = [t.detach().clone() for t in [*tensors, flat]]
    with pytest.raises(RuntimeError, match=rf"{re.escape(target_name(entry, op))} is a leaf tensor "
                       r"that requires grad.*detach\(\).*torch.no_grad\(\)"):
        run_entry(entry, op, tensors, flat, offsets, 0.5)
    assert all(same_bits(t.detach(), b) and t._version == 0 for t, b in zip([*tensors, flat], before))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        target.mul_(1)  # torch's own rule, which the ops follow

    def runner(op: str, tensors: list[Tensor], flat: Tensor, offsets: list[int], alpha: float) -> None:
        run_entry(entry, op, tensors, flat, offsets, alpha)

    with torch.no_grad():
        if entry == "wrapper-triton":
            run_entry(entry, op, tensors, flat, offsets, 0.5)
        else:
            check_against_reference(op, tensors, flat, offsets, 0.5, runner)
    assert target._version == 1 and target.is_leaf
    detached = [t.detach() for t in tensors]  # aliases sharing memory and version counter
    if entry == "wrapper-triton":
        run_entry(entry, op, detached, flat.detach(), offsets, 0.5)
    else:
        check_against_reference(op, detached, flat.detach(), offsets, -1.25, runner)
    assert target._version == 2 and target.is_leaf and target.grad_fn is None


@pytest.mark.parametrize("entry", ["wrapper", "torch.ops"])
def test_view_of_a_leaf_that_requires_grad_is_refused(entry: str) -> None:
    param = torch.zeros(10, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"dsts\[0\] is a view of a leaf tensor that requires grad"):
        run_entry(entry, "unpack", [param[2:5]], torch.ones(3), [0], 1.0)
    assert not param.detach().any()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("requiring", ["written", "read"])
def test_written_tensor_gets_a_history_whose_backward_raises(
    entry: str, op: str, requiring: str, fake_triton: list
) -> None:
    """Torch's rule for in-place ops: the written tensor's history is the op's if it or what it
    read requires grad. The ops have no derivative, so backward must raise (the stale history of
    a written non-leaf would silently give wrong gradients)."""
    tensors, flat, offsets = small_case((entry, op, requiring))
    pack = op.startswith("pack")
    base = torch.rand(9 if pack else 4, requires_grad=True)
    if requiring == "written":  # a non-leaf whose old history leads to base
        target = base * 2 if pack else (base * 2).view(2, 2).to(torch.bfloat16)
        if pack:
            flat = target
        else:
            tensors[-1] = target
    else:  # a read leaf (a parameter being packed, or a flat buffer that requires grad)
        if pack:
            tensors[0] = tensors[0].requires_grad_()
        else:
            flat = flat.requires_grad_()
        target = flat if pack else tensors[-1]
    run_entry(entry, op, tensors, flat, offsets, 0.5)
    assert target.requires_grad and type(target.grad_fn).__name__ in ("NotImplemented", "CopySlices")
    name = f"BoundShards.{op}" if entry == "bound" else f"tawpipe::{op}"
    with pytest.raises(RuntimeError, match=f"derivative for {name} is not implemented"):
        target.float().sum().backward()
    assert base.grad is None


def test_inference_mode_bumps_versions_of_normal_tensors() -> None:
    """Like torch's in-place ops: the bump lives in the ADInplaceOrView kernel, which inference
    mode keeps for normal tensors (while it skips the autograd one)."""
    tensors, flat, offsets = small_case("inference")
    with torch.inference_mode():
        torch.ops.tawpipe.unpack(flat, tensors, offsets)
        torch.ops.tawpipe.pack_accumulate(tensors, flat, offsets, 1.0)
    assert [t._version for t in tensors] == [1, 1] and flat._version == 1


@pytest.mark.parametrize("how", ["shrunk", "freed"])
@pytest.mark.parametrize("side", ["list", "flat"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_tensor_beyond_its_storage_is_refused(
    entry: str, op: str, side: str, how: str, fake_triton: list
) -> None:
    """The kernels trust sizes, so a tensor whose storage shrank would make them read or write
    out of bounds: every tensor, and the flat buffer, is checked against its storage's real size."""
    tensors, flat, offsets = small_case((entry, op, side))
    pack = op.startswith("pack")
    victim = tensors[1] if side == "list" else flat
    end = victim.numel() * victim.element_size()
    storage = victim.untyped_storage()
    storage.resize_(end // 2 if how == "shrunk" else 0)
    intact = [t for t in [*tensors, flat] if fits_storage(t)]
    before = [t.clone() for t in intact]
    if side == "list":
        name = "srcs[1]" if pack and entry != "bound" else "dsts[1]"  # bind checks as unpack
    else:
        name = "out" if pack and entry != "bound" else "flat"
    with pytest.raises(ValueError, match=rf"{re.escape(name)} spans bytes \[0, {end}\) of its storage, "
                       rf"which holds only {storage.nbytes()} bytes .*resize_\(\)\); pass a tensor"):
        run_entry(entry, op, tensors, flat, offsets, 0.5)
    assert all(same_bits(t, b) for t, b in zip(intact, before)) and fake_triton == []


# --- backend selection -----------------------------------------------------------------------


def test_backend_from_argument_and_environment(
    monkeypatch: pytest.MonkeyPatch, fake_triton: list[tuple]
) -> None:
    src, out = torch.ones(3), torch.zeros(4)
    ops.pack_accumulate([src], out, [1], 2.0, backend="triton")
    assert fake_triton == [("pack_accumulate", ([src], out, [1], 2.0))]
    assert torch.equal(out, torch.zeros(4))  # the native op did not run

    monkeypatch.setenv(ops.BACKEND_ENV, "triton")
    ops.unpack(out, [src], [0])
    assert fake_triton[-1] == ("unpack", (out, [src], [0]))
    ops.pack([src], out, [1], backend="native")  # the argument wins over the environment
    assert len(fake_triton) == 2 and torch.equal(out, torch.tensor([0.0, 1, 1, 1]))


def test_unknown_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown tawpipe ops backend 'cuda'"):
        ops.pack([], torch.zeros(1), [], backend="cuda")
    monkeypatch.setenv(ops.BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=ops.BACKEND_ENV):
        ops.pack([], torch.zeros(1), [])
    assert ops.resolve_backend("native") == "native"


@pytest.mark.parametrize("op", OPS)
def test_native_matches_triton_backend(op: str) -> None:
    """The two independent implementations agree (compiled on a GPU, interpreted on CPU)."""
    device = "cuda" if HAS_CUDA else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton on CPU tensors needs TRITON_INTERPRET=1 before triton is imported")
    pytest.importorskip("triton")
    pytest.importorskip("tawpipe.ops.triton")
    gen = torch.Generator().manual_seed(21)
    list_dtypes = [DTYPES[i] for i in torch.randint(0, 3, (40,), generator=gen).tolist()]
    tensors, flat, offsets = make_case(op, list_dtypes, torch.bfloat16, device, gen)
    for backend in ops.BACKENDS:  # each against the same torch reference, on copies of one case
        check_against_reference(op, [t.clone() for t in tensors], flat.clone(), offsets, 0.5, backend=backend)


# --- CUDA specifics --------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_one_kernel_launch_on_the_current_stream() -> None:
    gen = torch.Generator().manual_seed(4)
    srcs = [random_tensor(random_shape(gen), torch.float32, "cuda", gen) for _ in range(2000)]
    offsets, total = layout([s.numel() for s in srcs], gen)
    out = poisoned((total,), torch.bfloat16, "cuda")
    _, want, _ = reference("pack", srcs, out, offsets, 1.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(stream):
            ops.pack(srcs, out, offsets)
        stream.synchronize()
    kernels = [e for e in prof.events() if "shard_kernel" in e.name]
    assert len(kernels) == 1
    assert same_bits(out, want)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_graph_capture_is_refused_clearly() -> None:
    """The table upload of a call cannot be replayed, so capture is refused before any work."""
    src, out = torch.ones(4, device="cuda"), torch.zeros(4, device="cuda")
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            with pytest.raises(RuntimeError, match="capturing a CUDA graph"):
                torch.ops.tawpipe.pack([src], out, [0])
        finally:
            graph.capture_end()
    torch.cuda.synchronize()
    assert not out.any()


# --- ShardLayout -----------------------------------------------------------------------------


def small_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False))
    model[2].weight.data = model[2].weight.data.to(torch.bfloat16)
    return model


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=12), st.integers(1, 16))
def test_layout_offsets_are_aligned_disjoint_and_tight(numels: list[int], align: int) -> None:
    lay = ShardLayout.from_tensors([torch.empty(n) for n in numels], align=align)
    assert lay.numels == tuple(numels)
    end = 0
    for offset, n in zip(lay.offsets, numels):
        assert offset % align == 0 and end <= offset < end + align  # aligned, in order, no waste
        end = offset + n
    assert lay.numel % align == 0 and end <= lay.numel < end + align


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_dtype", DTYPES, ids=dtype_id)
def test_layout_round_trip_of_a_module(flat_dtype: torch.dtype, device: str) -> None:
    model = small_model().to(device)
    named = list(model.named_parameters())
    params = [p.detach() for _, p in named]
    lay = ShardLayout.from_module(model, align=8)
    assert lay.names == tuple(n for n, _ in named)
    assert lay.shapes == tuple(p.shape for p in params)
    assert lay.dtypes == tuple(p.dtype for p in params)
    flat = lay.new_flat(flat_dtype, device)
    assert flat.shape == (lay.numel,) and flat.dtype == flat_dtype and not flat.any()
    offsets = list(lay.offsets)

    lay.pack(params, flat)
    copies = [torch.full_like(p, math.nan) for p in params]
    lay.unpack(flat, copies)
    for p, c in zip(params, copies):
        assert same_bits(c, p.to(flat_dtype).to(p.dtype))  # exact when flat_dtype holds p

    _, want_flat, scale = reference("pack_accumulate", params, flat, offsets, -1.0)
    lay.pack_accumulate(params, flat, alpha=-1.0)
    assert_accumulated(flat, want_flat, scale)
    want_copies, _, scales = reference("unpack_accumulate", copies, flat, offsets, 3.0)
    lay.unpack_accumulate(flat, copies, alpha=3.0)
    for c, w, s in zip(copies, want_copies, scales):
        assert_accumulated(c, w, s)
    padding = torch.ones(lay.numel, dtype=torch.bool, device=device)
    for o, n in zip(lay.offsets, lay.numels):
        padding[o : o + n] = False
    assert not flat[padding].any()  # padding stays zero


def test_layout_views_alias_the_flat_buffer() -> None:
    model = small_model().float()
    lay = ShardLayout.from_module(model, align=4)
    flat = lay.new_flat()
    views = lay.views(flat)
    for i, (v, o, shape) in enumerate(zip(views, lay.offsets, lay.shapes)):
        assert v.shape == shape and v.data_ptr() == flat.data_ptr() + o * flat.element_size()
        v.fill_(i + 1)
    for i, (o, n) in enumerate(zip(lay.offsets, lay.numels)):
        assert torch.equal(flat[o : o + n], torch.full((n,), i + 1.0))
    assert int((flat == 0).sum()) == lay.numel - sum(lay.numels)

    # Bind the module's parameters to the views: the module now reads its weights from flat.
    lay.pack(list(model.parameters()), flat)
    for (name, _), v in zip(list(model.named_parameters()), views):
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(v))
    x = torch.randn(2, 5)
    y = model(x)
    flat.zero_()
    assert torch.equal(model(x), torch.zeros_like(y))  # every weight and bias came from flat
    assert not torch.equal(y, torch.zeros_like(y))


def test_layout_errors() -> None:
    tensors = [torch.ones(3), torch.ones(2, 2)]
    with pytest.raises(ValueError, match="2 tensors but 1 names"):
        ShardLayout.from_tensors(tensors, names=["a"])
    with pytest.raises(ValueError, match="align"):
        ShardLayout.from_tensors(tensors, align=0)
    lay = ShardLayout.from_tensors(tensors, names=["a", "b"])
    assert lay.names == ("a", "b") and ShardLayout.from_tensors(tensors).names == ("0", "1")
    with pytest.raises(ValueError, match="tensor 1 \\('b'\\) has shape \\(4,\\)"):
        lay.pack([torch.ones(3), torch.ones(4)], lay.new_flat())
    with pytest.raises(ValueError, match="got 1 tensors for a layout of 2"):
        lay.unpack(lay.new_flat(), [torch.ones(3)])
    with pytest.raises(ValueError, match="at least 7 elements"):
        lay.views(torch.zeros(6))
    with pytest.raises(ValueError, match="one entry per tensor"):
        ShardLayout(names=("a",), shapes=(), dtypes=(), offsets=(), numel=0)
    one = dict(names=("a",), shapes=((3,),), dtypes=(torch.float32,))
    for bad in (dict(offsets=(True,), numel=3), dict(offsets=(0.0,), numel=3), dict(offsets=(0,), numel=2.5)):
        with pytest.raises(ValueError, match="offsets and numel must be whole numbers of elements, got"):
            ShardLayout(**one, **bad)
    with pytest.raises(ValueError, match="align must be a positive number of elements, got True"):
        ShardLayout(**one, offsets=(0,), numel=3, align=True)


# --- bound fast path (ShardLayout.bind) ------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("list_dtype,flat_dtype", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("op", OPS)
def test_bound_matches_torch_every_dtype_pair(
    op: str, list_dtype: torch.dtype, flat_dtype: torch.dtype, device: str
) -> None:
    seed = seed_of(op, list_dtype, flat_dtype, "bound")
    n = randint(1, 70, torch.Generator().manual_seed(seed))
    check_op(op, [list_dtype] * n, flat_dtype, device, seed, runner=call_bound)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", [0, 1, 2000])
def test_bound_mixed_dtypes_many_tensors(op: str, n: int, device: str) -> None:
    gen = torch.Generator().manual_seed(seed_of(op, n, "bound"))
    list_dtypes = [DTYPES[i] for i in torch.randint(0, 3, (n,), generator=gen).tolist()]
    flat_dtype = DTYPES[randint(0, 3, gen)]
    check_op(op, list_dtypes, flat_dtype, device, seed_of(op, n, "bound data"), runner=call_bound)


@pytest.mark.parametrize("device", DEVICES)
def test_bound_calls_see_new_values_and_rebinding_follows_replaced_tensors(device: str) -> None:
    """A binding is reused across steps (values change in place); replacing a tensor's data
    makes calls raise until bind is called again, which then uses the new tensor."""
    gen = torch.Generator().manual_seed(seed_of("rebind"))
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3)).to(device)
    params = list(model.parameters())
    lay = ShardLayout.from_module(model, align=4)
    flat = poisoned((lay.numel,), torch.bfloat16, device)
    bound = lay.bind(params, flat)
    with torch.no_grad():
        for step in range(3):
            for p in params:
                p.copy_(random_tensor(tuple(p.shape), torch.float32, device, gen))
            _, want, _ = reference("pack", params, flat, list(lay.offsets), 1.0)
            bound.pack()
            assert same_bits(flat, want), f"step {step}"

        params[1].data = random_tensor((4,), torch.float32, device, gen)  # a new storage
        before = flat.clone()
        with pytest.raises(RuntimeError, match="bound tensor 1 no longer has the storage.*bind again"):
            bound.pack()
        assert same_bits(flat, before)  # refused before any work
        bound = lay.bind(params, flat)
        _, want, _ = reference("pack", params, flat, list(lay.offsets), 1.0)
        bound.pack()
        assert same_bits(flat, want)


def changes() -> list[tuple[str, Callable[[list[Tensor], Tensor], None], str]]:
    """(name, change to the bound tensors or flat buffer, which one the error names)."""

    def replace_data(ts: list[Tensor], flat: Tensor) -> None:
        ts[2].data = torch.zeros_like(ts[2])

    def set_storage(ts: list[Tensor], flat: Tensor) -> None:
        ts[0].set_(torch.zeros_like(ts[0]))

    def free_storage(ts: list[Tensor], flat: Tensor) -> None:
        ts[1].untyped_storage().resize_(0)

    def shrink_storage(ts: list[Tensor], flat: Tensor) -> None:
        ts[2].untyped_storage().resize_(ts[2].untyped_storage().nbytes() - 4)

    return [
        ("resize to more elements", lambda ts, flat: ts[0].resize_(50), "bound tensor 0"),
        ("resize to fewer elements", lambda ts, flat: ts[1].resize_(1), "bound tensor 1"),
        ("param.data = ...", replace_data, "bound tensor 2"),
        ("set_", set_storage, "bound tensor 0"),
        ("storage freed", free_storage, "bound tensor 1"),
        ("storage shrunk", shrink_storage, "bound tensor 2"),
        ("transposed in place", lambda ts, flat: ts[2].t_(), "bound tensor 2"),
        ("flat resized", lambda ts, flat: flat.resize_(flat.numel() + 10_000), "the flat buffer"),
    ]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("change", [c[0] for c in changes()])
def test_bound_call_after_a_change_raises_instead_of_corrupting(change: str, op: str) -> None:
    _, apply, culprit = next(c for c in changes() if c[0] == change)
    gen = torch.Generator().manual_seed(5)
    tensors = [random_tensor(s, torch.float32, "cpu", gen) for s in [(7,), (3,), (2, 3)]]
    lay = ShardLayout.from_tensors(tensors)
    flat = random_tensor((lay.numel,), torch.float16, "cpu", gen)
    bound = lay.bind(tensors, flat)
    apply(tensors, flat)
    intact = [t for t in [*tensors, flat] if fits_storage(t)]
    before = [t.clone() for t in intact]
    with pytest.raises(RuntimeError, match=f"{culprit} no longer has the storage"):
        getattr(bound, op)(*([0.5] if "accumulate" in op else []))
    assert all(same_bits(a, b) for a, b in zip(intact, before))


BIND_BAD_CASES = [c for c in BAD_CASES if c != "lengths differ"]  # a ShardLayout cannot differ


@pytest.mark.parametrize("case", BIND_BAD_CASES)
def test_bind_validates_with_the_native_checks_and_messages(case: str) -> None:
    """bind checks its tensors as unpack destinations (which covers packing from them), with the
    message of tawpipe::unpack under bind's name."""
    _, op, args, fragment = next(c for c in bad_cases("cpu") if c[0] == case)
    tensors, flat, offsets = (args[0], args[1], args[2]) if op == "pack" else (args[1], args[0], args[2])
    with pytest.raises(ValueError) as unpack_error:
        torch.ops.tawpipe.unpack(flat, tensors, offsets)
    lay = layout_of(tensors, offsets, flat.numel())
    with pytest.raises(ValueError, match=fragment) as bind_error:
        lay.bind(tensors, flat)
    want = str(unpack_error.value).replace("tawpipe::unpack", "ShardLayout.bind")
    assert str(bind_error.value).splitlines()[0] == want.splitlines()[0]


def test_bind_rejects_non_tensors_and_wrong_shapes() -> None:
    lay = ShardLayout.from_tensors([torch.ones(3)])
    with pytest.raises(TypeError, match=r"ShardLayout.bind: flat must be a torch.Tensor"):
        lay.bind([torch.ones(3)], [0.0] * 3)
    with pytest.raises(ValueError, match="tensor 0 \\('0'\\) has shape \\(4,\\)"):
        lay.bind([torch.ones(4)], lay.new_flat())


def test_bound_table_is_opaque_and_freed_with_its_binding() -> None:
    """The table holds raw pointers and stays in C++: Python holds a handle, which every call
    checks, so a wrong or stale handle is refused instead of addressing anything."""
    tensors = [torch.ones(3)]
    lay = ShardLayout.from_tensors(tensors)
    flat = lay.new_flat()
    bound = lay.bind(tensors, flat)
    handle = bound._table
    assert isinstance(handle, int)
    for wrong in (handle + 1, -handle, 0):
        with pytest.raises(ValueError, match=f"{wrong} is not the handle of a live table.*ShardLayout.bind"):
            torch.ops.tawpipe._run_bound(wrong, 0, 1.0)
    with pytest.raises(RuntimeError, match="Expected a value of type 'int'"):
        torch.ops.tawpipe._run_bound(torch.zeros(4096, dtype=torch.uint8), 0, 1.0)
    with pytest.raises(ValueError, match="mode must be 0-3"):
        torch.ops.tawpipe._run_bound(handle, 4, 1.0)
    for clone in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled.*bind the tensors again"):
            clone(bound)
    torch.ops.tawpipe._run_bound(handle, 0, 1.0)  # the real table still works
    assert torch.equal(flat, torch.ones(3))

    alive = weakref.ref(tensors[0])
    del bound, tensors
    gc.collect()
    assert alive() is None  # the table let go of its tensors
    assert lay.bind([torch.ones(3)], flat)._table > handle  # handles are never reused
    with pytest.raises(ValueError, match=f"{handle} is not the handle of a live table"):
        torch.ops.tawpipe._run_bound(handle, 0, 1.0)


def test_bound_tensors_stay_alive() -> None:
    lay = ShardLayout.from_tensors([torch.ones(3), torch.ones(2)])
    flat = lay.new_flat()
    bound = lay.bind([torch.full((3,), 2.0), torch.full((2,), 3.0)], flat)  # only bound refers
    torch.ones(1000)  # reuse freed memory, if any were freed
    bound.pack()
    assert torch.equal(flat, torch.tensor([2.0, 2, 2, 3, 3]))


def test_bound_refuses_to_be_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its tensors are invisible to the graph: torch.compile(fullgraph=True) must fail with the
    reason, and bind / every call refuse while compiling."""
    tensors = [torch.ones(3), torch.ones(2)]
    lay = ShardLayout.from_tensors(tensors)
    flat = lay.new_flat()
    bound = lay.bind(tensors, flat)

    def step(x: Tensor) -> Tensor:
        bound.unpack_accumulate(2.0)
        return x + 1

    torch._dynamo.reset()
    with pytest.raises(Exception, match="BoundShards.unpack_accumulate cannot run under torch.compile"):
        torch.compile(step, backend="eager", fullgraph=True)(torch.ones(1))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for method in OPS:
        with pytest.raises(RuntimeError, match=f"BoundShards.{method} cannot run under torch.compile"):
            getattr(bound, method)(*([1.0] if "accumulate" in method else []))
    with pytest.raises(RuntimeError, match="BoundShards.bind cannot run under torch.compile"):
        lay.bind(tensors, flat)
    assert torch.equal(flat, torch.zeros(5)) and all(torch.equal(t, torch.ones_like(t)) for t in tensors)
