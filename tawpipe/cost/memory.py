"""What an iteration costs a rank in memory, and which k (micro-batches per fetch) and prefetch
depth fit a budget.

Bytes on the wire are ``tawpipe.cost.traffic``'s; this module adds the other side of the trade-off of
design §7.3: running a resident chunk for k micro-batches cuts weight and gradient traffic by k
and keeps k times as many chunk-boundary activations alive; a deeper prefetch keeps more chunks
resident (fewer bytes again) in more staging buffers. ``choose`` and ``auto_plan`` make that
trade for the engine's and ``tawpipe train``'s default, ``"auto"``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..plan import registry
from ..plan.actions import GRAD_OPS, WEIGHT_OPS, BufKind, Op, buf_kind
from ..plan.plan import Plan
from ..plan.schedule import HOST, RESIDENT, REUSE, build_plan, compute_actions, resident_depth
from ..plan.topology import Topology, divisors
from ..models.shape import LOSS_CHUNK_TOKENS, ModelDims
from .traffic import busiest_node_sent
from .units import decimal, gib


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank. ``activations``: what the forwards keep on the device for their backwards
    (exact) plus the backward's working set for one micro-batch (estimated, ``working_set_bytes``),
    both as the memory savers run (``Savers.activations``). ``host``: what the savers keep in host
    memory instead; not part of ``total``, the device's."""

    persistent: float  # float32 master, two AdamW moments, float32 gradient accumulator
    staging: float  # the plan's weight and gradient buffers
    replicated: float  # embedding/head/norm: parameters, gradients, AdamW moments (float32)
    activations: float
    host: float = 0.0
    host_traffic: float = 0.0  # bytes to and from the host per iteration (``host_bytes``): PCIe, not memory

    @property
    def total(self) -> float:
        return self.persistent + self.staging + self.replicated + self.activations


RECOMPUTE = ("chunk", "layer", "block", "none")  # what a backward runs from (``Savers``, design §6.2)


@dataclass(frozen=True)
class Savers:
    """The memory savers a rank runs with, as the cost model counts them (the engine's
    ``MemoryPolicy``, design §6.2): ``recompute`` "chunk" keeps each chunk's input and runs the
    chunk again in its backward, "layer" the same a layer at a time (one layer's working set and
    the layers' inputs), "block" keeps every layer's input from the forward (a chunk's layers
    times the inputs, one layer's working set), "none" keeps every forward's graph; ``offload_state`` keeps the own
    chunk's 16 B per parameter on the host; ``offload_activations`` what the forwards keep, of
    which the device then holds what a slot's k forwards keep (in transit) and two inputs fetched
    back (one in use, one coming: a chunk's, or under "block" a layer's)."""

    recompute: str = "chunk"
    offload_state: bool = False
    offload_activations: bool = False

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.offload_activations and self.recompute == "none":
            raise ValueError("offload_activations=True keeps a chunk's input on the host, which recompute='none' does "
                             "not run from (it keeps the whole graph): use recompute='chunk', recompute='layer' or "
                             "recompute='block'")

    @property
    def layerwise(self) -> bool:
        """The backward runs a layer at a time: one layer's working set, weight gradient and scratch."""
        return self.recompute in ("layer", "block")

    def activations(self, inputs: int, k: int, input_bytes: float, chunk_layers: int,
                    working: Callable[[int], float]) -> tuple[float, float]:
        """(device, host) bytes of activations: ``inputs`` chunk inputs of ``input_bytes`` waiting
        for their backwards, and the backward's working set (``working(layers)``)."""
        if self.recompute == "none":  # every forward's graph, kept whole
            return inputs * working(chunk_layers), 0.0
        per = self.kept_per_forward(chunk_layers)
        kept, host = inputs * per * input_bytes, 0.0
        if self.offload_activations:  # a slot's k forwards' in transit, one in use, one coming back
            kept, host = min(inputs * per, k * per + 2) * input_bytes, kept
        if self.recompute == "layer":
            return kept + (chunk_layers - 1) * input_bytes + working(1), host
        if self.recompute == "block":
            return kept + working(1), host
        return kept + working(chunk_layers), host

    def __str__(self) -> str:
        return ", ".join([f"recompute {self.recompute}"] + ["activations on the host"] * self.offload_activations
                         + ["optimizer state on the host"] * self.offload_state)

    @property
    def forwards_in_backward(self) -> int:
        """Forwards of a chunk its backward runs: none without recompute, one from the chunk's or
        the layers' inputs, two a layer at a time (the chunk again, keeping its layers' inputs,
        then each layer's with its backward)."""
        return {"none": 0, "layer": 2}.get(self.recompute, 1)

    def kept_per_forward(self, chunk_layers: int) -> int:
        """Inputs of B·S·H a forward of a chunk of ``chunk_layers`` keeps for its backward."""
        return chunk_layers if self.recompute == "block" else 1


# The savers "auto" weighs, fastest first: no recompute; recompute from the chunk's input or from
# every layer's (the same compute, different memory); the same with what the forwards keep on the
# host (copies beside compute); a layer at a time (one more forward per chunk); then each of these
# with the optimizer state on the host (the host steps it).
_BY_TIME = (("none", False), ("chunk", False), ("block", False), ("chunk", True), ("block", True),
            ("layer", False), ("layer", True))


def savers_ladder(*, offload_state: bool = False, offload_activations: bool = False,
                  host_is_device: bool = False) -> tuple[Savers, ...]:
    """The memory savers ``auto_savers_plan`` weighs, fastest first; an offload given is in every
    one. ``host_is_device`` (a run on the CPU): no offload but those given, since moving bytes
    from the device to the host then frees nothing."""
    states = (True,) if offload_state else (False,) if host_is_device else (False, True)
    return tuple(Savers(r, s, a) for s in states for r, a in _BY_TIME
                 if a == offload_activations or (a and not host_is_device))


def savers_to_weigh(recompute: str, offload_state: bool, offload_activations: bool, *,
                    host_is_device: bool = False) -> tuple[Savers, ...]:
    """The savers a run's flags leave to choose among: recompute "auto" weighs ``savers_ladder``
    (the offloads given in each); any other value names the one."""
    if recompute == AUTO:
        return savers_ladder(offload_state=offload_state, offload_activations=offload_activations,
                             host_is_device=host_is_device)
    return (Savers(recompute, offload_state, offload_activations),)


def auto_savers_plan(ladder: Sequence[Savers], memory: Callable[[Plan, Savers], MemoryEstimate], *, budget: float,
                     budget_text: str = "", strict: bool = True, **auto_args: Any) -> tuple[Plan, Savers, str | None]:
    """``auto_plan`` with the memory savers as one more choice (``memory(plan, savers)``): for each
    of ``ladder`` (fastest first) the schedule ``auto_plan`` chooses within ``budget``; of the
    savers with which one fits, those whose schedule sends the fewest inter-node bytes, then the
    fastest. The host's optimizer step is the last resort: savers with ``offload_state`` count
    only where none without it fits. Every plan is built once, whatever the savers. Where none
    fits: NothingFits if ``strict``, else the last savers (the leanest) with their least memory."""
    if not ladder:
        raise ValueError("auto_savers_plan needs at least one choice of memory savers")
    built: dict = {}
    for tier in (t for t in ([s for s in ladder if not s.offload_state], [s for s in ladder if s.offload_state]) if t):
        fits = []
        for rank, savers in enumerate(tier):
            try:
                plan, why = auto_plan(memory=functools.partial(memory, savers=savers), budget=budget,
                                      budget_text=budget_text, built=built, **auto_args)
            except NothingFits:
                continue
            fits.append((_inter_node(built, plan), rank, plan, savers, why))
        if fits:
            _, _, plan, savers, why = min(fits, key=lambda f: f[:2])
            if len(ladder) > 1:
                why = (f"{savers}: of the memory savers that fit, the fewest inter-node bytes, then the fastest; "
                       f"{why or 'the schedule as given'}")
            return plan, savers, why
    leanest = ladder[-1]
    try:
        plan, why = auto_plan(memory=functools.partial(memory, savers=leanest), budget=budget,
                              budget_text=budget_text, strict=strict, built=built, **auto_args)
    except NothingFits as e:
        raise (NothingFits(f"even with {leanest}: {e}", e.least) if len(ladder) > 1 else e) from None
    return plan, leanest, (f"{leanest}: the leanest; {why}" if len(ladder) > 1 else why)


def _inter_node(built: dict, plan: Plan) -> float:
    """The busiest node's inter-node bytes per iteration of ``plan``, counted once per plan."""
    if ("traffic", id(plan)) not in built:
        built[("traffic", id(plan))] = busiest_node_sent(plan)
    return built[("traffic", id(plan))]


def logits_bytes(dims: ModelDims) -> float:
    """The head's float32 logits, their log-softmax and gradient for one micro-batch (without a
    chunked loss)."""
    return loss_bytes(dims, chunked=False)


def loss_bytes(dims: ModelDims, *, chunked: bool) -> float:
    """What the head and loss hold for one micro-batch. The plain loss: the whole float32 logits,
    their log-softmax and gradient (3·T·V·4 bytes). The chunked one
    (``models.loss.linear_cross_entropy``): one slice's float32 logits and their gradient cast to
    the compute dtype, the hidden states' gradient and the head weight's float32 gradient, all of
    which it holds at once."""
    tokens = dims.micro_batch * dims.seq
    if not chunked:
        return 3 * tokens * dims.vocab * 4
    return (min(tokens, LOSS_CHUNK_TOKENS) * dims.vocab * (4 + dims.dtype_bytes) + tokens * dims.hidden * dims.dtype_bytes
            + dims.vocab * dims.hidden * 4)


def working_set_bytes(dims: ModelDims, layers: int) -> float:
    """What ``layers`` decoder layers of the built-in LLaMA (``models.llama``) keep for their
    backward, for one micro-batch: autograd's saved tensors, counted (``tests/test_activation_count.py``
    holds this to them). Per token, in the compute dtype: each norm's output before and after its
    weight, the queries, keys, values and output of attention, the output projection's input, and
    the MLP's gate, up, activation and product (4·H + 3·q + 2·kv + 4·F elements); in float32: each
    norm's float32 input (in float32 compute only the second's, the first's is the layer's own
    input), each norm's inverse RMS and attention's log-sum-exp per head. Korthikanti et al.'s
    34·H bytes at 16 bits (GPT's 4·H GeLU MLP, no float32 norms) is 0.7x of this for LLaMA's
    shapes. With ``dims.scores`` (eager attention) the S x S scores too, as they count them
    (5·a·S bytes per token at 16 bits). Not counted: the backward's own temporaries."""
    d = dims
    per_token = d.dtype_bytes * (4 * d.hidden + 3 * d.q_dim + 2 * d.kv_dim + 4 * d.ffn_hidden)
    per_token += 4 * ((1 if d.dtype_bytes == 4 else 2) * d.hidden + d.heads + 2)
    if d.scores:
        per_token += 5 * d.heads * d.seq * d.dtype_bytes / 2
    return layers * d.micro_batch * d.seq * per_token


def gathered_kv_bytes(dims: ModelDims, context: int) -> float:
    """Under context parallelism over ``context`` ranks (``dims.seq`` a rank's slice): one layer's
    keys and values of the whole sequence, gathered for its attention, and their gradients in its
    backward (design §3.6); 0 without it."""
    if context == 1:
        return 0.0
    return 2 * 2 * dims.micro_batch * dims.seq * context * dims.kv_dim * dims.dtype_bytes


def memory_per_rank(plan: Plan, dims: ModelDims, savers: Savers = Savers(), *,
                    buffers: tuple[int, int] | None = None) -> MemoryEstimate:
    """The busiest rank's memory for ``plan`` on a model of ``dims`` (same layers as the plan),
    with the most bytes any of its ranks moves to and from the host (``host_traffic``, as
    ``rank_memory`` counts it) and keeps there (the chunks it stashes, ``stashed_bytes``);
    ``buffers``: ``staging_buffers(plan)``, where the caller has counted them already."""
    weight_bufs, grad_bufs = buffers or staging_buffers(plan)
    grad_bufs -= len(in_place_gradients(plan, 0, dims.grad_bytes, savers))  # none but where a replica is one rank
    out = _layout(dims, max(stop - start for start, stop in plan.chunk_layers), plan.replica_size,
                  int(plan.options.get("mb_per_fetch", 1)), weight_bufs, grad_bufs, savers)
    if not (savers.offload_state or savers.offload_activations or plan.options.get("reuse_weights") == HOST):
        return out
    ranks = range(plan.replica_size)
    traffic = max(sum(host_bytes(plan, r, own_numel=plan.chunk_numel(plan.own_chunk(r)), weight_bytes=dims.dtype_bytes,
                                 grad_bytes=dims.grad_bytes, input_bytes=dims.activation_numel * dims.dtype_bytes,
                                 savers=savers)) for r in ranks)
    stashed = max(stashed_bytes(plan, r, plan.chunk_numel, dims.dtype_bytes) for r in ranks)
    return dataclasses.replace(out, host=out.host + stashed, host_traffic=traffic)


def stashed_bytes(plan: Plan, rank: int, chunk_numel: Callable[[int], int], weight_bytes: int) -> float:
    """The chunks ``rank`` keeps in host memory (``reuse_weights="host"``): each it stashes, once."""
    if plan.options.get("reuse_weights") != HOST:
        return 0.0
    return sum(chunk_numel(c) for c in {a.chunk for a in plan.actions[rank] if a.op is Op.STASH_W}) * weight_bytes


def staging_buffers(plan: Plan) -> tuple[int, int]:
    """The most weight and gradient buffers any rank of ``plan`` names."""
    programs = plan.actions[:plan.replica_size]  # every replica runs the same lists
    weight_bufs = max(len({a.buf for a in acts if a.op in WEIGHT_OPS}) for acts in programs)
    grad_bufs = max(len({a.grad_buf if a.op is Op.B else a.buf for a in acts
                         if a.op is Op.B or a.op in GRAD_OPS}) for acts in programs)
    return weight_bufs, grad_bufs


def estimate_memory(dims: ModelDims, topology: Topology, *, replicas: int = 1, prefetch_depth: int = 1,
                    mb_per_fetch: int = 1, algo: str = "tawpipe", savers: Savers = Savers()) -> MemoryEstimate:
    """What ``memory_per_rank`` counts for a plan of ``algo`` without reuse, from the shapes
    alone: for clusters whose plans are too large to build once per choice (``tawpipe plan``
    advising R). The staging buffers are the schedule's closed-form layout (``Schedule.staging``;
    TawPipe's: w_own + d + 1 weight and d + 1 gradient buffers, plus g_recv where gradients arrive
    from other nodes of its replica, ``verify``'s bound; a replica of one rank holds its one chunk).
    The bytes to and from the host are left out (``host_traffic`` 0)."""
    n = topology.world_size // replicas
    weight_bufs, grad_bufs = registry.get(algo).staging(prefetch_depth, topology.nodes // replicas > 1)
    if n == 1:  # its one chunk, its own: a weight buffer, and a gradient buffer unless it adds in place
        weight_bufs, grad_bufs = 1, int(not _adds_in_place(dims.grad_bytes, savers))
    return _layout(dims, -(-dims.layers // n), n, mb_per_fetch, weight_bufs, grad_bufs, savers)


def _layout(dims: ModelDims, chunk_layers: int, chunks: int, k: int, weight_bufs: int, grad_bufs: int,
            savers: Savers) -> MemoryEstimate:
    """A rank's memory with the largest chunk of ``chunk_layers`` layers, the given staging buffers
    and the inputs of ``chunks`` chunks for ``k`` micro-batches."""
    chunk = chunk_layers * dims.layer_numel
    state = 16 * chunk
    activations, offloaded = savers.activations(chunks * k, k, dims.activation_numel * dims.dtype_bytes,
                                                chunk_layers, lambda layers: working_set_bytes(dims, layers))
    # a gradient in another dtype than the compute's is born in a scratch of one layer or chunk
    scratch = (dims.layer_numel if savers.layerwise else chunk) * dims.dtype_bytes \
        if dims.grad_bytes != dims.dtype_bytes else 0
    return MemoryEstimate(
        persistent=0.0 if savers.offload_state else state,
        staging=chunk * (weight_bufs * dims.dtype_bytes + grad_bufs * dims.grad_bytes) + scratch,
        replicated=16 * dims.replicated_numel,
        activations=activations,
        host=(state if savers.offload_state else 0.0) + offloaded,
    )


def rank_memory(plan: Plan, rank: int, *, chunk_numel: Sequence[int], replicated_numel: int, weight_bytes: int,
                grad_bytes: int, scratch_bytes: int, shape: ModelDims | None = None, chunked_loss: bool = False,
                savers: Savers = Savers()) -> MemoryEstimate:
    """``rank``'s memory as the engine lays it out for ``plan`` (``tawpipe.engine.storage``): its
    own chunk's float32 master, gradient accumulator and AdamW moments (16 B per parameter, counted
    from ``chunk_numel``, each chunk's parameters); one staging buffer of the largest chunk per
    buffer the plan names on this rank (but those ``in_place_gradients`` does without), weights
    in ``weight_bytes``, gradients in ``grad_bytes``,
    plus a scratch in ``scratch_bytes`` (0: none) when those differ, of one layer where the backward
    runs a layer at a time (``savers.recompute`` "layer" or "block"); the replicated parameters at
    16 B each (the gradient norm takes no copy: ``engine.precision.squared_norm``).
    Activations of one micro-batch of ``shape`` (its sequence a rank's slice), in ``weight_bytes``:
    the saved chunk inputs, one chunk's working set (``working_set_bytes``) and what the head and
    loss hold (``loss_bytes``: plain or ``chunked_loss``); none where the batch is not known
    (``shape`` None: the engine before its first batch). ``savers`` move the own chunk's state and
    the chunk inputs to ``host``; what crosses to and from it per iteration is ``host_traffic``
    (``host_bytes``; the chunk inputs only where ``shape`` is known)."""
    own = chunk_numel[plan.own_chunk(rank)]
    largest = max(chunk_numel)
    names = {b for a in plan.actions[rank] for b in (a.buf, a.grad_buf) if b}
    names -= in_place_gradients(plan, rank, grad_bytes, savers)
    per_element = {BufKind.WEIGHTS: weight_bytes, BufKind.GRADS: grad_bytes, BufKind.STATE: 4}
    chunk_layers = max(b - a for a, b in plan.chunk_layers)
    scratch = largest // chunk_layers if savers.layerwise else largest
    staging = largest * sum(per_element[buf_kind(b)] for b in names) + scratch * scratch_bytes
    activations = offloaded = input_bytes = 0.0
    if shape is not None:
        dims = dataclasses.replace(shape, dtype_bytes=weight_bytes)
        k, input_bytes = int(plan.options.get("mb_per_fetch", 1)), dims.activation_numel * weight_bytes
        activations, offloaded = savers.activations(plan.replica_size * k, k, input_bytes, chunk_layers,
                                                    lambda layers: working_set_bytes(dims, layers))
        activations += loss_bytes(dims, chunked=chunked_loss)
    state = 0.0 if savers.offload_state else 16 * own
    traffic = host_bytes(plan, rank, own_numel=own, weight_bytes=weight_bytes, grad_bytes=grad_bytes,
                         input_bytes=input_bytes, savers=savers)
    stashed = stashed_bytes(plan, rank, chunk_numel.__getitem__, weight_bytes)
    return MemoryEstimate(persistent=state, staging=staging, replicated=16 * replicated_numel,
                          activations=activations, host=(0.0 if state else 16 * own) + offloaded + stashed,
                          host_traffic=sum(traffic))


def in_place_gradients(plan: Plan, rank: int, grad_bytes: int, savers: Savers) -> frozenset[str]:
    """The gradient buffers ``rank`` does without (``Plan.accumulated_in_place``): its backwards
    add into the own float32 accumulator instead, where that is on the device (not
    ``offload_state``) and gradients are float32 (``grad_bytes`` 4) as it is, so that a gradient
    lands there as it would in the buffer: directly, or through the scratch it is born in."""
    return plan.accumulated_in_place(rank) if _adds_in_place(grad_bytes, savers) else frozenset()


def _adds_in_place(grad_bytes: int, savers: Savers) -> bool:
    """Whether a backward can add into the own accumulator: on the device, in its dtype."""
    return not savers.offload_state and grad_bytes == 4


def host_bytes(plan: Plan, rank: int, *, own_numel: int, weight_bytes: int, grad_bytes: int, input_bytes: float,
               savers: Savers) -> tuple[float, float]:
    """Bytes ``rank`` moves to and from host memory in one iteration of ``plan``: each STASH_W
    and RESTORE_W of the plan moves its chunk's weights (``weight_bytes`` per parameter); with
    ``offload_state`` each of its LOAD_W reads the own float32 master (4 B per own parameter, cast
    on the device) and each ACC_G sends a gradient (``grad_bytes`` per own parameter); with
    ``offload_activations`` each forward stores what it keeps (its chunk input, or with
    ``recompute="block"`` every layer's; ``input_bytes``: B·S·H in the compute dtype) and each
    backward fetches it back."""
    count = Counter((a.op, a.chunk) for a in plan.actions[rank])  # one pass: the map asks for many plans

    def layers(op: Op) -> int:
        return sum(n * (plan.chunk_layers[c][1] - plan.chunk_layers[c][0]) for (o, c), n in count.items() if o is op)

    def ops(op: Op) -> int:
        return sum(n for (o, _), n in count.items() if o is op)

    to_host = from_host = 0.0
    if plan.options.get("reuse_weights") == HOST:  # only it stashes
        to_host += layers(Op.STASH_W) * int(plan.options.get("layer_numel", 1)) * weight_bytes
        from_host += layers(Op.RESTORE_W) * int(plan.options.get("layer_numel", 1)) * weight_bytes
    if savers.offload_state:
        to_host += ops(Op.ACC_G) * grad_bytes * own_numel
        from_host += ops(Op.LOAD_W) * 4 * own_numel
    if savers.offload_activations:  # what each forward keeps goes, and comes back for its backward
        kept = sum(n * savers.kept_per_forward(plan.chunk_layers[c][1] - plan.chunk_layers[c][0])
                   for (o, c), n in count.items() if o is Op.F) * input_bytes
        to_host += kept
        from_host += kept
    return to_host, from_host


def busiest_rank_memory(plan: Plan, **sizes: Any) -> MemoryEstimate:
    """The largest ``rank_memory(plan, rank, **sizes)`` over one replica's ranks (the other
    replicas repeat them): a figure every rank computes alike, so that ``auto`` can decide on it."""
    return max((rank_memory(plan, r, **sizes) for r in range(plan.replica_size)), key=lambda m: m.total)


Choice = tuple[int, int, bool | str]  # (k, prefetch depth, reuse_weights)


def _key(choice: Choice) -> tuple[int, int, int]:
    """A choice as a sort key: the smaller k and depth first, then no reuse, reuse, reuse with the host."""
    k, d, reuse = choice
    return k, d, REUSE.index(reuse)


def fitting(options: dict[Choice, tuple[float, MemoryEstimate]], budget: float) -> tuple[int | None, Choice | None]:
    """Among ``options`` (busiest node's inter-node bytes and memory per choice), those whose
    memory fits ``budget`` bytes: the largest k, and the choice with the fewest bytes (the least
    memory among equals). None where nothing fits."""
    fits = {c: v for c, v in options.items() if v[1].total <= budget}
    if not fits:
        return None, None
    return max(k for k, _, _ in fits), min(fits, key=lambda c: (fits[c][0], fits[c][1].total))


AUTO = "auto"
# Left out of the budget "auto" chooses within: the allocator's slack and, in the engine (which
# sees no batch before its first step), the activations.
MARGIN = 0.1
# auto builds every candidate's plan while their forwards and backwards add up to at most this
# many (a few seconds of one core); past it, it builds them in the order of design §7.4's closed
# form of their bytes and takes the first that fits.
AUTO_BUILD_COMPUTE_ACTIONS = 300_000


class NothingFits(ValueError):
    """No choice fits the budget; ``least`` is the one that takes the least memory."""

    def __init__(self, message: str, least: Choice) -> None:
        super().__init__(message)
        self.least = least


def describe(choice: Choice, resident: int | None = None) -> str:
    """A choice as the summaries print it: ``k=2, resident depth 3, reuse``."""
    k, d, reuse = choice
    reused = {False: "no reuse", True: "reuse", HOST: "reuse, the rest kept on the host"}[reuse]
    return f"k={k}, {'resident ' if reuse is True and d == resident else ''}depth {d}, {reused}"


def choose(options: Mapping[Choice, tuple[float, MemoryEstimate]], budget: float, *, resident: int | None = None,
           budget_text: str = "") -> tuple[Choice, str]:
    """What ``"auto"`` takes among ``options`` (per choice: the busiest node's inter-node bytes per
    iteration, and the busiest rank's memory): the fewest bytes among the choices whose memory fits
    ``budget`` bytes, then the fewest bytes to and from the host (``host_traffic``: with offloaded
    state, a gradient sent to it per round of k micro-batches), then the least memory, then the
    smaller k and depth, reuse only where it saves bytes. A pure function of its arguments, so
    that ranks given the same numbers choose alike (and the simulator can ask it too). Returns
    the choice and why, one line; NothingFits, naming the options that fix it, where nothing fits. ``resident``: the resident depth, named
    as such; ``budget_text``: where the budget comes from."""
    def order(c: Choice) -> tuple:
        return options[c][0], options[c][1].host_traffic, options[c][1].total, _key(c)

    within = _within(budget, budget_text)
    fits = sorted((c for c in options if options[c][1].total <= budget), key=order)
    if not fits:
        least = min(options, key=lambda c: (options[c][1].total, options[c][0], _key(c)))
        raise NothingFits(
            f"no schedule fits {within}: the least memory, {describe(least, resident)}, takes "
            f"{gib(options[least][1].total)} per rank; if the ranks have more, say how much with MemoryPolicy.budget, "
            "or give mb_per_fetch, prefetch_depth and reuse_weights yourself", least)
    best = fits[0]
    inter, memory = options[best][0], f"{gib(options[best][1].total)} per rank"
    if len(fits) == 1:
        why = f"the only choice that fits: {memory} {within}"
    elif all(options[c][0] == inter for c in fits):
        host = options[best][1].host_traffic
        fewest = (f"the fewest bytes to and from the host ({decimal(host)}/iter), then "
                  if any(options[c][1].host_traffic != host for c in fits) else "")
        why = (f"with any that fits the busiest node sends {decimal(inter)}/iter to other nodes: {fewest}the least "
               f"memory, {memory} {within}")
    else:
        why = (f"the fewest inter-node bytes (the busiest node sends {decimal(inter)}/iter to other nodes), "
               f"{memory} {within}")
    cheapest = min(options, key=order)
    if options[cheapest][0] < inter:
        why += (f"; {describe(cheapest, resident)} would move {decimal(options[cheapest][0])} but takes "
                f"{gib(options[cheapest][1].total)}")
    return best, f"{describe(best, resident)} — {why}"


def candidates(micro_batches: int, *, mb_per_fetch: int | str = AUTO, prefetch_depth: int | str = AUTO,
               reuse_weights: bool | str = AUTO, weights_on_host: bool = False) -> list[tuple[int, int | str, bool | str]]:
    """The (k, depth, reuse) that ``auto`` weighs, the given values kept: every k that divides
    ``micro_batches``; depth 1 without and with reuse (and ``weights_on_host``: with the rest of
    the fetched chunks kept on the host), and the resident depth (with reuse, which it needs; the
    host then keeps nothing). Given values that cannot go together stay, so that ``build_plan``
    names them."""
    ks = divisors(micro_batches) if mb_per_fetch == AUTO else [mb_per_fetch]
    depths = [1, RESIDENT] if prefetch_depth == AUTO else [prefetch_depth]
    reuses = [False, True, *[HOST] * weights_on_host] if reuse_weights == AUTO else [reuse_weights]
    chosen = AUTO in (prefetch_depth, reuse_weights)
    return [(k, d, r) for d in depths for r in reuses for k in ks if d != RESIDENT or r is True or not chosen]


def auto_plan(topology: Topology, num_layers: int, micro_batches: int, *, memory: Callable[[Plan], MemoryEstimate],
              budget: float, budget_text: str = "", strict: bool = True, mb_per_fetch: int | str = AUTO,
              prefetch_depth: int | str = AUTO, reuse_weights: bool | str = AUTO, built: dict | None = None,
              weights_on_host: bool = False, **plan_args: Any) -> tuple[Plan, str | None]:
    """``build_plan(topology, num_layers, micro_batches, **plan_args)`` with the options left
    ``"auto"`` chosen by ``choose`` among ``candidates``: each candidate's plan is built, its
    busiest node's inter-node bytes counted (``busiest_node_sent``) and its memory taken from
    ``memory(plan)`` (the busiest rank's). Large plans are built in the order of their closed-form
    bytes, (f_w·b_w + b_g)/k (design §7.4), until one fits. Returns the plan and why it was
    chosen (None: every option was given). Where nothing fits, NothingFits if ``strict`` (a
    budget the user gave); otherwise the least memory, for the caller's own check to judge. Every
    option given and a ``strict`` budget they exceed: NothingFits too. ``built``: plans and their
    traffic already counted, by options, shared between calls that differ in ``memory`` only.
    ``weights_on_host``: weigh ``reuse_weights="host"`` too (a device that is not the host, whose
    host memory holds what the plan stashes; the memory counted is the device's)."""
    built = {} if built is None else built

    def build(**options: Any) -> Plan:
        key = tuple(sorted(options.items()))
        if key not in built:
            built[key] = build_plan(topology, num_layers, micro_batches, **plan_args, **options)
        return built[key]

    def fixed(options: dict[str, Any], why: str | None, fix: str) -> tuple[Plan, str | None]:
        """The plan of ``options``, nothing left to choose; held to a ``strict`` budget."""
        plan = build(**options)
        if strict and (need := memory(plan).total) > budget:
            raise NothingFits(f"{', '.join(f'{n}={v}' for n, v in options.items())} take {gib(need)} per rank, more "
                              f"than {_within(budget, budget_text).removeprefix('within ')}: {fix}",
                              tuple(options.values()))
        return plan, why

    asked = {"mb_per_fetch": mb_per_fetch, "prefetch_depth": prefetch_depth, "reuse_weights": reuse_weights}
    given = {name: v for name, v in asked.items() if v != AUTO}
    if len(given) == len(asked):
        return fixed(asked, None, 'leave them "auto" to choose what fits, or give a larger MemoryPolicy.budget')
    shown = {"mb_per_fetch": f"k={mb_per_fetch}", "prefetch_depth": f"depth {prefetch_depth}",
             "reuse_weights": {True: "reuse", HOST: "reuse with the host"}.get(reuse_weights, "no reuse")}
    note = f" ({', '.join(shown[n] for n in given)} given)" if given else ""
    algo = plan_args.get("algo", "tawpipe")
    if not registry.get(algo).tunable:
        return fixed({"mb_per_fetch": 1, "prefetch_depth": 1, "reuse_weights": False, **given},
                     f"{describe((1, 1, False))} — {algo} runs the paper's settings only{note}",
                     f"{algo} runs the paper's settings only: give a larger MemoryPolicy.budget")
    todo = candidates(micro_batches, **asked, weights_on_host=weights_on_host)
    computes = compute_actions(topology, micro_batches, plan_args.get("replicas", 1))
    large = computes * len(todo) > AUTO_BUILD_COMPUTE_ACTIONS
    if large:
        wb, gb = plan_args.get("weight_bytes", 2), plan_args.get("grad_bytes", 4)
        todo.sort(key=lambda c: (((1 if (c[1] == RESIDENT and c[2]) or c[2] == HOST else 2) * wb + gb) / c[0],
                                 not c[2], c[2] == HOST))
        note += " (a large plan: candidates built in the closed form's order of bytes, the first that fits taken)"
    options: dict[Choice, tuple[float, MemoryEstimate]] = {}
    plans: dict[Choice, Plan] = {}
    for k, d, r in todo:
        plan = build(mb_per_fetch=k, prefetch_depth=d, reuse_weights=r)
        choice = (k, int(plan.options["prefetch_depth"]), r)
        if choice not in options:  # the resident depth may be a depth already weighed
            options[choice], plans[choice] = (_inter_node(built, plan), memory(plan)), plan
        if large and options[choice][1].total <= budget:
            break
    resident = resident_depth(Topology(topology.nodes // plan_args.get("replicas", 1), topology.per_node))
    try:
        choice, why = choose(options, budget, resident=resident, budget_text=budget_text)
    except NothingFits as e:
        if strict:
            raise
        choice = e.least
        why = (f"{describe(choice, resident)} — the least memory, {gib(options[choice][1].total)} per rank: by this "
               f"estimate nothing fits {_within(budget, budget_text)}")
    return plans[choice], why + note


def _within(budget: float, budget_text: str) -> str:
    shown = f"within {gib(budget)} per rank" if math.isfinite(budget) else "with no known memory limit"
    return f"{shown} ({budget_text})" if budget_text else shown
