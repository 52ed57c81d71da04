"""Measure the current device's achieved rates at a model's shapes (design §9.2).

Three timings, each the median of a few repeats after a warm-up: a linear layer's forward and
backward ([T, H] x [H, F], 6·T·H·F FLOPs), causal attention's forward and backward
(``scaled_dot_product_attention``, 2·B·S²·H·(1 + 2.5) FLOPs as ``Workload`` counts them) and an
AdamW step (32 bytes per parameter). On a CPU rank of the emulated cluster, which runs
``threads`` threads under a quota of ``quota`` cores, the rates are measured with that many
threads and scaled by quota / threads.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..cost.traffic import ModelDims
from .hardware import Device
from .workload import ADAMW_BYTES


def calibrate(dims: ModelDims, *, device: str = "cpu", threads: int | None = None, quota: float | None = None,
              memory: float | None = None, repeats: int = 10, rounds: int = 3) -> Device:
    """The achieved rates of ``device`` (``cpu`` or ``cuda``) at ``dims``' shapes, in ``dims``'
    compute dtype (2 bytes: bfloat16, 4: float32). Each of ``rounds`` rounds times every kernel
    ``repeats`` times and keeps the fastest (contention only slows a run down); the rate is the
    median over the rounds, which were taken in turns so that they see the same conditions."""
    dev = torch.device(device)
    dtype = torch.float32 if dims.dtype_bytes == 4 else torch.bfloat16
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        t, h, f = dims.seq * dims.micro_batch, dims.hidden, dims.ffn_hidden
        x = torch.randn(t, h, device=dev, dtype=dtype, requires_grad=True)
        w = torch.randn(f, h, device=dev, dtype=dtype, requires_grad=True)
        heads = dims.heads
        q, k, v = (torch.randn(dims.micro_batch, heads, dims.seq, h // heads, device=dev, dtype=dtype,
                               requires_grad=True) for _ in range(3))
        n = 1 << 24  # 64 MB per tensor: well beyond the caches
        p = torch.nn.Parameter(torch.randn(n, device=dev))
        p.grad = torch.randn(n, device=dev)
        opt = torch.optim.AdamW([p], lr=1e-3)
        kernels = (lambda: F.linear(x, w).sum().backward(),
                   lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(),
                   opt.step)
        times = [[_seconds(fn, dev, repeats) for fn in kernels] for _ in range(rounds)]
        linear, attention, step = (statistics.median(col) for col in zip(*times))
    finally:
        torch.set_num_threads(old_threads)
    scale = (quota / (threads or old_threads)) if quota else 1.0
    if memory is None:
        memory = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else \
            os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # a device's whole memory, as CUDA's
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu x {quota or threads or old_threads:g}"
    return Device(
        name=name,
        matmul_flops=scale * 6 * t * h * f / linear,
        attention_flops=scale * 3.5 * 2 * dims.micro_batch * dims.seq ** 2 * h / attention,
        memory_bandwidth=scale * ADAMW_BYTES * n / step,
        memory=memory,
    )


def _seconds(fn: Callable[[], object], dev: torch.device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - start)
    return min(times)  # contention only slows a run down: the fastest is the device's own rate
