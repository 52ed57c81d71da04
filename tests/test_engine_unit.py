"""Engine pieces that need no process group."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tawpipe.engine.compute import weights_saved_by_reference
from tawpipe.plan.actions import Hazards
from tawpipe.runtime.comm import Handle


def test_saved_weights_are_read_from_the_backward_buffer() -> None:
    torch.manual_seed(0)
    n_in, n_out = 7, 5
    fwd_buf = torch.randn(n_in * n_out + n_out + 3)
    bwd_buf = fwd_buf.clone()  # the plan re-fetches the same chunk into another buffer
    w = fwd_buf[3:3 + n_in * n_out].view(n_out, n_in).detach().requires_grad_()
    b = fwd_buf[3 + n_in * n_out:].detach().requires_grad_()
    x = torch.randn(4, n_in, requires_grad=True)
    with weights_saved_by_reference(fwd_buf, lambda: bwd_buf):
        y = torch.tanh(F.linear(x, w, b)) * w.sum()
    fwd_buf.fill_(float("nan"))  # the forward buffer is refilled with another chunk
    dy = torch.randn_like(y)
    y.backward(dy)

    wr = bwd_buf[3:3 + n_in * n_out].view(n_out, n_in).clone().requires_grad_()
    br = bwd_buf[3 + n_in * n_out:].clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    (torch.tanh(F.linear(xr, wr, br)) * wr.sum()).backward(dy)
    for got, ref in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_hazards_order_writers_after_readers() -> None:
    h_write, h_read1, h_read2, h_write2 = (Handle.completed(label=s) for s in "abcd")
    hz = Hazards()
    hz.record(h_write, (), ("w0",))
    assert hz.deps(("w0",), ()) == [h_write]  # read after write
    hz.record(h_read1, ("w0",), ())
    hz.record(h_read2, ("w0",), ())
    deps = hz.deps((), ("w0",))  # write after read: the last writer and both readers
    assert set(map(id, deps)) == {id(h_write), id(h_read1), id(h_read2)}
    hz.record(h_write2, (), ("w0",))
    assert hz.deps(("w0",), ()) == [h_write2]
    assert hz.deps(("g0",), ("g1",)) == []
