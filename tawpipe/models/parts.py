"""A model cut the way the engine takes it (design §8.3), whatever it was built from.

The built-in LLaMA (``tawpipe.models.llama``) and Hugging Face models (``tawpipe.models.hf``) both
produce a :class:`ModelParts`, so the training tool, the examples and the tests build an engine
the same way: ``TawPipe(**parts.engine_args(), topology=..., micro_batches=...)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from ..storage import Materialize, unique_params

if TYPE_CHECKING:
    from ..engine import TawPipe

Export = Callable[["TawPipe", "str | os.PathLike[str]", torch.dtype], None]


@dataclass
class ModelParts:
    """Blocks (possibly on the meta device, with ``materialize`` for the own chunk), replicated
    ``embed`` and ``head`` (real, float32, on the engine's device), and the hooks the engine calls.

    ``export(engine, directory, dtype)`` writes the trained model as a Hugging Face
    ``save_pretrained`` directory, each rank its own chunk (None where the model has no such
    format). ``config`` is the model's configuration as plain data (recorded in checkpoints).
    """

    blocks: Sequence[nn.Module]
    embed: nn.Module
    head: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    block_forward: Callable[..., torch.Tensor]
    block_context: Callable[[torch.Tensor], dict[str, Any]]
    materialize: Materialize | None
    vocab_size: int
    description: str
    config: dict[str, Any] = field(default_factory=dict)
    export: Export | None = None

    def engine_args(self) -> dict[str, Any]:
        """The model arguments of ``TawPipe``."""
        return dict(blocks=self.blocks, embed=self.embed, head=self.head, loss_fn=self.loss_fn,
                    block_forward=self.block_forward, block_context=self.block_context,
                    materialize=self.materialize)

    @property
    def decoder_params(self) -> int:
        """Ψ: parameters of the blocks (the sharded part)."""
        return sum(p.numel() for b in self.blocks for p in b.parameters())

    @property
    def replicated_params(self) -> int:
        """Distinct parameters of ``embed`` and ``head`` (a tied embedding counts once)."""
        return sum(p.numel() for _, p in unique_params([("embed", self.embed), ("head", self.head)]))
