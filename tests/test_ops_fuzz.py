"""Fuzzing of the four ops (wrapper, direct torch.ops call, ShardLayout.bind) with hypothesis.

Each case is a small "world": a few storages (an arena holding the flat buffer, and one per
list tensor) and tensors viewing them, drawn with random dtypes, shapes (empty and 0-d
included), offsets (valid layouts, then sometimes shifted into overlaps, past the end or below
zero), non-contiguous and aliasing views (into the arena, inside or outside the flat buffer,
and into each other), unsupported dtypes, non-tensor arguments and shrunk or freed storages.

An independent oracle, written from the documented rules with brute-force checks, says whether
the call is valid. A valid call must equal a plain-torch reference run on a copy of the world,
byte for byte over every storage (so writes outside the segments are seen), and bump the version
counter of exactly the tensors it writes; accumulation is computed in float32 the same way
(alpha is a float32 value), then cast. An invalid call must raise ValueError (TypeError for a
non-tensor) whose message names the op, the problem and the fix, and leave every byte and
version untouched. Values are fresh random numbers, never zero, of magnitudes that stay finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

from tawpipe import ops
from tawpipe.ops import ShardLayout

OPS = ["pack", "unpack", "pack_accumulate", "unpack_accumulate"]
SUPPORTED = [torch.float32, torch.bfloat16, torch.float16]
# Mostly supported dtypes; float64 sometimes, which must be refused.
DTYPES = st.sampled_from(SUPPORTED * 10 + [torch.float64])
# float32 values, so that alpha * x rounds the same in the kernels and in the reference.
ALPHAS = st.sampled_from([1.0, -1.0, 0.5, -1.25, 3.0, 2.0**-7, -0.3125])


@dataclass
class View:
    """A tensor of the world: as_strided over storage `base` (or a non-tensor, if base < 0)."""

    base: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class Recipe:
    op: str
    base_dtypes: list[torch.dtype]  # base 0 is the arena that holds the flat buffer
    base_numels: list[int]
    flat: View
    tensors: list[View]
    offsets: list[int]
    shrink: dict[int, int] = field(default_factory=dict)  # base -> its storage's new byte size
    alpha: float = 1.0
    seed: int = 0


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def one_in(k: int) -> st.SearchStrategy[bool]:
    """True about once in k draws (hypothesis favours the first, simplest, element)."""
    return st.sampled_from([False] * (k - 1) + [True])


@st.composite
def recipes(draw: st.DrawFn) -> Recipe:
    op = draw(st.sampled_from(OPS))
    n = draw(st.sampled_from([3, 2, 4, 1, 5, 6, 0]))
    shapes = draw(
        st.lists(
            st.one_of(
                st.just(()),
                st.tuples(st.integers(0, 12)),
                st.tuples(st.integers(0, 5), st.integers(0, 5)),
            ),
            min_size=n,
            max_size=n,
        )
    )
    numels = [math.prod(s) for s in shapes]
    # A valid layout (shuffled order, small gaps), then some offsets shifted at random.
    offsets = [0] * n
    cursor = 0
    for i in draw(st.permutations(range(n))):
        cursor += draw(st.integers(0, 2))
        offsets[i] = cursor
        cursor += numels[i]
    capacity = cursor + draw(st.integers(0, 2))
    for i in range(n):
        if draw(one_in(12)):
            offsets[i] += draw(st.integers(-6, 6))
    if n and draw(one_in(20)):
        capacity = max(0, capacity - draw(st.integers(1, 3)))  # too small a flat buffer

    # The arena: padding, the flat buffer (contiguous, strided or 2-D), padding.
    flat_dtype = draw(DTYPES)
    flat_kind = draw(st.sampled_from(["1-D"] * 8 + ["strided", "2-D"]))
    before = draw(st.integers(0, 4))
    step = 2 if flat_kind == "strided" else 1
    arena = before + capacity * step + draw(st.integers(0, 4))
    if flat_kind == "2-D":
        flat = View(0, (1, capacity), (capacity, 1), before)
    else:
        flat = View(0, (capacity,), (step,), before)
    base_dtypes, base_numels = [flat_dtype], [arena]

    tensors: list[View] = []
    for i, shape in enumerate(shapes):
        kind = draw(st.sampled_from(["own"] * 6 + ["strided", "in arena", "into another"]))
        numel = numels[i]
        if kind == "in arena" and numel <= arena:  # inside or outside the flat buffer's bytes
            tensors.append(View(0, shape, contiguous_strides(shape), draw(st.integers(0, arena - numel))))
            continue
        if kind == "into another" and tensors:
            other = tensors[draw(st.integers(0, len(tensors) - 1))]
            start = other.offset + draw(st.integers(0, 2))
            if start + numel <= base_numels[other.base]:
                tensors.append(View(other.base, shape, contiguous_strides(shape), start))
                continue
        # Its own storage; "strided" spaces the elements out (non-contiguous if numel > 1).
        spread = 2 if kind == "strided" else 1
        base_dtypes.append(draw(DTYPES))
        base_numels.append(numel * spread + 1)
        strides = tuple(s * spread for s in contiguous_strides(shape))
        tensors.append(View(len(base_dtypes) - 1, shape, strides, draw(st.integers(0, 1))))

    if n and draw(one_in(30)):
        tensors[draw(st.integers(0, n - 1))] = View(-1, (), (), 0)  # a non-tensor argument
    shrink = {}
    if draw(one_in(12)):
        base = draw(st.integers(0, len(base_dtypes) - 1))
        nbytes = base_numels[base] * torch.empty((), dtype=base_dtypes[base]).element_size()
        shrink[base] = draw(st.integers(0, max(0, nbytes - 1)))
    return Recipe(op, base_dtypes, base_numels, flat, tensors, offsets, shrink, draw(ALPHAS),
                  draw(st.integers(0, 2**31 - 1)))


def random_values(numel: int, dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    """Nonzero, of magnitudes 1e-6 .. 2e3 (subnormal in float16 at the low end): sums with
    |alpha| <= 3 stay finite in every dtype."""
    magnitude = torch.pow(10.0, torch.empty(numel, dtype=torch.float64).uniform_(-6, 3, generator=gen))
    sign = torch.randint(0, 2, (numel,), generator=gen) * 2 - 1
    values = (sign * magnitude * (1 + torch.rand(numel, generator=gen, dtype=torch.float64))).to(dtype)
    return torch.where(values == 0, torch.ones((), dtype=dtype), values)  # rounding never gives 0


class World:
    """The recipe's storages and views, built fresh (same values for the same recipe)."""

    def __init__(self, r: Recipe) -> None:
        gen = torch.Generator().manual_seed(r.seed)
        self.bases = [random_values(n, d, gen) for n, d in zip(r.base_numels, r.base_dtypes)]
        self.flat = self.view(r.flat)
        self.tensors = [self.view(v) if v.base >= 0 else [1.0] for v in r.tensors]
        for base, nbytes in r.shrink.items():
            self.bases[base].untyped_storage().resize_(nbytes)

    def view(self, v: View) -> Tensor:
        return self.bases[v.base].as_strided(v.shape, v.stride, v.offset)

    def storage_bytes(self) -> list[Tensor]:
        """Every storage as bytes, at its current (possibly shrunk) size."""
        return [torch.empty(0, dtype=torch.uint8).set_(b.untyped_storage()).clone() for b in self.bases]

    def versions(self) -> list[int]:
        return [b._version for b in self.bases]


def byte_range(t: Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def disjoint(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[1] <= b[0] or b[1] <= a[0]


def oracle(op: str, w: World, offsets: list[int]) -> type[Exception] | None:
    """The exception the call must raise, from the documented rules; None if it is valid."""
    tensors, flat = w.tensors, w.flat
    if any(not isinstance(t, Tensor) for t in tensors):
        return TypeError
    if flat.dtype not in SUPPORTED or flat.dim() != 1 or not flat.is_contiguous():
        return ValueError
    capacity = flat.numel()
    for t, o in zip(tensors, offsets):
        if t.dtype not in SUPPORTED or not t.is_contiguous() or not 0 <= o <= capacity - t.numel():
            return ValueError
    full = [(t, o) for t, o in zip(tensors, offsets) if t.numel()]
    for i, (a, oa) in enumerate(full):  # segments pairwise disjoint in flat
        for b, ob in full[i + 1 :]:
            if not (oa + a.numel() <= ob or ob + b.numel() <= oa):
                return ValueError
    for t in [flat] + [t for t, _ in full]:  # within their storages
        if t.numel() and (t.storage_offset() + t.numel()) * t.element_size() > t.untyped_storage().nbytes():
            return ValueError
    if capacity and any(not disjoint(byte_range(t), byte_range(flat)) for t, _ in full):
        return ValueError
    if op.startswith("unpack"):
        ranges = [byte_range(t) for t, _ in full]
        if any(not disjoint(a, b) for i, a in enumerate(ranges) for b in ranges[i + 1 :]):
            return ValueError
    return None


def reference(op: str, w: World, offsets: list[int], alpha: float) -> None:
    """The op in plain torch on world w, segment by segment (valid calls never alias)."""
    for t, o in zip(w.tensors, offsets):
        seg = w.flat[o : o + t.numel()]
        if op == "pack":
            seg.copy_(t.reshape(-1).to(seg.dtype))
        elif op == "pack_accumulate":
            seg.copy_((seg.float() + alpha * t.reshape(-1).float()).to(seg.dtype))
        elif op == "unpack":
            t.copy_(seg.reshape(t.shape).to(t.dtype))
        else:
            t.copy_((t.float() + alpha * seg.reshape(t.shape).float()).to(t.dtype))


def written_bases(r: Recipe) -> list[int]:
    return [r.flat.base] if r.op.startswith("pack") else [v.base for v in r.tensors]


def run(entry: str, r: Recipe, w: World) -> None:
    args = (w.tensors, w.flat, r.offsets) if r.op.startswith("pack") else (w.flat, w.tensors, r.offsets)
    extra = [r.alpha] if "accumulate" in r.op else []
    if entry == "wrapper":
        getattr(ops, r.op)(*args, *extra)
    elif entry == "torch.ops":
        getattr(torch.ops.tawpipe, r.op)(*args, *extra)
    else:
        getattr(w.bound, r.op)(*extra)


def check_case(r: Recipe) -> None:
    for entry in ("wrapper", "torch.ops", "bound"):
        w = World(r)
        expected = oracle(r.op, w, r.offsets)
        prefix = f"tawpipe::{r.op}: "
        if entry == "torch.ops" and expected is TypeError:
            continue  # the dispatcher's own argument parsing, not tawpipe's
        if entry == "bound":
            if expected is TypeError:
                continue  # ShardLayout needs shapes
            prefix = "ShardLayout.bind: "
            # bind checks the tensors as unpack destinations, which covers every op
            expected = oracle("unpack", w, r.offsets)
            layout = ShardLayout(
                names=tuple(map(str, range(len(w.tensors)))),
                shapes=tuple(t.shape for t in w.tensors),
                dtypes=tuple(t.dtype for t in w.tensors),
                offsets=tuple(r.offsets),
                numel=w.flat.numel(),
            )
        bytes_before, versions_before = w.storage_bytes(), w.versions()
        if expected is not None:
            with pytest.raises(expected) as info:
                if entry == "bound":
                    layout.bind(w.tensors, w.flat)
                else:
                    run(entry, r, w)
            message = str(info.value).splitlines()[0]
            if expected is TypeError:
                assert "must be a torch.Tensor" in message, message
            else:
                assert message.startswith(prefix) and "; " in message, message  # problem; fix
            assert all(torch.equal(a, b) for a, b in zip(w.storage_bytes(), bytes_before)), entry
            assert w.versions() == versions_before, entry
            continue
        if entry == "bound":
            w.bound = layout.bind(w.tensors, w.flat)
        want = World(r)
        reference(r.op, want, r.offsets, r.alpha)
        run(entry, r, w)
        for i, (got, exp) in enumerate(zip(w.storage_bytes(), want.storage_bytes())):
            assert torch.equal(got, exp), f"{entry}: storage {i} differs from the reference"
        bumps = [written_bases(r).count(b) for b in range(len(r.base_dtypes))]
        assert w.versions() == [v + k for v, k in zip(versions_before, bumps)], entry


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(recipes())
def test_fuzz_ops(r: Recipe) -> None:
    check_case(r)


@pytest.mark.slow
@settings(max_examples=2500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipes())
def test_fuzz_ops_many(r: Recipe) -> None:
    check_case(r)
