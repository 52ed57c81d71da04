"""Bad input fails with a clear message before any communication (no process group here)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from tawpipe.runtime.comm import Comm
from tawpipe.engine.engine import TawPipe
from tawpipe.plan.topology import Topology

from engine_cases import HIDDEN, TinyLM, lm_loss, make_engine


class NoComm(Comm):
    """A backend that fails the test if anything is communicated (world size 1 ops are local)."""

    def __init__(self, world_size: int) -> None:
        self.rank, self.world_size = 0, world_size

    def _local_only(self, group=(0,)):
        assert self.world_size == 1 and tuple(group) == (0,), "communication before validation"

    def send(self, tensor, peer):
        self._local_only(group=(0, peer))

    def recv(self, tensor, peer):
        self._local_only(group=(0, peer))

    def broadcast(self, tensor, root, group):
        self._local_only(group)

    def reduce(self, tensor, root, group):
        self._local_only(group)

    def all_reduce(self, tensor, group):
        self._local_only(group)

    def channel_comm(self, name):
        return self


def _make(layers=4, topo=Topology(2, 2), comm=None, **kw):
    torch.manual_seed(0)
    m = TinyLM(layers)
    return make_engine(m.blocks, m.embed, m.head, lm_loss, topology=topo, micro_batches=kw.pop("acc", 2),
                       comm=comm or NoComm(topo.world_size), block_context=m.context, **kw)


@pytest.mark.parametrize("kwargs, message", [
    (dict(layers=3), "layers"),
    (dict(acc=0), "micro"),
    (dict(compute_dtype=torch.float64), "compute_dtype"),
    (dict(recompute="selective"), "recompute"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"),
    (dict(loss_scale="sometimes"), "loss_scale"),
    (dict(loss_scale=float("inf")), "loss_scale"),
    (dict(max_grad_norm=float("nan")), "max_grad_norm"),
    (dict(nonfinite="ignore"), "nonfinite"),
    (dict(comm=NoComm(2)), "ranks"),
    (dict(grad_wire_dtype=torch.float16), "grad_wire_dtype"),
    (dict(mb_per_fetch=3), "mb_per_fetch=3 does not divide"),
    (dict(prefetch_depth=0), "prefetch_depth"),
    (dict(algo="weipipe", mb_per_fetch=2), "weipipe"),
    (dict(timeout=-1), "timeout"),
    (dict(names=("embed", "blocks")), "names"),
])
def test_bad_arguments(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        _make(**kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(topology=(2, 2)), TypeError, "topology must be a tawpipe.Topology"),
    (dict(comm="gloo"), ValueError, r"backend must be a tawpipe.runtime.comm.Comm or one of \(.torch., .nccl-native., .gloo-staged.\)"),
    (dict(loss_fn=None), TypeError, "loss_fn is required"),
    (dict(optimizer=torch.optim.AdamW([torch.zeros(1, requires_grad=True)])), TypeError, "optimizer must be callable"),
    (dict(block_context="rope"), TypeError, "block_context must be callable"),
    (dict(head=lambda x: x), TypeError, "head must be an nn.Module"),
])
def test_bad_argument_types(kwargs, error, message) -> None:
    torch.manual_seed(0)
    m = TinyLM(4)
    args = dict(blocks=m.blocks, embed=m.embed, head=m.head, loss_fn=lm_loss, topology=Topology(2, 2),
                micro_batches=2, comm=NoComm(4)) | kwargs
    positional = [args.pop(k) for k in ("blocks", "embed", "head", "loss_fn")]
    with pytest.raises(error, match=message):
        make_engine(*positional, **args)


def test_the_same_block_twice_is_refused() -> None:
    m = TinyLM(4)
    blocks = [m.blocks[0], m.blocks[1], m.blocks[0], m.blocks[3]]
    with pytest.raises(ValueError, match="blocks 0 and 2 share parameters"):
        make_engine(blocks, m.embed, m.head, lm_loss, topology=Topology(2, 2), micro_batches=1, comm=NoComm(4))
    with pytest.raises(TypeError, match=r"blocks\[1\] is a str"):
        make_engine([m.blocks[0], "block"], m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=1,
                    comm=NoComm(1))


def _single(loss_fn=lm_loss, **kw) -> tuple[TawPipe, torch.Tensor]:
    torch.manual_seed(0)
    m = TinyLM(2)
    eng = make_engine(m.blocks, m.embed, m.head, loss_fn, topology=Topology(1, 1), micro_batches=1,
                      comm=NoComm(1), block_context=m.context, **kw)
    return eng, torch.randint(0, 10, (2, 5))


def test_a_non_finite_loss_skips_the_step_and_leaves_everything_unchanged() -> None:
    nan_once = iter([float("nan")])

    def loss_fn(logits, targets):
        return lm_loss(logits, targets) * next(nan_once, 1.0)

    eng, x = _single(loss_fn)
    before = {n: p.detach().clone() for n, p in eng.named_parameters()}
    loss = eng.step((x, x))
    assert loss != loss and eng.skipped_steps == 1  # NaN reported, step skipped
    assert all(torch.equal(p, before[n]) for n, p in eng.named_parameters())
    assert not eng.optimizer.state  # no optimizer state was touched either
    assert eng.step((x, x)) > 0  # training goes on: a finite loss, and this time an update
    assert eng.skipped_steps == 1 and all(torch.isfinite(p).all() for _, p in eng.named_parameters())
    assert any(not torch.equal(p, before[n]) for n, p in eng.named_parameters())


def test_nonfinite_raise_names_the_step_and_a_failed_engine_refuses_at_once() -> None:
    eng, x = _single(lambda logits, targets: lm_loss(logits, targets) * float("inf"), nonfinite="raise")
    with pytest.raises(FloatingPointError, match="step 0: the loss"):
        eng.step((x, x))
    with pytest.raises(RuntimeError, match="an earlier step failed"):
        eng.step((x, x))


def test_bad_step_arguments_are_clear() -> None:
    eng, x = _single()
    with pytest.raises(TypeError, match="pair of tensors"):
        eng.step(x)
    with pytest.raises(TypeError, match="pair of tensors"):
        eng.step((x, [1, 2]))
    eng.step((x, x))  # a rejected call leaves the engine usable


def test_blocks_of_different_structure() -> None:
    m = TinyLM(4)
    blocks = list(m.blocks)
    blocks[2] = nn.Linear(HIDDEN, HIDDEN)
    with pytest.raises(ValueError, match="block 2 differs in structure"):
        make_engine(blocks, m.embed, m.head, lm_loss, topology=Topology(2, 2), micro_batches=1, comm=NoComm(4))
    with pytest.raises(ValueError, match="empty"):
        make_engine([], m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=1, comm=NoComm(1))


def test_bad_batch_and_resume_shard() -> None:
    eng = _make(layers=2, topo=Topology(1, 1), acc=2)
    x = torch.randint(0, 10, (3, 5))
    with pytest.raises(ValueError, match="multiple of micro_batches"):
        eng.step((x, x))
    with pytest.raises(ValueError, match="differ in shape"):
        eng.step((x[:2], x[:2, :4]))
    good = torch.randint(0, 10, (4, 5))
    loss = eng.step((good, good))  # a world of one still trains, with local-only collectives
    assert loss == loss and loss > 0
    state = eng.state_dict()
    state["chunk"] = 7
    with pytest.raises(ValueError, match="owns chunk"):
        eng.load_state_dict(state)
    eng.close()


def test_fp16_overflow_skips_the_step_and_backs_off() -> None:
    """Dynamic loss scaling: an overflowing step changes nothing and halves the scale, until
    steps fit in float16 again."""
    torch.manual_seed(0)
    m = TinyLM(2)
    huge = lambda logits, targets: 3e4 * lm_loss(logits, targets)  # noqa: E731
    eng = make_engine(m.blocks, m.embed, m.head, huge, topology=Topology(1, 1), micro_batches=1,
                      comm=NoComm(1), block_context=m.context, compute_dtype=torch.float16)
    before = {n: p.detach().clone() for n, p in eng.named_parameters()}
    x = torch.randint(0, 10, (2, 5))
    eng.step((x, x))
    assert eng.skipped_steps == 1
    assert all(torch.equal(p, before[n]) for n, p in eng.named_parameters())
    for _ in range(20):
        eng.step((x, x))
    assert 1 < eng.skipped_steps < 21  # backed off, then took steps
    assert any(not torch.equal(p, before[n]) for n, p in eng.named_parameters())
    eng.close()


def test_ranks_that_disagree_fail_at_construction_naming_rank_and_field() -> None:
    from tawpipe.runtime.launch import run_local

    from engine_cases import disagreements

    cases = [
        (dict(options=dict(compute_dtype=torch.bfloat16)), "compute_dtype"),
        (dict(seed=True), "replicated weights"),
        (dict(acc=True), r"micro_batches \(rank 0: 2, rank 2: 4\)"),
        (dict(options=dict(grad_route="leader")), "grad_route"),
        (dict(layers=True), r"num_layers \(rank 0: 4, rank 2: 5\)"),
        (dict(options=dict(max_grad_norm=1.0)), "precision"),
        (dict(frozen=True), "trainable parameters"),  # a rank that froze a parameter the others train
        (dict(buffers=True), "block buffers"),
    ]
    topology = (dict(topology=True), r"rank 2 has topology 1x4 but rank 0 has 2x2")
    results = run_local(disagreements, 4, [c for c, _ in cases] + [topology[0]], timeout=120)
    for rank, messages in enumerate(results):
        for (case, field), msg in zip(cases, messages):
            assert re.search(rf"rank 2 disagrees with rank 0 on {field}", msg), (rank, case, msg)
        assert re.search(topology[1], messages[-1]), (rank, messages[-1])


def test_meta_blocks_are_materialised_only_for_the_own_chunk() -> None:
    torch.manual_seed(0)
    real = TinyLM(4)
    with torch.device("meta"):
        meta_blocks = TinyLM(4).blocks
    asked = []

    def materialize(block, i):
        asked.append(i)
        return real.blocks[i]

    torch.manual_seed(0)
    eng = make_engine(meta_blocks, real.embed, real.head, lm_loss, topology=Topology(1, 1), micro_batches=1,
                      comm=NoComm(1), block_context=real.context, materialize=materialize)
    assert asked == [0, 1, 2, 3]  # a world of one owns every block
    ref = {f"blocks.{n}": p for n, p in real.blocks.named_parameters()}
    for n, p in eng.named_parameters():
        if n.startswith("blocks."):
            assert torch.equal(p.detach(), ref[n].detach()), n
    with pytest.raises(ValueError, match="block 0 is on the meta device: pass materialize"):
        make_engine(meta_blocks, real.embed, real.head, lm_loss, topology=Topology(1, 1), micro_batches=1,
                    comm=NoComm(1))


def test_a_wrong_plan_is_refused_before_anything_is_sent(monkeypatch) -> None:
    """The engine proves its plan before it connects: a schedule that would hand a compute the
    wrong chunk is a PlanError, not a silently wrong gradient."""
    import dataclasses

    from tawpipe.engine import engine as engine_module
    from tawpipe.plan.actions import Op, PlanError

    real = engine_module.engine_plan

    def broken(*args, **kwargs):
        plan, savers, why = real(*args, **kwargs)
        acts = list(plan.actions[1])
        i = next(i for i, a in enumerate(acts) if a.op is Op.F and a.chunk == 1)
        acts[i] = dataclasses.replace(acts[i], buf="w0" if acts[i].buf != "w0" else "w1")  # reads the other buffer
        return dataclasses.replace(plan, actions=(plan.actions[0], tuple(acts), *plan.actions[2:])), savers, why

    monkeypatch.setattr(engine_module, "engine_plan", broken)
    m = TinyLM(4)
    with pytest.raises(PlanError, match=r"rank 1 F W1 m0 .*holding W"):
        make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(2, 2), micro_batches=2, comm=NoComm(4))


# ------------------------------------------------------------------ shards that cannot be loaded


def _trained(seed: int, optimizer=None, lr_scheduler=None) -> TawPipe:
    """A fresh random world-of-one engine after one step (its optimizer has state)."""
    from engine_cases import adamw, global_batch

    torch.manual_seed(seed)
    m = TinyLM(4)
    eng = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=2, comm=NoComm(1),
                      block_context=m.context, optimizer=optimizer or adamw, lr_scheduler=lr_scheduler)
    eng.step(global_batch(seed, 4))
    return eng


def _engine_state(eng: TawPipe) -> dict:
    """Everything load_state_dict may change, copied."""
    import copy

    return copy.deepcopy({"params": {n: p.detach() for n, p in eng.named_parameters()},
                          "optimizer": eng.optimizer.state_dict(), "steps": eng.steps,
                          "precision": eng.precision.state_dict(),
                          "scheduler": eng.scheduler.state_dict() if eng.scheduler is not None else None})


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _exp_avg(state: dict) -> dict:
    state["optimizer"]["state"]["blocks.0.up.weight"]["exp_avg"] = torch.zeros(2)
    return state


_SCHEDULER = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)  # noqa: E731


@pytest.mark.parametrize("break_it, engine_kw, message", [
    (lambda s: s.pop("precision"), {}, r"the shard has no 'precision'; nothing was loaded: load the whole dict"),
    (lambda s: s.pop("steps"), {}, r"the shard has no 'steps'; nothing was loaded"),
    (lambda s: s.__setitem__("steps", "2"), {}, r"the shard's 'steps' is a str, not int"),
    (lambda s: s.__setitem__("precision", {"loss_scale": None}), {},
     r"the shard's 'precision' has no number 'scale' \(it holds \['loss_scale'\]\)"),
    (_exp_avg, {}, r"the shard's optimizer state 'exp_avg' of blocks.0.up.weight is \(2,\), but the parameter is "
                   r"\(71, 24\); nothing was loaded"),
    (lambda s: s["optimizer"]["state"].__setitem__("blocks.9.up.weight", {}), {},
     r"the shard's optimizer state names parameters this engine does not have: \['blocks.9.up.weight'\]"),
    (lambda s: s.__setitem__("scheduler", {"last_epoch": 3}), {},
     r"the shard holds a learning-rate scheduler's state, but this engine has no scheduler; nothing was loaded: "
     r"build the engine with the lr_scheduler"),
    (lambda s: None, {"lr_scheduler": _SCHEDULER},
     r"the shard has no learning-rate scheduler state, but this engine has a scheduler; nothing was loaded: "
     r"build the engine without lr_scheduler"),
])
def test_a_shard_that_cannot_be_loaded_whole_is_refused_before_anything_changes(break_it, engine_kw, message) -> None:
    """load_state_dict checks the whole shard first: a missing key, a moment of the wrong shape,
    a scheduler state without a scheduler (or the reverse) name the key and the fix, and the
    engine keeps its parameters, optimizer state, scheduler, loss scale and step, and trains on.
    (The parameters used to be copied before a missing key raised a bare KeyError.)"""
    import copy

    from engine_cases import global_batch

    shard = copy.deepcopy(_trained(0).state_dict())
    break_it(shard)
    eng = _trained(1, **engine_kw)
    before = _engine_state(eng)
    with pytest.raises(ValueError, match=message):
        eng.load_state_dict(shard)
    assert _same(_engine_state(eng), before)
    assert eng.step(global_batch(5, 4)) > 0  # not failed: it steps on


def test_a_shard_of_another_optimizer_is_refused_and_the_engine_trains_on() -> None:
    """An AdamW shard into an SGD engine loaded, and the next step died of KeyError 'momentum',
    leaving the engine failed for good: the shard's optimizer class (or, in a shard that does not
    record it, its groups' hyper-parameters) is compared first."""
    from engine_cases import global_batch

    shard = _trained(0).state_dict()
    assert shard["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    eng = _trained(1, optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    before = _engine_state(eng)
    with pytest.raises(ValueError, match=r"the shard's optimizer is a torch.optim.adamw.AdamW, this engine's a "
                                         r"torch.optim.sgd.SGD; nothing was loaded: build the engine with the "
                                         r"optimizer the shard was trained with"):
        eng.load_state_dict(shard)
    del shard["optimizer"]["class"]  # a shard that does not say
    with pytest.raises(ValueError, match=r"the shard's optimizer group 0 has hyper-parameters \[.*'betas'.*\] that "
                                         r"this engine's torch.optim.sgd.SGD does not know"):
        eng.load_state_dict(shard)
    assert _same(_engine_state(eng), before)
    assert eng.step(global_batch(5, 4)) > 0
