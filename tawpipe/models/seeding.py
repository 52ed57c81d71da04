"""Per-part random initialisation: every part of a model draws from its own random stream.

A part is the embedding, one decoder layer, the head, and so on. Its stream is keyed by
(seed, part name) alone, so a rank can initialise its own chunk without building the rest of the
model, and gets the numbers the whole model would have, whatever the topology. The reference
models use the same streams, which is what makes "the same model" well defined.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_MASK = (1 << 63) - 1


def part_seed(seed: int, part: str) -> int:
    """A 63-bit seed for ``part`` of the model built from ``seed``."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    digest = hashlib.blake2b(f"{seed}/{part}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def layer_part(index: int) -> str:
    """The part name of decoder layer ``index`` (a global layer index)."""
    return f"layers.{index}"


def generator(seed: int, part: str) -> torch.Generator:
    """A CPU generator on ``part``'s stream (draws happen on the CPU whatever the device, so the
    numbers do not depend on where the model lives)."""
    return torch.Generator(device="cpu").manual_seed(part_seed(seed, part))


@contextmanager
def seeded(seed: int, part: str) -> Iterator[None]:
    """The global CPU RNG on ``part``'s stream, restored afterwards: for init code that takes no
    generator (Hugging Face's ``_init_weights``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(part_seed(seed, part))
        yield


def draw_seed() -> int:
    """A model seed from the global torch RNG, so ``torch.manual_seed(s)`` before building a model
    still fixes it."""
    return int(torch.randint(0, _MASK, (), device="cpu"))
