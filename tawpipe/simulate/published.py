"""``tawpipe simulate --published OUT``: the simulator against training runs no one here made
(design §9.5). Each published run is replayed as its authors describe it, as the simulator's
FSDP2 peer (with context parallelism where the run used it) on the H100 preset, and its predicted
tokens/s per GPU is set beside the published one.

What the simulator does not model, and how such a run is compared: each run is played as the
simulator's nearest setting (the prediction) and as a faster bound, and the published figure should
lie between the two:

- selective activation checkpointing (torchtitan's "op" policy saves attention's and every other
  matmul's output, recomputing the rest): predicted with per-block checkpointing (every forward
  again), bounded by no recompute;
- float8 matmuls (torchtitan's ``float8`` with ``torch.compile``): predicted at the preset's bf16
  matmul rate, bounded at twice it (float8's peak on an H100);
- ``torch.compile``'s fusions: the elementwise work is memory traffic in either case;
- memory: a published figure is the allocator's peak reserved memory, which caches freed blocks;
  the simulator's is what is live, so the two are shown, not compared.

Where a prediction misses, the row gives the attention rate the published time implies, all of
the difference put on attention (the simulator's other work taken as it is).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ..atomic import write_atomic
from ..models.shape import from_hf_config
from ..sim import compare
from ..sim.hardware import DEVICES, Cluster, link
from ..sim.workload import ATTENTION_BACKWARD, Workload

GiB = 2**30
BAND = 0.2  # a prediction within ±20% of the published figure counts as held (issue #37)

# Llama 3.1 8B's config.json (meta-llama/Llama-3.1-8B): the fields the simulator reads
LLAMA_31_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
               "tie_word_embeddings": False}
TORCHTITAN = "torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (H100 96 GB, 8 per host, 400 Gb/s per GPU)"


@dataclass(frozen=True)
class Run:
    """A published training run, as its source describes it."""

    what: str
    nodes: int
    per_node: int
    seq: int
    micro_batch: int  # the local batch, sequences per GPU
    context: int  # context-parallel degree (1: none)
    checkpointing: str  # "full" or "selective"
    float8: bool
    tokens_per_gpu_s: float  # published
    memory_gib: float  # published, peak reserved
    source: str = TORCHTITAN


RUNS = (
    Run("Llama 3.1 8B, FSDP over 8 GPUs, selective AC, bf16", 1, 8, 8192, 2, 1, "selective", False, 5762, 82.4),
    Run("Llama 3.1 8B, FSDP over 128 GPUs, selective AC, bf16", 16, 8, 8192, 2, 1, "selective", False, 5605, 67.0),
    Run("Llama 3.1 8B, FSDP 8, CP 1, full AC, float8 + compile", 1, 8, 32768, 1, 1, "full", True, 3890, 84),
    Run("Llama 3.1 8B, FSDP 8 over CP 2, full AC, float8 + compile", 1, 8, 65536, 1, 2, "full", True, 2540, 84),
    Run("Llama 3.1 8B, FSDP 8 over CP 4, full AC, float8 + compile", 1, 8, 131072, 1, 4, "full", True, 1071, 84),
    Run("Llama 3.1 8B, FSDP 8 over CP 8, full AC, float8 + compile", 1, 8, 262144, 1, 8, "full", True, 548, 84),
)


def replay(run: Run, *, bound: bool = False) -> tuple[compare.Row, Workload]:
    """``run`` played as the FSDP2 peer, one micro-batch per GPU per iteration (the local batch),
    each GPU holding 1/context of the sequence: as predicted, or (``bound``) the faster bound of
    what the simulator does not model (module docstring)."""
    dims = from_hf_config(LLAMA_31_8B, seq=run.seq, micro_batch=run.micro_batch, dtype_bytes=2, grad_bytes=4,
                          scores=False)  # FSDP2 reduces float32 gradients (its mixed-precision default)
    h100 = DEVICES["h100"]
    dev = dataclasses.replace(h100, memory=96e9, matmul_flops=h100.matmul_flops * (2 if bound and run.float8 else 1))
    cluster = Cluster(run.nodes, run.per_node, dev, link("nvlink"), link("400gb"), rails=True)
    recompute = run.checkpointing == "full" or not bound
    work = Workload(dims, dev, recompute=recompute).sliced(run.context)
    return compare.run("fsdp", cluster, work, 1), work


def implied_attention(run: Run, row: compare.Row, work: Workload) -> float:
    """The fraction of the device's peak at which attention would run for ``row`` to take the
    published time, the rest of its work taken as simulated."""
    d, dev = work.dims, work.device
    passes = 1 + int(work.recompute) + ATTENTION_BACKWARD  # forward, its re-run, backward
    flops = d.layers * passes * work.attention_flops()
    attention_s = flops / dev.attention_flops
    published_s = d.seq * d.micro_batch / run.tokens_per_gpu_s
    rest = row.time_s - attention_s
    return flops / max(published_s - rest, 1e-9) / dev.peak_flops


def table(runs: tuple[Run, ...] = RUNS) -> list[dict[str, Any]]:
    """Every run's prediction and faster bound against its published figure."""
    out = []
    for run in runs:
        row, work = replay(run)
        fast = replay(run, bound=True)[0].tokens_per_s_per_device
        predicted = row.tokens_per_s_per_device
        ratio = predicted / run.tokens_per_gpu_s
        out.append({**dataclasses.asdict(run), "predicted_tokens_per_gpu_s": predicted, "ratio": ratio,
                    "bound_tokens_per_gpu_s": fast, "published_in_band": predicted <= run.tokens_per_gpu_s <= fast,
                    "predicted_memory_gib": row.memory.total / GiB, "time_s": row.time_s,
                    "bottleneck": row.bottleneck, "held": abs(ratio - 1) <= BAND,
                    "implied_attention_of_peak": implied_attention(run, row, work),
                    "preset_attention_of_peak": work.device.attention_flops / work.device.peak_flops})
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["# The simulator against published runs", "",
             f"Source: {TORCHTITAN}. Each run is played as the simulator's FSDP2 peer on the H100 preset (96 GB, "
             "400 Gb/s per GPU on its own rail), one micro-batch per GPU per iteration, with context parallelism "
             "where the run used it (each GPU 1/CP of the sequence, the keys and values all-gathered over the CP "
             "ranks of the node in every forward, their gradients reduce-scattered in every backward). The "
             "prediction plays the nearest setting the simulator has (selective AC as per-block checkpointing, "
             "float8 at the bf16 matmul rate), the bound the faster side of what it does not model (no recompute; "
             "twice the matmul rate): the published figure should lie between. Memory is shown, not compared "
             "(the published figure is the allocator's peak reserved). Where the prediction misses, the attention "
             "rate the published time implies (the rest as simulated), against the preset's "
             f"{rows[0]['preset_attention_of_peak']:.0%} of peak.",
             "", "| run | S | CP | published tok/s/GPU | predicted | predicted / published | bound | published "
             "between | memory GiB: published / simulated | attention the published time implies |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        implied = "" if r["held"] else f"{r['implied_attention_of_peak']:.0%} of peak"
        lines.append(f"| {r['what']} | {r['seq']:,} | {r['context']} | {r['tokens_per_gpu_s']:,.0f} | "
                     f"{r['predicted_tokens_per_gpu_s']:,.0f} | {r['ratio']:.2f} | {r['bound_tokens_per_gpu_s']:,.0f} | "
                     f"{'yes' if r['published_in_band'] else 'no'} | {r['memory_gib']:.1f} / "
                     f"{r['predicted_memory_gib']:.1f} | {implied} |")
    held = sum(r["held"] for r in rows)
    lines += ["", f"Within ±{BAND:.0%} of the published tokens/s per GPU: {held} of {len(rows)} runs."]
    return "\n".join(lines)


def main_published(args: argparse.Namespace) -> int:
    rows = table()
    md = markdown(rows)
    args.published.mkdir(parents=True, exist_ok=True)
    write_atomic(args.published / "published.json", json.dumps({"rows": rows}, indent=1))
    write_atomic(args.published / "published.md", md + "\n")
    print(md)
    return 0
