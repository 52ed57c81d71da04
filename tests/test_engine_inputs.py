"""Bad input to the engine API ends in one clear exception that names the problem and the fix,
raised before anything is communicated where that is possible, and leaves the engine usable
where it was refused before a step ran ("nothing late, nothing silent")."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tawpipe.engine.engine as engine_module
from engine_cases import HIDDEN, TinyLM, VOCAB, lm_loss, make_engine
from tawpipe.engine.engine import TawPipe
from tawpipe.engine.inputs import MAX_PLAN_COMPUTE_ACTIONS
from tawpipe.engine.policy import CommPolicy
from tawpipe.engine.precision import Precision
from tawpipe.plan.topology import Topology
from test_engine_errors import NoComm


class NoConnect(NoComm):
    """A backend that fails the test if the engine even connects (its channels are asked for
    right after every argument check passed)."""

    def channel_comm(self, name):
        raise AssertionError("the engine connected before it refused its arguments")


def _build(topo=Topology(1, 1), layers=2, comm=None, loss_fn=lm_loss, embed=None, head=None, **kw) -> TawPipe:
    torch.manual_seed(0)
    m = TinyLM(layers)
    return make_engine(m.blocks, embed if embed is not None else m.embed, head if head is not None else m.head,
                       loss_fn, topology=topo, micro_batches=kw.pop("acc", 1), comm=comm or NoComm(topo.world_size),
                       block_context=m.context, **kw)


def _tokens(rows: int = 2, seq: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq))  # fresh every run: the checks must hold for any ids


def _params(eng: TawPipe) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in eng.named_parameters()}


# ---------------------------------------------------------------- 1. micro_batches


@pytest.fixture
def no_plan(monkeypatch):
    """Building the plan (``engine_plan``) fails the test: a huge micro_batches must be refused
    before any plan is built (without the check the test would fail here, not run out of memory)."""

    def built(*args, **kwargs):
        raise AssertionError(f"build_plan ran with micro_batches={args[2]}")

    monkeypatch.setattr(engine_module, "engine_plan", built)


@pytest.mark.parametrize("topo", [Topology(1, 1), Topology(2, 2)])
def test_huge_micro_batches_are_refused_before_the_plan_is_built(no_plan, topo) -> None:
    n = topo.world_size
    most = MAX_PLAN_COMPUTE_ACTIONS // (2 * n * n)
    for acc in (10**9, most + 1):
        with pytest.raises(ValueError, match=rf"micro_batches={acc} is too large: on {n} rank\(s\) the plan would "
                                             rf"hold at least [\d,]+ actions .* lower micro_batches to at most {most}"):
            _build(topo=topo, layers=4, acc=acc, comm=NoConnect(n))
    with pytest.raises(AssertionError, match=f"build_plan ran with micro_batches={most}"):
        _build(topo=topo, layers=4, acc=most, comm=NoConnect(n))  # the bound itself passes the check


@pytest.mark.parametrize("acc", [0, -3, 2.0, True, "4"])
def test_micro_batches_must_be_a_positive_integer(no_plan, acc) -> None:
    with pytest.raises(ValueError, match=re.escape(f"micro_batches must be a positive integer (micro-batches per "
                                                   f"rank and step), got {acc!r}")):
        _build(acc=acc, comm=NoConnect(1))


# ---------------------------------------------------------------- 2. device


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no CUDA device")
def test_cuda_on_a_cpu_only_torch_names_what_is_available() -> None:
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        with pytest.raises(ValueError, match=rf"device={re.escape(repr(device))} is not available: torch .* sees no "
                                             r"cuda device; available here: cpu$"):
            _build(device=device, comm=NoConnect(1))


def test_an_engine_device_other_than_the_current_one_names_the_call_that_fixes_it() -> None:
    """The engine orders its streams after the current device's current stream, so it runs on the
    current device (a torchrun worker sets it from LOCAL_RANK); the check itself needs no GPU."""
    from tawpipe.engine.inputs import check_current

    check_current(torch.device("cuda", 1), 1)
    with pytest.raises(ValueError, match=re.escape("device='cuda:1' is not this process's current cuda device "
                                                   "(cuda:0): the engine orders its streams after the current "
                                                   "device's; call torch.accelerator.set_device_index(1)")):
        check_current(torch.device("cuda", 1), 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_engine_refuses_a_device_that_is_not_current(monkeypatch) -> None:
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: torch.cuda.device_count())
    with pytest.raises(ValueError, match="is not this process's current cuda device"):
        _build(device="cuda:0", comm=NoConnect(1))


@pytest.mark.parametrize("device", ["nonsense", "gpu0", 3.5])
def test_a_device_that_is_no_device_names_what_is_available(device) -> None:
    available = "cpu" + "".join(f", cuda:{i}" for i in range(torch.cuda.device_count()))
    with pytest.raises(ValueError, match=rf"device={re.escape(repr(device))} is not a device: pass a torch.device "
                                         rf"or a name such as 'cpu' or 'cuda:0'; available here: {available}$"):
        _build(device=device, comm=NoConnect(1))


def test_the_meta_device_is_refused_as_the_engine_device() -> None:
    with pytest.raises(ValueError, match="device='meta': the engine cannot train on the meta device"):
        _build(device="meta", comm=NoConnect(1))


# ---------------------------------------------------------------- 3. optimizer and scheduler factories


@pytest.mark.parametrize("returned, name", [(None, "NoneType"), ([], "list"), ("adamw", "str")])
def test_an_optimizer_factory_must_return_an_optimizer(returned, name) -> None:
    with pytest.raises(TypeError, match=r"optimizer must be a factory that returns a torch.optim.Optimizer of the "
                                        rf"parameters it is given \(.*\), but it returned {name}: return the optimizer"):
        _build(optimizer=lambda params: returned)


def test_a_scheduler_factory_must_return_a_scheduler() -> None:
    with pytest.raises(TypeError, match=r"lr_scheduler must be a factory that returns a learning-rate scheduler .* "
                                        r"but it returned NoneType"):
        _build(lr_scheduler=lambda opt: None)


# ---------------------------------------------------------------- 4. step inputs


def _bad_batches() -> list[tuple[str, tuple[torch.Tensor, torch.Tensor], type, str]]:
    x, y = _tokens(), _tokens()
    high = int(torch.randint(VOCAB, 10 * VOCAB, ()))
    low = -int(torch.randint(1, 10 * VOCAB, ()))
    with_high, with_low, target_high = x.clone(), x.clone(), y.clone()
    with_high[1, int(torch.randint(0, 5, ()))] = high
    with_low[0, int(torch.randint(0, 5, ()))] = low
    target_high[int(torch.randint(0, 2, ())), int(torch.randint(0, 5, ()))] = high
    vocab = rf"outside the vocabulary of the embedding \(nn.Embedding with {VOCAB} ids: 0 to {VOCAB - 1}\)"
    return [
        ("float ids", (x.float(), y), TypeError,
         r"inputs are torch.float32, but they must be token ids of an integer dtype \(torch.int64\): convert them "
         r"with inputs.long\(\)"),
        ("int16 ids", (x.short(), y), TypeError, r"inputs are torch.int16, but the embedding \(nn.Embedding\) takes token ids of torch.int64 or "
                                                  r"torch.int32"),
        ("(B, S, 1)", (x[..., None], y[..., None]), ValueError,
         r"inputs have shape \(2, 5, 1\), but they must be 2-D token ids \(rows, seq_len\) with seq_len >= 1: drop "
         r"the last dimension"),
        ("1-D", (x[0], y[0]), ValueError, r"inputs have shape \(5,\), but they must be 2-D token ids .*pass inputs\[None\]"),
        ("empty rows", (x[:, :0], y[:, :0]), ValueError, r"inputs have shape \(2, 0\)"),
        ("id >= vocabulary", (with_high, y), ValueError, rf"inputs hold token id {high}, {vocab}"),
        ("negative id", (with_low, y), ValueError, rf"inputs hold token id {low}, {vocab}"),
        ("short targets", (x, y[:, :4]), ValueError,
         r"inputs \(2, 5\) and targets \(2, 4\) differ in shape: targets must be \(rows, seq_len\) like the inputs"),
        ("1-D targets", (x, y[0]), ValueError, r"inputs \(2, 5\) and targets \(5,\) differ in shape"),
        ("float targets", (x, y.float()), TypeError,
         r"targets are torch.float32, but targets shaped like the inputs \(rows, seq_len\) are class indices \(the "
         r"next tokens\), which cross_entropy takes as torch.int64 only: convert them with targets.long\(\) \(targets "
         r"of class probabilities have a class dimension: \(rows, seq_len, classes\)\)$"),
        ("int32 targets", (x.int(), y.int()), TypeError, r"targets are torch.int32, but .* targets.long\(\)"),
        ("target >= classes", (x, target_high), ValueError,
         rf"targets hold class {high}, outside the classes the head scores \(its last nn.Linear has {VOCAB} "
         rf"outputs: 0 to {VOCAB - 1}\); .*ignore_index -100, are left to loss_fn\)$"),
        ("rows", (x[:1], y[:1]), ValueError, r"batch has 1 rows, not a positive multiple of micro_batches=2"),
    ]


def test_bad_step_inputs_are_refused_before_the_step_and_the_engine_stays_exact() -> None:
    eng, twin = _build(acc=2), _build(acc=2)
    for what, batch, error, message in _bad_batches():
        before = _params(eng)
        with pytest.raises(error, match=r"^step\(batch\): " + message):
            eng.step(batch)
        assert eng.steps == 0 and all(torch.equal(p, before[n]) for n, p in _params(eng).items()), what
    x, y = _tokens(4), _tokens(4)
    assert eng.step((x, y)) == twin.step((x, y))  # the refusals left nothing behind
    assert all(torch.equal(p, _params(twin)[n]) for n, p in _params(eng).items())
    with pytest.raises(ValueError, match=r"^evaluate\(batches\): batches\[1\]: inputs hold token id"):
        eng.evaluate([(x, y), (x + VOCAB, y)])
    assert eng.evaluate([(x, y)]) == twin.evaluate([(x, y)])


def test_ignored_and_soft_targets_are_left_to_the_loss() -> None:
    """Negative targets (cross_entropy's ignore_index) and targets with a class dimension (class
    probabilities) pass the checks: they are the loss's business. int32 inputs are nn.Embedding's."""
    eng = _build()
    x, y = _tokens(), _tokens()
    y[0, int(torch.randint(0, 5, ()))] = -100
    assert eng.step((x.int(), y)) > 0
    soft = _build(loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten(0, 1)))
    assert soft.step((x, torch.softmax(torch.randn(2, 5, VOCAB), -1))) > 0


def test_targets_are_bounded_by_the_heads_classes_not_the_embeddings_vocabulary() -> None:
    """A head may score more classes than the embedding takes ids (or fewer): the targets are its
    classes. A head wider than the vocabulary trains on targets past it, and as plain torch does."""
    classes = VOCAB + int(torch.randint(1, 3 * VOCAB, ()))
    wide = nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, classes))
    eng = _build(head=copy.deepcopy(wide))
    torch.manual_seed(0)
    ref = TinyLM(2)  # the blocks and embedding _build made
    x, y = _tokens(), torch.randint(VOCAB, classes, (2, 5))
    loss = eng.step((x, y))
    h = ref.embed(x)
    for b in ref.blocks:
        h = b(h, **ref.context(x))
    assert loss == pytest.approx(lm_loss(wide(h), y).item(), rel=1e-5)
    y[1, int(torch.randint(0, 5, ()))] = classes
    with pytest.raises(ValueError, match=rf"targets hold class {classes}, .*has {classes} outputs: 0 to {classes - 1}\)"):
        eng.step((x, y))


class TableEmbed(nn.Module):
    """An embedding without nn.Embedding: the engine cannot know its vocabulary (it takes any id)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, HIDDEN))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids.remainder(VOCAB), self.table)


def test_without_an_nn_embedding_the_vocabulary_is_not_checked() -> None:
    eng = _build(embed=TableEmbed())
    x = _tokens() + VOCAB * int(torch.randint(1, 5, ()))  # ids this embed takes
    assert eng.step((x, _tokens())) > 0
    with pytest.raises(TypeError, match="inputs are torch.float32"):  # the rest still holds
        eng.step((x.float(), _tokens()))


# ---------------------------------------------------------------- 5. loss_fn


@pytest.mark.parametrize("loss_fn, message", [
    (lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="none"),
     r"but it returned a tensor of shape \(10,\): reduce it to one number"),
    (lambda logits, t: lm_loss(logits, t).item(),
     r"but it returned a float \([\d.]+\): return the tensor itself, not .item\(\) or a Python number"),
    (lambda logits, t: lm_loss(logits, t).detach(), r"but it returned a tensor without a gradient"),
])
def test_a_loss_fn_that_returns_no_scalar_tensor_is_named(loss_fn, message) -> None:
    """The loss is only seen when the last chunk's forward calls ``loss_fn``, inside the step, so
    that is where it is checked: calling ``loss_fn`` once more before the step (on what?) would cost
    a forward of the whole model and could still differ from what it returns in the step. The step
    then fails with a TypeError naming loss_fn and what it must return, and the engine refuses
    further steps as after any failed step (its buffers are mid-step)."""
    eng = _build(loss_fn=loss_fn)
    x, y = _tokens(), _tokens()
    with pytest.raises(TypeError, match=r"^loss_fn must return the loss as a scalar \(0-d\) torch tensor that "
                                        r"depends on the logits \(.*\), " + message):
        eng.step((x, y))
    with pytest.raises(RuntimeError, match=r"an earlier step failed \(TypeError\(.loss_fn must return"):
        eng.step((x, y))


def test_evaluate_names_a_loss_fn_that_returns_no_scalar() -> None:
    eng = _build(loss_fn=lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="none"))
    with pytest.raises(TypeError, match=r"^loss_fn must return the loss as a scalar .* shape \(10,\)"):
        eng.evaluate([(_tokens(), _tokens())])


# ---------------------------------------------------------------- 6. meta embed or head


@pytest.mark.parametrize("part", ["embed", "head"])
@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_meta_embed_or_head_is_named_before_connecting(part, device) -> None:
    with torch.device("meta"):
        meta = TinyLM(2)
    name = "'weight'" if part == "embed" else "'norm.weight'"
    where = r"the engine's device \(cpu\)" if device else r"the engine's device"
    with pytest.raises(ValueError, match=rf"^{part} parameter {name} is on the meta device: the embedding and head "
                                         rf"are replicated on every rank and must be real \(materialised\) float32 "
                                         rf"tensors on {where}; .*{part}.to_empty"):
        _build(comm=NoConnect(1), device=device, **{part: getattr(meta, part)})


def test_an_embed_of_another_dtype_is_named_before_connecting() -> None:
    with pytest.raises(ValueError, match=r"^embed parameter 'weight' is torch.float64 on cpu, but the embedding and "
                                         r"head must be float32 on the engine's device \(cpu\)"):
        _build(comm=NoConnect(1), embed=nn.Embedding(VOCAB, HIDDEN).double())


# ---------------------------------------------------------------- 7. max_grad_norm


@pytest.mark.parametrize("value", ["1.0", [1.0], True])
def test_max_grad_norm_of_the_wrong_type_is_named(value) -> None:
    message = rf"^max_grad_norm must be a number > 0 \(the global gradient norm to clip to\) or None, got " \
              rf"{re.escape(repr(value))} \(a {type(value).__name__}\): pass e.g. max_grad_norm=1.0$"
    with pytest.raises(TypeError, match=message):
        _build(max_grad_norm=value, comm=NoConnect(1))
    with pytest.raises(TypeError, match=message):
        Precision(max_grad_norm=value)


# ---------------------------------------------------------------- 8. a closed engine


def test_a_closed_engine_refuses_everything_that_communicates() -> None:
    eng = _build()
    x, y = _tokens(), _tokens()
    eng.step((x, y))
    eng.close()
    closed = r"^this engine was closed \(TawPipe.close\(\) was called\) and communicates no more: build a new TawPipe"
    for call in (lambda: eng.step((x, y)), lambda: eng.evaluate([(x, y)]), lambda: eng.gather_rows([1]),
                 eng.barrier, eng.full_state_dict):
        with pytest.raises(RuntimeError, match=closed):
            call()
    assert eng.state_dict()["steps"] == 1  # reading this rank's state needs no channel


# ---------------------------------------------------------------- 9. what the blocks hold


class Shared(nn.Module):
    """A block whose matrix is a parameter of the embedding or the head too."""

    def __init__(self, w: nn.Parameter) -> None:
        super().__init__()
        self.w = w

    def forward(self, x: torch.Tensor, **ctx) -> torch.Tensor:
        return x + torch.tanh(x @ self.w)


@pytest.mark.parametrize("part", ["embed", "head"])
def test_a_weight_shared_between_a_block_and_the_embedding_or_head_is_refused(part) -> None:
    """tawpipe shards the blocks and replicates embed and head: a weight in both would be untied."""
    torch.manual_seed(0)
    m = TinyLM(2)
    shared = nn.Parameter(torch.randn(HIDDEN, HIDDEN))
    getattr(m, part).register_parameter("mix", shared)
    blocks = [Shared(nn.Parameter(torch.randn(HIDDEN, HIDDEN))), Shared(shared)]
    with pytest.raises(ValueError, match=rf"^blocks\[1\] parameter 'w' is also {part} parameter 'mix': tawpipe "
                                         rf"shards the blocks .* keep the shared weight in {part} only, or give the "
                                         r"block its own copy \(nn.Parameter\(p.detach\(\).clone\(\)\)\)"):
        make_engine(blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=1, comm=NoConnect(1))


class Typed(nn.Module):
    """A block with one extra parameter of ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.extra = nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=dtype.is_floating_point)

    def forward(self, x: torch.Tensor, **ctx) -> torch.Tensor:
        return x + self.lin(x)


@pytest.mark.parametrize("dtype, message", [
    (torch.float64, r"block parameter 'extra' is torch.float64: tawpipe keeps the blocks' weights as float32 masters "
                    r".* from parameters of float32, bfloat16 or float16; convert the blocks first "
                    r"\(block.float\(\)\)$"),
    (torch.int64, r"block parameter 'extra' is torch.int64: tawpipe shards and trains floating-point parameters "
                  r"\(float32, bfloat16 or float16\) only; keep an integer or boolean constant as a buffer "
                  r"\(block.register_buffer\('extra', tensor\)\) instead$"),
])
def test_block_parameters_of_a_dtype_tawpipe_cannot_train_are_named(dtype, message) -> None:
    m = TinyLM(2)
    with pytest.raises(ValueError, match="^" + message):
        make_engine([Typed(dtype), Typed(dtype)], m.embed, m.head, lm_loss, topology=Topology(1, 1),
                    micro_batches=1, comm=NoConnect(1))


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(HIDDEN, HIDDEN), nn.BatchNorm1d(HIDDEN)

    def forward(self, x: torch.Tensor, **ctx) -> torch.Tensor:
        return x + self.bn(self.lin(x).transpose(1, 2)).transpose(1, 2)


def test_block_buffers_that_differ_or_change_are_refused_before_connecting() -> None:
    """One copy of the blocks' buffers serves every layer: per-layer values and BatchNorm's running
    statistics (which its forward changes) are refused, naming the fix."""
    from engine_cases import BufferBlock

    m = TinyLM(3, BufferBlock)
    with torch.no_grad():
        m.blocks[2].gain[int(torch.randint(0, HIDDEN, ()))] += 1.0
    with pytest.raises(ValueError, match=r"^block 2's buffer 'gain' differs from block 0's: tawpipe runs every layer "
                                         r"with one copy of the blocks' buffers, .* a frozen parameter "
                                         r"\(nn.Parameter\(tensor, requires_grad=False\)\), or pass it through "
                                         r"block_context$"):
        make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=1, comm=NoConnect(1))
    with pytest.raises(ValueError, match=r"^block module 'bn' is a BatchNorm1d that tracks running statistics: .* "
                                         r"build it with track_running_stats=False"):
        make_engine([Normed(), Normed()], m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=1,
                    comm=NoConnect(1))
    plain = TinyLM(2)
    with pytest.raises(ValueError, match=r"^block 1 differs in structure from block 0 \(buffer names"):
        make_engine([m.blocks[0], plain.blocks[1]], m.embed, m.head, lm_loss, topology=Topology(1, 1),
                    micro_batches=1, comm=NoConnect(1))


class Counting(nn.Module):
    """A block whose forward changes a buffer in place (a step counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor, **ctx) -> torch.Tensor:
        self.calls += 1
        return x + self.lin(x)


def test_a_block_that_changes_a_buffer_in_forward_fails_naming_it() -> None:
    """Only running it shows it: the step fails (the engine with it) naming the buffer, rather than
    train every layer on a counter they all share."""
    m = TinyLM(2)
    eng = make_engine([Counting(), Counting()], m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=1,
                      comm=NoComm(1))
    with pytest.raises(RuntimeError, match=r"^the blocks' forward changed their buffer 'calls' in place, but "
                                           r"tawpipe runs every layer with one copy of the blocks' buffers .* must be "
                                           r"constants"):
        eng.step((_tokens(), _tokens()))


def test_meta_blocks_take_their_buffers_from_the_materialised_ones() -> None:
    """Blocks built on the meta device have meta buffers: the own chunk's materialised blocks give
    the real ones, and training matches plain torch (float32, 1e-5)."""
    from engine_cases import BufferBlock, adamw, global_batch, rel_err, train_alone

    torch.manual_seed(int(torch.randint(0, 1000, ())))
    real = TinyLM(3, BufferBlock)
    with torch.device("meta"):
        meta = TinyLM(3, BufferBlock)
    ref, _ = train_alone(copy.deepcopy(real), lambda step: global_batch(step, 4), lm_loss, 2, None)
    eng = make_engine(meta.blocks, real.embed, real.head, lm_loss, topology=Topology(1, 1), micro_batches=2,
                      optimizer=adamw, comm=NoComm(1), block_context=real.context,
                      materialize=lambda block, i: real.blocks[i])
    for step in range(2):
        eng.step(global_batch(step, 4))
    ref_params = dict(ref.named_parameters())
    assert max(rel_err(p.detach(), ref_params[n].detach()) for n, p in eng.named_parameters()) <= 1e-5
    with pytest.raises(ValueError, match=r"^the blocks' buffer 'gain' is on the meta device in every block this rank "
                                         r"has: materialize\(block, layer\) must return the block with real buffers"):
        make_engine(meta.blocks, real.embed, real.head, lm_loss, topology=Topology(1, 1), micro_batches=1,
                    comm=NoComm(1), materialize=lambda block, i: block.to_empty(device="cpu").register_buffer(
                        "gain", torch.empty(HIDDEN, device="meta"), persistent=False) or block)


class _UncastBufferBlock(nn.Module):
    """A residual block that multiplies by its floating buffer as it is, without a cast: in a
    model put in bfloat16 the buffer is bfloat16 too, and the product stays in that dtype."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.register_buffer("gain", torch.linspace(0.5, 1.5, h), persistent=False)
        self.up = nn.Linear(h, 2 * h + 1)
        self.down = nn.Linear(2 * h + 1, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x * self.gain)))


def test_floating_block_buffers_are_in_the_compute_dtype() -> None:
    """The engine keeps the blocks' floating buffers in the compute dtype, as ``block.to(dtype)``
    puts them: a bfloat16 step's loss is plain torch's on the model's bfloat16 copy (a buffer left
    in float32 would promote the hidden states, and the next matmul would refuse them)."""
    seed = int(torch.randint(0, 10_000, ()))
    torch.manual_seed(seed)
    embed, head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
    blocks = nn.ModuleList(_UncastBufferBlock(HIDDEN) for _ in range(2))
    x = torch.randint(0, VOCAB, (4, 7))
    y = torch.randint(0, VOCAB, (4, 7))
    want = []
    low = copy.deepcopy(blocks).to(torch.bfloat16)
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        h = embed(xs).to(torch.bfloat16)
        for b in low:
            h = b(h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want.append(lm_loss(head(h), ys).item())
    eng = make_engine(blocks, embed, head, lm_loss, topology=Topology(1, 1), micro_batches=2, comm=NoComm(1),
                      compute_dtype=torch.bfloat16, loss_scale=None)
    got = eng.step((x, y))
    assert abs(got - sum(want) / 2) <= 1e-6 * abs(got), (seed, got, want)


def test_freezing_in_materialize_only_is_named() -> None:
    """Which parameters train is read from the blocks given (every rank has every layer's): a
    freeze that only materialize makes would be ignored on the other ranks, so it is refused."""
    real = TinyLM(2)
    with torch.device("meta"):
        meta = TinyLM(2)

    def materialize(block, i):
        real.blocks[i].up.weight.requires_grad_(False)
        return real.blocks[i]

    with pytest.raises(ValueError, match=r"^materialize\(block, 0\) returned the block with parameter 'up.weight' "
                                         r"frozen \(requires_grad=False\), but the block given has it trainable: .* "
                                         r"so freeze it there$"):
        make_engine(meta.blocks, real.embed, real.head, lm_loss, topology=Topology(1, 1), micro_batches=1,
                    comm=NoComm(1), materialize=materialize)


def test_a_model_or_rank_that_trains_nothing_is_refused_before_connecting() -> None:
    """Everything frozen: nothing to train. A rank whose chunk, embedding and head are all frozen
    gets an optimizer of no parameters, which ``torch.optim.AdamW(params)`` refuses: asked before
    connecting, and named."""
    from engine_cases import freeze

    m = TinyLM(2)
    m.requires_grad_(False)
    with pytest.raises(ValueError, match=r"^every parameter of the model has requires_grad=False: there is nothing "
                                         r"to train"):
        make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=1, comm=NoConnect(1))
    m = TinyLM(6)
    freeze(m, "replicated")  # layers 0 and 1 (the first chunk of four), embed and head
    with pytest.raises(ValueError, match=r"^rank\(s\) \[\d\] train nothing: every parameter of their chunk's layers "
                                         r"and of the embedding and head has requires_grad=False, so their optimizer "
                                         r"is given no parameters, but optimizer\(\[\]\) raised ValueError\("
                                         r".optimizer got an empty parameter list.\): make the factory take an "
                                         r"empty list"):
        make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(2, 2), micro_batches=1, comm=NoConnect(4),
                    optimizer=lambda params: torch.optim.AdamW(params))


# ---------------------------------------------------------------- 11. ranks that loaded different shards


def test_ranks_that_loaded_shards_of_different_steps_refuse_the_next_step() -> None:
    from tawpipe.runtime.launch import run_local

    from engine_inputs_cases import mixed_step_shards

    seed = int(torch.randint(0, 1000, ()))
    results = run_local(mixed_step_shards, 2, seed, timeout=120)
    for rank, out in enumerate(results):
        assert re.search(r"^the ranks loaded shards of different steps \(rank 0: step 2, rank 1: step 1\): rank\(s\) "
                         r"\[1\] differ from rank 0, .* load every rank's shard of the same checkpoint",
                         out["steps"]), (rank, out["steps"])
        assert re.search(r"^rank\(s\) \[1\] loaded another learning-rate scheduler state than rank 0, all at step 2",
                         out["scheduler"]), (rank, out["scheduler"])
        assert abs(out["resumed"] - out["loss3"]) <= 1e-6 * abs(out["loss3"]), (rank, out)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), True, "300"])
def test_comm_policy_refuses_a_timeout_no_wait_could_keep(timeout) -> None:
    """The engine's waits and the launcher's share one check (runtime.timeout.timeout_seconds)."""
    with pytest.raises(ValueError, match=rf"^timeout must be a number of seconds > 0 \(or None: \$TAWPIPE_TIMEOUT, "
                                         rf"else 300\), got {re.escape(repr(timeout))}$"):
        CommPolicy(timeout=timeout)
    seconds = float(torch.randint(1, 1000, ())) / 4
    assert _build(timeout=seconds).timeout == seconds
