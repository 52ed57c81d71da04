"""Tests that change the host's network run only when asked.

The emulated cluster (``tawpipe.cluster``) creates network namespaces, veth links and tc shapers
on the machine. As root a test run would do that unasked, so here every check of whether the
cluster can run (``tawpipe.cluster.unavailable_reason``, which the end-to-end tests skip on and
``Cluster.up`` refuses on) also says no unless ``TAWPIPE_NETNS_TESTS=1`` is set. ``.ci/run`` sets
it. Its real reasons (no root, no iproute2, no CAP_NET_ADMIN) come first: the variable cannot
overrule them.
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
    from tawpipe import cluster

    real = cluster.unavailable_reason
    if getattr(real, "_asks_first", False):  # configured twice (pytester): wrap once
        return

    @functools.wraps(real)
    def unavailable_reason(spec=None) -> str | None:
        reason = real(spec)
        return NOT_ASKED if reason is None and not netns_asked() else reason

    unavailable_reason._asks_first = True
    cluster.unavailable_reason = unavailable_reason
