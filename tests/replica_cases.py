"""Rank functions for the replica tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import copy

import torch

from engine_cases import MB_ROWS, TinyLM, _engine, global_batch, host_accumulator, record_norms, reference_run, rel_err
from tawpipe.io import checkpoint
from tawpipe.io.safetensors import save_sharded
from tawpipe.plan.topology import Topology


def _local(rank: int, world: int, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, world * rows)
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def resume_across_replicas(rank: int, directory: str) -> dict:
    """Two replicas train 2 steps and save; a third step is the reference. The same replica count
    restored must repeat it bit for bit; one replica (the same ranks as one pipeline) restored from
    the same checkpoint must hold the same parameters and take the same step to float32 rounding."""
    world = torch.distributed.get_world_size()
    topo, acc, layers, rows = Topology(2, world // 2), 2, 5, 2 * MB_ROWS
    torch.manual_seed(0)
    model = TinyLM(layers)
    first = _engine(copy.deepcopy(model), topo, acc, replicas=2)
    for step in range(2):
        first.step(_local(rank, world, step, rows))
    saved = checkpoint.save(first, directory, extra={"rank": rank})
    whole = checkpoint.consolidated(saved)
    save_sharded(first, f"{directory}/exported", lambda name: name)  # the engine's names, as the checkpoint's
    loss3 = first.step(_local(rank, world, 2, rows))
    params3 = {n: p.detach().clone() for n, p in first.named_parameters()}
    first.close()
    out: dict = {"files": sorted(p.name for p in saved.iterdir()), "whole": whole}
    for replicas in (2, 1):
        torch.manual_seed(123)  # another initialisation: everything must come from the checkpoint
        again = _engine(TinyLM(layers), topo, acc, replicas=replicas)
        restored = checkpoint.restore(again, directory)
        out[f"extra_{replicas}"] = restored.extra
        out[f"resharded_{replicas}"] = restored.resharded
        out[f"loaded_equal_{replicas}"] = all(torch.equal(p, whole[n]) for n, p in again.named_parameters())
        out[f"loss3_{replicas}"] = again.step(_local(rank, world, 2, rows))
        out[f"params3_{replicas}"] = {n: p.detach().clone() for n, p in again.named_parameters()}
        again.close()
    out["loss3"], out["params3"] = loss3, params3
    return out


def normed_over_replicas(rank: int, wire: str) -> dict:
    """Two replicas of 1 x 2 with the state on the host and clipping, computing and summing the
    gradients over the replicas in float32 or bfloat16 (``wire``): whether ``squared_norm`` read
    the host accumulator, how often it ran, and the parameters' error against one process."""
    world, acc, steps = torch.distributed.get_world_size(), 2, 3
    dtype = torch.bfloat16 if wire == "bfloat16" else torch.float32  # the wire's dtype is float32 or the compute's
    seen = record_norms()
    torch.manual_seed(0)
    model = TinyLM(4)
    ref, _ = reference_run(model, world * acc * MB_ROWS, steps, 0.05)
    engine = _engine(copy.deepcopy(model), Topology(2, world // 2), acc, replicas=2, offload_state=True,
                     max_grad_norm=0.05, compute_dtype=dtype, grad_wire_dtype=dtype)
    for step in range(steps):
        engine.step(_local(rank, world, step, acc * MB_ROWS))
    host = host_accumulator(engine)
    want = dict(ref.named_parameters())
    err = max(rel_err(p.detach(), want[n].detach()) for n, p in engine.named_parameters())
    engine.close()
    return {"host_normed": host in seen, "norms": len(seen), "err": err}
