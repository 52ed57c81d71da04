"""What a forward keeps for its backward, in pinned host memory in between.

Under recompute a forward keeps only its chunk's input (with ``recompute="block"`` each layer's):
B·S·H elements per chunk (or layer) and micro-batch. A rank runs every chunk for every
micro-batch, so N·acc of them wait on the device for their backwards. With
``MemoryPolicy(offload_activations=True)`` each tensor goes to pinned host memory as soon as the
forward that read it is done, and comes back ahead of what reads it: when a backward takes an
input, the next one in the rank's order (the next backward's, or under "block" the next layer's
of the same backward) starts coming back, so at most two fetched inputs are on the device at
once: two layers' under "block", not two chunks' worth. Stores and fetches run on streams of their
own, ordered by events with the compute stream, so on a GPU both overlap compute; the host never
waits. Without CUDA the same calls are plain copies (the tests' exactness runs).

The copies are torch's stream-ordered ones from and into pinned buffers, not the prefetcher's
(``tawpipe.runtime.offload``): an activation needs no cast and no staging, and a pinned buffer is
copied by the DMA engine directly. Pinned buffers are pooled by shape and dtype: a step reuses the
last step's.
"""

from __future__ import annotations

from collections import defaultdict

import torch

Key = tuple[int, int, int]  # (position in the model, micro-batch, layer within the chunk: 0 but under "block")


class ActivationOffload:
    """What forwards keep, by ``Key``: ``store`` after the forward that read it, ``take`` before
    the backward that reads it (which also starts fetching the next in ``order``)."""

    def __init__(self, device: torch.device, order: list[Key]) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.next = dict(zip(order, order[1:]))  # the backward after each, in the rank's plan order
        self.stored_bytes = self.fetched_bytes = 0
        self.most_fetched_bytes = 0  # the most bytes fetched back and not yet taken at once
        self._host: dict[Key, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}
        self._back: dict[Key, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}
        self._pool: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # pinned buffers free again
        self._lent: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []  # read by a fetch in flight
        if self.cuda:
            self._store_stream, self._fetch_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def store(self, key: Key, kept: list[torch.Tensor]) -> None:
        """What a forward keeps for ``key``'s backward (its chunk input, or every layer's) to the
        host, after the compute queued so far (which read it); the device's copies are freed once
        the copies are done."""
        hosts = [self._buffer(x) for x in kept]
        event = None
        if self.cuda:
            self._store_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._store_stream):
                for host, x in zip(hosts, kept):
                    host.copy_(x, non_blocking=True)
                    x.record_stream(self._store_stream)  # its memory waits for the copy, not for us
                event = torch.cuda.Event()
                event.record()
        else:
            for host, x in zip(hosts, kept):
                host.copy_(x)
        self._host[key] = (hosts, event)
        self.stored_bytes += sum(x.nbytes for x in kept)

    def take(self, key: Key) -> list[torch.Tensor]:
        """``key``'s kept tensors on the device, for the compute stream; the next backward's start
        coming."""
        self._fetch(key)
        kept, event = self._back.pop(key)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for x in kept:
                x.record_stream(current)
        if key in self.next:
            self._fetch(self.next[key])
        return kept

    def _fetch(self, key: Key) -> None:
        """Start bringing ``key`` back (once)."""
        if key in self._back or key not in self._host:
            return
        hosts, stored = self._host.pop(key)
        event = None
        if self.cuda:
            with torch.cuda.stream(self._fetch_stream):
                if stored is not None:
                    self._fetch_stream.wait_event(stored)
                kept = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in hosts]
                for x, h in zip(kept, hosts):
                    x.copy_(h, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
        else:
            kept = [h.clone() for h in hosts]
        self._lent += [(h, event) for h in hosts]
        self._back[key] = (kept, event)
        self.fetched_bytes += sum(x.nbytes for x in kept)
        waiting = sum(x.nbytes for tensors, _ in self._back.values() for x in tensors)
        self.most_fetched_bytes = max(self.most_fetched_bytes, waiting)

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped as ``like``: a pooled one whose fetch is done, else a new one."""
        still = []
        for h, e in self._lent:
            if e is None or e.query():
                self._pool[(tuple(h.shape), h.dtype)].append(h)
            else:
                still.append((h, e))
        self._lent = still
        free = self._pool[(tuple(like.shape), like.dtype)]
        return free.pop() if free else torch.empty(like.shape, dtype=like.dtype, pin_memory=self.cuda)
