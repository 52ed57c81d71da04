"""`tawpipe train` around a real 2-rank CPU run: --resume checks every shard before any worker
starts (a damaged, truncated, missing or other step's shard; a manifest without its file list),
--save admits one run at a time (a lock held by the launcher, taken over once its holder died),
and the progress a run writes into a log."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tawpipe import cli
from tawpipe.io import checkpoint
from tawpipe.io.checkpoint import CheckpointError
from tawpipe.runtime.launch import JobFailed
from tawpipe.train import job

from test_preflight import _tawpipe, refused

UNITS = {"B": 1, "kB": 1e3, "MB": 1e6}  # as the bar and the auto line print bytes

ROOT = Path(__file__).resolve().parent.parent
# 2 nodes of 1 rank: every byte rank 0 sends goes to the other node
ARGS = ["--model", "micro", "--nodes", "2", "--per-node", "1", "--seq-len", "32", "--micro-batch-size", "2",
        "--warmup", "2", "--val-every", "0"]
LAST, PREVIOUS = "step-00000004", "step-00000002"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """4 steps, checkpoints at steps 2 and 4, a metrics record per step."""
    tmp = tmp_path_factory.mktemp("run")
    data = tmp / "data.txt"
    data.write_bytes((ROOT / "tawpipe" / "plan" / "plan.py").read_bytes())  # any text: bytes are the tokens
    out = _tawpipe("train", *ARGS, "--steps", "4", "--data", str(data), "--save", str(tmp / "ckpt"),
                   "--save-every", "2", "--metrics", str(tmp / "m.jsonl"))
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(x) for x in (tmp / "m.jsonl").read_text().splitlines()]
    return {"root": tmp / "ckpt", "out": out, "records": records}


def _copy(run: dict, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run["root"], tmp_path / "ckpt"))


# ------------------------------------------------------------------------------------ --resume


def _break(root: Path, how: str) -> None:
    d = root / LAST
    shard, manifest = d / "rank-00001.pt", json.loads((d / "manifest.json").read_text())
    if how == "flipped byte":
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif how == "missing":
        shard.unlink()
    elif how == "another step's":
        shutil.copy(root / PREVIOUS / shard.name, shard)
    else:
        if how == "no file list":
            del manifest["files"]
        else:  # "file list of another shape"
            manifest["files"] = sorted(manifest["files"])
        (d / "manifest.json").write_text(json.dumps(manifest))


DAMAGE = [
    ("flipped byte", "{shard} is corrupt: its SHA-256 differs from the manifest's"),
    ("truncated", "{shard} is truncated: it has 1,000 bytes, the manifest records {size:,}"),
    ("missing", "{shard} is missing (the manifest lists it)"),
    ("another step's", "{shard} is from step 2 but its manifest is of step 4: mixed steps, refusing to load"),
    ("no file list", "{manifest} is damaged: it has no 'files' (the list of shards)"),
    ("file list of another shape", "{manifest} is damaged: its 'files' is list ['rank-00000.pt', 'rank-00001.pt'], "
                                   "not dict"),
]


@pytest.mark.parametrize("how, problem", DAMAGE, ids=[how for how, _ in DAMAGE])
def test_a_damaged_checkpoint_is_refused_before_any_worker(run, tmp_path, monkeypatch, capsys, how, problem) -> None:
    """Resuming from the root, i.e. its latest step: one line that names the file, what is wrong
    and the previous step to resume from, within seconds; the loader itself says the same."""
    root = _copy(run, tmp_path)
    size = (root / LAST / "rank-00001.pt").stat().st_size
    _break(root, how)
    t0 = time.monotonic()
    err = refused(monkeypatch, capsys, *ARGS, "--steps", "6", "--resume", str(root))
    seconds = time.monotonic() - t0
    expected = (problem.format(shard=root / LAST / "rank-00001.pt", manifest=root / LAST / "manifest.json", size=size)
                + f"; resume from the previous checkpoint, {root / PREVIOUS}, or restore {LAST} from a copy")
    assert err == f"tawpipe train: {expected}"
    assert seconds < 10  # the workers' start alone took longer: the refusal came 10.6 s after it
    with pytest.raises(CheckpointError) as loading:  # restore's check of a shard is the same one
        checkpoint.consolidated(root)
    assert str(loading.value) == expected


def test_without_an_earlier_step_the_message_says_so(run, tmp_path, monkeypatch, capsys) -> None:
    d = _copy(run, tmp_path) / PREVIOUS
    (d / "rank-00000.pt").unlink()
    err = refused(monkeypatch, capsys, *ARGS, "--steps", "6", "--resume", str(d))
    assert err == (f"tawpipe train: {d / 'rank-00000.pt'} is missing (the manifest lists it); restore {d} from a "
                   "copy (there is no earlier checkpoint beside it)")


def test_an_intact_checkpoint_passes_the_check(run) -> None:
    assert checkpoint.verify(run["root"])["step"] == 4  # the latest
    assert checkpoint.verify(run["root"] / PREVIOUS)["step"] == 2


# ------------------------------------------------------------------------------------ --save


def _held_by(lock: Path) -> dict:
    try:
        return json.loads(lock.read_text())
    except (OSError, ValueError):
        return {}


def test_a_second_run_saving_into_the_same_directory_is_refused(run, tmp_path, monkeypatch, capsys) -> None:
    """A real run holds its --save directory from before its workers start: a second run is
    refused in one line naming the holder. Killed (SIGKILL), its lock is taken over at once."""
    save = tmp_path / "ckpt"
    lock = save / checkpoint.LOCK
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    first = subprocess.Popen([sys.executable, "-m", "tawpipe", "train", *ARGS, "--steps", "100000", "--save", str(save)],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while _held_by(lock).get("pid") != first.pid:  # the launcher's own pid: not a worker's
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not take the lock"
            time.sleep(0.05)
        err = refused(monkeypatch, capsys, *ARGS, "--save", str(save))
        assert err == (f"tawpipe train: --save {save}: {lock} is held by pid {first.pid} on host "
                       f"{socket.gethostname()} (since {_held_by(lock)['since']}): another run saves its checkpoints "
                       "there; two runs saving into one directory delete each other's files: wait for that run to "
                       "end (or stop it), or save this run into another directory")
    finally:
        first.kill()  # a crash: the lock file stays, naming a dead process
        first.wait()
    assert _held_by(lock)["pid"] == first.pid
    with checkpoint.hold(save):
        assert _held_by(lock)["pid"] == os.getpid()
        with pytest.raises(checkpoint.RootBusy, match=f"is held by pid {os.getpid()} on host "):
            checkpoint.hold(save)  # one holder at a time, in one process too
    assert not lock.exists()
    assert not (run["root"] / checkpoint.LOCK).exists()  # a run that ended left none either


@pytest.mark.parametrize("ending, code", [(KeyboardInterrupt(), 130),
                                          (JobFailed("rank 1 failed: RuntimeError: boom", 1, "failed"), 1)])
def test_the_lock_is_held_while_the_workers_run_and_released_however_they_end(tmp_path, monkeypatch, ending,
                                                                              code) -> None:
    save = tmp_path / "ckpt"

    def workers(*args, **kwargs):
        with pytest.raises(checkpoint.RootBusy, match=f"is held by pid {os.getpid()} "):
            checkpoint.hold(save)
        raise ending

    monkeypatch.setattr(job, "run_local", workers)
    assert cli.main(["train", *ARGS, "--save", str(save)]) == code
    assert not (save / checkpoint.LOCK).exists()
    checkpoint.hold(save).release()


def test_a_file_system_without_locks_is_said_and_the_run_goes_on(tmp_path, monkeypatch) -> None:
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(RuntimeWarning, match=r"cannot lock .*\.tawpipe\.lock \(No locks available\): this file "
                                            r"system has no locks, so nothing keeps another run from saving"):
        checkpoint.hold(tmp_path).release()


# ------------------------------------------------------------------------------------ the log


def test_a_log_shows_each_step_once_and_the_end_with_its_own_loss(run) -> None:
    """stderr is a pipe here, as a log file: plain lines, the last at 100% with the last loss
    (as the metrics recorded it); the bytes named alike in the bar and in the auto line."""
    err, out, records = run["out"].stderr, run["out"].stdout, run["records"]
    assert "\r" not in err  # no tqdm records
    lines = [line for line in err.splitlines() if line.startswith("tawpipe train: step ")]
    assert [re.match(r"tawpipe train: step (\d+)/4 \(\d+%\), ", line)[1] for line in lines] == ["1", "2", "3", "4"]
    assert err.count("100%") == 1 and "(100%)" in lines[-1]
    intra, inter = records[-1]["bytes_per_iter"]["intra_node"], records[-1]["bytes_per_iter"]["inter_node"]
    for line, record in zip(lines, records):
        assert f"| loss {record['loss']:.3f} |" in line
        sends = re.search(r"rank 0 sends ([\d.]+) (B|kB|MB)/iter inside its node, ([\d.]+) (B|kB|MB)/iter to other "
                          r"nodes$", line)
        assert sends, line
        for value, unit, exact in ((sends[1], sends[2], intra[0]), (sends[3], sends[4], inter[0])):
            assert float(value) * UNITS[unit] == pytest.approx(exact, rel=5e-3, abs=0.5)
    busiest = re.search(r"\nauto: .*\(the busiest node sends ([\d.]+) (B|kB|MB)/iter to other nodes\)", out)
    assert busiest, out
    assert float(busiest[1]) * UNITS[busiest[2]] == pytest.approx(max(inter), rel=5e-3)
