"""What every rank is doing right now, so that a stuck job can name the rank that holds it up.

A wait that times out only says that *this* rank waited too long; the culprit is a peer. So each
rank publishes, into a slot of its own, the unit its executor is busy with or waiting for and
since when (``publish``: a few microseconds, no communication). A local job's slots live in one
shared-memory block that the launcher and every worker can read (``Board``); under torchrun a
heartbeat thread copies the slot into the TCPStore when it changes, at most once a second
(``StoreMirror``). When a wait fails, ``suspect`` picks the rank most likely to blame: the one
busy (not waiting) for the longest, or, when every rank waits, the one waiting longest.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from dataclasses import dataclass
from typing import Protocol

_HEADER = struct.Struct("<IBxxxddH")  # seq, state, since (monotonic), wait limit, label length
SLOT_BYTES = 256
_LABEL_BYTES = SLOT_BYTES - _HEADER.size
_EMPTY, _BUSY, _WAITING = 0, 1, 2
OUTSIDE = "code outside tawpipe's executor"  # the label between engine calls


@dataclass(frozen=True)
class Entry:
    """One rank's last publication: ``age`` seconds ago it started ``label``, waiting or busy."""

    rank: int
    label: str
    waiting: bool
    age: float
    limit: float  # the wait's timeout (0 when busy)


class Source(Protocol):
    def entries(self) -> list[Entry]: ...


class Board:
    """One fixed-size slot per rank in a shared buffer (``bytearray``, ``mmap`` or a
    ``multiprocessing.RawArray`` of ``nbytes(world)`` bytes). Each slot has one writer; a
    sequence number (odd while a write is under way) keeps readers from seeing a torn slot."""

    def __init__(self, buffer: object, world: int) -> None:
        self._mv = memoryview(buffer).cast("B")
        if len(self._mv) < self.nbytes(world):
            raise ValueError(f"a progress board for {world} ranks needs {self.nbytes(world)} bytes")
        self.world = world

    @staticmethod
    def nbytes(world: int) -> int:
        return world * SLOT_BYTES

    def write(self, rank: int, label: str, waiting: bool, limit: float = 0.0,
              since: float | None = None) -> None:
        at = rank * SLOT_BYTES
        seq = _HEADER.unpack_from(self._mv, at)[0]
        data = label.encode()[:_LABEL_BYTES]
        struct.pack_into("<I", self._mv, at, seq + 1)
        self._mv[at + _HEADER.size:at + _HEADER.size + len(data)] = data
        _HEADER.pack_into(self._mv, at, seq + 1, _WAITING if waiting else _BUSY,
                          time.monotonic() if since is None else since, limit, len(data))
        struct.pack_into("<I", self._mv, at, seq + 2)

    def read(self, rank: int, now: float | None = None) -> Entry | None:
        at = rank * SLOT_BYTES
        for _ in range(100):
            seq, state, since, limit, n = _HEADER.unpack_from(self._mv, at)
            label = bytes(self._mv[at + _HEADER.size:at + _HEADER.size + min(n, _LABEL_BYTES)])
            if seq % 2 == 0 and struct.unpack_from("<I", self._mv, at)[0] == seq:
                break
            time.sleep(0.001)
        if state == _EMPTY:
            return None
        age = (time.monotonic() if now is None else now) - since
        return Entry(rank, label.decode(errors="replace"), state == _WAITING, age, limit)

    def version(self, rank: int) -> int:
        """Changes with every write to ``rank``'s slot."""
        return _HEADER.unpack_from(self._mv, rank * SLOT_BYTES)[0]

    def entries(self) -> list[Entry]:
        now = time.monotonic()
        return [e for r in range(self.world) if (e := self.read(r, now)) is not None]


class StoreMirror:
    """Under torchrun: this rank's slot copied to a ``torch.distributed`` store key by a heartbeat
    thread, and every rank's keys read back on demand. Ages rest on the nodes' wall clocks."""

    PREFIX = "tawpipe/progress/"

    def __init__(self, store: object, rank: int, world: int, interval: float = 1.0) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.local = Board(bytearray(Board.nbytes(1)), 1)
        self._lock = threading.Lock()  # one request at a time on the store connection
        self._pushed = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(interval,), name="tawpipe-progress", daemon=True)

    def start(self) -> "StoreMirror":
        self._thread.start()
        return self

    def close(self, wait: float = 15.0) -> None:
        """Stop the heartbeat and wait for a push in flight. Left running into interpreter exit,
        a thread inside the store's C++ call is killed when it retakes the GIL, and that unwind
        aborts the process ("terminate called without an active exception")."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(wait)

    def push(self) -> None:
        """Copy this rank's slot to the store if it changed since the last push."""
        version = self.local.version(0)
        if version == self._pushed:
            return
        e = self.local.read(0)
        if e is None:
            return
        doc = {"label": e.label, "waiting": e.waiting, "limit": e.limit, "since": time.time() - e.age}
        with self._lock:
            self.store.set(f"{self.PREFIX}{self.rank}", json.dumps(doc))
        self._pushed = version

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.push()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return

    def entries(self) -> list[Entry]:
        keys = [f"{self.PREFIX}{r}" for r in range(self.world)]
        out = []
        with self._lock:
            for r, key in enumerate(keys):
                if not self.store.check([key]):
                    continue
                doc = json.loads(self.store.get(key))
                out.append(Entry(r, doc["label"], doc["waiting"], time.time() - doc["since"], doc["limit"]))
        return out


_board: Board | None = None
_slot = 0
_rank = 0
_source: Source | None = None


def install(rank: int, board: Board, slot: int, source: Source) -> None:
    """Publish rank ``rank``'s progress into ``board[slot]``; ``source`` shows every rank's."""
    global _board, _slot, _rank, _source
    _board, _slot, _rank, _source = board, slot, rank, source


def publish(label: str, wait_limit: float = 0.0) -> None:
    """This rank now runs ``label`` (``wait_limit`` = 0) or waits up to ``wait_limit`` s for it."""
    if _board is not None:
        _board.write(_slot, label, wait_limit > 0, wait_limit)


def suspect(entries: list[Entry], exclude: set[int] | frozenset[int] = frozenset(),
            min_age: float = 0.0) -> Entry | None:
    """The rank most likely holding the others up (see the module docstring) among those at it
    for at least ``min_age`` seconds."""
    pool = [e for e in entries if e.rank not in exclude and e.age >= min_age]
    busy = [e for e in pool if not e.waiting]
    return max(busy or pool, key=lambda e: e.age, default=None)


def stuck(entry: Entry) -> str:
    """``rank 2 stuck in slot 8 BCAST_W W1 ... for 31 s``."""
    what = entry.label.replace(f" rank {entry.rank} ", " ", 1)
    return f"rank {entry.rank} stuck {'waiting for' if entry.waiting else 'in'} {what} for {entry.age:.0f} s"


def hint(min_age: float) -> str:
    """For a timeout message: the peer most likely to blame, or ''."""
    if _source is None:
        return ""
    try:
        e = suspect(_source.entries(), exclude={_rank}, min_age=min_age)
    except Exception:  # noqa: BLE001 - a hint must never hide the error it decorates
        return ""
    return f"; {stuck(e)}" if e is not None else ""
