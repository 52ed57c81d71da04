"""Forward and backward of one chunk for one micro-batch, on the weights a staging buffer holds.

The plan decides which chunk, which micro-batch and which buffers (design §4); this module only
runs the math. Activations are keyed by (position in the model, micro-batch): position 0 starts
from the embedding, the last position ends in the head and the loss, whose backward runs at
once so the micro-batch's backward can start in the next slot.

Recompute (design §6.2): with ``recompute="chunk"`` (the paper's setting) a forward keeps only the
chunk's input and the backward re-runs it with gradients on the weights then resident; with
``recompute="layer"`` the backward re-runs the chunk keeping only the layers' inputs, then
re-runs and back-propagates one layer at a time, so one layer's activations are alive at a time;
with ``recompute="block"`` the forward keeps every layer's input and the backward only re-runs
and back-propagates one layer at a time (torch's per-block checkpointing). With
``recompute="none"`` the forward keeps its graph; tensors it saves that alias its weight buffer
are stored as (offset, size, stride) and re-read at backward time from the buffer the plan names
for that backward, which holds the same chunk by then. No weight copy is kept and no saved tensor
points into a buffer being refilled.

A re-run draws what its forward drew (dropout masks): the forward records the random generators'
state where each re-run will start (the chunk's, or each layer's), and the re-run replays it under
``torch.random.fork_rng``, as ``torch.utils.checkpoint`` does, leaving the caller's generators as
they were.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.func import functional_call

from ..plan.actions import Action
from .activations import ActivationOffload
from .storage import ChunkStorage

Activation = tuple[int, int]  # (position in the model, micro-batch): where a chunk input or graph is kept
ChunkMb = tuple[int, int]  # (chunk id, micro-batch): which B action a forward's graph is for
RngState = tuple[torch.Tensor, torch.Tensor | None]  # the CPU generator's state, and the device's if CUDA


@dataclass
class StepState:
    """What one step's compute produces and consumes; built anew by every ``TawPipe.step``."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    ctx: list[dict[str, Any]]
    grad_scale: float  # loss scale / (N x micro-batches): the step's loss is a global mean
    loss_weights: list[float]  # each micro-batch's loss weight: 1, or its slice's share (context parallelism)
    x: dict[Activation, torch.Tensor] = field(default_factory=dict)  # chunk inputs, until their forward
    kept: dict[Activation, list[torch.Tensor]] = field(default_factory=dict)  # what a forward keeps for its backward
    dy: dict[Activation, torch.Tensor] = field(default_factory=dict)  # gradients of chunk outputs
    graphs: dict[Activation, tuple] = field(default_factory=dict)  # recompute="none"
    rng: dict[Activation, list[RngState]] = field(default_factory=dict)  # where each re-run starts drawing
    embed_rng: dict[int, RngState] = field(default_factory=dict)  # where each micro-batch's embedding drew


@dataclass
class EvalState:
    """What one validation pass (``TawPipe.evaluate``) carries from chunk to chunk."""

    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    ctx: list[dict[str, Any]]
    totals: torch.Tensor  # float64 (loss sum, batch count): this rank's until ALLREDUCE_EVAL, then everyone's
    loss_weights: list[float]  # as StepState's
    hidden: list[torch.Tensor] = field(default_factory=list)


def checked_loss(loss: object) -> torch.Tensor:
    """``loss_fn``'s result if it is what the engine needs, a scalar tensor with a gradient;
    otherwise a TypeError that says what it returned and what it must return."""
    must = ("loss_fn must return the loss as a scalar (0-d) torch tensor that depends on the logits "
            "(e.g. F.cross_entropy(logits.flatten(0, 1), targets.flatten()) with reduction='mean')")
    if not torch.is_tensor(loss):
        raise TypeError(f"{must}, but it returned a {type(loss).__name__} ({loss!r:.40}): return the tensor itself, "
                        "not .item() or a Python number")
    if loss.dim() != 0:
        raise TypeError(f"{must}, but it returned a tensor of shape {tuple(loss.shape)}: reduce it to one number "
                        "(.mean() over the tokens)")
    if not loss.requires_grad:
        raise TypeError(f"{must}, but it returned a tensor without a gradient (detached, or computed under "
                        "torch.no_grad()): compute it from the logits it is given")
    return loss


def weights_saved_by_reference(
    buf: torch.Tensor, backward_buf: Callable[[], torch.Tensor]
) -> torch.autograd.graph.saved_tensors_hooks:
    """Autograd hooks under which tensors saved for backward that alias `buf` are stored as
    (offset, size, stride) and read back from `backward_buf()` when the backward runs."""
    base, ptr = buf.storage_offset(), buf.untyped_storage().data_ptr()

    def pack(t: torch.Tensor):
        if t.device == buf.device and t.untyped_storage().data_ptr() == ptr:
            return ("weights", t.storage_offset() - base, t.size(), t.stride())
        return t

    def unpack(saved):
        if isinstance(saved, tuple) and saved and saved[0] == "weights":
            _, offset, size, stride = saved
            b = backward_buf()
            return b.as_strided(size, stride, b.storage_offset() + offset)
        return saved

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def rng_state(device: torch.device) -> RngState:
    """The random generators' state that a computation on ``device`` draws from."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextmanager
def replaying(state: RngState, device: torch.device) -> Iterator[None]:
    """The generators as they were at ``state``, the caller's restored after: a re-run draws what
    its forward drew."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class ChunkCompute:
    """F and B actions on real modules: the embedding and head are the user's (replicated)
    modules, the blocks run from staging buffers through meta-device templates."""

    def __init__(self, storage: ChunkStorage, embed: nn.Module, head: nn.Module,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 compute_dtype: torch.dtype, recompute: str, backward_of: dict[ChunkMb, Action],
                 head_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 activations: ActivationOffload | None = None) -> None:
        self.s, self.embed, self.head = storage, embed, head
        self.activations = activations  # where chunk inputs wait for their backward: None, the device
        # the head and the loss in one call: the user's fused one, or loss_fn of the head's logits
        self.head_loss = (functools.partial(head_loss, head) if head_loss is not None
                          else lambda hidden, targets: loss_fn(head(hidden), targets))
        self.dtype, self.recompute = compute_dtype, recompute
        self.last = len(storage.plan.chunk_layers) - 1
        self._backward_of = backward_of  # (chunk, mb) -> its B action, for recompute="none"
        self._backward_buf: torch.Tensor | None = None

    def _autocast(self):
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.s.device.type, dtype=self.dtype)

    def _run(self, chunk: int, x: torch.Tensor, leaves: list[torch.Tensor], ctx: dict[str, Any]) -> torch.Tensor:
        """The chunk's blocks on ``x``, their weights the tensors ``leaves``."""
        n = self.s.layers(chunk)
        params = {f"blocks.{name}": t for name, t in zip(self.s.layouts[n].names, leaves)}
        return functional_call(self.s.runners[n], params, (x, ctx))

    @torch.no_grad()
    def forward(self, a: Action, st: StepState, gate: Callable[[int], None] | None = None) -> None:
        """F; with ``gate`` (not under ``recompute="none"``) the chunk runs a layer at a time,
        ``gate(j)`` called before layer j reads its weights (the host still loading them)."""
        pos, m = self.s.position[a.chunk], a.mb
        if pos == 0:  # the backward runs the embedding again: it must draw what it drew here (dropout)
            st.embed_rng[m] = rng_state(self.s.device)
            st.x[(0, m)] = self.embed(st.inputs[m]).to(self.dtype)
        x = st.x.pop((pos, m))
        if self.recompute == "none":
            b = self._backward_of[(a.chunk, m)]
            leaves = self.s.leaves(a.buf, b.grad_buf, a.chunk)
            x = x.detach().requires_grad_()
            hooks = weights_saved_by_reference(self.s.bufs[a.buf], lambda: self._backward_buf)
            with torch.enable_grad(), hooks:
                y = self._run(a.chunk, x, leaves, st.ctx[m])
            st.graphs[(pos, m)] = (x, y)
        else:
            weights = self.s.weights(a.buf, a.chunk)
            st.rng[(pos, m)] = states = []
            if self.recompute == "block":  # every layer's input, kept: the backward need not re-run the chunk
                kept = self._layer_inputs(weights, x, st.ctx[m], last=True, states=states, gate=gate)
                y = kept.pop()
            elif gate is not None:
                states.append(rng_state(self.s.device))
                y, kept = x, [x]
                for j, params in enumerate(self.s.layer_params(weights)):
                    gate(j)
                    y = functional_call(self.s.layer_runner, params, (y, st.ctx[m]))
            else:
                states.append(rng_state(self.s.device))
                y, kept = self._run(a.chunk, x, weights, st.ctx[m]), [x]
            if self.activations is not None:  # read: to the host until its backward, each tensor on its own
                for j, x in enumerate(kept):
                    self.activations.store((pos, m, j), [x])
            else:
                st.kept[(pos, m)] = kept
        self.s.check_buffers_unchanged()
        if pos < self.last:
            st.x[(pos + 1, m)] = y.detach()
            return
        weight = st.loss_weights[m]
        if weight == 0:  # a slice whose targets are all ignored: no loss (cross_entropy's would be NaN)
            st.dy[(pos, m)] = torch.zeros_like(y)
            return
        with torch.enable_grad():  # the head and the loss, whose gradients go to `rep`
            y = y.detach().requires_grad_()
            with self._autocast():
                loss = checked_loss(self.head_loss(y, st.targets[m])) * weight
            (loss.float() * st.grad_scale).backward()
        self.s.loss_sum += loss.detach().double()
        st.dy[(pos, m)] = y.grad

    @torch.no_grad()
    def backward(self, a: Action, st: StepState, layer_done: Callable[[int], None] | None = None) -> None:
        """B; a backward that runs a layer at a time calls ``layer_done(j)`` once layer j's slice
        of the gradient buffer is whole (its work issued), last layer first."""
        pos, m = self.s.position[a.chunk], a.mb
        if self.s.scratch is not None or not self.s.accumulates(a):
            self.s.grad_target(a.grad_buf, a.chunk).zero_()
        if self.s.layerwise:
            input_of, states = self._inputs_of(a, (pos, m), st)
            dx = self._backward_by_layer(a, input_of, states, st.dy.pop((pos, m)), st.ctx[m], layer_done)
        else:
            if self.recompute == "none":
                x, y = st.graphs.pop((pos, m))
                self._backward_buf = self.s.bufs[a.buf]
            else:
                x = self._kept((pos, m), st)[0].detach().requires_grad_()
                with torch.enable_grad(), replaying(st.rng.pop((pos, m))[0], self.s.device):
                    y = self._run(a.chunk, x, self.s.leaves(a.buf, a.grad_buf, a.chunk), st.ctx[m])
            with torch.enable_grad():
                torch.autograd.backward(y, st.dy.pop((pos, m)))
            dx = x.grad
            self.s.harvest(a.grad_buf, a.chunk, self.s.accumulates(a))
        if pos > 0:
            st.dy[(pos - 1, m)] = dx
            return
        with torch.enable_grad(), replaying(st.embed_rng.pop(m), self.s.device):
            e = self.embed(st.inputs[m]).to(self.dtype)
            if e.requires_grad:
                e.backward(dx)

    def _kept(self, key: Activation, st: StepState) -> list[torch.Tensor]:
        """What the forward kept for this backward (its chunk input): on the device, or back from
        the host."""
        return self.activations.take((*key, 0)) if self.activations is not None else st.kept.pop(key)

    def _inputs_of(self, a: Action, key: Activation, st: StepState
                   ) -> tuple[Callable[[int], torch.Tensor], list[RngState]]:
        """Layer j's input for a layer-wise backward, asked last layer first, each let go once
        asked: with ``"block"`` as the forward kept them (from the host a layer at a time, the next
        one's coming meanwhile, so two are on the device, not a chunk's), with ``"layer"`` from the
        chunk's input run again (drawing what the forward drew); and where each layer's re-run
        starts drawing."""
        states = st.rng.pop(key)
        if self.recompute == "block" and self.activations is not None:
            return (lambda j: self.activations.take((*key, j))[0]), states
        if self.recompute == "block":
            return st.kept.pop(key).pop, states
        layer_states: list[RngState] = []
        with replaying(states[0], self.s.device):
            inputs = self._layer_inputs(self.s.weights(a.buf, a.chunk), self._kept(key, st)[0], st.ctx[key[1]],
                                        last=False, states=layer_states)
        return inputs.pop, layer_states

    def _layer_inputs(self, weights: list[torch.Tensor], x: torch.Tensor, ctx: dict[str, Any],
                      last: bool, states: list[RngState],
                      gate: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        """``x`` and each layer's output in turn, without gradients: every layer's input, and the
        chunk's output too where ``last``; ``states`` gets where each layer starts drawing;
        ``gate(j)`` runs before layer j."""
        inputs = [x]
        layers = self.s.layer_params(weights)
        for j, params in enumerate(layers):
            if gate is not None:
                gate(j)
            states.append(rng_state(self.s.device))
            if last or j < len(layers) - 1:
                inputs.append(functional_call(self.s.layer_runner, params, (inputs[-1], ctx)))
        return inputs

    def _backward_by_layer(self, a: Action, input_of: Callable[[int], torch.Tensor], states: list[RngState],
                           dy: torch.Tensor, ctx: dict[str, Any],
                           layer_done: Callable[[int], None] | None) -> torch.Tensor:
        """Each layer, last first, from its input (``input_of(j)``, ``_inputs_of``) run with
        gradients (drawing from ``states[j]``) and back-propagated at once, its weight gradient
        moved out of the one-layer scratch; the gradient of the chunk's input. Only one layer's activations and weight
        gradient are alive at a time."""
        run, scratch = self.s.layer_runner, self.s.scratch
        layers = self.s.layer_params(self.s.leaves(a.buf, a.grad_buf, a.chunk))
        for j in reversed(range(len(layers))):
            xj = input_of(j).detach().requires_grad_()
            if scratch is not None and j < len(layers) - 1:  # the last layer's: zeroed by backward()
                scratch.zero_()
            with torch.enable_grad(), replaying(states[j], self.s.device):
                torch.autograd.backward(functional_call(run, layers[j], (xj, ctx)), dy)
            self.s.harvest(a.grad_buf, a.chunk, self.s.accumulates(a), layer=j)
            if layer_done is not None:
                layer_done(j)
            dy = xj.grad
        return dy

    @contextmanager
    def eval_mode(self) -> Iterator[None]:
        """Every module a validation pass runs (the embedding, the chunk templates, the head) in
        eval mode, as ``model.eval()`` puts a plain model (dropout off, batch norms on their
        running statistics); each submodule's own mode comes back after, mixed modes included."""
        tops = [self.embed, self.head, *self.s.runners.values(), self.s.layer_runner]
        modes = [(m, m.training) for top in tops for m in top.modules()]
        try:
            for top in tops:
                top.eval()
            yield
        finally:
            for m, training in modes:
                m.training = training

    @torch.no_grad()
    def evaluate(self, a: Action, st: EvalState) -> None:
        """EVAL_F: every validation batch through one chunk, without gradients; after the last
        chunk, the head and the loss, added to the rank's loss sum."""
        pos = self.s.position[a.chunk]
        if pos == 0:
            st.hidden = [self.embed(x).to(self.dtype) for x in st.inputs]
        weights = self.s.weights(a.buf, a.chunk)
        st.hidden = [self._run(a.chunk, h, weights, c) for h, c in zip(st.hidden, st.ctx)]
        if pos == self.last:
            with self._autocast():
                for h, y, weight in zip(st.hidden, st.targets, st.loss_weights):
                    if weight == 0:  # a slice whose targets are all ignored (as in a step)
                        continue
                    loss = self.head_loss(h, y)
                    if not (torch.is_tensor(loss) and loss.dim() == 0):
                        checked_loss(loss)  # the same message as in a step (no gradient here: not asked)
                    st.totals[0] += loss.double() * weight
