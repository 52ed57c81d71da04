"""`tawpipe train`: bit-exact resume, re-sharding a CLI checkpoint, arguments refused before any
worker starts; model selection, config files, help, validation loss, metrics and export."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tawpipe.io import checkpoint
from tawpipe import cli, models
from tawpipe.commands import Parser, UsageError
from tawpipe.train import add_arguments, job
from tawpipe.train.data import batch, load_tokens
from tawpipe.engine.engine import default_optimizer
from tawpipe.train.metrics import MetricsWriter, _flatten, check_tensorboard
from tawpipe.models.llama import Llama, LlamaConfig, block_forward, llama_loss
from tawpipe.plan.topology import Topology
from engine_cases import make_engine
from cli_cases import refused
from test_engine_errors import NoComm

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--model", "micro", "--nodes", "1", "--per-node", "2", "--seq-len", "32", "--micro-batch-size", "2",
         "--steps", "6", "--warmup", "2"]


def _tawpipe(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "tawpipe", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """6 steps straight, checkpointing at 3 and 6; then 3 + resume from step 3 + 3. Both append
    to one metrics file, as a run interrupted at 6 and resumed from its checkpoint at 3 would."""
    tmp = tmp_path_factory.mktemp("cli")
    data = tmp / "data.txt"
    data.write_bytes((ROOT / "tawpipe" / "plan" / "plan.py").read_bytes())  # any text: bytes are the tokens
    metrics = ["--metrics", str(tmp / "m.jsonl")]
    straight = _tawpipe("train", *SMALL, "--data", str(data), "--save", str(tmp / "straight"), "--save-every", "3",
                        *metrics)
    assert straight.returncode == 0, straight.stderr
    resumed = _tawpipe("train", *SMALL, "--data", str(data), "--save", str(tmp / "resumed"),
                       "--resume", str(tmp / "straight" / "step-00000003"), *metrics)
    assert resumed.returncode == 0, resumed.stderr
    assert "2 steps" not in resumed.stdout and "3 steps in" in resumed.stdout
    return {"data": data, "straight": tmp / "straight", "resumed": tmp / "resumed", "metrics": tmp / "m.jsonl",
            "resumed_stdout": resumed.stdout}


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


def test_the_host_staged_setting_resumes_bit_exactly(tmp_path) -> None:
    """--reuse-weights host (its restores in every round at k = 1) through a checkpoint: the
    manifest records it, the resume runs it again, and the result is bit-exact."""
    host = ["--model", "micro", "--nodes", "2", "--per-node", "1", "--seq-len", "32", "--micro-batch-size", "2",
            "--micro-batches", "2", "--mb-per-fetch", "1", "--prefetch-depth", "1", "--reuse-weights", "host",
            "--steps", "4", "--warmup", "1"]
    straight = _tawpipe("train", *host, "--save", str(tmp_path / "straight"), "--save-every", "2")
    assert straight.returncode == 0, straight.stderr
    assert "resident chunks reused, the rest kept in host memory" in straight.stdout
    resumed = _tawpipe("train", *host, "--save", str(tmp_path / "resumed"),
                       "--resume", str(tmp_path / "straight" / "step-00000002"))
    assert resumed.returncode == 0, resumed.stderr
    shards = _shards(tmp_path / "straight" / "step-00000004"), _shards(tmp_path / "resumed" / "step-00000004")
    assert len(shards[0]) == len(shards[1]) == 2
    for a, b in zip(*shards):
        assert all(torch.equal(t, b["params"][n]) for n, t in a["params"].items())
        assert _equal(a["optimizer"], b["optimizer"])


def test_resuming_with_metrics_writes_each_step_once(runs) -> None:
    """The records the interrupted run wrote after its checkpoint are dropped, not repeated; the
    resumed run's header says where it starts."""
    records = [json.loads(x) for x in runs["metrics"].read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    losses = _shards(runs["straight"] / "step-00000006")[0]["extra"]["losses"]
    assert [r["loss"] for r in records] == losses  # bit-exact resume: the same values, written again
    out = runs["resumed_stdout"]
    assert ", 6 steps, resumed from step 3\n" in out and "\nresumed from step 3 (" in out
    assert "metrics: dropped 3 record(s) after step 3 from" in out


def test_a_resume_with_a_new_lr_warmup_and_steps_steps_at_the_new_schedules_rates(runs, tmp_path) -> None:
    """A run resumed from step 3 with --lr, --warmup and --steps of its own steps at the rates of
    plain torch's LambdaLR built with those flags and stepped 3 times, from its first step on (it
    went on at the checkpoint's --lr, and its first step at the old schedule's rate)."""
    lr, warmup, steps = 0.0123, 3, 9
    r = _tawpipe("train", *SMALL, "--data", str(runs["data"]), "--lr", str(lr), "--warmup", str(warmup),
                 "--steps", str(steps), "--resume", str(runs["straight"] / "step-00000003"),
                 "--metrics", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0, r.stderr
    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warmup if s < warmup else
                                                 0.1 + 0.45 * (1 + np.cos(np.pi * min((s - warmup) / (steps - warmup), 1))))
    expected = []
    for step in range(steps):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert [x["step"] for x in records] == list(range(4, steps + 1))
    assert [x["lr"] for x in records] == pytest.approx(expected[3:], rel=1e-12)


def test_a_resume_on_another_layout_of_as_many_ranks_trains_the_same_curve_without_a_note(runs, tmp_path) -> None:
    """The checkpoint of 1 node x 2 ranks resumed on 2 nodes x 1 with the other schedule and
    gradient route: the same ranks draw the same batches, so the losses are the uninterrupted run's
    up to the order of the sums, and no note says the run will differ (it did); on another number
    of ranks it says so, naming the two shapes."""
    same = _tawpipe("train", *SMALL, "--data", str(runs["data"]), "--nodes", "2", "--per-node", "1",
                    "--algo", "weipipe", "--grad-route", "leader", "--resume", str(runs["straight"] / "step-00000003"),
                    "--metrics", str(tmp_path / "m.jsonl"))
    assert same.returncode == 0, same.stderr
    assert "note:" not in same.stderr, same.stderr
    losses = [json.loads(x)["loss"] for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    straight = _shards(runs["straight"] / "step-00000006")[0]["extra"]["losses"]
    assert len(losses) == 3 and losses == pytest.approx(straight[3:], rel=1e-5)
    fewer = _tawpipe("train", *SMALL, "--data", str(runs["data"]), "--per-node", "1", "--steps", "4",
                     "--resume", str(runs["straight"] / "step-00000003"))
    assert fewer.returncode == 0, fewer.stderr
    assert ("note: resuming with other settings than the checkpoint's (--nodes x --per-node 1 x 2 -> 1 x 1, "
            "--steps 6 -> 4); the run will differ from an uninterrupted one") in fewer.stderr, fewer.stderr


def test_each_rank_draws_its_own_dropout_stream_which_the_seed_fixes() -> None:
    """The torch generators a rank steps from (dropout's) differ between ranks, are the same in a
    second launch of the same configuration, and change with --seed (the workers started with the
    launcher's state: the same on every rank, and another one at every launch)."""
    from launch_cases import rng_after_setup
    from tawpipe.runtime.launch import run_local
    from tawpipe.train.config import TrainConfig

    cfg = TrainConfig(model="micro", nodes=1, per_node=2, seq_len=32, micro_batch_size=2, val_every=0)
    first, again, other = (run_local(rng_after_setup, 2, c, timeout=120) for c in (cfg, cfg, replace(cfg, seed=1)))
    assert not torch.equal(first[0], first[1])
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, other))


def test_a_model_with_dropout_trains_the_same_curve_twice(tmp_path) -> None:
    """A Hugging Face LLaMA with attention dropout, trained twice with the same flags: the same
    losses, bit for bit (they differed from launch to launch: 5.5387 and 5.5331 at step 1)."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             attention_dropout=0.3).save_pretrained(tmp_path / "hf")
    curves = []
    for i in range(2):
        r = _tawpipe("train", *SMALL[2:], "--model", str(tmp_path / "hf"), "--steps", "2", "--val-every", "0",
                     "--data", str(ROOT / "tawpipe" / "plan" / "plan.py"), "--metrics", str(tmp_path / f"m{i}"))
        assert r.returncode == 0, r.stderr
        curves.append([json.loads(x)["loss"] for x in (tmp_path / f"m{i}").read_text().splitlines()])
    assert len(curves[0]) == 2 and curves[0] == curves[1]


def test_steps_skipped_in_a_row_before_a_checkpoint_count_after_the_resume(runs, tmp_path) -> None:
    """--max-skipped-in-a-row 3 with every step from the second skipped (float16, --lr 50): the run
    stops at step 4, and so does its resume from the checkpoint of step 3 (which counted from 0
    again and went on to step 6)."""
    args = [*SMALL, "--data", str(runs["data"]), "--dtype", "float16", "--lr", "50", "--max-skipped-in-a-row", "3"]
    straight = _tawpipe("train", *args, "--save", str(tmp_path / "ckpt"), "--save-every", "3")
    resumed = _tawpipe("train", *args, "--resume", str(tmp_path / "ckpt" / "step-00000003"))
    for r in (straight, resumed):
        assert r.returncode == 1, r.stderr
        assert "tawpipe train: rank 0: step 4: the last 3 steps were skipped" in r.stderr, r.stderr[-2000:]
    assert _shards(tmp_path / "ckpt" / "step-00000003")[0]["extra"]["skipped_in_a_row"] == 2


def test_chunked_loss_trains_the_same_curve(runs, tmp_path) -> None:
    """--loss chunked: the head and cross-entropy a slice of tokens at a time, six steps of the same
    losses as the plain loss (the straight run) to float32 rounding."""
    r = _tawpipe("train", *SMALL, "--data", str(runs["data"]), "--loss", "chunked", "--metrics", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    chunked = [json.loads(x)["loss"] for x in (tmp_path / "m").read_text().splitlines()]
    plain = _shards(runs["straight"] / "step-00000006")[0]["extra"]["losses"]
    assert "; chunked loss (the head a slice of tokens at a time)" in r.stdout  # computed so ...
    assert len(chunked) == 6 and chunked == pytest.approx(plain, rel=1e-5)  # ... and the same to rounding


def test_context_parallel_trains_the_curve_of_one_rank_on_whole_sequences(runs, tmp_path) -> None:
    """--context-parallel 2 on one node of 2: both ranks draw rank 0's sequences and take a slice
    each, so the run trains what one rank alone trains on whole sequences, to float32 rounding."""
    curves = {}
    for name, ranks in (("split", ["--per-node", "2", "--context-parallel", "2"]), ("whole", ["--per-node", "1"])):
        args = [*SMALL, "--data", str(runs["data"]), *ranks, "--steps", "4", "--metrics", str(tmp_path / name)]
        r = _tawpipe("train", *args)
        assert r.returncode == 0, r.stderr
        curves[name] = [json.loads(x)["loss"] for x in (tmp_path / name).read_text().splitlines()]
        if name == "split":
            assert "context parallel: each 2 ranks of a node share them, 16 tokens of each sequence per rank" in r.stdout
    assert len(curves["split"]) == 4 and curves["split"] == pytest.approx(curves["whole"], rel=1e-5)


def test_a_hugging_face_model_trains_with_context_parallelism_and_the_chunked_loss(tmp_path) -> None:
    """A Hugging Face LLaMA (a config: seeded random init, the same on any topology) with a
    vocabulary past 65,536 tokens, trained on a uint32 .npy, with --context-parallel 2 and --loss
    chunked trains the curve of one rank on whole sequences with the plain loss, to float32
    rounding."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=70_000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(tmp_path / "hf")
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(3).integers(0, 70_000, size=20_000).astype(np.uint32))
    curves = {}
    for name, options in (("split", ["--per-node", "2", "--context-parallel", "2", "--loss", "chunked"]),
                          ("whole", ["--per-node", "1", "--loss", "plain"])):
        args = ["--model", str(tmp_path / "hf"), "--nodes", "1", "--seq-len", "32", "--micro-batch-size", "2",
                "--steps", "3", "--warmup", "1", "--data", str(data), *options,
                "--metrics", str(tmp_path / name)]
        r = _tawpipe("train", *args)
        assert r.returncode == 0, r.stderr
        curves[name] = [json.loads(x)["loss"] for x in (tmp_path / name).read_text().splitlines()]
        if name == "split":
            assert "context parallel: each 2 ranks of a node share them, 16 tokens of each sequence per rank" in r.stdout
            assert "; chunked loss (the head a slice of tokens at a time)" in r.stdout
    assert len(curves["split"]) == 3 and curves["split"] == pytest.approx(curves["whole"], rel=1e-5)


def test_a_hugging_face_model_that_cannot_attend_from_a_slice_is_refused(tmp_path, monkeypatch, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    _no_workers(monkeypatch)
    transformers.MistralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2,
                               sliding_window=8).save_pretrained(tmp_path / "hf")
    said = refused(capsys, "train", "--model", str(tmp_path / "hf"), "--nodes", "1", "--per-node", "2",
                   "--seq-len", "32", "--context-parallel", "2")
    assert re.match(r"tawpipe train: --context-parallel 2: this model cannot attend from a slice of the sequence: "
                    r"its sliding-window attention \(8 tokens\); train it with --context-parallel 1", said), said


def test_a_head_that_scales_its_logits_is_refused_the_chunked_loss(tmp_path, monkeypatch, capsys) -> None:
    """Granite's adapter (examples/hf_custom_family.py) scales the logits in its head: the chunked
    loss, which never forms them, would train another model."""
    transformers = pytest.importorskip("transformers")
    from tawpipe.models import hf

    _no_workers(monkeypatch)
    monkeypatch.setattr(hf, "ADAPTERS", dict(hf.ADAPTERS))  # the example registers Granite on import
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from hf_custom_family import GraniteAdapter

    hf.register("granite", GraniteAdapter())
    transformers.GraniteConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, logits_scaling=4.0).save_pretrained(tmp_path / "granite")
    said = refused(capsys, "train", "--model", str(tmp_path / "granite"), "--nodes", "1", "--per-node", "2",
                   "--seq-len", "32", "--loss", "chunked")
    assert re.match(r"tawpipe train: --loss chunked: this model's head \(Scaled\) is not the final norm and a "
                    r"bias-free projection.*use --loss plain", said), said


def test_metrics_truncation_keeps_the_records_up_to_the_step(tmp_path) -> None:
    from tawpipe.train.metrics import truncate_after

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    assert truncate_after(path, 3) == 3  # 4, 5 and the torn line of a killed run
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    assert truncate_after(path, 3) == 0 and truncate_after(tmp_path / "none.jsonl", 3) == 0
    path.write_text(path.read_text() + '{"step": 4}')  # complete, but its newline never written
    assert truncate_after(path, 4) == 0 and path.read_text().endswith('{"step": 4}\n')
    truncate_after(path, 3)
    w = MetricsWriter(path, resume_step=2)
    w.write({"step": 3, "loss": 0.5})
    w.close()
    assert w.dropped == 1 and [json.loads(x)["loss"] for x in path.read_text().splitlines()] == [1.0, 1.0, 0.5]


def test_a_cli_checkpoint_reshards_onto_one_rank(runs) -> None:
    """Two ranks' shards into a world of one: parameters and optimizer state move by name."""
    d = runs["straight"] / "step-00000003"
    meta = checkpoint.read_manifest(d)["meta"]
    torch.manual_seed(99)
    model = Llama(LlamaConfig(**meta["model"]))
    engine = make_engine(model.blocks, model.embed, model.head, llama_loss, topology=Topology(1, 1), micro_batches=4,
                         comm=NoComm(1), block_forward=block_forward, optimizer=default_optimizer,
                         # the run had a schedule (LambdaLR): an engine without one refuses its state
                         lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
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


def test_resume_of_another_model_is_refused_before_start(runs, monkeypatch, capsys) -> None:
    _no_workers(monkeypatch)
    assert re.match(r"tawpipe train: checkpoint .* is of a different model: it has 4 layers, this model 6",
                    refused(capsys, "train", *SMALL, "--layers", "6", "--resume", str(runs["straight"])))


def _no_workers(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(job, "run_local", refuse)
    monkeypatch.setattr(job, "init_distributed", refuse)


@pytest.mark.parametrize("args, message", [
    (["--model", "nope"], "unknown --model 'nope'; choose one of micro, tiny, paper, paper-1024, .*, 70b, a directory"),
    (["--model", "/no/such/dir"], "--model /no/such/dir: no such file or directory; give the path of a config "
                                  r"\.json file or of a directory written by save_pretrained, or a built-in model"),
    (["--val-every", "-1"], "--val-every must be >= 0, got -1"),
    (["--val-batches", "0"], "--val-batches must be >= 1, got 0"),
    (["--export", "{file}"], "--export .* exists and is not a directory"),
    (["--data", "/nonexistent/corpus.txt"], "data file not found: /nonexistent/corpus.txt"),
    (["--layers", "3"], r"3 layers for 4 ranks: every rank needs at least one layer \(--layers >= 4, or more --replicas\)"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--warmup", "-5"], "--warmup must be >= 0, got -5"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--micro-batches", "-1"], "--micro-batches must be >= 1, got -1"),
    (["--mb-per-fetch", "3"], "schedule: --mb-per-fetch 3 does not divide --micro-batches 2: .*pick a divisor"),
    (["--algo", "weipipe", "--prefetch-depth", "2"], "schedule: weipipe runs the paper's settings only"),
    (["--prefetch-depth", "4"], "schedule: --prefetch-depth 4 is beyond 3, where 4 staging buffers already hold"),
    (["--prefetch-depth", "resident", "--no-reuse-weights"],
     r"schedule: --prefetch-depth resident keeps fetched chunks only if they are reused: pass --reuse-weights, "
     r"or give the depth as a number"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be a finite number > 0, got 0.0"),
    (["--save-every", "2"], "--save-every needs --save DIR"),
    (["--save", "{file}"], "--save .* exists and is not a directory"),
    (["--resume", "{empty}"], "no complete checkpoint under"),
    (["--resume", "{file}"], "no checkpoint at .*: not a directory"),
    (["--data", "{tiny}"], "--data .*: 3 training tokens are too few for --seq-len 128"),
    (["--data", "{short}", "--seq-len", "64"],
     "--data .*: the held-out split has 20 tokens, too few for --seq-len 64: use more data, or --val-every 0"),
    (["--context-parallel", "0"], "--context-parallel must be >= 1, got 0"),
    (["--context-parallel", "3"], r"--context-parallel 3 does not divide the 2 ranks of a node \(--per-node\)"),
    (["--context-parallel", "2", "--seq-len", "66"], r"--seq-len 66 is not a multiple of 2 x --context-parallel = 4"),
    (["--context-parallel", "2", "--algo", "weipipe"], "--context-parallel 2 needs --algo tawpipe"),
])
def test_bad_arguments_fail_before_any_worker(tmp_path, monkeypatch, capsys, args, message) -> None:
    _no_workers(monkeypatch)
    (tmp_path / "file").write_text("x")
    (tmp_path / "tiny").write_bytes(b"abc")
    (tmp_path / "short").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(400)))
    (tmp_path / "empty").mkdir()
    args = [a.format(file=tmp_path / "file", tiny=tmp_path / "tiny", short=tmp_path / "short", empty=tmp_path / "empty")
            for a in args]
    t0 = time.monotonic()
    assert re.match(f"tawpipe train: {message}", refused(capsys, "train", *args))
    assert time.monotonic() - t0 < 2


def test_a_bad_argument_is_one_line_on_stderr() -> None:
    out = _tawpipe("train", "--warmup", "-5")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "tawpipe train: --warmup must be >= 0, got -5\n"


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="tawpipe train")
    add_arguments(p)
    return p


def test_help_shows_defaults_and_presets(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--steps STEPS optimizer steps (default: 100)" in out
    assert "(default: tiny)" in out and "(default: float32)" in out
    assert "of the batches (default: 0)" in out  # a default of 0 shows, though 0 == False
    for preset in models.PRESETS:
        assert preset in out
    assert "qwen2" in out


@pytest.mark.parametrize("suffix, text", [
    (".toml", 'steps = 7\nmicro_batches = 3\nmodel = "micro"\nlr = 0.01\n'),
    (".yaml", "steps: 7\nmicro-batches: 3\nmodel: micro\nlr: 0.01\n"),
])
def test_config_file_keys_mirror_the_flags_and_flags_win(tmp_path, suffix, text):
    file = tmp_path / f"run{suffix}"
    file.write_text(text)
    args = parser().parse_args(["--config", str(file), "--steps", "9"])
    assert (args.steps, args.micro_batches, args.model, args.lr) == (9, 3, "micro", 0.01)
    assert parser().parse_args(["--steps", "9", "--config", str(file)]).steps == 9  # wherever --config is


@pytest.mark.parametrize("text, expected", [
    ("no-reuse-weights = true\n", False), ("no-reuse-weights = false\n", "auto"), ("reuse-weights = true\n", True),
    ("reuse-weights = 'host'\n", "host"), ("reuse-weights = false\n", "auto"),
    ("reuse-weights = true\nno-reuse-weights = false\n", True),
])
def test_a_config_flag_without_a_value_stores_what_giving_it_stores(tmp_path, text, expected):
    """``no-reuse-weights = true`` is ``--no-reuse-weights`` (it used to store True: reuse on), and
    a flag set to false sets nothing."""
    file = tmp_path / "run.toml"
    file.write_text(text)
    assert parser().parse_args(["--config", str(file)]).reuse_weights == expected


@pytest.mark.parametrize("argv, file", [(["--max-grad-norm", "none"], ""), ([], 'max-grad-norm = "none"\n')])
def test_clipping_can_be_turned_off(tmp_path, argv, file):
    """``none`` is no clipping, from the command line or a config file; a number still clips."""
    (tmp_path / "run.toml").write_text(file)
    assert parser().parse_args(argv + ["--config", str(tmp_path / "run.toml")]).max_grad_norm is None
    assert parser().parse_args(["--max-grad-norm", "0.5"]).max_grad_norm == 0.5
    assert parser().parse_args([]).max_grad_norm == 1.0
    with pytest.raises(UsageError, match="--max-grad-norm: invalid float value: 'off'"):
        parser().parse_args(["--max-grad-norm", "off"])


@pytest.mark.parametrize("text, match", [
    ("stepz = 3\n", "unknown key 'stepz'; keys are the flags' names: .*steps"),
    ("reuse-weights = 'yes'\n", "--reuse-weights: expected no value or one of 'host'"),
    ("prefetch-depth = 'foo'\n", "--prefetch-depth: expected a number of slots or 'resident'"),
    ("no-reuse-weights = 'yes'\n", "--no-reuse-weights takes true or false"),
    ("steps = 'many'\n", "--steps: invalid int value: 'many'"),
    ("dtype = 'float64'\n", "--dtype: invalid choice: 'float64'"),
    ("steps = \n", "--config .*run.toml: "),
    ("config = 'other.toml'\n", "unknown key 'config'"),
])
def test_config_file_errors_name_the_key(tmp_path, text, match):
    file = tmp_path / "run.toml"
    file.write_text(text)
    with pytest.raises(UsageError) as e:
        parser().parse_args(["--config", str(file)])
    assert re.search(match, str(e.value))


@pytest.mark.parametrize("field", ["n_heads", "n_kv_heads", "hidden", "n_layers"])
def test_a_llama_config_with_a_zero_size_is_refused_naming_it(tmp_path, field):
    file = tmp_path / "llama.json"
    file.write_text(json.dumps({field: 0}))
    with pytest.raises(ValueError, match=rf"llama.json: {field} must be a whole number >= 1, got 0"):
        models.check(str(file))


def test_model_specs(tmp_path):
    assert models.check("tiny") == "preset"
    cfg_file = tmp_path / "llama.json"
    cfg_file.write_text(json.dumps({"hidden": 48, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2}))
    assert models.check(str(cfg_file)) == "llama-json"
    parts = models.load(str(cfg_file), seed=1, vocab_size=300)
    assert len(parts.blocks) == 3 and parts.vocab_size == 300 and parts.embed.weight.shape == (300, 48)
    assert all(p.is_meta for b in parts.blocks for p in b.parameters())
    cfg_file.write_text(json.dumps({"hiddden": 48}))
    with pytest.raises(ValueError, match=r"unknown LlamaConfig fields \['hiddden'\]"):
        models.check(str(cfg_file))
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        models.check(str(tmp_path / "dir"))
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path / "dir")
    assert models.check(str(tmp_path / "dir")) == "hf-dir"
    assert models.check(str(tmp_path / "dir" / "config.json")) == "hf-json"
    assert "random init, seed 5" in models.load(str(tmp_path / "dir"), seed=5).description


def test_metrics_writer_and_tensorboard(tmp_path, monkeypatch):
    w = MetricsWriter(tmp_path / "sub" / "m.jsonl")
    w.write({"step": 1, "loss": 2.5, "peak_memory": [{"host": 10}, {"host": 12}]})
    w.write({"step": 2, "loss": 2.0})
    w.close()
    lines = [json.loads(x) for x in (tmp_path / "sub" / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and lines[0]["peak_memory"][1]["host"] == 12
    assert _flatten({"step": 1, "a": {"b": [3, 4]}, "s": "x", "f": True}) == [("step", 1.0), ("a/b/0", 3.0),
                                                                              ("a/b/1", 4.0)]
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        check_tensorboard()


def test_train_end_to_end_with_config_validation_metrics_and_export(tmp_path):
    """A short local 2x2 run of the built-in model: the summary, one metrics record per step with
    every rank's peak memory, validation losses equal to an independent evaluation of the
    checkpointed model, and an export that transformers loads and that computes its logits."""
    config = tmp_path / "run.toml"
    config.write_text('model = "micro"\nsteps = 3\nseq-len = 24\nmicro-batch-size = 2\nval-every = 2\nval-batches = 2\n'
                      'prefetch-depth = "resident"\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "tawpipe", "train", "--config", str(config), "--layers", "5", "--seed", "3",
           "--mb-per-fetch", "2", "--reuse-weights",  # exact like the defaults
           "--metrics", str(tmp_path / "m.jsonl"), "--save", str(tmp_path / "ckpt")]
    has_hf = importlib.util.find_spec("transformers") is not None
    if has_hf:
        cmd += ["--export", str(tmp_path / "hf")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for line in ("data: python", "vocabulary 256", "model: built-in LLaMA (5 layers", "seed 3",
                 "topology: 2 node(s) x 2 rank(s) = 4 ranks, chunks of [2, 1, 1, 1] layers", "compute float32",
                 "schedule: tawpipe, gradient route rail, prefetch depth 3 (resident), 2 micro-batch(es) per fetch, "
                 "resident chunks reused, gradients travel in float32",
                 "memory per rank (rank 0), allocated: master", "validation loss: step 2"):
        assert line in text, line
    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [("val_loss" in r) for r in records] == [False, True, True]
    assert [r["lr"] for r in records] == pytest.approx([3e-3 * s / 5 for s in (1, 2, 3)])  # the rate each stepped at
    for r in records:
        assert r["tokens"] == r["step"] * 4 * 2 * 2 * 24 and r["tokens_per_s"] > 0
        assert len(r["peak_memory"]) == 4 and all(m["host"] > 50 * 2**20 for m in r["peak_memory"])
        assert len(r["bytes_per_iter"]["inter_node"]) == 4 and r["bytes_per_iter"]["inter_node"][0] > 0
    # The last validation loss, recomputed without tawpipe from the saved final weights.
    cfg = LlamaConfig(**checkpoint.read_manifest(tmp_path / "ckpt")["meta"]["model"])
    assert (cfg.n_layers, cfg.max_seq_len, cfg.vocab_size) == (5, 24, 256)
    model = Llama(cfg)
    model.load_state_dict(checkpoint.consolidated(tmp_path / "ckpt"))
    val = load_tokens(None).val
    with torch.no_grad():
        losses = [llama_loss(model(x), y).item()
                  for x, y in (batch(val, 24, 2, seed=3, step=0, index=i) for i in range(4 * 2))]
    assert records[-1]["val_loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
    if has_hf:
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
        x = torch.randint(0, 256, (2, 24))
        with torch.no_grad():
            torch.testing.assert_close(exported(x).logits, model(x), rtol=0, atol=2e-5)


def test_sigterm_saves_at_a_step_boundary_and_the_resume_is_bit_exact(runs, tmp_path) -> None:
    """Preemption: SIGTERM to a run with --save stops every rank at the same step boundary, saves a
    checkpoint there, exits 143 saying so; resuming from it ends exactly where an uninterrupted
    run of the same 16 steps ends."""
    import signal as sig

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    metrics = tmp_path / "m.jsonl"
    steps = [*SMALL, "--steps", "16", "--data", str(runs["data"])]
    proc = subprocess.Popen([sys.executable, "-m", "tawpipe", "train", *steps, "--save", str(tmp_path / "ck"),
                             "--metrics", str(metrics)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(sig.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig.SIGTERM, err
    stopped = int(re.search(r"stopped on request after step (\d+) of 16; checkpoint: ", err)[1])
    assert 1 <= stopped < 16 and "Traceback" not in err, err
    saved = tmp_path / "ck" / f"step-{stopped:08d}"
    assert (saved / "manifest.json").is_file()
    resumed = _tawpipe("train", *steps, "--save", str(tmp_path / "resumed"), "--resume", str(saved))
    straight = _tawpipe("train", *steps, "--save", str(tmp_path / "straight"))
    assert resumed.returncode == 0 and straight.returncode == 0, resumed.stderr + straight.stderr
    for a, b in zip(_shards(tmp_path / "straight" / "step-00000016"), _shards(tmp_path / "resumed" / "step-00000016")):
        assert _equal(a["params"], b["params"]) and _equal(a["optimizer"], b["optimizer"])


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_under_torchrun_every_rank_of_a_run_stopped_on_request_exits_nonzero(monkeypatch, capsys, rank) -> None:
    """A job stopped on request (torchrun's SIGINT or SIGTERM on one node) stops every rank at the
    same step; every rank's exit status says so, not rank 0's alone: the other node's torchrun
    exited 0 for a 2-node job stopped at step 1 of 400, as if it had finished."""
    result = {"stopped_at": 1, "losses": [5.0], "steps_run": 1, "seconds": 1.0, "tokens_per_step": 64,
              "skipped": 0, "skipped_total": 0, "val_losses": {}, "memory": "-"}
    stub = argparse.Namespace(get_rank=lambda: rank, destroy_process_group=lambda: None)
    monkeypatch.setattr(job, "under_torchrun", lambda: True)
    monkeypatch.setattr(job, "init_distributed", lambda: torch.device("cpu"))
    monkeypatch.setattr(job, "dist", stub)
    monkeypatch.setattr(job, "train_rank", lambda *a: dict(result))
    monkeypatch.setattr(job.Topology, "from_env", staticmethod(lambda: Topology(2, 2)))
    cfg = job.TrainConfig(steps=400)
    pre = argparse.Namespace(resumed_from=None, memory="memory", auto=None)
    assert job._run(cfg, pre) == 128 + 15
    assert "stopped on request after step 1 of 400" in capsys.readouterr().err
    result["stopped_at"] = None  # a run that ends at its last step: 0 on every rank
    assert job._run(cfg, pre) == 0


def _torchrun_env(monkeypatch, world: int, local: int) -> None:
    """This process as rank 0 of a torchrun job of world / local nodes x local ranks."""
    for name, value in dict(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(local),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("given, named", [(("--nodes", "2", "--per-node", "2"), "--nodes 2 --per-node 2"),
                                          (("--per-node", "2"), "--per-node 2")])
def test_under_torchrun_a_shape_given_that_differs_from_the_jobs_is_refused(monkeypatch, capsys, given, named) -> None:
    """torchrun sets the shape: --nodes 2 --per-node 2 on a job of 1 x 3 trained 1 x 3 without a word,
    and the checkpoints recorded 2 x 2."""
    _no_workers(monkeypatch)
    _torchrun_env(monkeypatch, 3, 3)
    assert SMALL[2:6] == ["--nodes", "1", "--per-node", "2"]
    assert refused(capsys, "train", *SMALL[:2], *SMALL[6:], *given) == (
        f"tawpipe train: {named} differ(s) from this torchrun job of 1 node(s) x 3 rank(s) (its --nnodes and "
        "--nproc-per-node, which set the shape): leave --nodes and --per-node out under torchrun, or start torchrun "
        "with the shape you meant")


@pytest.mark.parametrize("given", [(), ("--per-node", "3"), ("--nodes", "1", "--per-node", "3")])
def test_under_torchrun_the_configuration_takes_the_jobs_shape(monkeypatch, given) -> None:
    """The shape the checkpoints' manifests record and a resume compares is the job's, whatever of it
    the flags repeat (it was the flags' defaults, 2 x 2, on a job of 1 x 3)."""
    _torchrun_env(monkeypatch, 3, 3)
    p = parser()
    argv = ["--model", "micro", "--seq-len", "32", "--micro-batch-size", "2", "--steps", "2", *given]
    cfg, _ = job._config(p.parse_args(argv))
    assert (cfg.nodes, cfg.per_node) == (1, 3)
    local = job.TrainConfig.from_args(p.parse_args([]))
    assert (local.nodes, local.per_node) == (2, 2)  # the local emulated cluster's defaults


def test_a_rank_started_without_torchruns_rendezvous_address_is_refused_in_one_line(monkeypatch, capsys) -> None:
    """RANK and WORLD_SIZE set by hand without MASTER_ADDR and MASTER_PORT: one line and exit 2
    before any worker (it was init_distributed's RuntimeError traceback, after the data was read)."""
    _no_workers(monkeypatch)
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert refused(capsys, "train", *SMALL) == (
        "tawpipe train: RANK and WORLD_SIZE are set but MASTER_ADDR and MASTER_PORT not: start the ranks with "
        "torchrun, which sets them all, or unset RANK and WORLD_SIZE for a local emulated cluster")
