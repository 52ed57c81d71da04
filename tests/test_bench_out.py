"""`tawpipe bench WHAT --out DIR`: results go to ``tawpipe-results/`` in the current directory unless
``--out`` names another, and never into the committed ``benchmarks/results/`` by default."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_cases import nothing_starts, refused


ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "benchmarks" / "results"
DEFAULT = "tawpipe-results"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under root: its mtime and a hash of its contents."""
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def _comm(cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    """The cheapest sweep: one all_reduce of 1 KiB on 2 local gloo ranks (1 node x 2), through the CLI."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "tawpipe", "bench", "comm", "--nodes", "1", "--per-node", "2", "--backend", "gloo",
         "--ops", "all_reduce", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "--time-budget", "0", "-T", "60",
         *extra],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_comm_writes_under_out_and_never_into_committed_results(tmp_path: Path) -> None:
    before = _snapshot(COMMITTED)
    work = tmp_path / "work"
    work.mkdir()

    r = _comm(work)
    assert r.returncode == 0, r.stdout + r.stderr
    default = work / DEFAULT
    assert sorted(p.name for p in default.iterdir()) == ["comm_gloo_1x2.json", "comm_gloo_1x2.png"]
    result = json.loads((default / "comm_gloo_1x2.json").read_text())
    assert result["wrong"] == 0 and {(x["op"], x["placement"], x["n"]) for x in result["rows"]} == {
        ("all_reduce", "intra", 2), ("all_reduce", "inter", 1)}
    assert "out" not in result["config"]  # where it went is not part of the measurement
    assert f"wrote {os.path.join(DEFAULT, 'comm_gloo_1x2.json')}" in r.stdout

    elsewhere = tmp_path / "elsewhere" / "nested"  # created when needed
    r = _comm(work, "--out", str(elsewhere), "--plot", "")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == ["comm_gloo_1x2.json"]
    assert json.loads((elsewhere / "comm_gloo_1x2.json").read_text())["wrong"] == 0
    assert sorted(p.name for p in default.iterdir()) == ["comm_gloo_1x2.json", "comm_gloo_1x2.png"]  # untouched
    assert sorted(p.name for p in work.iterdir()) == [DEFAULT]

    assert _snapshot(COMMITTED) == before


@pytest.mark.parametrize("what", ["comm", "prefetch", "overlap", "cluster"])
def test_every_bench_defaults_to_the_results_folder_in_the_current_directory(what: str) -> None:
    p = argparse.ArgumentParser()
    importlib.import_module(f"tawpipe.bench.{what}").add_arguments(p)
    assert p.parse_args([]).out == DEFAULT
    assert p.parse_args(["--out", "benchmarks/results"]).out == "benchmarks/results"


def test_prefetch_writes_under_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tawpipe.bench import prefetch

    before = _snapshot(COMMITTED)
    monkeypatch.chdir(tmp_path)
    p = argparse.ArgumentParser()
    prefetch.add_arguments(p)
    small = ["--device", "cpu", "--numel", str(1 << 14), "--pieces", "4096", "--repeats", "1"]
    assert prefetch.main(p.parse_args(small)) == 0
    doc = json.loads((tmp_path / DEFAULT / "prefetch_cpu.json").read_text())
    assert doc["benchmark"] == "prefetch" and doc["accumulate_norm"]["t_s"] > 0  # the last addition, normed
    launches = doc["host_step"]["launches"]  # small kernels beside the host step on a thread, and alone
    assert launches["kernels"] >= 1 and launches["slowdown"] == launches["t_beside_step_s"] / launches["t_alone_s"] > 0
    assert prefetch.main(p.parse_args([*small, "--out", "mine"])) == 0
    assert [f.name for f in (tmp_path / "mine").iterdir()] == ["prefetch_cpu.json"]
    assert prefetch.main(p.parse_args([*small, "--out", "named.json"])) == 0  # a .json path is the file itself
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted([DEFAULT, "mine", "named.json"])
    assert _snapshot(COMMITTED) == before


@pytest.mark.parametrize("what", ["comm", "prefetch", "overlap", "context", "cluster"])
def test_an_existing_file_as_out_is_refused_before_the_bench_starts(capsys, monkeypatch, tmp_path: Path,
                                                                   what: str) -> None:
    nothing_starts(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_text("mine")
    line = refused(capsys, "bench", what, "--out", "taken")
    assert line.endswith("--out taken: is a file; it needs a directory"), line
    assert [p.name for p in tmp_path.iterdir()] == ["taken"] and (tmp_path / "taken").read_text() == "mine"


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_comm_refuses_a_file_it_cannot_write_before_any_rank_starts(capsys, monkeypatch, tmp_path: Path,
                                                                    flag: str) -> None:
    nothing_starts(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_text("")
    line = refused(capsys, "bench", "comm", flag, "taken/comm.x")
    assert line.endswith(f"{flag} taken/comm.x: taken is not a directory"), line


def test_prefetch_waits_as_long_as_tawpipe_timeout_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every offload the bench measures waits $TAWPIPE_TIMEOUT seconds, as the engine's do (it waited
    a fixed 300 s whatever the variable said)."""
    from tawpipe.bench import prefetch

    made = []

    class Recorded(prefetch.HostOffload):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self.timeout)

    monkeypatch.setattr(prefetch, "HostOffload", Recorded)
    monkeypatch.setenv("TAWPIPE_TIMEOUT", "42.5")
    monkeypatch.chdir(tmp_path)
    p = argparse.ArgumentParser()
    prefetch.add_arguments(p)
    assert prefetch.main(p.parse_args(["--device", "cpu", "--numel", "4096", "--pieces", "1024,2048",
                                       "--repeats", "1"])) == 0
    assert made == [42.5, 42.5, 42.5]  # one per piece size, one for the default piece


_PREFETCH_PEAK = """
import re, sys, torch
from tawpipe.bench import prefetch

def status(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\\s+(\\d+) kB", f.read(), re.M)[1]) * 1024

numel, dtype = int(sys.argv[1]), getattr(torch, sys.argv[2])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the high-water mark from here on
before = status("VmRSS")
prefetch.measure(torch.device("cpu"), numel, dtype, [1 << 20, 1 << 22], 1)
print(status("VmHWM") - before)
"""


@pytest.mark.parametrize("dtype, numel", [("bfloat16", 1 << 24), ("float32", 1 << 24), ("bfloat16", 1 << 22)])
def test_prefetch_counts_the_memory_it_holds(dtype: str, numel: int) -> None:
    """--numel's memory check counts what the measurement holds at its peak (measured: the growth of
    the process's high-water mark), within 5% and 32 MiB: one offload at a time, not two (8 B per
    element, 128 MiB, more); the host step's optimizer's imports once, whatever the size."""
    import torch

    from tawpipe.bench import prefetch

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MALLOC_MMAP_THRESHOLD_="65536")  # every large tensor mapped and unmapped on its own
    peak = int(subprocess.run([sys.executable, "-c", _PREFETCH_PEAK, str(numel), dtype], env=env, capture_output=True,
                              text=True, timeout=600, check=True).stdout)
    counted, _ = prefetch.footprint(torch.device("cpu"), numel, getattr(torch, dtype), [1 << 20, 1 << 22])
    assert 0.95 * counted <= peak <= counted + (32 << 20), (peak / numel, counted / numel)
