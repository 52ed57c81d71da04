"""Benchmark of tawpipe's fused pack / unpack / unpack_accumulate against the ways they replace.

Why: weight pipelining moves whole layer chunks (and, in the worst case, thousands of small
parameters) between per-parameter tensors and one flat communication buffer every step, so
these copies must run near the memory bandwidth and must not cost one launch or one Python
iteration per tensor. Each case is timed for:

* ``tawpipe``     the fused op (``--backend native``: ``torch.ops.tawpipe``; ``triton``:
                  ``tawpipe.ops.triton``, under the interpreter when there is no GPU),
* ``wrapper``     the same through the Python wrapper ``tawpipe.ops.<op>`` (which checks
                  argument types; the op itself validates, in C++),
* ``bound``       (native backend) the op on tensors bound once with ``ShardLayout.bind``: the
                  path for persistent tensors (parameters, master weights, persistent grads),
                  which passes only a prebuilt segment table per call instead of every tensor,
* ``loop``        a per-parameter Python loop with a per-tensor cast, as in the published
                  reference implementation (``flat[o:o+n].copy_(p.view(-1).to(dtype))``),
* ``foreach``     FSDP2's way: ``torch._foreach_copy_`` (``_foreach_add_`` to accumulate) on
                  ``torch.split`` views of the flat buffer,
* ``contiguous``  one ``dst.copy_(src)`` of a single float32 tensor that moves the same number
                  of bytes (read + written) as the case: the machine's bandwidth limit.

Usage: python benchmarks/ops_bench.py [--backend native|triton] [--iters N] [--warmup N]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tawpipe.ops import BoundShards

FORMULA = (
    "GB/s = (bytes read + bytes written) / seconds / 1e9, with n elements per case: "
    "copy n*(src_bytes + dst_bytes), accumulate n*(src_bytes + 2*dst_bytes) "
    "(the destination is read and written); every implementation of a case is credited "
    "the same bytes, so GB/s ratios are speed ratios"
)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# (op, list-side dtype, flat dtype): pack reads the list and writes flat, the unpacks the reverse.
CASES = [
    ("pack", torch.float32, torch.float32),
    ("pack", torch.float32, torch.bfloat16),
    ("unpack", torch.float32, torch.float32),
    ("unpack", torch.float32, torch.bfloat16),
    ("unpack_accumulate", torch.float32, torch.float32),
    ("unpack_accumulate", torch.float32, torch.bfloat16),
]
ALPHA = 1e-3  # small, so that repeated accumulation stays finite
# The fused implementations compared with the baselines, and the prefix of their ratio keys.
FUSED_IMPLS = {"tawpipe": "", "bound": "bound_"}
# Ratio names and the baseline each divides by the fused implementation's time.
BASELINES = {
    "speedup_vs_loop": "loop",
    "speedup_vs_foreach": "foreach",
    "fraction_of_contiguous": "contiguous",
}


def llama_chunk_shapes(hidden: int = 1024, layers: int = 4) -> list[tuple[int, ...]]:
    """The 9 parameters of each LLaMA layer (q, k, v, o, gate, up, down, two RMSNorm weights)."""
    # SwiGLU hidden size as in LLaMA: 2/3 of 4*hidden, rounded up to a multiple of 256.
    ffn = 256 * math.ceil(8 * hidden / 3 / 256)
    layer = [(hidden, hidden)] * 4 + [(ffn, hidden)] * 2 + [(hidden, ffn), (hidden,), (hidden,)]
    return layer * layers


def small_mixed_shapes(count: int = 2000, seed: int = 0) -> list[tuple[int, ...]]:
    """Many small parameters (biases, norms, small matrices): element counts log-uniform in
    [1, 16384] (at most 64 KiB of float32), 1-D or 2-D."""
    gen = torch.Generator().manual_seed(seed)
    numels = torch.exp(torch.rand(count, generator=gen) * math.log(16384)).round().long()
    shapes: list[tuple[int, ...]] = []
    for n in numels.tolist():
        rows = max(d for d in (1, 2, 4, 8, 16) if n % d == 0)
        shapes.append((n,) if rows == 1 else (rows, n // rows))
    return shapes


WORKLOADS = {
    "llama_h1024_x4": llama_chunk_shapes,
    "small_2000_mixed": small_mixed_shapes,
}


@dataclass
class Timing:
    median_s: float
    min_s: float
    p90_s: float

    @classmethod
    def of(cls, times: list[float]) -> Timing:
        times = sorted(times)
        p90 = times[min(len(times) - 1, math.ceil(0.9 * len(times)) - 1)]
        return cls(statistics.median(times), times[0], p90)


def _timed_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call: CUDA events on a GPU, perf_counter on a CPU (synchronous there)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_fns(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    warmup: int,
    iters: int,
    rounds: int = 3,
) -> dict[str, Timing]:
    """Time every callable ``iters`` times, in ``rounds`` rounds that visit them in turn.

    Rounds spread slow phases of a shared machine over all implementations instead of one; within
    a round an implementation runs back to back (after ``warmup`` untimed calls in the first round,
    one in later ones), so each is timed in its own steady state (warm caches).
    """
    rounds = max(1, min(rounds, iters))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        chunk = iters // rounds + (1 if r < iters % rounds else 0)
        for name, fn in fns.items():
            for _ in range(warmup if r == 0 else min(warmup, 1)):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name] += [_timed_call(fn, device) for _ in range(chunk)]
    return {name: Timing.of(t) for name, t in times.items()}


def load_ops(backend: str, device: torch.device) -> dict[str, tuple[Callable[..., None], ...]]:
    """Per op: (the op of the chosen backend, the validating wrapper that calls it)."""
    if backend == "triton" and device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
    import tawpipe.ops

    if backend == "native":
        direct = torch.ops.tawpipe
    else:
        from tawpipe.ops import triton as direct
    names = ("pack", "unpack", "unpack_accumulate")
    wrapped = {n: functools.partial(getattr(tawpipe.ops, n), backend=backend) for n in names}
    return {name: (getattr(direct, name), wrapped[name]) for name in names}


def implementations(
    op: str,
    fused: Callable[..., None],
    wrapper: Callable[..., None],
    params: list[torch.Tensor],
    flat: torch.Tensor,
    offsets: list[int],
    contig_src: torch.Tensor,
    contig_dst: torch.Tensor,
    bound: BoundShards | None,
) -> dict[str, Callable[[], object]]:
    """Zero-argument callables doing the same work five or six ways (see the module docstring);
    ``bound`` is ``params`` and ``flat`` bound together (None: no bound column)."""
    sizes = [p.numel() for p in params]
    views = list(torch.split(flat, sizes))
    param_flat = [p.view(-1) for p in params]
    if op == "pack":

        def loop() -> None:
            for p, o in zip(params, offsets):
                flat[o : o + p.numel()].copy_(p.view(-1).to(flat.dtype))

        return {
            "tawpipe": lambda: fused(params, flat, offsets),
            "wrapper": lambda: wrapper(params, flat, offsets),
            **({"bound": bound.pack} if bound else {}),
            "loop": loop,
            "foreach": lambda: torch._foreach_copy_(views, param_flat),
            "contiguous": lambda: contig_dst.copy_(contig_src),
        }
    if op == "unpack":

        def loop() -> None:
            for p, o in zip(params, offsets):
                p.copy_(flat[o : o + p.numel()].view_as(p).to(p.dtype))

        return {
            "tawpipe": lambda: fused(flat, params, offsets),
            "wrapper": lambda: wrapper(flat, params, offsets),
            **({"bound": bound.unpack} if bound else {}),
            "loop": loop,
            "foreach": lambda: torch._foreach_copy_(param_flat, views),
            "contiguous": lambda: contig_dst.copy_(contig_src),
        }

    def loop() -> None:
        for p, o in zip(params, offsets):
            p.add_(flat[o : o + p.numel()].view_as(p).to(p.dtype), alpha=ALPHA)

    return {
        "tawpipe": lambda: fused(flat, params, offsets, ALPHA),
        "wrapper": lambda: wrapper(flat, params, offsets, ALPHA),
        **({"bound": lambda: bound.unpack_accumulate(ALPHA)} if bound else {}),
        "loop": loop,
        "foreach": lambda: torch._foreach_add_(param_flat, views, alpha=ALPHA),
        "contiguous": lambda: contig_dst.copy_(contig_src),
    }


def case_bytes(op: str, n: int, list_dtype: torch.dtype, flat_dtype: torch.dtype) -> int:
    src, dst = (list_dtype, flat_dtype) if op == "pack" else (flat_dtype, list_dtype)
    s, d = src.itemsize, dst.itemsize
    return n * (s + 2 * d) if op.endswith("accumulate") else n * (s + d)


def copy_sweep(device: torch.device, warmup: int, iters: int) -> list[dict[str, float]]:
    """Contiguous float32 copy bandwidth by size, 1 MiB up to 1 GiB on a GPU (256 MiB on a CPU):
    where caches stop helping, and the device-to-device bandwidth of large copies."""
    largest = 1024 if device.type == "cuda" else 256
    rows = []
    for mib in (m for m in (1, 4, 16, 64, 128, 256, 512, 1024) if m <= largest):
        n = mib * 2**20 // 4
        src = torch.empty(n, device=device).uniform_()
        dst = torch.empty_like(src)
        t = time_fns({"copy": lambda: dst.copy_(src)}, device, warmup, iters, rounds=1)["copy"]
        rows.append({
            "bytes_copied": n * 4,
            "median_ms": t.median_s * 1e3,
            "min_ms": t.min_s * 1e3,
            "gbps": 2 * n * 4 / t.median_s / 1e9,
        })
        del src, dst
    return rows


def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


def load_average() -> float | None:
    """The 1-minute load average, where the OS has one."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine_info(device: torch.device, backend: str) -> dict[str, object]:
    info: dict[str, object] = {
        "device": device.type,
        "backend": backend,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        # Other processes on the machine skew CPU timings (a descheduled thread stalls a whole
        # parallel region): the 1-minute load averages at the start and end are kept for that.
        "load_average_1min": load_average(),
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    if backend == "triton":
        info["triton_interpret"] = os.environ.get("TRITON_INTERPRET") == "1"
    return info


def case_name(op: str, list_dtype: torch.dtype, flat_dtype: torch.dtype) -> str:
    src, dst = (list_dtype, flat_dtype) if op == "pack" else (flat_dtype, list_dtype)
    if op.endswith("accumulate"):
        return f"{DTYPE_NAMES[dst]}+={DTYPE_NAMES[src]}"
    return f"{DTYPE_NAMES[src]}->{DTYPE_NAMES[dst]}"


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, device=device).uniform_(-1, 1).to(dtype)


def bench_workload(
    name: str,
    shapes: list[tuple[int, ...]],
    ops: dict[str, tuple[Callable[..., None], ...]],
    device: torch.device,
    args: argparse.Namespace,
) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """Time every case of CASES on one workload; returns (result rows, ratio rows)."""
    from tawpipe.ops import ShardLayout  # imported by load_ops, after its TRITON_INTERPRET setup

    numels = [math.prod(s) for s in shapes]
    n = sum(numels)
    offsets = [0] + torch.tensor(numels).cumsum(0)[:-1].tolist()
    params: dict[torch.dtype, list[torch.Tensor]] = {}  # separate allocations, as real parameters
    flats: dict[torch.dtype, torch.Tensor] = {}
    contig_n = max(case_bytes(op, n, ld, fd) for op, ld, fd in CASES) // 8
    contig_src = random_tensor((contig_n,), torch.float32, device)
    contig_dst = torch.empty_like(contig_src)
    results, ratios = [], []
    for op, list_dtype, flat_dtype in CASES:
        if list_dtype not in params:
            params[list_dtype] = [random_tensor(s, list_dtype, device) for s in shapes]
        if flat_dtype not in flats:
            flats[flat_dtype] = random_tensor((n,), flat_dtype, device)
        case = case_name(op, list_dtype, flat_dtype)
        nbytes = case_bytes(op, n, list_dtype, flat_dtype)
        contig = nbytes // 8  # float32 elements: 4 bytes read and 4 written each
        bound = None
        if args.backend == "native":
            layout = ShardLayout.from_tensors(params[list_dtype])
            bound = layout.bind(params[list_dtype], flats[flat_dtype])
        impls = implementations(
            op, *ops[op], params[list_dtype], flats[flat_dtype], offsets,
            contig_src[:contig], contig_dst[:contig], bound,
        )
        timings = time_fns(impls, device, args.warmup, args.iters)
        key = {"workload": name, "op": op, "case": case}
        for impl, t in timings.items():
            results.append(key | {
                "impl": impl,
                "bytes": nbytes,
                "median_ms": t.median_s * 1e3,
                "min_ms": t.min_s * 1e3,
                "p90_ms": t.p90_s * 1e3,
                "gbps": nbytes / t.median_s / 1e9,
            })
        ratio = key.copy()
        for stat in ("median_s", "min_s"):
            tag = stat[: -len("_s")]
            ratio[f"wrapper_slowdown_{tag}"] = (
                getattr(timings["wrapper"], stat) / getattr(timings["tawpipe"], stat)
            )
            for impl, prefix in FUSED_IMPLS.items():
                if impl not in timings:
                    continue
                fused = getattr(timings[impl], stat)
                for ratio_name, baseline in BASELINES.items():
                    ratio[f"{prefix}{ratio_name}_{tag}"] = getattr(timings[baseline], stat) / fused
        ratios.append(ratio)
    return results, ratios


def run(args: argparse.Namespace) -> dict[str, object]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ops = load_ops(args.backend, device)
    load = load_average() or 0.0
    if device.type == "cpu" and load > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} on {os.cpu_count()} CPUs; timings will be noisy",
              file=sys.stderr)
    report: dict[str, object] = {
        "formula": FORMULA,
        "machine": machine_info(device, args.backend),
        "iters": args.iters,
        "warmup": args.warmup,
        "workloads": {},
        "results": [],
        "ratios": [],
    }
    for name in args.workloads:
        shapes = WORKLOADS[name]()
        n = sum(map(math.prod, shapes))
        report["workloads"][name] = {"tensors": len(shapes), "elements": n}
        results, ratios = bench_workload(name, shapes, ops, device, args)
        report["results"] += results
        report["ratios"] += ratios
    report["targets"] = targets(report["ratios"])
    report["copy_sweep"] = copy_sweep(device, args.warmup, args.iters)
    report["machine"]["load_average_1min_end"] = load_average()
    return report


def targets(ratios: list[dict[str, object]]) -> list[dict[str, object]]:
    """The issue's bar: on many small tensors, pack and unpack at >= 0.7x the contiguous copy's
    bandwidth and >= 5x faster than the Python loop (judged on medians). Reported for the plain
    op and for the bound path; for persistent tensors (the training case) the bound path counts."""
    rows = []
    for r in ratios:
        if r["workload"] != "small_2000_mixed" or r["op"] not in ("pack", "unpack"):
            continue
        for impl, prefix in FUSED_IMPLS.items():
            if f"{prefix}fraction_of_contiguous_median" not in r:
                continue
            frac = r[f"{prefix}fraction_of_contiguous_median"]
            speedup = r[f"{prefix}speedup_vs_loop_median"]
            rows.append({
                "impl": impl,
                "op": r["op"],
                "case": r["case"],
                "fraction_of_contiguous": frac,
                "speedup_vs_loop": speedup,
                "met": bool(frac >= 0.7 and speedup >= 5.0),
            })
    return rows


def print_report(report: dict[str, object]) -> None:
    m = report["machine"]
    print(f"device: {m.get('device_name', m['device'])}  backend: {m['backend']}"
          f"  torch {m['torch']}  cpus: {m['cpu_count']}  threads: {m['torch_threads']}"
          f"  load (start, end): {m['load_average_1min']}, {m['load_average_1min_end']}"
          f"  iters: {report['iters']}"
          f"  warmup: {report['warmup']}")
    print(FORMULA)
    for wname, w in report["workloads"].items():
        print(f"\n== {wname}: {w['tensors']} tensors, {w['elements']:,} elements")
        print(f"{'op':<18}{'case':<11}{'impl':<11}{'median ms':>10}{'min ms':>9}{'p90 ms':>9}"
              f"{'GB/s':>8}")
        for r in report["results"]:
            if r["workload"] == wname:
                print(f"{r['op']:<18}{r['case']:<11}{r['impl']:<11}{r['median_ms']:>10.3f}"
                      f"{r['min_ms']:>9.3f}{r['p90_ms']:>9.3f}{r['gbps']:>8.2f}")
        print("ratios of tawpipe (plain op) and bound to each baseline, from medians (from mins):")
        print(f"{'op':<18}{'case':<11}{'impl':<9}{'x vs loop':>14}{'x vs foreach':>14}"
              f"{'of contiguous':>15}{'wrapper / op':>14}")
        for r in report["ratios"]:
            if r["workload"] != wname:
                continue
            for impl, prefix in FUSED_IMPLS.items():
                if f"{prefix}speedup_vs_loop_median" not in r:
                    continue
                cells = [
                    f"{r[f'{prefix}{k}_median']:.2f} ({r[f'{prefix}{k}_min']:.2f})"
                    for k in BASELINES
                ]
                slowdown = f"{r['wrapper_slowdown_median']:.2f} ({r['wrapper_slowdown_min']:.2f})"
                print(f"{r['op']:<18}{r['case']:<11}{impl:<9}{cells[0]:>14}{cells[1]:>14}"
                      f"{cells[2]:>15}{slowdown if impl == 'tawpipe' else '':>14}")
    if report["targets"]:
        print("\ntarget (small_2000_mixed, pack/unpack: >= 0.7x contiguous, >= 5x loop; medians).\n"
              "tawpipe = the plain op, which passes all 2000 tensors through the op binding per call;\n"
              "bound = ShardLayout.bind, the path that counts for persistent tensors (parameters,\n"
              "master weights, persistent grads: the training case):")
        for t in report["targets"]:
            print(f"  {t['impl']:<9}{t['op']:<8}{t['case']:<11}{t['fraction_of_contiguous']:.2f}x "
                  f"contiguous  {t['speedup_vs_loop']:.2f}x loop  {'met' if t['met'] else 'MISSED'}")
    if report["copy_sweep"]:
        print("\ncontiguous copy bandwidth by size (bytes read + written):")
    for row in report["copy_sweep"]:
        print(f"  {row['bytes_copied'] / 2**20:>7.0f} MiB: {row['gbps']:8.1f} GB/s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("native", "triton"), default="native")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch and the native ops (default: torch's)")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path, or a folder for ops_bench_<device>.json (a _triton suffix for the triton "
                        "backend); default: the folder tawpipe-results/ in the current directory. The committed "
                        "results are rewritten only with --out benchmarks/results")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    report = run(args)
    print_report(report)
    out = args.out if args.out is not None else Path("tawpipe-results")
    if out.suffix != ".json":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        suffix = "" if args.backend == "native" else f"_{args.backend}"
        out = out / f"ops_bench_{device_slug(device)}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    from tawpipe.atomic import write_atomic
    write_atomic(out, json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
