"""Benchmark of tawpipe's fused pack / unpack / unpack_accumulate against the ways they replace.

Why: weight pipelining moves whole layer chunks (and, in the worst case, thousands of small
parameters) between per-parameter tensors and one flat communication buffer every step, so
these copies must run near the memory bandwidth and must not cost one launch or one Python
iteration per tensor. Each case is timed for:

* ``tawpipe``     the fused op (``--backend native``: ``torch.ops.tawpipe``; ``triton``:
                  ``tawpipe.triton_ops``, under the interpreter when there is no GPU),
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

import torch

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> Timing:
    """Per-iteration times: CUDA events on a GPU, perf_counter around a synced call on a CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    p90 = times[min(len(times) - 1, math.ceil(0.9 * len(times)) - 1)]
    return Timing(statistics.median(times), times[0], p90)


def load_ops(backend: str, device: torch.device) -> dict[str, Callable[..., None]]:
    """The three ops of the chosen backend, with the public schemas."""
    if backend == "native":
        import tawpipe.ops  # noqa: F401  (registers torch.ops.tawpipe)

        ns = torch.ops.tawpipe
        return {"pack": ns.pack, "unpack": ns.unpack, "unpack_accumulate": ns.unpack_accumulate}
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
    from tawpipe import triton_ops

    return {
        "pack": triton_ops.pack,
        "unpack": triton_ops.unpack,
        "unpack_accumulate": triton_ops.unpack_accumulate,
    }


def implementations(
    op: str,
    fused: Callable[..., None],
    params: list[torch.Tensor],
    flat: torch.Tensor,
    offsets: list[int],
    contig_src: torch.Tensor,
    contig_dst: torch.Tensor,
) -> dict[str, Callable[[], object]]:
    """Zero-argument callables doing the same work four ways (see the module docstring)."""
    sizes = [p.numel() for p in params]
    views = list(torch.split(flat, sizes))
    param_flat = [p.view(-1) for p in params]
    if op == "pack":

        def loop() -> None:
            for p, o in zip(params, offsets):
                flat[o : o + p.numel()].copy_(p.view(-1).to(flat.dtype))

        return {
            "tawpipe": lambda: fused(params, flat, offsets),
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
            "loop": loop,
            "foreach": lambda: torch._foreach_copy_(param_flat, views),
            "contiguous": lambda: contig_dst.copy_(contig_src),
        }

    def loop() -> None:
        for p, o in zip(params, offsets):
            p.add_(flat[o : o + p.numel()].view_as(p).to(p.dtype), alpha=ALPHA)

    return {
        "tawpipe": lambda: fused(flat, params, offsets, ALPHA),
        "loop": loop,
        "foreach": lambda: torch._foreach_add_(param_flat, views, alpha=ALPHA),
        "contiguous": lambda: contig_dst.copy_(contig_src),
    }


def case_bytes(op: str, n: int, list_dtype: torch.dtype, flat_dtype: torch.dtype) -> int:
    src, dst = (list_dtype, flat_dtype) if op == "pack" else (flat_dtype, list_dtype)
    s, d = src.itemsize, dst.itemsize
    return n * (s + 2 * d) if op.endswith("accumulate") else n * (s + d)


def copy_sweep(device: torch.device, warmup: int, iters: int) -> list[dict[str, float]]:
    """Device-to-device copy bandwidth from 1 MiB to 1 GiB (read + written bytes)."""
    rows = []
    for mib in (1, 4, 16, 64, 128, 256, 512, 1024):
        n = mib * 2**20 // 4
        src = torch.randn(n, device=device)
        dst = torch.empty_like(src)
        t = time_fn(lambda: dst.copy_(src), device, warmup, iters)
        moved = 2 * n * 4
        rows.append(
            {"bytes_copied": n * 4, "median_ms": t.median_s * 1e3, "gbps": moved / t.median_s / 1e9}
        )
        del src, dst
    return rows


def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


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
    ops: dict[str, Callable[..., None]],
    device: torch.device,
    args: argparse.Namespace,
) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """Time every case of CASES on one workload; returns (result rows, ratio rows)."""
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
        impls = implementations(
            op, ops[op], params[list_dtype], flats[flat_dtype], offsets,
            contig_src[:contig], contig_dst[:contig],
        )
        timings = {k: time_fn(f, device, args.warmup, args.iters) for k, f in impls.items()}
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
        fused = timings["tawpipe"].median_s
        ratios.append(key | {
            "speedup_vs_loop": timings["loop"].median_s / fused,
            "speedup_vs_foreach": timings["foreach"].median_s / fused,
            "fraction_of_contiguous": timings["contiguous"].median_s / fused,
        })
    return results, ratios


def run(args: argparse.Namespace) -> dict[str, object]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ops = load_ops(args.backend, device)
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
        report["workloads"][name] = {"tensors": len(shapes), "elements": sum(map(math.prod, shapes))}
        results, ratios = bench_workload(name, shapes, ops, device, args)
        report["results"] += results
        report["ratios"] += ratios
    report["targets"] = targets(report["ratios"])
    if device.type == "cuda":
        report["copy_sweep"] = copy_sweep(device, args.warmup, args.iters)
    return report


def targets(ratios: list[dict[str, object]]) -> list[dict[str, object]]:
    """The issue's bar: on many small tensors, pack and unpack at >= 0.7x the contiguous copy's
    bandwidth and >= 5x faster than the Python loop."""
    rows = []
    for r in ratios:
        if r["workload"] == "small_2000_mixed" and r["op"] in ("pack", "unpack"):
            ok = r["fraction_of_contiguous"] >= 0.7 and r["speedup_vs_loop"] >= 5.0
            rows.append({k: r[k] for k in ("op", "case")} | {"met": bool(ok)})
    return rows


def print_report(report: dict[str, object]) -> None:
    m = report["machine"]
    print(f"device: {m.get('device_name', m['device'])}  backend: {m['backend']}  torch {m['torch']}"
          f"  cpus: {m['cpu_count']}  iters: {report['iters']}  warmup: {report['warmup']}")
    print(FORMULA)
    for wname, w in report["workloads"].items():
        print(f"\n== {wname}: {w['tensors']} tensors, {w['elements']:,} elements")
        print(f"{'op':<18}{'case':<11}{'impl':<11}{'median ms':>10}{'min ms':>9}{'p90 ms':>9}"
              f"{'GB/s':>8}")
        for r in report["results"]:
            if r["workload"] == wname:
                print(f"{r['op']:<18}{r['case']:<11}{r['impl']:<11}{r['median_ms']:>10.3f}"
                      f"{r['min_ms']:>9.3f}{r['p90_ms']:>9.3f}{r['gbps']:>8.2f}")
        print(f"{'op':<18}{'case':<11}{'x vs loop':>10}{'x vs foreach':>13}{'of contiguous':>14}")
        for r in report["ratios"]:
            if r["workload"] == wname:
                print(f"{r['op']:<18}{r['case']:<11}{r['speedup_vs_loop']:>10.2f}"
                      f"{r['speedup_vs_foreach']:>13.2f}{r['fraction_of_contiguous']:>14.2f}")
    if report["targets"]:
        print("\ntarget (small_2000_mixed, pack/unpack: >= 0.7x contiguous and >= 5x loop):")
        for t in report["targets"]:
            print(f"  {t['op']:<8}{t['case']:<11}{'met' if t['met'] else 'MISSED'}")
    for row in report.get("copy_sweep", []):
        print(f"copy {row['bytes_copied'] / 2**20:>7.0f} MiB: {row['gbps']:8.1f} GB/s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("native", "triton"), default="native")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: benchmarks/results/ops_bench_<device>.json, "
                        "with a _triton suffix for the triton backend)")
    args = parser.parse_args(argv)
    report = run(args)
    print_report(report)
    out = args.out
    if out is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        suffix = "" if args.backend == "native" else f"_{args.backend}"
        out = Path(__file__).resolve().parent / "results" / f"ops_bench_{device_slug(device)}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
