"""A trained model written as a Hugging Face ``save_pretrained`` directory: nothing is gathered.

:func:`export` writes a directory that ``transformers``' ``from_pretrained`` loads: each rank
writes the shard of its own chunk; rank 0 also writes the replicated tensors, the config and,
once the ranks agree that every shard is on disk (``TawPipe.gather_rows``), the index. It reads
the engine only through its public methods.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..models.weights import INDEX, SINGLE, shard_names
from ..atomic import write_atomic

if TYPE_CHECKING:
    from ..engine.engine import TawPipe
    from ..models.parts import ModelParts


class ExportError(RuntimeError):
    """Raised on the ranks that wrote their part when another rank could not: the cause is there."""

    about_a_peer = True  # tawpipe.runtime.launch then names the other rank's error first


def export(engine: TawPipe, parts: ModelParts, directory: str | os.PathLike[str],
           dtype: torch.dtype = torch.float32) -> None:
    """Write ``engine``'s model, built from ``parts``, to ``directory`` in ``dtype``. Call it on every
    rank; it returns once the directory is complete."""
    if parts.checkpoint_name is None or parts.save_config is None:
        raise ValueError(f"{parts.description} has no Hugging Face format to export to")
    save_config = parts.save_config
    _check_save_config(save_config, Path(directory), dtype)  # on every rank, before any file is written
    save_sharded(engine, directory, parts.checkpoint_name, dtype=dtype,
                 write_extra=lambda d: save_config(d, dtype))


def _check_save_config(hook: Callable[..., None], directory: Path, dtype: torch.dtype) -> None:
    """Refuse a ``ModelParts.save_config`` that cannot be called as ``hook(directory, dtype)``:
    found only once the shards are written, it failed rank 0 alone, and its peers then lost it."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin without a signature: it is called as it is
        return
    try:
        signature.bind(directory, dtype)
    except TypeError as e:
        raise TypeError(
            f"ModelParts.save_config is called as save_config(directory, dtype) to write the model's config for "
            f"weights of that dtype, but {getattr(hook, '__name__', 'the hook')}{signature} cannot be ({e}): give it "
            "both parameters, e.g. save_config=lambda directory, dtype: config.save_pretrained(directory); "
            "nothing was written"
        ) from None


def save_sharded(engine: TawPipe, directory: str | os.PathLike[str], checkpoint_name: Callable[[str], str], *,
                 dtype: torch.dtype = torch.float32,
                 write_extra: Callable[[Path], None] | None = None) -> None:
    """Write the engine's model as a ``save_pretrained`` directory, each chunk by its owner in replica 0.

    ``checkpoint_name`` maps the engine's parameter names (``blocks.{layer}.{name}``, ``embed.*``,
    ``head.*``) to the checkpoint's. Call it on every rank; it returns once the directory is
    complete (the ranks agree that every part is written before rank 0 writes the index). If a
    rank cannot write its part, every rank raises: that rank its error, the others ExportError.
    """
    directory = Path(directory)
    files = shard_names(len(engine.plan.model_order))  # one per chunk, written by its owner in replica 0
    chunk_file = {k: files[i] for i, k in enumerate(engine.plan.model_order)}
    error: Exception | None = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if engine.plan.replica_of(engine.rank) == 0:  # the other replicas' copies are the same
            _write(directory / chunk_file[engine.own_chunk],
                   {checkpoint_name(n): p for n, p in engine.own_parameters()}, dtype)
        if engine.rank == 0:
            _write(directory / files[-1], {checkpoint_name(n): p for n, p in engine.replicated_parameters()}, dtype)
            if write_extra is not None:
                write_extra(directory)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait for this one
        error = e
    failed = [r for r, (ok,) in enumerate(engine.gather_rows([int(error is None)])) if not ok]
    if error is not None:
        raise error
    if failed:
        raise ExportError(f"export to {directory}: rank(s) {failed} could not write their part; see their errors")
    if engine.rank != 0:
        return
    item = torch.empty((), dtype=dtype).element_size()
    weight_map, total = {}, 0
    for name, numel, chunk in engine.block_parameters():
        weight_map[checkpoint_name(name)] = chunk_file[chunk]
        total += numel * item
    for n, p in engine.replicated_parameters():
        weight_map[checkpoint_name(n)] = files[-1]
        total += p.numel() * item
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_atomic(directory / INDEX, json.dumps(index, indent=2) + "\n", ".json")
    # Weights of an earlier save: transformers would read a stale model.safetensors before the index.
    for stale in [directory / SINGLE, *directory.glob("model-*-of-*.safetensors")]:
        if stale.name not in files and stale.exists():
            stale.unlink()


def _write(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    from safetensors.torch import save

    # Own copies: the engine's parameters are views of one flat buffer, which safetensors refuses.
    data = {n: t.detach().to("cpu", dtype, copy=True).contiguous() for n, t in tensors.items()}
    blob = save(data, metadata={"format": "pt"})
    write_atomic(path, blob, ".safetensors")
