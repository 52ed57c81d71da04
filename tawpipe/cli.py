"""The ``tawpipe`` command line.

Each subcommand is registered by one ``_add_<name>(subparsers)`` function listed in
``_SUBCOMMANDS``. ``plan`` lives here. ``train``, ``bench``, ``cluster`` and ``simulate`` belong to
``tawpipe.train``, ``tawpipe.bench``, ``tawpipe.cluster`` and ``tawpipe.simulate``, which are
imported only when their subcommand runs (``tawpipe.commands``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import sys
from collections.abc import Callable, Sequence

from .commands import (Parser, UsageError, add_reuse_weights, as_flags, delegate, int_at_least, prefetch_depth, refuse,
                       reuse_flag)
from .cost.memory import (AUTO, Choice, MemoryEstimate, NothingFits, Savers, auto_savers_plan, estimate_memory,
                          fitting, memory_per_rank, savers_to_weigh)
from . import models
from .cost.traffic import KINDS, LAYER_KINDS, busiest_node_sent, estimate, methods, plan_traffic
from .models.presets import PRESETS
from .models.shape import ModelDims
from .plan import registry
from .plan.plan import GRAD_ROUTES, Plan
from .plan.schedule import HOST, RESIDENT, build_plan, check_depth_gains, check_replicas, compute_actions, depth_text
from .plan.topology import Topology, divisors
from .plan.verify import VerifyReport, verify
from .sim.hardware import LINKS, Link, link


_COUNT = int_at_least(1)  # every count and size of the plan's flags


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="print the schedule of one iteration and its traffic",
        description="Build, verify and print the plan of one iteration (the same plan the engine runs).",
    )
    p.add_argument("--nodes", type=_COUNT, help="number of groups G (one per node); required")
    p.add_argument("--per-node", type=_COUNT, help="devices per group s; required")
    p.add_argument("--layers", type=_COUNT,
                   help="decoder layers L (>= G x s / --replicas: a layer per rank of a pipeline); default: --model's")
    p.add_argument("--micro-batches", type=_COUNT, help="micro-batches per device; required")
    p.add_argument("--algo", choices=registry.names(), default="tawpipe",
                   help="the schedule: TawPipe, or the WeiPipe ring baseline")
    p.add_argument("--grad-route", choices=GRAD_ROUTES, default="rail",
                   help="router of inter-node gradients: the owner's rail peer, or local index 0")
    p.add_argument("--prefetch-depth", type=prefetch_depth, default=1,
                   help="fetch weights this many slots ahead; 'resident' (with --reuse-weights): enough that "
                        "every fetched chunk stays, the fewest bytes")
    p.add_argument("--mb-per-fetch", type=_COUNT, default=1,
                   help="k: micro-batches each resident chunk runs per fetch (divides --micro-batches)")
    add_reuse_weights(p, default=False, help="do not fetch again a chunk still in a staging buffer (fewer bytes "
                                             "than the paper); 'host': and keep the fetched chunks the buffers cannot "
                                             "in host memory, so each crosses the network once per iteration")
    p.add_argument("--replicas", type=_COUNT, default=1,
                   help="R: the nodes form R replicas of nodes/R nodes, each a pipeline; a chunk's R owners add "
                        "their gradients once per iteration (with a model, every R is compared)")
    p.add_argument("--inter", default="10gbe", type=_link,
                   help=f"inter-node link per node and direction, for link times: {', '.join(LINKS)} or a rate like "
                        "25gbit")
    p.add_argument("--json", action="store_true",
                   help="print a JSON summary instead (the plan without its actions, what verify proved, traffic)")
    p.add_argument("--actions", action="store_true",
                   help="with --json: print the whole plan instead, with replica 0's actions (Plan.from_json reads it)")
    p.add_argument("--no-table", action="store_true", help="print only the summary")
    m = p.add_argument_group("model (optional: gives sizes in bytes, memory per k and the peer estimates)")
    m.add_argument("--model", help=f"a built-in model ({', '.join(PRESETS)}) or a Hugging Face config.json; "
                                   "--layers, if given, overrides its layer count")
    m.add_argument("--hidden", type=_COUNT, help="hidden size H (a model of your own, instead of --model)")
    m.add_argument("--heads", type=_COUNT, default=32, help="attention heads (with --hidden)")
    m.add_argument("--kv-heads", type=_COUNT, default=None, help="key/value heads (with --hidden; default: --heads)")
    m.add_argument("--head-dim", type=_COUNT, default=None, help="size of a head (with --hidden; default: H / --heads)")
    m.add_argument("--vocab", type=_COUNT, default=32000, help="vocabulary size (with --hidden)")
    m.add_argument("--seq-len", type=_COUNT, default=4096, help="tokens per sequence")
    m.add_argument("--micro-batch-size", type=_COUNT, default=1, help="sequences per micro-batch")
    m.add_argument("--dtype-bytes", type=_COUNT, default=2, help="bytes per weight/activation element")
    m.add_argument("--grad-bytes", type=_COUNT, default=4, help="bytes per gradient element on the wire")
    m.add_argument("--memory-budget", type=float, default=None, metavar="GiB",
                   help="GiB per rank: suggest the largest k, and the k and prefetch depth with the "
                        "fewest inter-node bytes, whose estimated memory fits; and what 'auto' (the default of "
                        "tawpipe train and the engine) chooses within it")
    m.add_argument("--recompute", choices=("chunk", "layer", "block", "none", "auto"), default="chunk",
                   help="what the memory counts a backward running again (as tawpipe train's flag); auto, with "
                        "--memory-budget: of the memory savers that fit, offloads included, those that move the "
                        "fewest inter-node bytes, then the fastest")
    m.add_argument("--offload-state", action="store_true", help="count the own chunk's 16 B per parameter on the host")
    m.add_argument("--offload-activations", action="store_true",
                   help="count what the forwards keep for their backwards on the host")
    p.set_defaults(run=functools.partial(_run_plan, p))


def _link(spec: str) -> Link:
    """--inter's value: a link of the simulator's presets or a rate."""
    try:
        return link(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dims_and_sizes(args: argparse.Namespace) -> tuple[ModelDims | None, dict]:
    """The model of --model or --hidden, and the sizes ``build_plan`` counts bytes with; without
    one, every layer one element of one byte (the traffic is then counted in layers)."""
    batch = dict(seq=args.seq_len, micro_batch=args.micro_batch_size, dtype_bytes=args.dtype_bytes,
                 grad_bytes=args.grad_bytes)
    if args.model is not None and args.hidden is not None:
        raise ValueError("--model and --hidden both give the model: use one")
    if args.model is None and args.layers is None:
        raise ValueError("the following arguments are required: --layers (or --model)")
    if args.model is not None:
        dims = models.dims(args.model, **batch)
        dims = dims if args.layers is None else dataclasses.replace(dims, layers=args.layers)
    elif args.hidden is not None:
        dims = ModelDims(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                         head_dim=args.head_dim, vocab=args.vocab, **batch)
    else:
        return None, dict(layer_numel=1, weight_bytes=1, grad_bytes=1, replicated_numel=0)
    return dims, dict(layer_numel=dims.layer_numel, weight_bytes=dims.dtype_bytes,
                      grad_bytes=dims.grad_bytes, replicated_numel=dims.replicated_numel)


def _run_plan(parser: Parser, args: argparse.Namespace, rest: Sequence[str]) -> int:
    parser.refuse_unknown(rest)  # before the required ones: a mistyped flag is named as such
    missing = [f for f in ("--nodes", "--per-node", "--micro-batches") if getattr(args, f[2:].replace("-", "_")) is None]
    if missing:
        raise UsageError(f"the following arguments are required: {', '.join(missing)}")
    if args.memory_budget is not None and not (math.isfinite(args.memory_budget) and args.memory_budget > 0):
        raise UsageError(f"--memory-budget must be a finite number of GiB > 0, got {args.memory_budget}")
    try:
        topo = Topology(args.nodes, args.per_node)
        _savers(args)  # savers that go together, before any plan is built
        _refuse_unused(parser, args)
        _check_plan_size(topo, args.micro_batches, args.replicas)
        check_depth_gains(topo, args.prefetch_depth, args.replicas)
        dims, sizes = _dims_and_sizes(args)
        args.layers = dims.layers if dims is not None else args.layers
        build = functools.partial(build_plan, topo, args.layers, args.micro_batches, algo=args.algo,
                                  grad_route=args.grad_route, replicas=args.replicas, **sizes)
        plan = build(mb_per_fetch=args.mb_per_fetch, prefetch_depth=args.prefetch_depth,
                     reuse_weights=args.reuse_weights)
        if args.actions and not args.json:
            raise ValueError("--actions lists the plan's actions in its JSON: add --json")
    except ValueError as e:
        raise UsageError(as_flags(str(e))) from None
    gc.freeze()  # the plan lives to the end: the collector need not walk its millions of objects again
    try:
        return _report_plan(args, topo, dims, sizes, build, plan)
    finally:
        # the collector as it was: in a caller's process (a test, a notebook) what was frozen with
        # the plan would otherwise never be collected (cycles other libraries left, kept to exit)
        gc.unfreeze()


def _report_plan(args: argparse.Namespace, topo: Topology, dims: ModelDims | None, sizes: dict,
                 build: Callable[..., Plan], plan: Plan) -> int:
    """The plan's proof, table, traffic and, with a model, its memory, the k and replica advice and
    the other schedules' traffic."""
    report = verify(plan)
    if args.json:
        memory = _json_memory(args, dims, sizes, build, plan) if dims is not None and not args.actions else None
        print(plan.to_json() if args.actions else _json_summary(plan, report, dims, memory))
        return 0
    if not args.no_table:
        if plan.replicas > 1:
            print(f"replica 0 of {plan.replicas} (ranks 0-{plan.replica_size - 1}); replica i runs the same plan on "
                  f"ranks + i x {plan.replica_size}")
        print(plan.table())
        print()
    layers = [stop - start for start, stop in (plan.chunk_layers[k] for k in plan.model_order)]
    schedule = registry.get(args.algo)
    route = f", gradient route {args.grad_route}" if schedule.routes_gradients else ""
    print(f"{args.algo}: {topo.nodes} nodes x {topo.per_node} devices, {plan.num_layers} layers in "
          f"chunks of {layers} (model order), {plan.micro_batches} micro-batches{route}, prefetch depth "
          f"{depth_text(plan, args.prefetch_depth)}, "
          f"{args.mb_per_fetch} micro-batch(es) per fetch"
          f"{', resident chunks reused' if args.reuse_weights else ''}"
          f"{', the rest kept on the host' if args.reuse_weights == HOST else ''}, "
          f"{plan.num_slots - 1} slots as tabled, a prologue and the step's slot"
          f"{f'; {plan.replicas} replicas of {plan.replica_size} ranks' if plan.replicas > 1 else ''}")
    ranks = (f" on replica 0's {report.ranks_run} ranks, the other replicas proven its shifts"
             if report.ranks_run < topo.world_size else "")
    print(f"verified (serial and channel models{ranks}): {report.actions} actions, {report.p2p_messages} P2P "
          f"messages, {report.collectives} collectives, {report.weight_buffers} weight and "
          f"{report.grad_buffers} gradient buffers per rank, {report.contributions} gradient "
          "contributions delivered, no deadlock")
    traffic = plan_traffic(plan)
    print("traffic per iteration (sent, bytes):" if dims else
          "traffic per iteration (sent, in layers of weights or gradients; --model or --hidden gives bytes, "
          "and the replicated modules' and the step statistics' traffic):")
    print(traffic.summary(in_bytes=dims is not None))
    if dims is not None:
        floor, bursts = traffic.link_seconds(args.inter.rate)
        print(f"inter-node link {args.inter.name} ({args.inter.rate * 8 / 1e9:g} Gbit/s) per node and direction: "
              f"floor {floor:.3f} s "
              f"(busiest link's bytes), per-slot bursts {bursts:.3f} s (each slot's busiest link, summed)")
        if schedule.tunable:
            _print_k_table(args, dims, sizes, build, plan)
            _print_replicas(args, dims, topo)
        plans = {args.algo: plan}
        for other in registry.names():  # every other schedule at its own defaults (the paper's settings)
            if other not in plans and topo.world_size >= registry.get(other).min_ranks:
                plans[other] = build(algo=other)
        _print_peers(args, dims, topo, plans)
    return 0


_MODEL_ONLY = ("seq_len", "micro_batch_size", "dtype_bytes", "grad_bytes", "memory_budget", "recompute", "offload_state",
               "offload_activations", "inter")  # what only a model's sizes give a meaning to
_OWN_MODEL = ("heads", "kv_heads", "head_dim", "vocab")  # what describes a model of --hidden


def _refuse_unused(parser: Parser, args: argparse.Namespace) -> None:
    """ValueError for a flag this command would ignore: a size without a model, or a model's shape
    beside --model (which gives its own)."""
    if args.model is None and args.hidden is None and (given := parser.given(args, _MODEL_ONLY + _OWN_MODEL)):
        raise ValueError(f"{given[0]} needs a model to count with: add --model NAME or --hidden H "
                         "(without one the plan's traffic is counted in layers)")
    if args.model is not None and (own := parser.given(args, _OWN_MODEL)):
        raise ValueError(f"{own[0]} describes a model of your own (with --hidden); --model {args.model} "
                         "gives its own: drop it")


# One pipeline's plan holds 2 x ranks^2 x micro-batches forwards and backwards (and about twice
# as many transfers); 16 x 8 ranks at 64 micro-batches (2.1 M, 6.1 M actions in all) is built,
# proven and summed up in about 22 s of one core and 1.2 GB, so the limit takes about 45 s and 2.3 GB.
# The k table's plans (every k at two depths, built and counted, not proven) hold at most as many
# in all, or it shows the asked row alone.
MOST_COMPUTE_ACTIONS = 4_000_000


def _check_plan_size(topo: Topology, micro_batches: int, replicas: int) -> None:
    """Refuse, before building it, a plan too large for this machine, naming the way out."""
    n = check_replicas(topo, replicas)
    computes = compute_actions(topo, micro_batches, replicas)
    if computes > MOST_COMPUTE_ACTIONS:
        fits = [r for r in divisors(topo.nodes)
                if r >= replicas and compute_actions(topo, micro_batches, r) <= MOST_COMPUTE_ACTIONS]
        fewer = " or fewer --micro-batches" if micro_batches > 1 else ""
        most = MOST_COMPUTE_ACTIONS // compute_actions(topo, 1, topo.nodes)  # micro-batches at one node per replica
        way = (f"run the nodes as replicas (--replicas {fits[0]}){fewer}" if fits else
               f"use at most {most} --micro-batches with --replicas {topo.nodes}" if most else
               f"even one node of {topo.per_node} ranks is too large a pipeline to build here")
        raise ValueError(f"one pipeline of {n} ranks at {micro_batches} micro-batches holds {computes:,} forwards and "
                         f"backwards (2 x ranks^2 x micro-batches), more than the {MOST_COMPUTE_ACTIONS:,} this command "
                         f"builds: {way}")


def _k_options(args: argparse.Namespace, dims: ModelDims, build: Callable[..., Plan], plan: Plan
               ) -> tuple[dict[Choice, tuple[float, MemoryEstimate, int | str]], str]:
    """The busiest node's inter-node bytes and the memory per rank for every k, at the given
    prefetch depth and with every chunk resident (with the depth as asked, for the labels); and
    why only ``plan``'s row is there, where the others' plans together would hold more forwards
    and backwards than this command builds (it would take minutes), else ""."""
    ks = divisors(args.micro_batches)
    depths = [(args.prefetch_depth, args.reuse_weights)]
    if args.prefetch_depth != RESIDENT:
        depths.append((RESIDENT, True))
    computes = compute_actions(plan.topology, plan.micro_batches, plan.replicas)
    left_out = ""
    if computes * len(ks) * len(depths) > MOST_COMPUTE_ACTIONS:
        ks, depths = [args.mb_per_fetch], depths[:1]
        left_out = (f"the other k and depths left out: their plans would hold {computes:,} forwards and backwards "
                    f"each, more than the {MOST_COMPUTE_ACTIONS:,} this command builds in all; give --mb-per-fetch "
                    "and --prefetch-depth to see one")
    options: dict[Choice, tuple[float, MemoryEstimate, int | str]] = {}
    for depth, reuse in depths:
        for k in ks:
            plan_k = build(mb_per_fetch=k, prefetch_depth=depth, reuse_weights=reuse) if left_out == "" else plan
            choice = (k, int(plan_k.options["prefetch_depth"]), reuse)
            if choice not in options:  # else the given depth is the resident one
                options[choice] = (busiest_node_sent(plan_k), memory_per_rank(plan_k, dims, _savers(args)),
                                   depth)
    return options, left_out


def _print_k_table(args: argparse.Namespace, dims: ModelDims, sizes: dict, build: Callable[..., Plan],
                   plan: Plan) -> None:
    """Bytes and memory for every k, at the given prefetch depth and with every chunk resident."""
    options, left_out = _k_options(args, dims, build, plan)
    if args.recompute == AUTO:
        print("memory counted with --recompute chunk (--recompute auto: the auto line weighs the other savers)")
    print(f"{'k':>4}  {'depth':>16}  {'inter-node/iter (busiest node)':>31}  {'staging/rank':>13}  "
          f"{'activations/rank':>17}  {'host/rank':>10}  {'memory/rank':>12}")
    for choice, (inter, e, depth) in options.items():
        print(f"{choice[0]:>4}  {_depth_label(choice, depth):>16}  {inter / 1e9:>28.3f} GB  "
              f"{e.staging / 2**30:>9.3f} GiB  {e.activations / 2**30:>13.3f} GiB  {e.host / 2**30:>6.3f} GiB  "
              f"{e.total / 2**30:>8.3f} GiB")
    if left_out:
        print(left_out)
    if args.memory_budget is not None:
        if not left_out:  # with one row, auto's line says what fits
            largest, cheapest = _fitting(args, options)
            if cheapest is None:
                print(f"within {args.memory_budget:g} GiB per rank: nothing fits, not even k=1")
            else:
                k, d, reuse = cheapest
                print(f"within {args.memory_budget:g} GiB per rank: largest k {largest}; fewest inter-node bytes "
                      f"with k={k}, --prefetch-depth {d}{f' {reuse_flag(reuse)}' if reuse else ''}")
        print("auto (tawpipe train's default): " + _auto_choice(args, dims, sizes))


def _savers(args: argparse.Namespace) -> Savers:
    """The memory savers the flags name ("auto": the given offloads, recompute "chunk")."""
    return Savers("chunk" if args.recompute == AUTO else args.recompute, args.offload_state, args.offload_activations)


def _fitting(args: argparse.Namespace, options: dict[Choice, tuple[float, MemoryEstimate, int | str]]
             ) -> tuple[int | None, Choice | None]:
    """``fitting`` of the k options within --memory-budget."""
    return fitting({c: v[:2] for c, v in options.items()}, args.memory_budget * 2**30)


def _json_memory(args: argparse.Namespace, dims: ModelDims, sizes: dict, build: Callable[..., Plan],
                 plan: Plan) -> dict:
    """--json's memory: this plan's bytes per rank; for a tunable schedule those of every k (the
    table's rows), and with --memory-budget what fits and what auto chooses (its lines)."""
    def bytes_of(e: MemoryEstimate) -> dict:
        return {**dataclasses.asdict(e), "total": e.total}

    doc: dict = {"per_rank": bytes_of(memory_per_rank(plan, dims, _savers(args)))}
    if registry.get(args.algo).tunable:
        options, left_out = _k_options(args, dims, build, plan)
        doc["options"] = [{"mb_per_fetch": k, "prefetch_depth": d, "reuse_weights": r, "inter_node_busiest_node": inter,
                           "per_rank": bytes_of(e)} for (k, d, r), (inter, e, _) in options.items()]
        if left_out:
            doc["options_left_out"] = left_out
        if args.memory_budget is not None:
            largest, cheapest = _fitting(args, options) if not left_out else (None, None)
            doc["budget"] = {
                "gib": args.memory_budget, "largest_mb_per_fetch": largest,
                "fewest_inter_node": dict(zip(("mb_per_fetch", "prefetch_depth", "reuse_weights"), cheapest))
                if cheapest else None,
                "auto": _auto_choice(args, dims, sizes)}
    return doc


def _auto_choice(args: argparse.Namespace, dims: ModelDims, sizes: dict) -> str:
    """What "auto" (the default of ``tawpipe train`` and the engine) chooses within --memory-budget,
    on this command's estimate of the memory (design §7.3), in flags; with --recompute auto, the
    memory savers too (``savers_ladder``)."""
    ladder = savers_to_weigh(args.recompute, args.offload_state, args.offload_activations)
    try:
        _, _, why = auto_savers_plan(ladder, functools.partial(memory_per_rank, dims=dims),
                                     topology=Topology(args.nodes, args.per_node), num_layers=args.layers,
                                     micro_batches=args.micro_batches, budget=args.memory_budget * 2**30,
                                     budget_text="--memory-budget", grad_route=args.grad_route,
                                     replicas=args.replicas, weights_on_host=True, **sizes)
    except NothingFits as e:
        why = str(e)
    return as_flags(why or "nothing left to choose: every option was given")


def _print_replicas(args: argparse.Namespace, dims: ModelDims, topo: Topology) -> None:
    """Per replica count R: the busiest node's inter-node bytes, the link floor and the memory per
    rank, in closed form (design §3.5, §7), at this k and depth, without reuse (the header says so
    where reuse was asked): a plan per R of a large cluster would take longer to build than the
    answer is worth."""
    k, depth = args.mb_per_fetch, args.prefetch_depth
    if depth == RESIDENT:
        return  # the closed form covers numbered depths
    rate = args.inter.rate
    budget = args.memory_budget * 2**30 if args.memory_budget is not None else None
    reuse = f", without {reuse_flag(args.reuse_weights)} (the closed form's)" if args.reuse_weights else ""
    print(f"replicas (closed form, k={k}, prefetch depth {depth}{reuse}; R divides the {topo.nodes} nodes):")
    print(f"{'R':>5}  {'ranks/pipeline':>14}  {'inter-node/iter (per node)':>27}  {'floor':>9}  {'memory/rank':>12}  fits")
    best = None
    for r in divisors(topo.nodes):
        size = topo.world_size // r
        if size > args.layers:
            print(f"{r:>5}  {size:>14}  {'':>27}  {'':>9}  {'':>12}  no: {args.layers} layers < {size} ranks")
            continue
        inter = estimate("tawpipe", dims, topo, args.micro_batches, replicas=r).inter_node_per_node
        mem = estimate_memory(dims, topo, replicas=r, prefetch_depth=depth, mb_per_fetch=k, savers=_savers(args)).total
        fits = budget is None or mem <= budget
        if fits and (best is None or inter < best[1]):
            best = (r, inter)
        print(f"{r:>5}  {size:>14}  {inter / 1e9:>24.3f} GB  {inter / rate:>7.3f} s  {mem / 2**30:>8.3f} GiB  "
              f"{'yes' if fits else 'no: over --memory-budget'}")
    if best is not None:
        print(f"fewest inter-node bytes{' within the budget' if budget is not None else ''}: --replicas {best[0]}")


def _json_summary(plan: Plan, report: VerifyReport, dims: ModelDims | None, memory: dict | None) -> str:
    """The plan without its actions, what verify proved, the traffic and, with a model, the memory:
    small at any size."""
    traffic = plan_traffic(plan)
    kinds = KINDS if dims is not None else LAYER_KINDS
    doc = {
        "format": "tawpipe-plan-summary/1",
        "plan": json.loads(plan.to_json(actions=False)),
        "verified": dataclasses.asdict(report),
        "traffic": {
            "sent_per_rank_mean": traffic.total(kind=kinds) / plan.topology.world_size,
            "inter_node_per_node": traffic.per_node(kind=kinds),
            "by_kind_busiest_rank": {k: traffic.busiest(kind=k)[1] for k in kinds},
            "units": "bytes" if dims is not None else "layers",
        },
        **({"memory": memory} if memory is not None else {}),  # bytes per rank
    }
    return json.dumps(doc)


def _depth_label(choice: Choice, asked: int | str) -> str:
    _, d, reuse = choice
    return f"{d}{' host' if reuse == HOST else ' reuse' if reuse else ''}{' resident' if asked == RESIDENT else ''}"



def _print_peers(args: argparse.Namespace, dims: ModelDims, topo: Topology, plans: dict[str, Plan]) -> None:
    """The peers' closed forms, with the schedules counted from ``plans`` instead: at a few
    micro-batches their turnarounds and dropped ring sends make the closed forms 10-35% off."""
    print(f"peers on the same model and global batch ({dims.decoder_numel:,} decoder + {dims.replicated_numel:,} "
          f"replicated parameters; {' and '.join(plans)} counted from plans, the others closed form):")
    print(f"{'method':>10}  {'sent per rank':>14}  {'inter-node per node':>20}")
    for method in methods():
        if method in plans:  # counted on replica 0: every replica's ranks and nodes send what its do
            t = plan_traffic(plans[method], replica_zero=True)
            sent, inter = t.total() / plans[method].replica_size, max(t.per_node())
        else:
            e = estimate(method, dims, topo, args.micro_batches)
            sent, inter = e.sent_per_rank, e.inter_node_per_node
        print(f"{method:>10}  {sent / 1e9:>11.2f} GB  {inter / 1e9:>17.2f} GB")


_add_train = functools.partial(delegate, prog="tawpipe", name="train", module="tawpipe.train",
                               help="train a model with tawpipe")
_add_bench = functools.partial(delegate, prog="tawpipe", name="bench", module="tawpipe.bench",
                               help="benchmark tawpipe against its peers")
_add_cluster = functools.partial(delegate, prog="tawpipe", name="cluster", module="tawpipe.cluster",
                                 help="an emulated multi-node cluster on this machine (root)")
_add_simulate = functools.partial(delegate, prog="tawpipe", name="simulate", module="tawpipe.simulate",
                                  help="what TawPipe and its peers would do on a cluster you describe")
_SUBCOMMANDS = (_add_plan, _add_train, _add_bench, _add_cluster, _add_simulate)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tawpipe", description=(
        "Topology-aware weight pipeline parallelism for PyTorch: train a model with TawPipe (train), print and "
        "verify its schedule (plan), predict it and its peers on a cluster you describe (simulate), measure it "
        "(bench), and emulate a multi-node cluster on this machine (cluster)."))
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    except UsageError as e:
        return refuse(parser.prog, e)
    try:
        return args.run(args, rest)
    except UsageError as e:  # tawpipe plan's (the delegated commands print their own)
        return refuse(f"{parser.prog} {args.command}", e)
    except BrokenPipeError:  # `tawpipe plan ... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
