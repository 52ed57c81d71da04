"""The local launcher: first failures named in time, no process left behind, no job deadline,
loopback only; and the progress board that names a stuck rank."""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from launch_cases import ends_at_start, freezes, long_job, raises, train_then
from tawpipe.runtime import progress
from tawpipe.io.checkpoint import PeerCheckpointError
from tawpipe.runtime.comm.base import CommTimeout
from tawpipe.runtime.launch import JobFailed, _failure, run_local

TESTS = Path(__file__).resolve().parent


def _since_bad(directory: Path) -> float:
    return time.time() - float((directory / "bad").read_text())


def test_a_killed_rank_is_named_within_10_s(tmp_path) -> None:
    with pytest.raises(JobFailed) as info:
        run_local(train_then, 4, str(tmp_path), 3, 1, "kill", timeout=60)
    assert _since_bad(tmp_path) < 10
    assert info.value.summary == "rank 3 died (SIGKILL) before returning", str(info.value)
    assert (info.value.rank, info.value.kind) == (3, "died")


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
    results = run_local(long_job, 2, seconds, timeout=1)
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
                assert f"{sig.name}: stopped the local job's 2 workers" in err, err
                assert sig == signal.SIGINT or "Traceback" not in err, err  # SIGINT: KeyboardInterrupt
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()


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


def test_store_mirror_shows_every_rank() -> None:
    """Under torchrun each rank's slot reaches the others through the job's store."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           master_listen_fd=listener.detach(), timeout=datetime.timedelta(seconds=10))
    mirrors = [progress.StoreMirror(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                                  timeout=datetime.timedelta(seconds=10)), r, 3) for r in range(3)]
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
