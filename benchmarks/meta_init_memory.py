"""Peak host memory of one rank building its engine: meta-device initialisation against today's
whole-model build.

    python benchmarks/meta_init_memory.py                      # built-in LLaMA, about 1.0 B, N = 4
    python benchmarks/meta_init_memory.py --family hf          # transformers' LlamaForCausalLM

Each rank of an N-rank job is measured in a fresh process of its own, one after another (N ranks
of a 1 B model at once would not fit a 24 GiB machine). That process builds the model, then the
engine for that rank (a stand-in backend answers the setup check as if every rank agreed; nothing
else is communicated), then does what the first step adds to persistent memory: it writes every
staging buffer and creates the AdamW state (``optimizer.step()`` on the zero gradients). Peak RSS
is the process's VmHWM, interpreter and torch included. The bound it is held to is
16 B x own parameters (float32 master, gradient accumulator, AdamW m and v) + staging + 16 B x
replicated parameters.

* ``meta``: blocks on the meta device; the rank materialises its own chunk only.
* ``whole``: what every rank did before, the whole float32 model built, then the engine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable

import torch

from tawpipe.atomic import write_atomic
from tawpipe.runtime.comm.base import Comm
from tawpipe.engine.engine import TawPipe
from tawpipe.engine.policy import CommPolicy, PrecisionPolicy, SchedulePolicy
from tawpipe.train.metrics import peak_host_bytes
from tawpipe.models.llama import Llama, LlamaConfig, block_forward, llama_loss, llama_parts
from tawpipe.models.parts import ModelParts
from tawpipe.plan.topology import Topology

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class SoloComm(Comm):
    """Rank ``rank`` of a ``world``-rank job, alone: enough for construction only."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world

    def all_reduce(self, tensor: torch.Tensor, group) -> None:  # the setup check's (world, fields) table
        tensor.copy_(tensor[self.rank].expand_as(tensor))

    def _nothing(self, *args, **kwargs) -> None:
        raise RuntimeError("the memory benchmark communicates nothing but the setup check")

    send = recv = broadcast = reduce = _nothing

    def channel_comm(self, name: str) -> Comm:
        return self


def hf_llama_config(a: argparse.Namespace):
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
                         max_position_embeddings=2048, tie_word_embeddings=True)


def build(a: argparse.Namespace, dtype: torch.dtype) -> tuple[ModelParts, Callable[[], None]]:
    """The model's parts, and what frees the blocks the engine does not keep."""
    if a.family == "hf":
        from tawpipe.models import hf

        return hf.from_config(hf_llama_config(a), seed=0, compute_dtype=dtype), lambda: None
    cfg = LlamaConfig(vocab_size=a.vocab, hidden=a.hidden, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.heads,
                      ffn_hidden=a.ffn, max_seq_len=2048)
    if a.mode == "meta":
        return llama_parts(cfg, seed=0, compute_dtype=dtype), lambda: None
    model = Llama(cfg, seed=0)  # the whole float32 model, as train.py built it before
    parts = ModelParts(list(model.blocks), model.embed, model.head, llama_loss, block_forward=block_forward,
                       block_context=lambda t: model.block_context(t.shape[1], "cpu", dtype),
                       vocab_size=cfg.vocab_size, description="whole")

    def release() -> None:  # train.py's `del model.blocks` once the engine had its chunk
        del model.blocks
        parts.blocks = []

    return parts, release


def measure_rank(a: argparse.Namespace) -> dict:
    dtype = _DTYPES[a.dtype]
    topo = Topology(a.nodes, a.per_node)
    parts, release = build(a, dtype)
    psi, rep = parts.decoder_params, parts.replicated_params
    after_model = peak_host_bytes()
    engine = TawPipe(parts, topology=topo, micro_batches=1, precision=PrecisionPolicy(dtype, dtype),
                     comm=CommPolicy(SoloComm(a.rank, topo.world_size)),
                     schedule=SchedulePolicy(mb_per_fetch=1, prefetch_depth=1, reuse_weights=False))  # not "auto"'s
    release()
    after_engine = peak_host_bytes()
    engine.optimizer.step()  # AdamW creates its state here (the gradients are zero)
    report = engine.memory_report()
    own = report.master // 4
    staging = sum(report.staging.values())
    bound = 16 * own + staging + 16 * rep
    peak = peak_host_bytes()
    engine.close()
    return {"rank": a.rank, "peak_rss": peak, "peak_after_model": after_model, "peak_after_engine": after_engine,
            "bound": bound,
            "ratio": peak / bound, "own_params": own, "decoder_params": psi, "replicated_params": rep,
            "staging": staging, "optimizer": report.optimizer}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("builtin", "hf"), default="builtin")
    p.add_argument("--mode", choices=("meta", "whole", "both"), default="both", help="whole: built-in only")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=2)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=5504)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16", help="compute and gradient wire dtype")
    p.add_argument("--ranks", type=int, nargs="*", help="measure only these ranks (default: all)")
    p.add_argument("--rank", type=int, help="measure this rank in this process (used by the driver)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    if a.rank is not None:
        print(json.dumps(measure_rank(a)))
        return
    results: dict[str, list[dict]] = {}
    modes = ("meta",) if a.family == "hf" else ("meta", "whole") if a.mode == "both" else (a.mode,)
    shape = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("mode", "rank", "ranks", "out")]
    for mode in modes:
        results[mode] = []
        for rank in a.ranks if a.ranks is not None else range(a.nodes * a.per_node):
            cmd = [sys.executable, __file__, *shape, "--mode", mode, "--rank", str(rank)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results[mode].append(r)
            gib = 2**30
            print(f"{a.family} {mode:5} rank {rank}: peak RSS {r['peak_rss'] / gib:6.2f} GiB (after the model "
                  f"{r['peak_after_model'] / gib:5.2f}, after the engine {r['peak_after_engine'] / gib:5.2f}), bound "
                  f"{r['bound'] / gib:5.2f} GiB (16 x {r['own_params'] / 1e6:.0f} M own + staging "
                  f"{r['staging'] / gib:.2f} + 16 x {r['replicated_params'] / 1e6:.1f} M replicated), "
                  f"ratio {r['ratio']:.2f}", flush=True)
    if a.out:
        write_atomic(a.out, json.dumps({"args": {k: v for k, v in vars(a).items() if k not in ("rank", "out")},
                                        "command": " ".join(["python", "benchmarks/meta_init_memory.py", *sys.argv[1:]]),
                                        "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
