"""Rank functions for the Hugging Face tests (module level, so spawned ranks can import them).

The parent test builds the models, saves them with save_pretrained, trains an independent
single-process Hugging Face reference and compares; the ranks only run tawpipe.
"""

from __future__ import annotations

from typing import Any

import torch

from engine_cases import adamw, make_engine  # AdamW with eps 1e-6: rounding-noise gradients do not become lr-sized steps
from tawpipe import models
from tawpipe.cost.traffic import context_bytes
from tawpipe.models import hf
from tawpipe.io.safetensors import export
from tawpipe.models.weights import SafetensorsCheckpoint
from tawpipe.plan.topology import Topology


def _arrays(tensors: dict[str, torch.Tensor] | None) -> dict[str, Any] | None:
    """Tensors as numpy arrays: they travel back to the parent by value (a tensor would be shared
    through a file descriptor that dies with this process)."""
    return None if tensors is None else {n: t.detach().cpu().numpy().copy() for n, t in tensors.items()}


def _spy_reads(read_names: list[str]) -> None:
    """Record every tensor name this process reads from a checkpoint."""
    read = SafetensorsCheckpoint.read

    def spy(self, names):
        names = list(names)
        read_names.extend(names)
        return read(self, names)

    SafetensorsCheckpoint.read = spy


def _spy_materialize(parts: Any, asked: list[int]) -> None:
    materialize = parts.materialize

    def spy(block, index):
        asked.append(index)
        return materialize(block, index)

    parts.materialize = spy


def train_and_export(rank: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case: load ``dir`` chunk by chunk on 2x2 ranks, train on this rank's rows of every
    global batch, export to ``export``. Returns what was read, the losses and (rank 0) the
    gathered state dict."""
    read: list[str] = []
    _spy_reads(read)
    out = []
    for case in cases:
        read.clear()
        parts = hf.from_pretrained(case["dir"])
        asked: list[int] = []
        _spy_materialize(parts, asked)
        engine = make_engine(parts, topology=Topology(2, 2), micro_batches=case["micro_batches"],
                             optimizer=adamw)
        rows = case["batches"][0][0].shape[0] // 4
        losses = [engine.step((x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]))
                  for x, y in case["batches"]]
        export(engine, parts, case["export"], torch.float32)
        out.append({"losses": losses, "read": sorted(set(read)), "asked": asked,
                    "own_layers": engine.plan.chunk_layers[engine.own_chunk],
                    "full": _arrays(engine.full_state_dict())})
        engine.close()
    return out


def train_export_and_meta_init(rank: int, cases: list[dict[str, Any]], config: Any, seed: int,
                               topologies: list[tuple[int, int]], sliced: list[dict[str, Any]]) -> dict[str, Any]:
    """The three jobs in one local cluster (starting ranks that import transformers is the slow part)."""
    return {"train": train_and_export(rank, cases), "meta": meta_init(rank, config, seed, topologies),
            "sliced": train_sliced(rank, sliced)}


def train_sliced(rank: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case: load ``dir``, train with context parallelism on ``nodes`` nodes (the other keys
    are the engine's options), each context group on its own rows of every global batch. Returns
    the losses, the bytes of the K/V exchange, those the cost model counts from the config's
    shape, and (rank 0) the gathered state dict."""
    world = torch.distributed.get_world_size()
    out = []
    for case in cases:
        case = dict(case)
        path, batches, nodes, acc = case.pop("dir"), case.pop("batches"), case.pop("nodes"), case.pop("acc")
        c, dev = case["context_parallel"], torch.device(case.pop("device", "cpu"))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # every rank on the one GPU (comm "gloo-staged")
        engine = make_engine(hf.from_pretrained(path, device=dev), topology=Topology(nodes, world // nodes),
                             micro_batches=acc, optimizer=adamw, device=dev, **case)
        rows = batches[0][0].shape[0] // (world // c)
        group = rank // c
        losses = [engine.step((x[group * rows:(group + 1) * rows].to(dev), y[group * rows:(group + 1) * rows].to(dev)))
                  for x, y in batches]
        shape = models.dims(path, seq=batches[0][0].shape[1], micro_batch=rows // acc, dtype_bytes=4)
        planned = len(batches) * context_bytes(engine.plan, rank, shape, c, case.get("recompute", "chunk"))
        out.append({"losses": losses, "exchanged": engine.context_traffic()[0], "planned": planned,
                    "full": _arrays(engine.full_state_dict())})
        engine.close()
    return out


def meta_init(rank: int, config: Any, seed: int, topologies: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Build from the config on the meta device under each topology; return the own chunk's and the
    replicated initial weights, and which layers were materialised."""
    out = []
    for nodes, per_node in topologies:
        parts = hf.from_config(config, seed=seed)
        asked: list[int] = []
        _spy_materialize(parts, asked)
        engine = make_engine(parts, topology=Topology(nodes, per_node), micro_batches=1)
        out.append({"asked": asked, "own_layers": engine.plan.chunk_layers[engine.own_chunk],
                    "params": _arrays(dict(engine.named_parameters()))})
        engine.close()
    return out


def export_with_a_failing_config(rank: int, directory: str, config: dict[str, Any]) -> str:
    """Export on 1x2 ranks with a ``save_config`` that fails on rank 0, which alone calls it:
    what each rank raised."""
    import dataclasses

    from transformers import LlamaConfig

    def save_config(directory, dtype):
        raise OSError(28, "No space left on device")

    parts = dataclasses.replace(hf.from_config(LlamaConfig(**config), seed=1), save_config=save_config)
    engine = make_engine(parts, topology=Topology(1, 2), micro_batches=1, timeout=60)
    try:
        export(engine, parts, directory)
        out = "exported"
    except Exception as e:  # noqa: BLE001 - the error is the result
        out = f"{type(e).__name__}: {e}"
    engine.close()
    return out
