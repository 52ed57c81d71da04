"""The engine's options as four small policies, each checked where it is made.

``TawPipe`` takes a model, a topology, the micro-batches and, besides the optimizer, four
policies: what schedule runs (``SchedulePolicy``), in what precision (``PrecisionPolicy``), with
what memory savers and budget (``MemoryPolicy``), and over which communication backend
(``CommPolicy``). Each is a frozen dataclass whose ``__post_init__`` refuses a bad value with a
ValueError naming the field and the fix, before anything is built or sent; ``tawpipe train``
builds the same objects from its flags (``tawpipe.train.job``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ..cost.memory import AUTO, Savers, savers_to_weigh
from ..models.shape import ModelDims
from ..ops import SUPPORTED_DTYPES
from ..plan import registry
from ..plan.plan import GRAD_ROUTES
from ..plan.schedule import HOST, RESIDENT
from ..runtime import comm as comm_backends
from ..runtime.comm import Comm
from ..runtime.timeout import timeout_seconds
from .precision import DynamicScaling, Precision



def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SchedulePolicy:
    """Which schedule runs (``algo``: a name of ``tawpipe.plan.registry``) and how.

    ``prefetch_depth`` fetches weights that many slots ahead (``"resident"``, with reuse: far
    enough that every fetched chunk stays); ``mb_per_fetch`` runs each resident chunk for that
    many micro-batches per fetch; ``reuse_weights`` skips the fetch of a chunk still in a staging
    buffer, and ``"host"`` also keeps the fetched chunks needed again in pinned host memory, so
    that each crosses the network once per iteration whatever the depth (design §3.2). Each left ``"auto"`` is chosen by the cost model: the fewest inter-node bytes whose
    memory fits ``MemoryPolicy.budget`` (design §7.3); the paper's schedule is ``mb_per_fetch=1,
    prefetch_depth=1, reuse_weights=False``. ``replicas`` R splits the nodes into R pipelines of
    whole nodes whose chunks' R owners add their gradients once per step (design §3.5).
    ``grad_route``: the router of inter-node gradients, the owner's rail peer or local index 0.
    ``context_parallel`` c > 1 makes each run of c ranks of a node compute every micro-batch
    together, each on two mirrored slices of its sequence, attention seeing the whole sequence
    through an exchange of keys and values among them (design §3.6): a rank keeps 1/c of the
    activations, and the ranks of such a group are given the same batches.
    """

    algo: str = "tawpipe"
    mb_per_fetch: int | str = AUTO
    prefetch_depth: int | str = AUTO
    reuse_weights: bool | str = AUTO
    replicas: int = 1
    grad_route: str = "rail"
    context_parallel: int = 1

    def __post_init__(self) -> None:
        registry.get(self.algo)  # a ValueError naming the registered schedules
        if self.grad_route not in GRAD_ROUTES:
            raise ValueError(f"grad_route must be one of {GRAD_ROUTES}, got {self.grad_route!r}")
        if not (self.mb_per_fetch == AUTO or (_whole(self.mb_per_fetch) and self.mb_per_fetch >= 1)):
            raise ValueError(f"mb_per_fetch must be 'auto' or an integer >= 1, got {self.mb_per_fetch!r}")
        if not (self.prefetch_depth in (AUTO, RESIDENT) or (_whole(self.prefetch_depth) and self.prefetch_depth >= 1)):
            raise ValueError(f"prefetch_depth must be 'auto', {RESIDENT!r} or an integer >= 1, "
                             f"got {self.prefetch_depth!r}")
        if not (self.reuse_weights in (AUTO, HOST) or isinstance(self.reuse_weights, bool)):
            raise ValueError(f"reuse_weights must be 'auto', True, False or {HOST!r}, got {self.reuse_weights!r}")
        if not (_whole(self.replicas) and self.replicas >= 1):
            raise ValueError(f"replicas must be an integer >= 1, got {self.replicas!r}")
        if not (_whole(self.context_parallel) and self.context_parallel >= 1):
            raise ValueError(f"context_parallel must be an integer >= 1 (ranks of a node that share each "
                             f"micro-batch), got {self.context_parallel!r}")

    def plan_options(self) -> dict[str, Any]:
        """The options as ``build_plan`` (and ``engine_plan``) take them."""
        return dict(algo=self.algo, mb_per_fetch=self.mb_per_fetch, prefetch_depth=self.prefetch_depth,
                    reuse_weights=self.reuse_weights, replicas=self.replicas, grad_route=self.grad_route)


@dataclass(frozen=True)
class PrecisionPolicy:
    """The numerics (design §6.4): masters, optimizer state and accumulators are float32
    whatever ``compute_dtype``. ``grad_wire_dtype`` (float32 or the compute dtype) is the dtype
    gradients travel in, to their owner and between the replicas' owners of a chunk, always
    accumulated in float32 by the owner (the replicated modules' all-reduce too). ``loss_scale``: "auto"
    (dynamic for float16, none otherwise), None, a number, or "dynamic", which moves as ``scaling``
    says (``DynamicScaling``: torch's GradScaler's defaults); ``max_grad_norm`` clips
    the global norm; ``nonfinite``: "skip" a step whose loss or gradients are not finite, or
    "raise" FloatingPointError."""

    compute_dtype: torch.dtype = torch.float32
    grad_wire_dtype: torch.dtype = torch.float32
    loss_scale: float | str | None = "auto"
    max_grad_norm: float | None = None
    nonfinite: str = "skip"
    scaling: DynamicScaling = field(default_factory=DynamicScaling)

    def __post_init__(self) -> None:
        if not isinstance(self.scaling, DynamicScaling):
            raise ValueError(f"scaling must be a tawpipe.engine.precision.DynamicScaling, got {self.scaling!r}")
        for name in ("compute_dtype", "grad_wire_dtype"):
            if not isinstance(value := getattr(self, name), torch.dtype):
                raise TypeError(f"{name} must be a torch.dtype, got {value!r}: pass e.g. torch.bfloat16, not a string")
        if self.compute_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"compute_dtype {self.compute_dtype} unsupported; use one of {SUPPORTED_DTYPES}")
        if self.grad_wire_dtype not in (torch.float32, self.compute_dtype):
            raise ValueError(f"grad_wire_dtype must be torch.float32 or the compute dtype {self.compute_dtype}, "
                             f"got {self.grad_wire_dtype}")
        numerics = self.numerics()  # loss_scale, max_grad_norm and nonfinite are checked by the numerics they make
        if self.scaling != DynamicScaling() and not numerics.dynamic:
            raise ValueError(f"scaling={self.scaling} moves a dynamic loss scale, and this policy's is "
                             f"{self.loss_scale!r} with compute_dtype {self.compute_dtype}: pass loss_scale='dynamic' "
                             "(float16's 'auto'), or leave scaling out")

    def numerics(self) -> Precision:
        """A fresh ``Precision``: the loss scale and the step counters of one engine."""
        scale = self.loss_scale
        if scale == "auto":
            scale = "dynamic" if self.compute_dtype == torch.float16 else None
        return Precision(scale, self.max_grad_norm, self.nonfinite, **asdict(self.scaling))


@dataclass(frozen=True)
class MemoryPolicy:
    """What a rank keeps on its device, and the budget "auto" plans within. ``recompute``:
    "chunk" keeps a chunk's input and runs it again in the backward (the paper's); "layer" does
    too, but the backward runs the chunk again keeping only its layers' inputs and then one layer
    at a time, so one layer's activations are alive at once whatever the chunk's size; "block"
    keeps every layer's input from the forward (torch's per-block checkpointing: no second run of
    the chunk, the chunk's layers times the inputs kept); "none" keeps the forward's graph (design
    §6.2). ``offload_state`` keeps the own chunk's master, gradient
    accumulator and optimizer state in pinned host memory; with torch's per-parameter optimizers
    the host steps it a piece at a time, each piece loading for the next step while the next
    steps, where the plan's first load of the chunk can be made that early (design §6.1). ``budget``: bytes per
    rank that the "auto" schedule options must fit (None: the free memory less a margin); given,
    it bounds a schedule given whole too (``NothingFits`` where it does not fit).
    ``chunked_loss``: the head and loss a slice of tokens at a time, never the whole [tokens,
    vocabulary] float32 logits (the model's ``head_loss``, equal to the plain loss to ~1e-6).
    ``offload_activations``: the chunk inputs a forward keeps for its backward wait in pinned host
    memory, stored as soon as the forward is done and fetched back ahead of the backward (with
    recompute "chunk", "layer" or "block"; ``tawpipe.engine.activations``).
    ``shape``: the model and the micro-batch ``step`` will take, as the cost model counts them
    (``ModelDims``: hidden, layers, heads, vocab, seq, micro_batch rows; the built-in LLaMA's
    ``LlamaConfig.dims(seq=..., micro_batch=...)``; ``step`` refuses larger micro-batches; a model
    whose attention keeps its S x S scores, eager attention, says ``scores=True``). With it,
    the "auto" schedule options count the activations too, and ``recompute="auto"`` chooses the
    memory savers as ``tawpipe train --recompute auto`` does (design §7.3): of those with which a
    schedule fits, the fewest inter-node bytes, then the fastest, the host's optimizer step last
    (an offload given is in every choice; on a CPU, none is added, since it would free nothing)."""

    recompute: str = "chunk"
    offload_state: bool = False
    offload_activations: bool = False
    budget: float | None = None
    chunked_loss: bool = False
    shape: ModelDims | None = None

    def savers(self, host_is_device: bool = False) -> Savers | tuple[Savers, ...]:
        """These options as the cost model counts them; with ``recompute="auto"`` the savers to
        choose among, fastest first (``host_is_device``: a CPU device, no offload added)."""
        ladder = savers_to_weigh(self.recompute, self.offload_state, self.offload_activations,
                                 host_is_device=host_is_device)
        return ladder if self.recompute == AUTO else ladder[0]

    def batch(self, context_parallel: int = 1) -> dict[str, Any] | None:
        """What one micro-batch's activations are counted from (a rank's slice of the sequence
        under ``context_parallel``); None without ``shape``."""
        return None if self.shape is None else activation_batch(self.shape, self.chunked_loss, context_parallel)

    def __post_init__(self) -> None:
        if self.shape is not None and not isinstance(self.shape, ModelDims):
            raise ValueError("shape must be a tawpipe.models.ModelDims (hidden, layers, heads, vocab, seq, "
                             f"micro_batch), got {type(self.shape).__name__}")
        if self.recompute == AUTO and self.shape is None:
            raise ValueError("recompute='auto' chooses the memory savers by what they save, mostly activations, "
                             "which depend on the batch: give shape=ModelDims(...) of the micro-batches step() takes "
                             "(the built-in LLaMA's LlamaConfig.dims(seq=..., micro_batch=...)), or name the "
                             "recompute")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, (int, float))
                                        or not self.budget > 0):
            raise ValueError(f"budget must be None (measure the free memory) or bytes per rank > 0, "
                             f"got {self.budget!r}")
        for name in ("chunked_loss", "offload_state", "offload_activations"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self.savers()  # the recompute's name, and the savers that go together (the cost model's rules)


def activation_batch(shape: ModelDims, chunked_loss: bool, context_parallel: int = 1) -> dict[str, Any]:
    """What the cost model counts one micro-batch's activations from (``cost.memory.rank_memory``'s
    ``shape`` and ``chunked_loss``): ``shape`` with a rank's slice of the sequence under
    ``context_parallel``."""
    return dict(shape=replace(shape, seq=shape.seq // context_parallel), chunked_loss=chunked_loss)


@dataclass(frozen=True)
class CommPolicy:
    """How ranks talk: ``backend``, a name of ``tawpipe.runtime.comm`` ("torch": torch.distributed,
    the default; "nccl-native": tawpipe's own NCCL; "gloo-staged": gloo with GPU tensors staged
    through pinned host memory, for several ranks on one GPU) or a ``Comm`` built by hand; ``timeout``:
    seconds any wait may take (None: ``TAWPIPE_TIMEOUT``, else 300); ``overlap``: communication
    runs on its channels' threads beside compute (False: every transfer is waited for at once,
    for measurements)."""

    backend: str | Comm = "torch"
    timeout: float | None = None
    overlap: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.backend, Comm) and self.backend not in comm_backends.names():
            raise ValueError(f"backend must be a tawpipe.runtime.comm.Comm or one of {comm_backends.names()}, "
                             f"got {self.backend!r}")
        if self.timeout is not None:
            timeout_seconds(self.timeout)
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be True or False, got {self.overlap!r}")

    def supports_replicas(self) -> bool:
        """Whether the backend has collectives across replicas (design §3.5)."""
        return self.backend.supports_replicas if isinstance(self.backend, Comm) else \
            comm_backends.backend(self.backend).supports_replicas
