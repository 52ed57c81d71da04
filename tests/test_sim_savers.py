"""The simulator plays the memory savers (issue #36, item 4; design §9.3): TawPipe's copies over
PCIe are the cost model's bytes, which test_memory_savers holds to the engine's; layer-wise
recompute costs one more forward; the host steps an offloaded state; the peers' save_on_cpu
copies run in line with compute; what a node offloads must fit its host; and the simulator's
memory per rank is what the engine allocates on the emulated cluster."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tawpipe import models
from tawpipe.cost.memory import Savers, host_bytes, loss_bytes, memory_per_rank, working_set_bytes
from tawpipe.plan.actions import Op, describe
from tawpipe.plan.plan import STEP_PIECES
from tawpipe.plan.schedule import RESIDENT
from tawpipe.plan.topology import Topology
from tawpipe.sim import compare
from tawpipe.sim.hardware import Cluster, Host, Link, device, link
from tawpipe.sim.network import simulate
from tawpipe.sim.peers import peer_memory
from tawpipe.sim.play import engine_plan, plan_graph
from tawpipe.sim.workload import Workload, model

from engine_cases import make_engine

DEV = device("h100")
DIMS = model("1b", seq=4096, micro_batch=1)
SETTINGS = {"mb_per_fetch": 2, "prefetch_depth": 1, "reuse_weights": False}


def _cluster(nodes: int = 2, per_node: int = 2, pcie: float | None = None, host_memory: float = 2e12,
             adamw: float = 160e9, d2h: float | None = None) -> Cluster:
    host = Host(host_memory, Link("pcie", pcie, 5e-6) if pcie else link("pcie"), adamw,
                Link("pcie", d2h, 5e-6) if d2h else None)
    return Cluster(nodes, per_node, DEV, link("nvlink"), link("100gb"), host=host)


def _timeline(result, rank: int = 0) -> list[tuple]:
    """``rank``'s tasks of a played graph, each with its start and end."""
    return [(t, s, e) for t, s, e in zip(result.graph.tasks, result.start, result.end) if t.rank == rank]


@pytest.mark.parametrize("savers", [Savers("chunk", offload_activations=True), Savers("block", offload_activations=True),
                                    Savers("layer", offload_state=True),
                                    Savers("block", offload_state=True, offload_activations=True)])
@pytest.mark.parametrize("k", [1, 2])
def test_the_bytes_over_pcie_are_the_cost_models(savers, k):
    cluster, work = _cluster(), Workload(DIMS, DEV)
    plan = engine_plan(cluster, work, 4, **{**SETTINGS, "mb_per_fetch": k})
    graph, fabric = plan_graph(plan, cluster, work, host=False, savers=savers)
    ports = simulate(graph, fabric).port_bytes
    for r in range(plan.replica_size):
        want = host_bytes(plan, r, own_numel=plan.chunk_numel(plan.own_chunk(r)), weight_bytes=DIMS.dtype_bytes,
                          grad_bytes=DIMS.grad_bytes,
                          input_bytes=DIMS.activation_numel * DIMS.dtype_bytes, savers=savers)
        got = (ports.get(("pcie d2h", r), 0.0), ports.get(("pcie h2d", r), 0.0))
        assert got == pytest.approx(want, rel=1e-12) and min(got) > 0, (r, got, want)


@pytest.mark.parametrize("k", [1, 4])
def test_stashed_weights_cross_pcie_as_the_cost_model_counts(k):
    """reuse_weights="host": every STASH_W and RESTORE_W crosses its rank's PCIe link, and the
    inter-node bytes are the resident depth's."""
    cluster, work = _cluster(), Workload(DIMS, DEV)
    plan = engine_plan(cluster, work, 4, mb_per_fetch=k, prefetch_depth=1, reuse_weights="host")
    ports = simulate(*plan_graph(plan, cluster, work, host=False)).port_bytes
    for r in range(plan.replica_size):
        want = host_bytes(plan, r, own_numel=plan.chunk_numel(plan.own_chunk(r)), weight_bytes=DIMS.dtype_bytes,
                          grad_bytes=DIMS.grad_bytes, input_bytes=0, savers=Savers())
        got = (ports.get(("pcie d2h", r), 0.0), ports.get(("pcie h2d", r), 0.0))
        assert got == pytest.approx(want, rel=1e-12) and min(got) > 0, (r, got, want)
    stashed = compare.run("tawpipe", cluster, work, 4, settings=dict(mb_per_fetch=k, prefetch_depth=1,
                                                                    reuse_weights="host"))
    resident = compare.run("tawpipe", cluster, work, 4, settings=dict(mb_per_fetch=k, prefetch_depth=RESIDENT,
                                                                     reuse_weights=True))
    assert stashed.inter_bytes == resident.inter_bytes
    assert stashed.memory.staging < resident.memory.staging and stashed.memory.host > 0 == resident.memory.host


def test_without_offload_nothing_crosses_pcie():
    cluster, work = _cluster(), Workload(DIMS, DEV)
    row = compare.run("tawpipe", cluster, work, 4, settings=SETTINGS, savers=Savers("layer"))
    assert row.pcie_bytes == 0


def test_a_layer_at_a_time_costs_one_more_forward_per_layer():
    cluster, work = _cluster(), Workload(DIMS, DEV)
    rows = {r: compare.run("tawpipe", cluster, work, 4, settings=SETTINGS, savers=Savers(r))
            for r in ("none", "chunk", "block", "layer")}
    plan = engine_plan(cluster, work, 4, **SETTINGS)
    layers = sum(plan.chunk_layers[a.chunk][1] - plan.chunk_layers[a.chunk][0] for a in plan.actions[0] if a.op is Op.B)
    f = work.layer_forward()
    assert rows["block"].compute_s == pytest.approx(rows["chunk"].compute_s, rel=1e-12)
    assert rows["layer"].compute_s - rows["chunk"].compute_s == pytest.approx(layers * f, rel=1e-9)
    assert rows["chunk"].compute_s - rows["none"].compute_s == pytest.approx(layers * f, rel=1e-9)
    assert rows["none"].time_s < rows["chunk"].time_s < rows["layer"].time_s


def test_activation_offload_hides_behind_compute_unless_pcie_is_slow():
    work = Workload(DIMS, DEV)
    plain = compare.run("tawpipe", _cluster(), work, 4, settings=SETTINGS, savers=Savers("block"))
    fast = compare.run("tawpipe", _cluster(), work, 4, settings=SETTINGS,
                       savers=Savers("block", offload_activations=True))
    slow_link = 1e9
    slow = compare.run("tawpipe", _cluster(pcie=slow_link), work, 4, settings=SETTINGS,
                       savers=Savers("block", offload_activations=True))
    assert fast.time_s <= plain.time_s * 1.02 and fast.pcie_bytes > 0
    assert slow.time_s > plain.time_s * 1.2
    assert slow.time_s >= slow.pcie_bytes / 2 / slow_link  # one direction's bytes at the link's rate, at least
    assert fast.memory.activations < plain.memory.activations and fast.memory.host > 0


def test_the_host_steps_an_offloaded_state_in_pieces_each_loading_once_stepped():
    """As the engine on a GPU (design §6.1): the host steps the own chunk in ``STEP_PIECES``
    pieces beside the next iteration (played as the previous step, from the start), and each
    piece's part of that iteration's first load crosses once the piece is stepped, hidden behind
    the next piece. That load (``carried_load``, the prologue's into ``w_own``) then moves
    nothing; every unit that reads or writes the master, the accumulator or the carried buffer
    waits for the step, and the STEP at the end is the device's part alone, after every transfer."""
    cluster, work = _cluster(), Workload(DIMS, DEV)
    on_device = compare.run("tawpipe", cluster, work, 4, settings=SETTINGS, savers=Savers("chunk"))
    on_host = compare.run("tawpipe", cluster, work, 4, settings=SETTINGS, savers=Savers("chunk", offload_state=True))
    plan = engine_plan(cluster, work, 4, **SETTINGS)
    own = plan.chunk_numel(plan.own_chunk(0))
    tasks = _timeline(on_host.result)
    steps = [x for x in tasks if x[0].label == "host AdamW"]
    loads = [x for x in tasks if x[0].label.startswith("load master ")]
    casts = [x for x in tasks if x[0].label.startswith("cast ")]
    assert len(steps) == len(loads) == len(casts) == STEP_PIECES and steps[0][1] == 0
    assert sum(t.seconds for t, _, _ in steps) == pytest.approx(own * 32 / (160e9 / cluster.per_node))
    piece_load = 4 * own / STEP_PIECES / cluster.host.pcie.bandwidth
    for i in range(STEP_PIECES):
        assert loads[i][1] >= steps[i][2] and loads[i][2] - loads[i][1] == pytest.approx(piece_load, rel=1e-3)
        if i + 1 < STEP_PIECES:
            assert loads[i][2] <= steps[i + 1][2] and steps[i + 1][1] == steps[i][2]  # hidden behind the next piece
    done = next(e for t, _, e in tasks if t.label == "host step done")
    assert done == pytest.approx(loads[-1][2])
    touching = [x for x in tasks if x[0].label == "load master" or x[0].label.startswith("gradient to host")
                or x[0].label == describe(plan.actions[0][-1])]
    assert touching and all(s >= done - 1e-12 for _, s, _ in touching)
    step = next(x for x in tasks if x[0].label == describe(plan.actions[0][-1]))
    assert step[2] == max(e for _, _, e in tasks)  # the device's part of the step ends the iteration
    carried = plan.carried_load(0)
    assert carried is not None and carried.buf == "w_own"
    assert next(t for t, _, _ in tasks if t.label == describe(carried)).seconds == 0  # nothing to cast either
    own_loads = [a for a in plan.actions[0] if a.op is Op.LOAD_W]
    assert sum(t.label == "load master" for t, _, _ in tasks) == len(own_loads) - 1
    assert on_host.compute_s < on_device.compute_s  # the device no longer steps or accumulates the own chunk
    assert on_host.memory.persistent == 0 and on_host.memory.host == 16 * own


@pytest.mark.parametrize("slower", ["copy", "addition"])
def test_a_gradient_crosses_to_the_host_while_the_host_adds_the_piece_before(slower):
    """ACC_G with the state on the host as ``HostOffload.accumulate_grad`` runs it: two pinned
    buffers, a piece's copy while the host adds the one before, a copy waiting for the addition
    two before it (its buffer): the span is one copy, then the slower stage per piece, then one
    addition, not every copy and then every addition."""
    cluster = _cluster(pcie=8e9) if slower == "copy" else _cluster(adamw=20e9)
    work = Workload(DIMS, DEV)
    row = compare.run("tawpipe", cluster, work, 4, settings=SETTINGS, savers=Savers("chunk", offload_state=True))
    tasks = _timeline(row.result)
    firsts = [i for i, (t, _, _) in enumerate(tasks) if t.label == f"gradient to host 1/{STEP_PIECES}"]
    assert len(firsts) == sum(a.op is Op.ACC_G for a in engine_plan(cluster, work, 4, **SETTINGS).actions[0]) > 0
    for first in firsts:
        copies = [x for x in tasks[first:] if x[0].label.startswith("gradient to host ")][:STEP_PIECES]
        adds = [x for x in tasks[first:] if x[0].label.startswith("host accumulate ")][:STEP_PIECES]
        c, a = copies[0][2] - copies[0][1], adds[0][2] - adds[0][1]
        assert (c > a > 0) if slower == "copy" else (a > c > 0)
        assert adds[-1][2] - copies[0][1] == pytest.approx(c + (STEP_PIECES - 1) * max(c, a) + a, rel=1e-6)
        if slower == "addition":  # a copy waits for its buffer, which the addition two before frees
            assert all(copies[i][1] == pytest.approx(adds[i - 2][2], rel=1e-9) for i in range(2, STEP_PIECES))


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("recompute", ["layer", "block"])
def test_a_backward_a_layer_at_a_time_hands_each_piece_of_its_gradient_to_the_host_once_whole(recompute, host,
                                                                                             monkeypatch):
    """World size 1, state on the host, a backward a layer at a time (design §6.1), on a GPU and
    on a CPU: each piece of the gradient crosses once the layers that make it whole are done,
    last layers first (under "layer" after the chunk's re-run), so the copies run beside the
    backward. With nothing streamed they wait for the whole backward, and the iteration is
    longer."""
    import math

    from tawpipe.plan.plan import Plan

    cluster, work = _cluster(1, 1), Workload(DIMS, DEV)
    settings = {"mb_per_fetch": 1, "prefetch_depth": 1, "reuse_weights": False}
    savers = Savers(recompute, offload_state=True)
    row = compare.run("tawpipe", cluster, work, 4, host=host, settings=settings, savers=savers)
    plan = engine_plan(cluster, work, 4, **settings)
    n = DIMS.layers
    lead = (savers.forwards_in_backward - 1) * n * work.layer_forward()
    per_layer = work.layer_backward(forwards=1)
    tasks = _timeline(row.result)
    backwards = [a for a in plan.actions[0] if a.op is Op.B]
    assert len(backwards) == 4 and set(plan.streamed_accumulations(0)) == set(backwards)
    for b in backwards:
        parts = [(s, e) for t, s, e in tasks if t.label == describe(b)]
        at = next(i for i, (t, s, _) in enumerate(tasks) if t.label == describe(b) and s == parts[0][0])
        copies = [(s, e) for t, s, e in tasks[at:] if t.label.startswith("gradient to host ")][:STEP_PIECES]
        for i, (start, _) in enumerate(copies):
            whole = parts[0][0] + lead + math.ceil((i + 1) * n / STEP_PIECES) * per_layer
            assert start >= whole - 1e-9 and (i > 0 or start == pytest.approx(whole, rel=1e-9))
        assert copies[0][0] < parts[-1][1] - per_layer  # beside the backward, not after it
    monkeypatch.setattr(Plan, "streamed_accumulations", lambda self, rank: {})
    waiting = compare.run("tawpipe", cluster, work, 4, host=host, settings=settings, savers=savers)
    assert waiting.time_s > row.time_s


@pytest.mark.parametrize("recompute", ["layer", "block", "chunk", "none"])
def test_the_next_forward_runs_each_layer_once_the_host_has_stepped_and_loaded_it(recompute):
    """World size 1, state on the host, on a GPU (design §6.1): the first forward of the carried
    buffer runs each layer once the piece of the step beside it that holds the layer is cast, so
    part of the host's step hides behind it: a layer-wise backward streaming its gradient, the
    iteration is shorter than the same without offloaded state plus the whole host step. Without
    recompute the forward keeps its graph and waits for the whole step."""
    import math

    cluster, work = _cluster(1, 1), Workload(DIMS, DEV)
    settings = {"mb_per_fetch": 1, "prefetch_depth": 1, "reuse_weights": False}
    plan = engine_plan(cluster, work, 4, **settings)
    row = compare.run("tawpipe", cluster, work, 4, settings=settings, savers=Savers(recompute, offload_state=True))
    plain = compare.run("tawpipe", cluster, work, 4, settings=settings, savers=Savers(recompute))
    tasks = _timeline(row.result)
    casts = [e for t, _, e in tasks if t.label.startswith("cast ")]
    steps = [t.seconds for t, _, _ in tasks if t.label == "host AdamW"]
    first = next(a for a in plan.actions[0] if a.op is Op.F)
    parts = [(t, s) for t, s, _ in tasks if t.label == describe(first)]
    n, layer = DIMS.layers, work.layer_forward()
    if recompute == "none":
        done = next(e for t, _, e in tasks if t.label == "host step done")
        assert len(parts) == 1 and parts[0][1] >= done
        return
    needs = [math.ceil((j + 1) * STEP_PIECES / n) - 1 for j in range(n)]
    runs = [(p, len(list(g))) for p, g in itertools.groupby(needs)]
    assert [t.seconds for t, _ in parts[:len(runs)]] == pytest.approx([k * layer for _, k in runs])
    assert all(s >= casts[p] - 1e-12 for (p, _), (_, s) in zip(runs, parts))
    if recompute != "chunk":  # a backward a layer at a time streams its gradient: the rest hides too
        assert row.time_s < plain.time_s + sum(steps)


def test_each_direction_of_pcie_crosses_at_its_own_rate():
    """A host whose device-to-host copies are slower than its loads (``Host.pcie_d2h``): the
    gradients cross at that rate, the masters' loads at the other, and the lower bound knows it."""
    from tawpipe.sim.atlas import _pcie_floor

    work = Workload(DIMS, DEV)
    same, slow = _cluster(), _cluster(d2h=link("pcie").bandwidth / 4)
    rows = {c: compare.run("tawpipe", c, work, 4, settings=SETTINGS, savers=Savers("chunk", offload_state=True))
            for c in (same, slow)}

    def spans(row, prefix):
        return [e - s for t, s, e in _timeline(row.result) if t.label.startswith(prefix)]

    for down, up in zip(spans(rows[slow], "gradient to host "), spans(rows[same], "gradient to host ")):
        assert down == pytest.approx(4 * up, rel=1e-3)
    assert spans(rows[slow], "load master") == pytest.approx(spans(rows[same], "load master"), rel=1e-9)
    plan = engine_plan(same, work, 4, **SETTINGS)
    savers = Savers("chunk", offload_state=True)
    to_host, from_host = host_bytes(plan, 0, own_numel=plan.chunk_numel(plan.own_chunk(0)),
                                    weight_bytes=DIMS.dtype_bytes, grad_bytes=DIMS.grad_bytes,
                                    input_bytes=DIMS.activation_numel * DIMS.dtype_bytes, savers=savers)
    assert _pcie_floor(plan, work, savers, slow) == pytest.approx(
        max(4 * to_host, from_host) / link("pcie").bandwidth)


def test_on_a_cpu_the_stepping_thread_loads_each_piece_before_the_next():
    """On a CPU the loads are copies in the thread that steps (design §6.1): nothing hides, each
    piece steps once the piece before it is loaded and cast."""
    cluster, work = _cluster(), Workload(DIMS, DEV)
    plan = engine_plan(cluster, work, 4, **SETTINGS)
    graph, fabric = plan_graph(plan, cluster, work, host=True, savers=Savers("chunk", offload_state=True))
    result = simulate(graph, fabric)
    ends = {label: [(s, e) for t, s, e in _timeline(result) if t.label == label or t.label.startswith(label + " ")]
            for label in ("host AdamW", "cast")}
    steps, casts = ends["host AdamW"], ends["cast"]
    assert len(steps) == len(casts) == STEP_PIECES
    assert all(steps[i + 1][0] >= casts[i][1] > steps[i][1] for i in range(STEP_PIECES - 1))


def test_save_on_cpu_copies_run_in_line_with_compute():
    cluster, work, acc = _cluster(1, 1), Workload(DIMS, DEV), 2
    plain = compare.run("ddp", cluster, work, acc)
    offload = compare.run("ddp", cluster, work, acc, savers=Savers(offload_activations=True))
    saved = DIMS.activation_numel * DIMS.dtype_bytes  # a checkpointed block's input
    copies = acc * DIMS.layers * 2 * saved / link("pcie").bandwidth
    assert offload.time_s - plain.time_s == pytest.approx(copies, rel=1e-9)
    assert offload.pcie_bytes == pytest.approx(acc * DIMS.layers * 2 * saved)


@pytest.mark.parametrize("recompute", [True, False])
def test_save_on_cpu_keeps_what_the_layers_save_on_the_host(recompute):
    cluster = _cluster()
    plain = peer_memory("fsdp", DIMS, cluster, 4, recompute)
    offload = peer_memory("fsdp", DIMS, cluster, 4, recompute, offload=True)
    saved = DIMS.activation_numel * DIMS.dtype_bytes if recompute else working_set_bytes(DIMS, 1)
    assert offload.host == DIMS.layers * saved
    kept = working_set_bytes(DIMS, 1) + (saved if recompute else 0)
    assert offload.activations == pytest.approx(kept + loss_bytes(DIMS, chunked=False))
    assert plain.activations - offload.activations == pytest.approx(
        (DIMS.layers - 1) * saved if recompute else (DIMS.layers - 1) * working_set_bytes(DIMS, 1))
    with pytest.raises(ValueError, match="activation offload is modelled for ddp"):
        peer_memory("1f1b", DIMS, cluster, 4, recompute, offload=True, stages=4)


def test_what_a_node_offloads_must_fit_its_host():
    work = Workload(DIMS, DEV)
    savers = Savers("chunk", offload_state=True, offload_activations=True)
    roomy = compare.run("tawpipe", _cluster(), work, 4, settings=SETTINGS, savers=savers)
    need = roomy.memory.host * 2  # two ranks per node
    assert roomy.fits
    cramped = compare.run("tawpipe", _cluster(host_memory=need * 0.99), work, 4, settings=SETTINGS, savers=savers)
    assert not cramped.fits and cramped.memory.total == roomy.memory.total
    assert compare.run("tawpipe", _cluster(host_memory=need), work, 4, settings=SETTINGS, savers=savers).fits


def test_the_chunked_loss_holds_a_slice_of_the_logits():
    long = dataclasses.replace(DIMS, seq=131072)
    assert loss_bytes(long, chunked=False) == 3 * 131072 * long.vocab * 4  # 200 GB: nothing fits with it
    assert loss_bytes(long, chunked=True) < loss_bytes(long, chunked=False) / 40
    work, cluster = Workload(DIMS, DEV), _cluster()
    for method in ("tawpipe", "ddp", "hsdp"):
        plain = compare.run(method, cluster, work, 4, settings=SETTINGS if method == "tawpipe" else None)
        chunked = compare.run(method, cluster, work, 4, settings=SETTINGS if method == "tawpipe" else None,
                              chunked_loss=True)
        assert plain.memory.total - chunked.memory.total == pytest.approx(
            loss_bytes(DIMS, chunked=False) - loss_bytes(DIMS, chunked=True)), method


# ------------------------------------------------------------------ against the engine's accounting


def _accounting(rank: int, case: dict) -> dict:
    """One step of the built-in micro model on 2 x 2 with ``case``'s options: what the engine
    allocated, and what the simulator's estimate (``memory_per_rank``) says for its plan."""
    world = torch.distributed.get_world_size()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case["dtype"]]
    parts = models.load("micro", seed=0, compute_dtype=dtype)
    options = dict(case["options"])
    engine = make_engine(parts, topology=Topology(2, world // 2), micro_batches=2, compute_dtype=dtype, **options)
    torch.manual_seed(rank)
    x = torch.randint(0, 256, (2, 16))
    engine.step((x, x.roll(-1, 1)))
    report = engine.memory_report()
    savers = Savers(**{k: v for k, v in options.items() if k in ("recompute", "offload_state")})
    dims = models.dims("micro", seq=16, micro_batch=1, dtype_bytes=dtype.itemsize, grad_bytes=4)
    sim = memory_per_rank(engine.plan, dims, savers)
    engine.close()
    return {"persistent": report.persistent, "staging": sum(report.staging.values()), "replicated": report.replicated,
            "offloaded": report.offloaded, "sim": dataclasses.asdict(sim), "state": 16 * report.decoder_params / world,
            "host_weights": report.host_weights}


@pytest.mark.parametrize("case", [dict(dtype="float32", options={}),
                                  dict(dtype="bfloat16", options=dict(recompute="layer")),
                                  dict(dtype="bfloat16", options=dict(recompute="chunk")),
                                  dict(dtype="float32", options=dict(offload_state=True, mb_per_fetch=2,
                                                                     prefetch_depth="resident", reuse_weights=True)),
                                  dict(dtype="bfloat16", options=dict(mb_per_fetch=1, prefetch_depth=1,
                                                                      reuse_weights="host"))],
                         ids=["fp32", "bf16-layer", "bf16-chunk", "state-on-host-resident", "bf16-weights-on-host"])
def test_the_simulators_memory_is_what_the_engine_allocates(case):
    from tawpipe.runtime.launch import run_local

    results = run_local(_accounting, 4, case, timeout=240)
    stashed = max(r["host_weights"] for r in results)  # the busiest rank's, as memory_per_rank counts
    assert (stashed > 0) == (case["options"].get("reuse_weights") == "host")
    for r in results:
        sim = r["sim"]
        assert sim["staging"] == r["staging"], r
        assert abs(sim["replicated"] - 4 * r["replicated"]) <= 16, r  # + the loss sum's element in the plan
        if r["offloaded"]:
            assert sim["persistent"] == 0 and sim["host"] == r["persistent"] + stashed == r["state"] + stashed, r
        else:
            assert sim["persistent"] == r["persistent"] == r["state"] and sim["host"] == stashed, r


def test_the_simulators_auto_weighs_host_bytes_as_the_engines_does():
    """One device moves nothing between nodes: with its state on the host, "auto" takes the k with
    the fewest bytes to and from the host (k = acc: one gradient sent per iteration), as
    ``tawpipe train`` does (test_auto); without, the least memory (k = 1)."""
    cluster, work = _cluster(1, 1), Workload(DIMS, DEV)
    for savers, k in ((Savers("chunk", offload_state=True), 4), (Savers("chunk"), 1)):
        mem = memory_per_rank(engine_plan(cluster, work, 4, mb_per_fetch=k, prefetch_depth=1, reuse_weights=False),
                              DIMS, savers)
        assert (mem.host_traffic > 0) == savers.offload_state
        plan = engine_plan(cluster, work, 4, memory=lambda p, s=savers: memory_per_rank(p, DIMS, s),
                           mb_per_fetch="auto", prefetch_depth="auto", reuse_weights="auto")
        assert plan.options["mb_per_fetch"] == k, savers
