"""Bytes as people read them, one way everywhere: memory in binary units, traffic in decimal ones
(as link rates are given)."""

from __future__ import annotations


def gib(n: float) -> str:
    """Memory: ``384.0 MiB``, ``2.00 GiB``, ``1.5 TiB``."""
    if n < 2**30:
        return f"{n / 2**20:,.1f} MiB"
    return f"{n / 2**30:,.2f} GiB" if n < 1000 * 2**30 else f"{n / 2**40:,.1f} TiB"


def decimal(n: float) -> str:
    """Bytes moved: ``512 B``, ``6.10 MB``, ``1.20 TB``."""
    for scale, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:,.2f} {name}"
    return f"{n:,.0f} B"
