"""The engine's host offload (``MemoryPolicy(offload_state=True)``): a chunk owner's float32 master and gradient
accumulator live in pinned host memory, in a ``tawpipe.runtime.offload.HostOffload`` (public API,
where its interface is described); the device holds only compute-dtype weights and incoming
gradients.

Where the optimizer runs: on the host, where the state lives. The engine's optimizer holds the
own chunk's parameters as views of ``master`` (their ``.grad`` are views of ``grad``), so the
optimizer state it creates for them is host memory too and its step reads and writes 16 bytes
per parameter there; running it on the device would move 28 bytes per parameter across PCIe
every step instead, and the step is memory-bound on either side.

Overlap: the engine issues loads on its weights channel, whose stream is not the compute stream,
and compute waits on the channel's event before it reads the buffer.
"""

from __future__ import annotations

from ..runtime.offload import DEFAULT_PIECE_NUMEL, HostOffload, OffloadMemory

__all__ = ["DEFAULT_PIECE_NUMEL", "HostOffload", "OffloadMemory"]
