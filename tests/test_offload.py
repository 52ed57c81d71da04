"""HostOffload against torch: loads equal torch casts, accumulation equals float32 adds. CPU path
everywhere; the same checks run on CUDA (pinned memory, streamed pieces) when a GPU is present.
The engine's exactness with offload on is tested in test_engine.py."""

from __future__ import annotations

import pytest
import torch

from tawpipe.runtime.offload import HostOffload, OffloadMemory
from tawpipe.ops import ShardLayout

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = [(37, 11), (5,), (3, 4, 7), (), (129,), (16, 16)]


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _flat(layout: ShardLayout, tensors: list[torch.Tensor], device: str = "cpu") -> torch.Tensor:
    flat = layout.new_flat(torch.float32)
    layout.pack(tensors, flat)
    return flat.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_load_weights_casts_like_torch(device: str, dtype: torch.dtype) -> None:
    params = _params(2)
    layout = ShardLayout.from_tensors(params)
    master = _flat(layout, params) * 1e3  # beyond float16's precision, to test its rounding
    master[3] = float("nan")
    off = HostOffload(layout, device, init=master, piece_numel=64)
    buf = torch.full((layout.numel + 5,), 7.0, dtype=dtype, device=device)
    off.load_weights_into(buf)
    got = buf.cpu()
    want = master.to(dtype)
    assert torch.equal(got[: layout.numel].isnan(), want.isnan())
    assert torch.equal(got[: layout.numel].nan_to_num(), want.nan_to_num())
    assert torch.all(got[layout.numel:] == 7.0)  # beyond numel untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_is_float32_add(device: str, dtype: torch.dtype) -> None:
    layout = ShardLayout.from_tensors(_params(3))
    off = HostOffload(layout, device, piece_numel=50)
    g = torch.Generator().manual_seed(4)
    want = torch.zeros(layout.numel)
    for alpha in (1.0, 0.25, -3.0):
        src = torch.randn(layout.numel, generator=g).to(dtype)
        off.accumulate_grad(src.to(device), alpha)
        want = want + src.float() * alpha  # two roundings, no fused multiply-add
    assert torch.equal(off.grad, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 203, 300_007])  # one element, a short tail, several threads
def test_an_addition_that_takes_the_norm_adds_alike_and_sums_the_squares_of_the_result(device, dtype, numel):
    """``accumulate_grad(..., squared_norm=True)``: the accumulator equals the plain addition's bit
    for bit, and the returned sum is float64's sum of its squares to 1e-6 (the squares' float32
    sums of a block, as ``squared_norm``'s pieces); a non-finite element makes the sum non-finite."""
    layout = ShardLayout.from_tensors([torch.empty(numel)])
    plain, normed = (HostOffload(layout, device, piece_numel=4099) for _ in range(2))
    g = torch.Generator().manual_seed(numel)
    for alpha in (1.0, -0.5, 3.0):
        src = (torch.randn(numel, generator=g) * 4).to(dtype).to(device)
        plain.accumulate_grad(src, alpha)
        squares = normed.accumulate_grad(src, alpha, squared_norm=True)
        assert torch.equal(normed.grad, plain.grad)
        want = normed.grad.double().square().sum()
        assert squares.dtype == torch.float64 and squares.item() == pytest.approx(want.item(), rel=1e-6)
    for bad in (float("inf"), float("nan")):
        src = torch.zeros(numel, dtype=dtype)
        src[numel // 2] = bad
        assert not torch.isfinite(normed.accumulate_grad(src.to(device), squared_norm=True))
    assert plain.accumulate_grad(src.to(device)) is None


@pytest.mark.parametrize("device", DEVICES)
def test_a_piece_of_the_master_loads_into_its_place_alone(device: str) -> None:
    params = _params(5)
    layout = ShardLayout.from_tensors(params)
    master = _flat(layout, params)
    off = HostOffload(layout, device, init=master, piece_numel=64)
    buf = torch.full((layout.numel,), 7.0, dtype=torch.bfloat16, device=device)
    start, stop = 100, layout.numel - 30
    off.load_weights_into(buf, start, stop)
    off.synchronize()
    got = buf.cpu()
    assert torch.equal(got[start:stop], master[start:stop].to(torch.bfloat16))
    assert torch.all(got[:start] == 7.0) and torch.all(got[stop:] == 7.0)
    for bad in [(5, 5), (-1, 10), (0, layout.numel + 1)]:
        with pytest.raises(ValueError, match="not a piece"):
            off.load_weights_into(buf, *bad)
    off.close()


def test_bad_input_is_rejected_with_the_fix() -> None:
    layout = ShardLayout.from_tensors(_params(7))
    off = HostOffload(layout, "cpu")
    with pytest.raises(ValueError, match="at least"):
        off.load_weights_into(torch.empty(layout.numel - 1))
    with pytest.raises(ValueError, match="dtype"):
        off.accumulate_grad(torch.zeros(layout.numel, dtype=torch.int32))
    with pytest.raises(ValueError, match="not a live prefetcher"):  # a handle is a number Python cannot forge
        torch.ops.tawpipe._prefetch_load(off._prefetcher + 1000, off.master, torch.empty(layout.numel))
    # the native op checks too (direct calls skip the Python checks)
    with pytest.raises(ValueError, match="elements"):
        torch.ops.tawpipe._prefetch_load(off._prefetcher, off.master, torch.empty(layout.numel + 1))
    with pytest.raises(ValueError, match="elements"):
        torch.ops.tawpipe._prefetch_accumulate_norm(off._prefetcher, torch.empty(layout.numel + 1), off.grad, 1.0, 9.0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            HostOffload(layout, "cuda")
    assert off.memory() == OffloadMemory(host_bytes=8 * layout.numel, device_bytes=0)  # master + grad; no staging on the CPU
    off.close()
    with pytest.raises(RuntimeError, match="closed"):
        off.load_weights_into(torch.empty(layout.numel))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_load_is_stream_ordered_and_rejects_pageable_memory() -> None:
    layout = ShardLayout.from_tensors([torch.empty(1 << 20)])
    off = HostOffload(layout, "cuda", init=torch.arange(1 << 20, dtype=torch.float32), piece_numel=1 << 16)
    buf = torch.zeros(1 << 20, dtype=torch.bfloat16, device="cuda")
    torch.cuda._sleep(10_000_000)  # the consumer stream is busy: the load must wait for it ...
    off.load_weights_into(buf)
    # ... and work queued after it (this copy, on the same stream) must see the loaded weights
    assert torch.equal(buf.cpu(), torch.arange(1 << 20, dtype=torch.float32).to(torch.bfloat16))
    with pytest.raises(ValueError, match="pinned"):
        torch.ops.tawpipe._prefetch_load(off._prefetcher, torch.zeros(1 << 20), buf)
    with pytest.raises(ValueError, match="is on cpu"):
        off.load_weights_into(torch.empty(1 << 20))


BUSY = 100_000_000  # torch.cuda._sleep cycles: tens of ms on a current GPU, long beyond a piece's copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pieces_load_each_as_stepped_under_a_busy_consumer() -> None:
    """The host step's pattern (design §6.1) with every cast held back: a piece of the master is
    written, then loaded, then the next; after ``synchronize`` the next step may write all of it.
    Odd boundaries, a piece of one element, pieces below and above a staging piece, a partial last."""
    n = 1_000_003
    off = HostOffload(ShardLayout.from_tensors([torch.empty(n)]), "cuda", init=torch.zeros(n), piece_numel=4099)
    buf = torch.full((n,), -1.0, dtype=torch.bfloat16, device="cuda")
    cuts = [0, 1, 4098, 4100, 130_001, 500_000, 999_999, n]
    torch.cuda._sleep(BUSY)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        off.master[a:b] = float(i + 1)
        off.load_weights_into(buf, a, b)
    off.synchronize()  # the loads have read the master ...
    off.master.fill_(1e6)  # ... so the next step may write it
    want = torch.cat([torch.full((b - a,), float(i + 1)) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))])
    assert torch.equal(buf.cpu(), want.to(torch.bfloat16))
    side = torch.cuda.Stream()  # a reader on another stream, ordered as ChunkStorage.carried orders the weights'
    off.master.fill_(5.0)
    torch.cuda._sleep(BUSY)
    off.load_weights_into(buf)
    off.synchronize()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        seen = buf.clone()
    torch.cuda.synchronize()
    assert torch.all(seen == 5.0)
    off.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("side", [False, True])
def test_cuda_the_addition_that_takes_the_norm_waits_for_its_producer(side: bool) -> None:
    """The gradient is made late on the caller's current stream (another than the default, where
    ``side``) and overwritten as soon as the call returns: the host adds, and squares, what was made."""
    n = 300_007
    off = HostOffload(ShardLayout.from_tensors([torch.empty(n)]), "cuda", piece_numel=4099)
    src = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(BUSY)
        src.fill_(3.0)
        sq = off.accumulate_grad(src, squared_norm=True)
        src.fill_(100.0)
    torch.cuda.synchronize()
    assert torch.all(off.grad == 3.0)
    assert sq.dtype == torch.float64 and sq.item() == pytest.approx(9.0 * n, rel=1e-6)
    off.close()


def test_prefetch_bench_reports_every_figure(tmp_path) -> None:
    import argparse
    import json

    from tawpipe.bench import prefetch

    p = argparse.ArgumentParser()
    prefetch.add_arguments(p)
    out = tmp_path / "p.json"
    args = p.parse_args(["--device", "cpu", "--numel", str(1 << 16), "--pieces", "4096,65536", "--repeats", "1",
                         "--out", str(out)])
    assert prefetch.main(args) == 0
    res = json.loads(out.read_text())
    assert set(res["load"]) == {"4096", "65536"}
    figures = [res["pinned_h2d_GBps"], res["accumulate"]["GBps"], res["overlap"]["ratio"],
               *(r["GBps"] for r in res["load"].values())]
    assert all(f > 0 for f in figures) and "CPU only" in res["note"]
