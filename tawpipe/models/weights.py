"""A model's weights read from safetensors, tensor by tensor: a rank reads only what it asks for.

:class:`SafetensorsCheckpoint` takes a single ``.safetensors`` file, or a directory that holds
``model.safetensors`` or shards listed by ``model.safetensors.index.json``. It reads only headers
until a tensor is asked for by name; ``safe_open`` maps the file and reads a tensor's bytes when
the tensor is taken, so a rank that asks for its own chunk and the replicated weights reads only
those. Writing a trained model back is ``tawpipe.io.safetensors``.

:meth:`SafetensorsCheckpoint.verify` checks every file before any process starts, reading only
headers (the 8-byte length and the JSON that follows): a damaged or truncated file, an index
naming a file that is absent, or one outside the model's directory, is refused with its name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100_000_000  # the safetensors format's own limit on the JSON header
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "I16": 2, "F16": 2,
               "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}


class WeightsError(ValueError):
    """A weight file or index that cannot be read as it is: the message names the file."""


def has_safetensors(directory: str | os.PathLike[str]) -> bool:
    directory = Path(directory)
    return (directory / INDEX).is_file() or (directory / SINGLE).is_file()


class SafetensorsCheckpoint:
    """Tensor names and their files; tensors are read on request, each file opened once per read."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
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
            weight_map = _weight_map(index)
            self._files = {name: index.parent / file for name, file in weight_map.items()}
            absent = sorted({f.name for f in self._files.values() if not f.is_file()})
            if absent:
                raise FileNotFoundError(
                    f"{index} names {len(absent)} shard(s) that do not exist in {index.parent}: "
                    f"{', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''}: copy the missing file(s) "
                    "there, or save the model again with save_pretrained")
        else:
            if not single.is_file():
                raise FileNotFoundError(f"no such file: {single}")
            self._files = {name: single for name in read_header(single)}
        self._names = frozenset(self._files)
        self._shapes: dict[str, tuple[int, ...]] = {}

    def names(self) -> frozenset[str]:
        return self._names

    def verify(self) -> None:
        """Read every file's header (no tensor data) and check it against the file's size and the
        index: WeightsError naming the file if one is damaged, truncated, or lacks a tensor the
        index places in it. The shapes are kept for :meth:`shape`."""
        by_file: dict[Path, list[str]] = {}
        for name, file in self._files.items():
            by_file.setdefault(file, []).append(name)
        for file, names in sorted(by_file.items()):
            header = read_header(file)
            absent = sorted(set(names) - set(header))
            if absent:
                raise WeightsError(f"{file}: the index places {len(absent)} tensor(s) in this file that it does "
                                   f"not hold (first: {absent[0]}): the index and the shards are of different "
                                   "saves; save the model again with save_pretrained")
            for name, entry in header.items():
                self._shapes[name] = tuple(entry["shape"])

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


def read_header(file: str | os.PathLike[str]) -> dict[str, dict]:
    """The tensors a ``.safetensors`` file's header lists, ``{name: {"dtype", "shape",
    "data_offsets"}}``, checked against the file's size; WeightsError naming the file otherwise.
    Reads the 8-byte header length and the JSON header only."""
    file = Path(file)
    damaged = f"{file} is not a complete safetensors file"
    fix = "the file is damaged or truncated: download or save it again"
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsError(f"{damaged} ({size} bytes, less than a header): {fix}")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER, size - 8):
            raise WeightsError(f"{damaged} (its first 8 bytes give a {n:,}-byte header; the file has {size:,} "
                               f"bytes): {fix}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsError(f"{damaged} (its header is not JSON): {fix}") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{damaged} (its header is not a JSON object): {fix}")
    header.pop("__metadata__", None)
    data, end = size - 8 - n, 0
    for name, entry in header.items():
        try:
            dtype, shape, (begin, stop) = entry["dtype"], [int(d) for d in entry["shape"]], entry["data_offsets"]
            numel = 1
            for d in shape:
                numel *= d
            ok = 0 <= begin <= stop and min(shape, default=0) >= 0 and (
                dtype not in DTYPE_BYTES or stop - begin == numel * DTYPE_BYTES[dtype])
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise WeightsError(f"{damaged} (its header's entry for {name!r} is malformed): {fix}")
        end = max(end, stop)
    if end != data:
        how = "truncated" if end > data else "longer than its header says"
        raise WeightsError(f"{damaged} ({how}: its tensors take {end:,} bytes after the header, the file holds "
                           f"{data:,}): {fix}")
    return header


def _weight_map(index: Path) -> dict[str, str]:
    """An index's tensor -> file map; every file must lie in the index's own directory."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise WeightsError(f"{index} is not a JSON index ({e}): save the model again with save_pretrained") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsError(f"{index} has no weight_map of tensor names to file names: save the model again "
                           "with save_pretrained")
    for file in sorted(set(weight_map.values())):
        rel = Path(file)
        if rel.is_absolute() or ".." in rel.parts:
            raise WeightsError(f"{index} names {file!r}, outside the model's directory: refusing to read it; an "
                               "index must name files in its own directory (e.g. model-00001-of-00002.safetensors)")
    return weight_map


def shard_names(chunks: int) -> list[str]:
    """File names of the chunks' shards in layer order, then the replicated shard."""
    return [f"model-{i:05d}-of-{chunks + 1:05d}.safetensors" for i in range(1, chunks + 2)]
