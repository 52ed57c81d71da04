"""What one CPU rank of a bench holds at its peak, counted before any rank starts, so that a bench
that asks for more than the host has is refused (``check_memory``) instead of killed by the
kernel's OOM killer. Estimates from the cost model's GPU formulas, which count less than torch
holds on a CPU (the cluster bench's single-process reference peaked at 1.2 to 2.2 times
``reference_bytes``, the runtime left out of both, on LLaMAs of width 256 to 1,024 at S = 64 to
2,048): a bench refused here could not run, one let through may still need more."""

from __future__ import annotations

import dataclasses

from ..cost.memory import Savers, loss_bytes, memory_per_rank, working_set_bytes
from ..models.shape import ModelDims
from ..plan.plan import Plan
from ..train.preflight import RUNTIME_BYTES


def _params(dims: ModelDims) -> int:
    return dims.decoder_numel + dims.replicated_numel


def _built(dims: ModelDims, micro_batches: int) -> float:
    """Every rank's runtime, the whole model it builds in float32, its rotary tables while they are
    made (float64 angles and their cosines and sines, float32 tables) and three steps' int64
    inputs and targets."""
    model = 4 * _params(dims)
    rope = 16 * dims.seq * dims.head_size
    batches = 3 * 2 * 8 * micro_batches * dims.micro_batch * dims.seq
    return RUNTIME_BYTES + model + rope + batches


def engine_rank_bytes(dims: ModelDims, plan: Plan, micro_batches: int, savers: Savers = Savers(), *,
                      chunked_loss: bool = False) -> float:
    """A TawPipe rank of ``plan`` on a model of ``dims`` (float32): what every rank builds, and one
    engine's memory at a time (the cost model's, and its loss's: the whole logits unless chunked;
    no S x S attention scores, which torch's CPU attention does not keep: ``dims.scores`` off)."""
    return (_built(dims, micro_batches) + memory_per_rank(plan, dims, savers).total
            + loss_bytes(dims, chunked=chunked_loss))


def replica_rank_bytes(dims: ModelDims, micro_batches: int, *, chunked_loss: bool = False) -> float:
    """A rank that holds the whole model's weights, gradients and AdamW moments (16 B per
    parameter) and one micro-batch's activations through every layer: DDP, the most any method a
    bench compares holds on a rank (FSDP2, HSDP and 1F1B hold a part of it)."""
    state = 12 * _params(dims)  # the built model is the weights
    return (_built(dims, micro_batches) + state + working_set_bytes(dims, dims.layers)
            + loss_bytes(dims, chunked=chunked_loss))


def reference_bytes(dims: ModelDims, sequences: int) -> float:
    """The cluster bench's single-process reference (``baselines.reference``): a replica on the
    ``sequences`` of a whole step at once, with the plain loss, and two copies of the parameters
    (before and after its first step) for the check."""
    return replica_rank_bytes(dataclasses.replace(dims, micro_batch=sequences), 1) + 8 * _params(dims)
