"""`tawpipe train` around a real 2-rank CPU run: --resume checks every shard before any worker
starts (a damaged, truncated, missing or other step's shard; a manifest without its file list)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tawpipe.io import checkpoint
from tawpipe.io.checkpoint import CheckpointError

from test_preflight import _tawpipe, refused

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
