"""`tawpipe bench comm`: sizes, the correctness check itself, a real sweep on 4 local gloo ranks
(every op and placement, results checked, JSON and plot written) and the torchrun path."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tawpipe.bench import comm
from tawpipe.runtime import comm as comms
from tawpipe.commands import UsageError
from tawpipe.runtime.launch import free_port
from tawpipe.plan.topology import Topology

ROOT = Path(__file__).resolve().parents[1]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    comm.add_arguments(p)
    return p


def _args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(list(argv))


def test_sizes_parse_like_nccl_tests() -> None:
    assert [comm.parse_size(s) for s in ("100", "1K", "64M", "2G", "8k")] == [100, 1024, 64 << 20, 2 << 30, 8192]
    with pytest.raises(argparse.ArgumentTypeError):
        comm.parse_size("1.5M")
    assert comm._sizes({"minbytes": 1024, "maxbytes": 64 << 20, "stepfactor": 4}) == [1024 << (2 * i) for i in range(9)]


def _expected_case(op: str, topo: Topology, rank: int, placement: str = "intra") -> comm._Case:
    """A case whose buffers hold what the operation must produce, computed here by hand."""
    layout = dict(comm._team_layout(topo))
    team = None
    if placement != "both":
        ranks = next(r for r in layout[placement] if rank in r)
        team = comm.Team(placement, ranks, ranks.index(rank))
    case = comm._Case(op, team, topo, rank, 4096, torch.float32, torch.device("cpu"))
    pat = lambda r, n=case.count: comm._pattern(r, n, salt=3)  # noqa: E731
    if op == "all_reduce":
        case.a.copy_(pat(team.ranks[0]) + pat(team.ranks[1]))
    elif op == "all_gather":
        case.b.copy_(torch.cat([pat(r) for r in team.ranks]))
    elif op == "reduce_scatter":
        full = pat(team.ranks[0], 2 * case.count) + pat(team.ranks[1], 2 * case.count)
        case.b.copy_(full[team.index * case.count:(team.index + 1) * case.count])
    elif op == "chunk_fetch":  # node 0 fetches the chunk of node 1's rail-0 rank (rank 2)
        case.b.copy_(pat(2))
    elif op == "grad_route":  # rank 0 owns what node 1 (ranks 2, 3) reduced
        case.b.copy_(pat(2) + pat(3))
    return case


@pytest.mark.parametrize("op,rank,placement", [
    ("all_reduce", 1, "intra"), ("all_gather", 3, "inter"), ("reduce_scatter", 1, "intra"),
    ("chunk_fetch", 1, "both"), ("grad_route", 0, "both"),
])
def test_check_counts_wrong_elements(op: str, rank: int, placement: str) -> None:
    case = _expected_case(op, Topology(2, 2), rank, placement)
    assert case.wrong(salt=3) == 0
    out = case.b if op in ("all_gather", "reduce_scatter", "chunk_fetch", "grad_route") else case.a
    out[[0, -1]] += 1
    assert case.wrong(salt=3) == 2


def test_sweep_on_four_local_gloo_ranks(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    out = tmp_path / "comm.json"
    rc = comm.main(_args("-b", "4K", "-e", "4K", "-n", "2", "--time-budget", "0", "--backend", "gloo",
                         "--json", str(out)))
    assert rc == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    got = {(r["op"], r["placement"], r["bytes"]) for r in rows}
    want = {(op, p, 4096) for op in comm.PRIMITIVES for p in ("intra", "inter")}
    want |= {(op, "both", 4096) for op in comm.COMPOSITES}
    assert got == want
    assert result["torch"] == torch.__version__ and result["cpus"] == os.cpu_count()  # provenance()
    for r in rows:
        assert r["wrong"] == 0 and r["iters"] == 2 and r["time_us"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
        assert r["busbw"] == pytest.approx(r["algbw"] * comm.BUS_FACTOR[r["op"]](r["n"]))
    assert (tmp_path / "comm.png").stat().st_size > 10_000
    printed = capfd.readouterr().out  # rank 0 prints from its own process
    assert "busbw = algbw x factor: all_reduce 2(n-1)/n" in printed and "#wrong" in printed


def test_runs_from_a_launchers_environment(tmp_path: Path) -> None:
    """Two processes with torchrun's variables (as tawpipe cluster sets them): 2 nodes x 1."""
    out = tmp_path / "env.json"
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tawpipe", "bench", "comm", "-b", "2K", "-e", "2K", "-n", "1", "--backend", "gloo",
             "--ops", "all_reduce,sendrecv,chunk_fetch", "--json", str(out), "-T", "60"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    result = json.loads(out.read_text())
    assert (result["nodes"], result["per_node"]) == (2, 1)
    placements = {(r["op"], r["placement"], r["n"]) for r in result["rows"]}
    # n = 1 per node: intra runs alone (no gloo self-send), inter pairs the nodes
    assert placements == {("all_reduce", "intra", 1), ("all_reduce", "inter", 2), ("sendrecv", "inter", 2),
                          ("chunk_fetch", "both", 2)}
    assert all(r["wrong"] == 0 for r in result["rows"])
    assert "wrote" not in outputs[1]  # only rank 0 reports


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("backend", ["nccl", "nccl-native"])
def test_nccl_backends_refuse_clearly_without_cuda(backend: str) -> None:
    with pytest.raises(UsageError, match=f"backend {backend} needs CUDA"):
        comm.main(_args("--backend", backend))


def test_backends_are_the_registrys_and_the_torch_backends_two_spellings() -> None:
    comms.register("mine", "somewhere:Mine")  # registered by a user, imported when used
    try:
        choices, names = next(a.choices for a in _parser()._actions if a.dest == "backend"), comms.names()
    finally:
        comms.unregister("mine")
    assert list(choices) == [*names, "gloo", "nccl"] and "mine" in choices
    # results keep today's names: the torch backend is gloo on the CPU and nccl on GPUs
    assert comm.backend_choice(None, cuda=False) == comm.backend_choice("torch", cuda=False) == \
        comm.backend_choice("gloo", cuda=True) == comm.Backend("torch", "cpu", "gloo")
    assert comm.backend_choice(None, cuda=True) == comm.backend_choice("nccl", cuda=False) == \
        comm.Backend("torch", "cuda", "nccl")
    assert comm.backend_choice("nccl-native", cuda=True) == comm.Backend("nccl-native", "cuda", "nccl-native")
    assert comm.backend_choice("mine", cuda=True) == comm.Backend("mine", "cuda", "mine")


def test_a_backend_without_the_optional_collectives_names_itself() -> None:
    class Minimal(comms.Comm):
        send = recv = broadcast = reduce = all_reduce = channel_comm = None

    with pytest.raises(NotImplementedError, match="Minimal has no all_gather"):
        Minimal().all_gather(torch.empty(4), torch.empty(2), (0, 1))
    with pytest.raises(NotImplementedError, match="Minimal has no reduce_scatter"):
        Minimal().reduce_scatter(torch.empty(2), torch.empty(4), (0, 1))


def test_the_bench_reaches_backends_through_the_registry_only() -> None:
    """Nothing from inside a backend's module: Comm.create and the Comm methods are all it calls."""
    source = (ROOT / "tawpipe" / "bench" / "comm.py").read_text()
    assert not re.findall(r"nccl_native|torch_dist|runtime\.comm\.\w", source)


_PEAKS = """
import re, sys, torch
from tawpipe.bench import comm
from tawpipe.plan.topology import Topology

def status(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\\s+(\\d+) kB", f.read(), re.M)[1]) * 1024

size, topo = int(sys.argv[1]), Topology(2, 2)
ranks = comm._team_layout(topo)[0][1][0]
for dtype in ("float32", "bfloat16"):
    for op in comm.OPS:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark from here on
        before = status("VmRSS")
        team = None if op in comm.COMPOSITES else comm.Team("intra", ranks, 0)
        case = comm._Case(op, team, topo, 0, size, comm.DTYPES[dtype], torch.device("cpu"))
        case.fill(0)
        case.wrong(0)
        print(dtype, op, status("VmHWM") - before)
        del case
"""


def test_the_memory_check_counts_what_a_rank_holds_at_the_largest_size() -> None:
    """The peak resident memory of one rank's buffers and -c 1's check, measured for every operation
    and dtype: never more than ``case_bytes`` (but for 16 MiB the measurement itself touches), and
    the worst operation's within 5% of it, so the check refuses no run that fits."""
    size = 16 << 20
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MALLOC_MMAP_THRESHOLD_="65536")  # every large tensor mapped and unmapped on its own
    out = subprocess.run([sys.executable, "-c", _PEAKS, str(size)], env=env, capture_output=True, text=True,
                         timeout=600, check=True).stdout
    peaks: dict[str, list[int]] = {}
    for line in out.splitlines():
        dtype, op, peak = line.split()
        counted = comm.case_bytes(size, comm.DTYPES[dtype], cpu=True, check=True)
        assert int(peak) <= counted + (16 << 20), (dtype, op, int(peak) / size, counted / size)
        peaks.setdefault(dtype, []).append(int(peak))
    for dtype, seen in peaks.items():
        assert len(seen) == len(comm.OPS) and max(seen) >= 0.95 * comm.case_bytes(size, comm.DTYPES[dtype], True, True), \
            (dtype, max(seen) / size)
    assert comm.case_bytes(size, torch.float32, cpu=False, check=False) == 0  # buffers on a GPU, nothing checked
