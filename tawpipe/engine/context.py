"""Context parallelism inside a node (design §3.6): the c ranks of a context group compute each
micro-batch together, each on its own slice of the sequence.

The plan is unchanged: in a slot every rank of a node runs the same chunk for the same
micro-batch, one broadcast feeding them all (design §3.2), so a group of c ranks of a node can
split that micro-batch's sequence instead of taking a micro-batch each. Each rank then keeps 1/c
of the activations, and the weights cross the network as before. Attention needs every earlier
token's keys and values: each layer all-gathers them among the group in the forward, over the
node's links, and reduce-scatters their gradients in the backward (``gather``). An all-gather,
not a ring: each of a rank's layers exchanges 2/c of a layer's K/V per rank over links that are
the node's fastest, in one call, and the gathered keys then meet one attention call whatever the
mask; a ring would overlap the exchange with attention blocks at the cost of c calls per layer.

Causal attention gives late tokens more work than early ones, so the sequence is cut into 2c
equal pieces and rank i takes pieces i and 2c-1-i (as Llama 3's and Megatron's context
parallelism do): every rank then attends to the same number of key positions.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..models.parts import SequenceSlice, position_runs
from ..plan.context import context_groups
from ..plan.topology import Topology
from ..runtime.comm.base import Comm, Group

CONTEXT_CHANNEL = "context"  # the K/V exchange's communicator: no plan op runs on it


def mirrored(degree: int, member: int) -> tuple[int, int]:
    """The two pieces (of 2·degree) that member ``member`` of a context group computes."""
    return member, 2 * degree - 1 - member


def slice_positions(seq_len: int, degree: int, index: int) -> torch.Tensor:
    """Positions of the tokens member ``index`` of a context group of ``degree`` computes: pieces
    ``index`` and ``2 degree - 1 - index`` of the sequence cut into ``2 degree`` equal pieces."""
    if seq_len % (2 * degree):
        raise ValueError(f"sequences of {seq_len} tokens cannot be cut into the 2 x context_parallel = "
                         f"{2 * degree} equal pieces that context parallelism balances (each rank takes two): "
                         f"make the sequence length a multiple of {2 * degree}")
    n = seq_len // (2 * degree)
    return torch.cat([torch.arange(p * n, (p + 1) * n) for p in mirrored(degree, index)])


class ContextGroup:
    """This rank's context group: the slices it computes and the K/V exchange among its members,
    on a communicator of its own (``comm``, a channel no plan op uses). ``sent`` counts the bytes
    this rank sent in exchanges since it was built: (c - 1) times its own share per all-gather or
    reduce-scatter, as ``cost.traffic.context_bytes`` counts them; ``seconds`` the time the
    compute waited in them."""

    def __init__(self, comm: Comm, topology: Topology, degree: int, rank: int) -> None:
        self.comm, self.degree = comm, degree
        self.groups = context_groups(topology, degree)
        self.group = next(g for g in self.groups if rank in g)
        self.index = self.group.index(rank)
        self.sent, self.seconds = 0, 0.0

    def slice(self, seq_len: int, device: torch.device) -> SequenceSlice:
        positions = slice_positions(seq_len, self.degree, self.index)
        return SequenceSlice(positions.to(device), seq_len, lambda *xs: _Gather.apply(self, seq_len, *xs),
                             position_runs(positions))

    def loss_weights(self, targets: list[torch.Tensor], slices: list[SequenceSlice]) -> list[float]:
        """The weight of this rank's slice loss for each batch: ``c · n_slice / n_whole``, the
        targets it counts over those of the whole sequence (class indices count unless negative,
        an ignore_index; targets of class probabilities all count). ``loss_fn`` is a mean over the
        counted targets, so the group's mean of weighted slice losses is the whole sequence's loss
        however unevenly the ignored targets fall; 1 where none is counted (every slice's own loss)."""
        counted = [i for i, y in enumerate(targets) if y.dim() == 2]
        weights = [1.0] * len(targets)
        if counted:
            counts = torch.stack([torch.stack([(targets[i] >= 0).sum(), (targets[i][:, slices[i].positions] >= 0).sum()])
                                  for i in counted]).tolist()
            for i, (whole, mine) in zip(counted, counts):
                weights[i] = self.degree * mine / whole if whole else 1.0
        return weights

    def check_same_batches(self, world: Group, tokens: list[torch.Tensor]) -> None:
        """Every member of every context group was given the same sequences (each takes its slice
        of them): one small all-gather over the world, so every rank raises, or none does. Each
        rank sends three numbers whatever it was given (a digest of its tensors' digests, and their
        count), so ranks of different groups may hold different numbers of batches."""
        digests = torch.stack([_digest(t) for t in tokens])
        mine = torch.cat([_digest(digests), torch.tensor([len(tokens)], device=digests.device)])
        rows = torch.empty(len(world) * mine.numel(), dtype=torch.int64, device=mine.device)
        self.comm.all_gather(rows, mine, world)
        rows = rows.view(len(world), -1)
        for group in self.groups:
            if any(not torch.equal(rows[r], rows[group[0]]) for r in group):
                raise ValueError(
                    f"context_parallel={self.degree}: ranks {group} were given different batches, but a context "
                    "group computes the same sequences together (each rank its slice): give the ranks of a context "
                    f"group the same batch (shard the data by rank // {self.degree})")

    def exchange(self, pieces: torch.Tensor, out: torch.Tensor, gather: bool) -> None:
        """All-gather ``pieces`` into ``out`` (c times its size), or reduce-scatter ``pieces`` (c
        shares, in member order) into ``out``."""
        t0 = time.perf_counter()
        if gather:
            self.comm.all_gather(out, pieces, self.group)
        else:
            self.comm.reduce_scatter(out, pieces, self.group)
        self.seconds += time.perf_counter() - t0
        self.sent += (self.degree - 1) * min(pieces.numel(), out.numel()) * pieces.element_size()


def _digest(tokens: torch.Tensor) -> torch.Tensor:
    """Two int64 that differ, almost surely, between two different token tensors of a shape."""
    t = tokens.reshape(-1).long()
    weights = torch.arange(1, t.numel() + 1, device=t.device) % 1_000_003
    return torch.stack([(t * weights).sum(), t.sum()])


def _pieces(x: torch.Tensor, degree: int, member: int) -> list[tuple[int, torch.Tensor]]:
    """(piece index, piece) of member ``member``'s share ``x`` (tokens second to last)."""
    return list(zip(mirrored(degree, member), x.chunk(2, dim=-2)))


class _Gather(torch.autograd.Function):
    """Tensors over this rank's slice -> the same over the whole sequence; backward: the sum of
    every member's gradient for this rank's slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, group: ContextGroup, seq_len: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.shapes = group, [x.shape for x in xs]
        c = group.degree
        mine = torch.cat([x.reshape(-1) for x in xs])
        every = torch.empty(c * mine.numel(), dtype=mine.dtype, device=mine.device)
        group.exchange(mine, every, gather=True)
        shares = every.view(c, -1).split([x.numel() for x in xs], dim=1)
        out = []
        for x, share in zip(xs, shares):
            ordered = sorted(p for m in range(c) for p in _pieces(share[m].view(x.shape), c, m))
            out.append(torch.cat([p for _, p in ordered], dim=-2))
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        group, c = ctx.group, ctx.group.degree
        per_member = []
        n = grads[0].shape[-2] // (2 * c)
        for m in range(c):  # member m's share of each gradient, laid out as its forward sent it
            per_member += [torch.cat([g.narrow(-2, p * n, n) for p in mirrored(c, m)], dim=-2).reshape(-1)
                           for g in grads]
        send = torch.cat(per_member)
        mine = torch.empty(send.numel() // c, dtype=send.dtype, device=send.device)
        group.exchange(send, mine, gather=False)
        out, at = [], 0
        for shape in ctx.shapes:
            size = shape.numel()
            out.append(mine[at:at + size].view(shape))
            at += size
        return (None, None, *out)
