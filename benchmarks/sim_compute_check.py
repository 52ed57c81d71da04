"""The simulator's compute model against one device's real training iteration (design §9.5).

The emulated cluster checks the simulator's links and schedules on CPUs; this checks its compute
side where it matters, on a GPU: the built-in LLaMA at a simulator preset's shape trains on one
device with plain torch (bfloat16 autocast, float32 weights and AdamW, each block checkpointed with
``--recompute``), and an iteration of ``--acc`` micro-batches and the step is timed. Beside it, the
simulator's time for the same iteration on that device, calibrated in the same process at the same
shape (``tawpipe.sim.calibrate``). Prints a table and writes JSON:

    python benchmarks/sim_compute_check.py --device cuda --model paper --seq-len 4096 16384 --out X.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tawpipe.atomic import write_atomic
from tawpipe.models.llama import Llama, LlamaConfig, block_forward
from tawpipe.models.shape import ModelDims
from tawpipe.sim import compare
from tawpipe.sim.calibrate import calibrate
from tawpipe.sim.hardware import Cluster, link
from tawpipe.sim.workload import Workload, model


def measure(dims: ModelDims, device: torch.device, acc: int, recompute: bool, iters: int, warmup: int) -> float:
    """Median seconds of one training iteration (acc micro-batches, then AdamW) at ``dims``."""
    net = Llama(LlamaConfig.from_dims(dims), seed=0).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    ctx = net.block_context(dims.seq, device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def iteration() -> None:
        for _ in range(acc):
            tokens = torch.randint(0, dims.vocab, (dims.micro_batch, dims.seq + 1), device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                h = net.embed(tokens[:, :-1])
                for block in net.blocks:
                    h = (checkpoint(block_forward, block, h, use_reentrant=False, **ctx) if recompute
                         else block_forward(block, h, **ctx))
                logits = net.head(h)
            F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for i in range(warmup + iters):
        sync()
        start = time.perf_counter()
        iteration()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="paper", help="a built-in model (paper, 1b, 7b, ...)")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--hidden", type=int, help="override the preset's hidden size (with --heads)")
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq-len", type=int, nargs="+", default=[4096])
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", help="JSON file to write")
    args = p.parse_args()
    device = torch.device(args.device)
    overrides = {k: v for k, v in (("layers", args.layers), ("hidden", args.hidden), ("heads", args.heads),
                                   ("vocab", args.vocab)) if v is not None}
    rows = []
    for seq in args.seq_len:
        dims = dataclasses.replace(model(args.model, seq=seq, micro_batch=args.micro_batch_size), **overrides)
        dev = calibrate(dims, device=args.device)
        cluster = Cluster(1, 1, dev, link("nvlink"), link("10gbe"))
        sim = compare.run("ddp", cluster, Workload(dims, dev, recompute=args.recompute), args.micro_batches)
        measured = measure(dims, device, args.micro_batches, args.recompute, args.iters, args.warmup)
        rows.append({"seq": seq, "measured_s": measured, "predicted_s": sim.time_s,
                     "ratio": sim.time_s / measured, "calibration": dataclasses.asdict(dev)})
        print(f"S = {seq:6d}: measured {measured:.4f} s/iteration, predicted {sim.time_s:.4f} s "
              f"({sim.time_s / measured:.2f}x)", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{name}, model {args.model} {overrides or ''}, micro-batch {args.micro_batch_size}, "
          f"{args.micro_batches} micro-batches, "
          f"recompute {args.recompute}, bfloat16 autocast\n")
    print("| S | measured s/iteration | predicted s | predicted / measured |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq']} | {r['measured_s']:.4f} | {r['predicted_s']:.4f} | {r['ratio']:.2f} |")
    if args.out:
        write_atomic(args.out, json.dumps({"device": name, "torch": torch.__version__, "model": args.model,
                                           "overrides": overrides, "micro_batch": args.micro_batch_size,
                                           "acc": args.micro_batches, "recompute": args.recompute,
                                           "iters": args.iters, "warmup": args.warmup, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
