"""Rank functions for tests/test_engine_inputs.py (module level, so spawned processes can import them)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from engine_cases import MB_ROWS, TinyLM, adamw, global_batch, lm_loss, make_engine
from tawpipe.engine.engine import TawPipe
from tawpipe.plan.topology import Topology
from tawpipe.runtime.comm.torch_dist import TorchDistComm


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def mixed_step_shards(rank: int, seed: int) -> dict:
    """Train 2 steps (a scheduler halves the learning rate each step) keeping each step's shard;
    then a fresh engine where the ranks load shards of different steps, then of different scheduler
    states, must refuse its next step on every rank, and after every rank loads the same shard it
    must step exactly as the first engine did."""
    world = dist.get_world_size()
    topo = Topology(1, world)
    rows = MB_ROWS

    def local(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = global_batch(seed + step, world * rows)
        return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]

    def make(model: TinyLM) -> TawPipe:
        return make_engine(model.blocks, model.embed, model.head, lm_loss, topology=topo, micro_batches=1,
                           optimizer=adamw, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                           comm=TorchDistComm(topo, timeout=60), block_context=model.context)

    torch.manual_seed(seed)
    first = make(TinyLM(world))
    shards = []
    for step in range(2):
        first.step(local(step))
        shards.append(copy.deepcopy(first.state_dict()))  # the optimizer state it holds lives on
    loss3 = first.step(local(2))
    first.close()

    torch.manual_seed(seed + 1)  # another initialisation: everything must come from the shards
    second = make(TinyLM(world))
    out = {}
    second.load_state_dict(shards[1] if rank == 0 else shards[0])  # rank 0 at step 2, the others at 1
    out["steps"] = _error(lambda: second.step(local(2)))
    tampered = copy.deepcopy(shards[1])
    if rank == world - 1:
        tampered["scheduler"]["last_epoch"] += 1  # the same step, another learning-rate schedule position
    second.load_state_dict(tampered)
    out["scheduler"] = _error(lambda: second.step(local(2)))
    second.load_state_dict(shards[1])
    out["loss3"], out["resumed"] = loss3, second.step(local(2))
    second.close()
    return out
