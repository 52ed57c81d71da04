"""The peers' graphs against closed forms: ring collectives, DDP's exposed all-reduce, a two-stage
1F1B pipeline, the inter-node bytes of ``cost.traffic.estimate`` and the bench's
``predicted_busiest``, memory, and the size of a 1,024-GPU graph."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tawpipe.bench.baselines import RunConfig
from tawpipe.bench.cluster import predicted_busiest
from tawpipe.cost.memory import working_set_bytes
from tawpipe.cost.traffic import estimate, fsdp_numel
from tawpipe.models.shape import ModelDims
from tawpipe.plan.topology import Topology
from tawpipe.sim.hardware import DEVICES, LINKS, Cluster, Device, Link
from tawpipe.sim.network import HALF_DUPLEX_SHARE, Graph, Result, simulate
from tawpipe.sim.peers import PEERS, Ring, peer_graph, peer_memory, ring_collective
from tawpipe.sim.workload import Workload, model

DEVICE = Device("test", matmul_flops=1e12, attention_flops=1e12, memory_bandwidth=1e11, memory=1e12)
TINY = ModelDims(hidden=64, layers=4, heads=4, vocab=256, seq=128, micro_batch=1, dtype_bytes=2, grad_bytes=4)


def cluster(nodes: int, per_node: int, *, inter: float = 1e9, latency: float = 0.0) -> Cluster:
    return Cluster(nodes, per_node, DEVICE, Link("intra", 100e9, 0.0), Link("inter", inter, latency))


def busiest_node_port(result: Result) -> float:
    return max((v for port, v in result.port_bytes.items() if port[0].startswith("node")), default=0.0)


def play(method: str, c: Cluster, dims: ModelDims, acc: int, *, host: bool, stages: int | None = None) -> Result:
    return simulate(*peer_graph(method, c, Workload(dims, c.device, recompute=False), acc, host=host, stages=stages))


# ------------------------------------------------------------------------------ collectives


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("op, share, hops", [("all-reduce", 2, 2), ("all-gather", 1, 1), ("reduce-scatter", 1, 1)])
def test_ring_on_one_link_per_hop(k, op, share, hops):
    """k nodes of one device: every hop has a link of its own, so a ring takes its share of the
    buffer over one link plus its hop latencies; folded to one node, by symmetry, the same."""
    nbytes, bw, lat = 3e6, 1e9, 1e-4
    c = cluster(k, 1, inter=bw, latency=lat)
    expected = share * (k - 1) / k * nbytes / bw + hops * (k - 1) * lat
    for ranks, fold in ((range(k), None), (range(1), 1)):
        g = Graph()
        ring_collective(g, c, op, nbytes, Ring(k), ranks)
        assert simulate(g, c.fabric(fold)).makespan == pytest.approx(expected, rel=1e-9)


def test_ring_is_node_major():
    """A world ring crosses each node boundary once; a ring per local index crosses from every
    device; a node's ring stays inside."""
    assert [Ring(8).next(r) for r in range(8)] == [1, 2, 3, 4, 5, 6, 7, 0]
    assert [Ring(3, 4).next(r) for r in (1, 5, 9)] == [5, 9, 1]
    assert Ring(8).crosses(4) and Ring(3, 4).crosses(4) and not Ring(4).crosses(4)


# ------------------------------------------------------------------------------------- time


def test_ddp_one_bucket_is_compute_plus_exposed_all_reduce():
    """All gradients fit DDP's first bucket (1 MiB), which fills only when the embedding's
    gradient does: nothing overlaps it."""
    dims, acc, bw, lat = ModelDims(hidden=32, layers=2, heads=4, vocab=256, seq=64), 3, 1e8, 2e-5
    c = cluster(2, 2, inter=bw, latency=lat)
    work = Workload(dims, DEVICE, recompute=True)
    graph, fabric = peer_graph("ddp", c, work, acc, host=False)
    params = dims.decoder_numel + dims.replicated_numel
    assert params * dims.grad_bytes < 2**20
    assert sum(t.lane == "all-reduce" for t in graph.tasks) == 1
    compute = acc * (work.embed() + work.head() + dims.layers * (work.layer_forward() + work.layer_backward()))
    n = c.world_size
    all_reduce = 2 * (n - 1) / n * params * dims.grad_bytes / bw + 2 * (n - 1) * lat
    assert simulate(graph, fabric).makespan == pytest.approx(compute + all_reduce + work.step(params), rel=1e-9)


def test_ddp_buckets_overlap_backward():
    """A bucket per large parameter, each all-reduced as soon as it is full while the backward
    goes on: when compute dominates, only the buckets that fill at block 0's backward and the
    embedding's gradient (the last two computations) show, back to back, before the step."""
    dims = model("1b", seq=4096, micro_batch=2)
    c = Cluster(2, 8, DEVICES["h100"], LINKS["nvlink"], LINKS["400gb"])
    work = Workload(dims, c.device)
    result = simulate(*peer_graph("ddp", c, work, 2, host=False))
    tasks = result.graph.tasks
    buckets = [i for i, t in enumerate(tasks) if t.lane == "all-reduce"]
    # per block: the MLP's three 33.5 MB projections, each at least 25 MiB, close a bucket each;
    # attention's 21 MB waits for the next block's down projection (the last one, the embedding)
    assert len(buckets) == 3 * dims.layers + 1
    ready = {i: tasks[i].deps[0] for i in buckets}  # the computation that fills the bucket
    block0 = next(i for i, t in enumerate(tasks) if t.label == "B0 m1")
    tail = [i for i in buckets if ready[i] >= block0]
    assert len(tail) == 4
    assert all(result.end[i] <= result.end[block0] for i in buckets if i not in tail)
    step = work.step(dims.decoder_numel + dims.replicated_numel)
    exposed = sum(result.end[i] - result.start[i] for i in tail)
    assert result.makespan == pytest.approx(result.end[block0] + exposed + step, rel=1e-9)


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("acc, latency", [(1, 0.0), (3, 0.0), (4, 1e-3)])
def test_two_stage_1f1b(acc, latency, host):
    """Two stages, M = 2·acc micro-batches, c = one message's time. Stage 1 (layers and head) is
    the slower, so after stage 0's first forward every period is stage 1's f1 + b1 plus the
    gradient's and the next input's transfer (concurrent, opposite directions: c on a GPU, 2c
    minus one latency on a host, whose one gloo connection carries them in turn); stage 0 ends
    with the last gradient's transfer, its backward and its step:
    f0 + c + M·(f1 + b1) + (M − 1)·c2 + c + b0 + step0."""
    dims, bw = TINY, 5e8
    c = cluster(2, 1, inter=bw, latency=latency)
    work = Workload(dims, DEVICE, recompute=False)
    half = dims.layers // 2
    f0, b0 = half * work.layer_forward() + work.embed() / 3, half * work.layer_backward() + 2 * work.embed() / 3
    f1, b1 = half * work.layer_forward() + work.head() / 3, half * work.layer_backward() + 2 * work.head() / 3
    assert f1 + b1 >= f0 + b0
    msg = dims.activation_numel * dims.dtype_bytes / bw + latency
    m = 2 * acc
    step = work.step(half * dims.layer_numel + dims.vocab * dims.hidden)  # the embedding; the final norm is stage 1's
    both = 2 * dims.activation_numel * dims.dtype_bytes / (HALF_DUPLEX_SHARE * bw) + latency if host else msg
    result = simulate(*peer_graph("1f1b", c, work, acc, host=host))
    assert result.makespan == pytest.approx(f0 + msg + m * (f1 + b1) + (m - 1) * both + msg + b0 + step, rel=1e-9)
    assert result.busy(0) == pytest.approx(m * (f0 + b0) + step, rel=1e-9)


@pytest.mark.parametrize("method", ["fsdp", "fsdp-mm", "fsdp-node", "hsdp"])
def test_fsdp_on_host_runs_one_thing_at_a_time(method):
    """gloo blocks the caller on every FSDP2 collective: the host iteration is the sum of its
    parts; NCCL's streams overlap them on a GPU."""
    c = cluster(2, 2, inter=1e8, latency=1e-5)
    host = play(method, c, TINY, 2, host=True)
    assert host.makespan == pytest.approx(sum(e - s for s, e in zip(host.start, host.end)), rel=1e-9)
    assert play(method, c, TINY, 2, host=False).makespan < host.makespan


def test_fsdp_compute_bound_hides_all_gathers():
    """When a block's compute outlasts its gathers, a GPU's FSDP2 iteration is its compute plus
    what cannot overlap: each micro-batch's first gathers and the root's last reduce-scatter."""
    dims = model("1b", seq=4096, micro_batch=8)
    c = Cluster(2, 8, DEVICES["h100"], LINKS["nvlink"], LINKS["400gb"])
    work = Workload(dims, c.device)
    compute = 2 * (work.embed() + work.head() + dims.layers * (work.layer_forward() + work.layer_backward()))
    gpu = simulate(*peer_graph("fsdp", c, work, 2, host=False)).makespan
    assert compute < gpu < 1.1 * compute


# ----------------------------------------------------------------------------------- bytes


SHAPES = [(2, 2), (3, 2), (4, 1), (2, 3)]


@pytest.mark.parametrize("nodes, per_node", SHAPES)
@pytest.mark.parametrize("method", ["ddp", "hsdp", "1f1b"])
@pytest.mark.parametrize("host", [False, True])
def test_inter_node_bytes_match_estimate(nodes, per_node, method, host):
    acc, dims = 2, replace(TINY, layers=nodes * per_node)  # 1F1B: a layer per stage at least
    result = play(method, cluster(nodes, per_node), dims, acc, host=host)
    expected = estimate(method, dims, Topology(nodes, per_node), acc).inter_node_per_node
    if method == "hsdp":  # the node's shards all-reduced across nodes, as FSDP2 pads them
        block, root = fsdp_numel(dims, per_node)
        expected = 2 * (nodes - 1) / nodes * (dims.layers * block + root) * dims.grad_bytes
    assert busiest_node_port(result) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("nodes, per_node", SHAPES)
@pytest.mark.parametrize("method", ["fsdp", "fsdp-mm", "fsdp-node"])
def test_fsdp_host_bytes_match_the_bench_prediction(nodes, per_node, method):
    """On gloo: the bench's closed form, with its reduce-scatter that is an all-reduce."""
    cfg = RunConfig(nodes=nodes, per_node=per_node, hidden=64, layers=6, heads=4, seq_len=32, vocab=256,
                    micro_batches=3)
    dims = ModelDims(hidden=64, layers=6, heads=4, vocab=2 * 256, seq=32, micro_batch=1, dtype_bytes=4, grad_bytes=4)
    result = play(method, cluster(nodes, per_node), dims, cfg.micro_batches, host=True)
    assert busiest_node_port(result) == pytest.approx(predicted_busiest(method, cfg), rel=1e-9)


@pytest.mark.parametrize("nodes, per_node", SHAPES)
@pytest.mark.parametrize("method", ["fsdp", "fsdp-mm", "fsdp-node"])
def test_fsdp_gpu_bytes(nodes, per_node, method):
    """On NCCL the reduce-scatter is a ring: (N−1)/N of the gradients per sync. Per micro-batch
    the forward gathers the root and every block, the backward the blocks again (inside the
    node for fsdp-node). ``estimate('fsdp')`` also gathers the root again in the backward,
    which FSDP2 does not (it keeps the root unsharded after forward). Sizes are FSDP2's padded
    ones (every dim 0 up to a multiple of N), which on shapes that need no padding are
    ``estimate``'s."""
    acc, d = 3, TINY
    n = nodes * per_node
    block, e = fsdp_numel(d, n)
    ring, psi = (n - 1) / n, d.layers * block
    gathered = (1 if method == "fsdp-node" else 2) * psi + e
    syncs = acc if method == "fsdp-mm" else 1
    expected = acc * ring * gathered * d.dtype_bytes + syncs * ring * (psi + e) * d.grad_bytes
    result = play(method, cluster(nodes, per_node), d, acc, host=False)
    assert busiest_node_port(result) == pytest.approx(expected, rel=1e-9)
    if method == "fsdp-mm" and (block, e) == (d.layer_numel, d.replicated_numel):
        paper = estimate("fsdp", d, Topology(nodes, per_node), acc).inter_node_per_node
        assert paper - expected == pytest.approx(acc * ring * e * d.dtype_bytes, rel=1e-9)


def test_fsdp_pads_every_parameter_to_equal_shards():
    # hidden 64 and ffn 192 split evenly over 4 ranks; over 6 ranks every dim 0 is padded
    assert fsdp_numel(TINY, 4) == (TINY.layer_numel, TINY.replicated_numel)
    block, root = fsdp_numel(TINY, 6)
    h, f = 64, TINY.ffn_hidden
    assert block == 4 * 66 * h + 2 * (-(-f // 6) * 6) * h + 66 * f + 2 * 66
    assert root == 258 * h + 66
    assert fsdp_numel(replace(TINY, tied=False), 6)[1] == 2 * 258 * h + 66  # an untied head: its own V x H


def test_pipelines_inside_nodes_send_only_their_gradient_rings():
    """Two-stage pipelines, two per node: only each stage's all-reduce over its 4 copies
    crosses, once per node and stage."""
    c, acc, d = cluster(2, 4), 2, TINY
    result = play("1f1b", c, d, acc, host=False, stages=2)
    table = d.vocab * d.hidden
    stages = [d.layers // 2 * d.layer_numel + table, d.layers // 2 * d.layer_numel + table + d.hidden]  # + final norm
    assert busiest_node_port(result) == pytest.approx(2 * 3 / 4 * sum(stages) * d.grad_bytes, rel=1e-9)


# ---------------------------------------------------------------------------------- memory


def test_memory():
    c, d, acc = cluster(4, 8), model("7b", seq=4096, micro_batch=1), 4
    psi, e, n = d.decoder_numel, d.replicated_numel, c.world_size
    mem = {m: peer_memory(m, d, c, acc, recompute=True) for m in PEERS if m != "1f1b"}
    assert mem["ddp"].persistent == 16 * psi and mem["ddp"].replicated == 16 * e
    for m in ("fsdp", "fsdp-mm", "fsdp-node"):
        assert mem[m].persistent == pytest.approx(16 * psi / n) and mem[m].replicated == pytest.approx(16 * e / n)
    assert mem["hsdp"].persistent == pytest.approx(16 * psi / 8)
    assert mem["fsdp-mm"].staging < mem["fsdp"].staging < mem["fsdp-node"].staging
    assert peer_memory("fsdp", d, c, acc, recompute=False).activations > mem["fsdp"].activations
    pipe = peer_memory("1f1b", d, c, acc, recompute=True)
    layers = d.layers // n
    table = d.vocab * d.hidden  # the first stage's embedding, or the last one's head and final norm
    assert pipe.persistent == 16 * layers * d.layer_numel and pipe.staging == 0
    assert pipe.replicated in (16 * table, 16 * (table + d.hidden)) and not d.tied and e == 2 * table + d.hidden
    # the first stage holds the layer inputs of N micro-batches, the last one and the logits
    inputs, working = layers * d.activation_numel * d.dtype_bytes, working_set_bytes(d, 1)
    logits = 3 * d.micro_batch * d.seq * d.vocab * 4
    assert pipe.activations == pytest.approx(max(n * inputs + working, inputs + working + logits))


# ------------------------------------------------------------------------------------ scale


@pytest.mark.parametrize("method, stages", [("ddp", None), ("fsdp", None), ("hsdp", None), ("1f1b", 8)])
def test_1024_gpus_stay_small(method, stages):
    """128 nodes × 8 GPUs, 64 micro-batches: one node (one 8-stage pipeline) stands for all."""
    c = Cluster(128, 8, DEVICES["h100"], LINKS["nvlink"], LINKS["400gb"])
    work = Workload(model("7b", seq=4096, micro_batch=1), c.device)
    graph, fabric = peer_graph(method, c, work, 64, host=False, stages=stages)
    assert len(graph.tasks) <= 100_000
    result = simulate(graph, fabric)
    assert math.isfinite(result.makespan) and result.makespan > 0


def test_a_1f1b_too_large_to_play_names_the_stages_and_micro_batches_that_play(monkeypatch):
    """A pipeline of P stages runs P x acc micro-batches; the refusal speaks of the acc per device
    given (not P x acc), and every --stages and the --micro-batches it offers do play."""
    from tawpipe.sim import peers

    monkeypatch.setattr(peers, "MAX_PIPELINE_TASKS", 5_000)
    c, work = cluster(4, 8), Workload(replace(TINY, layers=32), DEVICE, recompute=False)
    with pytest.raises(ValueError) as refused:
        peer_graph("1f1b", c, work, 2, host=False, stages=32)
    said = str(refused.value)
    assert "1F1B with 32 stages at 2 micro-batches per device runs 64 micro-batches through each pipeline" in said
    stages = [int(p) for p in said.split("--stages ")[1].split(";")[0].split(", ")]
    assert stages == [2, 4, 8, 16]  # 32 stages at 2 micro-batches are 8,192 tasks; 16 are 2,048
    most = int(said.split("at most --micro-batches ")[1])
    assert most == 1
    for p in stages:
        assert len(peer_graph("1f1b", c, work, 2, host=False, stages=p)[0].tasks) <= 5_000
    assert len(peer_graph("1f1b", c, work, most, host=False, stages=32)[0].tasks) <= 5_000
    with pytest.raises(ValueError, match="1F1B with 8 stages at 20 micro-batches per device"):
        peer_graph("1f1b", c, work, 20, host=False, stages=8)


def test_refuses_what_it_cannot_model():
    c, work = cluster(2, 2), Workload(TINY, DEVICE)
    with pytest.raises(ValueError, match="unknown peer"):
        peer_graph("zero3", c, work, 1, host=True)
    with pytest.raises(ValueError, match="1f1b only"):
        peer_graph("ddp", c, work, 1, host=True, stages=2)
    with pytest.raises(ValueError, match="tile nodes"):
        peer_graph("1f1b", cluster(2, 4), Workload(replace(TINY, layers=8), DEVICE), 1, host=True, stages=3)
    with pytest.raises(ValueError, match="at least 8 layers"):
        peer_graph("1f1b", cluster(2, 4), work, 1, host=True)
    big = Cluster(128, 8, DEVICES["h100"], LINKS["nvlink"], LINKS["400gb"])
    with pytest.raises(ValueError, match="fewer stages"):
        peer_graph("1f1b", big, Workload(replace(TINY, layers=1024), big.device), 64, host=False)
