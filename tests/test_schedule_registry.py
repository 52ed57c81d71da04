"""A third schedule, registered here and nowhere else, in every tool (design §8.1).

``Gather`` is the simplest weight pipeline there is: every chunk, in model order, is broadcast by
its owner to every rank, which runs it for one micro-batch; the backward broadcasts it again and
reduces its gradient to the owner. Registering it is all it takes for ``tawpipe plan`` to build,
prove and print it, for the cost model to count it, for ``tawpipe simulate`` to play it and for
the engine to train with it, exactly.
"""

from __future__ import annotations

import copy
import enum
import re
from typing import Any

import pytest
import torch

from tawpipe import cli
from tawpipe.cost.memory import estimate_memory
from tawpipe.cost.traffic import estimate, methods, plan_traffic
from tawpipe.models.shape import ModelDims
from tawpipe.plan import registry
from tawpipe.plan.actions import G_RECV, W_OWN, Op, PlanError, grad_buf, new_action, weight_buf
from tawpipe.plan.events import Events, finish
from tawpipe.plan.schedule import build_plan
from tawpipe.plan.tables import by_slot, compute_word, table_row
from tawpipe.plan.topology import Topology
from tawpipe.plan.verify import verify
from tawpipe.runtime.launch import run_local
from tawpipe.sim import compare

from engine_cases import MB_ROWS, TinyLM, _engine, global_batch, reference_run, rel_err


class Phase(enum.IntEnum):
    REPLICATED = 0
    LOAD = 1
    FETCH = 2
    BCAST = 3
    COMPUTE = 4
    REDUCE = 5
    ROUTE = 6
    ACC = 7
    STATS = 8
    STEP = 9


class Gather(registry.Schedule):
    """Every node runs the same chunk in the same slot: the owner sends it to its rail peer in
    each other node, each node broadcasts it; a backward's gradient is reduced in each node and
    routed back to the owner. TawPipe without its stagger, prefetch or reuse."""

    name, title = "gather", "Gather"
    drop_route = False  # a broken variant, for verify to catch

    def events(self, topology: Topology, micro_batches: int, owner: tuple[int, ...], nbytes: dict[str, list[int]],
               rbytes: int, options: dict[str, Any]) -> tuple[Events, int]:
        n, everyone = topology.world_size, tuple(range(topology.world_size))
        out = Events(Phase, frozenset({Phase.FETCH, Phase.ROUTE}))
        for r in everyone:
            out.add(Phase.LOAD, new_action(-1, r, Op.LOAD_W, chunk=owner.index(r), buf=W_OWN))
        uses = [(Op.F, c) for c in range(n)] + [(Op.B, c) for c in reversed(range(n))]
        slot = 0
        for m in range(micro_batches):
            for op, c in uses:
                self._use(out, topology, slot, owner[c], c, nbytes, op is Op.B)
                out.computes(Phase.COMPUTE, slot, everyone, op, c, m, 1, weight_buf(0),
                             grad_buf(0) if op is Op.B else None)
                slot += 1
        for r in everyone:
            out.add(Phase.REPLICATED, new_action(slot, r, Op.ALLREDUCE_REPLICATED, group=everyone, bytes=rbytes))
        finish(out, Phase.STEP, Phase.STATS, n, slot)
        return out, slot + 1

    def _use(self, out: Events, topo: Topology, slot: int, o: int, c: int, nbytes: dict[str, list[int]],
             backward: bool) -> None:
        """Chunk ``c`` staged in every node for ``slot``; after a backward, its gradient home.
        Each node's gradient comes home in an order of its own: one receive buffer is reused."""
        for g in range(topo.nodes):
            members, peer = topo.group_ranks(g), topo.rank_of(g, topo.local_index(o))
            if topo.group_of(o) == g:
                out.add(Phase.LOAD, new_action(slot, o, Op.LOAD_W, chunk=c, buf=weight_buf(0)))
            else:
                out.pair(Phase.FETCH, slot, o, peer, Op.SEND_W, Op.RECV_W, c, W_OWN, weight_buf(0), nbytes["w"][c])
            if len(members) > 1:
                out.collective(Phase.BCAST, slot, Op.BCAST_W, members, peer, c, weight_buf(0), nbytes["w"][c])
            if not backward:
                continue
            if len(members) > 1:
                out.collective(Phase.REDUCE, slot, Op.REDUCE_G, members, peer, c, grad_buf(0), nbytes["g"][c],
                               order=g)
            if peer == o:
                out.add(Phase.ACC, new_action(slot, o, Op.ACC_G, chunk=c, buf=grad_buf(0)), order=g)
            elif not self.drop_route:
                out.pair(Phase.ROUTE, slot, peer, o, Op.SEND_G, Op.RECV_G, c, grad_buf(0), G_RECV, nbytes["g"][c],
                         order=g)
                out.add(Phase.ACC, new_action(slot, o, Op.ACC_G, chunk=c, buf=G_RECV), order=g)

    def table(self, plan) -> str:
        per_rank = by_slot(plan)
        lines = [table_row(["slot", "every rank"]), "|---|---|"]
        for slot in range(plan.num_slots - 1):
            lines.append(table_row([str(slot), "gather " + compute_word(per_rank[0].get(slot, []), 1)]))
        return "\n".join(lines)

    def closed_form(self, dims: ModelDims, topology: Topology, micro_batches: int) -> tuple[float, float]:
        """A chunk reaches the other n - 1 ranks twice per micro-batch, its gradient comes back
        once; a node sends its own chunks to, and the others' gradients from, the other nodes."""
        n, G = topology.world_size, topology.nodes
        volume = micro_batches * dims.decoder_numel * (2 * dims.dtype_bytes + dims.grad_bytes)
        return volume * (n - 1) / n, volume * (G - 1) / G

    def staging(self, prefetch_depth: int, routed: bool) -> tuple[int, int]:
        return 2, 1 + routed  # w_own and w0; g0 and g_recv


@pytest.fixture
def gather():
    schedule = Gather()
    registry.register(schedule)
    yield schedule
    registry.unregister(schedule.name)


def _plan(topology: Topology = Topology(2, 2), **options: Any):
    return build_plan(topology, 8, 2, algo="gather", layer_numel=1000, weight_bytes=2, grad_bytes=4,
                      replicated_numel=100, **options)


def test_tawpipe_plan_builds_proves_and_prints_it(gather, capsys):
    assert cli.main(["plan", "--algo", "gather", "--nodes", "2", "--per-node", "2", "--layers", "8",
                     "--micro-batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 0 | gather **F0** |" in out and "| 15 | gather **B0** |" in out  # its own table
    assert re.search(r"verified \(serial and channel models\): \d+ actions, \d+ P2P messages, \d+ collectives", out)
    assert cli.main(["plan", "--algo", "gather", "--nodes", "2", "--per-node", "2", "--model", "micro",
                     "--micro-batches", "2", "--no-table"]) == 0
    peers = capsys.readouterr().out.split("peers on the same model")[1]
    assert re.search(r"\n +gather +[\d.]+ GB", peers)  # counted from its plan beside the others


def test_verify_holds_it_to_the_rules(gather):
    report = verify(_plan())
    assert report.contributions == 4 * 4 * 2  # every rank's two micro-batches, to every chunk's owner
    gather.drop_route = True  # gradients that never reach their owner
    with pytest.raises(PlanError):
        verify(_plan())


def test_the_cost_model_counts_it(gather):
    dims = ModelDims(hidden=64, layers=8, heads=4, vocab=256)
    topo = Topology(2, 2)
    assert "gather" in methods()
    est = estimate("gather", dims, topo, 2)
    sent, inter = gather.closed_form(dims, topo, 2)
    ring = 2 * 3 / 4 * dims.replicated_numel * dims.grad_bytes  # the replicated modules' all-reduce
    assert (est.sent_per_rank, est.inter_node_per_node) == pytest.approx((sent + ring, inter + ring))
    plan = build_plan(topo, 8, 2, algo="gather", layer_numel=dims.layer_numel, weight_bytes=dims.dtype_bytes,
                      grad_bytes=dims.grad_bytes, replicated_numel=dims.replicated_numel)
    counted = plan_traffic(plan).total() / topo.world_size
    assert counted == pytest.approx(est.sent_per_rank, rel=0.3)  # a chain model against the plan's own bytes
    mem = estimate_memory(dims, topo, algo="gather")
    scratch = 2 * dims.layer_numel * dims.dtype_bytes  # a chunk's gradient in the compute dtype, then cast
    assert mem.staging == dims.layer_numel * 2 * (2 * dims.dtype_bytes + 2 * dims.grad_bytes) + scratch  # two of each


def test_tawpipe_simulate_plays_it(gather, capsys):
    assert "gather" in compare.methods()
    assert cli.main(["simulate", "--nodes", "2", "--per-node", "2", "--model", "micro", "--seq-len", "64",
                     "--methods", "gather", "weipipe", "ddp"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("gather "))
    assert re.search(r"\d+\.\d+s", row) and "not simulated" not in row


def _train_gather(rank: int, acc: int) -> dict:
    """The engine trains with the gather schedule (registered in this worker), against the
    single-process reference on the global batch."""
    registry.register(Gather())
    world = torch.distributed.get_world_size()
    topo = Topology(2, world // 2)
    torch.manual_seed(0)
    model = TinyLM(4)
    ref, _ = reference_run(model, world * acc * MB_ROWS, 2, None)
    engine = _engine(copy.deepcopy(model), topo, acc, algo="gather")
    rows = acc * MB_ROWS
    for step in range(2):
        x, y = global_batch(step, world * rows)
        engine.step((x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]))
    ref_params = dict(ref.named_parameters())
    worst = max(rel_err(p.detach(), ref_params[n].detach()) for n, p in engine.named_parameters())
    engine.close()
    return {"worst": worst}


def test_the_engine_trains_with_it_exactly():
    results = run_local(_train_gather, 4, 2, timeout=300)
    assert max(r["worst"] for r in results) < 1e-5
