"""Checkpoints: layout and manifest, exact round trips, and the checkpoints that must be refused.

A world of one (no process group) covers the file format; re-sharding across topologies runs
through the CLI's multi-rank checkpoints in test_train_cli.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from engine_cases import TinyLM, global_batch, lm_loss, make_engine
from tawpipe.io import checkpoint
from tawpipe.io.checkpoint import CheckpointError
from tawpipe.engine.engine import TawPipe
from tawpipe.plan.topology import Topology
from test_engine_errors import NoComm


def _engine(seed: int = 0, layers: int = 4, **kw) -> TawPipe:
    torch.manual_seed(seed)
    m = TinyLM(layers)
    return make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=2, comm=NoComm(1),
                       block_context=m.context, **kw)


def _train(engine: TawPipe, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(engine.step(global_batch(engine.steps, 4)))
    return out


def _params(engine: TawPipe) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.named_parameters()}


@pytest.fixture
def saved(tmp_path) -> Path:
    """Checkpoints of one training run at steps 2 and 3."""
    eng = _engine()
    _train(eng, 2)
    checkpoint.save(eng, tmp_path, extra={"rng": torch.get_rng_state(), "position": 2}, meta={"note": "hi"})
    _train(eng, 1)
    checkpoint.save(eng, tmp_path)
    return tmp_path


def test_layout_manifest_and_checksums(saved) -> None:
    assert sorted(p.name for p in saved.iterdir()) == ["step-00000002", "step-00000003"]
    d = saved / "step-00000002"
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "rank-00000.pt"]  # no temporary files
    m = json.loads((d / "manifest.json").read_text())
    assert (m["format"], m["step"], m["topology"], m["meta"]) == ("tawpipe-checkpoint/1", 2, {"nodes": 1, "per_node": 1},
                                                                  {"note": "hi"})
    assert m["tawpipe_version"] and m["torch_version"] == torch.__version__ and len(m["plan_sha256"]) == 64
    assert m["dtypes"] == {"master": "torch.float32", "compute": "torch.float32", "grad_wire": "torch.float32"}
    entry = m["files"]["rank-00000.pt"]
    raw = (d / "rank-00000.pt").read_bytes()
    assert entry == {"rank": 0, "chunk": 0, "replica": 0, "layers": [0, 4], "bytes": len(raw),
                     "sha256": hashlib.sha256(raw).hexdigest()}
    ref = TinyLM(4)  # the signature lists every parameter the model has
    assert m["model"]["num_layers"] == 4
    assert {n for n, _, _ in m["model"]["block"]} == {n for n, _ in ref.blocks[0].named_parameters()}
    shard = torch.load(d / "rank-00000.pt", weights_only=True)
    assert shard["steps"] == 2 and shard["extra"]["position"] == 2
    assert set(shard["params"]) == {n for n, _ in ref.named_parameters()}
    assert set(shard["optimizer"]["state"]) == set(shard["params"])  # keyed by name


def test_restore_is_exact_and_finds_the_latest(saved) -> None:
    ref = _engine()
    _train(ref, 3)
    expected_loss = _train(ref, 1)[0]
    fresh = _engine(seed=123)  # another initialisation: everything must come from the checkpoint
    restored = checkpoint.restore(fresh, saved)  # the root: its latest complete step
    assert (restored.step, restored.resharded, fresh.steps) == (3, False, 3)
    assert _train(fresh, 1)[0] == expected_loss
    for n, p in fresh.named_parameters():
        assert torch.equal(p.detach(), dict(ref.named_parameters())[n].detach()), n
    earlier = checkpoint.restore(_engine(seed=5), saved / "step-00000002")
    assert earlier.step == 2 and earlier.meta == {"note": "hi"} and earlier.extra["position"] == 2
    assert torch.equal(earlier.extra["rng"], torch.load(saved / "step-00000002" / "rank-00000.pt",
                                                        weights_only=True)["extra"]["rng"])


def test_flipped_bytes_are_refused(saved) -> None:
    shard = saved / "step-00000003" / "rank-00000.pt"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    eng = _engine(seed=7)
    before = _params(eng)
    with pytest.raises(CheckpointError, match="rank-00000.pt is corrupt: its SHA-256 differs"):
        checkpoint.restore(eng, saved)
    assert all(torch.equal(p, before[n]) for n, p in _params(eng).items())  # nothing was loaded


def test_mixed_steps_are_refused(saved) -> None:
    shutil.copy(saved / "step-00000002" / "rank-00000.pt", saved / "step-00000003" / "rank-00000.pt")
    with pytest.raises(CheckpointError, match="is from step 2 but its manifest is of step 3: mixed steps"):
        checkpoint.restore(_engine(), saved / "step-00000003")


@pytest.mark.parametrize("kw, message", [
    (dict(layers=6), "different model: it has 4 layers, this model 6"),
])
def test_another_model_is_refused(saved, kw, message) -> None:
    with pytest.raises(CheckpointError, match=message):
        checkpoint.restore(_engine(**kw), saved)


def test_another_block_shape_is_refused(saved, monkeypatch) -> None:
    import engine_cases

    monkeypatch.setattr(engine_cases, "HIDDEN", 20)
    torch.manual_seed(0)
    m = engine_cases.TinyLM(4)
    eng = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=2, comm=NoComm(1))
    with pytest.raises(CheckpointError, match=r"different model: block parameter 'down.bias' is \[\[24\]"):
        checkpoint.restore(eng, saved)


def test_incomplete_steps_are_skipped_or_refused(saved) -> None:
    (saved / "step-00000003" / "manifest.json").unlink()  # a save that died before its manifest
    assert checkpoint.restore(_engine(seed=9), saved).step == 2
    with pytest.raises(CheckpointError, match="incomplete .*interrupted"):
        checkpoint.restore(_engine(), saved / "step-00000003")
    with pytest.raises(CheckpointError, match="no checkpoint at .*nope: not a directory"):
        checkpoint.resolve(saved / "nope")
    (saved / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint under .*empty"):
        checkpoint.resolve(saved / "empty")


def test_stale_temporary_files_are_removed_at_the_next_save(saved, monkeypatch) -> None:
    # what a save killed mid-write leaves behind
    for stale in (saved / ".tmp-abc.pt", saved / "step-00000003" / ".tmp-def.pt"):
        stale.write_bytes(b"x" * 1000)
    eng = _engine()
    _train(eng, 1)

    def disk_full(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[0\] could not write .*No space left"):
        checkpoint.save(eng, saved)
    monkeypatch.undo()
    assert not list(saved.rglob(".tmp-*")), "a temporary file survived"
    assert not (saved / "step-00000001" / "manifest.json").exists()  # the failed step is incomplete
    checkpoint.save(eng, saved)
    assert checkpoint.resolve(saved).name == "step-00000003"
    assert checkpoint.read_manifest(saved / "step-00000001")["step"] == 1


def test_a_failed_engine_is_not_saved(tmp_path) -> None:
    eng = _engine(nonfinite="raise", loss_scale=None,
                  head_loss=lambda head, hidden, targets: lm_loss(head(hidden), targets) * float("nan"))
    with pytest.raises(FloatingPointError):
        _train(eng, 1)
    with pytest.raises(RuntimeError, match="state is unknown"):
        checkpoint.save(eng, tmp_path)
    eng.close()  # closing it does not make its state known again
    with pytest.raises(RuntimeError, match="state is unknown"):
        eng.state_dict()


def test_loss_scale_survives_a_dtype_change(tmp_path) -> None:
    fp32 = _engine()
    _train(fp32, 1)
    checkpoint.save(fp32, tmp_path / "fp32")
    fp16 = _engine(compute_dtype=torch.float16)
    with pytest.warns(UserWarning, match="keeping this engine's scale 65536 rather than the shard's 1"):
        checkpoint.restore(fp16, tmp_path / "fp32")
    assert fp16.precision.scale == 2.0**16 and fp16.steps == 1
    fp16.precision.scale = 1024.0  # e.g. after backoffs: a float16 shard carries its scale over
    checkpoint.save(fp16, tmp_path / "fp16")
    again = _engine(compute_dtype=torch.float16)
    checkpoint.restore(again, tmp_path / "fp16")
    assert again.precision.scale == 1024.0


def test_consolidated_loads_into_a_plain_model(saved) -> None:
    full = checkpoint.consolidated(saved)
    model = TinyLM(4)
    model.load_state_dict(full, strict=True)
    eng = _engine()
    _train(eng, 3)
    for n, p in eng.named_parameters():
        assert torch.equal(full[n], p.detach()), n


def _tensors_of(x) -> list[torch.Tensor]:
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors_of(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors_of(v)]
    return []


def test_a_state_dict_is_a_snapshot_that_later_steps_leave_alone() -> None:
    """The optimizer state of state_dict() was the live optimizer's: the next step moved its
    moments and step count, so rolling back to it redid the step from the wrong moments (0.001
    off in one step). Now it is a copy: equal after later steps, and a rollback is exact."""
    import copy

    eng = _engine()
    _train(eng, 1)
    sd = eng.state_dict()
    kept = copy.deepcopy(sd)
    live = {t.untyped_storage().data_ptr() for t in _tensors_of(eng.optimizer.state_dict())}
    assert not any(t.untyped_storage().data_ptr() in live for t in _tensors_of(sd))
    _train(eng, 1)
    assert _same(sd, kept)
    eng.load_state_dict(sd)  # back to step 1, then step 2 again
    redo = _train(eng, 1)
    ref = _engine()
    assert redo == _train(ref, 2)[1:]
    assert all(torch.equal(p, _params(ref)[n]) for n, p in _params(eng).items())


def test_one_state_dict_loads_into_two_engines_that_share_nothing() -> None:
    """Optimizer.load_state_dict keeps a tensor already on the parameter's device: two engines
    loaded from one dict stepped the same moments, and the dict's. Each engine now keeps copies."""
    import copy

    src = _engine()
    _train(src, 1)
    sd = src.state_dict()
    kept = copy.deepcopy(sd)
    first, second = _engine(seed=1), _engine(seed=2)
    first.load_state_dict(sd)
    second.load_state_dict(sd)
    given = {t.untyped_storage().data_ptr() for t in _tensors_of(sd)}
    for eng in (first, second):
        assert not any(t.untyped_storage().data_ptr() in given for t in _tensors_of(eng.optimizer.state_dict()))
    _train(first, 2)
    assert _same(sd, kept)  # neither the dict ...
    assert _train(second, 1) == _train(src, 1)  # ... nor the other engine moved
    assert all(torch.equal(p, _params(src)[n]) for n, p in _params(second).items())


def test_save_writes_the_live_optimizer_state_without_a_snapshot(tmp_path, monkeypatch) -> None:
    """checkpoint.save writes the shard at once: it takes the optimizer state as it is, with no
    second copy of the moments in memory (state_dict's snapshot), and the file is the same."""
    from tawpipe.engine import shard

    eng = _engine()
    _train(eng, 1)
    monkeypatch.setattr(shard, "snapshot", lambda x: pytest.fail("checkpoint.save copied the optimizer state"))
    checkpoint.save(eng, tmp_path)
    monkeypatch.undo()
    written = torch.load(tmp_path / "step-00000001" / "rank-00000.pt", weights_only=True)
    assert _same({k: v for k, v in written.items() if k != "extra"}, eng.state_dict())


def test_an_extra_that_torch_load_cannot_read_back_is_refused_before_anything_is_written(tmp_path) -> None:
    """A numpy RNG state in ``extra`` saved fine, then restore called the checkpoint "truncated or
    corrupt" (torch.load(weights_only=True) reads no numpy array). save now names the key and the
    type first, on every rank, and writes nothing; so for a meta the manifest cannot hold."""
    import numpy as np

    eng = _engine()
    _train(eng, 1)
    with pytest.raises(CheckpointError, match=r"extra\['np'\]\[1\] is a numpy.ndarray \(Unsupported global: .*\), "
                                              r"which torch.load\(weights_only=True\) does not read back, so restore "
                                              r"would refuse the checkpoint: .*torch.from_numpy\(a\) or a.tolist\(\)"):
        checkpoint.save(eng, tmp_path, extra={"np": np.random.get_state(), "position": 1})
    with pytest.raises(CheckpointError, match=r"extra\['rngs'\]\[0\]\['seed'\] is a numpy.int64"):
        checkpoint.save(eng, tmp_path, extra={"rngs": [{"seed": np.int64(3)}]})
    with pytest.raises(CheckpointError, match=r"meta goes into the JSON manifest, but Object of type Tensor is not "
                                              r"JSON serializable"):
        checkpoint.save(eng, tmp_path, meta={"loss": torch.zeros(())})
    assert not list(tmp_path.iterdir())  # nothing written, not even the step's directory
    extra = {"np": [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in np.random.get_state()]}
    checkpoint.save(eng, tmp_path, extra=extra)  # converted: saved, and restored as it was
    assert _same(checkpoint.restore(_engine(seed=3), tmp_path).extra, extra)


def test_a_shard_holding_an_object_weights_only_refuses_is_named_as_such_not_corrupt(tmp_path, monkeypatch) -> None:
    """A checkpoint written with such an ``extra`` (before save refused it): its shard is intact,
    so restore says what torch refuses and what to do, instead of "truncated or corrupt"."""
    import numpy as np

    eng = _engine()
    _train(eng, 1)
    monkeypatch.setattr(checkpoint, "_unsavable", lambda extra, meta: None, raising=False)
    checkpoint.save(eng, tmp_path, extra={"np": np.zeros(3)})
    with pytest.raises(CheckpointError) as refused:
        checkpoint.restore(_engine(seed=1), tmp_path)
    assert re.search(r"rank-00000.pt holds an object that torch.load\(weights_only=True\) refuses to read "
                     r"\(Unsupported global: GLOBAL numpy.*\): it was written with more than tensors and plain "
                     r"containers .*not damaged. If you trust the file, load it inside "
                     r"`with torch.serialization.safe_globals", str(refused.value)), str(refused.value)
    assert "corrupt" not in str(refused.value)


# ---------------------------------------------------------------- single files (save_atomic, load)


def _object() -> dict:
    """A fresh object with tensors of several dtypes, nested containers and plain values."""
    return {"w": torch.randn(257, 13), "ids": torch.randint(0, 1000, (31,)), "half": torch.randn(40).bfloat16(),
            "steps": int(torch.randint(0, 100, ())), "nested": [{"m": torch.randn(5)}, (1.5, "x", None)]}


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_save_atomic_round_trips_and_still_loads_with_torch_load(tmp_path) -> None:
    obj, path = _object(), tmp_path / "full.pt"
    digest = checkpoint.save_atomic(obj, path)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert _same(checkpoint.load(path), obj)
    raw = torch.load(path, weights_only=True)  # plain containers and tensors: the object and its digest
    assert _same(raw["object"], obj) and raw["sha256"] == checkpoint.content_sha256(obj)


def test_save_atomic_file_with_flipped_bytes_is_refused(tmp_path) -> None:
    obj, path = _object(), tmp_path / "full.pt"
    checkpoint.save_atomic(obj, path)
    raw = bytearray(path.read_bytes())
    start = bytes(raw).find(obj["w"].numpy().tobytes())  # a byte inside a tensor's data: still a readable file
    assert start > 0
    raw[start + int(torch.randint(0, obj["w"].numel() * 4, ()))] ^= 1 << int(torch.randint(0, 8, ()))
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))} is corrupt: the SHA-256 of its content "
                                              r"differs from the one save_atomic stored in it \(flipped bytes\)"):
        checkpoint.load(path)


def test_empty_and_truncated_files_are_named(tmp_path) -> None:
    path = tmp_path / "full.pt"
    checkpoint.save_atomic(_object(), path)
    raw = path.read_bytes()
    path.write_bytes(raw[: int(torch.randint(1, len(raw) - 1, ()))])
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))} cannot be read as a checkpoint: it is "
                                              r"truncated or corrupt"):
        checkpoint.load(path)
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))} is empty \(0 bytes\)"):
        checkpoint.load(path)
    path.write_bytes(bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).tolist()))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))} cannot be read as a checkpoint"):
        checkpoint.load(path)


_CRASH = """
import os, sys, torch
from tawpipe.io import checkpoint

def killed(obj, f):
    f.write(b"partial" * 1000)
    f.flush()
    os._exit(9)  # the process dies mid-write: no cleanup runs

torch.save = killed
checkpoint.save_atomic({"w": torch.zeros(3)}, sys.argv[1])
"""


def test_save_atomic_removes_what_crashed_writes_left_and_only_that(tmp_path) -> None:
    import os
    import subprocess
    import sys

    crashed = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path / "a.pt")], capture_output=True)
    assert crashed.returncode == 9, crashed.stderr.decode()
    left = [p.name for p in tmp_path.glob(".tmp-*")]
    assert len(left) == 1 and not (tmp_path / "a.pt").exists()
    # temporary files of writers that may still be writing: this process, another host, an unknown name
    host = left[0][len(".tmp-"):].rsplit("-", 2)[0]  # the crashed writer's, which is this host
    alive = [f".tmp-{host}-{os.getpid()}-0123.pt", ".tmp-otherhost-1-0123.pt", ".tmp-0123abcd.pt"]
    for name in alive:
        (tmp_path / name).write_bytes(b"x")
    obj = _object()
    checkpoint.save_atomic(obj, tmp_path / "b.pt")
    assert sorted(p.name for p in tmp_path.glob(".tmp-*")) == sorted(alive), "a crashed write's file survived"
    assert _same(checkpoint.load(tmp_path / "b.pt"), obj)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_export_writes_every_weight_in_the_dtype_asked(tmp_path, dtype) -> None:
    """``save_sharded(..., dtype=)`` writes each tensor cast to ``dtype``: the files hold the
    trained parameters as ``p.to(dtype)`` gives them, in that dtype (not the float32 masters)."""
    from safetensors.torch import load_file

    from tawpipe.io.safetensors import save_sharded

    torch.manual_seed(int(torch.randint(0, 10_000, ())))
    model = TinyLM(3)
    eng = make_engine(model.blocks, model.embed, model.head, lm_loss, topology=Topology(1, 1), micro_batches=2,
                      comm=NoComm(1), block_context=model.context)
    eng.step(global_batch(0, 4))
    save_sharded(eng, tmp_path, lambda name: name, dtype=dtype)
    written = {}
    for f in tmp_path.glob("*.safetensors"):
        written.update(load_file(f))
    params = dict(eng.named_parameters())
    assert written.keys() == params.keys()
    for name, p in params.items():
        assert written[name].dtype == dtype, name
        assert torch.equal(written[name], p.detach().to(dtype)), name
    eng.close()
