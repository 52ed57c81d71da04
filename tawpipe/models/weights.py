"""A model's weights read from safetensors, tensor by tensor: a rank reads only what it asks for.

:class:`SafetensorsCheckpoint` takes a single ``.safetensors`` file, or a directory that holds
``model.safetensors`` or shards listed by ``model.safetensors.index.json``. It reads only headers
until a tensor is asked for by name; ``safe_open`` maps the file and reads a tensor's bytes when
the tensor is taken, so a rank that asks for its own chunk and the replicated weights reads only
those. Writing a trained model back is ``tawpipe.io.safetensors``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

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
