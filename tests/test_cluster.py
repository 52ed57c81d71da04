"""The emulated cluster: pure parts everywhere, one end-to-end run where root is available.

The end-to-end tests build real namespaces and rate-limited veths, check that the veth counters
see exactly the inter-node bytes (and none of the intra-node ones), and that nothing is left
behind — also when the launcher is killed outright.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tawpipe import cluster as cl
from tawpipe.bench.baselines import RunConfig
from tawpipe.bench import cluster as bench
from tawpipe.bench.cluster import method, report
from tawpipe.cluster import ClusterSpec, LinkBytes, command, host, netns
from tawpipe.commands import UsageError
from tawpipe.plan.topology import Topology
from tawpipe.runtime.workers import parent_of
from tawpipe.simulate.inputs import shape_dims

from cli_cases import refused


def spec(nodes: int = 3, per_node: int = 2, rate: str | None = "100mbit") -> ClusterSpec:
    return ClusterSpec(nodes, per_node, rate, run_id="tpc4242x7")


# ------------------------------------------------------------------------------------ pure parts


@pytest.mark.parametrize("text, bits", [("100mbit", 10**8), ("1gbit", 10**9), ("1.5Mbit", 1_500_000),
                                        ("500kbit", 500_000), ("64bit", 64)])
def test_parse_rate(text, bits):
    assert cl.parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["100", "100mb", "fast", "0mbit", "-1mbit", ""])
def test_parse_rate_rejects_with_an_example(bad):
    with pytest.raises(ValueError, match="100mbit"):
        cl.parse_rate(bad)


@pytest.mark.parametrize("kw, what", [(dict(nodes=0), "nodes"), (dict(per_node=0), "per-node"),
                                      (dict(rate="100"), "rate"), (dict(queue_ms=0), "queue-ms"),
                                      (dict(nodes=251), "250 nodes"), (dict(run_id="foo"), "run id")])
def test_spec_rejects_bad_input(kw, what):
    args = dict(nodes=2, per_node=2, rate="100mbit") | kw
    with pytest.raises(ValueError, match=what):
        ClusterSpec(**args)


@pytest.mark.parametrize("argv, message", [
    (["--rate", "799bit"], "link rate '799bit' is below 800bit, the slowest the links' shaper can set"),
    (["--queue-ms", "350000"], "queue-ms 350000 at 100mbit queues 4,375,262,144 bytes, more than the "
                               "4,294,967,295 a tc bfifo holds: give a queue-ms of at most 343576"),
    (["--rate", "100gbit"], "queue-ms 400 at 100gbit queues 5,050,000,000 bytes"),
    (["--timeout", "0"], "argument --timeout: expected a finite number > 0, got 0"),
    (["--timeout", "nan"], "argument --timeout: expected a finite number > 0, got nan"),
])
def test_link_options_tc_or_the_wait_cannot_take_are_refused_before_the_cluster_is_built(
        monkeypatch, capsys, argv, message):
    """A rate under 800 bit/s (its acknowledgement class under tc's 1 byte/s), a queue of more
    bytes than a bfifo holds (32 bits) and a timeout not > 0 were tracebacks once namespaces were
    built, tc's error blamed on a missing CAP_NET_ADMIN, or Cluster.run's ValueError."""
    def built(*args, **kwargs):
        raise AssertionError("the cluster was built before its options were refused")

    monkeypatch.setattr(command, "Cluster", built)
    monkeypatch.setattr(host, "unavailable_reason", lambda spec=None: None)
    line = refused(capsys, "cluster", "run", *argv, "--", "true",
                   prog="tawpipe cluster run" if "--timeout" in argv else "tawpipe cluster")
    assert message in line, line
    # the bounds are the last values tc takes
    assert ClusterSpec(1, 1, "800bit").rate == "800bit"
    assert ClusterSpec(1, 1, "100mbit", queue_ms=343576).queue_bytes <= 2**32 - 1


def test_names_are_recognisable_and_unique():
    s = spec()
    assert s.namespaces == ["tpc4242x7-n0", "tpc4242x7-n1", "tpc4242x7-n2", "tpc4242x7-br"]
    a, b = ClusterSpec(2, 1), ClusterSpec(2, 1)
    assert a.run_id != b.run_id and a.run_id.startswith(f"tpc{os.getpid()}x")
    assert len({s.address(g) for g in range(s.nodes)}) == s.nodes
    assert all(s.address(g).startswith(cl.SUBNET + ".") for g in range(s.nodes))
    assert all(len(name) <= 15 for name in (cl.NODE_LINK, s.bridge_link(249)))  # Linux IFNAMSIZ


def test_setup_commands_build_a_rate_limited_star():
    s = spec()
    cmds = cl.setup_commands(s)
    assert cmds[: len(s.namespaces)] == [["ip", "netns", "add", ns] for ns in s.namespaces]
    for g in range(s.nodes):
        ns, peer = s.node_ns(g), s.bridge_link(g)
        # the veth is born with its ends inside the namespaces: nothing appears in the root one
        assert ["ip", "link", "add", cl.NODE_LINK, "netns", ns, "type", "veth", "peer", "name", peer,
                "netns", s.bridge_ns] in cmds
        assert ["ip", "-n", s.bridge_ns, "link", "set", peer, "master", "br0"] in cmds
        assert ["ip", "-n", ns, "addr", "add", f"{s.address(g)}/24", "dev", cl.NODE_LINK] in cmds
        shaped = [c for c in cmds if c[0] == "tc" and c[6] in (cl.NODE_LINK, peer) and c[2] in (ns, s.bridge_ns)]
        sides = {(c[2], c[6]) for c in shaped}
        assert sides == {(ns, cl.NODE_LINK), (s.bridge_ns, peer)}, "both directions must be limited"
        for side in sides:  # the link class at the rate, a bulk FIFO of 400 ms, acknowledgements first
            mine = [c for c in shaped if (c[2], c[6]) == side]
            link = next(c for c in mine if "1:1" in c and "classid" in c)
            assert link[link.index("rate") + 1] == "100mbit"
            assert int(link[link.index("burst") + 1]) > 65536 + 64 * 66  # whole GSO packets pass
            fifo = next(c for c in mine if "bfifo" in c)
            assert int(fifo[fifo.index("limit") + 1]) >= 100e6 / 8 * 0.4
            acks = next(c for c in mine if "filter" in c)
            assert acks[acks.index("flowid") + 1] == "1:10" and "0xff80" in acks  # IPv4 length < 128
    # every command is scoped to one of the cluster's namespaces
    for c in cmds[len(s.namespaces):]:
        assert any(ns in c for ns in s.namespaces), c


def test_no_rate_means_no_tc():
    assert not [c for c in cl.setup_commands(spec(rate=None)) if c[0] == "tc"]
    assert cl.shaping_commands(spec(rate=None), on=False) == []


def test_unlimiting_removes_exactly_the_shapers_setup_added():
    s = spec()
    shaped = {(c[2], c[6]) for c in cl.setup_commands(s) if c[0] == "tc"}
    off = cl.shaping_commands(s, on=False)
    assert {(c[2], c[6]) for c in off} == shaped and len(off) == len(shaped) == 2 * s.nodes
    assert all(c[3:5] == ["qdisc", "del"] and c[-1] == "root" for c in off)
    assert cl.shaping_commands(s) == [c for c in cl.setup_commands(s) if c[0] == "tc"]


def test_stale_namespaces_are_those_of_dead_launchers():
    listing = "tpc11x0-n0 (id: 3)\ntpc11x0-br (id: 2)\ntpc22x1-n0\nsomeone-else\ntpc33x0-n0-extra\n"
    names = cl.parse_netns_list(listing)
    assert names == ["tpc11x0-n0", "tpc11x0-br", "tpc22x1-n0", "someone-else", "tpc33x0-n0-extra"]
    alive = {22}.__contains__
    assert cl.stale_namespaces(names, alive) == ["tpc11x0-n0", "tpc11x0-br"]
    assert cl.stale_namespaces(names, alive, everything=True) == ["tpc11x0-n0", "tpc11x0-br", "tpc22x1-n0"]


def test_worker_env_is_torchruns():
    s = spec(nodes=3, per_node=2)
    for rank in range(s.world_size):
        env = cl.worker_env(s, rank, 29500, base={"PATH": "/bin"})
        assert Topology.from_env(env) == Topology(3, 2)
        assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"]) == (str(rank), str(rank % 2), str(rank // 2))
        assert env["MASTER_ADDR"] == s.address(0) and env["MASTER_PORT"] == "29500"
        assert env["GLOO_SOCKET_IFNAME"] == env[cl.LINK_ENV] == cl.NODE_LINK
        assert env["PATH"] == "/bin"
        assert cl.worker_command(s, rank, ["python", "x.py"]) == [
            "ip", "netns", "exec", s.node_ns(rank // 2), "python", "x.py"]
    with pytest.raises(ValueError, match="outside"):
        cl.worker_env(s, 6, 1)


def test_ranks_are_pinned_round_robin(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {7, 3, 5})
    pinned = dataclasses.replace(spec(nodes=3, per_node=2), pin_cpus=True)
    assert [cl.worker_cpus(pinned, r) for r in range(6)] == [{3}, {5}, {7}, {3}, {5}, {7}]
    assert cl.worker_cpus(spec(), 0) is None  # by default the kernel places the ranks


def test_byte_accounting():
    before, after = LinkBytes(tx=100, rx=50), LinkBytes(tx=1_250_100, rx=2_500_050)
    moved = after - before
    assert moved == LinkBytes(1_250_000, 2_500_000) and moved.busiest_direction == 2_500_000
    # busiest direction of the busiest node, at 100 Mbit/s: 2.5 MB -> 0.2 s
    assert cl.network_floor([moved, LinkBytes(10, 10)], 10**8) == pytest.approx(0.2)


def test_link_bytes_outside_a_cluster(monkeypatch):
    monkeypatch.delenv(cl.LINK_ENV, raising=False)
    assert cl.link_bytes() is None


def test_unavailable_reason_names_the_problem(monkeypatch):
    monkeypatch.setattr(host.os, "geteuid", lambda: 1000)
    assert "needs root" in cl.unavailable_reason()
    monkeypatch.setattr(host.shutil, "which", lambda tool: None)
    assert "ip and tc" in cl.unavailable_reason()
    with pytest.raises(cl.ClusterUnavailable, match="iproute2"):
        cl.Cluster(spec()).up()


def _as_root_with(monkeypatch, tmp_path, cap_eff: str) -> None:
    """As root with iproute2, and ``cap_eff`` as CapEff in /proc/self/status."""
    monkeypatch.setattr(host.os, "geteuid", lambda: 0)
    monkeypatch.setattr(host.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    status = tmp_path / "status"
    status.write_text(f"Name:\tpython3\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff}\nCapBnd:\t000001ffffffffff\n")
    monkeypatch.setattr(host, "_PROC_STATUS", str(status))


def test_root_without_cap_net_admin_is_told_so(monkeypatch, tmp_path):
    """Root in a container without NET_ADMIN: `ip netns add` would fail, so the cluster (and its
    tests) are unavailable, naming the capability."""
    _as_root_with(monkeypatch, tmp_path, f"{0x1fffeffffff & ~(1 << 12):016x}")
    reason = cl.unavailable_reason()
    assert "CAP_NET_ADMIN" in reason and "CAP_SYS_ADMIN" not in reason, reason
    _as_root_with(monkeypatch, tmp_path, "00000000a80425fb")  # docker's default set: neither
    assert "CAP_NET_ADMIN and CAP_SYS_ADMIN" in cl.unavailable_reason()
    with pytest.raises(cl.ClusterUnavailable, match="CAP_NET_ADMIN"):
        cl.Cluster(spec()).up()


def test_network_changing_tests_run_only_when_asked(monkeypatch, tmp_path):
    """As root with every capability the end-to-end tests still skip unless TAWPIPE_NETNS_TESTS=1."""
    from conftest import NETNS_ENV

    _as_root_with(monkeypatch, tmp_path, "000001fffeffffff")
    monkeypatch.delenv(NETNS_ENV, raising=False)
    assert f"set {NETNS_ENV}=1" in cl.unavailable_reason()
    with pytest.raises(cl.ClusterUnavailable, match=NETNS_ENV):
        cl.Cluster(spec()).up()  # nothing created
    # every command that builds a cluster asks the same check (the one conftest.py wraps)
    run = argparse.ArgumentParser()
    cl.add_arguments(run)
    with pytest.raises(UsageError, match=NETNS_ENV):
        cl.main(run.parse_args(["run", "--nodes", "1", "--per-node", "1", "--", "true"]))
    with pytest.raises(UsageError, match=NETNS_ENV):
        bench.main(_parse("--nodes", "2", "--methods", "ddp"))
    monkeypatch.setenv(NETNS_ENV, "0")
    assert f"set {NETNS_ENV}=1" in cl.unavailable_reason()
    monkeypatch.setenv(NETNS_ENV, "1")
    assert cl.unavailable_reason() is None


def test_run_needs_an_up_cluster():
    with pytest.raises(cl.ClusterError, match="not up"):
        cl.Cluster(spec()).run(["true"], timeout=1)


def test_resolve_function_or_command():
    assert command._resolve(["tawpipe.cluster:link_bytes"]) is cl.link_bytes
    assert command._resolve(["python", "-m", "tawpipe"]) is None
    with pytest.raises(UsageError, match="cannot import"):
        command._resolve(["tawpipe.cluster:nope"])


# --------------------------------------------------------------------- the bench's pure parts


def test_best_k_is_the_micro_batch_count():
    assert bench.methods(4, prefetch_depth=2)["tawpipe-best"].engine_options == {
        "mb_per_fetch": 4, "reuse_weights": True, "prefetch_depth": "resident", "recompute": "none"}
    assert bench.methods(4, prefetch_depth=3, recompute="chunk")["tawpipe"].engine_options == {
        "mb_per_fetch": 1, "prefetch_depth": 3, "reuse_weights": False, "recompute": "chunk"}
    assert bench.methods(4, recompute="chunk")["weipipe"].engine_options == {"algo": "weipipe", "recompute": "chunk"}
    assert bench.methods(4)["tawpipe-host"].engine_options == {
        "mb_per_fetch": 4, "reuse_weights": "host", "prefetch_depth": 1, "recompute": "none"}
    assert "tawpipe-best" not in bench.methods(1) and "tawpipe-host" not in bench.methods(1)


def test_replicas_add_tawpipe_at_both_k_on_the_node_counts_they_divide():
    known = bench.methods(2, replicas=(2,))
    assert known["tawpipe-r2"].engine_options == {**known["tawpipe"].engine_options, "replicas": 2}
    assert known["tawpipe-best-r2"].engine_options == {**known["tawpipe-best"].engine_options, "replicas": 2}
    assert known["tawpipe"].replicas == 1 and known["fsdp"].replicas == 1
    assert "tawpipe-best-r2" not in bench.methods(1, replicas=(2,)) and "tawpipe-r2" not in bench.methods(2)
    assert bench.for_shape(known["tawpipe-r2"], 4, 2).label == "tawpipe (k=1), 2 replicas of 2×2"
    assert bench.for_shape(known["tawpipe-r2"], 3, 2) is None
    assert bench.for_shape(known["hsdp"], 3, 2) is known["hsdp"]


def test_fsdp_prediction_counts_gloo_reduce_scatter_as_all_reduce():
    cfg = RunConfig(nodes=2, per_node=2, micro_batches=3)
    dims = shape_dims(dataclasses.asdict(cfg))
    ring, psi, e = 3 / 4, dims.decoder_numel, dims.replicated_numel
    gathers = 3 * ring * (2 * psi + e) * 4
    assert bench.predicted_busiest("fsdp", cfg) == pytest.approx(gathers + 2 * ring * (psi + e) * 4)
    assert bench.predicted_busiest("fsdp-mm", cfg) == pytest.approx(gathers + 3 * 2 * ring * (psi + e) * 4)
    # the model of the bench, untied: 6.56 M parameters as in the measurement
    assert psi + e == 6_557_952


def test_fsdp_node_prediction_gathers_the_blocks_across_nodes_only_in_forward():
    cfg = RunConfig(nodes=2, per_node=2, micro_batches=3)
    dims = shape_dims(dataclasses.asdict(cfg))
    ring, psi, e = 3 / 4, dims.decoder_numel, dims.replicated_numel
    # forward: blocks and root over all ranks; backward: the blocks from the node; one all-reduce
    node = bench.predicted_busiest("fsdp-node", cfg)
    assert node == pytest.approx((3 * ring * (psi + e) + 2 * ring * (psi + e)) * 4)
    # one rank per node keeps the whole blocks after forward: no backward gather either
    assert bench.predicted_busiest("fsdp-node", dataclasses.replace(cfg, nodes=4, per_node=1)) == pytest.approx(node)
    assert bench.predicted_busiest("fsdp", cfg) - node == pytest.approx(3 * ring * psi * 4)
    assert bench.predicted_busiest("fsdp-node", dataclasses.replace(cfg, nodes=1, per_node=4)) == 0.0
    assert list(bench.methods(2))[-6:] == ["fsdp", "fsdp-mm", "fsdp-node", "hsdp", "ddp", "1f1b"]


def test_a_larger_vocabulary_is_in_the_predictions_and_the_engines_loss(monkeypatch):
    from tawpipe.bench import baselines
    from tawpipe.models.llama import Llama, chunked_head_loss

    cfg = RunConfig(vocab=1024, loss="chunked")
    dims = shape_dims(dataclasses.asdict(cfg))
    assert dims.decoder_numel + dims.replicated_numel == sum(p.numel() for p in Llama(cfg.model_config()).parameters())
    monkeypatch.setattr(method, "TawPipe", lambda parts, **kw: (parts, kw))
    model = baselines.build_model(cfg)
    parts, kw = bench.build_engine(model, cfg, cfg.topology, torch.device("cpu"))
    assert parts.head_loss is chunked_head_loss and kw["memory"].chunked_loss


def test_bound_pairs_each_method_with_its_unlimited_run():
    taw = bench.methods(2)["tawpipe"]
    free = bench.compute_only(taw)
    assert free.unlimited and free.engine_options == taw.engine_options and free.name == "tawpipe-compute"
    rows = [dict(method="tawpipe", label="tawpipe (k=1)", status="ok", time_median_s=6.0, floor_s=5.0),
            dict(method="tawpipe-compute", label="x", status="ok", time_median_s=2.5, unlimited=True),
            dict(method="weipipe", label="WeiPipe", status="ok", time_median_s=9.0, floor_s=3.0),
            dict(method="weipipe-compute", label="y", status="ok", time_median_s=4.5, unlimited=True),
            dict(method="ddp", label="DDP", status="ok", time_median_s=4.0, floor_s=3.9)]
    bench.add_bounds(rows)
    assert rows[0]["time_over_bound"] == pytest.approx(6.0 / 5.0)  # network-bound
    assert rows[2]["time_over_bound"] == pytest.approx(9.0 / 4.5)  # compute-bound
    assert rows[2]["compute_only_s"] == 4.5
    assert "time_over_bound" not in rows[4] and "time_over_bound" not in rows[1]


def test_crossover_is_where_1f1b_bytes_reach_tawpipes():
    cfg = RunConfig()
    s_star = bench.crossover_seq(cfg, 64e6)
    assert bench.predicted_busiest("1f1b", RunConfig(seq_len=round(s_star))) == pytest.approx(64e6, rel=1e-3)


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_a_preset_fills_what_the_command_line_leaves_at_its_default():
    a = _parse("--rate", "5mbit", "--preset", "long", "--rounds", "1")
    assert (a.rate, a.rounds, a.cpus_per_rank, a.seq_len, a.layers_per_rank) == ("5mbit", 1, 0.3, [4096], 1)
    assert a.compute_only == ["tawpipe-best"] and "fsdp-node" in a.methods and a.nodes == [2, 3]
    b = _parse("--preset", "sweep")
    assert b.nodes == [2] and len(b.seq_len) >= 4 and b.rate == "14mbit"
    assert _parse().preset is None and _parse().seq_len == [RunConfig().seq_len]


def _sweep_shape(seq: int, taw: float, one_f_one_b: float) -> dict:
    cfg = RunConfig(hidden=128, heads=4, layers=4, seq_len=seq)
    row = dict(status="ok", peak_rss_bytes_max=2**20, predicted_busiest_bytes=3.2e6)
    return {"config": dataclasses.asdict(cfg),
            "rows": [dict(row, method="tawpipe-best", label="best", time_median_s=taw),
                     dict(row, method="1f1b", label="1F1B", time_median_s=one_f_one_b, predicted_busiest_bytes=None)]}


def test_the_measured_crossover_is_where_the_time_ratio_crosses_one():
    # ratio 2 at S = 512, 0.5 at S = 2048: 1 at 1024 in log S
    result = {"shapes": [_sweep_shape(256, 4.0, 1.0), _sweep_shape(512, 2.0, 1.0), _sweep_shape(2048, 2.0, 4.0)]}
    (c,) = bench.sweep_crossovers(result)
    assert c["measured_seq"] == pytest.approx(1024.0)
    cfg = RunConfig(hidden=128, heads=4, layers=4, seq_len=256)
    assert c["predicted_seq"] == pytest.approx(bench.crossover_seq(cfg, 3.2e6))
    assert c["measured_over_predicted"] == pytest.approx(1024.0 / c["predicted_seq"])
    result["crossovers"] = [c]
    text = "\n".join(report._sweep_markdown(result))
    assert "| 512 | 2.00 | 1.00 | 2.00 |" in text and "S = 1,024 (measured" in text
    never = {"shapes": [_sweep_shape(256, 2.0, 1.0), _sweep_shape(512, 1.5, 1.0)]}
    assert bench.sweep_crossovers(never)[0]["measured_seq"] is None


CALIBRATION = {"name": "cpu rank x 0.5, in the cluster", "matmul_flops": 5e10, "attention_flops": 2e10,
               "memory_bandwidth": 9e9, "memory": 2e10, "peak": None, "transfer_rate": 1e9}


def test_each_shape_is_written_as_soon_as_it_is_measured(tmp_path, monkeypatch):
    """A run stopped during its second cluster keeps the first one's results on disk."""
    measured = []

    def run_shape(cfg, here, spec, rounds, timeout, log=print):
        if measured:
            raise KeyboardInterrupt
        measured.append(cfg.nodes)
        return {"runs": {m.name: [] for m in here}, "checks": {}, "reference_losses": [1.0],
                "failures": {m.name: ["rank 1 exited with code 1"] for m in here}, "calibration": CALIBRATION}

    monkeypatch.setattr(bench, "run_shape", run_shape)
    monkeypatch.setattr(host, "unavailable_reason", lambda spec=None: None)
    with pytest.raises(KeyboardInterrupt):
        bench.main(_parse("--nodes", "2", "3", "--methods", "ddp", "hsdp", "--out", str(tmp_path)))
    saved = json.loads((tmp_path / "cluster.json").read_text())
    assert [s["config"]["nodes"] for s in saved["shapes"]] == [2] == measured
    assert [r["method"] for r in saved["shapes"][0]["rows"]] == ["ddp", "hsdp"]
    assert "### 2 nodes × 2 ranks" in (tmp_path / "cluster.md").read_text()
    # fixed compute: the ranks' rates at the shape, measured after its runs, for `simulate --validate`
    assert saved["shapes"][0]["calibration"] == CALIBRATION
    assert not list(tmp_path.glob("*.part"))


class _Runs:
    """Not a tensor: a weights-only load refuses it instead of running its code."""

    ran = False

    def __reduce__(self):
        return (_Runs._run, ())

    @staticmethod
    def _run():
        _Runs.ran = True
        return {}


def test_merged_checkpoints_are_loaded_weights_only(tmp_path, monkeypatch):
    from tawpipe.bench.baselines import merge_params

    torch.save({"w": torch.ones(2)}, tmp_path / "rank0.pt")
    assert torch.equal(merge_params(str(tmp_path), 2)["w"], torch.ones(2))
    torch.save(_Runs(), tmp_path / "rank1.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # overrides torch's default, not an explicit True
    with pytest.raises(Exception, match="[Ww]eights only load failed"):
        merge_params(str(tmp_path), 2)
    assert not _Runs.ran


def test_comm_plot_titles_tell_the_emulated_link_from_loopback(monkeypatch):
    """The two committed gloo 2x2 plots had the same title; the cluster's link rate tells them apart."""
    import json
    from pathlib import Path

    from tawpipe.bench import comm

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(cl.LINK_ENV, raising=False)
    shaped = comm.title(json.loads((results / "comm_gloo_2x2_cluster_400mbit.json").read_text()))
    local = comm.title(json.loads((results / "comm_gloo_2x2.json").read_text()))
    assert shaped.startswith("tawpipe bench comm: gloo, 2 nodes x 2 (emulated cluster, 400mbit links), float32")
    assert local.startswith("tawpipe bench comm: gloo, 2 nodes x 2 (local job, loopback), float32")
    # plotted by rank 0 of a fresh run inside the cluster: the rate of its node's shaper
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(cl.LINK_ENV, cl.NODE_LINK)
    monkeypatch.setattr(comm, "_shaped_rate", lambda link: "123mbit" if link == cl.NODE_LINK else None)
    fresh = dict(backend="gloo", nodes=2, per_node=1, dtype="float32", device="cpu", hosts=["a", "b"])
    assert comm.title(fresh) == "tawpipe bench comm: gloo, 2 nodes x 1 (emulated cluster, 123mbit links), float32, cpu"
    monkeypatch.delenv(cl.LINK_ENV)
    assert comm.title(fresh) == "tawpipe bench comm: gloo, 2 nodes x 1, float32, cpu"  # torchrun: not known


# -------------------------------------------------------------------------- on a real cluster

# root, iproute2, CAP_NET_ADMIN, and TAWPIPE_NETNS_TESTS=1: they change the host's network (conftest.py)
needs_netns = pytest.mark.skipif(cl.unavailable_reason(ClusterSpec(1, 1)) is not None,
                                 reason=str(cl.unavailable_reason(ClusterSpec(1, 1))))
M = 2_000_000  # bytes per probe message
# What the veth counts besides payload, at worst: one Ethernet + IP + TCP (timestamps) header per
# MSS-sized segment. Segments are larger when GSO coalesces them, so the overhead varies from
# under 1% (an idle machine) to this bound (a loaded one: the full suite measured 2.6% on a ring).
WIRE = 1 + 66 / 1448


def _probe(rank: int) -> dict:
    """P2P across nodes, P2P inside a node, an all-reduce: the node's veth bytes for each."""
    x = torch.ones(M // 4)
    out = {}

    def window(name, fn):
        dist.barrier()
        a = cl.link_bytes()
        dist.barrier()  # nobody sends before every node has read its counters
        fn()
        dist.barrier()
        b = cl.link_bytes() - a
        out[name] = [b.tx, b.rx]

    window("inter", lambda: dist.send(x, 2) if rank == 0 else dist.recv(x, 0) if rank == 2 else None)
    window("intra", lambda: dist.send(x, 1) if rank == 0 else dist.recv(x, 0) if rank == 1 else None)
    window("all_reduce", lambda: dist.all_reduce(x))
    out["topology"] = [Topology.from_env().nodes, Topology.from_env().per_node]
    out["cpus"] = sorted(os.sched_getaffinity(0))
    return out


def _fail(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(60)


def _our_children() -> list[int]:
    """Child processes of this test process, except multiprocessing's resource tracker and fork
    server (started once per process by run_local in other tests, and meant to outlive them)."""
    kids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if parent_of(int(pid)) != os.getpid():
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if not any(helper in cmdline for helper in (b"resource_tracker", b"forkserver")):
                kids.append(int(pid))
        except (FileNotFoundError, IndexError, ProcessLookupError):
            pass
    return kids


def _leftovers(s: ClusterSpec) -> list[str]:
    return [ns for ns in cl.list_namespaces() if ns.startswith(s.run_id + "-")]


@needs_netns
def test_veth_counters_see_inter_node_bytes_only():
    s = ClusterSpec(2, 2, "200mbit", pin_cpus=True)
    with cl.Cluster(s) as c:
        before = c.link_bytes()
        res = c.run(_probe, timeout=120)
        moved = [b - a for a, b in zip(before, c.link_bytes())]
    assert res[0]["topology"] == [2, 2]
    assert [r["cpus"] for r in res] == [sorted(cl.worker_cpus(s, r)) for r in range(4)]  # pinned
    tx0, rx0 = res[0]["inter"]
    tx2, rx2 = res[2]["inter"]
    assert M <= tx0 <= WIRE * M and M <= rx2 <= WIRE * M  # payload + headers
    assert rx0 < 0.01 * M and tx2 < 0.01 * M  # only ACKs come back
    assert max(res[0]["intra"] + res[2]["intra"]) < 0.005 * M  # loopback: the veth sees ~nothing
    ring = 2 * 3 / 4 * M  # gloo's ring all-reduce leaves each node over one link
    for r in (0, 2):  # each direction: its payload with headers, plus the ACKs of the other's
        assert all(ring <= v <= (2 * WIRE - 1) * ring for v in res[r]["all_reduce"]), res[r]
    # the launcher's bridge-side view of the whole run agrees with the nodes' own counters
    assert moved[0].tx >= tx0 + res[0]["all_reduce"][0] and moved[1].rx >= rx2 + res[2]["all_reduce"][1]
    assert not _leftovers(s) and not _our_children()


def _transfer_seconds(rank: int) -> float:
    x = torch.randn(M // 4)
    dist.barrier()
    t = time.perf_counter()
    if rank == 0:
        dist.send(x, 1)
    elif rank == 1:
        dist.recv(x, 0)
    dist.barrier()
    return time.perf_counter() - t


@needs_netns
def test_unlimited_lifts_the_rate_limit_and_puts_it_back():
    s = ClusterSpec(2, 1, "8mbit")  # M bytes take 2 s at 8 Mbit/s
    with cl.Cluster(s) as c:
        limited = c.run(_transfer_seconds, timeout=120)[0]
        with c.unlimited():
            free = c.run(_transfer_seconds, timeout=120)[0]
        again = c.run(_transfer_seconds, timeout=120)[0]
    assert limited > 1.5 and again > 1.5, (limited, again)  # 2 s less the shaper's 256 KiB burst
    assert free < 0.5, free
    assert not _leftovers(s)


@needs_netns
def test_failure_and_timeout_tear_everything_down():
    s = ClusterSpec(2, 1, None)
    with pytest.raises(cl.ClusterError, match="fails on purpose"):
        with cl.Cluster(s) as c:
            c.run(_fail, timeout=120)
    assert not _leftovers(s) and not _our_children()
    s = ClusterSpec(2, 1, None)
    t0 = time.monotonic()
    with cl.Cluster(s) as c:
        with pytest.raises(cl.ClusterError, match="still running"):
            c.run(["sleep", "60"], timeout=1)
        assert not _our_children()
    assert time.monotonic() - t0 < 20 and not _leftovers(s)


@needs_netns
def test_a_rank_that_fails_ends_cluster_run_with_its_message_not_a_traceback(capsys):
    """`tawpipe cluster run` whose rank exits with 3 says so on one line and exits 1 (it was
    ClusterError's traceback), and leaves nothing behind."""
    before = set(cl.list_namespaces())
    code = cl.main(argparse.Namespace(action="run", nodes=2, per_node=1, rate=None, queue_ms=400, pin_cpus=False,
                                      compute="shared", cpus_per_rank=None, timeout=120.0,
                                      target=["--", sys.executable, "-c",
                                              "import os, sys; sys.exit(3 * (os.environ['RANK'] == '1'))"]))
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("tawpipe cluster run: rank 1 exited with code 3"), err
    assert "Traceback" not in err
    assert set(cl.list_namespaces()) <= before and not _our_children()


@needs_netns
@pytest.mark.parametrize("how", ["down", "next run"])
def test_killed_launcher_leaves_no_workers_and_down_or_the_next_run_cleans(capsys, how):
    """What a SIGKILLed launcher leaves (its namespaces and cgroups) goes with `tawpipe cluster down`,
    or with the next cluster built, which says so (they piled up until a `down`)."""
    code = ("import sys; from tawpipe.cluster import Cluster, ClusterSpec\n"
            "with Cluster(ClusterSpec(2, 1, None)) as c:\n    c.run(['sleep', '120'], timeout=300)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=root)
    prefix = f"{cl.PREFIX}{launcher.pid}x"
    try:
        deadline = time.monotonic() + 30
        workers: list[str] = []
        while time.monotonic() < deadline and len(workers) < 2:
            names = [ns for ns in cl.list_namespaces() if ns.startswith(prefix) and "-n" in ns]
            workers = [p for ns in names for p in netns.run_ip(["ip", "netns", "pids", ns], check=False).stdout.split()]
            time.sleep(0.2)
        assert len(workers) == 2, "the launcher did not start its workers"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in workers):
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{p}") for p in workers), "workers outlived their launcher"
        assert [ns for ns in cl.list_namespaces() if ns.startswith(prefix)], "expected leftovers to clean"
        cgroups = cl.cpu_controller()[0]
        assert [d for d in os.listdir(cgroups) if d.startswith(prefix)], "expected the ranks' cgroups left"
        capsys.readouterr()
        if how == "down":
            assert cl.main(argparse.Namespace(action="down", all=False)) == 0
        else:
            with cl.Cluster(ClusterSpec(1, 1, None)) as c:
                assert c.run(["true"], timeout=60) == [0]
            err = capsys.readouterr().err  # its 3 namespaces and 1 cgroup, and any a killed launcher left before
            assert re.search(r"removed ([3-9]|\d\d+) namespace\(s\) and \d+ cgroup\(s\) left by launchers that were "
                             "killed", err), err
        assert not [ns for ns in cl.list_namespaces() if ns.startswith(prefix)]
        assert not [d for d in os.listdir(cgroups) if d.startswith(prefix)], "down left the cgroups"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        cl.remove_namespaces([ns for ns in cl.list_namespaces() if ns.startswith(prefix)])
