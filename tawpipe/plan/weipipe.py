"""WeiPipe-Interleave, the paper's baseline (design §3.4), corrected; registered as "weipipe".

Three same-direction rings w -> w+1 over every rank: the weights of the forward (F-ring), those
of the backward (B-ring) and the gradients' partial sums. Chunk k is owned by rank k and, in
model order, is position (-k) mod N. It runs the paper's settings only.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import TYPE_CHECKING, Any

from .actions import G_RECV, OPS, W_OWN, WEIPIPE_B_BUFS, WEIPIPE_F_BUFS, Op, grad_buf, new_action
from .events import Events, finish
from .plan import Plan
from .registry import ChunkLayout, Schedule, register
from .tables import by_slot, table_row
from .topology import Topology

if TYPE_CHECKING:
    from ..models.shape import ModelDims


class WeiPipeSchedule(Schedule):
    """The lock-step ring of the paper's baseline; every rank a worker of one ring."""

    name, title = "weipipe", "WeiPipe"
    min_ranks = 2

    def layout(self, topology: Topology, positions: Any) -> ChunkLayout:
        n = topology.world_size
        return tuple(positions[(-x) % n] for x in range(n)), tuple(range(n))

    def events(self, topology: Topology, micro_batches: int, owner: tuple[int, ...], nbytes: dict[str, list[int]],
               rbytes: int, options: dict[str, Any]) -> tuple[Events, int]:
        return _events(topology.world_size, micro_batches, nbytes, rbytes)

    def table(self, plan: Plan) -> str:
        return _table(plan)

    def closed_form(self, dims: ModelDims, topology: Topology, micro_batches: int) -> tuple[float, float]:
        """The F-ring and B-ring weights and the gradient ring, (acc + 1)·Ψ each, every rank a
        sender of each; one rank has no ring."""
        n = topology.world_size
        v = (micro_batches + 1) * dims.decoder_numel * (2 * dims.dtype_bytes + dims.grad_bytes) if n > 1 else 0.0
        return v, (v if topology.nodes > 1 else 0.0)

    def staging(self, prefetch_depth: int, routed: bool) -> tuple[int, int]:
        return 1 + len(WEIPIPE_F_BUFS) + len(WEIPIPE_B_BUFS), 3  # w_own and both rings' pairs; the gradient ring


class WeiPhase(enum.IntEnum):
    """Work inside one WeiPipe step, in order (design §3.4)."""

    REPLICATED = 0
    LOAD = 1  # owners reload their chunk; seeding the B-ring with the own chunk
    GRAD_RING = 2  # the gradient partial sums move one hop (and the final delivery)
    RINGS = 3  # the F-ring and the B-ring move one hop (and the B-ring's seed exchange)
    COMPUTE = 4
    ACC = 5
    STATS = 6
    STEP = 7


def _f_active(n: int, acc: int, w: int, t: int) -> bool:
    return w <= t < w + acc * n


def _b_active(n: int, acc: int, w: int, t: int) -> bool:
    return w + n <= t < w + n + acc * n


def _ring_needs(n: int, acc: int, last: int) -> tuple[list[list[bool]], list[list[bool]]]:
    """need[t][w]: worker w must hold its F-ring (B-ring) chunk at step t, because it uses it or
    because a later worker on the ring will; the other ring transfers are dropped."""
    need_f = [[False] * n for _ in range(last + 2)]
    need_b = [[False] * n for _ in range(last + 2)]
    for t in range(last, -1, -1):
        for w in range(n):
            nxt = (w + 1) % n
            need_f[t][w] = _f_active(n, acc, w, t) or ((t + 1) % n != 0 and need_f[t + 1][nxt])
            need_b[t][w] = t >= n and (_b_active(n, acc, w, t) or need_b[t + 1][nxt])
    return need_f, need_b


def _events(n: int, acc: int, nbytes: dict[str, list[int]], rbytes: int) -> tuple[Events, int]:
    """Corrected WeiPipe-Interleave: three same-direction rings w -> w+1 (design §3.4).

    Step t = slot t. Ring transfers nobody consumes are dropped. Each chunk's gradient partial sum
    starts at worker 0 with a fresh buffer, collects one contribution per B, keeps moving along the
    ring until the last step and is then delivered by the exchange u <-> (N-1-u) mod N.
    """
    last = (acc + 2) * n - 2  # last compute step
    step_slot = last + 2
    everyone = tuple(range(n))
    out = Events(WeiPhase, frozenset({WeiPhase.GRAD_RING, WeiPhase.RINGS}))
    wb, gb = nbytes["w"], nbytes["g"]

    def f_active(w: int, t: int) -> bool:
        return _f_active(n, acc, w, t)

    def b_active(w: int, t: int) -> bool:
        return _b_active(n, acc, w, t)

    def fbuf(t: int) -> str:
        return W_OWN if t % n == 0 else WEIPIPE_F_BUFS[t % 2]

    def bbuf(t: int) -> str:
        return WEIPIPE_B_BUFS[t % 2]

    need_f, need_b = _ring_needs(n, acc, last)

    for r in everyone:
        out.add(WeiPhase.LOAD, new_action(-1, r, Op.LOAD_W, chunk=r, buf=W_OWN))
    for w in range(n):  # B-ring seed: w <-> (N+1-w) mod N, for use at step N
        if need_b[n][w]:
            c = (1 - w) % n
            if c == w:
                out.add(WeiPhase.LOAD, new_action(n - 1, w, Op.LOAD_W, chunk=c, buf=bbuf(n)))
            else:
                out.pair(WeiPhase.RINGS, n - 1, c, w, Op.SEND_W, Op.RECV_W, c, W_OWN, bbuf(n), wb[c])

    tokens: list[int | None] = [None] * n  # chunk of the partial sum each worker holds
    for t in range(last + 1):
        arriving = [tokens[(w - 1) % n] for w in range(n)]
        for w in range(n):
            nxt = (w + 1) % n
            if t < last and (t + 1) % n != 0 and need_f[t + 1][nxt]:
                c = (w - t) % n
                out.pair(WeiPhase.RINGS, t, w, nxt, Op.SEND_W, Op.RECV_W, c, fbuf(t), fbuf(t + 1), wb[c])
            if t >= n and t < last and need_b[t + 1][nxt]:
                c = (t - w + 1) % n
                out.pair(WeiPhase.RINGS, t, w, nxt, Op.SEND_W, Op.RECV_W, c, bbuf(t), bbuf(t + 1), wb[c])
            inc = arriving[w]
            if inc is not None:  # the partial sum from w-1's step t-1 arrives for this step
                prev = (w - 1) % n
                out.pair(WeiPhase.GRAD_RING, t, prev, w, Op.SEND_G, Op.RECV_G, inc, grad_buf((t - 1) % 2),
                         grad_buf(t % 2), gb[inc])
            if b_active(w, t):
                c = (t - w + 1) % n
                if inc is not None and inc != c:
                    raise AssertionError(f"gradient ring out of step at worker {w}, step {t}")
                out.add(WeiPhase.COMPUTE, new_action(t, w, Op.B, chunk=c, mb=(t - w - n) // n, buf=bbuf(t),
                                                 grad_buf=grad_buf(t % 2), accumulate=inc is not None))
                tokens[w] = c
            else:
                tokens[w] = inc
            if f_active(w, t):
                out.add(WeiPhase.COMPUTE, new_action(t, w, Op.F, chunk=(w - t) % n, mb=(t - w) // n, buf=fbuf(t)))
    final = last + 1  # each worker u holds the complete sum of chunk (-1-u) mod N
    for u, c in enumerate(tokens):
        if c is None:
            raise AssertionError(f"worker {u} holds no gradient at the end of the ring")
        if c == u:
            out.add(WeiPhase.ACC, new_action(final, u, Op.ACC_G, chunk=c, buf=grad_buf(last % 2)))
        else:
            out.pair(WeiPhase.GRAD_RING, final, u, c, Op.SEND_G, Op.RECV_G, c, grad_buf(last % 2), G_RECV, gb[c])
            out.add(WeiPhase.ACC, new_action(final, c, Op.ACC_G, chunk=c, buf=G_RECV))
    for w in range(n):  # right after the worker's last B (of chunk 0)
        out.add(WeiPhase.REPLICATED,
                new_action(w + n + acc * n, w, Op.ALLREDUCE_REPLICATED, group=everyone, bytes=rbytes))
    finish(out, WeiPhase.STEP, WeiPhase.STATS, n, step_slot)
    return out, step_slot + 1


def _table(plan: Plan) -> str:
    """Rows are steps; "⇒" lists what a worker sends: f/b ring weights, g partial sums (sent in
    the step after the B that produced them), seeds and the final gradient delivery. A plan of
    replicas shows replica 0's workers: the others run the same, shifted."""
    n, acc = plan.replica_size, plan.micro_batches
    per_rank = by_slot(plan)
    head = ["step"] + [f"worker {w}" for w in range(n)]
    lines = [table_row(head), "|" + "---|" * len(head)]
    for slot in range(0, plan.num_slots - 1):
        recv_bufs: dict[tuple[Op, int, int], deque[str]] = {}
        for w in range(n):
            for a in per_rank[w].get(slot, ()):
                if OPS[a.op].transfer == "recv":
                    recv_bufs.setdefault((a.op, a.peer, w), deque()).append(a.buf)
        row = [str(slot)]
        for w in range(n):
            acts = per_rank[w].get(slot, [])
            comps = sorted((a for a in acts if a.op in (Op.F, Op.B)), key=lambda a: a.op.value, reverse=True)
            words = [f"{a.op.value}:W{a.chunk}" + (f"(m{a.mb})" if acc > 1 else "") for a in comps]
            sends = []
            for a in acts:
                if a.op is Op.SEND_W:
                    rbuf = recv_bufs[(Op.RECV_W, w, a.peer)].popleft()
                    if rbuf in WEIPIPE_F_BUFS:
                        sends.append(f"f{a.chunk}")
                    elif a.buf == W_OWN:
                        sends.append(f"seed W{a.chunk}→{a.peer}")
                    else:
                        sends.append(f"b{a.chunk}")
                elif a.op is Op.SEND_G:
                    final = recv_bufs[(Op.RECV_G, w, a.peer)].popleft() == G_RECV
                    sends.append(f"final G{a.chunk}→{a.peer}" if final else f"g{a.chunk}")
            if sends:
                words.append("⇒ " + ",".join(sends))
            row.append(" ".join(words))
        lines.append(table_row(row))
    return "\n".join(lines)


register(WeiPipeSchedule())
