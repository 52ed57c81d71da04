"""Weights in and out as safetensors, chunk by chunk: nothing is gathered on one rank.

Reading: :class:`SafetensorsCheckpoint` takes a single ``.safetensors`` file, or a directory that
holds ``model.safetensors`` or shards listed by ``model.safetensors.index.json``. It reads only
headers until a tensor is asked for by name; ``safe_open`` maps the file and reads a tensor's bytes
when the tensor is taken, so a rank that asks for its own chunk and the replicated weights reads
only those.

Writing: :func:`save_sharded` writes a directory that ``transformers``' ``from_pretrained`` loads:
each rank writes the shard of its own chunk; rank 0 also writes the replicated tensors, whatever
``write_extra`` adds (the config) and, once every shard is on disk, the index.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .engine import TawPipe

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def has_safetensors(directory: str | os.PathLike[str]) -> bool:
    directory = Path(directory)
    return (directory / INDEX).is_file() or (directory / SINGLE).is_file()


class SafetensorsCheckpoint:
    """Tensor names and their files; tensors are read on request, each file opened once per read."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from safetensors import safe_open

        self.path = path = Path(path)
        if path.is_dir():
            index = path / INDEX if (path / INDEX).is_file() else None
            single = path / SINGLE if index is None else None
            if index is None and not (path / SINGLE).is_file():
                raise FileNotFoundError(f"{path} holds neither {SINGLE} nor {INDEX}: pass a directory written "
                                        "by save_pretrained (safetensors) or a .safetensors file")
        elif path.name.endswith(".index.json"):
            index, single = path, None
        elif path.suffix == ".safetensors":
            index, single = None, path
        else:
            raise ValueError(f"{path}: expected a directory, a .safetensors file or a *.index.json")
        if index is not None:
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: index.parent / file for name, file in weight_map.items()}
            absent = sorted({str(f) for f in self._files.values() if not f.is_file()})
            if absent:
                raise FileNotFoundError(f"{index} names shards that do not exist: {absent[:3]}")
        else:
            if not single.is_file():
                raise FileNotFoundError(f"no such file: {single}")
            with safe_open(single, framework="pt") as f:
                self._files = {name: single for name in f.keys()}
        self._names = frozenset(self._files)
        self._shapes: dict[str, tuple[int, ...]] = {}

    def names(self) -> frozenset[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape the header gives ``name`` (no tensor data is read)."""
        if name not in self._shapes:
            from safetensors import safe_open

            with safe_open(self._files[name], framework="pt") as f:
                for n in f.keys():
                    self._shapes[n] = tuple(f.get_slice(n).get_shape())
        return self._shapes[name]

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, as stored (dtype included), on the CPU."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self._files:
                raise KeyError(f"{self.path} has no tensor {n!r}")
            by_file.setdefault(self._files[n], []).append(n)
        out = {}
        for file, wanted in by_file.items():
            with safe_open(file, framework="pt", device="cpu") as f:
                for n in wanted:
                    out[n] = f.get_tensor(n)
        return out


def shard_names(world: int) -> list[str]:
    """File names of the N chunk shards in layer order, then the replicated shard."""
    return [f"model-{i:05d}-of-{world + 1:05d}.safetensors" for i in range(1, world + 2)]


def save_sharded(engine: TawPipe, directory: str | os.PathLike[str], checkpoint_name: Callable[[str], str], *,
                 dtype: torch.dtype = torch.float32,
                 write_extra: Callable[[Path], None] | None = None) -> None:
    """Write the engine's model as a ``save_pretrained`` directory, every rank its own chunk.

    ``checkpoint_name`` maps the engine's parameter names (``blocks.{layer}.{name}``, ``embed.*``,
    ``head.*``) to the checkpoint's. Call it on every rank; it returns once the directory is
    complete (a barrier before rank 0 writes the index).
    """
    import torch.distributed as dist

    world = engine.topology.world_size
    if world > 1 and not dist.is_initialized():
        raise RuntimeError("save_sharded needs torch.distributed initialised (torchrun or "
                           "tawpipe.launch.run_local) to wait for every rank's shard")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan, storage = engine.plan, engine.storage
    files = shard_names(world)
    chunk_file = {k: files[i] for i, k in enumerate(plan.model_order)}
    _write(directory / chunk_file[engine.own_chunk],
           {checkpoint_name(n): p for n, p in storage.own_params}, dtype)
    if engine.rank == 0:
        _write(directory / files[-1], {checkpoint_name(n): p for n, p in storage.replicated}, dtype)
        if write_extra is not None:
            write_extra(directory)
    if world > 1:
        dist.barrier()
    if engine.rank != 0:
        return
    item = torch.empty((), dtype=dtype).element_size()
    weight_map, total = {}, 0
    for k in plan.model_order:
        start, stop = plan.chunk_layers[k]
        layout = storage.layouts[stop - start]
        for name, numel in zip(layout.names, layout.numels):
            idx, rest = name.split(".", 1)
            weight_map[checkpoint_name(f"{engine.names[1]}.{start + int(idx)}.{rest}")] = chunk_file[k]
            total += numel * item
    for n, p in storage.replicated:
        weight_map[checkpoint_name(n)] = files[-1]
        total += p.numel() * item
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _atomic(directory / INDEX, lambda path: path.write_text(json.dumps(index, indent=2) + "\n"))
    # Weights of an earlier save: transformers would read a stale model.safetensors before the index.
    for stale in [directory / SINGLE, *directory.glob("model-*-of-*.safetensors")]:
        if stale.name not in files and stale.exists():
            stale.unlink()


def _write(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    # Own copies: the engine's parameters are views of one flat buffer, which safetensors refuses.
    data = {n: t.detach().to("cpu", dtype, copy=True).contiguous() for n, t in tensors.items()}
    _atomic(path, lambda tmp: save_file(data, tmp, metadata={"format": "pt"}))


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary file in the same directory and rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
