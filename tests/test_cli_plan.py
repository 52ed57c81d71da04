"""`tawpipe plan` and the subcommand hooks of the command line."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import tawpipe
from tawpipe.cli import main
from tawpipe.plan import Plan
from tawpipe.schedule import build_plan
from tawpipe.topology import Topology

SPEC_N4_SLOT5 = ("| 5 | **B2**(m0); P2P W1 r2→r0; bcast from r0; reduce G3→r0; P2P G3 r0→r3 "
                 "| **B3**(m0); P2P W2 r1→r3; bcast from r3 |")
SPEC_N6_SLOT8 = ("| 8 | **B3**; P2P W2 r4→r0; bcast from r0; reduce G4→r0; P2P G4 r0→r3 "
                 "| **B4**; P2P W3 r1→r3; bcast from r3; reduce G5→r2; P2P G5 r2→r5 "
                 "| **B5**; P2P W4 r3→r5; bcast from r5 |")


def run(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def table_of(out: str) -> str:
    return "\n".join(line for line in out.splitlines() if line.startswith("|"))


@pytest.mark.parametrize("nodes,per_node,layers,acc,line", [
    (2, 2, 4, 2, SPEC_N4_SLOT5), (3, 2, 6, 1, SPEC_N6_SLOT8),
])
def test_plan_prints_the_spec_tables(capsys, nodes, per_node, layers, acc, line):
    out = run(capsys, "plan", "--nodes", str(nodes), "--per-node", str(per_node), "--layers", str(layers),
              "--micro-batches", str(acc), "--grad-route", "leader")
    expected = build_plan(Topology(nodes, per_node), layers, acc, grad_route="leader").table()
    assert table_of(out) == expected  # equal to the paper's tables: see test_plan.py
    assert line in out.splitlines()
    assert "no deadlock" in out and f"{nodes * per_node * nodes * per_node * acc} gradient" in out


def test_plan_json_is_the_plan(capsys):
    out = run(capsys, "plan", "--nodes", "2", "--per-node", "3", "--layers", "7", "--micro-batches", "2", "--json")
    plan = Plan.from_json(out)
    assert plan == build_plan(Topology(2, 3), 7, 2, layer_numel=1, weight_bytes=1, grad_bytes=1)


def test_plan_weipipe_table(capsys):
    out = run(capsys, "plan", "--nodes", "1", "--per-node", "4", "--layers", "4", "--micro-batches", "2",
              "--algo", "weipipe")
    assert "| 4 | F:W0(m1) B:W1(m0) ⇒ f0,b1 | F:W1(m0) ⇒ f1,b0 | F:W2(m0) ⇒ f2,b3 | F:W3(m0) ⇒ f3,b2 |" in out
    assert "final G3→3" in out


def _busiest_grads(out: str) -> float:
    m = re.search(r"grads: busiest rank across nodes r\d+ ([\d,.]+)", out)
    return float(m.group(1).replace(",", ""))


def test_summary_shows_the_rail_cut_of_the_busiest_rank(capsys):
    args = ("plan", "--nodes", "3", "--per-node", "8", "--layers", "24", "--micro-batches", "4", "--no-table")
    leader = run(capsys, *args, "--grad-route", "leader")
    rail = run(capsys, *args, "--grad-route", "rail")
    assert "|" not in leader
    assert _busiest_grads(leader) == 4 * 16  # acc·N·(G-1)/G chunks of one layer
    assert _busiest_grads(leader) / _busiest_grads(rail) == pytest.approx(8)


def test_model_dimensions_give_bytes_and_peer_estimates(capsys):
    out = run(capsys, "plan", "--nodes", "2", "--per-node", "2", "--layers", "8", "--micro-batches", "2",
              "--no-table", "--hidden", "256", "--heads", "8", "--seq", "1024")
    for method in ("ddp", "fsdp", "hsdp", "1f1b", "weipipe", "tawpipe"):
        assert re.search(rf"^\s+{method}\s+[\d.]+ GB\s+[\d.]+ GB$", out, re.M), method
    assert re.search(r"weights: busiest rank across nodes r\d \d[\d.]* [kMG]?B", out)


@pytest.mark.parametrize("argv,match", [
    (["plan", "--nodes", "2", "--per-node", "2", "--layers", "3", "--micro-batches", "1"], "num_layers=3 < world size 4"),
    (["plan", "--nodes", "0", "--per-node", "2", "--layers", "3", "--micro-batches", "1"], "nodes must be"),
    (["plan", "--nodes", "2", "--per-node", "2", "--layers", "4", "--micro-batches", "1", "--bogus"], "unrecognized"),
])
def test_plan_errors_are_clear(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(argv)


def test_train_and_bench_are_delegated_lazily(monkeypatch):
    seen = {}
    fake = types.ModuleType("tawpipe.bench", "Fake bench.")
    fake.add_arguments = lambda p: p.add_argument("--repeat", type=int, default=1)

    def fake_main(args: argparse.Namespace) -> int:
        seen["args"] = args
        return 7

    fake.main = fake_main
    monkeypatch.setitem(sys.modules, "tawpipe.bench", fake)
    assert main(["bench", "--repeat", "3"]) == 7
    assert seen["args"].repeat == 3
    monkeypatch.setitem(sys.modules, "tawpipe.bench", None)
    with pytest.raises(SystemExit, match="not available"):
        main(["bench"])


def test_module_entry_point():
    root = Path(tawpipe.__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    out = subprocess.run(
        [sys.executable, "-m", "tawpipe.cli", "plan", "--nodes", "2", "--per-node", "2", "--layers", "4",
         "--micro-batches", "2", "--grad-route", "leader"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    assert SPEC_N4_SLOT5 in out.splitlines()
