"""A model cut the way the engine takes it (design §8.3), whatever it was built from.

The built-in LLaMA (``tawpipe.models.llama``) and Hugging Face models (``tawpipe.models.hf``) both
produce a :class:`ModelParts`, so the training tool, the examples and the tests build an engine
the same way: ``TawPipe(**parts.engine_args(), topology=..., micro_batches=...)``.

The contract's vocabulary lives here, once: the names of the three parts, the name of a block's
parameter in the whole model, and the signature that makes two models interchangeable. Models
know nothing of distribution; the engine and the checkpoints use these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

PART_NAMES = ("embed", "blocks", "head")  # the engine's default names of the three parts

# Returns block number i (a global layer index) with its initial weights, for blocks built on the
# meta device: each rank materialises only its own chunk.
Materialize = Callable[[nn.Module, int], nn.Module]

Signature = list[tuple[str, tuple[int, ...], torch.dtype]]


def unique_params(modules: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, nn.Parameter]]:
    """(prefixed name, parameter) of ``modules``, each shared parameter once (tied weights)."""
    seen: set[int] = set()
    out = []
    for prefix, m in modules:
        for name, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"{prefix}.{name}", p))
    return out


def block_param_name(prefix: str, first_layer: int, name_in_chunk: str) -> str:
    """The model's name of a parameter that a stack of blocks starting at ``first_layer`` calls
    ``name_in_chunk`` (``"{i}.{rest}"``): ``"{prefix}.{first_layer + i}.{rest}"``."""
    idx, rest = name_in_chunk.split(".", 1)
    return f"{prefix}.{first_layer + int(idx)}.{rest}"


def param_signature(named: Iterable[tuple[str, torch.Tensor]]) -> Signature:
    """(name, shape, dtype) of every parameter: what must match for weights to be exchangeable."""
    return [(n, tuple(p.shape), p.dtype) for n, p in named]


def model_signature(num_layers: int, names: tuple[str, str, str], block: Signature,
                    replicated: Signature) -> dict[str, Any]:
    """What makes two models interchangeable, as JSON data: the layer count, one block's parameters
    and the replicated ones (name, shape, dtype), and the names of the three parts."""
    rows = lambda params: [[n, list(shape), str(dtype)] for n, shape, dtype in params]  # noqa: E731
    return {"num_layers": num_layers, "names": list(names), "block": rows(block), "replicated": rows(replicated)}


def parts_signature(blocks: Sequence[nn.Module], embed: nn.Module, head: nn.Module) -> dict[str, Any]:
    """The signature an engine built from these parts has (``TawPipe.model_signature``), read from
    the parts alone: blocks on the meta device are fine."""
    replicated = unique_params([(PART_NAMES[0], embed), (PART_NAMES[2], head)])
    return model_signature(len(blocks), PART_NAMES, param_signature(blocks[0].named_parameters()),
                           param_signature(replicated))


@dataclass(frozen=True)
class SequenceSlice:
    """A rank's share of a sequence that several ranks compute together (context parallelism):
    the positions of its tokens in the whole sequence, ascending, and ``gather``, which turns
    tensors over this slice's tokens (the token dimension second to last, e.g. keys and values
    (batch, heads, tokens, head_dim)) into the same tensors over the whole sequence's tokens, in
    sequence order, differentiably. Whoever gives it (the engine) does the exchange; a model only
    calls it, so models stay free of distribution code. ``runs``: the slice as runs of consecutive
    positions, (first index in the slice, first position, length) each, in order, known on the
    host (``position_runs``) so that a model reading them makes no device sync."""

    positions: torch.Tensor  # (tokens,) int64
    seq_len: int  # of the whole sequence
    gather: Callable[..., tuple[torch.Tensor, ...]]
    runs: tuple[tuple[int, int, int], ...]


def position_runs(positions: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """Ascending ``positions`` (on the host) as runs of consecutive ones: (first index, first
    position, length) each."""
    if positions.numel() == 0:
        return ()
    starts = [0, *((positions[1:] - positions[:-1] != 1).nonzero().flatten() + 1).tolist()]
    ends = [*starts[1:], positions.numel()]
    first = positions[starts].tolist()
    return tuple((i, p, e - i) for i, p, e in zip(starts, first, ends))


def call_block(block: nn.Module, hidden: torch.Tensor, **ctx: Any) -> torch.Tensor:
    """The default ``block_forward``: the block called with the hidden state and the context."""
    return block(hidden, **ctx)


@dataclass
class ModelParts:
    """A model as the engine takes it (design §8.3): blocks (possibly on the meta device, with
    ``materialize`` for the own chunk), replicated ``embed`` and ``head`` (real, float32, on the
    engine's device), the loss, and the hooks the engine calls.

    ``block_forward(block, hidden, **ctx)`` runs a block with what ``block_context(tokens)``
    returns for the micro-batch (rotary tables, masks). ``sliced_context(tokens, slice)`` is the
    same for a rank's :class:`SequenceSlice` of the sequence under context parallelism: ``tokens``
    are the slice's, and the blocks' attention must see the whole sequence through
    ``slice.gather`` (None: the model cannot be trained with context parallelism); each slice's
    loss then weighs by its share of the counted targets (those not negative), so ``loss_fn`` must
    be a mean over them, as ``cross_entropy``'s is. ``head_loss(head, hidden, targets)`` is
    ``loss_fn(head(hidden), targets)`` computed without the whole logits, where the model has one
    (None otherwise); the engine uses it when its ``MemoryPolicy`` asks for the chunked loss.
    ``names`` are the three parts' names in parameter names and checkpoints.
    ``checkpoint_name`` maps the engine's parameter names to the ones of a Hugging Face
    ``save_pretrained`` directory and ``save_config(directory, dtype)`` writes its config there
    for weights of ``dtype`` (the config records it), for ``tawpipe.io.safetensors.export``, which
    checks that it takes both before writing anything (both None where the model has no such
    format).
    ``config`` is the model's configuration as plain data (recorded in checkpoints);
    ``vocab_size`` and ``description`` are for people and checks (None and "": not known).
    """

    blocks: Sequence[nn.Module]
    embed: nn.Module
    head: nn.Module
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    block_forward: Callable[..., torch.Tensor] = call_block
    block_context: Callable[[torch.Tensor], dict[str, Any]] | None = None
    sliced_context: Callable[[torch.Tensor, SequenceSlice], dict[str, Any]] | None = None
    materialize: Materialize | None = None
    vocab_size: int | None = None
    description: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    checkpoint_name: Callable[[str], str] | None = None
    save_config: Callable[[Path, torch.dtype], None] | None = None
    head_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    names: tuple[str, str, str] = PART_NAMES

    @property
    def decoder_params(self) -> int:
        """Ψ: parameters of the blocks (the sharded part)."""
        return sum(p.numel() for b in self.blocks for p in b.parameters())

    @property
    def replicated_params(self) -> int:
        """Distinct parameters of ``embed`` and ``head`` (a tied embedding counts once)."""
        return sum(p.numel() for _, p in unique_params([(PART_NAMES[0], self.embed), (PART_NAMES[2], self.head)]))
