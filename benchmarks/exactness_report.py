"""Print how far tawpipe is from single-process training: max relative error of parameters,
updates and losses after 3 AdamW steps, per world size over every topology of the test matrix.

Usage: python benchmarks/exactness_report.py [--worlds 4 6 8]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from engine_cases import exactness  # noqa: E402
from tawpipe.launch import run_local  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 6, 8])
    args = p.parse_args()
    for world in args.worlds:
        cases = [dict(nodes=g, acc=acc, layers=layers)
                 for g in range(1, world + 1) if world % g == 0
                 for acc in (1, 3) for layers in (2 * world, 2 * world + 1)]
        res = [r for rank in run_local(exactness, world, cases, timeout=1800) for r in rank]
        loss_err = max(abs(a - b) / abs(b) for r in res for a, b in zip(r["losses"], r["ref_losses"]))
        print(f"N={world}: {len(cases)} cases, max param rel err {max(r['param_err'] for r in res):.1e}, "
              f"max update rel err {max(r['update_err'] for r in res):.1e}, max loss rel err {loss_err:.1e}",
              flush=True)
    r = run_local(exactness, 4, [dict(nodes=2, acc=2, layers=4, steps=6, dtype=torch.bfloat16)], timeout=600)[0][0]
    print(f"bf16 (N=4, G=2, acc=2, 6 steps): max |loss - fp32 reference| "
          f"{max(abs(a - b) for a, b in zip(r['losses'], r['ref_losses'])):.1e}")


if __name__ == "__main__":
    main()
