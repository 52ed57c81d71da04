"""tawpipe.ops.triton against a plain-torch reference, called directly (no C++ build needed).

Without a GPU the kernels run under the triton interpreter on CPU tensors; triton picks the
interpreter from TRITON_INTERPRET, which must be set before triton is imported, hence here at the
top. With a GPU (and TRITON_INTERPRET unset) the same checks run compiled on CUDA tensors.

Every list-side tensor is a view into a larger poisoned arena, and the flat buffer is poisoned
outside the segments, so the checks see both unwritten elements and writes out of bounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from tawpipe.ops import triton as triton_ops

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1"),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(
                INTERPRETED or not torch.cuda.is_available(),
                reason="needs a CUDA device and compiled triton (TRITON_INTERPRET unset)",
            ),
        ],
    ),
]
# (number of tensors, whether segments start 16-byte aligned): both kernel paths, empty lists.
LISTS = [(0, False), (1, True), (9, False), (50, True), (50, False)]
GUARD = 8  # poisoned elements before and after every list-side tensor


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view, so that comparisons see NaN poison and signed zeros exactly."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _shapes(n: int, gen: torch.Generator) -> list[tuple[int, ...]]:
    """Random small shapes: scalars, odd sizes, empty tensors, and multi-tile ones."""
    block = triton_ops._BLOCK
    special = [(2, block + 3), (block,), (0, 5), ()]
    shapes = []
    for i in range(n):
        if n >= 9 and i < len(special):
            shapes.append(special[i])
            continue
        ndim = int(torch.randint(1, 4, (1,), generator=gen))
        shapes.append(tuple(int(d) for d in torch.randint(1, 14, (ndim,), generator=gen)))
    order = torch.randperm(n, generator=gen).tolist()
    return [shapes[i] for i in order]


def _arena_views(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, device: str, aligned: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A NaN-poisoned arena and one contiguous view per shape, separated by GUARD elements."""
    align = 16 // torch.tensor([], dtype=dtype).element_size()
    starts, pos = [], GUARD
    for shape in shapes:
        if aligned:
            pos = -(-pos // align) * align
        else:
            pos += 1 if pos % align == 0 else 0
        starts.append(pos)
        pos += torch.Size(shape).numel() + GUARD
    arena = torch.full((pos,), float("nan"), dtype=dtype, device=device)
    views = [arena[s : s + torch.Size(sh).numel()].view(sh) for s, sh in zip(starts, shapes)]
    return arena, views


def _layout(
    numels: list[int], dtype: torch.dtype, aligned: bool, gen: torch.Generator
) -> tuple[list[int], int]:
    """Offsets of the segments in a flat buffer, in shuffled order with random gaps."""
    align = 16 // torch.tensor([], dtype=dtype).element_size()
    offsets = [0] * len(numels)
    pos = 0
    for i in torch.randperm(len(numels), generator=gen).tolist():
        pos += int(torch.randint(0, 5, (1,), generator=gen))
        if aligned:
            pos = -(-pos // align) * align
        elif pos % align == 0:
            pos += 1
        offsets[i] = pos
        pos += numels[i]
    return offsets, pos + int(torch.randint(0, 5, (1,), generator=gen))


def _fill_random(views: list[torch.Tensor], gen: torch.Generator) -> None:
    """Fresh nonzero random data (uniform in +-[0.5, 2.5)) written into the given views."""
    for v in views:
        mag = torch.rand(v.shape, generator=gen) * 2 + 0.5
        sign = torch.randint(0, 2, v.shape, generator=gen) * 2 - 1
        v.copy_(mag * sign)


def _segments(
    flat: torch.Tensor, offsets: list[int], like: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The views of flat that the op maps to each tensor of ``like``."""
    return [flat[o : o + t.numel()].view(t.shape) for o, t in zip(offsets, like)]


def _outside_mask(flat: torch.Tensor, offsets: list[int], numels: list[int]) -> torch.Tensor:
    """True for the elements of flat that belong to no segment."""
    inside = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    for o, n in zip(offsets, numels):
        inside[o : o + n] = True
    return ~inside


def _same_views(
    arena: torch.Tensor, other: torch.Tensor, views: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The views of ``other`` at the positions that ``views`` have in ``arena``."""
    begins = [(v.data_ptr() - arena.data_ptr()) // v.element_size() for v in views]
    return [other[b : b + v.numel()].view(v.shape) for b, v in zip(begins, views)]


def _guards(arena: torch.Tensor, views: list[torch.Tensor]) -> torch.Tensor:
    """True for the elements of arena that belong to no view."""
    mask = torch.ones(arena.numel(), dtype=torch.bool, device=arena.device)
    for v in _same_views(arena, mask, views):
        v.fill_(False)
    return mask


def _assert_accumulated(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Exact under the interpreter (same float32 operations as torch); on a GPU the compiler may
    fuse the multiply-add, so allow one rounding step of the destination dtype."""
    if INTERPRETED:
        assert torch.equal(_bits(got), _bits(ref))
    else:
        torch.testing.assert_close(got, ref, rtol=torch.finfo(got.dtype).eps, atol=1e-5)


def _case(
    device: str, list_dtype: torch.dtype, flat_dtype: torch.dtype, n: int, aligned: bool, seed: int
) -> tuple[torch.Generator, torch.Tensor, list[torch.Tensor], torch.Tensor, list[int]]:
    """Random list-side tensors (in a poisoned arena) and a NaN-poisoned flat buffer."""
    gen = torch.Generator().manual_seed(seed)
    shapes = _shapes(n, gen)
    arena, tensors = _arena_views(shapes, list_dtype, device, aligned)
    offsets, size = _layout([t.numel() for t in tensors], flat_dtype, aligned, gen)
    flat = torch.full((size,), float("nan"), dtype=flat_dtype, device=device)
    return gen, arena, tensors, flat, offsets


def _seed(*parts: object) -> int:
    """A seed per test case that is stable across processes (hash() of a str is not)."""
    return sum(ord(c) * (i + 1) for i, c in enumerate(repr(parts))) % 2**31


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,aligned", LISTS)
@pytest.mark.parametrize("flat_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("list_dtype", DTYPES, ids=str)
def test_pack_then_unpack(
    device: str, list_dtype: torch.dtype, flat_dtype: torch.dtype, n: int, aligned: bool
) -> None:
    gen, arena, srcs, out, offsets = _case(
        device, list_dtype, flat_dtype, n, aligned, _seed(list_dtype, flat_dtype, n, aligned)
    )
    _fill_random(srcs, gen)
    arena_before = arena.clone()
    out_before = out.clone()
    numels = [t.numel() for t in srcs]

    triton_ops.pack(srcs, out, offsets)

    for got, src in zip(_segments(out, offsets, srcs), srcs):
        assert torch.equal(_bits(got), _bits(src.to(flat_dtype)))
    outside = _outside_mask(out, offsets, numels)
    assert torch.equal(_bits(out)[outside], _bits(out_before)[outside])
    assert torch.equal(_bits(arena), _bits(arena_before))

    # Unpack the packed buffer into fresh poisoned views: segment i must land in dsts[i] only.
    dst_arena, dsts = _arena_views([tuple(t.shape) for t in srcs], list_dtype, device, aligned)
    dst_arena_before = dst_arena.clone()
    triton_ops.unpack(out, dsts, offsets)

    for dst, seg in zip(dsts, _segments(out, offsets, srcs)):
        assert torch.equal(_bits(dst), _bits(seg.to(list_dtype)))
    guards = _guards(dst_arena, dsts)
    assert torch.equal(_bits(dst_arena)[guards], _bits(dst_arena_before)[guards])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,aligned", LISTS)
@pytest.mark.parametrize("flat_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("list_dtype", DTYPES, ids=str)
def test_accumulate(
    device: str, list_dtype: torch.dtype, flat_dtype: torch.dtype, n: int, aligned: bool
) -> None:
    gen, arena, tensors, flat, offsets = _case(
        device, list_dtype, flat_dtype, n, aligned, _seed("acc", list_dtype, flat_dtype, n, aligned)
    )
    _fill_random(tensors, gen)
    _fill_random(_segments(flat, offsets, tensors), gen)
    alpha = float(torch.empty(1).uniform_(-2.0, 2.0, generator=gen))
    numels = [t.numel() for t in tensors]
    outside = _outside_mask(flat, offsets, numels)
    arena_before, flat_before = arena.clone(), flat.clone()

    def ref(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return (dst.float() + alpha * src.reshape(dst.shape).float()).to(dst.dtype)

    triton_ops.pack_accumulate(tensors, flat, offsets, alpha)

    segs_before = _segments(flat_before, offsets, tensors)
    for got, before, src in zip(_segments(flat, offsets, tensors), segs_before, tensors):
        _assert_accumulated(got, ref(before, src))
    assert torch.equal(_bits(flat)[outside], _bits(flat_before)[outside])
    assert torch.equal(_bits(arena), _bits(arena_before))

    flat_mid = flat.clone()
    triton_ops.unpack_accumulate(flat, tensors, offsets, alpha)

    befores = _same_views(arena, arena_before, tensors)
    for got, before, seg in zip(tensors, befores, _segments(flat_mid, offsets, tensors)):
        _assert_accumulated(got, ref(before, seg))
    assert torch.equal(_bits(flat), _bits(flat_mid))
    guards = _guards(arena, tensors)
    assert torch.equal(_bits(arena)[guards], _bits(arena_before)[guards])


def _special_values() -> torch.Tensor:
    """float32 values where rounding to bfloat16/float16 is easy to get wrong: ties to even both
    ways, just off ties, overflow to inf, subnormals, signed zeros, infinities and NaN."""
    bits = [
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF818000,  # bfloat16 ties and near
        0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x00000001, 0x00408000, 0x80018000,  # edges
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,  # 0, inf, NaN
    ]
    ints = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32)
    fp16_edges = [1 + 2**-11, 1 + 3 * 2**-11, 65519.0, 65520.0, -65520.0, 2**-25, 3 * 2**-25]
    bf16_from_fp16 = [1 + 2**-8, 1 + 3 * 2**-8, 2**-24]  # exact in float16, ties for bfloat16
    return torch.cat([ints.view(torch.float32), torch.tensor(fp16_edges + bf16_from_fp16)])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", DTYPES, ids=str)
def test_casts_round_like_torch(device: str, src_dtype: torch.dtype) -> None:
    src = _special_values().to(src_dtype).to(device)
    for dst_dtype in DTYPES:
        out = torch.full((src.numel() + 3,), 7.0, dtype=dst_dtype, device=device)
        triton_ops.pack([src], out, [2])
        got, want = out[2:-1], src.to(dst_dtype)
        assert torch.equal(got.isnan(), want.isnan()), (src_dtype, dst_dtype)
        finite = ~want.isnan()
        assert torch.equal(_bits(got)[finite], _bits(want)[finite]), (src_dtype, dst_dtype)
        dst = torch.full_like(src, 7.0, dtype=dst_dtype)
        triton_ops.unpack(src, [dst], [0])
        assert torch.equal(_bits(dst)[finite], _bits(want)[finite]), (src_dtype, dst_dtype)
        assert torch.equal(dst.isnan(), want.isnan())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_dtype", DTYPES, ids=str)
def test_mixed_dtypes_one_launch_per_dtype(
    device: str, flat_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list of mixed dtypes is grouped per dtype: one launch each (one descriptor table each)."""
    gen = torch.Generator().manual_seed(_seed("mixed", flat_dtype))
    n = 40
    dtypes = [DTYPES[i % 3] for i in torch.randperm(n, generator=gen).tolist()]
    shapes = _shapes(n, gen)
    tensors = [torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, dtypes)]
    _fill_random(tensors, gen)
    offsets, size = _layout([t.numel() for t in tensors], flat_dtype, False, gen)
    flat = torch.full((size,), float("nan"), dtype=flat_dtype, device=device)
    tables = []
    real_table = triton_ops._tile_table

    def counting_table(*args: object) -> tuple[torch.Tensor, bool]:
        tables.append(args)
        return real_table(*args)

    monkeypatch.setattr(triton_ops, "_tile_table", counting_table)

    triton_ops.pack(tensors, flat, offsets)
    assert len(tables) == 3
    for got, src in zip(_segments(flat, offsets, tensors), tensors):
        assert torch.equal(_bits(got), _bits(src.to(flat_dtype)))
    outside = _outside_mask(flat, offsets, [t.numel() for t in tensors])
    assert bool(flat[outside].isnan().all())

    dsts = [torch.empty_like(t) for t in tensors]
    _fill_random(dsts, gen)
    befores = [d.clone() for d in dsts]
    triton_ops.unpack_accumulate(flat, dsts, offsets, -0.5)
    assert len(tables) == 6
    for dst, before, seg in zip(dsts, befores, _segments(flat, offsets, tensors)):
        _assert_accumulated(dst, (before.float() - 0.5 * seg.float()).to(dst.dtype))


def test_without_triton_empty_is_noop_and_use_names_the_package() -> None:
    """Importing the module must not need triton; using it without triton says what is missing."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from tawpipe.ops import triton as T\n"
        "T.pack([], torch.empty(0), [])\n"
        "T.unpack(torch.ones(2), [torch.empty(0)], [1])\n"
        "try:\n"
        "    T.pack([torch.ones(3)], torch.empty(3), [0])\n"
        "except ImportError as e:\n"
        "    assert 'pip install triton' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.cuda
@pytest.mark.skipif(
    INTERPRETED or not torch.cuda.is_available(), reason="needs compiled triton and a CUDA device"
)
def test_cpu_tensors_without_interpreter_raise() -> None:
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        triton_ops.pack([torch.ones(3)], torch.empty(3), [0])
