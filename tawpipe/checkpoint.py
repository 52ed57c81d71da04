"""Checkpoint files: atomic writes of plain tensors and containers (weights_only-loadable)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch


def save_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over `path`, so a
    crash leaves either the old file or the new one, never a torn one."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | os.PathLike[str]) -> Any:
    """Load a tawpipe checkpoint; only tensors and plain containers are accepted."""
    return torch.load(path, map_location="cpu", weights_only=True)
