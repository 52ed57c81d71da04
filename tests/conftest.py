"""Tests that change the host's network run only when asked.

The emulated cluster (``tawpipe.cluster``) creates network namespaces, veth links and tc shapers
on the machine. As root a test run would do that unasked, so here every check of whether the
cluster can run (``tawpipe.cluster.host.unavailable_reason``, which the end-to-end tests skip on,
``Cluster.up`` refuses on and ``tawpipe.cluster.unavailable_reason`` forwards to) also says no
unless ``TAWPIPE_NETNS_TESTS=1`` is set. ``.ci/run`` sets it. Its real reasons (no root, no
iproute2, no CAP_NET_ADMIN) come first: the variable cannot overrule them.
"""

from __future__ import annotations

import functools
import os

NETNS_ENV = "TAWPIPE_NETNS_TESTS"
NOT_ASKED = (f"the emulated-cluster tests create network namespaces, veth links and tc shapers on this "
             f"host: set {NETNS_ENV}=1 to run them (as root; .ci/run does)")


def netns_asked() -> bool:
    return os.environ.get(NETNS_ENV, "") == "1"


def pytest_configure(config) -> None:
    from tawpipe.cluster import host

    real = host.unavailable_reason
    if getattr(real, "_asks_first", False):  # configured twice (pytester): wrap once
        return

    @functools.wraps(real)
    def unavailable_reason(spec=None) -> str | None:
        reason = real(spec)
        return NOT_ASKED if reason is None and not netns_asked() else reason

    unavailable_reason._asks_first = True
    host.unavailable_reason = unavailable_reason


# What each family of skipped tests needs (the words its skip reasons use), and how to run it
# (README, "Quick start").
SKIP_FAMILIES = (
    (("CUDA",), "need a CUDA GPU (on a GPU machine: bash benchmarks/gpu_check.sh)"),
    (("network namespaces", NETNS_ENV), f"create network namespaces and shaped links on this host (as root: "
                                        f"{NETNS_ENV}=1 python3 -m pytest)"),
    (("TRITON_INTERPRET",), "run Triton kernels on CPU tensors (TRITON_INTERPRET=1 python3 -m pytest "
                            "tests/test_triton_ops.py)"),
    (("nvcc", "nccl"), "compile CUDA code (nvcc, and nccl.h from the nvidia-nccl-cu13 wheel)"),
)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Say, in a line per family, why tests were skipped and what runs them: a newcomer's run
    skips a few hundred, every one for want of a GPU, root or a toolchain."""
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr).lower()
        family = next((what for keys, what in SKIP_FAMILIES if any(k.lower() in reason for k in keys)),
                      "other: " + reason)
        counts[family] = counts.get(family, 0) + 1
    if counts:
        terminalreporter.write_line(f"skipped {sum(counts.values())} tests, by what they need:")
        for family, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"  {n:4d} {family}")
