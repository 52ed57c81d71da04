"""Run metrics: every rank's measured peak memory, and one writer for JSONL and TensorBoard.

Peak host memory is the process's VmHWM (Linux): unlike ``ru_maxrss``, it restarts at exec, so a
spawned rank does not report the launcher's peak. Device memory is torch's peak allocation.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

import torch
import torch.distributed as dist

from ..atomic import write_atomic


def peak_host_bytes() -> int:
    """This process's peak resident set size, in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def peak_device_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def gather_peaks(device: torch.device) -> list[dict[str, int]]:
    """Every rank's peak host and device bytes (a collective: call it on every rank)."""
    # on the device only where the job's collectives need it there (NCCL; gloo takes host tensors)
    where = device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([peak_host_bytes(), peak_device_bytes(device)], dtype=torch.int64, device=where)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        rows = [mine]
    else:
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
    return [{"host": int(r[0]), "device": int(r[1])} for r in rows]


def check_tensorboard() -> None:
    """ImportError with the fix, before a run starts, when TensorBoard is not installed."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ImportError("--tensorboard needs the tensorboard package: pip install tensorboard") from None


class MetricsWriter:
    """One JSON object per line in ``path`` (appended, flushed per record); numbers also go to a
    TensorBoard event directory when ``tensorboard`` is given.

    ``resume_step``: a run resumed from that step; records past it (an interrupted run wrote them
    after its last checkpoint, and the resumed run writes them again) are dropped from ``path``
    first, and from TensorBoard's view (``purge_step``). ``dropped`` counts them."""

    def __init__(self, path: str | os.PathLike[str] | None, tensorboard: str | os.PathLike[str] | None = None,
                 resume_step: int | None = None) -> None:
        self._file = None
        self.dropped = 0
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if resume_step is not None:
                self.dropped = truncate_after(path, resume_step)
            self._file = open(path, "a")
        self._tb = None
        if tensorboard is not None:
            check_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            purge = {"purge_step": resume_step + 1} if resume_step is not None else {}
            self._tb = SummaryWriter(os.fspath(tensorboard), **purge)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in _flatten(record):
                if key != "step":
                    self._tb.add_scalar(key, value, record.get("step", 0))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def truncate_after(path: str | os.PathLike[str], step: int) -> int:
    """Keep in the JSONL file ``path`` the records up to ``step``; returns how many lines were
    dropped (later records, and a line a killed run left half written). Rewritten atomically;
    a file that does not exist is left so."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return 0
    keep = [line if line.endswith("\n") else line + "\n" for line in lines if _step_of(line) is not None
            and _step_of(line) <= step]
    if keep == lines:
        return 0
    write_atomic(path, "".join(keep))
    return len(lines) - len(keep)


def _step_of(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def _flatten(record: dict[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    """Numeric leaves as ("a/b/0", value) pairs, for TensorBoard's flat tags."""
    out: list[tuple[str, float]] = []
    items = record.items() if isinstance(record, dict) else enumerate(record)
    for k, v in items:
        tag = f"{prefix}{k}"
        if isinstance(v, (dict, list)):
            out += _flatten(v, tag + "/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append((tag, float(v)))
    return out
