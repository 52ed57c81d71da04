"""The default "auto" schedule options (design §7.3): the pure chooser on hand-made options, on real
plans, in the engine (still exact against single-process training), in the fingerprint, in
checkpoints and in ``tawpipe train``'s summary."""

from __future__ import annotations

import argparse
import copy
from dataclasses import replace
import re
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_cases import refused
from engine_cases import (HIDDEN, MB_ROWS, SEQ, VOCAB, TinyLM, _engine, adamw, global_batch, lm_loss, make_engine,
                          reference_run, rel_err)
from tawpipe.cost import memory as cost_memory
from tawpipe.cost.memory import (MemoryEstimate, NothingFits, Savers, auto_plan, auto_savers_plan,
                                 busiest_rank_memory, candidates, choose, memory_per_rank, savers_ladder)
from tawpipe.models.shape import ModelDims
from tawpipe.engine import MemoryPolicy, fingerprint
from tawpipe.engine.auto import memory_budget
from tawpipe.io import checkpoint
from tawpipe.cost.traffic import plan_traffic
from tawpipe.plan.schedule import RESIDENT, build_plan
from tawpipe.plan.topology import Topology
from tawpipe.runtime.launch import run_local
from tawpipe.train import TrainConfig, job, preflight
from tawpipe.train.config import add_arguments
from test_engine_errors import NoComm

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30


def _gib(n: float) -> MemoryEstimate:
    return MemoryEstimate(persistent=n * GiB, staging=0, replicated=0, activations=0)


# the busiest node's inter-node bytes and the busiest rank's memory, made up
OPTIONS = {(1, 1, False): (9e6, _gib(1)), (1, 1, True): (9e6, _gib(1)), (2, 1, False): (5e6, _gib(2)),
           (2, 1, True): (5e6, _gib(2)), (2, 3, True): (3e6, _gib(4))}


def test_a_budget_that_fits_everything_takes_the_fewest_bytes():
    choice, why = choose(OPTIONS, 8 * GiB, resident=3, budget_text="--memory-budget")
    assert choice == (2, 3, True)
    assert why == ("k=2, resident depth 3, reuse — the fewest inter-node bytes (the busiest node sends 3.00 MB/iter "
                   "to other nodes), 4.00 GiB per rank within 8.00 GiB per rank (--memory-budget)")


def test_a_tight_budget_falls_back_to_a_smaller_k_or_depth():
    choice, why = choose(OPTIONS, 3 * GiB, resident=3)
    assert choice == (2, 1, False)  # reuse saves nothing here: the paper's fetches
    assert why.startswith("k=2, depth 1, no reuse — the fewest inter-node bytes (the busiest node sends 5.00 MB/iter")
    assert why.endswith("; k=2, resident depth 3, reuse would move 3.00 MB but takes 4.00 GiB")
    choice, why = choose(OPTIONS, 1.5 * GiB, resident=3)
    assert choice == (1, 1, False)
    assert "with any that fits the busiest node sends 9.00 MB/iter to other nodes: the least memory" in why


def test_nothing_fits_is_an_error_naming_the_options():
    with pytest.raises(NothingFits, match=r"no schedule fits within 512\.0 MiB per rank: the least memory, k=1, "
                                          r"depth 1, no reuse, takes 1\.00 GiB per rank; .*MemoryPolicy\.budget"
                                          r".*mb_per_fetch, prefetch_depth and reuse_weights") as e:
        choose(OPTIONS, 0.5 * GiB)
    assert e.value.least == (1, 1, False)


def test_where_no_bytes_cross_nodes_the_least_memory():
    options = {(1, 1, False): (0.0, _gib(1)), (2, 1, False): (0.0, _gib(2))}
    assert choose(options, 8 * GiB) == ((1, 1, False), "k=1, depth 1, no reuse — with any that fits the busiest node "
                                                       "sends 0 B/iter to other nodes: the least memory, 1.00 GiB per "
                                                       "rank within 8.00 GiB per rank")


def test_where_no_bytes_cross_nodes_the_fewest_host_bytes_then_the_least_memory():
    """With the state on the host each round of k micro-batches sends it a gradient: among equal
    inter-node bytes, fewer host bytes win over less memory."""
    options = {(1, 1, False): (0.0, replace(_gib(1), host_traffic=4e9)),
               (4, 1, False): (0.0, replace(_gib(2), host_traffic=1e9))}
    choice, why = choose(options, 8 * GiB)
    assert choice == (4, 1, False) and "the fewest bytes to and from the host (1.00 GB/iter), then the least" in why


@pytest.mark.parametrize("offload_state", [False, True])
def test_one_device_takes_no_gradient_buffer_and_with_host_state_the_fewest_host_sends(offload_state):
    """World size 1: nothing crosses a node, and the backwards add into the accumulator (no
    gradient buffer) or, with it on the host, into one buffer for every k; so k = 1 (one
    micro-batch's inputs kept) is the least memory; with the state on the host, k = acc sends the
    host one gradient per iteration instead of acc, the engine counts the same, and both train
    exactly like one process."""
    torch.manual_seed(0)
    model = TinyLM(2)
    ref, ref_losses = reference_run(model, 4 * MB_ROWS, 2, None)
    m = copy.deepcopy(model)
    engine = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=4,
                         optimizer=adamw, comm=NoComm(1), block_context=m.context, offload_state=offload_state)
    assert engine.mb_per_fetch == (4 if offload_state else 1), engine.auto_reason
    assert sum(name.startswith("g") for name in engine.memory_report().staging) == int(offload_state)
    losses = [engine.step(global_batch(step, 4 * MB_ROWS)) for step in range(2)]
    sent, _ = engine.host_traffic()
    own = engine.memory_report().master // 4
    assert sent == (2 * 4 * own if offload_state else 0)  # one float32 gradient a step
    want = dict(ref.named_parameters())
    assert max(rel_err(p.detach(), want[n].detach()) for n, p in engine.named_parameters()) <= 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    engine.close()


def test_candidates_keep_the_given_values():
    assert candidates(4) == [(k, d, r) for d, r in ((1, False), (1, True), (RESIDENT, True)) for k in (1, 2, 4)]
    assert candidates(4, mb_per_fetch=2) == [(2, 1, False), (2, 1, True), (2, RESIDENT, True)]
    assert candidates(2, prefetch_depth=RESIDENT) == [(1, RESIDENT, True), (2, RESIDENT, True)]  # resident: reuse
    assert candidates(2, reuse_weights=False) == [(1, 1, False), (2, 1, False)]
    assert candidates(2, prefetch_depth=RESIDENT, reuse_weights=False) == [(1, RESIDENT, False), (2, RESIDENT, False)]
    # off the CPU, depth 1 with the fetched chunks on the host too; the resident depth keeps none there
    assert candidates(2, weights_on_host=True) == [(k, d, r) for d, r in ((1, False), (1, True), (1, "host"),
                                                                         (RESIDENT, True)) for k in (1, 2)]
    assert candidates(2, reuse_weights="host", weights_on_host=True) == [(1, 1, "host"), (2, 1, "host")]


DIMS = ModelDims(hidden=256, layers=8, heads=8, vocab=512, seq=512, dtype_bytes=4, grad_bytes=4)
SIZES = dict(layer_numel=DIMS.layer_numel, weight_bytes=4, grad_bytes=4, replicated_numel=DIMS.replicated_numel)


def _auto(budget: float = math.inf, **kw):
    return auto_plan(Topology(2, 2), 8, 2, memory=lambda p: memory_per_rank(p, DIMS), budget=budget, **SIZES, **kw)


def test_auto_plan_on_real_plans():
    """2 x 2 with 2 micro-batches: k = 2 with every chunk resident moves the fewest bytes; a budget
    below its memory takes depth 1; given values are kept; WeiPipe is the paper's ring."""
    plan, why = _auto()
    assert (plan.options["mb_per_fetch"], plan.options["prefetch_depth"], plan.options["reuse_weights"]) == (2, 3, True)
    assert why.startswith("k=2, resident depth 3, reuse — the fewest inter-node bytes")
    resident = memory_per_rank(plan, DIMS).total
    depth1 = memory_per_rank(_auto(mb_per_fetch=2, prefetch_depth=1, reuse_weights=True)[0], DIMS).total
    assert depth1 < resident
    plan, why = _auto((depth1 + resident) / 2)
    assert (plan.options["mb_per_fetch"], plan.options["prefetch_depth"]) == (2, 1) and "would move" in why
    plan, why = _auto(mb_per_fetch=1)  # explicit values win
    assert plan.options["mb_per_fetch"] == 1 and why.endswith("(k=1 given)")
    assert _auto(mb_per_fetch=1, prefetch_depth=1, reuse_weights=False)[1] is None  # nothing left to choose
    plan, why = _auto(algo="weipipe")
    with pytest.raises(NothingFits, match=r"weipipe runs the paper's settings only: give a larger MemoryPolicy\.budget"):
        _auto(1.0, algo="weipipe")  # a schedule with nothing to choose is held to the budget too
    with pytest.raises(NothingFits, match=r"^mb_per_fetch=1, prefetch_depth=1, reuse_weights=False take .* more than"):
        _auto(1.0, mb_per_fetch=1, prefetch_depth=1, reuse_weights=False)  # so is one given whole
    assert [plan.options[n] for n in ("mb_per_fetch", "prefetch_depth", "reuse_weights")] == [1, 1, False]
    with pytest.raises(ValueError, match="reuse_weights=True"):
        _auto(prefetch_depth=RESIDENT, reuse_weights=False)  # the constraint stays
    with pytest.raises(ValueError, match="does not divide"):
        _auto(mb_per_fetch=3)
    with pytest.raises(NothingFits):
        _auto(1.0)
    plan, why = _auto(1.0, budget_text="measured", strict=False)  # a measured budget: the least memory
    assert why.startswith("k=1, depth 1, reuse — the least memory") and "nothing fits within" in why


def test_large_plans_are_built_in_the_closed_form_order_until_one_fits(monkeypatch):
    monkeypatch.setattr(cost_memory, "AUTO_BUILD_COMPUTE_ACTIONS", 0)
    built = []
    memory = lambda p: built.append(p.options) or memory_per_rank(p, DIMS)  # noqa: E731
    plan, why = auto_plan(Topology(2, 2), 8, 2, memory=memory, budget=math.inf, **SIZES)
    assert (plan.options["mb_per_fetch"], plan.options["prefetch_depth"]) == (2, 3) and len(built) == 1
    assert why.endswith("(a large plan: candidates built in the closed form's order of bytes, the first that fits "
                        "taken)")


def test_the_savers_ladder_runs_fastest_first_and_keeps_what_is_given():
    ladder = savers_ladder()
    assert [str(s) for s in ladder[:3]] == ["recompute none", "recompute chunk", "recompute block"]
    assert ladder.index(Savers("block", offload_activations=True)) < ladder.index(Savers("layer"))
    assert not any(s.offload_state for s in ladder[:7]) and all(s.offload_state for s in ladder[7:])
    assert all(s.offload_activations for s in savers_ladder(offload_activations=True))
    assert all(s.offload_state for s in savers_ladder(offload_state=True))
    # on the CPU the device is the host: an offload would free nothing, so none but those given
    assert not any(s.offload_state or s.offload_activations for s in savers_ladder(host_is_device=True))


SAVERS_DIMS = ModelDims(hidden=256, layers=8, heads=8, vocab=512, seq=4096, dtype_bytes=2, grad_bytes=4)
SAVERS_SIZES = dict(layer_numel=SAVERS_DIMS.layer_numel, weight_bytes=2, grad_bytes=4,
                    replicated_numel=SAVERS_DIMS.replicated_numel)


def _savers_auto(budget: float):
    return auto_savers_plan(savers_ladder(), lambda plan, savers: memory_per_rank(plan, SAVERS_DIMS, savers),
                            topology=Topology(2, 2), num_layers=8, micro_batches=2, budget=budget, **SAVERS_SIZES)


def _memory(savers: Savers, **options) -> float:
    plan = build_plan(Topology(2, 2), 8, 2, **SAVERS_SIZES, **options)
    return memory_per_rank(plan, SAVERS_DIMS, savers).total


def test_auto_takes_the_savers_whose_schedule_moves_fewest_bytes_then_the_fastest():
    plan, savers, why = _savers_auto(math.inf)
    assert savers == Savers("none") and why.startswith("recompute none: of the memory savers that fit")
    fewest = max(plan_traffic(plan).per_node())
    resident = dict(mb_per_fetch=2, prefetch_depth=RESIDENT, reuse_weights=True)
    # every graph kept no longer fits with every chunk resident: recompute does, at the same bytes
    budget = _memory(Savers("none"), **resident) * 0.99
    plan, savers, _ = _savers_auto(budget)
    assert savers == Savers("chunk") and max(plan_traffic(plan).per_node()) == fewest
    # nothing without the host's optimizer step fits even the smallest schedule: then it counts
    least = dict(mb_per_fetch=1, prefetch_depth=1, reuse_weights=False)
    lean = min(_memory(s, **least) for s in savers_ladder() if not s.offload_state)
    leaner = min(_memory(s, **least) for s in savers_ladder() if s.offload_state)
    assert leaner < lean  # 16 B per own parameter on the host
    plan, savers, _ = _savers_auto((lean + leaner) / 2)
    assert savers.offload_state and memory_per_rank(plan, SAVERS_DIMS, savers).total <= (lean + leaner) / 2
    with pytest.raises(NothingFits, match=r"^even with recompute layer, activations on the host, optimizer state on "
                                          r"the host: no schedule fits"):
        _savers_auto(1.0)


# ------------------------------------------------------------------------------------------ engine

def _engine_memory(plan, model: TinyLM) -> MemoryEstimate:
    """What the engine counts for a plan of ``model`` (float32): its state and staging, no batch."""
    return busiest_rank_memory(plan, chunk_numel=[(b - a) * _layer(model) for a, b in plan.chunk_layers],
                               replicated_numel=_replicated(model), weight_bytes=4, grad_bytes=4, scratch_bytes=0)


def _layer(model: TinyLM) -> int:
    return sum(p.numel() for p in model.blocks[0].parameters())


def _replicated(model: TinyLM) -> int:
    return sum(p.numel() for m in (model.embed, model.head) for p in m.parameters()) + 1  # + the loss sum


def _plan_of(model: TinyLM, budget: float, **given):
    """The plan the engine builds for ``model`` on 2 x 2 with 2 micro-batches, as the chooser says."""
    return auto_plan(Topology(2, 2), len(model.blocks), 2, memory=lambda p: _engine_memory(p, model), budget=budget,
                     layer_numel=_layer(model), weight_bytes=4, grad_bytes=4, replicated_numel=_replicated(model),
                     **given)[0]


def _choice(model: TinyLM, budget: float, **given) -> tuple[int, int, bool]:
    o = _plan_of(model, budget, **given).options
    return o["mb_per_fetch"], o["prefetch_depth"], o["reuse_weights"]


def auto_rank(rank: int, cases: list[dict]) -> list[dict]:
    """Each case: an engine with "auto" options against single-process training."""
    world, out = torch.distributed.get_world_size(), []
    for options in cases:
        torch.manual_seed(0)
        model = TinyLM(4)
        acc, rows, steps = 2, 2 * MB_ROWS, 2
        ref, ref_losses = reference_run(model, world * rows, steps, None)
        engine = _engine(copy.deepcopy(model), Topology(2, 2), acc, **options)
        losses = []
        for step in range(steps):
            x, y = global_batch(step, world * rows)
            losses.append(engine.step((x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])))
        want = dict(ref.named_parameters())
        out.append({"choice": (engine.mb_per_fetch, engine.prefetch_depth, engine.reuse_weights),
                    "why": engine.auto_reason, "losses": losses, "ref_losses": ref_losses,
                    "err": max(rel_err(p.detach(), want[n].detach()) for n, p in engine.named_parameters())})
        engine.close()
    return out


def test_the_engine_takes_the_choosers_pick_and_stays_exact():
    """Defaults on 2 x 2 (every option fits: the fewest bytes), a MemoryPolicy.budget that leaves out the
    resident depth, and a given k: each engine builds what the chooser says, and trains exactly
    like one process."""
    torch.manual_seed(0)
    model = TinyLM(4)
    fits_all = _choice(model, math.inf)
    resident = _engine_memory(_plan_of(model, math.inf), model).total
    depth1 = _engine_memory(_plan_of(model, math.inf, prefetch_depth=1), model).total
    budget = (depth1 + resident) / 2
    tight = _choice(model, budget)
    assert fits_all == (2, 3, True) and tight[:2] == (2, 1)
    cases = [{}, {"memory_budget": budget}, {"mb_per_fetch": 1}]
    results = run_local(auto_rank, 4, cases, timeout=240)
    for rank_results in results:
        default, budgeted, given = rank_results
        assert default["choice"] == fits_all
        assert default["why"].startswith("k=2, resident depth 3, reuse — the fewest")
        assert budgeted["choice"] == tight and "(MemoryPolicy.budget)" in budgeted["why"]
        assert given["choice"] == _choice(model, math.inf, mb_per_fetch=1) and given["choice"][0] == 1
        assert given["why"].endswith("(k=1 given)")
        for r in rank_results:
            assert r["err"] <= 1e-5, r
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)


def test_the_engine_chooses_its_memory_savers_from_the_shape_it_is_given():
    """recompute="auto" with MemoryPolicy.shape: the savers that fit the budget, fastest first, as
    the cost model counts them here for the schedule given (a budget just above keeping every
    graph takes "none", one between that and recomputing from the chunk's input takes "chunk");
    trained exactly like one process. Without a shape it is refused, naming the fix."""
    with pytest.raises(ValueError, match=r"recompute='auto' chooses the memory savers .* give shape=ModelDims"):
        MemoryPolicy(recompute="auto")
    with pytest.raises(ValueError, match=r"shape must be a tawpipe.models.ModelDims .* got dict"):
        MemoryPolicy(recompute="auto", shape={"seq": SEQ})
    torch.manual_seed(0)
    model = TinyLM(4)
    shape = ModelDims(hidden=HIDDEN, layers=4, heads=4, vocab=VOCAB, seq=SEQ, micro_batch=MB_ROWS, dtype_bytes=4)
    given = dict(mb_per_fetch=4, prefetch_depth=1, reuse_weights=False)  # four forwards before the backwards
    plan = build_plan(Topology(1, 1), 4, 4, layer_numel=_layer(model), weight_bytes=4, grad_bytes=4,
                      replicated_numel=_replicated(model), **given)

    def estimate(recompute: str, offload_state: bool = False) -> float:
        return busiest_rank_memory(plan, chunk_numel=[4 * _layer(model)], replicated_numel=_replicated(model),
                                   weight_bytes=4, grad_bytes=4, scratch_bytes=0, shape=shape,
                                   savers=Savers(recompute, offload_state)).total

    keep, chunk = estimate("none"), estimate("chunk")
    assert chunk < keep
    ref, ref_losses = reference_run(model, 4 * MB_ROWS, 2, None)
    for budget, want in ((keep * 1.001, "none"), ((keep + chunk) / 2, "chunk")):
        m = copy.deepcopy(model)
        engine = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=4,
                             optimizer=adamw, comm=NoComm(1), block_context=m.context, recompute="auto", shape=shape,
                             memory_budget=budget, **given)
        assert engine.policies[2].recompute == want, engine.auto_reason
        assert engine.auto_reason.startswith(f"recompute {want}: of the memory savers that fit"), engine.auto_reason
        losses = [engine.step(global_batch(step, 4 * MB_ROWS)) for step in range(2)]
        trained = dict(ref.named_parameters())
        assert max(rel_err(p.detach(), trained[n].detach()) for n, p in engine.named_parameters()) <= 1e-5
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        with pytest.raises(ValueError, match=rf"micro-batches of {2 * MB_ROWS} x {SEQ} tokens, larger than "
                                             rf"MemoryPolicy.shape's {MB_ROWS} x {SEQ}"):
            engine.step(global_batch(2, 8 * MB_ROWS))  # refused before the step: the engine stays usable
        engine.close()
    # on a CPU the device is the host: no offload is weighed, so a budget that only the optimizer
    # state on the host would meet is not met (with the leanest savers named), not "met" by an offload
    lean, leaner = estimate("layer"), estimate("layer", offload_state=True)
    assert leaner < lean
    with pytest.raises(NothingFits, match=r"^even with recompute layer: "):
        m = copy.deepcopy(model)
        make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=4, optimizer=adamw,
                    comm=NoComm(1), block_context=m.context, recompute="auto", shape=shape,
                    memory_budget=(lean + leaner) / 2, **given)


def test_the_measured_budget(monkeypatch):
    """CUDA: the free memory less 10% of the device's; elsewhere the host's share less 10%."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GiB, 80 * GiB))
    assert memory_budget(torch.device("cuda", 0), 1, None) == (52 * GiB, "free on cuda:0 less 10% of its 80 GiB")
    host = (40 * GiB, "MemAvailable in /proc/meminfo")
    assert memory_budget(torch.device("cpu"), 4, host) == (9 * GiB, "MemAvailable in /proc/meminfo, shared by 4 "
                                                                    "rank(s), less 10%")
    assert memory_budget(torch.device("cpu"), 4, None)[0] == math.inf


def test_an_explicit_memory_budget_that_nothing_fits_is_refused_before_anything_is_sent():
    torch.manual_seed(0)
    m = TinyLM(4)
    with pytest.raises(NothingFits, match="no schedule fits within 0.0 MiB per rank \\(MemoryPolicy\\.budget\\)"):
        make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=2, comm=NoComm(1),
                    memory_budget=1)
    with pytest.raises(ValueError, match="budget must be None .* or bytes per rank > 0"):
        make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=2, comm=NoComm(1),
                    memory_budget=0)


def test_ranks_that_chose_differently_are_told_why():
    """The fingerprint holds the resolved options: ranks whose "auto" chose another depth get a
    ValueError naming the field and MemoryPolicy.budget, from the same CHECK as every disagreement."""
    torch.manual_seed(0)
    m = TinyLM(4)
    rows = []
    for depth in (3, 1):
        plan = _plan_of(m, math.inf, mb_per_fetch=2, prefetch_depth=depth, reuse_weights=True)
        rows.append(fingerprint.fields(plan, compute_dtype=torch.float32, grad_dtype=torch.float32,
                                       block=m.blocks[0], replicated=list(m.embed.named_parameters()),
                                       optimizer=adamw(list(m.parameters())), precision={}, recompute="chunk"))
    assert "reuse_weights" in [name for name, _, _ in rows[0]]
    table = [[v for _, v, _ in row] for row in rows]
    with pytest.raises(ValueError, match=r"rank 1 disagrees with rank 0 on prefetch_depth \(rank 0: 3, rank 1: 1\).*"
                                         r"\"auto\" .* MemoryPolicy\.budget \(tawpipe train --memory-budget\)"):
        fingerprint.compare(table, rows[0], 0)
    # recompute="auto" chooses per rank too (MemoryPolicy.shape): the same advice
    plan = _plan_of(m, math.inf)
    rows = [fingerprint.fields(plan, compute_dtype=torch.float32, grad_dtype=torch.float32, block=m.blocks[0],
                               replicated=list(m.embed.named_parameters()), optimizer=adamw(list(m.parameters())),
                               precision={}, recompute=recompute) for recompute in ("chunk", "layer")]
    with pytest.raises(ValueError, match=r"rank 1 disagrees with rank 0 on recompute: .* whose recompute is chunk; "
                                         r"where it is \"auto\", each rank chooses .* MemoryPolicy\.budget"):
        fingerprint.compare([[v for _, v, _ in row] for row in rows], rows[0], 0)


def test_a_checkpoint_records_the_choice_and_a_resume_makes_it_again(tmp_path):
    torch.manual_seed(0)
    m = TinyLM(4)
    engine = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=2, comm=NoComm(1),
                         block_context=m.context)
    engine.step(global_batch(0, 4))
    checkpoint.save(engine, tmp_path)
    manifest = checkpoint.read_manifest(tmp_path)
    assert manifest["schedule"] == {"micro_batches": 2, "mb_per_fetch": engine.mb_per_fetch,
                                    "prefetch_depth": engine.prefetch_depth, "reuse_weights": engine.reuse_weights}
    engine.close()
    cfg = TrainConfig(nodes=1, per_node=1)
    ran = {"mb_per_fetch": 1, "prefetch_depth": 1, "reuse_weights": True}
    manifest["schedule"] = {"micro_batches": 2, **ran}
    assert preflight._as_it_ran(cfg, Topology(1, 1), manifest) == ran
    assert preflight._as_it_ran(TrainConfig(nodes=1, per_node=1, mb_per_fetch=2), Topology(1, 1), manifest) == {
        "prefetch_depth": 1, "reuse_weights": True}  # a given value stays
    assert preflight._as_it_ran(TrainConfig(nodes=1, per_node=1, micro_batches=4), Topology(1, 1), manifest) == {}
    assert preflight._as_it_ran(cfg, Topology(1, 2), manifest) == {}  # another plan: "auto" chooses afresh
    assert preflight._as_it_ran(TrainConfig(nodes=1, per_node=1, memory_budget=1.0), Topology(1, 1), manifest) == {}


# ------------------------------------------------------------------------------------ tawpipe train

def test_train_defaults_choose_and_the_budget_is_a_flag(monkeypatch, capsys):
    pre = preflight.validate(TrainConfig())
    assert pre.schedule == {"mb_per_fetch": 2, "prefetch_depth": 3, "reuse_weights": True, "loss": "plain",
                            "recompute": "chunk", "offload_state": False, "offload_activations": False}
    assert pre.auto.startswith("k=2, resident depth 3, reuse — the fewest inter-node bytes (")
    assert "shared by 4 rank(s), less 10%, less 384.0 MiB of runtime" in pre.auto
    pre = preflight.validate(TrainConfig(memory_budget=0.030))  # k=2 takes 28.1 MiB at depth 1, 33.7 MiB resident
    assert pre.schedule["prefetch_depth"] == 1 and "(--memory-budget)" in pre.auto and "would move" in pre.auto
    monkeypatch.setattr(job, "run_local", lambda *a, **k: pytest.fail("a worker was started"))
    assert re.match(r"tawpipe train: schedule: no schedule fits within 1\.0 MiB per rank \(--memory-budget\): "
                    r".*say how much with --memory-budget, or give --mb-per-fetch, --prefetch-depth and "
                    r"--reuse-weights yourself", refused(capsys, "train", "--memory-budget", "0.001"))


def test_train_chunks_the_loss_where_the_logits_outweigh_a_layer(tmp_path):
    """--loss auto (the default): plain for a small vocabulary, chunked for a LLaMA-sized one
    (the paper's model: 32,000 against hidden 1,024), a Hugging Face LLaMA's too; plain for a model
    without a chunked loss (a head that scales its logits)."""
    from tawpipe.models import dims

    assert preflight.validate(TrainConfig()).schedule["loss"] == "plain"  # tiny: vocabulary 256, hidden 128
    assert preflight.validate(TrainConfig(loss="chunked")).schedule["loss"] == "chunked"  # as given
    assert preflight._loss(True, dims("paper", seq=8192)) == "chunked"
    assert preflight._loss(True, dims("7b", seq=512)) == "chunked"
    assert preflight._loss(False, dims("paper", seq=8192)) == "plain"
    # the byte corpus trains a built-in model with a vocabulary of 256: its logits are small
    assert preflight._loss(True, replace(dims("paper", seq=8192), vocab=256)) == "plain"
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=32_000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4).save_pretrained(tmp_path / "hf")
    np.save(tmp_path / "data.npy", np.arange(6144, dtype=np.uint32) * 5)  # 307 held out, for --seq-len 256
    pre = preflight.validate(TrainConfig(model=str(tmp_path / "hf"), data=str(tmp_path / "data.npy"), seq_len=256))
    assert pre.schedule["loss"] == "chunked"


def test_train_chooses_the_memory_savers_with_recompute_auto():
    """The fastest savers whose schedule moves the fewest bytes within the budget; on the CPU no
    offload (the device is the host); what it chose is what the run trains with."""
    pre = preflight.validate(TrainConfig(recompute="auto"))
    assert pre.schedule["recompute"] == "none" and pre.auto.startswith("recompute none: of the memory savers that fit")
    pre = preflight.validate(TrainConfig(recompute="auto", memory_budget=0.05))
    assert pre.schedule["recompute"] in ("chunk", "block", "layer") and not pre.schedule["offload_state"]
    assert pre.auto.startswith(f"recompute {pre.schedule['recompute']}: ") and "(--memory-budget)" in pre.auto
    assert preflight.validate(TrainConfig(recompute="auto", offload_activations=True)).schedule["offload_activations"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg, _ = job._config(parser.parse_args(["--recompute", "auto", "--memory-budget", "0.05"]))
    assert cfg.recompute == pre.schedule["recompute"]


def test_train_prints_what_auto_chose_and_why():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "tawpipe", "train", "--model", "micro", "--steps", "1", "--seq-len",
                          "16", "--micro-batch-size", "1", "--val-every", "0"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("schedule: tawpipe, gradient route rail, prefetch depth 3, 2 micro-batch(es) per fetch, resident chunks "
            "reused") in out.stdout
    assert "\nauto: k=2, resident depth 3, reuse — the fewest inter-node bytes (" in out.stdout
