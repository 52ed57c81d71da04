"""benchmarks/sim_compute_check.py on the CPU, tiny: it trains, times, and records the calibration
its prediction came from (the GPU figures in benchmarks/results/sim_calibration/ come from it)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tawpipe.sim import compare
from tawpipe.sim.hardware import Cluster, Device, link
from tawpipe.sim.workload import Workload, model

ROOT = Path(__file__).resolve().parents[1]


def test_the_compute_check_predicts_from_the_calibration_it_records(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sim_compute_check.py"), "--device", "cpu", "--model", "paper",
           "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq-len", "64", "128",
           "--iters", "2", "--warmup", "1", "--no-recompute", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [r["seq"] for r in doc["rows"]] == [64, 128] and doc["recompute"] is False
    for r in doc["rows"]:
        assert r["measured_s"] > 0 and r["ratio"] == pytest.approx(r["predicted_s"] / r["measured_s"])
        dims = dataclasses.replace(model("paper", seq=r["seq"], micro_batch=2), layers=1, hidden=64, heads=4,
                                   vocab=256)
        dev = Device(**r["calibration"])
        sim = compare.run("ddp", Cluster(1, 1, dev, link("nvlink"), link("10gbe")), Workload(dims, dev, recompute=False), 2)
        assert sim.time_s == pytest.approx(r["predicted_s"], rel=1e-12)
    assert f"| 128 | {doc['rows'][1]['measured_s']:.4f} |" in run.stdout
