"""The executor's posting order, on one rank with a scripted transport: which messages wait for
which (design §5.2). Exactness of the whole engine is in test_engine.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from tawpipe.runtime.comm.base import P2P, Handle
from tawpipe.runtime.executor import Executor, Messages
from tawpipe.plan.actions import OPS, Action, batches, describe
from tawpipe.plan.schedule import build_plan
from tawpipe.plan.topology import Topology


class _Message:
    def __init__(self, done: threading.Event) -> None:
        self._done = done

    def wait(self, timeout: float) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError("scripted message never completed")


class ScriptedComm:
    """Posts complete at once, except the first one matching ``held``, which completes when
    ``release`` is set. Records every post as (op, peer)."""

    async_p2p = True

    def __init__(self, held: tuple[str, int]) -> None:
        self.held, self.release, self.posted = held, threading.Event(), []
        self._done = threading.Event()
        self._done.set()
        self._lock = threading.Lock()

    def post(self, op: P2P, tag: int) -> _Message:
        with self._lock:
            key = (op.op, op.peer)
            first = key == self.held and key not in self.posted
            self.posted.append(key)
        return _Message(self.release if first else self._done)


def test_a_send_batched_with_a_fetch_does_not_wait_for_the_fetches_before_it():
    """3 x 2, k = 2 (the cluster bench's job). Before slot 0, rank 0 swaps with rank 2 (fetch W1,
    send W0), then with rank 4 (fetch W2, send W0). Group 2 cannot start until W0 arrives, so
    rank 0's send to rank 4 must go out while its fetch from rank 2 is still on the wire. Held in
    queue order behind that fetch, it went out a whole transfer late (design §5.2)."""
    plan = build_plan(Topology(3, 2), 12, 2, prefetch_depth=3, mb_per_fetch=2, reuse_weights=True)
    rank = 0
    comm = ScriptedComm(held=("recv", 2))

    def work(unit: list[Action]):
        if OPS[unit[0].op].is_p2p:
            return Messages(comm, tuple(P2P(OPS[a.op].transfer, torch.empty(1), a.peer) for a in unit),
                            tuple(a.tag for a in unit), 10.0)
        return lambda: None

    ex = Executor(plan, timeout=10.0, device=torch.device("cpu"), rank=rank)
    runner = threading.Thread(target=ex.run, args=(plan.actions[rank], work), daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 5.0
        while ("send", 4) not in comm.posted and time.monotonic() < deadline:
            time.sleep(0.01)
        posted_while_held = list(comm.posted)
    finally:
        comm.release.set()
        runner.join(10.0)
        ex.close()
    assert not runner.is_alive()
    assert ("recv", 2) in posted_while_held
    assert ("send", 4) in posted_while_held, posted_while_held


def test_a_failure_without_a_message_is_named_by_its_type():
    """A unit interrupted by Ctrl-C (KeyboardInterrupt has no message) says so, not "failed: "."""
    h = Handle("slot 16 rank 2 ACC_G chunk 1 [g0]")
    h._finish(error=KeyboardInterrupt())
    with pytest.raises(RuntimeError, match=r"ACC_G chunk 1 \[g0\] failed: KeyboardInterrupt$"):
        h.wait(1.0)


def test_a_traced_run_writes_its_units_in_place_of_the_last_and_an_untraced_one_writes_nothing(monkeypatch, tmp_path):
    """TAWPIPE_TRACE: the file holds the last traced run (the engine's last step), each unit once,
    on its channel's row; a run that fails leaves the units that had started. The executor used to
    keep every unit of every run until it closed, a trace (and its handles) growing with the job."""
    monkeypatch.setenv("TAWPIPE_TRACE", str(tmp_path))
    plan = build_plan(Topology(2, 2), 8, 4, prefetch_depth=2, mb_per_fetch=2)
    rank, comm = 1, ScriptedComm(held=("none", -1))
    units = list(batches(plan.actions[rank]))
    failing = len(units) // 2 + next(i for i, u in enumerate(units[len(units) // 2:]) if OPS[u[0].op].channel == "compute")

    def work(unit: list[Action], fail: bool = False):
        if OPS[unit[0].op].is_p2p:
            return Messages(comm, tuple(P2P(OPS[a.op].transfer, torch.empty(1), a.peer) for a in unit),
                            tuple(a.tag for a in unit), 10.0)
        if fail and unit == units[failing]:
            return lambda: 1 / 0
        return lambda: time.sleep(0.001)

    ex = Executor(plan, timeout=10.0, device=torch.device("cpu"), rank=rank)
    path = tmp_path / f"trace_rank{rank}.json"
    try:
        ex.run(plan.actions[rank], work)
        assert not path.exists()
        for _ in range(2):
            ex.run(plan.actions[rank], work, traced=True)
            events = json.loads(path.read_text())["traceEvents"]
            assert sorted(e["name"] for e in events) == sorted(describe(u[0]) for u in units)
            assert {(e["name"], e["tid"]) for e in events} == {(describe(u[0]), OPS[u[0].op].channel.value) for u in units}
            assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in events)
            assert all(e["dur"] >= 1e3 for e in events if e["tid"] == "compute")  # a unit's 1 ms, in microseconds
        with pytest.raises(ZeroDivisionError):
            ex.run(plan.actions[rank], lambda unit: work(unit, fail=True), traced=True)
        names = [e["name"] for e in json.loads(path.read_text())["traceEvents"]]
        ran = [describe(u[0]) for u in units[:failing] if OPS[u[0].op].channel == "compute"]
        assert [n for n in names if n in ran] == ran and describe(units[failing][0]) not in names
    finally:
        ex.close()


def test_the_engine_traces_its_steps_and_not_its_evaluations(monkeypatch, tmp_path):
    from engine_cases import TinyLM, global_batch, lm_loss, make_engine
    from test_engine_errors import NoComm

    monkeypatch.setenv("TAWPIPE_TRACE", str(tmp_path))
    torch.manual_seed(0)
    m = TinyLM(4)
    engine = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=2, comm=NoComm(1),
                         block_context=m.context)
    try:
        path = tmp_path / "trace_rank0.json"
        assert not path.exists()  # the setup run is not traced
        engine.step(global_batch(0, 4))
        step = json.loads(path.read_text())["traceEvents"]
        assert sorted(e["name"] for e in step) == sorted(describe(u[0]) for u in batches(engine.plan.actions[0]))
        engine.evaluate([global_batch(1, 4)])
        assert json.loads(path.read_text())["traceEvents"] == step
    finally:
        engine.close()
