"""Train your own stack of blocks with TawPipe.

    python examples/own_block_stack.py                                      # 2 emulated nodes x 2 ranks
    torchrun --nnodes 1 --nproc-per-node 4 examples/own_block_stack.py     # or under torchrun

What the engine needs (design §8.3): identical blocks, a replicated ``embed`` and ``head``, a
``loss_fn`` that averages over the micro-batch, and for blocks that take more than the hidden
states, ``block_context(tokens) -> dict`` passed to ``block_forward(block, hidden, **ctx)``.
Each rank passes ``step`` its own micro-batches: (inputs, targets) of int64 token ids, shaped
(micro_batches * rows, seq_len). Every rank must build the same initial model: the replicated
weights are not broadcast, so seed every rank alike (the engine checks that they agree).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from tawpipe import ModelParts, TawPipe, Topology
from tawpipe.runtime.launch import init_distributed, run_local

VOCAB, HIDDEN, SEQ, ROWS, MICRO_BATCHES = 64, 32, 16, 2, 2


class Block(nn.Module):
    """A residual MLP block whose output is damped towards later positions (its extra input)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, damping: torch.Tensor) -> torch.Tensor:
        return x + damping * self.down(F.gelu(self.up(self.norm(x))))


def block_context(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-micro-batch inputs every block needs besides the hidden states."""
    return {"damping": torch.linspace(1.0, 0.5, tokens.shape[1]).unsqueeze(-1)}


def block_forward(block: nn.Module, hidden: torch.Tensor, **ctx: torch.Tensor) -> torch.Tensor:
    return block(hidden, ctx["damping"])


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batches of a toy task (continue a counting sequence), the same whichever
    process draws them."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (MICRO_BATCHES * ROWS, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def train(rank: int, topology: Topology, steps: int) -> list[float]:
    torch.manual_seed(0)  # the same initial model on every rank
    embed, head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
    blocks = [Block() for _ in range(8)]
    model = ModelParts(blocks, embed, head, loss_fn, block_forward=block_forward, block_context=block_context)
    engine = TawPipe(model, topology=topology, micro_batches=MICRO_BATCHES)
    losses = [engine.step(batch(step, rank)) for step in range(steps)]  # the global mean loss
    engine.close()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun: one process per rank, the topology from its environment
        init_distributed()
        losses = train(int(os.environ["RANK"]), Topology.from_env(), args.steps)
        if os.environ["RANK"] != "0":
            return
    else:
        losses = run_local(train, 4, Topology(nodes=2, per_node=2), args.steps)[0]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")


if __name__ == "__main__":
    main()
