"""The host step in pieces (design §6.1): with the own chunk's state on the host, the step loads
each piece for the next iteration as soon as it is stepped. Stepping in pieces equals one step
bit for bit; the engine trains like one process with it; the next iteration's LOAD_W finds the
chunk loaded, and loads it again whenever the master or the buffer changed in between."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tawpipe.engine import TawPipe
from tawpipe.engine.engine import default_optimizer
from tawpipe.engine.host_step import pieces, step_in_pieces, steps_in_pieces
from tawpipe.plan.plan import STEP_PIECES
from tawpipe.plan.topology import Topology
from tawpipe.runtime.offload import HostOffload

from engine_cases import MB_ROWS, TinyLM, finished_norms, global_batch, lm_loss, make_engine, reference_run, rel_err
from test_engine_errors import NoComm


@pytest.mark.parametrize("seed", range(5))
def test_pieces_are_consecutive_runs_of_about_an_eighth(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([0, rng.randint(1, 1000)]) for _ in range(rng.randint(1, 60))] + [rng.randint(1, 9)]
    runs = pieces(sizes)
    assert runs[0][0] == 0 and runs[-1][1] == len(sizes)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(runs, runs[1:]))
    assert len(runs) <= min(STEP_PIECES, len(sizes)) and all(sum(sizes[i:j]) > 0 for i, j in runs)
    assert all(sum(sizes[i:j]) >= sum(sizes) / STEP_PIECES for i, j in runs[:-1])


def test_a_piece_never_loads_nothing():
    """An empty parameter last (its run would load no element, which HostOffload refuses) joins
    the run before it."""
    assert pieces([100, 0]) == [(0, 2)] and pieces([0, 5, 0, 0]) == [(0, 4)]
    assert pieces([8] * 8 + [0]) == [(i, i + 1) for i in range(7)] + [(7, 9)]
    assert pieces([1] * 9 + [0]) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]


OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-1),
    "default, two groups": default_optimizer,
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_stepping_in_pieces_equals_one_step_bit_for_bit(name):
    """Parameters of random shapes (a frozen one among them), random gradients, three steps: one
    optimizer steps them at once, another in random runs (some parameters outside every run);
    parameters and state agree exactly, every .grad is as it was, each run reported in order."""
    torch.manual_seed(hash(name) % 1000)
    shapes = [(7, 5), (5,), (3, 4, 2), (11,), (6, 6), (1,), (9, 3)]
    whole = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    whole[3].requires_grad_(False)
    split = [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in whole]
    train = [i for i, p in enumerate(whole) if p.requires_grad]
    a, b = OPTIMIZERS[name]([whole[i] for i in train]), OPTIMIZERS[name]([split[i] for i in train])
    assert steps_in_pieces(b)
    for step in range(3):
        for i in train:
            whole[i].grad = torch.randn(shapes[i])
            split[i].grad = whole[i].grad.clone()
        a.step()
        runs = [[split[0], split[2]], [split[3], split[4]], [split[6]]]  # 1 and 5 step with the first
        before = [p.grad for p in split]
        seen: list[int] = []
        step_in_pieces(b, runs, seen.append)
        assert seen == [0, 1, 2] and all(p.grad is g for p, g in zip(split, before))
        assert all(torch.equal(p, q) for p, q in zip(whole, split)), (name, step)
    for p, q in zip(whole, split):
        assert all(torch.equal(x, y) for x, y in zip(a.state[p].values(), b.state[q].values())
                   if torch.is_tensor(x))


def test_the_parameters_outside_the_runs_step_with_the_first_run_that_has_a_gradient():
    """Torch picks a step's implementation by the devices of the parameters it sees: the ones no
    run lists (the replicated, on the device) step with a run that has gradients, never alone."""
    ps = [torch.nn.Parameter(torch.randn(4)) for _ in range(4)]
    for p in ps[1:]:
        p.grad = torch.randn(4)
    opt = torch.optim.SGD(ps, lr=0.1)
    seen: list[list[int]] = []
    opt.register_step_pre_hook(lambda o, *_: seen.append([i for i, p in enumerate(ps) if p.grad is not None]))
    step_in_pieces(opt, [[ps[0]], [ps[1]], [ps[2]]], lambda i: None)  # ps[0]: no gradient; ps[3]: in no run
    assert seen == [[], [1, 3], [2]]


class CoupledAdamW(torch.optim.AdamW):
    """A subclass: it may couple its parameters, so the engine steps it at once."""


def test_only_per_parameter_optimizers_without_step_hooks_step_in_pieces():
    p = [torch.nn.Parameter(torch.randn(3))]
    assert steps_in_pieces(torch.optim.AdamW(p)) and steps_in_pieces(torch.optim.SGD(p, lr=0.1))
    assert not steps_in_pieces(CoupledAdamW(p)) and not steps_in_pieces(torch.optim.LBFGS(p))
    hooked = torch.optim.Adam(p)
    handle = hooked.register_step_post_hook(lambda *_: None)  # e.g. an EMA of the weights: once a step
    assert not steps_in_pieces(hooked)
    handle.remove()
    torch.optim.lr_scheduler.StepLR(hooked, 1)  # wraps step() to note the call: that is all it does
    assert steps_in_pieces(hooked)
    step = hooked.step
    hooked.step = lambda *a, **k: step(*a, **k)  # a wrapper of the user's: it would run once a piece
    assert not steps_in_pieces(hooked)
    handle = register_optimizer_step_pre_hook(lambda *_: None)
    try:
        assert not steps_in_pieces(hooked)
    finally:
        handle.remove()


def _loads(monkeypatch) -> list[tuple[int, int | None]]:
    """From now on, every HostOffload load's elements (start, stop), stop None for all of them."""
    loads: list[tuple[int, int | None]] = []
    load = HostOffload.load_weights_into

    def recorded(self, dst, start=0, stop=None):
        loads.append((start, stop))
        return load(self, dst, start, stop)

    monkeypatch.setattr(HostOffload, "load_weights_into", recorded)
    return loads


def _engine(model: TinyLM, k: int, optimizer=default_optimizer, **options) -> TawPipe:
    context = options.pop("block_context", model.context)
    return make_engine(model.blocks, model.embed, model.head, lm_loss, topology=Topology(1, 1), micro_batches=4,
                       optimizer=optimizer, comm=NoComm(1), block_context=context, offload_state=True,
                       mb_per_fetch=k, **options)


def _adamw(params, kind=torch.optim.AdamW):  # the tests' reference optimizer, fused: the engine's default kind
    return kind([{"params": list(params)}], lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6, fused=True)


@pytest.mark.parametrize("k", [4, 1])
def test_the_step_loads_each_piece_for_the_next_iteration_and_trains_like_one_process(monkeypatch, k):
    """World size 1, state on the host, clipping: three steps equal single-process training to
    1e-5 and, bit for bit, an optimizer the engine steps at once. Only the first step loads the
    whole chunk in its prologue; every step's STEP loads it a piece at a time for the next."""
    torch.manual_seed(0)
    model = TinyLM(5)
    ref, ref_losses = reference_run(model, 4 * MB_ROWS, 3, 0.05)
    loads = _loads(monkeypatch)
    engine = _engine(copy.deepcopy(model), k, _adamw, max_grad_norm=0.05)
    losses = [engine.step(global_batch(step, 4 * MB_ROWS)) for step in range(3)]
    sizes = [p.numel() for _, p in engine.own_parameters()]
    at, numel = [0, *itertools.accumulate(sizes)], sum(sizes)
    runs = [(at[i], at[j]) for i, j in pieces(sizes)]
    assert 1 < len(runs) <= STEP_PIECES and runs[-1][1] == numel
    assert loads == [(0, None), *runs * 3]
    want = dict(ref.named_parameters())
    assert max(rel_err(p.detach(), want[n].detach()) for n, p in engine.named_parameters()) <= 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)

    loads.clear()  # the same run with the optimizer stepped at once: its loads follow the whole step
    at_once = _engine(copy.deepcopy(model), k, lambda ps: _adamw(ps, CoupledAdamW),
                      max_grad_norm=0.05)
    assert [at_once.step(global_batch(step, 4 * MB_ROWS)) for step in range(3)] == losses
    assert loads == [(0, None), *[(0, numel)] * 3]
    got = dict(at_once.named_parameters())
    assert all(torch.equal(p, got[n]) for n, p in engine.named_parameters())
    engine.close()
    at_once.close()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("k", [1, 4])  # one addition to the host's accumulator per step, or four
def test_loads_carried_in_pieces_train_bit_for_bit_as_loads_where_the_plan_puts_them(device, k, monkeypatch):
    """bfloat16 compute (the cast, not a float32 copy), clipping, staging pieces of 257 elements
    (several per step piece): the engine carrying its loads against the same engine loading where
    the plan puts each LOAD_W, bit for bit. On CUDA each step's loads are held back on the GPU (a
    sleep queued after ``settle``), so a piece loaded before it was stepped, a load still reading
    the master when the next step writes it, or a read before the load lands, shows. Each step's
    norm of the own chunk, taken on its way to the host, is the accumulator's."""
    from tawpipe.plan.plan import Plan
    from tawpipe.runtime.executor import Executor

    dev = torch.device(device)
    monkeypatch.setitem(HostOffload.__init__.__kwdefaults__, "piece_numel", 257)
    if dev.type == "cuda":
        settle = Executor.settle

        def held_back(self) -> None:
            settle(self)
            torch.cuda._sleep(100_000_000)

        monkeypatch.setattr(Executor, "settle", held_back)
    norms = finished_norms(monkeypatch.setattr)
    torch.manual_seed(0)
    model = TinyLM(4)
    runs, loads = [], _loads(monkeypatch)
    for carry in (True, False):
        with monkeypatch.context() as patch:
            if not carry:
                patch.setattr(Plan, "carried_load", lambda self, rank: None)
            m = copy.deepcopy(model).to(dev)
            engine = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=4,
                                 comm=NoComm(1), device=dev, offload_state=True, mb_per_fetch=k,
                                 compute_dtype=torch.bfloat16, max_grad_norm=0.05,
                                 block_context=lambda t: {a: v.to(dev) for a, v in m.context(t).items()})
        loads.clear()
        losses = [engine.step(tuple(t.to(dev) for t in global_batch(s, 4 * MB_ROWS))) for s in range(3)]
        assert (loads[1] != (0, None)) == carry  # piece by piece after the first step's prologue, or whole
        runs.append((losses, {n: p.detach().cpu().clone() for n, p in engine.named_parameters()}))
        engine.close()
    (carried_losses, carried), (plain_losses, plain) = runs
    assert carried_losses == plain_losses and all(torch.equal(carried[n], plain[n]) for n in carried)
    assert len(norms) == 6 and all(a == pytest.approx(b, rel=2e-6) for a, b in norms), norms


class EmptyLast(torch.nn.Module):
    """A block whose last parameter has no element (its piece would load nothing)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(h, h, bias=False)
        self.tail = torch.nn.ParameterDict({"empty": torch.nn.Parameter(torch.zeros(0))})  # after lin's

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) * scale


def test_a_chunk_that_ends_in_an_empty_parameter_steps_in_pieces():
    """The last piece holds elements even where the last parameter has none: the engine trains,
    as the engine with its state on the device does."""
    torch.manual_seed(3)
    model = TinyLM(8, EmptyLast)
    engines = []
    for offload in (True, False):
        m = copy.deepcopy(model)
        engines.append(make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=4,
                                   comm=NoComm(1), block_context=m.context, offload_state=offload, mb_per_fetch=4))
        for step in range(2):
            engines[-1].step(global_batch(step, 4 * MB_ROWS))
    got = dict(engines[1].named_parameters())
    assert max(rel_err(p.detach(), got[n].detach()) for n, p in engines[0].named_parameters() if p.numel()) <= 1e-6
    for e in engines:
        e.close()


def test_what_changes_between_steps_is_loaded_again(monkeypatch):
    """The carried load serves the next step only if nothing changed since: a shard loaded back,
    weights changed in place through the parameters, an evaluation that used the buffer. Each
    such step loads the whole chunk again and trains as the engine without offload does."""
    torch.manual_seed(1)
    model = TinyLM(4)
    loads = _loads(monkeypatch)
    engine = _engine(copy.deepcopy(model), 4)
    m = copy.deepcopy(model)
    plain = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=4, comm=NoComm(1),
                        block_context=m.context, mb_per_fetch=4)

    def both(step: int) -> None:
        loads.clear()
        for e in (engine, plain):
            e.step(global_batch(step, 4 * MB_ROWS))

    def agree() -> float:
        got = dict(plain.named_parameters())
        return max(rel_err(p.detach(), got[n].detach()) for n, p in engine.named_parameters())

    both(0)
    saved = engine.state_dict()
    saved_plain = plain.state_dict()
    both(1)
    assert loads[0] != (0, None)  # the carried load served step 1
    engine.load_state_dict(saved)
    plain.load_state_dict(saved_plain)
    both(1)  # step 1 again, from the shard of step 0
    assert loads[0] == (0, None) and agree() <= 1e-6
    with torch.no_grad():
        for e in (engine, plain):
            dict(e.named_parameters())["blocks.2.up.weight"].mul_(-0.5)
    both(2)
    assert loads[0] == (0, None) and agree() <= 1e-6
    x, y = global_batch(9, 2 * MB_ROWS)
    assert engine.evaluate([(x, y)]) == pytest.approx(plain.evaluate([(x, y)]), rel=1e-6)
    both(3)
    assert loads[0] == (0, None) and agree() <= 1e-6
    engine.close()
    plain.close()


@pytest.mark.parametrize("topology, acc, options", [
    ((1, 1), 4, dict(mb_per_fetch=4)), ((1, 1), 4, {}), ((2, 2), 2, {}), ((1, 4), 2, dict(algo="weipipe")),
    ((2, 2), 4, dict(mb_per_fetch=2, prefetch_depth=2, reuse_weights=True)), ((2, 2), 2, dict(replicas=2)),
    ((3, 2), 2, dict(reuse_weights="host", prefetch_depth=1)), ((2, 2), 3, dict(algo="weipipe")),
    ((1, 4), 2, dict(prefetch_depth="resident", reuse_weights=True)), ((1, 4), 2, {}),
])
def test_which_ranks_the_step_loads_the_next_iterations_chunk_for(topology, acc, options):
    """Where the own chunk's first load of an iteration fills a buffer nothing before it touched,
    the step before carries it: every rank with several nodes (their own chunk's buffer ``w_own``),
    WeiPipe's (the same), world size 1, a node at the resident depth; on one node at depth 1, the
    ranks whose chunk comes first (0 and 1): the others' first load refills a buffer the iteration
    used already, and is made where the plan makes it."""
    from tawpipe.plan.schedule import build_plan

    plan = build_plan(Topology(*topology), 9, acc, **options)
    carries = []
    for rank in range(plan.topology.world_size):
        a = plan.carried_load(rank)
        loads = [x for x in plan.actions[rank] if x.op.name == "LOAD_W" and x.chunk == plan.own_chunk(rank)]
        assert a is None or (a is loads[0] and a.slot <= 0 and plan.actions[rank][-1].op.name == "STEP"), rank
        carries.append(a is not None)
    one_node_depth_1 = topology[0] == 1 and topology[1] > 2 and not options
    assert carries == ([True, True] + [False] * (topology[1] - 2) if one_node_depth_1 else [True] * len(carries))


def test_a_program_that_fills_the_carried_buffer_forgets_the_carried_load():
    """The rule ``evaluate`` runs its program under: one that writes the buffer the step loaded
    for the next one (the evaluation's, run through that buffer) forgets that load; one that
    touches neither it nor the master (the setup CHECK) keeps it."""
    from tawpipe.plan.programs import eval_program, setup_program
    from tawpipe.plan.schedule import build_plan

    plans = [build_plan(Topology(2, 2), 6, 2), build_plan(Topology(1, 4), 6, 2)]
    for plan, rank in [(p, r) for p in plans for r in range(4)][:6]:  # the one-node plan's ranks 0 and 1 carry one
        carried = plan.carried_load(rank)
        assert plan.leaves_carried(carried, setup_program(plan, 8)[rank])
        assert not plan.leaves_carried(carried, eval_program(plan, carried.buf)[rank])
        assert plan.leaves_carried(carried, [x for x in eval_program(plan, carried.buf)[rank]
                                              if x.op.name == "ALLREDUCE_EVAL"])


def _held_back(monkeypatch, seconds: float = 0.02) -> None:
    """Every piece's load waits ``seconds`` first, on the host and (on CUDA) on the stream it is
    queued on: a forward that reads a layer before its piece is loaded reads the weights before
    the step."""
    import time

    from tawpipe.engine.storage import ChunkStorage

    carry = ChunkStorage.carry

    def slow(self, start, stop):
        time.sleep(seconds)
        if self.device.type == "cuda":
            torch.cuda._sleep(int(seconds * 1e9))  # cycles: about `seconds` at 1 GHz
        carry(self, start, stop)

    monkeypatch.setattr(ChunkStorage, "carry", slow)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("recompute", ["layer", "block", "chunk"])
def test_the_host_steps_beside_the_next_forward_bit_for_bit_as_at_once(monkeypatch, recompute, device):
    """On a GPU the host steps the own chunk on a thread beside the next iteration (design §6.1);
    on a CPU it is forced here. Each piece's load is held back (on CUDA on its stream too). The
    next forward runs each layer once its piece is loaded, the pieces step with the learning rate
    the step began with (the scheduler has moved on), ``state_dict`` between steps waits for the
    step: three steps with clipping equal the engine stepping at once, bit for bit, state
    included."""
    import tawpipe.engine.update as update_module

    dev = torch.device(device)
    _held_back(monkeypatch)
    torch.manual_seed(0)
    model = TinyLM(4).to(dev)
    gated: list[int] = []
    gate = update_module.Update.gate
    monkeypatch.setattr(update_module.Update, "gate", lambda self, layer: (gated.append(layer), gate(self, layer))[1])
    runs = []
    for beside in (True, False):
        monkeypatch.setattr(update_module, "steps_beside", lambda device: beside)
        m = copy.deepcopy(model)
        engine = _engine(m, 1, _adamw, max_grad_norm=0.05, recompute=recompute, device=dev,
                         block_context=lambda t: {a: v.to(dev) for a, v in m.context(t).items()},
                         lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
        losses = [engine.step(tuple(t.to(dev) for t in global_batch(0, 4 * MB_ROWS)))]
        states = [engine.state_dict()]
        losses += [engine.step(tuple(t.to(dev) for t in global_batch(s, 4 * MB_ROWS))) for s in (1, 2)]
        states.append(engine.state_dict())
        runs.append((losses, states, {n: p.detach().clone() for n, p in engine.named_parameters()}))
        engine.close()
    (losses, states, params), (at_once_losses, at_once_states, at_once) = runs
    assert losses == at_once_losses
    assert all(torch.equal(p, at_once[n]) for n, p in params.items())
    for got, want in zip(states, at_once_states):
        assert got["params"].keys() == want["params"].keys()
        assert all(torch.equal(got["params"][n], want["params"][n]) for n in got["params"])
        for n, moments in want["optimizer"]["state"].items():
            assert all(torch.equal(got["optimizer"]["state"][n][k], v) for k, v in moments.items())
    assert gated == list(range(4))  # the third step's first forward (the second began after state_dict waited)


def test_a_failed_step_beside_fails_the_next_call(monkeypatch):
    """The host's step beside the next iteration fails in its third piece: the next call that
    needs it raises, naming it and its cause, and the engine refuses to go on."""
    import tawpipe.engine.host_step as host_step
    import tawpipe.engine.update as update_module

    monkeypatch.setattr(update_module, "steps_beside", lambda device: True)
    torch.manual_seed(0)
    engine = _engine(TinyLM(4), 1)
    stepping, calls = host_step._stepping, []

    def failing(optimizer, groups, params):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("host memory error")
        stepping(optimizer, groups, params)

    monkeypatch.setattr(host_step, "_stepping", failing)
    engine.step(global_batch(0, 4 * MB_ROWS))
    with pytest.raises(RuntimeError, match="host's step of the own chunk failed") as info:
        engine.state_dict()
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(RuntimeError, match="an earlier step failed"):
        engine.step(global_batch(1, 4 * MB_ROWS))
    engine.close()


BESIDE_CASES = [dict(nodes=2, acc=4, layers=6, offload_state=True, recompute=recompute, beside=True, max_grad_norm=0.05,
                     mb_per_fetch=k, prefetch_depth=1, reuse_weights=False)
                for recompute, k in (("layer", 1), ("block", 2), ("chunk", 4))]
BESIDE_CASES += [dict(nodes=2, acc=4, layers=4, offload_state=True, recompute="layer", beside=True, replicas=2),
                 dict(nodes=2, acc=2, layers=4, offload_state=True, recompute="layer", beside=True, algo="weipipe")]


def test_the_step_beside_on_four_ranks_trains_like_one_process():
    """The host's step beside the next iteration (a GPU's, forced on the CPU) on a 2x2 job over
    gloo: TawPipe at three k, replicas, WeiPipe, clipping. Each rank's first units that touch
    the stepped state wait for it; every rank's parameters and losses equal one process's."""
    from tawpipe.runtime.launch import run_local

    from engine_cases import exactness

    for rank_results in run_local(exactness, 4, BESIDE_CASES, timeout=300):
        for r in rank_results:
            assert r["param_err"] <= 1e-5, (r["case"], r["rank"], r["worst"], r["param_err"])
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], r["ref_losses"])), r["case"]
