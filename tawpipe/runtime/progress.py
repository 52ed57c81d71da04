"""What every rank is doing right now, so that a stuck job can name the rank that holds it up.

A wait that times out only says that *this* rank waited too long; the culprit is a peer. So each
rank publishes, into a slot of its own, the unit its executor is busy with or waiting for and
since when (``publish``: a few microseconds, no communication). A local job's slots live in one
shared-memory block that the launcher and every worker can read (``Board``); under torchrun a
heartbeat thread copies the slot into the TCPStore once a second, with the time of the beat
(``StoreMirror``). When a wait fails, ``suspect`` picks the rank most likely to blame: the one
busy (not waiting) for the longest, or, when every rank waits, the one waiting longest. Under
torchrun a rank whose heartbeat stopped without its saying that it ended is ``gone`` (killed,
frozen or cut off): it is blamed before any other.

``StepBar`` is the other kind of progress: a training loop's, for people, on stderr.
"""

from __future__ import annotations

import json
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Protocol, TextIO

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
    beat: float | None = None  # seconds since its last heartbeat (under torchrun; None: no heartbeat)
    ended: str = ""  # how it ended, as it said before ending ("" while it runs)


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
    thread every ``interval`` seconds (the beat's time included, so that a rank that died shows as
    ``gone``), and every rank's keys read back on demand. Ages rest on the nodes' wall clocks.

    After a failure, the first rank that finds whom to blame posts it as the job's verdict; every
    heartbeat keeps a copy of it, so that a rank that fails only once the store is gone (when
    rank 0, which hosts it without torchrun's agent, has exited) can still name the culprit."""

    PREFIX = "tawpipe/progress/"

    def __init__(self, store: object, rank: int, world: int, interval: float = 1.0, attempt: str = "") -> None:
        self.store, self.rank, self.world, self.interval = store, rank, world, interval
        # the keys of one attempt: torchrun's agent keeps its store across restarts
        self.prefix = f"{self.PREFIX}{attempt}/" if attempt else self.PREFIX
        self.verdict_key = f"{self.prefix}verdict"
        self.local = Board(bytearray(Board.nbytes(1)), 1)
        self.verdict = ""  # the job's verdict, once posted
        self._lock = threading.Lock()  # one request at a time on the store connection
        self._ended = ""
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

    def end(self, how: str = "exited", wait: float = 15.0) -> None:
        """Stop the heartbeat and tell the others that this rank ended (``how``), so that its silence
        does not read as a death. The first call counts; best effort (the store may be gone)."""
        self.close(wait)
        if self._ended:
            return
        self._ended = how
        try:
            self.push(force=True)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to tell
            pass

    def push(self, force: bool = False) -> None:
        """Copy this rank's slot, with the time of this beat, to the store."""
        e = self.local.read(0)
        if e is None and not (force and self._ended):
            return
        doc = {"beat": time.time(), "ended": self._ended, "verdict": bool(self.verdict)}
        if e is not None:
            doc |= {"label": e.label, "waiting": e.waiting, "limit": e.limit, "since": time.time() - e.age}
        with self._lock:
            self.store.set(f"{self.prefix}{self.rank}", json.dumps(doc))

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.push()
                self.read_verdict()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return

    def read_verdict(self) -> str:
        """The job's verdict (from the store until one is posted, then the copy)."""
        if not self.verdict:
            with self._lock:
                if self.store.check([self.verdict_key]):
                    self.verdict = self.store.get(self.verdict_key).decode()
        return self.verdict

    def post_verdict(self, verdict: str) -> str:
        """Post ``verdict`` unless another rank did first; the job's verdict."""
        with self._lock:
            if not self.store.check([self.verdict_key]):
                self.store.set(self.verdict_key, verdict)
            self.verdict = self.store.get(self.verdict_key).decode()
        return self.verdict

    def docs(self) -> dict[int, dict]:
        """Every rank's last push, by rank."""
        keys = [f"{self.prefix}{r}" for r in range(self.world)]
        out = {}
        with self._lock:
            for r, key in enumerate(keys):
                if self.store.check([key]):
                    out[r] = json.loads(self.store.get(key))
        return out

    def entries(self) -> list[Entry]:
        now = time.time()
        return [Entry(r, doc.get("label", ""), doc.get("waiting", False), now - doc.get("since", now),
                      doc.get("limit", 0.0), now - doc["beat"] if "beat" in doc else None, doc.get("ended", ""))
                for r, doc in self.docs().items()]


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


GONE_AFTER = 5.0  # seconds without a heartbeat (sent every second) before a rank counts as gone


def gone(entries: list[Entry], after: float = GONE_AFTER) -> list[Entry]:
    """Ranks whose heartbeat stopped ``after`` seconds ago or more without their saying they ended:
    killed (SIGKILL, the OOM killer), frozen, or cut off from the store. Oldest silence first."""
    return sorted((e for e in entries if e.beat is not None and e.beat >= after and not e.ended),
                  key=lambda e: -(e.beat or 0.0))


def departed(entry: Entry) -> str:
    """``rank 2 is gone: no heartbeat for 6 s (killed, frozen or cut off), last seen in slot 1 F W0 m0 [w0]``."""
    what = entry.label.replace(f" rank {entry.rank} ", " ", 1)
    return (f"rank {entry.rank} is gone: no heartbeat for {entry.beat or 0.0:.0f} s (killed, frozen or cut off)"
            + (f", last seen {'waiting for' if entry.waiting else 'in'} {what}" if what else ""))


def hint(min_age: float) -> str:
    """For a timeout message: the peer most likely to blame (a gone one first), or ''."""
    if _source is None:
        return ""
    try:
        entries = _source.entries()
        dead = [e for e in gone(entries) if e.rank != _rank]
        if dead:
            return f"; {departed(dead[0])}"
        e = suspect([e for e in entries if not e.ended], exclude={_rank}, min_age=min_age)
    except Exception:  # noqa: BLE001 - a hint must never hide the error it decorates
        return ""
    return f"; {stuck(e)}" if e is not None else ""


FAILED = "failed: "  # how a rank that failed on its own ends (``StoreMirror.end``)


def blame_after_failure(within: float) -> str:
    """Under torchrun, once this rank failed because of a peer (a broken connection, a timeout):
    the peer to blame, as a sentence, or ''. The job's verdict if a rank posted one; else a peer
    that failed on its own error and said so; else a gone one, waiting up to ``within`` seconds
    for a dead rank's heartbeat to fall silent long enough (it died between two beats, and the
    break is seen at once). What it finds becomes the job's verdict."""
    mirror = _source
    if not isinstance(mirror, StoreMirror):
        return ""
    deadline = time.monotonic() + within
    while True:
        try:
            if mirror.read_verdict():
                return mirror.verdict
            entries = [e for e in mirror.entries() if e.rank != _rank]
        except Exception:  # noqa: BLE001 - the store is gone: its host (torchrun's agent, or rank 0) exited
            return mirror.verdict or ("the job's store is unreachable: the process hosting it (torchrun's agent, "
                                      "or rank 0) is gone")
        own = [e for e in entries if e.ended.startswith(FAILED)]
        dead = gone(entries)
        found = (f"rank {own[0].rank} failed first: {own[0].ended[len(FAILED):]}" if own
                 else departed(dead[0]) if dead else "")
        if found:
            try:
                return mirror.post_verdict(found)
            except Exception:  # noqa: BLE001 - the store went meanwhile
                return found
        if time.monotonic() >= deadline:
            return ""
        time.sleep(0.25)


def linger_for_the_others(within: float) -> None:
    """Under torchrun, in the rank that hosts the job's store (rank 0 without torchrun's agent),
    once a verdict is posted: wait up to ``within`` seconds until every other rank has a copy of
    it, has ended or is gone. Ranks blocked on this one fail only when it exits, and then the
    store is gone with it."""
    mirror = _source
    if not isinstance(mirror, StoreMirror) or not mirror.verdict:
        return
    deadline = time.monotonic() + within
    others = set(range(mirror.world)) - {_rank}
    while time.monotonic() < deadline:
        try:
            docs = mirror.docs()
        except Exception:  # noqa: BLE001 - the store is gone after all
            return
        now = time.time()
        done = {r for r, d in docs.items()
                if d.get("verdict") or d.get("ended") or now - d.get("beat", now) >= GONE_AFTER}
        if done >= others:
            return
        time.sleep(0.25)


class StepBar:
    """A training loop's progress on ``stream`` (stderr), drawn by one rank: a tqdm bar redrawn in
    place on a terminal; in a log (not a terminal), a plain line every ``total // lines`` steps and
    at the last step. tqdm in a log writes a record per refresh: there the bar reached 100% three
    times (the last step's update, its new postfix, the close), the loss changing after the first.
    Each step's postfix (loss, throughput, ...) is set before the count moves, so the last thing
    shown is the last step with its own values."""

    def __init__(self, total: int, initial: int, desc: str, stream: TextIO | None = None, lines: int = 20) -> None:
        self.stream = stream or sys.stderr
        self.total, self.n, self.desc = total, initial, desc
        self.every = max(1, total // lines)
        self.t0 = time.monotonic()
        self._bar = None
        if _is_terminal(self.stream):
            from tqdm import tqdm

            tqdm.set_lock(threading.RLock())  # not its default multiprocessing lock: a killed rank would leak it
            self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=self.stream)

    def step(self, postfix: str) -> None:
        """One step done; ``postfix`` says how it went."""
        self.n += 1
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(1)
        elif self.n % self.every == 0 or self.n == self.total:
            self.stream.write(f"{self.desc}: step {self.n}/{self.total} ({100 * self.n // self.total}%), "
                              f"{time.monotonic() - self.t0:.1f} s | {postfix}\n")
            self.stream.flush()

    def close(self) -> None:
        """End the bar's line (a terminal's bar is drawn once more, as it stands)."""
        if self._bar is not None:
            self._bar.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no such method, or closed
        return False
