"""The local launcher: first failures named in time, no process left behind, no job deadline,
loopback only; and the progress board that names a stuck rank."""

from __future__ import annotations

import datetime
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launch_cases import (bar_then_killed, ends_at_start, freezes, inherited, late_stop, long_job, loaded, raises,
                          random_tensors, refuses_then_waits, train_then)
import tawpipe.runtime.launch as launch_module
from tawpipe.runtime import progress
from tawpipe.io.checkpoint import PeerCheckpointError
from tawpipe.runtime.comm.base import CommTimeout
from tawpipe.runtime.launch import JobFailed, _failure, free_port, grace_seconds, run_local

TESTS = Path(__file__).resolve().parent


def _since_bad(directory: Path) -> float:
    return time.time() - float((directory / "bad").read_text())


def test_a_killed_rank_is_named_within_10_s(tmp_path) -> None:
    with pytest.raises(JobFailed) as info:
        run_local(train_then, 4, str(tmp_path), 3, 1, "kill", timeout=60)
    assert _since_bad(tmp_path) < 10
    assert info.value.summary == "rank 3 died (SIGKILL) before returning", str(info.value)
    assert (info.value.rank, info.value.kind) == (3, "died")


def test_the_failure_starts_a_line_of_its_own_after_an_open_progress_bar(capfd) -> None:
    """Rank 0 is killed while its bar's line is open: the launcher ends that line, so that the
    message `tawpipe train` prints next starts at column 0 (it was printed at the end of the bar)."""
    with pytest.raises(JobFailed) as info:
        run_local(bar_then_killed, 2, timeout=60)
    print(f"tawpipe train: {info.value.summary}", file=sys.stderr)  # as tawpipe train tells it
    lines = capfd.readouterr().err.split("\n")
    assert lines[-3:] == ["\rtawpipe train:   3%|▎         | 3/100 [00:01<00:30]",
                          "tawpipe train: rank 0 died (SIGKILL) before returning", ""], lines


@pytest.mark.parametrize("how, message", [
    ("kill", "rank 1 died (SIGKILL) before returning"),
    pytest.param("exit", "rank 1 exited with code 3 before returning", marks=pytest.mark.slow),
])
def test_a_rank_ending_at_start_up_is_the_only_one_named(tmp_path, how, message) -> None:
    with pytest.raises(JobFailed) as info:
        run_local(ends_at_start, 2, str(tmp_path), how, timeout=60)
    assert _since_bad(tmp_path) < 10
    assert str(info.value) == message


@pytest.mark.slow
def test_a_frozen_rank_is_named_from_the_board() -> None:
    t0 = time.monotonic()
    with pytest.raises(JobFailed) as info:
        run_local(freezes, 2, timeout=1)
    assert info.value.summary.startswith("rank 1 stuck waiting for slot 7 RECV_G chunk 0 from r0 for "), str(info.value)
    assert "past its wait's timeout (1 s)" in str(info.value) and time.monotonic() - t0 < 60


def test_a_rank_that_raises_is_named_not_the_peer_it_left_behind() -> None:
    with pytest.raises(JobFailed) as info:
        run_local(raises, 2, timeout=60)
    assert info.value.summary == "rank 1 failed: ValueError: bad input on rank 1"
    assert 'raise ValueError("bad input on rank 1")' in str(info.value)  # with that rank's traceback


def test_a_rank_that_refused_its_batch_and_stayed_away_is_named_with_the_reason() -> None:
    """Its peer waits in the step; when that wait times out, the job names the rank and what
    its step refused, not only that it is outside tawpipe's code."""
    with pytest.raises(JobFailed) as info:
        run_local(refuses_then_waits, 2, timeout=4)
    assert info.value.summary.startswith(
        "rank 1 stuck in code outside tawpipe's executor, having refused what step() was given at step 0 "
        "(ValueError: step(batch): batch has 3 rows, not a positive multiple of micro_batches=2) for "), \
        info.value.summary
    assert (info.value.rank, info.value.kind) == (1, "stuck")


def test_errors_about_peers_are_told_apart() -> None:
    def report(e: BaseException):
        try:
            raise e
        except BaseException as caught:  # noqa: BLE001
            return _failure(caught)

    timeout = report(CommTimeout("timed out after 6s waiting for slot 3 rank 0 F W0"))
    broken = report(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    own = report(ValueError("bad input"))
    assert report(PeerCheckpointError("rank(s) [0] refused checkpoint x; see their errors")).about_a_peer
    assert (timeout.timed_out, timeout.about_a_peer) == (True, True)
    assert (broken.timed_out, broken.about_a_peer) == (False, True)
    assert (own.timed_out, own.about_a_peer, own.headline) == (False, False, "ValueError: bad input")


def _stuck(tmp_path: Path, world: int, timeout: float) -> None:
    stuck = world // 2  # the first rank of node 1
    with pytest.raises(JobFailed) as info:
        run_local(train_then, world, str(tmp_path), stuck, 1, "sleep", timeout=timeout)
    assert _since_bad(tmp_path) < timeout + 10
    e = info.value
    assert (e.rank, e.kind) == (stuck, "stuck"), str(e)
    # it sleeps in its first forward of step 1 (node 1 runs chunk 0 at slot 1)
    assert e.summary.startswith(f"rank {stuck} stuck in slot 1 F W0 m0 "), e.summary
    age = float(e.summary.rsplit(" for ", 1)[1].split()[0])
    assert timeout / 2 <= age <= timeout + 10
    assert "timed out" in str(e).lower()  # and the waiter's own message follows


def test_a_stuck_rank_is_named_within_the_timeout(tmp_path) -> None:
    _stuck(tmp_path, world=2, timeout=5)


@pytest.mark.slow
def test_a_stuck_rank_is_named_within_30_s_plus_10(tmp_path) -> None:
    _stuck(tmp_path, world=4, timeout=30)


@pytest.mark.parametrize("seconds", [4, pytest.param(65, marks=pytest.mark.slow)])
def test_no_job_deadline_and_loopback_only(seconds) -> None:
    """A job lives as long as its waits succeed, far past its per-wait timeout (the old launcher
    killed every job at timeout + 60 s); every socket of the job is on loopback."""
    t0 = time.monotonic()
    results = run_local(long_job, 2, seconds, os.getpid(), timeout=1)
    assert time.monotonic() - t0 > seconds
    loopback = ("0100007F:", "0000000000000000FFFF00000100007F:")
    for r in results:
        assert r["rounds"] > seconds  # it kept working all along
        assert r["sockets"] and r["launcher"]
        for address, state in r["sockets"] + r["launcher"]:
            assert address.startswith(loopback), (address, state)
    listening = [a for a, state in results[0]["launcher"] if state == "0A"]
    assert listening, "the launcher hosts the store"


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has ended


def test_a_signal_to_the_launcher_leaves_no_process(tmp_path) -> None:
    """SIGINT, SIGTERM and SIGKILL, each to a launcher of its own (run side by side). The SIGTERM
    comes twice, as from `timeout`, which signals the launcher and then its whole process group."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
    dirs = [tmp_path / sig.name for sig in sigs]
    launchers = []
    try:
        for d in dirs:
            d.mkdir()
            launchers.append(subprocess.Popen([sys.executable, str(TESTS / "launch_cases.py"), "local", str(d)],
                                              env=env, stderr=subprocess.PIPE, text=True))
        pid_files = [d / f"worker{r}.pid" for d in dirs for r in range(2)]
        deadline = time.monotonic() + 120
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert all(p.poll() is None for p in launchers) and time.monotonic() < deadline, "workers did not start"
            time.sleep(0.1)
        workers = [int(f.read_text()) for f in pid_files]
        t0 = time.monotonic()
        for launcher, sig in zip(launchers, sigs):
            launcher.send_signal(sig)
        time.sleep(0.05)
        launchers[sigs.index(signal.SIGTERM)].send_signal(signal.SIGTERM)  # a repeat while it stops
        errs = [launcher.communicate(timeout=10)[1] for launcher in launchers]
        while any(_alive(p) for p in workers) and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers), "a worker outlived its launcher"
        for launcher, sig, err in zip(launchers, sigs, errs):
            assert launcher.returncode == -sig or (sig == signal.SIGINT and launcher.returncode != 0), sig
            if sig != signal.SIGKILL:
                assert f"\ntawpipe: {sig.name}: stopped the local job's 2 workers" in err, err
                assert sig == signal.SIGINT or "Traceback" not in err, err  # SIGINT: KeyboardInterrupt
                # not at the end of the progress bar's line that rank 0 left open
                assert not [line for line in err.splitlines() if "3/100" in line and "tawpipe:" in line], err
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()


def _launch(mode: str, directory: Path, world: int, **env: str) -> list[subprocess.Popen]:
    """The ranks of a job started as torchrun starts them: one process each, with RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT (rank 0 hosts the store), no launcher of ours."""
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]), RANK=str(rank),
                        LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
        procs.append(subprocess.Popen([sys.executable, str(TESTS / "launch_cases.py"), mode, str(directory)],
                                      env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.parametrize("job", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_under_torchrun_the_survivors_of_a_killed_rank_name_it_and_exit_cleanly(tmp_path, job) -> None:
    """Rank 2 of 4 is killed inside a step. Every survivor names it and exits with code 1: left to
    the interpreter's exit, one survivor in about three aborted ("terminate called without an
    active exception", SIGABRT) and none said which rank had died."""
    procs = _launch("torchrun-killed", tmp_path, 4, TAWPIPE_TIMEOUT="60")
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert _since_bad(tmp_path) < 30
    assert procs[2].returncode == -signal.SIGKILL
    for rank in (0, 1, 3):
        out = outs[rank]
        assert procs[rank].returncode == 1, (rank, procs[rank].returncode, out[-3000:])
        assert "terminate called" not in out and "Fatal Python error" not in out, out[-3000:]
        assert f"tawpipe: rank {rank}: rank 2 is gone: no heartbeat for " in out, out[-3000:]


def _with_launcher(mode: str, directory: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(TESTS / "launch_cases.py"), mode, str(directory)],
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]), **env),
                            stderr=subprocess.PIPE, text=True)


def test_sigterm_stops_every_rank_at_an_iteration_boundary(tmp_path) -> None:
    """SIGTERM to the launcher reaches every worker as a stop request: ranks that ask
    stop_requested() stop at the same iteration and return, and the launcher raises JobStopped
    with their results. A rank that asks once but does not stop is killed after the grace
    (TAWPIPE_GRACE=1), and named missing."""
    counts, stubborn = tmp_path / "counts", tmp_path / "stubborn"
    counts.mkdir()
    stubborn.mkdir()
    launchers = [_with_launcher("local-counts", counts), _with_launcher("local-stubborn", stubborn, TAWPIPE_GRACE="1")]
    try:
        pid_files = [counts / f"worker{r}.pid" for r in range(3)] + [stubborn / f"worker{r}.pid" for r in range(2)]
        deadline = time.monotonic() + 120
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert all(p.poll() is None for p in launchers) and time.monotonic() < deadline, "workers did not start"
            time.sleep(0.1)
        time.sleep(0.5)  # a few iterations
        t0 = time.monotonic()
        for launcher in launchers:
            launcher.send_signal(signal.SIGTERM)
        errs = [launcher.communicate(timeout=60)[1] for launcher in launchers]
        elapsed = time.monotonic() - t0
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    workers = [int(f.read_text()) for f in pid_files]
    assert not any(_alive(p) for p in workers), "a worker outlived its launcher"
    assert [launcher.returncode for launcher in launchers] == [128 + signal.SIGTERM] * 2, errs
    done = json.loads((counts / "outcome.json").read_text())
    assert (done["how"], done["signal"], done["complete"], done["missing"]) == ("stopped", "SIGTERM", True, []), done
    iterations = [r["iterations"] for r in done["results"]]
    assert iterations[0] > 3 and len(set(iterations)) == 1, iterations  # the same boundary on every rank
    assert done["message"] == "stopped on request (SIGTERM): every rank returned"
    assert "tawpipe: SIGTERM: stopped the local job's 3 workers (3 of them returned)" in errs[0], errs[0]
    assert "Traceback" not in errs[0], errs[0]
    partial = json.loads((stubborn / "outcome.json").read_text())
    assert (partial["how"], partial["complete"], partial["missing"]) == ("stopped", False, [1]), partial
    assert partial["results"][0] > 3 and partial["results"][1] is None
    assert "did not return within the 1 s grace" in partial["message"]
    assert "tawpipe: SIGTERM: rank 1 stuck in code outside tawpipe's executor for " in errs[1], errs[1]
    assert "rank 0 stuck" not in errs[1], errs[1]
    assert elapsed < 30, elapsed  # the stubborn rank: 1 s grace, then SIGTERM (ignored now), then SIGKILL


def test_a_stop_signal_during_the_agreement_gives_every_rank_the_same_answer() -> None:
    """The agreed answer is the all-reduced flag alone: a signal that lands on one rank after it
    sent its flag counts at the next call, on every rank (CI once saw the ranks of `tawpipe
    train` part there: one saved and stopped, the other ran on, and both waited until killed)."""
    assert run_local(late_stop, 2) == [[False, True], [False, True]]


def test_stop_requested_arms_on_first_use_and_a_second_ctrl_c_stops_at_once() -> None:
    """Before its first call SIGTERM ends a process as ever; after it, SIGTERM (any number) and a
    first SIGINT only set the flag; a second SIGINT raises KeyboardInterrupt."""
    env = dict(os.environ, PYTHONPATH=str(TESTS.parent))
    code = ("import os, signal, sys\n"
            "from tawpipe.runtime.launch import stop_requested\n"
            "if sys.argv[1] == 'unarmed':\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    signal.pthread_kill(signal.pthread_self(), 0)\n"
            "    print('survived')\n"
            "    sys.exit(0)\n"
            "assert not stop_requested()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "assert stop_requested() and stop_requested(agree=True)  # no process group: the flag itself\n"
            "print('asked', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "print('not stopped at once')\n")

    def run(mode: str, sigint=signal.SIG_DFL) -> subprocess.CompletedProcess:
        # SIGINT as a shell hands it on: default in the foreground, ignored in a background job
        return subprocess.run([sys.executable, "-c", code, mode], env=env, capture_output=True, text=True, timeout=120,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))

    unarmed = run("unarmed")
    assert unarmed.returncode == -signal.SIGTERM and "survived" not in unarmed.stdout, unarmed
    armed = run("armed")
    assert armed.stdout == "asked\n" and "KeyboardInterrupt" in armed.stderr, armed
    # a process started with SIGINT ignored (nohup, a background job) keeps it ignored: only SIGTERM asks
    ignored = run("armed", signal.SIG_IGN)
    assert ignored.returncode == 0 and ignored.stdout == "asked\nnot stopped at once\n", ignored


def test_the_grace_period_comes_from_the_argument_or_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("TAWPIPE_GRACE", raising=False)
    assert grace_seconds() == 60.0 and grace_seconds(5) == 5.0
    monkeypatch.setenv("TAWPIPE_GRACE", "2.5")
    assert grace_seconds() == 2.5 and grace_seconds(0) == 0.0
    monkeypatch.setenv("TAWPIPE_GRACE", "soon")
    with pytest.raises(ValueError, match="TAWPIPE_GRACE='soon'"):
        grace_seconds()
    with pytest.raises(ValueError, match=">= 0"):
        grace_seconds(-1)


@pytest.mark.parametrize("world_size, timeout, message", [
    (0, None, r"world_size must be an integer >= 1 \(the number of ranks\), got 0"),
    (2.0, None, r"world_size must be an integer >= 1 \(the number of ranks\), got 2.0"),
    (True, None, r"world_size must be an integer >= 1 \(the number of ranks\), got True"),
    (2, 0, r"timeout must be a number of seconds > 0 \(or None: \$TAWPIPE_TIMEOUT, else 300\), got 0$"),
    (2, -5.0, r"timeout must be a number of seconds > 0 .*got -5.0$"),
    (2, float("inf"), r"timeout must be a number of seconds > 0 .*got inf$"),
    (2, "60", r"timeout must be a number of seconds > 0 .*got '60'$"),
])
def test_run_local_refuses_a_bad_world_size_or_timeout_before_starting_a_rank(monkeypatch, world_size, timeout,
                                                                             message) -> None:
    """A zero timeout used to mean the default, a negative one reached the workers, and no ranks
    returned an empty list: each is refused before any process starts."""
    def started(*args, **kwargs):
        raise AssertionError("a rank started")

    monkeypatch.setattr(launch_module._LocalJob, "start", started)
    with pytest.raises(ValueError, match=message):
        run_local(random_tensors, world_size, timeout=timeout)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_later_job_gets_the_environment_and_output_the_launcher_has_then(monkeypatch, tmp_path) -> None:
    """The fork server that starts the workers outlives a job; it started with the first job's
    environment and output. A later job's workers still see the launcher's environment and write
    where the launcher's output goes now (here: files this test points its stdout and stderr to)."""
    name = "TAWPIPE_TEST_INHERITED"
    monkeypatch.delenv(name, raising=False)
    first = run_local(inherited, 2, name, "first")
    token = os.urandom(6).hex()
    monkeypatch.setenv(name, token)
    files = {fd: tmp_path / f"fd{fd}" for fd in (1, 2)}
    saved = {fd: os.dup(fd) for fd in files}
    try:
        for fd, path in files.items():
            with open(path, "wb") as f:
                os.dup2(f.fileno(), fd)
        later = run_local(inherited, 2, name, token)
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
    assert [r["env"] for r in first] == [None, None]
    assert [r["env"] for r in later] == [token, token]
    out, err = files[1].read_text(), files[2].read_text()
    for rank in range(2):
        assert f"rank {rank} out {token}" in out, out  # the ranks' lines may interleave
        assert f"rank {rank} err {token}" in err, err
    # forked by one server, shared by both jobs, whose parent is this process
    servers = {r["parent"] for r in first + later}
    assert len(servers) == 1 and {r["grandparent"] for r in first + later} == {os.getpid()}


def test_a_job_launched_from_another_thread_spawns_its_workers() -> None:
    """A parent's death signal follows the thread that started the child: a fork server started
    by a thread that ends would take later jobs' workers with it, so another thread spawns."""
    results: list = []
    thread = threading.Thread(target=lambda: results.append(run_local(inherited, 2, "HOME", "thread")))
    thread.start()
    thread.join(timeout=120)
    assert results and [r["parent"] for r in results[0]] == [os.getpid()] * 2


def test_workers_start_with_what_the_launcher_imported_already_imported(tmp_path) -> None:
    """The fork server imports, once, the parts of tawpipe its launcher has (here the simulator's
    map, which no worker's code imports) and torch._dynamo, which torch imports on a worker's first
    optimizer step: each worker paid 1.7-2.5 s of CPU for it, 4 ranks on 2 cores 5 s a job."""
    names = ["tawpipe.sim.atlas", "torch._dynamo"]
    launcher = ("import json, sys, tawpipe.sim.atlas; from tawpipe.runtime.launch import run_local; "
                "from launch_cases import loaded; print(json.dumps(run_local(loaded, 2, sys.argv[1:])))")
    done = subprocess.run([sys.executable, "-c", launcher, *names], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)])))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [dict.fromkeys(names, True)] * 2


def test_a_server_started_early_serves_the_first_job(tmp_path) -> None:
    """``start_server`` (``tawpipe train`` calls it before it imports torch and checks the job: a
    16.8 s quick start took 11.4 s) starts, without torch, the fork server that the launcher's
    first job then forks its workers from: no second server, and the workers have the modules it
    was asked to preload."""
    launcher = ("import json, sys, pathlib; from tawpipe.runtime import workers\n"
                "workers.start_server(['tawpipe.sim.atlas'])\n"
                "assert 'torch' not in sys.modules and 'tawpipe.sim.atlas' not in sys.modules\n"
                "from tawpipe.runtime.launch import run_local; from launch_cases import inherited, loaded\n"
                "def servers():\n"
                "    kids = pathlib.Path(f'/proc/self/task/{__import__(\"os\").getpid()}/children').read_text().split()\n"
                "    return [int(k) for k in kids if b'forkserver' in pathlib.Path(f'/proc/{k}/cmdline').read_bytes()]\n"
                "before = servers()\n"
                "jobs = run_local(inherited, 2, 'X', 'token'), run_local(loaded, 2, ['tawpipe.sim.atlas'])\n"
                "print(json.dumps({'before': before, 'after': servers(), 'parents': [r['parent'] for r in jobs[0]],"
                " 'loaded': jobs[1]}))")
    done = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)])))
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert len(got["before"]) == 1 and got["after"] == got["before"] == got["parents"][:1] == got["parents"][1:]
    assert got["loaded"] == [{"tawpipe.sim.atlas": True}] * 2


def test_a_launcher_that_ends_while_its_server_imports_leaves_no_process() -> None:
    """A run refused after ``start_server`` ends while the server is still importing torch (about
    4 s of CPU): the server dies with it at once, not after its imports."""
    mark = f"TAWPIPE_TEST_MARK={os.getpid()}-{time.monotonic_ns()}"
    launcher = "import os; from tawpipe.runtime import workers; workers.start_server(); os._exit(2)"
    done = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(TESTS.parent), TAWPIPE_TEST_MARK=mark.split("=")[1]))
    assert done.returncode == 2, done.stderr

    def marked() -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and mark.encode() in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:  # gone meanwhile
                pass
        return found

    deadline = time.monotonic() + 1.0
    while marked() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = marked()
    for pid in left:  # not to leave them running if this fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the server outlived its launcher: {left}"


def test_the_fork_servers_imports_make_no_cuda_call() -> None:
    """Every worker is forked from the server, and a process forked from one that has initialised
    the CUDA driver (torch.cuda.is_available() does, by asking the runtime for the device count)
    cannot use CUDA. So importing all of tawpipe, as the server may, calls none of torch's CUDA
    queries (checked by replacing them before the imports)."""
    check = """
import importlib, pkgutil, torch
calls = []
def spy(owner, name):
    real = getattr(owner, name)
    setattr(owner, name, lambda *a, **k: calls.append(name) or real(*a, **k))
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "get_device_properties",
             "get_device_capability", "get_device_name", "is_bf16_supported", "mem_get_info"):
    spy(torch.cuda, name)
for name in ("_cuda_getDeviceCount", "_cuda_init", "_cuda_getDevice"):
    if hasattr(torch._C, name):  # a CUDA build's
        spy(torch._C, name)
import tawpipe, tawpipe.runtime.fork_server
for module in pkgutil.walk_packages(tawpipe.__path__, "tawpipe."):
    if not module.name.endswith("__main__"):
        try:
            importlib.import_module(module.name)
        except ImportError:  # an extension this build has not (tawpipe._nccl without NCCL)
            pass
assert not calls, calls
print(len(calls), "calls")
"""
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=str(TESTS.parent)))
    assert done.returncode == 0 and done.stdout.strip() == "0 calls", done.stdout + done.stderr


def test_ranks_return_tensors() -> None:
    """CPU tensors in lists and dicts come back exactly. They used to travel through torch's
    shared-memory reductions, whose file descriptors the launcher fetched from the worker after
    the worker had exited: 8 jobs in 9 failed with "rank N exited with code 0 before returning"."""
    for job in range(3):
        results = run_local(random_tensors, 4, job, timeout=60)
        assert all(_same(got, random_tensors(rank, job)) for rank, got in enumerate(results)), job
        assert all(not r["vector"].is_shared() for r in results)


@pytest.mark.slow
def test_under_torchrun_a_timeout_names_the_stuck_peer(tmp_path) -> None:
    """No launcher of ours: the ranks see each other's progress through the job's store."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]), TAWPIPE_TIMEOUT="8")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                    str(TESTS / "launch_cases.py"), "torchrun", str(tmp_path)], env=env, capture_output=True,
                   timeout=300)
    errors = {int(p.name[5:]): p.read_text() for p in tmp_path.glob("error*")}
    assert errors and 2 not in errors, errors
    for rank, message in errors.items():
        assert "timed out" in message.lower(), message
        assert message.endswith(tuple(f"; rank 2 stuck in slot 1 F W0 m0 [w0] for {s} s" for s in range(4, 12))), message


def test_board_slots_and_the_suspect() -> None:
    board = progress.Board(bytearray(progress.Board.nbytes(3)), 3)
    assert board.entries() == []
    now = time.monotonic()
    board.write(0, "slot 4 rank 0 BCAST_W W1 root r2", waiting=True, limit=30.0, since=now - 20)
    board.write(1, "slot 4 rank 1 F W1 m0 [w1]", waiting=False, since=now - 18)
    board.write(2, "slot 3 rank 2 RECV_W W1 from r0 " + "x" * 400, waiting=True, limit=30.0, since=now - 25)
    e0, e1, e2 = board.entries()
    assert (e0.rank, e0.waiting, e0.limit) == (0, True, 30.0) and 19.9 < e0.age < 21
    assert 200 < len(e2.label) < progress.SLOT_BYTES and e2.label.startswith("slot 3 rank 2 RECV_W")  # cut
    # the busy rank is blamed before ranks that wait longer, unless it is too recent
    assert progress.suspect([e0, e1, e2]) == e1
    assert progress.suspect([e0, e1, e2], min_age=19) == e2
    assert progress.suspect([e0, e1, e2], exclude={1}) == e2
    assert progress.suspect([e0, e1, e2], exclude={1}, min_age=26) is None
    assert progress.stuck(e1) == "rank 1 stuck in slot 4 F W1 m0 [w1] for 18 s"
    assert progress.stuck(e0) == "rank 0 stuck waiting for slot 4 BCAST_W W1 root r2 for 20 s"
    v = board.version(1)
    board.write(1, progress.OUTSIDE, waiting=False)
    assert board.version(1) == v + 2 and board.read(1).age < 1


class _SlowStore:
    """A store whose every write takes a while, like one behind a busy link."""

    def __init__(self) -> None:
        self.writes = 0

    def set(self, key: str, value: str) -> None:
        time.sleep(0.3)
        self.writes += 1


def test_store_mirror_close_waits_for_the_push_in_flight() -> None:
    """A heartbeat left inside a store call at interpreter exit aborts the process, so close()
    must return only once the thread is gone."""
    store = _SlowStore()
    mirror = progress.StoreMirror(store, 0, 1, interval=0.01).start()
    mirror.local.write(0, "slot 1 rank 0 F W0 m0 [w0]", waiting=False)
    deadline = time.monotonic() + 5
    while not mirror._lock.locked():  # a push is in flight
        assert time.monotonic() < deadline
        time.sleep(0.005)
    mirror.close()
    assert not mirror._thread.is_alive() and store.writes == 1


def _store_mirrors(n: int, **kwargs) -> tuple[dist.TCPStore, list[progress.StoreMirror]]:
    """A job's store on a free local port, and one rank's mirror of the progress board per rank."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           master_listen_fd=listener.detach(), timeout=datetime.timedelta(seconds=10))
    mirrors = [progress.StoreMirror(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                                  timeout=datetime.timedelta(seconds=10)), r, n, **kwargs)
               for r in range(n)]
    return server, mirrors


def test_store_mirror_shows_every_rank() -> None:
    """Under torchrun each rank's slot reaches the others through the job's store."""
    server, mirrors = _store_mirrors(3)
    assert mirrors[0].entries() == []
    now = time.monotonic()
    mirrors[0].local.write(0, "slot 2 rank 0 REDUCE_G chunk 1 root r1", waiting=True, limit=9.0, since=now - 7)
    mirrors[2].local.write(0, "slot 2 rank 2 B W3 m1 [w0]", waiting=False, since=now - 5)
    for m in mirrors:
        m.push()
    seen = mirrors[1].entries()
    assert [e.rank for e in seen] == [0, 2]
    assert seen[0].waiting and seen[0].limit == 9.0 and 6.5 < seen[0].age < 8
    assert progress.suspect(seen, exclude={1}) == seen[1]
    mirrors[2].start()  # the heartbeat pushes changes by itself
    mirrors[2].local.write(0, "slot 3 rank 2 STEP", waiting=False)
    deadline = time.monotonic() + 10
    while mirrors[1].entries()[1].label != "slot 3 rank 2 STEP":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    mirrors[2].close()
    del server


def test_a_rank_whose_heartbeat_stopped_is_gone_and_the_verdict_is_shared(monkeypatch) -> None:
    """Under torchrun: a rank silent for GONE_AFTER seconds that did not say it ended is gone, and
    blamed first; what a failing rank finds is posted for the others, who keep a copy."""
    server, mirrors = _store_mirrors(4, attempt="0")
    for m in mirrors:
        m.local.write(0, f"slot 3 rank {m.rank} F W1 m0 [w1]", waiting=False)
        m.push()
    stale = {"beat": time.time() - 7, "ended": "", "label": "slot 3 rank 2 F W1 m0 [w1]", "waiting": False,
             "limit": 0.0, "since": time.time() - 8}
    server.set("tawpipe/progress/0/2", json.dumps(stale))  # rank 2 died 7 s ago
    server.set("tawpipe/progress/0/3", json.dumps(stale | {"ended": "after a peer: RuntimeError: x"}))
    entries = mirrors[0].entries()
    assert [e.rank for e in progress.gone(entries)] == [2]
    assert progress.departed(progress.gone(entries)[0]) == (
        "rank 2 is gone: no heartbeat for 7 s (killed, frozen or cut off), last seen in slot 3 F W1 m0 [w1]")
    monkeypatch.setattr(progress, "_source", mirrors[0])
    monkeypatch.setattr(progress, "_rank", 0)
    assert progress.hint(min_age=0).startswith("; rank 2 is gone: no heartbeat for 7 s")  # before the busiest
    verdict = progress.blame_after_failure(within=0)
    assert verdict.startswith("rank 2 is gone") and mirrors[0].verdict == verdict
    assert mirrors[1].read_verdict() == verdict  # a heartbeat keeps a copy, for when the store is gone
    assert not progress.StoreMirror(mirrors[1].store, 1, 4, attempt="1").read_verdict()  # another attempt's keys
    # a rank that failed on its own error, and said so, is blamed before a silent one
    monkeypatch.setattr(progress, "_source", mirrors[2])
    monkeypatch.setattr(progress, "_rank", 2)
    server.set("tawpipe/progress/1/3", json.dumps(stale | {"ended": "failed: ValueError: bad input"}))
    other = progress.StoreMirror(mirrors[1].store, 1, 4, attempt="1")
    monkeypatch.setattr(progress, "_source", other)
    monkeypatch.setattr(progress, "_rank", 1)
    assert progress.blame_after_failure(within=0) == "rank 3 failed first: ValueError: bad input"
    del server


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_step_bar_in_a_log_ends_once_with_the_last_steps_values() -> None:
    """Not a terminal: a plain line every total // 20 steps and at the last, the only 100%."""
    log = io.StringIO()
    bar = progress.StepBar(45, 0, "tawpipe train", stream=log)
    for step in range(1, 46):
        bar.step(f"loss {step}")
    bar.close()
    lines = log.getvalue().splitlines()
    assert [int(re.match(r"tawpipe train: step (\d+)/45 \(\d+%\), [\d.]+ s \| loss (\d+)$", line)[2])
            for line in lines] == [*range(2, 45, 2), 45]
    assert log.getvalue().count("100%") == 1 and "(100%)" in lines[-1] and "\r" not in log.getvalue()


def test_a_step_bar_on_a_terminal_shows_each_count_with_its_own_values() -> None:
    """tqdm redraws the line in place; no drawing shows a step's count with the previous step's
    loss (the count moved before the loss did), and the last drawing is the end."""
    screen = _Terminal()
    bar = progress.StepBar(5, 0, "tawpipe train", stream=screen)
    for step in range(1, 6):
        time.sleep(0.15)  # past tqdm's minimum interval: every step is drawn
        bar.step(f"loss {step}")
    bar.close()
    drawings = [d for d in screen.getvalue().split("\r") if "|" in d]
    shown = [re.search(r" (\d)/5 .*?(?:loss (\d))?\]?$", d.strip()).groups() for d in drawings]
    assert len(shown) >= 5 and shown[0] == ("0", None), shown
    assert all(count == loss for count, loss in shown[1:]), shown
    assert shown[-1] == ("5", "5") and screen.getvalue().endswith("\n")


def test_the_default_comm_without_torch_distributed_says_how_to_start_it() -> None:
    """The engine's default backend needs torch.distributed; without it the message says how to
    start it (it was torch's 'Default process group has not been initialized', asked for the
    backend first). A fresh interpreter: this one may have a process group from another test."""
    code = ("from tawpipe import TawPipe, ModelParts\nfrom tawpipe.plan.topology import Topology\n"
            "from engine_cases import TinyLM, lm_loss\n"
            "m = TinyLM(2)\n"
            "try:\n"
            "    TawPipe(ModelParts(m.blocks, m.embed, m.head, lm_loss), topology=Topology(1, 1), micro_batches=1)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.startswith("torch.distributed is not initialised: call tawpipe.runtime.launch.init_distributed()"), \
        out.stdout + out.stderr
