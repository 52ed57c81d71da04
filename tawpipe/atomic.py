"""Files written whole or not at all: a crash, a kill or a full disk leaves the old file or the new
one, never a torn one, and no reader sees a half-written file.

Every file tawpipe writes for another process or a later run to read (checkpoints, exports, metrics,
traces, results, the simulator's map) goes through ``write_atomic``. Its temporary file is named for
its writer (``.tmp-HOST-PID-RANDOM``), so the temporaries of writes that died can be told from those
of writes still running (``remove_temporary``).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

TMP = ".tmp-"  # what a temporary file's name starts with
_HOST = "".join(c if c.isalnum() or c == "." else "_" for c in socket.gethostname()) or "host"


class _Hashing:
    """A write-only file that hashes what passes through it."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write_atomic(path: str | os.PathLike[str], content: str | bytes | Callable[[IO[bytes]], None],
                 suffix: str = ".tmp") -> tuple[str, int]:
    """Write ``content`` (text as UTF-8, bytes, or a function writing to a binary file) to ``path``
    through a temporary file in its directory (mode 0o666 less the umask, ending in ``suffix``, which
    readers of the directory's files skip), fsync, rename, fsync the directory. Temporaries that
    dead writers on this host left there are removed first. Returns the SHA-256 and size written."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_temporary([Path(directory)], only_dead_writers=True)
    tmp = os.path.join(directory, f"{TMP}{_HOST}-{os.getpid()}-{secrets.token_hex(8)}{suffix}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # as the umask allows, like open()
    try:
        with os.fdopen(fd, "wb") as f:
            out = _Hashing(f)
            if callable(content):
                content(out)
            else:
                out.write(content.encode() if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power loss
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return out.sha.hexdigest(), out.size


def remove_temporary(directories: Iterable[Path], *, only_dead_writers: bool) -> None:
    """Remove the temporary files of writes that crashed in ``directories``: all of them (nothing
    writes there now), or only those whose writer is gone (others may be writing)."""
    for d in directories:
        for tmp in d.glob(f"{TMP}*"):
            if not only_dead_writers or _writer_is_gone(tmp):
                tmp.unlink(missing_ok=True)


def _writer_is_gone(tmp: Path) -> bool:
    """Whether the write that made temporary file ``tmp`` has died: its name holds the writer's
    host and pid; a writer on another host, or a name without them, counts as alive (its file
    stays)."""
    try:
        host, pid, _ = tmp.name[len(TMP):].rsplit("-", 2)
        pid_number = int(pid)
    except ValueError:
        return False
    if host != _HOST or pid_number == os.getpid():
        return False
    try:
        os.kill(pid_number, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return False
