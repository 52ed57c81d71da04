"""Topology: rank arithmetic, rails, and discovery from torchrun's environment or hostnames."""

from __future__ import annotations

import random

import pytest

from tawpipe.plan.topology import Topology, divisors


def test_rank_arithmetic_and_rails():
    t = Topology(nodes=3, per_node=4)
    assert t.world_size == 12
    assert [t.group_of(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert [t.local_index(r) for r in range(12)] == [0, 1, 2, 3] * 3
    assert all(t.rank_of(t.group_of(r), t.local_index(r)) == r for r in range(12))
    assert t.group_ranks(1) == (4, 5, 6, 7)
    assert t.rail_peers(5) == (1, 9)
    assert Topology(1, 8).rail_peers(3) == ()


@pytest.mark.parametrize("nodes,per_node", [(0, 2), (2, 0), (-1, 1), (1.5, 2), (True, 2)])
def test_invalid_shapes(nodes, per_node):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        Topology(nodes, per_node)


def test_out_of_range_queries():
    t = Topology(2, 2)
    with pytest.raises(ValueError, match="rank 4 is outside 0..3"):
        t.group_of(4)
    with pytest.raises(ValueError, match="group 2"):
        t.rank_of(2, 0)
    with pytest.raises(ValueError, match="local index 2"):
        t.rank_of(0, 2)


def test_from_env_torchrun():
    env = {"WORLD_SIZE": "24", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "3",
           "RANK": "13", "GROUP_RANK": "1", "LOCAL_RANK": "5"}
    assert Topology.from_env(env) == Topology(3, 8)
    assert Topology.from_env({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}) == Topology(1, 4)


@pytest.mark.parametrize("env,match", [
    ({}, "not both set"),
    ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, "same number of processes on every node"),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "3"}, "equal-sized groups"),
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "2", "GROUP_RANK": "1", "LOCAL_RANK": "2"},
     "not contiguous per node"),
    ({"WORLD_SIZE": "eight", "LOCAL_WORLD_SIZE": "4"}, "not an integer"),
])
def test_from_env_rejects_inconsistent_launches(env, match):
    with pytest.raises(ValueError, match=match):
        Topology.from_env(env)


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for name in ("GROUP_WORLD_SIZE", "RANK", "GROUP_RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert Topology.from_env() == Topology(3, 2)


def test_from_hostnames():
    assert Topology.from_hostnames(["a", "a", "b", "b", "c", "c"]) == Topology(3, 2)
    assert Topology.from_hostnames(["solo"] * 4) == Topology(1, 4)
    assert Topology.from_hostnames(["x", "y", "z"]) == Topology(3, 1)


def test_from_hostnames_rejects_unequal_groups_and_says_what_it_found():
    with pytest.raises(ValueError, match=r"hosts have 3, 2, 3 ranks; tawpipe needs equal-sized groups"):
        Topology.from_hostnames(["a"] * 3 + ["b"] * 2 + ["c"] * 3)


def test_from_hostnames_rejects_interleaved_ranks():
    with pytest.raises(ValueError, match=r"ranks of host 'a' are not contiguous \(r0:a, r1:b, r2:a, r3:b\)"):
        Topology.from_hostnames(["a", "b", "a", "b"])
    with pytest.raises(ValueError, match="empty"):
        Topology.from_hostnames([])


def test_divisors_are_every_divisor_ascending():
    rng = random.Random()
    for n in [1, 2, 36, 97, *(rng.randint(1, 200_000) for _ in range(20)), rng.randint(1, 400) ** 2]:
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
