"""Fixed compute on the emulated cluster: a CPU quota per rank (a cgroup), so waiting costs time.

Pure parts (the spec, the environment, the cgroup files) everywhere; where root may build
clusters (TAWPIPE_NETNS_TESTS=1, see conftest.py), a rank that spins gets its quota and no more,
also while the other rank sleeps, and nothing is left behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import pytest

from tawpipe import cluster as cl
from tawpipe.cluster import ClusterSpec, host


def test_default_quota_is_the_machines_cores_over_the_ranks():
    s = ClusterSpec(2, 3, run_id="tpc4242x7")
    cores = len(os.sched_getaffinity(0))
    assert s.compute == "fixed" and s.rank_cpus == pytest.approx(cores / 6)
    assert s.threads == max(1, cores // 6)
    assert ClusterSpec(1, 1, cpus_per_rank=float(os.cpu_count())).threads == os.cpu_count()
    assert ClusterSpec(1, 1, cpus_per_rank=0.99).threads == 1
    shared = ClusterSpec(2, 2, compute="shared")
    assert shared.rank_cpus is None and shared.threads == 1


@pytest.mark.parametrize("kw, what", [(dict(compute="gpu"), "fixed"), (dict(cpus_per_rank=0.0), "cpus-per-rank"),
                                      (dict(cpus_per_rank=1e6), "cpus-per-rank"),
                                      (dict(compute="shared", cpus_per_rank=0.5), "leave it out")])
def test_spec_rejects_bad_compute(kw, what):
    with pytest.raises(ValueError, match=what):
        ClusterSpec(2, 2, **kw)


def test_workers_get_the_quotas_thread_count(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    fixed = ClusterSpec(1, 2, cpus_per_rank=1.0)
    env = cl.worker_env(fixed, 0, 29500)
    assert env["OMP_NUM_THREADS"] == env[cl.THREADS_ENV] == "1"
    shared = cl.worker_env(ClusterSpec(1, 2, compute="shared"), 0, 29500)
    assert shared["OMP_NUM_THREADS"] == shared[cl.THREADS_ENV] == "7"  # the caller's choice


def test_cpu_controller_is_found_in_either_version(tmp_path):
    v1, v2, none = tmp_path / "v1", tmp_path / "v2", tmp_path / "none"
    for d in (v1, v2, none):
        d.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    (none / "cgroup.controllers").write_text("cpuset io memory\n")
    assert cl.cpu_controller([str(none), str(v2), str(v1)]) == (str(v2), 2)
    assert cl.cpu_controller([str(v1)]) == (str(v1), 1)
    assert cl.cpu_controller([str(none), str(tmp_path / "missing")]) is None


@pytest.mark.parametrize("version", [1, 2])
def test_each_rank_gets_its_own_cgroup_with_its_quota(tmp_path, version):
    s = ClusterSpec(2, 2, cpus_per_rank=0.37, run_id="tpc4242x7")
    q = cl.CpuQuota(s, (str(tmp_path), version))
    q.create()
    quota = round(0.37 * cl.CPU_PERIOD_US)
    for rank in range(4):
        d = tmp_path / "tpc4242x7" / f"r{rank}"
        assert q.procs_file(rank) == str(d / "cgroup.procs")
        if version == 1:
            assert (d / "cpu.cfs_period_us").read_text() == str(cl.CPU_PERIOD_US)
            assert (d / "cpu.cfs_quota_us").read_text() == str(quota)
        else:
            assert (d / "cpu.max").read_text() == f"{quota} {cl.CPU_PERIOD_US}"
    if version == 2:
        assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"


def test_stale_cgroups_are_those_of_dead_launchers(tmp_path):
    for name in ("tpc100x0", "tpc200x3", "tpc100x1-n0", "user.slice"):
        (tmp_path / name).mkdir()
    (tmp_path / "tpc300x0").write_text("a file, not a cgroup")
    found = cl.stale_cgroups(lambda pid: pid == 200, controller=(str(tmp_path), 1))
    assert found == [str(tmp_path / "tpc100x0")]
    assert len(cl.stale_cgroups(lambda pid: True, everything=True, controller=(str(tmp_path), 1))) == 2


def test_fixed_compute_without_a_controller_names_the_shared_mode(monkeypatch):
    monkeypatch.setenv("TAWPIPE_NETNS_TESTS", "1")  # the check itself creates nothing (conftest.py)
    monkeypatch.setattr(host, "cpu_controller", lambda roots=(): None)
    monkeypatch.setattr(host.os, "geteuid", lambda: 0)
    monkeypatch.setattr(host, "_effective_capabilities", lambda: -1)
    monkeypatch.setattr(host.shutil, "which", lambda tool: f"/sbin/{tool}")
    reason = cl.unavailable_reason(ClusterSpec(2, 2))
    assert "cgroup cpu controller" in reason and "--compute shared" in reason
    assert cl.unavailable_reason(ClusterSpec(2, 2, compute="shared")) is None


def test_cli_options_build_the_spec():
    p = argparse.ArgumentParser()
    cl.add_link_arguments(p)
    s = cl.spec_from_args(p.parse_args(["--cpus-per-rank", "0.25", "--rate", "10mbit"]), 3, 2)
    assert (s.nodes, s.per_node, s.rate, s.compute, s.rank_cpus) == (3, 2, "10mbit", "fixed", 0.25)
    assert cl.spec_from_args(p.parse_args(["--compute", "shared"]), 2, 2).compute == "shared"


# -------------------------------------------------------------------------- on a real cluster

needs_netns = pytest.mark.skipif(cl.unavailable_reason(ClusterSpec(1, 1)) is not None,
                                 reason=str(cl.unavailable_reason(ClusterSpec(1, 1))))
SPIN_S = 1.5


def _throttled_s(cgroup: str) -> float:
    """How long the kernel has held ``cgroup`` back for its quota (cgroup v1 or v2)."""
    with open(os.path.join(cgroup, "cpu.stat")) as f:
        stat = dict(line.split() for line in f)
    return int(stat["throttled_time"]) / 1e9 if "throttled_time" in stat else int(stat["throttled_usec"]) / 1e6


def _spin_or_sleep(rank: int) -> dict:
    """Rank 0 sleeps, the others spin: each reports the CPU seconds it got in SPIN_S of wall time."""
    import torch.distributed as dist

    dist.barrier()
    c0, t0 = time.process_time(), time.monotonic()
    if rank == 0:
        time.sleep(SPIN_S)
    else:
        while time.monotonic() - t0 < SPIN_S:
            pass
    cpu = time.process_time() - c0
    dist.barrier()
    return {"cpu_s": cpu, "threads": int(os.environ[cl.THREADS_ENV])}


@needs_netns
def test_a_rank_gets_its_quota_and_not_the_idle_ranks_time():
    s = ClusterSpec(1, 2, None, cpus_per_rank=0.25)
    controller = cl.cpu_controller()
    with cl.Cluster(s) as c:
        assert os.path.isdir(os.path.join(controller[0], s.run_id, "r1"))
        out = c.run(_spin_or_sleep, timeout=120)
        # the quota holds the rank's work only: rank 0 only slept, and its start and its exit (seconds
        # of CPU for the interpreter and torch, four times that in wall time at a quarter core) are not
        # a device's work
        held = _throttled_s(os.path.join(controller[0], s.run_id, "r0"))
    assert held < 0.5, f"the quota held back a rank that only slept for {held:.1f} s: its start ran under it"
    assert not os.path.exists(os.path.join(controller[0], s.run_id)), "the cgroups outlived the cluster"
    spun = out[1]["cpu_s"] / SPIN_S
    assert 0.15 < spun < 0.33, f"a rank with a quota of 0.25 core got {spun:.2f} core while the other slept"
    assert out[0]["cpu_s"] < 0.1 and out[1]["threads"] == 1
    # shared: the spinning rank takes a whole core (the machine has at least one idle)
    with cl.Cluster(ClusterSpec(1, 2, None, compute="shared")) as c:
        shared = c.run(_spin_or_sleep, timeout=120)[1]["cpu_s"] / SPIN_S
    assert shared > 0.6, f"without a quota a spinning rank got only {shared:.2f} core"


@needs_netns
def test_a_rank_measures_itself_under_its_quota_and_what_its_transfers_cost_it():
    """`bench cluster`'s calibration, taken by the ranks themselves (``on_rank``): the quota shows in
    the rates, sending and receiving take compute from the rank, and a rank that idled gets part of
    the wait back."""
    from tawpipe.models.shape import ModelDims
    from tawpipe.sim.calibrate import calibrate, median_device, on_rank

    dims = ModelDims(hidden=128, layers=2, heads=4, vocab=256, seq=512, micro_batch=1, dtype_bytes=4, grad_bytes=4)
    with cl.Cluster(ClusterSpec(2, 1, None, cpus_per_rank=0.25)) as c:
        ranks = c.run(on_rank, dataclasses.asdict(dims), "a quarter core", 5, 0.25, 1, 2, timeout=300)
    dev = median_device(ranks)
    assert dev.name == "a quarter core"
    assert dev.matmul_flops == pytest.approx(statistics.median(r["matmul_flops"] for r in ranks))
    # measured from outside, one thread scaled to a quarter core: the rank sees about as much (its
    # throttling costs some), where an unenforced quota would show four times that
    outside = calibrate(dims, threads=1, quota=0.25, repeats=5, rounds=1)
    for rate in ("matmul_flops", "attention_flops"):
        assert 0.4 < getattr(dev, rate) / getattr(outside, rate) < 1.5, rate
    # gloo's copies run in the rank's cgroup: every byte sent or received costs it compute
    assert all(r["transfer_rate"] is not None and 1e6 < r["transfer_rate"] < 1e11 for r in ranks)
    # after an idle spell a rank runs at its thread's whole core until the quota's leftover is
    # spent: it gets back some of the 60 ms it slept, never more (no quota: nothing comes back)
    credits = [r["idle_credit"] for r in ranks]
    assert all(c is not None and 0.001 < c < 0.06 for c in credits), credits
    assert dev.burst == 4.0 and dev.host_ranks == 8.0  # one thread over a quarter core; 2 cores over it
