"""Checkpoints: one directory per step, every rank's shard plus a manifest that vouches for them.

Layout of a checkpoint root::

    ROOT/step-00000006/rank-00000.pt ... rank-00003.pt   one shard per rank (TawPipe.state_dict)
    ROOT/step-00000006/manifest.json                     written last: the checkpoint is complete

The manifest records the step, the topology, the plan's hash and schedule options, the model's
signature (every parameter's name, shape and dtype), the dtypes, the tawpipe and torch versions,
each file's SHA-256 and byte count, and the caller's ``meta`` (JSON). Every file is written
atomically (temporary file, fsync, rename); temporary files a crash left behind are removed at the
next save.

A single file (``save_atomic``, no manifest) vouches for itself: it holds the object together
with the SHA-256 of its content (every tensor's bytes, every key and value), which ``load``
recomputes; ``load`` names the file that is empty, truncated, unreadable or altered.

Shards hold parameters and optimizer state under the model's parameter names, so ``restore``
loads a checkpoint onto any topology: each rank reads the shards that hold its layers (on the same
topology, exactly its own). It refuses a shard that is missing, or whose size, checksum or step
disagrees with the manifest, a manifest that lacks what loading reads, and a model whose signature
differs. ``verify`` makes the same checks of every shard without loading any, before a run starts.
Everything loads with ``torch.load(weights_only=True)``.

One run writes into a root at a time: ``tawpipe train --save`` holds the root's lock
(``hold``: ``ROOT/.tawpipe.lock``) while it runs, and a second run is refused.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import io
import json
import os
import pickle
import re
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..atomic import remove_temporary, write_atomic
from ..version import __version__

if TYPE_CHECKING:
    from ..engine.engine import TawPipe

FORMAT = "tawpipe-checkpoint/1"
MANIFEST = "manifest.json"
CHECKED = "tawpipe-checked/1"  # save_atomic's file: {CHECKED: 1, "sha256": ..., "object": ...}


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, or that must not be loaded."""


class PeerCheckpointError(CheckpointError):
    """Raised on the ranks that did their part when another rank could not: the cause is there."""

    about_a_peer = True  # tawpipe.runtime.launch then names the other rank's error first


def save_atomic(obj: Any, path: str | os.PathLike[str]) -> str:
    """Write ``obj`` to ``path`` atomically (``tawpipe.atomic``: a crash leaves either the old file
    or the new one, never a torn one). Returns its SHA-256.

    The file holds ``obj`` with the SHA-256 of its content, which ``load`` checks (and unwraps)."""
    checked = {CHECKED: 1, "sha256": content_sha256(obj), "object": obj}
    return write_atomic(path, lambda f: torch.save(checked, f), ".pt")[0]


def content_sha256(obj: Any) -> str:
    """The SHA-256 of what a checkpoint object holds: its containers' structure, keys and values,
    and every tensor's dtype, shape and bytes (equal before saving and after loading)."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if torch.is_tensor(x):
            t = x.detach()
            t = (t.to_dense() if t.layout != torch.strided else t).resolve_conj().resolve_neg().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
        elif isinstance(x, dict):
            h.update(f"D{type(x).__name__}{len(x)};".encode())
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, (list, tuple)):
            h.update(f"L{type(x).__name__}{len(x)};".encode())
            for v in x:
                walk(v)
        elif isinstance(x, (set, frozenset)):
            h.update(f"S{type(x).__name__}{sorted(repr(v) for v in x)};".encode())
        else:
            r = repr(x)
            h.update(f"V{type(x).__name__}{len(r)}:{r};".encode())

    walk(obj)
    return h.hexdigest()


def load(path: str | os.PathLike[str]) -> Any:
    """Load a tawpipe checkpoint file; only tensors and plain containers are accepted.

    A file of ``save_atomic`` is checked against the SHA-256 it holds, and its object returned.
    CheckpointError names a file that is empty, truncated, unreadable or altered."""
    path = os.fspath(path)
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{path} is empty (0 bytes): its write never completed (or a copy failed); "
                              "use another copy or an earlier checkpoint")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not (refused := _weights_only_refusal(e)):
            raise CheckpointError(f"{path} cannot be read as a checkpoint: it is truncated or corrupt "
                                  f"(UnpicklingError: {str(e)[:200]}); use another copy or an earlier checkpoint") from e
        raise CheckpointError(
            f"{path} holds an object that torch.load(weights_only=True) refuses to read ({refused}): it was "
            "written with more than tensors and plain containers (say, a numpy array in checkpoint.save's extra, "
            "which save now refuses), not damaged. If you trust the file, load it inside "
            "`with torch.serialization.safe_globals([...]):` naming that class; else use an earlier checkpoint"
        ) from e
    except Exception as e:  # noqa: BLE001 - torch reports a torn file in many ways
        cause = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:200]  # torch's first sentence
        raise CheckpointError(
            f"{path} cannot be read as a checkpoint: it is truncated or corrupt, or not a file of torch.save with "
            f"tensors and plain containers only ({type(e).__name__}: {cause}); use another copy or an earlier "
            "checkpoint"
        ) from e
    if isinstance(obj, dict) and CHECKED in obj:
        if set(obj) != {CHECKED, "sha256", "object"} or content_sha256(obj["object"]) != obj["sha256"]:
            raise CheckpointError(f"{path} is corrupt: the SHA-256 of its content differs from the one save_atomic "
                                  "stored in it (flipped bytes); use another copy or an earlier checkpoint")
        return obj["object"]
    return obj


def _weights_only_refusal(e: pickle.UnpicklingError) -> str | None:
    """What torch's weights-only unpickler refused (``Unsupported global: GLOBAL numpy...``), or
    None where the error is not that refusal (a torn file raises UnpicklingError too)."""
    text = str(e)
    if "Weights only load failed" not in text:
        return None
    found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|\n|$)", text)
    return (found.group(1) if found else "an unsupported global").rstrip(". ")


def _unloadable(obj: Any, where: str) -> str | None:
    """Where in ``obj`` is something a file of torch.save would hold but torch.load(weights_only=True)
    could not read back (restore would then refuse the checkpoint): ``where[...]`` and its type,
    with torch's reason; None where all of it reads back. Plain dicts, lists and tuples are
    walked; tensors and plain values pass; anything else is tried through a save and a
    weights-only load."""
    if torch.is_tensor(obj) or obj is None or type(obj) in (bool, int, float, complex, str, bytes):
        return None
    if type(obj) in (dict, list, tuple):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            if isinstance(obj, dict) and (problem := _unloadable(k, f"a key of {where}")):
                return problem
            if problem := _unloadable(v, f"{where}[{k!r}]"):
                return problem
        return None
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever torch says, it is the reason
        reason = (_weights_only_refusal(e) if isinstance(e, pickle.UnpicklingError) else None) or \
            f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        return f"{where} is a {type(obj).__module__}.{type(obj).__qualname__} ({reason})"
    return None


def _unsavable(extra: Any, meta: Any) -> str | None:
    """Why ``save`` must refuse this rank's ``extra`` or ``meta`` before it writes anything (a
    checkpoint that cannot be restored, or a manifest that cannot be written); None if it need not."""
    if extra is not None and not isinstance(extra, dict):
        return f"extra is a {type(extra).__name__}: give a dict (or None)"
    if problem := _unloadable(extra or {}, "extra"):
        return (f"{problem}, which torch.load(weights_only=True) does not read back, so restore would refuse the "
                "checkpoint: keep tensors, numbers, strings and plain dicts, lists and tuples of them in extra "
                "(a numpy array: torch.from_numpy(a) or a.tolist(); a numpy number: int(x) or float(x))")
    if meta is not None and not isinstance(meta, dict):
        return f"meta is a {type(meta).__name__}: give a dict (or None), of JSON values"
    try:
        json.dumps(meta or {})
    except (TypeError, ValueError) as e:
        return f"meta goes into the JSON manifest, but {e}: give JSON values (a tensor: .tolist() or .item())"
    return None


def sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _signature_difference(saved: dict[str, Any], mine: dict[str, Any]) -> str | None:
    if saved == mine:
        return None
    if saved["num_layers"] != mine["num_layers"]:
        return f"it has {saved['num_layers']} layers, this model {mine['num_layers']}"
    for part in ("block", "replicated"):
        a, b = {r[0]: r[1:] for r in saved[part]}, {r[0]: r[1:] for r in mine[part]}
        for name in sorted(a.keys() | b.keys()):
            if a.get(name) != b.get(name):
                return (f"{part} parameter {name!r} is {a.get(name) or 'absent'} in the checkpoint but "
                        f"{b.get(name) or 'absent'} in this model")
    return f"its part names are {saved['names']}, this model's {mine['names']}"


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def resolve(path: str | os.PathLike[str]) -> Path:
    """A complete checkpoint directory: ``path`` itself, or the latest complete one under it."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    if not p.is_dir():
        raise CheckpointError(f"no checkpoint at {p}: not a directory")
    if p.name.startswith("step-"):
        raise CheckpointError(f"{p} is incomplete (no {MANIFEST}): its save was interrupted; use an earlier step")
    done = sorted(d for d in p.glob("step-*") if (d / MANIFEST).is_file())
    if not done:
        raise CheckpointError(f"no complete checkpoint under {p} (no step-*/{MANIFEST})")
    return done[-1]


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (as ``resolve`` finds it), checked for the keys
    that loading reads; CheckpointError naming what is wrong and what to resume from instead."""
    d = resolve(path)
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{d / MANIFEST} is unreadable: {e}; {_instead(d)}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{d / MANIFEST} is not a {FORMAT} manifest; {_instead(d)}")
    problem = _shape_problem(manifest)
    if problem:
        raise CheckpointError(f"{d / MANIFEST} is damaged: {problem}; {_instead(d)}")
    return manifest


# What loading reads of a manifest (its other keys are a record for people): key -> type.
_MANIFEST_KEYS = {"step": int, "topology": dict, "replicas": int, "algo": str, "model": dict, "files": dict,
                  "meta": dict}
_FILE_KEYS = {"rank": int, "chunk": int, "replica": int, "bytes": int, "sha256": str}
_MODEL_KEYS = ("num_layers", "names", "block", "replicated")
_SHARD_NAME = re.compile(r"rank-\d{5}\.pt")


def _shape_problem(manifest: dict[str, Any]) -> str | None:
    """What is missing or of the wrong type in ``manifest``, one phrase; None where nothing is."""
    for key, kind in _MANIFEST_KEYS.items():
        if key not in manifest:
            return f"it has no {key!r}" + (" (the list of shards)" if key == "files" else "")
        if not isinstance(manifest[key], kind):
            return f"its {key!r} is {type(manifest[key]).__name__} {manifest[key]!r:.40}, not {kind.__name__}"
    if missing := [k for k in _MODEL_KEYS if k not in manifest["model"]]:
        return f"its 'model' has no {missing[0]!r}"
    if not manifest["files"]:
        return "its 'files' lists no shard"
    for name, entry in manifest["files"].items():
        if not _SHARD_NAME.fullmatch(name):
            return f"its 'files' names {name!r}, not a shard of this directory (rank-NNNNN.pt)"
        if not isinstance(entry, dict):
            return f"its entry of {name} is {type(entry).__name__}, not dict"
        for key, kind in _FILE_KEYS.items():
            if not isinstance(entry.get(key), kind):
                return f"its entry of {name} has no {key!r} of type {kind.__name__}"
        layers = entry.get("layers", "absent")
        if layers is not None and not (isinstance(layers, list) and len(layers) == 2
                                       and all(isinstance(v, int) for v in layers)):
            return f"its entry of {name} has 'layers' {layers!r}, not [start, stop] or null"
    return None


def _instead(d: Path) -> str:
    """What to do about a damaged step directory ``d``: resume from the latest complete step
    before it, named, where there is one."""
    earlier = sorted(p for p in d.parent.glob("step-*") if p.name < d.name and (p / MANIFEST).is_file()) \
        if d.name.startswith("step-") else []
    if earlier:
        return f"resume from the previous checkpoint, {earlier[-1]}, or restore {d.name} from a copy"
    return f"restore {d} from a copy (there is no earlier checkpoint beside it)"


def check_model(manifest: dict[str, Any], signature: dict[str, Any], where: str | os.PathLike[str]) -> None:
    """Refuse a checkpoint of another model (CheckpointError naming the first difference)."""
    diff = _signature_difference(manifest["model"], signature)
    if diff is not None:
        raise CheckpointError(f"checkpoint {where} is of a different model: {diff}")


def _remove_stale(root: Path, step: Path) -> None:
    """Temporary files of saves that crashed, and the manifest of the step about to be rewritten
    (until the new one lands, the directory is incomplete)."""
    remove_temporary([root, *root.glob("step-*")], only_dead_writers=False)
    (step / MANIFEST).unlink(missing_ok=True)


def _digest_row(digest: str) -> list[int]:
    raw = bytes.fromhex(digest)
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]


def _row_digest(row: list[int]) -> str:
    return b"".join(v.to_bytes(8, "little", signed=True) for v in row).hex()


def save(engine: TawPipe, root: str | os.PathLike[str], *, extra: dict[str, Any] | None = None,
         meta: dict[str, Any] | None = None) -> Path:
    """Write ``engine``'s checkpoint at its current step under ``root``; every rank calls it.

    ``extra`` is this rank's own state (tensors and plain containers: RNG, data position...),
    returned by ``restore``; ``meta`` (JSON, rank 0's) goes into the manifest. Every rank raises
    the same CheckpointError if any rank fails, and the step is then left incomplete. An ``extra``
    that ``torch.load(weights_only=True)`` could not read back (a numpy array) or a ``meta`` that is
    not JSON is refused on every rank before anything is written or removed, naming the key.
    """
    root, step = Path(root), engine.steps
    d = step_dir(root, step)
    name = f"rank-{engine.rank:05d}.pt"
    problem = _unsavable(extra, meta)
    _agree(engine, [problem is None], "cannot save what it was given", TypeError(problem) if problem else None)
    error: BaseException | None = None
    if engine.rank == 0:
        try:
            d.mkdir(parents=True, exist_ok=True)
            _remove_stale(root, d)
        except OSError as e:
            error = e
    _agree(engine, [error is None], f"could not prepare {d}", error)  # nobody writes before this
    digest, size = "0" * 64, 0
    try:
        shard = engine.state_dict(snapshot=False)  # written at once: no second copy of the moments
        if engine.plan.replica_of(engine.rank) > 0:  # replica 0's owner saves the chunk; this rank its extra
            shard = dict(shard, params={}, aliases={}, optimizer=dict(shard["optimizer"], state={}))
        shard["extra"] = extra or {}
        digest, size = write_atomic(d / name, lambda f: torch.save(shard, f), ".pt")
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait
        error = e
    rows = _agree(engine, [error is None, size, *_digest_row(digest)], f"could not write {d}", error)
    if engine.rank == 0:
        try:
            _write_manifest(engine, d, rows, meta or {})
        except Exception as e:  # noqa: BLE001
            error = e
    _agree(engine, [error is None], f"could not write {d / MANIFEST}", error)
    return d


def _agree(engine: TawPipe, row: list[int], what: str, error: BaseException | None) -> list[list[int]]:
    """Exchange a row per rank whose first value says "ok"; raise on every rank if one failed."""
    rows = engine.gather_rows([int(v) for v in row])
    failed = [r for r, values in enumerate(rows) if not values[0]]
    if failed and error is not None:
        raise CheckpointError(f"checkpoint: rank(s) {failed} {what}: {type(error).__name__}: {error}") from error
    if failed:
        raise PeerCheckpointError(f"checkpoint: rank(s) {failed} {what}; see their errors")
    return rows


def _write_manifest(engine: TawPipe, d: Path, rows: list[list[int]], meta: dict[str, Any]) -> None:
    plan = engine.plan
    files = {}
    for r, row in enumerate(rows):
        chunk, replica = plan.own_chunk(r), plan.replica_of(r)
        files[f"rank-{r:05d}.pt"] = {"rank": r, "chunk": chunk, "replica": replica,
                                     "layers": list(plan.chunk_layers[chunk]) if replica == 0 else None,
                                     "bytes": row[1], "sha256": _row_digest(row[2:6])}
    manifest = {
        "format": FORMAT,
        "step": engine.steps,
        "tawpipe_version": __version__,
        "torch_version": torch.__version__,
        "topology": {"nodes": plan.topology.nodes, "per_node": plan.topology.per_node},
        "replicas": plan.replicas,
        "algo": plan.algo,
        "plan_sha256": hashlib.sha256(plan.to_json().encode()).hexdigest(),
        # what "auto" chose, so that a resume can choose it again (tawpipe train does)
        "schedule": {"micro_batches": plan.micro_batches, "mb_per_fetch": engine.mb_per_fetch,
                     "prefetch_depth": engine.prefetch_depth, "reuse_weights": engine.reuse_weights},
        "model": engine.model_signature(),
        "dtypes": {"master": "torch.float32", "compute": str(engine.compute_dtype),
                   "grad_wire": str(engine.grad_wire_dtype)},
        "files": files,
        "meta": meta,
    }
    write_atomic(d / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()), ".json")


def _check_shard(d: Path, name: str, manifest: dict[str, Any], *, checksum: bool = True) -> None:
    """Refuse shard ``name`` of step directory ``d`` unless it is there with the manifest's size
    and SHA-256 (``checksum=False``: the size alone); where it differs, name the likelier cause.
    The one check of a shard: ``verify`` (before a run) and ``restore`` (before loading) share it."""
    entry, path = manifest["files"][name], d / name
    if not path.is_file():
        raise CheckpointError(f"{path} is missing (the manifest lists it); {_instead(d)}")
    size = path.stat().st_size
    if size == entry["bytes"] and (not checksum or sha256(path) == entry["sha256"]):
        return
    found = _saved_step(path)
    if found is not None and found != manifest["step"]:
        raise CheckpointError(f"{path} is from step {found} but its manifest is of step {manifest['step']}: "
                              f"mixed steps, refusing to load; {_instead(d)}")
    if size != entry["bytes"]:
        how = "truncated" if size < entry["bytes"] else "damaged"
        raise CheckpointError(f"{path} is {how}: it has {size:,} bytes, the manifest records {entry['bytes']:,}; "
                              f"{_instead(d)}")
    raise CheckpointError(f"{path} is corrupt: its SHA-256 differs from the manifest's; {_instead(d)}")


def _saved_step(path: Path) -> int | None:
    """The step a shard says it holds, or None where it does not read. Memory-mapped: only the
    pickle is read, not the tensors."""
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - unreadable: truncated or corrupt, which the caller then says
        return None
    return shard.get("steps") if isinstance(shard, dict) else None


def _verified(d: Path, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """Load one shard after checking it against the manifest (``_check_shard``), then its step and rank."""
    _check_shard(d, name, manifest)
    path, entry = d / name, manifest["files"][name]
    shard = load(path)
    if shard.get("steps") != manifest["step"] or shard.get("rank") != entry["rank"]:
        raise CheckpointError(f"{path} holds rank {shard.get('rank')} at step {shard.get('steps')}, the manifest "
                              f"says rank {entry['rank']} at step {manifest['step']}: mixed shards, refusing to load")
    return shard


def verify(path: str | os.PathLike[str], *, checksums: bool = True) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (a step directory, or the latest complete one
    under a root), once every shard it lists is found whole: there, of the recorded size, with the
    recorded SHA-256; CheckpointError naming the first one that is not, and what to resume from.

    For a check before a run starts (``tawpipe train --resume``): the shards are checked as
    ``restore`` checks them (``_check_shard``), but without loading them. Hashing reads every
    shard in full, one pass more over the checkpoint than ``restore`` makes (it hashes the shards
    it loads again): the price of refusing a damaged checkpoint before any worker starts.
    ``checksums=False`` checks presence and sizes only (a stat per shard), for processes whose
    peer hashes them."""
    d = resolve(path)
    manifest = read_manifest(d)
    for name in sorted(manifest["files"]):
        _check_shard(d, name, manifest, checksum=checksums)
    return manifest


@dataclass(frozen=True)
class Restored:
    path: Path
    step: int
    extra: dict[str, Any]  # this rank's ``extra`` (on another topology: the same rank's, or rank 0's)
    meta: dict[str, Any]
    resharded: bool


def restore(engine: TawPipe, path: str | os.PathLike[str]) -> Restored:
    """Load the checkpoint at ``path`` (a step directory, or the latest complete one under a
    root) into ``engine``; every rank calls it, and every rank raises if any rank refuses.

    On another topology each rank takes its layers from the shards that hold them; parameters
    and their optimizer state (per parameter, by name) move exactly, and the scheduler, loss
    scale, counters and optimizer hyper-parameters come from the first of those shards."""
    error, out, step = None, None, -1
    try:
        d = resolve(path)
        manifest = read_manifest(d)
        step = manifest["step"]
        check_model(manifest, engine.model_signature(), d)
        start, stop = engine.plan.chunk_layers[engine.own_chunk]
        files = manifest["files"]  # a replica's shards hold only its extra (layers None): replica 0's hold the chunks
        needed = [n for n, f in sorted(files.items())
                  if f["layers"] is not None and f["layers"][0] < stop and start < f["layers"][1]]
        same = f"rank-{engine.rank:05d}.pt"  # its extra (RNG...) is this rank's on the same topology
        extra_from = [same] if same in files and same not in needed else []
        shards = {n: _verified(d, n, manifest) for n in needed + extra_from}
        first = shards[needed[0]]
        resharded = not (len(needed) == 1 and files[needed[0]]["layers"] == [start, stop]
                         and files[needed[0]]["chunk"] == engine.own_chunk)
        state = dict(first, params={}, optimizer=dict(first["optimizer"], state={}))
        for n in needed:
            state["params"].update(shards[n]["params"])
            state["optimizer"]["state"].update(shards[n]["optimizer"]["state"])
        engine.load_state_dict(state, reshard=resharded, assign=True)  # state was read from the files: ours alone
        out = Restored(d, step, shards.get(same, first)["extra"], manifest["meta"], resharded)
    except Exception as e:  # noqa: BLE001 - shared below, so that no rank trains on alone
        error = e
    rows = engine.gather_rows([int(error is None), step])
    refused = [r for r, (ok, _) in enumerate(rows) if not ok]
    if error is not None:
        raise error
    if refused:
        raise PeerCheckpointError(f"rank(s) {refused} refused checkpoint {out.path}; see their errors")
    if len({s for _, s in rows}) > 1:
        raise CheckpointError(f"ranks found checkpoints of different steps {[s for _, s in rows]} under {path}")
    return out


def consolidated(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The whole model's parameters from a checkpoint's shards, under the model's names (what a
    single-process model's ``load_state_dict`` takes, tied weights under each of their names)."""
    d = resolve(path)
    manifest = read_manifest(d)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(manifest["files"]):
        shard = _verified(d, name, manifest)
        out.update(shard["params"])
        out.update({alias: shard["params"][canonical] for alias, canonical in shard["aliases"].items()})
    return out


# ----------------------------------------------------------------------------- one writer per root

LOCK = ".tawpipe.lock"


class RootBusy(CheckpointError):
    """Another live process holds the root's lock (``hold``): its message names that process."""


class RootLock:
    """The lock of one checkpoint root, held by this process until ``release`` (or the end of a
    ``with`` block, or the process, however it ends). Made by ``hold``."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        """Remove the lock file, then let go of the lock (in that order: a process that opened the
        file meanwhile finds it unlinked and makes a new one, see ``hold``). Idempotent."""
        if self._fd < 0:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = -1

    def __enter__(self) -> RootLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold(root: str | os.PathLike[str]) -> RootLock:
    """Take the lock of checkpoint root ``root`` (an existing directory) for this process, without
    waiting; RootBusy, naming the holder (host, pid, since when), where another process holds it.

    Two runs saving into one root destroy each other's work: ``save`` removes the temporary files
    it finds, taking them for leftovers of crashed saves, so one run's save deleted the other's
    shard in flight. A run holds the lock from before its workers start until it ends.

    The lock is ``flock(2)`` on ``ROOT/.tawpipe.lock``: the kernel drops it when the holding
    process ends, however it ends (SIGKILL, the OOM killer, a power loss), so it is never stale;
    the file a killed run leaves behind is taken over as it is. (A file made with O_EXCL and
    judged by its holder's pid, the alternative, cannot tell whether a holder on another host
    still runs, and two processes taking over one stale file race.) On network file systems flock
    is the file system's lock (NFS maps it to a POSIX lock); where there are none (ENOLCK), a
    RuntimeWarning says so and the run goes on unlocked. The file holds the holder's host, pid and
    start time, for the message that refuses the next one. The descriptor is close-on-exec:
    processes started by the holder do not inherit the lock."""
    import fcntl  # POSIX only, as the launcher is

    path = Path(root) / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RootBusy(f"{path} is held by {_holder(path)}: another run saves its checkpoints there; two runs "
                           "saving into one directory delete each other's files: wait for that run to end (or stop "
                           "it), or save this run into another directory") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            warnings.warn(f"cannot lock {path} ({e.strerror}): this file system has no locks, so nothing keeps "
                          f"another run from saving into {root} at the same time", RuntimeWarning, stacklevel=2)
            return RootLock(path, -1)
        try:  # the holder we raced may have removed the file before letting go: lock the new one
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    lock = RootLock(path, fd)
    try:  # who holds it, for the message that refuses the next one
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": since}).encode(), 0)
    except BaseException:
        lock.release()
        raise
    return lock


def _holder(path: Path) -> str:
    """``pid 123 on host h (since ...)`` from a lock file; what is known where it is not written yet."""
    try:
        who = json.loads(path.read_text())
        return f"pid {who['pid']} on host {who['host']} (since {who['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its name yet)"
