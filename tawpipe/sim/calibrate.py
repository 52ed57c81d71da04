"""Measure the current device's achieved rates at a model's shapes, and its host's (design §9.2).

Three timings of the device, each the median of a few repeats after a warm-up: a linear layer's
forward and backward ([T, H] x [H, F], 6·T·H·F FLOPs), causal attention's forward and backward
(``scaled_dot_product_attention``, 2·B·S²·H·(1 + 2.5) FLOPs as ``Workload`` counts them) and an
AdamW step (32 bytes per parameter). ``calibrate`` measures a CPU rank of the emulated cluster,
``threads`` threads under a quota of ``quota`` cores, from outside: with that many threads,
scaled by quota / threads. ``on_rank`` measures it from inside, as a run uses it: every rank of
the cluster at once, each under its own quota (the scheduler's throttling included), and also
what its transfers cost it (``transfer_rate``), which a GPU does not pay. ``calibrate_host``
measures the host the memory savers use: its fused AdamW and its copies to and from the device.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..models.shape import ModelDims
from .hardware import LINKS, Device, Host
from .workload import ADAMW_BYTES


def calibrate(dims: ModelDims, *, device: str = "cpu", threads: int | None = None, quota: float | None = None,
              memory: float | None = None, repeats: int = 10, rounds: int = 3, fastest: bool = True) -> Device:
    """The achieved rates of ``device`` (``cpu`` or ``cuda``) at ``dims``' shapes, in ``dims``'
    compute dtype (2 bytes: bfloat16, 4: float32). Each of ``rounds`` rounds times every kernel
    ``repeats`` times and keeps the fastest (contention only slows a run down; ``fastest=False``:
    their sustained time, where slowing down is part of the device, as a quota's throttling is);
    the rate is the median over the rounds, which were taken in turns so that they see the same
    conditions."""
    dev = torch.device(device)
    dtype = _dtype(dims)
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        t, h, f = dims.seq * dims.micro_batch, dims.hidden, dims.ffn_hidden
        heads = dims.heads
        q, k, v = (torch.randn(dims.micro_batch, heads, dims.seq, dims.head_size, device=dev, dtype=dtype,
                               requires_grad=True) for _ in range(3))
        n = 1 << 24  # 64 MB per tensor: well beyond the caches
        p = torch.nn.Parameter(torch.randn(n, device=dev))
        p.grad = torch.randn(n, device=dev)
        opt = torch.optim.AdamW([p], lr=1e-3)
        kernels = (_linear(dims, dev, dtype),
                   lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(),
                   opt.step)
        times = [[_seconds(fn, dev, repeats, fastest) for fn in kernels] for _ in range(rounds)]
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
        attention_flops=scale * 3.5 * 2 * dims.micro_batch * dims.seq ** 2 * dims.q_dim / attention,
        memory_bandwidth=scale * ADAMW_BYTES * n / step,
        memory=memory,
    )


def calibrate_host(device: str, *, numel: int = 1 << 24, repeats: int = 5, rounds: int = 3) -> Host:
    """This machine's host as the memory savers use it (``Host``): the bytes/s a fused AdamW
    reaches on the CPU (``ADAMW_BYTES`` per parameter, as the engine's default optimizer steps an
    offloaded state), each direction of the link between pinned host memory and ``device``
    (``cuda``; ``cpu``: a copy within host memory, as a CPU rank offloads) and the host's memory.
    Each rate is the median over ``rounds`` of the fastest of ``repeats``; ``numel`` float32
    elements (64 MB) go beyond the caches."""
    dev = torch.device(device)
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    pinned = torch.randn(numel, pin_memory=dev.type == "cuda")
    other = torch.empty(numel, device=dev)
    kernels = (opt.step, lambda: other.copy_(pinned, non_blocking=True),
               lambda: pinned.copy_(other, non_blocking=True))
    times = [[_seconds(fn, dev, repeats) for fn in kernels] for _ in range(rounds)]
    step, to_device, to_host = (statistics.median(col) for col in zip(*times))
    link = LINKS["pcie"]  # its latency; the rates measured, whole (efficiency 1)
    return Host(memory=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                pcie=dataclasses.replace(link, rate=4 * numel / to_device, efficiency=1.0),
                pcie_d2h=dataclasses.replace(link, rate=4 * numel / to_host, efficiency=1.0),
                adamw_bandwidth=ADAMW_BYTES * numel / step)


def on_rank(rank: int, dims: dict[str, Any], name: str = "cpu rank, in the cluster", repeats: int = 10,
            quota: float | None = None, threads: int = 1, cpus: float | None = None) -> dict[str, Any]:
    """This rank of the emulated cluster (``tawpipe.cluster.Cluster.run``), measured as a run uses
    it: its kernels' sustained times under its quota while every rank does the same, its
    ``transfer_rate``, and (given the ``quota`` in cores, its ``threads`` and the machine's
    ``cpus``) the wait it gets back (``idle_credit``). Every rank must call it at once; returns the
    ``Device`` (``name``) as a dict."""
    d = ModelDims(**dims)
    dev = calibrate(d, repeats=repeats, fastest=False)
    dev = dataclasses.replace(dev, name=name, transfer_rate=transfer_rate(_linear(d, dtype=_dtype(d))))
    if quota is not None and threads > quota:
        dev = dataclasses.replace(dev, idle_credit=idle_credit(), burst=threads / quota,
                                  host_ranks=(cpus or os.cpu_count() or 1) / quota)
    return dataclasses.asdict(dev)


def idle_credit(*, spells: int = 24, idle_s: float = 0.06, work_s: float = 0.02) -> float | None:
    """Seconds of an idle spell that this rank, under a CPU quota, gets back when it computes again:
    the median over ``spells`` of a block of work's sustained time less its time right after
    ``idle_s`` of sleep. Each pair is measured back to back, so that a slower or busier spell of the
    machine shifts both; the blocks are short (``work_s`` to twice that) so that what comes back, a
    few of the quota's periods, stands out of their noise. The ranks take turns, the others waiting
    in a barrier, so a rank's burst meets no other rank's (``Fabric.cores`` models that). Every rank
    must call it at once; None when nothing comes back."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def block(calls: int) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            a @ b
        return time.perf_counter() - start

    mine = None
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn == dist.get_rank():
            calls = 1
            while block(calls) < work_s:  # a block of work_s to 2·work_s at the sustained rate
                calls *= 2
            gains = []
            for _ in range(spells):
                block(2 * calls)  # spend what the last wait saved up: "sustained" must not burst
                sustained = block(calls)
                time.sleep(idle_s)
                gains.append(sustained - block(calls))
            mine = statistics.median(gains)
    dist.barrier()
    return mine if mine and mine > 0 else None


def transfer_rate(kernel: Callable[[], object], *, messages: int = 20, nbytes: int = 6 * 2**20,
                  alone_s: float = 1.0, timeout_s: float = 300.0) -> float | None:
    """Bytes/s of transfers (sent plus received) that cost this rank one second of its compute:
    ``kernel``'s rate alone, then while a thread exchanges ``messages`` of ``nbytes`` with the
    rank's ring neighbours. gloo's copies run on the rank's CPU, and on a machine whose cores the
    ranks fill, so does the kernel's network stack. Every rank must call it at once; None when the
    group has one rank or the transfers cost nothing measurable. A transfer not done within
    ``timeout_s`` raises ``TimeoutError``."""
    n, rank = dist.get_world_size(), dist.get_rank()
    if n < 2:
        return None
    kernel()
    dist.barrier()
    start, done = time.perf_counter(), 0
    while time.perf_counter() - start < alone_s:
        kernel()
        done += 1
    rate = done / (time.perf_counter() - start)
    numel = nbytes // 4
    sends = [torch.randn(numel) for _ in range(messages)]
    recvs = [torch.empty(numel) for _ in range(messages)]

    failed: list[BaseException] = []

    def exchange() -> None:
        try:
            for out, into in zip(sends, recvs):
                for work in (dist.isend(out, (rank + 1) % n), dist.irecv(into, (rank - 1) % n)):
                    work.wait(timedelta(seconds=timeout_s))
        except BaseException as e:  # raised again on the calling thread
            failed.append(e)

    dist.barrier()
    mover = threading.Thread(target=exchange, daemon=True)
    start, done = time.perf_counter(), 0
    mover.start()
    while mover.is_alive():
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"rank {rank}: {messages} transfers of {nbytes} bytes to its ring neighbours took "
                               f"over {timeout_s:g} s")
        kernel()
        done += 1
    spent = time.perf_counter() - start
    mover.join()
    if failed:
        raise failed[0]
    lost = spent - done / rate
    dist.barrier()
    return 2 * messages * numel * 4 / lost if lost > 0 else None


def median_device(devices: list[dict[str, Any]]) -> Device:
    """One device from the ranks' own measurements (``on_rank``): each rate's median over them."""
    rates = ("matmul_flops", "attention_flops", "memory_bandwidth", "transfer_rate")
    credit = statistics.median(d.get("idle_credit") or 0.0 for d in devices)  # a rank's None: nothing back
    return Device(**{**devices[0], **{k: statistics.median(d[k] for d in devices) if all(d[k] for d in devices)
                                        else None for k in rates}, "idle_credit": credit or None})


def _dtype(dims: ModelDims) -> torch.dtype:
    """``dims``' compute dtype: 4 bytes float32, 2 bfloat16."""
    return torch.float32 if dims.dtype_bytes == 4 else torch.bfloat16


def _linear(dims: ModelDims, dev: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
            ) -> Callable[[], object]:
    """A linear layer's forward and backward at ``dims``' shape ([T, H] x [H, F])."""
    x = torch.randn(dims.seq * dims.micro_batch, dims.hidden, device=dev, dtype=dtype, requires_grad=True)
    w = torch.randn(dims.ffn_hidden, dims.hidden, device=dev, dtype=dtype, requires_grad=True)
    return lambda: F.linear(x, w).sum().backward()


def _seconds(fn: Callable[[], object], dev: torch.device, repeats: int, fastest: bool = True) -> float:
    """Seconds of one call: the fastest of ``repeats``, or (``fastest=False``) the ``repeats``
    calls back to back over their number, which a quota's throttling cannot miss (a call shorter
    than the quota's share of a period runs at a whole core)."""
    fn()  # warm-up
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    if not fastest:
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        return (time.perf_counter() - start) / repeats
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)
