"""The methods `tawpipe bench cluster` compares, how a TawPipe/WeiPipe engine is built and run
inside a rank, and what each method is predicted to send between nodes."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ...cost.traffic import estimate, fsdp_numel, plan_traffic
from ...engine.engine import TawPipe
from ...engine.policy import MemoryPolicy, SchedulePolicy
from ...models.parts import ModelParts
from ...models.llama import block_forward, llama_loss
from ...plan.schedule import RESIDENT
from ...plan.topology import Topology
from ...simulate.inputs import shape_dims
from .. import baselines
from ..baselines import RunConfig


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    engine_options: dict[str, Any] | None = None  # None: a peer from tawpipe.bench.baselines
    unlimited: bool = False  # run with the links' rate limit lifted: the method's compute-only time

    @property
    def replicas(self) -> int:
        """R of a TawPipe run as R replicas (engine option ``replicas``); 1 otherwise."""
        return (self.engine_options or {}).get("replicas", 1)


def compute_only(m: Method) -> Method:
    """``m`` again, on the same cluster with its links unlimited: the compute side of its bound."""
    return Method(f"{m.name}-compute", f"{m.label}, links unlimited", m.engine_options, unlimited=True)


def methods(micro_batches: int, prefetch_depth: int | str = 1, recompute: str = "none",
            replicas: tuple[int, ...] = ()) -> dict[str, Method]:
    """Every method the bench knows, in the default order. ``prefetch_depth`` is tawpipe's at k = 1;
    the best k keeps every chunk resident (one fetch per chunk and iteration; this model fits), and
    tawpipe-host gets the same bytes at depth 1 with the fetched chunks kept in host memory.
    ``recompute`` is the engine's (tawpipe and WeiPipe); "none" keeps activations, as every peer
    here does, so all do the same work. Each R in ``replicas`` adds tawpipe-rR and tawpipe-best-rR:
    the same two with the engine's ``replicas=R`` (see :func:`for_shape`)."""
    k = micro_batches  # the largest k dividing micro_batches; it fits this model's memory
    paper = {"mb_per_fetch": 1, "prefetch_depth": prefetch_depth, "reuse_weights": False}  # not the engine's "auto"
    taw = [Method("tawpipe", "tawpipe (k=1)", {**paper, "recompute": recompute})]
    if k > 1:
        best = {"mb_per_fetch": k, "reuse_weights": True, "prefetch_depth": RESIDENT, "recompute": recompute}
        taw.append(Method("tawpipe-best", f"tawpipe (k={k}, reuse, resident)", best))
        # the same inter-node bytes through two buffers, the fetched chunks kept in host memory
        host = {**best, "reuse_weights": "host", "prefetch_depth": 1}
        taw.append(Method("tawpipe-host", f"tawpipe (k={k}, depth 1, reuse, the rest on the host)", host))
    out = list(taw)
    for r in replicas:
        out += [Method(f"{m.name}-r{r}", f"{m.label}, {r} replicas", {**m.engine_options, "replicas": r})
                for m in taw]
    out += [
        Method("weipipe", "WeiPipe", {"algo": "weipipe", "recompute": recompute}),
        Method("fsdp", "FSDP2"), Method("fsdp-mm", "FSDP2 memory-matched"),
        Method("fsdp-node", "FSDP2 node reshard"), Method("hsdp", "HSDP"),
        Method("ddp", "DDP"), Method("1f1b", "1F1B"),
    ]
    return {m.name: m for m in out}


def for_shape(m: Method, nodes: int, per_node: int) -> Method | None:
    """``m`` on a cluster of ``nodes`` x ``per_node``: a run as R replicas names the replicas' shape
    in its label, and is left out (None) where R does not divide the nodes."""
    r = m.replicas
    if r == 1:
        return m
    if nodes % r:
        return None
    return replace(m, label=f"{m.label} of {nodes // r}×{per_node}")


def build_engine(model: Any, cfg: RunConfig, topology: Topology, device: torch.device, **options: Any) -> TawPipe:
    """The one place the bench builds a TawPipe/WeiPipe engine, as ``tawpipe train`` does, with the
    head and loss of ``cfg.loss`` (``baselines.head_loss``, plain or chunked, every method's);
    ``options``: the schedule's (algo, mb_per_fetch, prefetch_depth, reuse_weights, replicas) and
    ``recompute``."""
    parts = ModelParts(model.blocks, model.embed, model.head, llama_loss, block_forward=block_forward,
                       block_context=lambda t: model.block_context(t.shape[1], device),
                       head_loss=baselines.head_loss(cfg))
    return TawPipe(parts, topology=topology, micro_batches=cfg.micro_batches,
                   optimizer=functools.partial(baselines.make_optimizer, cfg), device=device,
                   schedule=SchedulePolicy(**{k: v for k, v in options.items() if k != "recompute"}),
                   memory=MemoryPolicy(recompute=options.get("recompute", "chunk"), chunked_loss=True))


def engine_rank(rank: int, cfg: RunConfig, options: dict[str, Any]) -> dict[str, Any]:
    """A TawPipe/WeiPipe engine in the harness of tawpipe.bench.baselines, plus its plan's bytes."""
    device = torch.device("cpu")
    model = baselines.build_model(cfg)
    engine = build_engine(model, cfg, Topology.from_env(), device, **options)
    del model.blocks  # the engine holds its own chunk
    data = baselines.rank_data(cfg, rank)
    traffic = plan_traffic(engine.plan)
    plan = {"sent": traffic.per_node(direction="sent"), "received": traffic.per_node(direction="received")}
    try:
        return baselines.measure(cfg, lambda i: engine.step(data(i)), lambda: dict(engine.named_parameters()),
                                 engine.optimizer, plan_bytes=plan if rank == 0 else None,
                                 staging_bytes=sum(engine.memory_report().staging.values()))
    finally:
        engine.close()


def predicted_busiest(method: str, cfg: RunConfig) -> float:
    """Closed-form inter-node bytes per iteration leaving the busiest node, for gloo.

    ddp, hsdp, 1f1b, weipipe and tawpipe are ``tawpipe.cost.traffic.estimate``. The FSDP2 variants
    are written here: ``estimate('fsdp')`` assumes a ring reduce-scatter per micro-batch, but
    gloo's reduce-scatter is an all-reduce plus a slice (twice the bytes), the default variant
    reduce-scatters once per step, and FSDP2 does not reshard the root (embedding and head)
    after forward, so backward re-gathers only the blocks.

    With Ψ block and E root parameters, N ranks and acc micro-batches, a ring collective over all
    N ranks sends (N−1)/N of its size over each node's link. Per micro-batch, forward gathers the
    blocks and the root (Ψ + E) and backward the blocks again (Ψ): acc·(N−1)/N·(2Ψ + E) for
    ``fsdp``/``fsdp-mm``. ``fsdp-node`` reshards the blocks to the node after forward, so its
    backward gather is the node's own: acc·(N−1)/N·(Ψ + E). Gradients (Ψ + E) are all-reduced,
    2·(N−1)/N each time: once per step, or every micro-batch for ``fsdp-mm``. Ψ and E are
    counted as FSDP2 pads them (``tawpipe.cost.traffic.fsdp_numel``).
    """
    dims = shape_dims(asdict(cfg))
    topo, acc = cfg.topology, cfg.micro_batches
    if method not in ("fsdp", "fsdp-mm", "fsdp-node"):
        return estimate(method, dims, topo, acc).inter_node_per_node
    n = topo.world_size
    if topo.nodes == 1:
        return 0.0
    ring = (n - 1) / n
    block, e = fsdp_numel(dims, n)  # FSDP2 pads every parameter's dim 0 to a multiple of n
    psi = dims.layers * block
    gathered = (1 if method == "fsdp-node" else 2) * psi + e
    gathers = acc * ring * gathered * dims.dtype_bytes
    reduces = (acc if method == "fsdp-mm" else 1) * 2 * ring * (psi + e) * dims.grad_bytes
    return gathers + reduces
