"""Print how far tawpipe is from single-process training: max relative error of parameters,
updates and losses after 3 AdamW steps, per world size over every topology of the test matrix,
for k = 1 and k = micro-batches, a deeper prefetch, reused resident chunks and WeiPipe; then the
low-precision loss deviations, gradients on the wire in float32 and in bfloat16.

Usage: python benchmarks/exactness_report.py [--worlds 4 6 8]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from engine_cases import exactness  # noqa: E402
from tawpipe.runtime.launch import run_local


def _summary(label: str, res: list[dict], world: int) -> str:
    loss_err = max(abs(a - b) / abs(b) for r in res for a, b in zip(r["losses"], r["ref_losses"]))
    return (f"{label}: {len(res) // world} cases, max param rel err "
            f"{max(r['param_err'] for r in res):.1e}, max update rel err {max(r['update_err'] for r in res):.1e}, "
            f"max loss rel err {loss_err:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 6, 8])
    args = p.parse_args()
    for world in args.worlds:
        divisors = [g for g in range(1, world + 1) if world % g == 0]
        cases = [dict(nodes=g, acc=acc, layers=layers)
                 for g in divisors for acc in (1, 3) for layers in (2 * world, 2 * world + 1)]
        variants = [dict(nodes=g, acc=2, layers=world + 1, mb_per_fetch=2, prefetch_depth=2) for g in divisors]
        reuse = [dict(nodes=g, acc=2, layers=world + 1, mb_per_fetch=2, prefetch_depth=3, reuse_weights=True)
                 for g in divisors]
        weipipe = [dict(nodes=1, acc=2, layers=world + 1, algo="weipipe")]
        res = [r for rank in run_local(exactness, world, cases + variants + reuse + weipipe, timeout=1800)
               for r in rank]
        for label, group in ((f"N={world}, k=1", cases), (f"N={world}, k=acc=2, prefetch depth 2", variants),
                             (f"N={world}, k=acc=2, prefetch depth 3, resident chunks reused", reuse),
                             (f"N={world}, WeiPipe", weipipe)):
            print(_summary(label, [r for r in res if r["case"] in group], world), flush=True)
    low = [dict(nodes=2, acc=2, layers=4, steps=6, dtype=torch.bfloat16),
           dict(nodes=2, acc=2, layers=4, steps=6, dtype=torch.bfloat16, grad_wire_dtype=torch.bfloat16),
           dict(nodes=2, acc=2, layers=4, steps=6, dtype=torch.float16)]
    for r in run_local(exactness, 4, low, timeout=600)[0]:
        c = r["case"]
        wire = str(c.get("grad_wire_dtype", torch.float32)).replace("torch.", "")
        print(f"{str(c['dtype']).replace('torch.', '')} compute, {wire} gradients on the wire "
              f"(N=4, G=2, acc=2, 6 steps): max |loss - fp32 reference| "
              f"{max(abs(a - b) for a, b in zip(r['losses'], r['ref_losses'])):.1e}, "
              f"param rel err {r['param_err']:.1e}")


if __name__ == "__main__":
    main()
