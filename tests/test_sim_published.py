"""Context parallelism in the simulator's data-parallel peers, and the replay of runs published by
others (``tawpipe simulate --published``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tawpipe.models.shape import ModelDims
from tawpipe.sim import compare
from tawpipe.sim.hardware import Cluster, Device, link
from tawpipe.sim.network import simulate
from tawpipe.sim.peers import peer_graph
from tawpipe.sim.workload import Workload
from tawpipe.simulate import published

DEV = Device("test", matmul_flops=2e13, attention_flops=1e13, memory_bandwidth=2e12, memory=8e10)
DIMS = ModelDims(hidden=256, layers=4, heads=8, kv_heads=2, vocab=512, seq=4096, micro_batch=1, scores=False)


def test_each_context_rank_does_its_share_of_the_whole_sequences_attention():
    for c in (2, 4):
        local = Workload(dataclasses.replace(DIMS, seq=DIMS.seq // c), DEV, context=c)
        whole = Workload(DIMS, DEV)
        assert local.attention_flops() * c == pytest.approx(whole.attention_flops())
        assert local.linear_flops() * c == pytest.approx(whole.linear_flops())


@pytest.mark.parametrize("c", [2, 4])
def test_the_key_value_exchange_is_its_closed_form(c):
    """Per layer and micro-batch, a forward's all-gather of the whole sequence's keys and values, the
    backward's re-run forward's again and the reduce-scatter of their gradients: each rank sends
    (c − 1)/c of the whole buffer in each, over the node's links only."""
    cluster = Cluster(1, 8, DEV, link("nvlink"), link("100gb"))
    local = dataclasses.replace(DIMS, seq=DIMS.seq // c)
    acc = 2
    with_cp = simulate(*peer_graph("fsdp", cluster, Workload(local, DEV, context=c), acc, host=False)).port_bytes
    without = simulate(*peer_graph("fsdp", cluster, Workload(local, DEV), acc, host=False)).port_bytes
    kv = 2 * DIMS.hidden * DIMS.kv_heads // DIMS.heads
    whole = c * local.seq * local.micro_batch * kv * DIMS.dtype_bytes
    for r in range(8):
        extra = with_cp[("out", r)] - without[("out", r)]
        assert extra == pytest.approx(DIMS.layers * acc * 3 * (c - 1) / c * whole, rel=1e-9), r
    assert not any(port[0].startswith("node") for port in with_cp)
    with pytest.raises(ValueError, match="divides the 8 ranks per node"):
        peer_graph("fsdp", cluster, Workload(local, DEV, context=3), acc, host=False)


@pytest.mark.parametrize("method", ["ddp", "fsdp", "hsdp"])
def test_a_peers_backward_waits_for_the_key_value_gradients_it_scatters(method):
    """A layer's input gradient needs its keys' and values' gradients back from the context group,
    so the layer below starts its backward only after their reduce-scatter, as TawPipe's engine
    does (and its player plays, ``tests/test_sim_context.py``)."""
    cluster = Cluster(2, 4, DEV, link("100gb"), link("100gb"))
    work = Workload(dataclasses.replace(DIMS, seq=DIMS.seq // 2), DEV, recompute=False, context=2)
    result = simulate(*peer_graph(method, cluster, work, 2, host=False))
    when = {(t.label, t.lane): (s, e) for t, s, e in zip(result.graph.tasks, result.start, result.end) if t.rank == 0}
    checked = 0
    for m in range(2):
        for i in range(1, DIMS.layers):
            scattered = when[(f"dK/dV B{i} m{m}", "cp")][1]
            assert when[(f"B{i - 1} m{m}", "compute")][0] >= scattered > when[(f"B{i} m{m}", "compute")][1], (i, m)
            checked += 1
    assert checked == 2 * (DIMS.layers - 1)


def test_context_parallelism_divides_a_ranks_activations_and_tokens():
    cluster = Cluster(1, 8, DEV, link("nvlink"), link("100gb"))
    whole = compare.run("fsdp", cluster, Workload(DIMS, DEV), 1)
    split = compare.run("fsdp", cluster, Workload(dataclasses.replace(DIMS, seq=DIMS.seq // 4), DEV, context=4), 1)
    assert split.memory.activations < whole.memory.activations / 3
    assert split.memory.persistent == whole.memory.persistent
    assert split.tokens_per_s_per_device * split.time_s == pytest.approx(whole.tokens_per_s_per_device * whole.time_s / 4)


def test_published_runs_are_replayed_and_bounded(tmp_path):
    """Every run lies between its prediction and its faster bound's order; the runs the simulator
    models without approximation beyond its presets (bf16 FSDP) are held within the band."""
    rows = published.table()
    assert len(rows) == len(published.RUNS) >= 3
    for r in rows:
        assert r["predicted_tokens_per_gpu_s"] <= r["bound_tokens_per_gpu_s"], r["what"]
        assert r["held"] == (abs(r["predicted_tokens_per_gpu_s"] / r["tokens_per_gpu_s"] - 1) <= published.BAND)
    for r in rows:
        if r["context"] == 1 and not r["float8"]:
            assert r["held"], r
    from tawpipe.cli import main

    assert main(["simulate", "--published", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "published.json").read_text())
    assert [r["what"] for r in doc["rows"]] == [r.what for r in published.RUNS]
    assert "Within ±20%" in (tmp_path / "published.md").read_text()


def test_simulate_runs_the_methods_with_context_parallelism_at_the_same_tokens_per_device(capsys):
    """--context-parallel C: TawPipe, FSDP2 and HSDP each hold a 1/C slice of C times the
    micro-batches (the same tokens per device), with less activation memory."""
    from tawpipe.cli import main

    argv = ["simulate", "--nodes", "2", "--per-node", "4", "--device", "h100", "--inter", "100gb", "--model", "1b",
            "--seq-len", "16384", "--micro-batch-size", "1", "--micro-batches", "2", "--methods", "tawpipe", "fsdp",
            "hsdp", "--json"]
    rows = {}
    for c in (1, 4):
        assert main([*argv, "--context-parallel", str(c)]) == 0
        rows[c] = {r["method"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for method in ("tawpipe", "fsdp", "hsdp"):
        split, whole = rows[4][method], rows[1][method]
        assert split["settings"]["context_parallel"] == 4 and "context_parallel" not in whole["settings"]
        assert split["tokens_per_s_per_device"] * split["time_s"] == pytest.approx(
            whole["tokens_per_s_per_device"] * whole["time_s"])
        # the loss's part stays; TawPipe at its k keeps as many inputs of C times the micro-batches
        assert split["memory"]["activations"] < (0.9 if method == "tawpipe" else 0.7) * whole["memory"]["activations"]
    assert main([*argv, "--context-parallel", "3"]) == 2
    assert "--context-parallel 3: must divide --per-node 4" in capsys.readouterr().err
