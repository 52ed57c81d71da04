"""`tawpipe train`: bit-exact resume, re-sharding a CLI checkpoint, and arguments refused before
any worker starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tawpipe import checkpoint, cli, train
from tawpipe.engine import TawPipe, default_optimizer
from tawpipe.models.llama import Llama, LlamaConfig, block_forward, llama_loss
from tawpipe.topology import Topology
from test_engine_errors import NoComm

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--preset", "micro", "--nodes", "1", "--per-node", "2", "--seq-len", "32", "--batch-size", "2",
         "--steps", "6", "--warmup", "2"]


def _tawpipe(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "tawpipe", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """6 steps straight, checkpointing at 3 and 6; then 3 + resume from step 3 + 3."""
    tmp = tmp_path_factory.mktemp("cli")
    data = tmp / "data.txt"
    data.write_bytes((ROOT / "tawpipe" / "plan.py").read_bytes())  # any text: bytes are the tokens
    straight = _tawpipe("train", *SMALL, "--data", str(data), "--save", str(tmp / "straight"), "--save-every", "3")
    assert straight.returncode == 0, straight.stderr
    resumed = _tawpipe("train", *SMALL, "--data", str(data), "--save", str(tmp / "resumed"),
                       "--resume", str(tmp / "straight" / "step-00000003"))
    assert resumed.returncode == 0, resumed.stderr
    assert "2 steps" not in resumed.stdout and "3 steps in" in resumed.stdout
    return {"data": data, "straight": tmp / "straight", "resumed": tmp / "resumed"}


def _shards(d: Path) -> list[dict]:
    return [torch.load(p, weights_only=True) for p in sorted(d.glob("rank-*.pt"))]


def _equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_resume_is_bit_exact(runs) -> None:
    straight = _shards(runs["straight"] / "step-00000006")
    resumed = _shards(runs["resumed"] / "step-00000006")
    assert len(straight) == len(resumed) == 2
    for a, b in zip(straight, resumed):
        for n, t in a["params"].items():
            assert torch.equal(t, b["params"][n]), n
        # optimizer moments and step, scheduler, loss scale and counters, RNG, the loss history
        for key in ("optimizer", "scheduler", "precision", "steps", "extra"):
            assert _equal(a[key], b[key]), key
        assert len(a["extra"]["losses"]) == 6 and a["extra"]["data_step"] == 6
    assert straight[0]["extra"]["losses"][:3] == _shards(runs["straight"] / "step-00000003")[0]["extra"]["losses"]


def test_a_cli_checkpoint_reshards_onto_one_rank(runs) -> None:
    """Two ranks' shards into a world of one: parameters and optimizer state move by name."""
    d = runs["straight"] / "step-00000003"
    meta = checkpoint.read_manifest(d)["meta"]
    torch.manual_seed(99)
    model = Llama(LlamaConfig(**meta["model"]))
    engine = TawPipe(model.blocks, model.embed, model.head, llama_loss, topology=Topology(1, 1), micro_batches=4,
                     comm=NoComm(1), block_forward=block_forward, optimizer=default_optimizer,
                     block_context=lambda t: model.block_context(t.shape[1], torch.device("cpu"), torch.float32))
    restored = checkpoint.restore(engine, d)
    assert restored.resharded and engine.steps == 3
    full = checkpoint.consolidated(d)
    shards = _shards(d)
    moments = {n: s for shard in shards for n, s in shard["optimizer"]["state"].items()}
    for n, p in engine.named_parameters():
        assert torch.equal(p.detach(), full[n]), n
        state = engine.optimizer.state[p]
        assert all(torch.equal(state[k], moments[n][k]) for k in ("exp_avg", "exp_avg_sq", "step")), n
    assert all(len(s["params"]) < len(full) for s in shards)  # each shard held a part


def test_resume_of_another_model_is_refused_before_start(runs, monkeypatch) -> None:
    _no_workers(monkeypatch)
    with pytest.raises(SystemExit, match=r"tawpipe train: checkpoint .* is of a different model: it has 4 layers, "
                                         r"this model 6"):
        cli.main(["train", *SMALL, "--layers", "6", "--resume", str(runs["straight"])])


def _no_workers(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(train, "run_local", refuse)
    monkeypatch.setattr(train, "init_distributed", refuse)


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "unknown --preset 'nope'; choose one of micro, paper-1024"),
    (["--data", "/nonexistent/corpus.txt"], "data file not found: /nonexistent/corpus.txt"),
    (["--layers", "3"], r"3 layers for 4 ranks: every rank needs at least one layer \(--layers >= 4\)"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--warmup", "-5"], "--warmup must be >= 0, got -5"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--micro-batches", "-1"], "--micro-batches must be >= 1, got -1"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be a finite number > 0, got 0.0"),
    (["--save-every", "2"], "--save-every needs --save DIR"),
    (["--save", "{file}"], "--save .* exists and is not a directory"),
    (["--resume", "{empty}"], "no complete checkpoint under"),
    (["--resume", "{file}"], "no checkpoint at .*: not a directory"),
    (["--data", "{tiny}"], "--data .*: 3 training tokens are too few for --seq-len 128"),
])
def test_bad_arguments_fail_before_any_worker(tmp_path, monkeypatch, args, message) -> None:
    _no_workers(monkeypatch)
    (tmp_path / "file").write_text("x")
    (tmp_path / "tiny").write_bytes(b"abc")
    (tmp_path / "empty").mkdir()
    args = [a.format(file=tmp_path / "file", tiny=tmp_path / "tiny", empty=tmp_path / "empty") for a in args]
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match=f"^tawpipe train: {message}"):
        cli.main(["train", *args])
    assert time.monotonic() - t0 < 2


def test_a_bad_argument_is_one_line_on_stderr() -> None:
    out = _tawpipe("train", "--warmup", "-5")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == "tawpipe train: --warmup must be >= 0, got -5\n"
