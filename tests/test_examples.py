"""The scripts in examples/ run as a user runs them (quick sizes), and say what they promise."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")


def run(*cmd: str, timeout: float = 600) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHON=sys.executable)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def losses(out: str) -> tuple[float, float]:
    m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+) in \d+ steps", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


def test_own_block_stack():
    first, last = losses(run(sys.executable, str(EXAMPLES / "own_block_stack.py"), "--steps", "5"))
    assert last < first


@needs_hf
def test_hf_model_in_and_out(tmp_path):
    out = run(sys.executable, str(EXAMPLES / "hf_model.py"), "--steps", "2", "--export", str(tmp_path / "trained"))
    losses(out)
    assert (tmp_path / "trained" / "model.safetensors.index.json").is_file()
    assert re.search(r"the exported model: held-out loss \d+\.\d+", out)


@needs_hf
def test_hf_custom_family():
    out = run(sys.executable, str(EXAMPLES / "hf_custom_family.py"), "--steps", "0")  # training: as hf_model.py
    assert "largest logit difference from transformers' Granite: 0.00e+00" in out


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
def test_torchrun_two_nodes_on_loopback():
    out = run("bash", str(EXAMPLES / "torchrun_two_nodes.sh"), "--model", "micro", "--steps", "2", "--seq-len", "32",
              "--micro-batch-size", "2", "--val-every", "1", "--val-batches", "1")
    assert "topology: 2 node(s) x 2 rank(s) = 4 ranks" in out
    assert "validation loss: step 1" in out
    assert re.search(r"loss at start \d+\.\d+", out)


def test_emulated_cluster():
    from tawpipe.cluster import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    out = run("bash", str(EXAMPLES / "emulated_cluster.sh"), "--model", "micro", "--steps", "2", "--seq-len", "32",
              "--micro-batch-size", "2", "--val-every", "0")
    assert "topology: 2 node(s) x 2 rank(s) = 4 ranks" in out
    assert re.search(r"node 0: \d+\.\d+ MB / \d+\.\d+ MB", out)
