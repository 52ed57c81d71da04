"""Starting ranks: a local emulated cluster (processes + gloo on this machine) or torchrun.

`run_local(fn, world_size, *args)` spawns one process per rank, initialises gloo over loopback
and returns every rank's return value, so tests and the default `tawpipe train` run a real
multi-process job without a launcher. Under torchrun, `init_distributed()` reads the environment.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_timeout() -> float:
    return float(os.environ.get("TAWPIPE_TIMEOUT", 300))


def init_distributed(timeout: float | None = None, cpu: bool = False) -> torch.device:
    """Initialise torch.distributed from torchrun's environment; returns this rank's device
    (``cpu=True``: gloo on the CPU even where CUDA is available)."""
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"environment lacks {', '.join(missing)}: start with torchrun, or use "
                "tawpipe.launch.run_local for a local emulated cluster"
            )
        use_cuda = torch.cuda.is_available() and not cpu
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            timeout=timedelta(seconds=timeout or default_timeout()),
            **({"device_id": device} if use_cuda else {}),
        )
    if dist.get_backend() != "gloo":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _worker(rank: int, world_size: int, port: int, timeout: float, fn: Callable, args: tuple, results) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        out = fn(rank, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = None) -> list[Any]:
    """Run `fn(rank, *args)` on `world_size` local CPU processes joined by gloo.

    `fn` must be importable (module level). Raises with the failing rank's traceback; a rank that
    neither returns nor fails within `timeout` seconds stops the whole job.
    """
    timeout = timeout or default_timeout()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, timeout, fn, args, results), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout + 60
    while len(out) + len(errors) < world_size:
        if time.monotonic() > deadline:
            break
        if results.empty():
            if any(p.exitcode not in (None, 0) for p in procs) and results.empty():
                time.sleep(0.5)
                if results.empty():
                    break
            time.sleep(0.02)
            continue
        rank, ok, value = results.get()
        if ok:
            out[rank] = value
        else:
            errors.append(f"rank {rank}:\n{value}")
            break
    for p in procs:
        p.join(timeout=5 if errors or len(out) < world_size else timeout)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise RuntimeError("local cluster failed; first failure:\n" + errors[0])
    if len(out) < world_size:
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (0, None)]
        raise RuntimeError(
            f"local cluster stopped: {world_size - len(out)} rank(s) returned nothing "
            f"(exit codes {[p.exitcode for p in procs]}, dead ranks {dead}); see stderr"
        )
    return [out[r] for r in range(world_size)]
