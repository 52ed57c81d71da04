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
