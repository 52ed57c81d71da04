"""Unit tests of ``Precision``: loss scaling, global-norm clipping, non-finite steps, state."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tawpipe.engine.policy import PrecisionPolicy
from tawpipe.engine import precision
from tawpipe.engine.precision import NORM_PIECE, DynamicScaling, Precision, squared_norm


def _grads(seed: int, n_own: int = 37, n_rep: int = 11, mul: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_own, generator=g) * mul, torch.randn(n_rep, generator=g) * mul


def _step(p: Precision, own: torch.Tensor, rep: torch.Tensor, loss: float = 1.0, step: int = 0) -> bool:
    """One engine-like step on one rank: own-chunk stats, then ``finish`` (in place)."""
    return p.finish(step, Precision.local_stats(own, torch.tensor(loss)), loss, rep, own)


def _sgd(p: Precision, params: torch.Tensor, own: torch.Tensor, rep: torch.Tensor, loss: float) -> bool:
    """As the engine does: the optimizer steps only if ``finish`` says so."""
    ok = _step(p, own, rep, loss)
    if ok:
        params.grad = torch.cat([own, rep])
        torch.optim.SGD([params], lr=0.1).step()
    return ok


def test_local_stats_are_squared_norm_and_flag() -> None:
    """local_stats is [sum of squares in float64, 0/1 non-finite flag, loss sum]; on a host each
    piece's dot product is float32, so it agrees with a float64 reference to float32 rounding."""
    own, _ = _grads(0)
    loss = torch.rand((), dtype=torch.float32) * 10
    s = Precision.local_stats(own, loss)
    assert s.dtype == torch.float64
    assert s[0].item() == pytest.approx(own.double().square().sum().item(), rel=1e-6)
    assert s[1].item() == 0
    assert s[2].item() == loss.item()
    own[3] = float("inf")
    assert Precision.local_stats(own, loss)[1].item() == 1
    own[3] = float("nan")
    assert Precision.local_stats(own, loss)[1].item() == 1


def test_no_scaling_leaves_gradients_unchanged() -> None:
    """loss_scale=None: scale 1, gradients untouched, step taken."""
    p = Precision()
    assert p.scale == 1.0 and not p.dynamic
    own, rep = _grads(1)
    own0, rep0 = own.clone(), rep.clone()
    assert _step(p, own, rep)
    assert torch.equal(own, own0) and torch.equal(rep, rep0)


def test_static_scale_unscales_and_never_changes() -> None:
    """A static loss scale divides both gradient views by it and stays fixed over many steps."""
    p = Precision(loss_scale=128)
    for i in range(5):
        own, rep = _grads(10 + i, mul=128.0)
        ref_own, ref_rep = own / 128.0, rep / 128.0
        assert _step(p, own, rep)
        torch.testing.assert_close(own, ref_own)
        torch.testing.assert_close(rep, ref_rep)
    assert p.scale == 128.0 and p.skipped_steps == 0


def test_dynamic_scale_grows_after_interval() -> None:
    """Dynamic: the scale is multiplied by ``growth`` exactly every ``growth_interval`` good steps."""
    p = Precision(loss_scale="dynamic", init_scale=1024.0, growth=2.0, growth_interval=3)
    scales = []
    for i in range(7):
        own, rep = _grads(20 + i, mul=p.scale)
        ref = own / p.scale
        assert _step(p, own, rep)
        torch.testing.assert_close(own, ref)
        scales.append(p.scale)
    assert scales == [1024, 1024, 2048, 2048, 2048, 4096, 4096]


def test_the_policy_moves_a_dynamic_scale_as_its_scaling_says() -> None:
    """``PrecisionPolicy(scaling=DynamicScaling(...))``: the engine's numerics (``numerics()``, what
    ``TawPipe`` builds) start, grow and back off as asked, under float16's "auto" scaling."""
    p = PrecisionPolicy(torch.float16, scaling=DynamicScaling(init_scale=64.0, growth=4.0, backoff=0.25,
                                                              growth_interval=2)).numerics()
    assert p.dynamic and p.scale == 64.0
    scales = []
    for i in range(5):
        own, rep = _grads(40 + i, mul=p.scale)
        if i == 3:
            own[0] = float("inf")
        _step(p, own, rep)
        scales.append(p.scale)
    assert scales == [64.0, 256.0, 256.0, 64.0, 64.0]
    assert PrecisionPolicy(torch.float16).numerics().scale == 2.0**16  # torch's GradScaler's start
    assert PrecisionPolicy(torch.float32, loss_scale="dynamic",
                           scaling=DynamicScaling(init_scale=8.0)).numerics().scale == 8.0  # asked for
    for dtype, scale in ((torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float16, None),
                         (torch.float16, 128.0)):  # a scaling that nothing would move: refused, not ignored
        with pytest.raises(ValueError, match="moves a dynamic loss scale, and this policy's is"):
            PrecisionPolicy(dtype, loss_scale=scale, scaling=DynamicScaling(init_scale=8.0))
    with pytest.raises(TypeError, match="compute_dtype must be a torch.dtype, got 'bfloat16': pass e.g. torch.bfloat16"):
        PrecisionPolicy("bfloat16")


@pytest.mark.parametrize("scaling,message", [
    (dict(init_scale=0.0), "init_scale must be > 0"), (dict(growth=1.0), "growth must be > 1"),
    (dict(backoff=1.0), r"backoff must be in \(0, 1\)"), (dict(growth_interval=0), "growth_interval must be"),
    (dict(growth_interval=2.5), "growth_interval must be"), (dict(init_scale=True), "init_scale must be a finite"),
    (dict(growth=float("nan")), "growth must be a finite"),
])
def test_a_bad_dynamic_scaling_is_refused_naming_the_field(scaling, message) -> None:
    with pytest.raises(ValueError, match=message):
        DynamicScaling(**scaling)
    with pytest.raises(ValueError, match=message):  # Precision's own fields, the same checks
        Precision(loss_scale="dynamic", **scaling)
    with pytest.raises(ValueError, match="scaling must be a tawpipe.engine.precision.DynamicScaling"):
        PrecisionPolicy(scaling=scaling)


def test_dynamic_overflow_backs_off_and_skips() -> None:
    """Dynamic: an overflow halves the scale, skips, counts, and restarts the growth interval;
    this holds even with nonfinite='raise'."""
    p = Precision(loss_scale="dynamic", init_scale=256.0, growth_interval=2, nonfinite="raise")
    own, rep = _grads(30)
    assert _step(p, own, rep)  # good_steps = 1
    own, rep = _grads(31)
    own[5] = float("inf")
    own0, rep0 = own.clone(), rep.clone()
    assert not _step(p, own, rep)
    assert p.scale == 128.0 and p.skipped_steps == 1 and p.good_steps == 0
    assert torch.equal(rep, rep0) and torch.equal(own[:5], own0[:5])  # not unscaled when skipped
    own, rep = _grads(32)
    assert _step(p, own, rep) and p.scale == 128.0  # one good step is not yet an interval
    own, rep = _grads(33)
    assert _step(p, own, rep) and p.scale == 256.0


@pytest.mark.parametrize("scale", [None, 64.0])
@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e4])
def test_clipping_matches_torch(scale: float | None, max_norm: float) -> None:
    """Global-norm clipping over own + replicated gradients matches clip_grad_norm_ on unscaled copies."""
    p = Precision(loss_scale=scale, max_grad_norm=max_norm)
    own, rep = _grads(40, n_own=53, n_rep=17)
    refs = [own.clone().requires_grad_(), rep.clone().requires_grad_()]
    for r in refs:
        r.grad = r.detach().clone()
    norm = torch.nn.utils.clip_grad_norm_(refs, max_norm)
    s = scale or 1.0
    own.mul_(s)
    rep.mul_(s)
    assert _step(p, own, rep)
    torch.testing.assert_close(own, refs[0].grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(rep, refs[1].grad, rtol=1e-5, atol=1e-7)
    if max_norm < norm.item():  # actually clipped: the result has norm max_norm
        got = math.sqrt(own.double().square().sum().item() + rep.double().square().sum().item())
        assert got == pytest.approx(max_norm, rel=1e-5)


def test_clipping_uses_all_reduced_stats() -> None:
    """The norm comes from ``stats`` (other ranks' owned chunks) plus this rank's replicated part."""
    own_a, rep = _grads(50)
    own_b, _ = _grads(51)  # another rank's chunk
    stats = Precision.local_stats(own_a, torch.tensor(1.0)) + Precision.local_stats(own_b, torch.tensor(2.0))
    total = math.sqrt(stats[0].item() + rep.double().square().sum().item())
    p = Precision(max_grad_norm=total / 4)
    ref_own, ref_rep = own_a * (total / 4) / (total + 1e-6), rep * (total / 4) / (total + 1e-6)
    assert p.finish(0, stats, 1.0, rep, own_a)
    torch.testing.assert_close(own_a, ref_own)
    torch.testing.assert_close(rep, ref_rep)


def test_overflow_flag_in_stats_skips() -> None:
    """A non-finite flag in the all-reduced stats (another rank's overflow) skips, even with a finite norm."""
    p = Precision(loss_scale="dynamic", init_scale=8.0)
    own, rep = _grads(55)
    stats = Precision.local_stats(own, torch.tensor(1.0)) + torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    assert not p.finish(0, stats, 1.0, rep, own)
    assert p.scale == 4.0 and p.skipped_steps == 1


@pytest.mark.parametrize("where", ["loss", "own", "rep"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_skips_and_leaves_params(where: str, bad: float) -> None:
    """nonfinite='skip': a NaN/inf loss or gradient skips the step; parameters are untouched."""
    p = Precision(loss_scale=32.0, max_grad_norm=1.0)
    params = torch.randn(48, generator=torch.Generator().manual_seed(60)).requires_grad_()
    before = params.detach().clone()
    own, rep = _grads(61, n_own=37, n_rep=11)
    loss = bad if where == "loss" else 2.5
    if where != "loss":
        (own if where == "own" else rep)[2] = bad
    assert not _sgd(p, params, own, rep, loss)
    assert torch.equal(params.detach(), before)
    assert p.skipped_steps == 1 and p.scale == 32.0
    own, rep = _grads(62)  # the next good step does move the parameters
    assert _sgd(p, params, own, rep, 2.5)
    assert not torch.equal(params.detach(), before)
    assert p.skipped_steps == 1


@pytest.mark.parametrize("where", ["loss", "own", "rep"])
def test_nonfinite_raise(where: str) -> None:
    """nonfinite='raise' with static scaling raises FloatingPointError and leaves gradients as they were."""
    p = Precision(loss_scale=4.0, nonfinite="raise")
    own, rep = _grads(70)
    if where != "loss":
        (own if where == "own" else rep)[0] = float("nan")
    own0, rep0 = own.clone(), rep.clone()
    with pytest.raises(FloatingPointError, match="not finite"):
        _step(p, own, rep, loss=float("inf") if where == "loss" else 1.0, step=7)
    assert torch.equal(own[1:], own0[1:]) and torch.equal(rep[1:], rep0[1:])  # not unscaled


def test_state_dict_round_trip() -> None:
    """state_dict/load_state_dict carry scale and counters; the loaded object continues identically."""
    kw = dict(loss_scale="dynamic", init_scale=64.0, growth_interval=4)
    a = Precision(**kw)
    for i in range(3):
        _step(a, *_grads(80 + i))
    bad, rep = _grads(85)
    bad[0] = float("inf")
    _step(a, bad, rep)
    for i in range(3):
        _step(a, *_grads(90 + i))
    sd = a.state_dict()
    assert sd == {"scale": 32.0, "good_steps": 3, "skipped_steps": 1}
    b = Precision(**kw)
    b.load_state_dict(sd)
    assert b.state_dict() == sd
    _step(a, *_grads(95))
    _step(b, *_grads(95))
    assert a.state_dict() == b.state_dict() == {"scale": 64.0, "good_steps": 4, "skipped_steps": 1}


@pytest.mark.parametrize("kwargs", [
    dict(loss_scale=0), dict(loss_scale=-2.0), dict(loss_scale=float("inf")), dict(loss_scale=float("nan")),
    dict(loss_scale=True), dict(loss_scale="static"), dict(max_grad_norm=0.0), dict(max_grad_norm=-1.0),
    dict(max_grad_norm=float("nan")), dict(max_grad_norm=float("inf")), dict(nonfinite="ignore"),
    dict(init_scale=0.0), dict(growth=1.0), dict(backoff=0.0), dict(backoff=1.0), dict(growth_interval=0),
])
def test_invalid_arguments(kwargs: dict) -> None:
    """Invalid constructor arguments raise ValueError naming the argument."""
    name = next(iter(kwargs)).split("_")[0]
    with pytest.raises(ValueError, match=name):
        Precision(**kwargs)


@pytest.mark.parametrize("numel", [0, 7, 1 << 16, (1 << 16) + 3, 5 * (1 << 16) + 11])
def test_the_norm_of_a_gradient_is_summed_in_float64_without_a_copy(numel):
    """A gradient's squared norm: float32 norms of pieces, summed in float64, against a float64
    reference; no tensor the size of the gradient is made (a float64 copy and its square were the
    step's peak on a GPU); a non-finite element is flagged wherever it is."""
    g = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    with _Allocations() as made:
        sq, flag, _ = Precision.local_stats(g, torch.tensor(1.0))
    assert max(made.numels, default=0) <= max(3, numel // NORM_PIECE + 1)  # 3: the stats row
    assert sq.dtype == torch.float64 and flag == 0
    assert sq.item() == pytest.approx(g.double().square().sum().item(), rel=1e-6, abs=1e-6)
    if numel:
        g[numel - 1] = float("inf")
        assert Precision.local_stats(g, torch.tensor(1.0))[1] == 1
        g[0] = float("nan")
        assert Precision.local_stats(g, torch.tensor(1.0))[1] == 1


@pytest.mark.parametrize("numel", [5, 2 * NORM_PIECE, 5 * NORM_PIECE + 9])
def test_a_bfloat16_gradient_is_normed_a_slice_at_a_time_as_its_float32_values(monkeypatch, numel):
    """A bfloat16 gradient buffer (normed on the device before it goes to the host) gives the norm
    of its float32 values, the same pieces summed in float64; it is cast a slice at a time, so no
    float32 copy of the whole is made, and a non-finite element is still flagged."""
    monkeypatch.setattr(precision, "CAST_SLICE", NORM_PIECE * 2)  # several slices at small sizes too
    g = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).bfloat16()
    with _Allocations() as made:
        sq = squared_norm(g)
    assert max(made.numels) <= NORM_PIECE * 2
    assert sq.item() == pytest.approx(squared_norm(g.float()).item(), rel=1e-12)
    assert sq.item() == pytest.approx(g.double().square().sum().item(), rel=1e-5)  # float32 within a piece
    g[numel // 2] = float("inf")
    assert Precision.local_stats(g, torch.tensor(1.0))[1] == 1


class _Allocations(TorchDispatchMode):
    """The element counts of the tensors the ops under it make (views of their inputs left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        self.numels += [t.numel() for t in tree_flatten(out)[0]
                        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen]
        return out
