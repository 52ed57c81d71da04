"""Device topology: G groups (nodes) of s devices each, ranks contiguous per group.

TawPipe keeps collectives inside a group and sends only rail-aligned P2P messages between groups
(design §3.1), so every other module asks this one which group a rank is in and who its rail peers
are. Only equal-sized, contiguous groups are supported; anything else is rejected here, at
construction time, with a message that says what was found.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


def divisors(n: int) -> list[int]:
    """``n``'s divisors, ascending, in about sqrt(n) steps (a flag may name a million nodes): the
    replica counts a job's nodes allow, the micro-batches a fetch may serve."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class Topology:
    """``nodes`` groups of ``per_node`` devices; rank = group · per_node + local index."""

    nodes: int
    per_node: int

    def __post_init__(self) -> None:
        for name in ("nodes", "per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1} ({self})")

    # group_of and local_index check the rank inline: the traffic accounting asks them millions of times
    def group_of(self, rank: int) -> int:
        if not 0 <= rank < self.nodes * self.per_node:
            self._check_rank(rank)
        return rank // self.per_node

    def local_index(self, rank: int) -> int:
        if not 0 <= rank < self.nodes * self.per_node:
            self._check_rank(rank)
        return rank % self.per_node

    def rank_of(self, group: int, local: int) -> int:
        if not 0 <= group < self.nodes:
            raise ValueError(f"group {group} is outside 0..{self.nodes - 1}")
        if not 0 <= local < self.per_node:
            raise ValueError(f"local index {local} is outside 0..{self.per_node - 1}")
        return group * self.per_node + local

    def group_ranks(self, group: int) -> tuple[int, ...]:
        start = self.rank_of(group, 0)
        return tuple(range(start, start + self.per_node))

    def rail_peers(self, rank: int) -> tuple[int, ...]:
        """Ranks with the same local index in the other groups (the rank's rail)."""
        g, i = self.group_of(rank), self.local_index(rank)
        return tuple(self.rank_of(h, i) for h in range(self.nodes) if h != g)

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None) -> "Topology":
        """Read the launch shape that torchrun exports (WORLD_SIZE, LOCAL_WORLD_SIZE, ...).

        torchrun gives every node LOCAL_WORLD_SIZE workers with contiguous global ranks; the
        optional GROUP_WORLD_SIZE and RANK/GROUP_RANK/LOCAL_RANK are cross-checked against that.
        """
        env = os.environ if env is None else env

        def read(name: str) -> int | None:
            raw = env.get(name)
            if raw is None or raw == "":
                return None
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None

        world, local = read("WORLD_SIZE"), read("LOCAL_WORLD_SIZE")
        if world is None or local is None:
            raise ValueError(
                "WORLD_SIZE and LOCAL_WORLD_SIZE are not both set: launch with torchrun, or build "
                "the topology explicitly with Topology(nodes, per_node) or Topology.from_hostnames"
            )
        if local < 1 or world < 1 or world % local:
            raise ValueError(
                f"WORLD_SIZE={world} is not a positive multiple of LOCAL_WORLD_SIZE={local}: "
                "tawpipe needs the same number of processes on every node"
            )
        nodes = world // local
        group_world = read("GROUP_WORLD_SIZE")
        if group_world is not None and group_world != nodes:
            raise ValueError(
                f"GROUP_WORLD_SIZE={group_world} but WORLD_SIZE/LOCAL_WORLD_SIZE={nodes}: the "
                "nodes run different numbers of processes; tawpipe needs equal-sized groups"
            )
        rank, group_rank, local_rank = read("RANK"), read("GROUP_RANK"), read("LOCAL_RANK")
        if None not in (rank, group_rank, local_rank):
            if rank != group_rank * local + local_rank:
                raise ValueError(
                    f"RANK={rank} is not GROUP_RANK*LOCAL_WORLD_SIZE+LOCAL_RANK="
                    f"{group_rank}*{local}+{local_rank}: ranks are not contiguous per node; "
                    "launch with torchrun's default rank assignment"
                )
        return Topology(nodes=nodes, per_node=local)

    @staticmethod
    def from_hostnames(hostnames: Sequence[str]) -> "Topology":
        """Derive the groups from one hostname per rank (gathered once by the caller)."""
        if not hostnames:
            raise ValueError("from_hostnames needs one hostname per rank, got an empty list")
        runs: list[tuple[str, int]] = []  # (host, number of consecutive ranks on it)
        for host in hostnames:
            if runs and runs[-1][0] == host:
                runs[-1] = (host, runs[-1][1] + 1)
            else:
                runs.append((host, 1))
        seen: set[str] = set()
        for host, _ in runs:
            if host in seen:
                order = ", ".join(f"r{r}:{h}" for r, h in enumerate(hostnames))
                raise ValueError(
                    f"the ranks of host {host!r} are not contiguous ({order}); tawpipe needs "
                    "ranks numbered node by node (torchrun's default)"
                )
            seen.add(host)
        sizes = [n for _, n in runs]
        if len(set(sizes)) != 1:
            listed = ", ".join(str(n) for n in sizes)
            raise ValueError(
                f"hosts have {listed} ranks; tawpipe needs equal-sized groups: launch the same "
                "number of processes on every node"
            )
        return Topology(nodes=len(runs), per_node=sizes[0])
