"""`tawpipe train` refuses bad input before any worker starts (one line on stderr, exit status 2):
memory that does not fit, paths it cannot write, damaged Hugging Face weight files, a bad
TAWPIPE_TIMEOUT, an export over its own model; and it says what it did silently before: skipped
steps, a full disk. Resuming with --metrics is covered by test_train_cli (its resume fixture)."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tawpipe import atomic, cli, models
from tawpipe.cost.memory import Savers, rank_memory
from tawpipe.io import checkpoint
from tawpipe.io import safetensors as st_io
from tawpipe.plan.topology import Topology
from tawpipe.runtime.launch import JobFailed
from tawpipe.engine import auto as engine_auto
from tawpipe.train import TrainConfig, job, loop, preflight
from engine_cases import make_engine

from cli_cases import refused as cli_refused
from test_engine_errors import NoComm

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30
FEW = ["--nodes", "1", "--per-node", "2"]


def _no_workers(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(job, "run_local", refuse)
    monkeypatch.setattr(job, "init_distributed", refuse)


def refused(monkeypatch, capsys, *args: str) -> str:
    """Run `tawpipe train ARGS` in-process; it must refuse, before any worker, with exit status 2
    and exactly one line on stderr, which is returned."""
    _no_workers(monkeypatch)
    return cli_refused(capsys, "train", *args)


def _tawpipe(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "tawpipe", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ---------------------------------------------------------------------------------- 1. memory


def test_a_model_that_does_not_fit_in_memory_is_refused(tmp_path, monkeypatch, capsys):
    config = tmp_path / "huge.json"
    config.write_text(json.dumps({"hidden": 131072}))  # ran 17.8 s, then a 64 GiB allocation failed
    err = refused(monkeypatch, capsys, "--model", str(config))
    assert re.match(r"tawpipe train: not enough memory: the run needs about [\d.,]+ TiB for 4 rank\(s\) on this host; "
                    r"per rank up to [\d.,]+ TiB: own chunk .*; [\d.,]+ GiB is available \(.*\): use more machines "
                    r"under torchrun .*a smaller --prefetch-depth or --mb-per-fetch.*--dtype bfloat16", err), err


def _host_has(monkeypatch, available: int) -> None:
    """This host's available memory as the preflight's check and "auto"'s budget read it."""
    for module in (preflight, engine_auto):
        monkeypatch.setattr(module, "host_available", lambda: (available, "MemAvailable in /proc/meminfo"))


def test_what_a_gpu_nodes_ranks_keep_on_the_host_is_held_to_its_memory():
    from tawpipe.cost.memory import MemoryEstimate

    ranks = [MemoryEstimate(persistent=0, staging=0, replicated=0, activations=0, host=10 * GiB)] * 2
    preflight.check_host(ranks, (21 * GiB, "MemAvailable in /proc/meminfo"))
    preflight.check_host(ranks, None)  # nothing known, nothing refused
    with pytest.raises(ValueError, match=r"not enough host memory: this node's 2 rank\(s\) keep about 20\.00 GiB .*"
                                         r"19\.00 GiB is available \(MemAvailable.*--reuse-weights host"):
        preflight.check_host(ranks, (19 * GiB, "MemAvailable in /proc/meminfo"))


def test_paper_4096_is_refused_on_a_24_gib_host(monkeypatch, capsys):
    _host_has(monkeypatch, 24 * GiB)
    err = refused(monkeypatch, capsys, "--model", "paper-4096")
    # 4 ranks of 12 layers: 2.4e9 parameters each, 16 B a parameter (36 GiB), 6 float32 staging buffers (54 GiB)
    assert re.search(r"needs about 36\d\.\d\d GiB for 4 rank\(s\) on this host; per rank up to 9\d\.\d\d GiB: "
                     r"own chunk 36\.\d\d GiB .*staging 54\.\d\d GiB.*; 24\.00 GiB is available", err), err


def test_the_default_model_fits_and_the_estimate_is_printed_first(monkeypatch, capsys):
    pre = preflight.validate(TrainConfig())
    assert pre.memory.startswith("memory estimate: ") and "for 4 rank(s) on this host" in pre.memory
    _no_workers(monkeypatch)
    monkeypatch.setattr(job, "run_local", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert cli.main(["train"]) == 130  # the workers' start, stopped at once
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tawpipe train: local emulated cluster")
    estimate, available = pre.memory.rsplit("; ", 1)  # what is available changes from moment to moment
    assert out[1].startswith(f"tawpipe train: {estimate}; ") and available.endswith("available (MemAvailable in "
                                                                                     "/proc/meminfo)")
    # The same check refuses the default model where the host has less than it needs.
    _host_has(monkeypatch, 300 * 2**20)
    with pytest.raises(ValueError, match=r"not enough memory: the run needs about 1\.\d\d GiB .* 300\.0 MiB is "
                                         "available"):
        preflight.validate(TrainConfig())


@pytest.mark.parametrize("recompute", ["chunk", "layer", "block"])
def test_the_estimate_counts_what_the_engine_allocates(recompute):
    """Own chunk, staging buffers (bfloat16 weights, float32 gradients and the scratch: a chunk's,
    or a layer's where the backward runs a layer at a time) and the replicated parameters, exactly
    as the engine of the busiest rank holds them after a step."""
    parts = models.load("micro", seed=0, compute_dtype=torch.bfloat16)
    topo = Topology(1, 1)
    engine = make_engine(parts, topology=topo, micro_batches=2, comm=NoComm(1),
                         compute_dtype=torch.bfloat16, recompute=recompute)
    x = torch.randint(0, 256, (4, 16))
    engine.step((x, x.roll(-1, 1)))
    report = engine.memory_report()
    blocks, embed, head, _ = models.meta_model("micro")
    est = rank_memory(engine.plan, 0, chunk_numel=[sum(p.numel() for b in blocks for p in b.parameters())],
                      replicated_numel=sum({id(p): p.numel() for m in (embed, head) for p in m.parameters()}.values()),
                      weight_bytes=2, grad_bytes=4, scratch_bytes=2,
                      shape=replace(models.PRESETS["micro"], seq=16, micro_batch=2), savers=Savers(recompute))
    assert est.persistent == report.persistent
    assert est.staging == sum(report.staging.values()) and "scratch" in report.staging
    assert est.replicated == 4 * report.replicated  # float32 weights, gradients and two AdamW moments
    engine.close()


@pytest.mark.parametrize("given", [dict(prefetch_depth=1, mb_per_fetch=1, reuse_weights=False),
                                   dict(prefetch_depth="resident", mb_per_fetch=2, reuse_weights=True)])
def test_a_budget_the_given_schedule_exceeds_is_refused(monkeypatch, capsys, given):
    """Every schedule option given and a --memory-budget they do not fit: refused, naming what they
    take (the estimate "auto" weighs) and both ways out, instead of training without a word."""
    assert preflight.validate(TrainConfig(model="micro", **given)).auto is None  # valid, nothing left to choose
    flags = [f"--prefetch-depth={given['prefetch_depth']}", f"--mb-per-fetch={given['mb_per_fetch']}",
             "--reuse-weights" if given["reuse_weights"] else "--no-reuse-weights"]
    err = refused(monkeypatch, capsys, "--model", "micro", "--memory-budget", "0.000001", *flags)
    assert re.fullmatch(r"tawpipe train: schedule: --mb-per-fetch \d, --prefetch-depth \w+, --(no-)?reuse-weights take "
                        r"[\d.]+ MiB per rank, more than 0\.0 MiB per rank \(--memory-budget\): leave them \"auto\" "
                        r"to choose what fits, or give a larger --memory-budget", err), err
    pre = preflight.validate(TrainConfig(model="micro", memory_budget=1.0, **given))  # within a budget they fit: kept
    assert pre.schedule["mb_per_fetch"] == given["mb_per_fetch"] and pre.auto is None


# ---------------------------------------------------------------------------------- 2. paths


@pytest.mark.parametrize("args, message", [
    (["--metrics", "/proc/nope/m.jsonl"], r"--metrics /proc/nope/m.jsonl: cannot create the directory /proc/nope "
                                          r"\(.*\): choose a writable location"),
    (["--save", "/proc/nope"], r"--save /proc/nope: cannot create the directory /proc/nope"),
    (["--export", "/proc/nope/hf"], r"--export /proc/nope/hf: cannot create the directory /proc/nope/hf"),
    (["--metrics", "{file}/m.jsonl"], r"--metrics .*/file/m.jsonl: .*/file exists and is not a directory"),
    (["--metrics", "{dir}"], r"--metrics .*/dir is a directory: name a file"),
])
def test_paths_the_job_writes_are_tried_first(tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    args = [a.format(file=tmp_path / "file", dir=tmp_path / "dir") for a in args]
    assert re.match(f"tawpipe train: {message}", refused(monkeypatch, capsys, *args))


def test_a_writable_metrics_path_is_prepared_and_left_clean(tmp_path):
    metrics = tmp_path / "new" / "m.jsonl"
    preflight.validate(TrainConfig(model="micro", metrics=str(metrics), save=str(tmp_path / "ckpt")))
    assert metrics.parent.is_dir() and not metrics.exists()
    assert {p.name for p in tmp_path.rglob("*")} == {"new", "ckpt"}  # no probe left behind


def test_a_save_that_cannot_fit_on_its_disk_is_refused(tmp_path, monkeypatch, capsys):
    class Full:
        f_bavail, f_frsize = 100, 4096

    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: Full() if str(p).startswith(str(tmp_path)) else real(p))
    err = refused(monkeypatch, capsys, "--model", "micro", "--save", str(tmp_path / "ckpt"))
    assert err == (f"tawpipe train: --save {tmp_path / 'ckpt'}: no space left on device for it: 0.4 MiB free, the save "
                   f"takes about 2.4 MiB: free space there, or point --save at a file system with room")


def test_tensorboard_without_its_package_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    err = refused(monkeypatch, capsys, "--tensorboard", "/tmp/tb")
    assert err == "tawpipe train: --tensorboard needs the tensorboard package: pip install tensorboard"


# ---------------------------------------------------------------------------------- 3. HF weights


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A small LLaMA saved three ways: one file, sharded (index + 3 files), and as .bin."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    transformers.logging.set_verbosity_error()
    tmp = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=56, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp / "single")
    model.save_pretrained(tmp / "sharded", max_shard_size="60KB")
    model.save_pretrained(tmp / "bin")
    (tmp / "bin" / "model.safetensors").unlink()  # transformers 5 writes .bin files no more: as an older one did
    torch.save(model.state_dict(), tmp / "bin" / "pytorch_model.bin")
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(tmp / "nan")
    return tmp


def _copy(hf_dirs: Path, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(hf_dirs / name, tmp_path / name))


def _index(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def test_a_good_hf_directory_passes_reading_headers_only(hf_dirs, tmp_path, monkeypatch):
    from tawpipe.models.weights import SafetensorsCheckpoint

    def no_tensors(*args, **kwargs):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(SafetensorsCheckpoint, "read", no_tensors)
    assert len(set(_index(hf_dirs / "sharded")["weight_map"].values())) >= 3
    for name in ("single", "sharded"):
        preflight.validate(TrainConfig(model=str(hf_dirs / name), nodes=1, per_node=2))


def _break(d: Path, how: str) -> None:
    if how == "missing shard":
        next(d.glob("model-00002-of-*.safetensors")).unlink()
    elif how == "index names an absent file":
        index = _index(d)
        index["weight_map"]["model.norm.weight"] = "model-99.safetensors"
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how == "index points outside":
        (d.parent / "other").mkdir()
        shutil.copy(next(d.glob("model-00001-of-*")), d.parent / "other" / "model.safetensors")
        index = _index(d)
        index["weight_map"] = {k: "../other/model.safetensors" if v.startswith("model-00001-") else v
                               for k, v in index["weight_map"].items()}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how == "shards without index":
        (d / "model.safetensors.index.json").unlink()
    elif how == "truncated":
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "garbage":
        (d / "model.safetensors").write_bytes(os.urandom(5000))
    elif how == "garbage header":
        (d / "model.safetensors").write_bytes((200).to_bytes(8, "little") + b"{not json" + bytes(300))
    elif how in ("shape mismatch", "fewer layers"):
        config = json.loads((d / "config.json").read_text())
        config.update({"intermediate_size": 64} if how == "shape mismatch" else {"num_hidden_layers": 2})
        (d / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("source, how, message", [
    ("sharded", "missing shard", r"model.safetensors.index.json names 1 shard\(s\) that do not exist in .*: "
                                 r"model-00002-of-0000\d.safetensors: copy the missing file\(s\) there"),
    ("sharded", "index names an absent file", r"names 1 shard\(s\) that do not exist in .*: model-99.safetensors"),
    ("sharded", "index points outside", r"model.safetensors.index.json names '../other/model.safetensors', outside "
                                        r"the model's directory: refusing to read it"),
    ("sharded", "shards without index", r"holds model-00001-of-0000\d.safetensors, model-00002-of-0000\d.safetensors, "
                                        r"... but neither model.safetensors nor model.safetensors.index.json"),
    ("single", "truncated", r".*/single/model.safetensors is not a complete safetensors file \(truncated: its tensors "
                            r"take [\d,]+ bytes after the header, the file holds [\d,]+\): the file is damaged"),
    ("single", "garbage", r".*/single/model.safetensors is not a complete safetensors file \(its first 8 bytes give a "
                          r"[\d,]+-byte header; the file has 5,000 bytes\)"),
    ("single", "garbage header", r".*/model.safetensors is not a complete safetensors file \(its header is not JSON\)"),
    ("single", "shape mismatch", r"12 tensors have other shapes than the config says, e.g. "
                                 r"model.layers.0.mlp.down_proj.weight is \(32, 56\), expected \(32, 64\): the config "
                                 r"and the weights disagree; use the config.json saved with these weights"),
    ("single", "fewer layers", r"holds weights of 4 layers \(model.layers.0 to model.layers.3\) but its config.json "
                               r"builds 2: training would drop layers 2-3; set num_hidden_layers to 4 in config.json"),
    ("bin", None, r"holds PyTorch .bin weights \(pytorch_model.bin\); tawpipe reads safetensors only: convert them "
                  r"once with transformers, .*save_pretrained\('.*', safe_serialization=True\)"),
])
def test_bad_hf_weight_files_are_refused_up_front(hf_dirs, tmp_path, monkeypatch, capsys, source, how, message):
    d = _copy(hf_dirs, source, tmp_path)
    _break(d, how)
    err = refused(monkeypatch, capsys, "--model", str(d), *FEW)
    assert re.match(f"tawpipe train: --model {re.escape(str(d))}: .*{message}", err), err


# ---------------------------------------------------------------------------------- 4. TAWPIPE_TIMEOUT


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-5", "0"])
def test_a_bad_timeout_is_refused_before_the_workers(monkeypatch, capsys, value):
    monkeypatch.setenv("TAWPIPE_TIMEOUT", value)
    err = refused(monkeypatch, capsys, "--model", "micro")
    assert err == (f"tawpipe train: TAWPIPE_TIMEOUT={value!r} is not a number of seconds > 0: set it to e.g. 300, "
                   "or unset it")


# ---------------------------------------------------------------------------------- 5. export


def test_an_export_over_its_own_model_is_refused(hf_dirs, tmp_path, monkeypatch, capsys):
    d = _copy(hf_dirs, "single", tmp_path)
    for export in (str(d), str(d) + "/", str(d / ".." / "single")):
        err = refused(monkeypatch, capsys, "--model", str(d), "--export", export, *FEW)
        assert err == (f"tawpipe train: --export {export} is the directory of --model {d}: the export would replace "
                       "the weights and config the run starts from; export to another directory")
    err = refused(monkeypatch, capsys, "--model", str(d / "config.json"), "--export", str(d), *FEW)
    assert "is the directory of --model" in err


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_follow_the_umask_like_checkpoint_shards(tmp_path, umask):
    old = os.umask(umask)
    try:
        st_io._write(tmp_path / "model.safetensors", {"a": torch.ones(3)}, torch.float32)
        atomic.write_atomic(tmp_path / "index.json", "{}", ".json")  # how the index is written
        checkpoint.save_atomic({"a": 1}, tmp_path / "shard.pt")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys(["model.safetensors", "index.json", "shard.pt"], 0o666 & ~umask)


# ---------------------------------------------------------------------------------- 6. skipped steps


def test_skipped_steps_are_reported_and_a_run_of_them_stops(tmp_path):
    """--lr 1e8 in float16: the first step trains, every later one has a NaN loss and is skipped."""
    args = ["train", "--model", "micro", *FEW, "--seq-len", "32", "--micro-batch-size", "2", "--lr", "1e8", "--dtype",
            "float16", "--val-every", "0"]
    out = _tawpipe(*args, "--steps", "4", "--max-skipped-in-a-row", "0", "--metrics", str(tmp_path / "m.jsonl"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "; 3 of them skipped (loss or gradients not finite)" in out.stdout
    assert "| skipped 3 |" in out.stderr  # the progress line
    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records] == [0, 1, 2, 3] and math.isnan(records[-1]["loss"])
    out = _tawpipe(*args, "--steps", "8", "--max-skipped-in-a-row", "3")
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == (
        "tawpipe train: rank 0: step 4: the last 3 steps were skipped, their loss (last: nan) or gradients not finite, "
        "so nothing is being trained: lower --lr, use --dtype float32 or bfloat16 rather than float16, or check the "
        "model's weights for NaN/Inf (--max-skipped-in-a-row 0 lets the run go on; now 3)")
    assert "Traceback" not in out.stderr


def test_a_model_with_nan_weights_does_not_train_with_exit_0(hf_dirs):
    out = _tawpipe("train", "--model", str(hf_dirs / "nan"), "--nodes", "1", "--per-node", "1", "--steps", "3",
                   "--seq-len", "16", "--micro-batch-size", "2", "--val-every", "0")
    assert out.returncode == 1, out.stderr[-2000:]
    assert re.fullmatch(r"tawpipe train: rank 0: step 3: all 3 steps of this run were skipped, their loss "
                        r"\(last: nan\) or gradients not finite, so nothing is being trained: .*",
                        out.stderr.splitlines()[-1])


def test_the_skipped_step_check():
    cfg = TrainConfig(steps=20, max_skipped_in_a_row=10)
    loop._check_skipped(cfg, 9, 9, 9, math.nan)  # not yet
    with pytest.raises(loop.TrainError, match="step 10: all 10 steps of this run were skipped"):
        loop._check_skipped(cfg, 10, 10, 10, math.nan)
    with pytest.raises(loop.TrainError, match="step 15: the last 10 steps were skipped"):
        loop._check_skipped(cfg, 10, 15, 15, math.nan)
    loop._check_skipped(cfg, 3, 20, 20, 1.0)  # a finished run with a few skipped at the end
    with pytest.raises(loop.TrainError, match="step 20: all 4 steps of this run"):  # resumed at 16, all skipped
        loop._check_skipped(cfg, 4, 4, 20, math.nan)
    loop._check_skipped(TrainConfig(steps=20, max_skipped_in_a_row=0), 20, 20, 20, math.nan)


def test_the_checks_build_the_model_on_meta_without_initialising_it() -> None:
    """``models.meta_model`` leaves meta tensors uninitialised: torch runs a meta tensor's random
    fill through Python references that import torch._dynamo, 2.5 s of the 2.6 s `tawpipe train`'s
    checks took. Its shapes are still the real model's."""
    code = ("import sys; from tawpipe import models; from tawpipe.models.parts import parts_signature\n"
            "blocks, embed, head, vocab = models.meta_model('tiny', layers=3)\n"
            "assert 'torch._dynamo' not in sys.modules, 'meta_model imported torch._dynamo'\n"
            "assert all(p.is_meta for m in (*blocks, embed, head) for p in m.parameters())\n"
            "real = models.load('tiny', seed=1, layers=3)\n"
            "assert parts_signature(blocks, embed, head) == parts_signature(real.blocks, real.embed, real.head)\n"
            "assert vocab == real.vocab_size and len(blocks) == 3\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------- 8. a full disk


def _full_disk(monkeypatch, after: int = 1000) -> None:
    """The checkpoint writer's file fails as a full disk does, after ``after`` bytes."""
    write = atomic._Hashing.write

    def full(self, data):
        if self.size + len(data) > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, data)

    monkeypatch.setattr(atomic._Hashing, "write", full)


def test_a_full_disk_while_saving_is_named_in_one_line(tmp_path, monkeypatch):
    parts = models.load("micro", seed=0)
    engine = make_engine(parts, topology=Topology(1, 1), micro_batches=1, comm=NoComm(1))
    cfg = TrainConfig(model="micro", save=str(tmp_path / "ckpt"))
    _full_disk(monkeypatch)
    with pytest.raises(loop.TrainError) as e:
        loop._save(engine, cfg, parts, [], 0, torch.device("cpu"))
    engine.close()
    assert str(e.value) == (f"no space left on device: could not write {tmp_path / 'ckpt' / 'step-00000000'} (--save): "
                            "free space there, or point --save at a file system with room")
    assert "unexpected pos" in str(e.value.__cause__)  # what torch said, kept as the cause
    assert not list((tmp_path / "ckpt").rglob(".tmp-*"))


def test_a_failed_run_of_ours_is_one_line(monkeypatch, capsys):
    line = "no space left on device: could not write /x/step-00000006 (--save): free space there, or ..."
    failure = JobFailed(f"rank 2 failed: TrainError: {line}", 2, "failed",
                        "traceback of rank 2:\nTraceback (most recent call last):\n  ...\n")
    monkeypatch.setattr(job, "run_local", lambda *a, **k: (_ for _ in ()).throw(failure))
    assert cli.main(["train", "--model", "micro"]) == 1
    assert capsys.readouterr().err == f"tawpipe train: rank 2: {line}\n"
    other = JobFailed("rank 1 failed: RuntimeError: boom", 1, "failed", "traceback of rank 1:\n...")
    monkeypatch.setattr(job, "run_local", lambda *a, **k: (_ for _ in ()).throw(other))
    assert cli.main(["train", "--model", "micro"]) == 1
    assert "traceback of rank 1" in capsys.readouterr().err  # any other failure keeps its traceback
