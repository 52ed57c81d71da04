"""`tawpipe bench prefetch`: the host offload's streaming (tawpipe.runtime.offload.HostOffload).

Bandwidth: loading a float32 master from pinned host memory into a compute-dtype device buffer
(copy + cast, piece by piece through two staging buffers), against one plain pinned copy of the
same float32 bytes, which is the limit; and accumulating a device gradient into the host float32
accumulator, against one plain device-to-host copy, and doing so with the accumulator's norm in
the same pass (a step's last addition, design §6.1) against adding and then norming. The host's
AdamW step of the master with its load for the next iteration: the step then the load, against
the step in pieces, each loading once stepped (design §6.1; on the CPU the loads are copies in
the calling thread, so nothing hides). Overlap: the load on its own stream while a
matmul loop runs on the compute stream, t(both) / max(t_load, t_matmul), 1.0 being perfect.
Targets on a GPU: load >= 90% of the pinned copy, overlap <= 1.1.

Every wait of the offload is bounded by ``$TAWPIPE_TIMEOUT`` seconds (300 when unset), as the
engine's are. The JSON goes into ``--out`` (default ``tawpipe-results/`` in the current directory;
the committed results are rewritten only with ``--out benchmarks/results``).

On the CPU the same code runs through the host prefetcher (plain copies) and the "concurrent"
matmul is another thread on the same cores and memory: those numbers mean little.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch

from ..atomic import write_atomic
from ..commands import UsageError, env_timeout, int_at_least
from ..cost.units import gib
from ..engine.engine import default_optimizer
from ..engine.host_step import piece_ranges, step_in_pieces
from ..engine.precision import squared_norm
from ..runtime.offload import DEFAULT_PIECE_NUMEL, HostOffload
from ..runtime.timeout import DEFAULT_TIMEOUT
from ..ops import ShardLayout
from . import DEFAULT_OUT, check_memory, provenance, result_file

TARGET_BANDWIDTH = 0.9
TARGET_OVERLAP = 1.1
# What a process's first torch optimizer adds to its memory whatever its size (the compiler's
# modules it imports): 162 MB with torch 2.13, measured at 4, 16 and 64 Mi parameters.
OPTIMIZER_IMPORTS = 160 << 20


DESCRIPTION = (
    "The host offload's streaming: loading a float32 master from pinned host memory into a device buffer, and "
    "accumulating gradients back, against a plain pinned copy; and how well the load overlaps a matmul loop."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--numel", type=int_at_least(1), default=None,
                   help="elements streamed (default 64M on CUDA, 8M on CPU)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="compute dtype of the device buffer")
    p.add_argument("--pieces", type=_pieces, default=f"{1 << 20},{DEFAULT_PIECE_NUMEL},{1 << 24}",
                   help="piece sizes (elements) to measure, comma-separated; the overlap uses the default piece size")
    p.add_argument("--repeats", type=int_at_least(1), default=7, help="timed repeats per measurement (median)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"directory for prefetch_<device>.json (default: {DEFAULT_OUT}/ in the current directory; "
                        "the committed results: --out benchmarks/results); a path ending in .json names the file")


def _pieces(text: str) -> list[int]:
    """--pieces: one or more piece sizes, each at least one element."""
    try:
        sizes = [int(piece) for piece in text.split(",") if piece.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected piece sizes in elements, each >= 1, comma-separated; got {text!r}")
    return sizes


def _device(name: str | None) -> torch.device:
    """--device as the device to measure: the CPU, or a CUDA device this machine has."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: expected cpu, cuda or cuda:N")
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available here; use --device cpu")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median wall-clock seconds of fn, the device drained before and after each run."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _concurrently(a: Callable[[], None], b: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """Run a and b at once: on CUDA, a on a side stream (both only enqueue); on the CPU, a on a
    second thread (the ops release the GIL)."""
    if device.type == "cuda":
        side = torch.cuda.Stream(device)

        def both() -> None:
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                a()
            b()
            torch.cuda.current_stream(device).wait_stream(side)

        return both

    def both_cpu() -> None:
        t = threading.Thread(target=a)
        t.start()
        b()
        t.join()

    return both_cpu


def measure(device: torch.device, numel: int, dtype: torch.dtype, pieces: list[int], repeats: int,
            timeout: float = DEFAULT_TIMEOUT) -> dict:
    """The bandwidths and the overlap of ``numel`` elements streamed to ``device``; every wait of
    the offload bounded by ``timeout`` seconds."""
    layout = ShardLayout.from_tensors([torch.empty(numel, device="meta")])
    init = torch.randn(numel)
    pinned = device.type == "cuda"
    master = init.pin_memory() if pinned else init.clone()
    dst32 = torch.empty(numel, device=device)
    dst = torch.empty(numel, dtype=dtype, device=device)
    host_out = torch.empty(numel, pin_memory=pinned)
    grad = torch.randn(numel, device=device)
    nbytes = numel * 4
    out: dict = {"bytes": nbytes}

    # The limits: one plain pinned copy each way (non_blocking needs a side stream to overlap).
    t_h2d = _time(lambda: dst32.copy_(master, non_blocking=True), device, repeats)
    t_d2h = _time(lambda: host_out.copy_(grad, non_blocking=True), device, repeats)
    out["pinned_h2d_GBps"] = nbytes / t_h2d / 1e9
    out["pinned_d2h_GBps"] = nbytes / t_d2h / 1e9

    out["load"] = {}
    for piece in pieces:
        off = HostOffload(layout, device, init=init, piece_numel=piece, timeout=timeout)
        t = _time(lambda: off.load_weights_into(dst), device, repeats)
        out["load"][str(piece)] = {"GBps": nbytes / t / 1e9, "of_pinned": t_h2d / t}
        off.close()
        del off  # its master and accumulator freed before the next one's are made
    off = HostOffload(layout, device, init=init, timeout=timeout)
    t_load = _time(lambda: off.load_weights_into(dst), device, repeats)
    t_acc = _time(lambda: off.accumulate_grad(grad), device, repeats)
    out["load_default_piece"] = {"piece": DEFAULT_PIECE_NUMEL, "GBps": nbytes / t_load / 1e9, "of_pinned": t_h2d / t_load}
    out["accumulate"] = {"GBps": nbytes / t_acc / 1e9, "of_pinned_d2h": t_d2h / t_acc}
    # The step's last addition with the gradient's norm (clipping, the non-finite check): taken in
    # the same pass over the accumulator, against the addition and then the norm (a second pass).
    t_norm = _time(lambda: off.accumulate_grad(grad, squared_norm=True), device, repeats)
    t_then = _time(lambda: (off.accumulate_grad(grad), squared_norm(off.grad)), device, repeats)
    out["accumulate_norm"] = {"t_s": t_norm, "t_add_then_norm_s": t_then, "saved": 1 - t_norm / t_then}
    out["host_step"] = _host_step(off, dst, device, repeats)

    # A matmul loop about as long as the load, then both at once.
    n = 4096 if device.type == "cuda" else 512
    mm_dtype = dtype if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=mm_dtype)
    b = torch.randn(n, n, device=device, dtype=mm_dtype)
    t_one = _time(lambda: a @ b, device, repeats)
    reps = max(1, round(t_load / t_one))

    def matmuls() -> None:
        for _ in range(reps):
            a @ b

    t_mm = _time(matmuls, device, repeats)
    t_both = _time(_concurrently(lambda: off.load_weights_into(dst), matmuls, device), device, repeats)
    off.close()
    out["overlap"] = {"matmul": f"{reps} x {n}^3 {str(mm_dtype).removeprefix('torch.')}", "t_load_s": t_load,
                      "t_matmul_s": t_mm, "t_both_s": t_both, "ratio": t_both / max(t_load, t_mm)}
    if device.type == "cuda":
        out["targets"] = {
            "load_of_pinned": TARGET_BANDWIDTH, "overlap": TARGET_OVERLAP,
            "met": out["load_default_piece"]["of_pinned"] >= TARGET_BANDWIDTH and out["overlap"]["ratio"] <= TARGET_OVERLAP,
        }
    return out


def _host_step(off: HostOffload, dst: torch.Tensor, device: torch.device, repeats: int) -> dict:
    """The host's AdamW step of the offloaded master (fused, the engine's default) with the load
    for the next iteration (design §6.1): the step and then the load, against the step in the
    engine's pieces with each piece loading as soon as it is stepped. ``hidden``: the share of
    the load's time the pieces hide (1.0: all of it)."""
    params = [torch.nn.Parameter(v) for v in off.master.chunk(32)]
    for p, g in zip(params, off.grad.chunk(32)):
        p.grad = g.normal_()
    opt = default_optimizer(params)
    runs = piece_ranges(params)

    def stepped(i: int) -> None:
        off.load_weights_into(dst, *runs[i][1:])

    t_step = _time(opt.step, device, repeats)
    t_load = _time(lambda: off.load_weights_into(dst), device, repeats)
    t_serial = _time(lambda: (opt.step(), off.load_weights_into(dst)), device, repeats)
    t_pieces = _time(lambda: step_in_pieces(opt, [ps for ps, _, _ in runs], stepped), device, repeats)
    return {"pieces": len(runs), "t_step_s": t_step, "t_load_s": t_load, "t_step_then_load_s": t_serial,
            "t_in_pieces_s": t_pieces, "hidden": (t_serial - t_pieces) / t_load,
            "launches": _launches_beside(opt.step, t_step, device, repeats)}


def _launches_beside(step: Callable[[], None], t_step: float, device: torch.device, repeats: int) -> dict:
    """What the host's step on a thread beside the compute (design §6.1) costs the thread that
    launches the compute's kernels: a loop of small kernels (its time the launches'), about half
    as long as the step, alone and while ``step`` runs on a thread. ``slowdown``: the second over
    the first."""
    small = torch.randn(64, 64, device=device)
    t_one = _time(lambda: small.add_(1.0), device, repeats)
    count = max(1, round(t_step / 2 / t_one))

    def launches() -> None:
        for _ in range(count):
            small.add_(1.0)

    t_alone = _time(launches, device, repeats)
    beside = []
    for _ in range(repeats):
        _sync(device)
        thread = threading.Thread(target=step)
        thread.start()
        t0 = time.perf_counter()
        launches()
        _sync(device)
        beside.append(time.perf_counter() - t0)
        thread.join()
    t_beside = statistics.median(beside)
    return {"kernels": count, "t_alone_s": t_alone, "t_beside_step_s": t_beside, "slowdown": t_beside / t_alone}


def footprint(device: torch.device, numel: int, dtype: torch.dtype, pieces: list[int]) -> tuple[int, int]:
    """Bytes ``measure`` holds at once on the host and on a CUDA device (0 on the CPU, where the
    device's buffers are the host's): float32 source, master, copy target, offload master and
    accumulator and the host step's two AdamW moments (28 B per element), and the modules torch
    imports for a process's first optimizer (``OPTIMIZER_IMPORTS``); the float32 and
    compute-dtype loads and the gradient on the device, and on CUDA two pinned and two device
    staging buffers of the largest piece."""
    host, on_device = 28 * numel + OPTIMIZER_IMPORTS, (8 + dtype.itemsize) * numel
    if device.type == "cpu":
        return host + on_device, 0
    staging = 2 * 4 * max(*pieces, DEFAULT_PIECE_NUMEL)
    return host + staging, on_device + staging


def _check_memory(device: torch.device, numel: int, dtype: torch.dtype, pieces: list[int]) -> None:
    """A UsageError naming --numel (and --pieces) where the measurement would not fit in this host's
    memory or the device's, before anything is allocated."""
    host, on_device = footprint(device, numel, dtype, pieces)
    flags = f"--numel {numel:,}" + (f" and --pieces up to {max(pieces):,}" if device.type == "cuda" else "")
    check_memory(host, flags, "use a smaller --numel" + (" or --pieces" if device.type == "cuda" else ""))
    if on_device:
        free, total = torch.cuda.mem_get_info(device)
        if on_device > free:
            raise UsageError(f"{flags}: the bench needs about {gib(on_device)} ({on_device:,} bytes) on {device}, but "
                             f"{gib(free)} of its {gib(total)} is free: use a smaller --numel or --pieces")


def main(args: argparse.Namespace) -> int:
    device = _device(args.device)
    timeout = env_timeout()  # every wait of the offload
    out = result_file(args.out, f"prefetch_{device.type}.json")
    numel = args.numel or ((64 << 20) if device.type == "cuda" else (8 << 20))
    dtype = getattr(torch, args.dtype)
    _check_memory(device, numel, dtype, args.pieces)
    res = measure(device, numel, dtype, args.pieces, args.repeats, timeout)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    res.update({"benchmark": "prefetch", "device": name, "numel": numel, "dtype": args.dtype,
                **provenance(), "repeats": args.repeats})
    if device.type == "cpu":
        res["note"] = ("CPU only: host prefetcher (plain copies); the 'concurrent' matmul shares the cores and "
                       "memory bandwidth, so these numbers say little about a GPU")
    print(f"prefetch on {name}: {numel:,} float32 elements ({res['bytes'] / 1e6:.0f} MB) -> {args.dtype}")
    print(f"  pinned copy (limit)   h2d {res['pinned_h2d_GBps']:8.2f} GB/s   d2h {res['pinned_d2h_GBps']:8.2f} GB/s")
    for piece, r in res["load"].items():
        print(f"  load, piece {int(piece):>10,}  {r['GBps']:8.2f} GB/s  = {r['of_pinned']:6.1%} of the pinned copy")
    print(f"  accumulate (d2h + add) {res['accumulate']['GBps']:7.2f} GB/s  = "
          f"{res['accumulate']['of_pinned_d2h']:6.1%} of the pinned d2h copy")
    n = res["accumulate_norm"]
    print(f"  accumulate with its norm {n['t_s'] * 1e3:.2f} ms, against adding then norming {n['t_add_then_norm_s'] * 1e3:.2f} "
          f"ms: {n['saved']:.1%} saved")
    h = res["host_step"]
    print(f"  host AdamW step {h['t_step_s'] * 1e3:.2f} ms, load {h['t_load_s'] * 1e3:.2f} ms: step then load "
          f"{h['t_step_then_load_s'] * 1e3:.2f} ms, in {h['pieces']} pieces each loading once stepped "
          f"{h['t_in_pieces_s'] * 1e3:.2f} ms ({h['hidden']:.0%} of the load hidden)")
    k = h["launches"]
    print(f"  {k['kernels']} small kernels launched {k['t_alone_s'] * 1e3:.2f} ms, beside the host step on a thread "
          f"{k['t_beside_step_s'] * 1e3:.2f} ms: x{k['slowdown']:.2f}")
    o = res["overlap"]
    print(f"  overlap with {o['matmul']}: load {o['t_load_s'] * 1e3:.2f} ms, matmul {o['t_matmul_s'] * 1e3:.2f} ms, "
          f"both {o['t_both_s'] * 1e3:.2f} ms -> t(both)/max = {o['ratio']:.3f}")
    if "targets" in res:
        print(f"  targets (>= {TARGET_BANDWIDTH:.0%} of pinned, overlap <= {TARGET_OVERLAP}): "
              f"{'met' if res['targets']['met'] else 'NOT met'}")
    if "note" in res:
        print(f"  note: {res['note']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0
