"""HostOffload against torch: AdamW steps equal torch.optim.AdamW (paper's param groups), loads
equal torch casts, accumulation equals float32 adds, state round-trips. CPU path everywhere;
the same checks run on CUDA (pinned memory, streamed pieces) when a GPU is present."""

from __future__ import annotations

import pytest
import torch

from tawpipe.offload import AdamWConfig, HostOffload, OffloadMemory
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
def test_adamw_steps_equal_torch_adamw(device: str) -> None:
    params = _params(0)
    layout = ShardLayout.from_tensors(params)
    cfg = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    off = HostOffload(layout, device, init=_flat(layout, params), piece_numel=100)  # many pieces
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(
        [{"params": [p for p in ref if p.dim() >= 2], "weight_decay": cfg.weight_decay},
         {"params": [p for p in ref if p.dim() < 2], "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
    )
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        lr = cfg.lr * (1.0 - 0.2 * step)  # a scheduler changes lr between steps
        for group in opt.param_groups:
            group["lr"] = lr
        for p in ref:
            p.grad = None
        for _ in range(3):  # micro-batches
            grads = [torch.randn(s, generator=g) for s in SHAPES]
            for p, gr in zip(ref, grads):
                p.grad = gr.clone() if p.grad is None else p.grad + gr
            off.accumulate_grad(_flat(layout, grads, device))
        assert off.grad_sq_norm() == pytest.approx(sum(p.grad.double().square().sum().item() for p in ref), rel=1e-12)
        opt.step()
        off.step(cfg, lr=lr)
        off.zero_grad()
        for view, p in zip(layout.views(off.master), ref):
            assert torch.equal(view, p.detach()), step
        for view, p in zip(layout.views(off.exp_avg_sq), ref):
            assert torch.equal(view, opt.state[p]["exp_avg_sq"]), step
    assert off.steps == 4


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


def test_state_dict_resumes_exactly() -> None:
    params = _params(5)
    layout = ShardLayout.from_tensors(params)
    cfg = AdamWConfig()
    g = torch.Generator().manual_seed(6)
    grads = [torch.randn(layout.numel, generator=g) for _ in range(3)]
    first = HostOffload(layout, "cpu", init=_flat(layout, params))
    for gr in grads[:2]:
        first.accumulate_grad(gr)
        first.step(cfg)
        first.zero_grad()
    second = HostOffload(layout, "cpu")
    second.load_state_dict(first.state_dict())
    for off in (first, second):
        off.accumulate_grad(grads[2])
        off.step(cfg)
    assert torch.equal(first.master, second.master)
    assert torch.equal(first.exp_avg, second.exp_avg)


def test_bad_input_is_rejected_with_the_fix() -> None:
    layout = ShardLayout.from_tensors(_params(7))
    off = HostOffload(layout, "cpu")
    with pytest.raises(ValueError, match="at least"):
        off.load_weights_into(torch.empty(layout.numel - 1))
    with pytest.raises(ValueError, match="dtype"):
        off.accumulate_grad(torch.zeros(layout.numel, dtype=torch.int32))
    with pytest.raises(ValueError, match="same chunk"):
        off.load_state_dict({"numel": layout.numel + 1})
    with pytest.raises(ValueError, match="not a prefetcher"):
        torch.ops.tawpipe._prefetch_load(torch.zeros(8, dtype=torch.uint8), off.master, torch.empty(layout.numel))
    # the native op checks too (direct calls skip the Python checks)
    with pytest.raises(ValueError, match="elements"):
        torch.ops.tawpipe._prefetch_load(off._prefetcher, off.master, torch.empty(layout.numel + 1))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            HostOffload(layout, "cuda")
    assert off.memory() == OffloadMemory(host_bytes=16 * layout.numel, device_bytes=0)  # no staging on the CPU
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
