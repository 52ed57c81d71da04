"""`tawpipe.atomic.write_atomic`: the one way tawpipe writes a file that another process or a later
run reads. A write lands whole or not at all, and a dead writer's temporary is cleaned up."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tawpipe import atomic

ROOT = Path(__file__).resolve().parent.parent

_KILLED = """
import os, sys
from tawpipe import atomic

def killed(f):
    f.write(os.urandom(4096))
    f.flush()
    os._exit(9)  # the process dies mid-write: no cleanup runs

atomic.write_atomic(sys.argv[1], killed, ".json")
"""


@pytest.mark.parametrize("kind", ["bytes", "text", "writer"])
def test_what_is_written_is_what_is_read_and_hashed(tmp_path, kind):
    data = os.urandom(10_000 + int.from_bytes(os.urandom(2), "little"))
    content = {"bytes": data, "text": data.hex() + " é ∑\n",
               "writer": lambda f: [f.write(data[i:i + 999]) for i in range(0, len(data), 999)]}[kind]
    expected = content.encode() if kind == "text" else data
    path = tmp_path / "sub" / "out.bin"  # the directory is made
    sha, size = atomic.write_atomic(path, content)
    assert path.read_bytes() == expected
    assert (sha, size) == (hashlib.sha256(expected).hexdigest(), len(expected))
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.bin"]


def test_a_failing_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path, old = tmp_path / "state.json", os.urandom(512)
    path.write_bytes(old)

    def fails(f):
        f.write(os.urandom(300))
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic.write_atomic(path, fails)
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_killed_writer_leaves_the_old_file_and_the_next_write_removes_its_temporary(tmp_path):
    path, old = tmp_path / "result0.json", os.urandom(64).hex().encode()
    path.write_bytes(old)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c", _KILLED, str(path)], capture_output=True, env=env)
    assert killed.returncode == 9, killed.stderr.decode()
    left = [p.name for p in tmp_path.glob(atomic.TMP + "*")]
    assert len(left) == 1 and left[0].endswith(".json") and path.read_bytes() == old
    # another live writer's temporary (this process) stays; the dead one's goes
    host = left[0][len(atomic.TMP):].rsplit("-", 2)[0]
    alive = tmp_path / f"{atomic.TMP}{host}-{os.getpid()}-feed.json"
    alive.write_bytes(b"x")
    new = os.urandom(100)
    atomic.write_atomic(tmp_path / "result1.json", new)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, "result0.json", "result1.json"])
    assert path.read_bytes() == old and (tmp_path / "result1.json").read_bytes() == new


def test_no_module_renames_files_into_place_by_itself():
    """Every atomic write goes through ``write_atomic``: a module that renames a temporary file
    into place itself is a second copy of it (without its fsync or its cleanup)."""
    inline = [f"{p.relative_to(ROOT)}:{n}" for p in sorted([*(ROOT / "tawpipe").rglob("*.py"),
                                                            *(ROOT / "benchmarks").rglob("*.py")])
              if p.name != "atomic.py"
              for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bos\.(replace|rename)\(", line)]
    assert not inline, f"use tawpipe.atomic.write_atomic instead of renaming by hand: {inline}"


def test_no_module_writes_a_file_in_place():
    """A file that a later run or another process reads (results, plots, calibrations, traces) is
    written through ``write_atomic``: written in place, an interrupted write leaves half a file
    that the reader takes for whole. The kernel's control files (cgroups, /proc) are not files."""
    kernel_files = {"atomic.py", "cgroups.py"}  # cgroups.py writes only the cgroup file system's controls
    in_place = [f"{p.relative_to(ROOT)}:{n}" for p in sorted([*(ROOT / "tawpipe").rglob("*.py"),
                                                              *(ROOT / "benchmarks").rglob("*.py")])
                if p.name not in kernel_files
                for n, line in enumerate(p.read_text().splitlines(), 1)
                if re.search(r"\.write_(text|bytes)\(|\bopen\([^)]*[\"'][wx]b?[\"']|\.savefig\((?!f,)|json\.dump\(|"
                             r"pickle\.dump\(", line) and "/proc/" not in line]
    assert not in_place, f"use tawpipe.atomic.write_atomic instead of writing in place: {in_place}"
