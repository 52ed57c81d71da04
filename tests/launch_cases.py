"""Rank functions for the launcher tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine_cases import TinyLM, global_batch, lm_loss, make_engine
from tawpipe.plan.topology import Topology


def _mark(directory: str, name: str) -> None:
    """Write the current time to directory/name (the test measures from it)."""
    Path(directory, name).write_text(repr(time.time()))


def train_then(rank: int, directory: str, bad_rank: int, bad_step: int, action: str) -> int:
    """Train a TinyLM on 2 nodes; at ``bad_step`` rank ``bad_rank`` kills itself (``action="kill"``)
    or sleeps inside a block's forward (``"sleep"``), i.e. inside the step, while its peers wait."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = TinyLM(4)
    step_now = [0]

    def block_forward(block, hidden, **ctx):
        if rank == bad_rank and step_now[0] == bad_step:
            _mark(directory, "bad")
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        return block(hidden, **ctx)

    engine = make_engine(model.blocks, model.embed, model.head, lm_loss, topology=Topology(2, world // 2),
                         micro_batches=2, block_context=model.context, block_forward=block_forward)
    for step in range(bad_step + 2):
        step_now[0] = step
        x, y = global_batch(step, 4 * world)
        engine.step((x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]))
    return rank


def refuses_then_waits(rank: int) -> int:
    """Rank 1's step refuses its batch (3 rows for 2 micro-batches); its program catches that and
    stays away, while rank 0 is in the step waiting for it."""
    torch.manual_seed(0)
    model = TinyLM(4)
    engine = make_engine(model.blocks, model.embed, model.head, lm_loss, topology=Topology(1, 2),
                         micro_batches=2, block_context=model.context)
    x, y = global_batch(0, 8)
    if rank == 1:
        try:
            engine.step((x[:3], y[:3]))
        except ValueError:
            time.sleep(3600)
    engine.step((x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]))
    return rank


def ends_at_start(rank: int, directory: str, how: str) -> int:
    """Rank 1 ends as soon as it runs: killed, or exiting with code 3."""
    if rank == 1:
        _mark(directory, "bad")
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    dist.barrier()
    return rank


def freezes(rank: int) -> int:
    """Rank 1 freezes (SIGSTOP) in the middle of a wait, so it can never time out by itself."""
    from tawpipe.runtime import progress

    if rank == 1:
        progress.publish("slot 7 rank 1 RECV_G chunk 0 from r0", wait_limit=1.0)
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(120)
    return rank


def raises(rank: int) -> int:
    """Rank 1 fails on its own while rank 0 is in a collective with it."""
    dist.barrier()
    if rank == 1:
        raise ValueError("bad input on rank 1")
    dist.all_reduce(torch.ones(1))
    return rank


def _socket_addresses(pid: int) -> list[tuple[str, str]]:
    """(local address, state) of every TCP socket that process ``pid`` holds, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                out.append((fields[1], fields[3]))
    return out


def long_job(rank: int, seconds: float, launcher: int) -> dict:
    """All-reduce every 0.2 s for ``seconds`` (many times the per-wait timeout); report this
    rank's and the launcher's (process ``launcher``) TCP sockets."""
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        t = torch.ones(1)
        dist.all_reduce(t)
        n += 1
        time.sleep(0.2)
    return {"rounds": n, "sockets": _socket_addresses(os.getpid()), "launcher": _socket_addresses(launcher)}


def forever(rank: int, directory: str) -> None:
    """Write this rank's pid, leave a progress bar's line open (as tqdm does), then all-reduce
    until stopped."""
    if rank == 0:
        sys.stderr.write("\rtawpipe train:   3%|▎         | 3/100 [00:01<00:30]")
        sys.stderr.flush()
    Path(directory, f"worker{rank}.pid").write_text(str(os.getpid()))
    while True:
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.1)


def bar_then_killed(rank: int) -> int:
    """Rank 0 leaves a progress bar's line open (as tqdm does) and is killed; rank 1 waits."""
    dist.barrier()
    if rank == 0:
        sys.stderr.write("\rtawpipe train:   3%|▎         | 3/100 [00:01<00:30]")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
    return rank


def random_tensors(rank: int, seed: int) -> dict:
    """CPU tensors nested in lists and dicts, different on every rank and job."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return {"rank": rank, "vector": torch.randn(1000, generator=g),
            "nested": [torch.randn(3, 4, generator=g), (torch.arange(rank + 5), torch.ones(0))],
            "layers": {f"p{i}": torch.randn(64, 64, generator=g).to(torch.float16 if i % 2 else torch.float32)
                       for i in range(20)},
            "view": torch.randn(100, generator=g)[10:20]}


def inherited(rank: int, name: str, token: str) -> dict:
    """Write ``token`` to stdout and stderr; report the environment variable ``name`` and this
    rank's parent and grandparent."""
    print(f"rank {rank} out {token}", flush=True)
    print(f"rank {rank} err {token}", file=sys.stderr, flush=True)
    from tawpipe.runtime.workers import parent_of

    return {"env": os.environ.get(name), "parent": os.getppid(), "grandparent": parent_of(os.getppid())}


def loaded(rank: int, names: list[str]) -> dict[str, bool]:
    """Which of the modules ``names`` this rank had imported before it ran."""
    return {name: name in sys.modules for name in names}


def counts(rank: int, directory: str) -> dict:
    """All-reduce until asked to stop; every rank agrees on the iteration to stop at."""
    from tawpipe.runtime.launch import stop_requested

    n = 0
    while not stop_requested(agree=True):  # the first call arms the handlers: then the pid is written
        if n == 0:
            Path(directory, f"worker{rank}.pid").write_text(str(os.getpid()))
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == dist.get_world_size()
        n += 1
        time.sleep(0.02)
    return {"iterations": n, "pid": os.getpid()}


def late_stop(rank: int) -> list[bool]:
    """Rank 0's stop signal lands while its agreeing all-reduce is under way, after it sent its
    flag (the launcher's SIGTERM reaches each rank wherever it is): both calls must still give
    every rank the same answer."""
    from tawpipe.runtime import launch

    real = dist.all_reduce

    def signalled_during(*args, **kwargs):
        work = real(*args, **kwargs)
        if rank == 0:
            signal.raise_signal(signal.SIGTERM)  # its handler has run when this returns
        return work

    launch.stop_requested()  # arms the handlers
    dist.all_reduce = signalled_during
    try:
        first = launch.stop_requested(agree=True)
    finally:
        dist.all_reduce = real
    return [first, launch.stop_requested(agree=True)]


def stubborn(rank: int, directory: str) -> int:
    """Rank 0 stops when asked; rank 1 asks once (arming the handlers), then never again."""
    from tawpipe.runtime.launch import stop_requested

    n = 0
    stop_requested()
    Path(directory, f"worker{rank}.pid").write_text(str(os.getpid()))
    while rank == 1 or not stop_requested():
        n += 1
        time.sleep(0.02)
    return n


def _local_stop(directory: str, fn) -> None:
    """A launcher that reports how its job stopped, as a training tool would: to a file."""
    import json

    from tawpipe.runtime.launch import JobStopped, run_local

    try:
        run_local(fn, 3 if fn is counts else 2, directory)
        outcome = {"how": "returned"}
    except JobStopped as e:
        outcome = {"how": "stopped", "signal": e.signal.name, "results": e.results, "missing": e.missing,
                   "complete": e.complete, "message": str(e)}
    Path(directory, "outcome.json").write_text(json.dumps(outcome))
    sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    if sys.argv[1] == "local":  # a launcher for the signal tests
        from tawpipe.runtime.launch import run_local

        run_local(forever, 2, sys.argv[2])
    elif sys.argv[1] in ("local-counts", "local-stubborn"):  # launchers for the stop-request tests
        _local_stop(sys.argv[2], counts if sys.argv[1] == "local-counts" else stubborn)
    elif sys.argv[1] == "torchrun-killed":  # one rank started as torchrun starts it; rank 2 is killed
        from tawpipe.runtime.launch import init_distributed

        init_distributed()
        train_then(dist.get_rank(), sys.argv[2], 2, 1, "kill")  # the survivors' errors are not caught
    else:  # one rank under torchrun, rank 2 stuck: the others' timeouts must name it
        from tawpipe.runtime.launch import init_distributed

        init_distributed()
        try:
            train_then(dist.get_rank(), sys.argv[2], 2, 1, "sleep")
        except RuntimeError as e:  # tawpipe's timeout, or gloo's when it fires first
            Path(sys.argv[2], f"error{dist.get_rank()}").write_text(str(e))
        os._exit(1)


def rng_after_setup(rank: int, cfg: Any) -> torch.Tensor:
    """The torch generator state a `tawpipe train` rank (``Loop``) steps from: what its dropout draws."""
    from tawpipe.train.loop import Loop

    loop = Loop(rank, cfg, Topology(cfg.nodes, cfg.per_node), torch.device("cpu"), None)
    loop.engine.close()
    return torch.get_rng_state()
