"""What the memory savers keep alive and what they move: recomputing a chunk a layer at a time
holds one layer's activations in its backward, where recomputing the whole chunk holds every
layer's (design §6.2); the bytes host offload moves are the cost model's. Exactness against
single-process training is in test_engine and test_replicas."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

from tawpipe.cost.memory import Savers, rank_memory
from tawpipe.plan.topology import Topology

from engine_cases import (HIDDEN, MB_ROWS, SEQ, TinyLM, adamw, finished_norms, global_batch, host_accumulator, lm_loss,
                          make_engine, record_norms, reference_run, rel_err)
from test_engine_errors import NoComm


class SavedBytes:
    """Saved-for-backward tensors of the blocks, each a copy owned by autograd alone, counted
    while alive: the peak is what a backward holds at once."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        owned = t.detach().clone()
        self.live += owned.nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(owned, self._freed, owned.nbytes)
        return owned

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def block_forward(self, block, hidden, **ctx):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            return block(hidden, **ctx)


def _peak(recompute: str, layers: int, steps: int = 1, **options) -> tuple[float, dict[str, torch.Tensor], dict]:
    """The peak saved bytes of ``steps`` steps on one rank whose one chunk has ``layers`` layers,
    the parameters after them and the engine's staging buffers."""
    torch.manual_seed(0)
    model = TinyLM(layers)
    saved = SavedBytes()
    engine = make_engine(copy.deepcopy(model).blocks, model.embed, model.head, lm_loss, topology=Topology(1, 1),
                         micro_batches=2, comm=NoComm(1), block_context=model.context,
                         block_forward=saved.block_forward, recompute=recompute, **options)
    for step in range(steps):
        engine.step(global_batch(step, 2 * MB_ROWS))
    params = {n: p.detach().clone() for n, p in engine.named_parameters()}
    staging = engine.memory_report().staging
    engine.close()
    return saved.peak, params, staging


@pytest.mark.parametrize("recompute", ["layer", "block"])
def test_a_layer_at_a_time_holds_one_layers_activations(recompute):
    """"layer" re-runs the chunk for its layers' inputs, "block" kept them from the forward:
    either way the backward holds one layer's activations."""
    layers = 8
    chunk, chunk_params, _ = _peak("chunk", layers)
    layer, layer_params, _ = _peak(recompute, layers)
    one_layer = chunk / layers  # the blocks are alike: each saves the same
    assert layer == pytest.approx(one_layer, rel=0.05), (chunk, layer)
    for name, p in chunk_params.items():  # the same update, computed a layer at a time
        torch.testing.assert_close(layer_params[name], p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("recompute", ["layer", "block"])
def test_a_layer_at_a_time_casts_its_gradient_through_one_layers_scratch(recompute):
    """In bfloat16 a chunk's gradient is born in a compute-dtype scratch and cast into the float32
    buffer: a layer at a time, the scratch holds one layer (a chunk's with "chunk") and the
    updates after 3 steps are those of recomputing the chunk whole."""
    layers = 8
    _, chunk_params, chunk_staging = _peak("chunk", layers, steps=3, compute_dtype=torch.bfloat16)
    _, layer_params, layer_staging = _peak(recompute, layers, steps=3, compute_dtype=torch.bfloat16)
    assert layer_staging["scratch"] * layers == chunk_staging["scratch"] == chunk_staging["w0"], chunk_staging
    for name, p in chunk_params.items():
        torch.testing.assert_close(layer_params[name], p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("recompute", ["chunk", "layer"])
def test_k_micro_batches_add_their_gradients_once_through_the_scratch(recompute):
    """bfloat16 compute, float32 gradient buffers, k = 2: each micro-batch's chunk gradient is born
    in the compute-dtype scratch and added into the buffer once. One step of SGD (lr 1) moves every
    block weight by plain torch's gradient of the bfloat16 model, summed over the micro-batches in
    float32 (a scratch left holding the first micro-batch's would count it twice)."""
    seed = int(torch.randint(0, 10_000, ()))
    torch.manual_seed(seed)
    model = TinyLM(2)
    x, y = global_batch(seed, 2 * MB_ROWS)
    low = copy.deepcopy(model.blocks).to(torch.bfloat16)
    want = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in low.named_parameters()}
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        h = model.embed(xs).detach().to(torch.bfloat16)
        for b in low:
            h = b(h, **model.context(xs))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model.head(h), ys)
        (loss.float() / 2).backward()
        for n, p in low.named_parameters():
            want[n] += p.grad.float()
            p.grad = None
    before = {f"blocks.{n}": p.detach().clone() for n, p in model.blocks.named_parameters()}
    engine = make_engine(model.blocks, model.embed, model.head, lm_loss, topology=Topology(1, 1), micro_batches=2,
                         comm=NoComm(1), block_context=model.context, compute_dtype=torch.bfloat16,
                         grad_wire_dtype=torch.float32, mb_per_fetch=2, recompute=recompute,
                         optimizer=lambda params: torch.optim.SGD(params, lr=1.0))
    engine.step((x, y))
    for n, p in engine.named_parameters():
        if n in before:
            moved, grad = before[n] - p.detach(), want[n.removeprefix("blocks.")]
            assert ((moved - grad).norm() / grad.norm()).item() <= 1e-2, (seed, n)
    engine.close()


@pytest.mark.parametrize("recompute", ["none", "chunk", "layer", "block"])
@pytest.mark.parametrize("k", [1, 2])
def test_alone_in_its_replica_a_rank_adds_its_gradients_into_the_accumulator(k, recompute):
    """World size 1: with the accumulator on the device and float32 gradients the backwards add
    into it, no gradient buffer is allocated, and the cost model counts none; with the state on
    the host the plan's buffer is back. Both train like one process, clipped, over 4 micro-batches
    at k per fetch (the first backward of a fetch must add too: the accumulator already holds the
    fetches before)."""
    torch.manual_seed(int(torch.randint(0, 10_000, ())))
    model = TinyLM(3)
    ref, ref_losses = reference_run(model, 4 * MB_ROWS, 3, 0.05)
    want = dict(ref.named_parameters())
    for offload_state in (False, True):
        m = copy.deepcopy(model)
        engine = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=4,
                             optimizer=adamw, comm=NoComm(1), block_context=m.context, offload_state=offload_state,
                             mb_per_fetch=k, max_grad_norm=0.05, recompute=recompute)
        losses = [engine.step(global_batch(step, 4 * MB_ROWS)) for step in range(3)]
        staging = engine.memory_report().staging
        assert sorted(n for n in staging if n.startswith("g")) == (["g0"] if offload_state else []), staging
        est = rank_memory(engine.plan, 0, chunk_numel=[engine.memory_report().master // 4], replicated_numel=0,
                          weight_bytes=4, grad_bytes=4, scratch_bytes=0,
                          savers=Savers(recompute, offload_state=offload_state))
        assert est.staging == sum(staging.values())
        assert max(rel_err(p.detach(), want[n].detach()) for n, p in engine.named_parameters()) <= 1e-5
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        engine.close()


def _moved(rank: int, case: dict) -> dict:
    """The second step with host offload, an iteration as every later one runs (the first also
    loads the own chunk in its prologue, which the steps after it find loaded by the step before):
    the bytes the engine moved with the host, and the cost model's."""
    from tawpipe.cost.memory import Savers, host_bytes

    world = torch.distributed.get_world_size()
    topo = Topology(2, world // 2)
    torch.manual_seed(0)
    model = TinyLM(case["layers"])
    engine = make_engine(model.blocks, model.embed, model.head, lm_loss, topology=topo, micro_batches=case["acc"],
                         block_context=model.context, **case["options"])
    rows = case["acc"] * MB_ROWS
    x, y = global_batch(0, world * rows)
    mine = (x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
    engine.step(mine)
    first = engine.host_traffic()
    engine.step(mine)
    moved = tuple(b - a for a, b in zip(first, engine.host_traffic()))
    savers = Savers(**{k: v for k, v in case["options"].items() if k in ("recompute", "offload_state",
                                                                          "offload_activations")})
    own = sum(p.numel() for _, p in engine.own_parameters())
    inputs = MB_ROWS * x.shape[1] * HIDDEN * 4  # a chunk input: rows x seq x hidden, float32
    expected = host_bytes(engine.plan, rank, own_numel=own, weight_bytes=4, grad_bytes=4, input_bytes=inputs,
                          savers=savers)
    engine.close()
    return {"moved": moved, "expected": expected}


@pytest.mark.parametrize("options", [dict(offload_state=True), dict(offload_activations=True),
                                     dict(offload_state=True, offload_activations=True, recompute="layer",
                                          mb_per_fetch=2),
                                     dict(offload_activations=True, recompute="block"),  # every layer's input
                                     # fetched chunks stashed and restored, k = 1 (restores in every round)
                                     dict(reuse_weights="host", prefetch_depth=1, mb_per_fetch=1),
                                     dict(reuse_weights="host", prefetch_depth=1, mb_per_fetch=2, offload_state=True)])
def test_the_bytes_moved_with_the_host_are_the_cost_models(options):
    from tawpipe.runtime.launch import run_local

    results = run_local(_moved, 4, dict(layers=6, acc=2, options=options), timeout=240)
    for r in results:
        assert r["moved"][0] > 0 and r["moved"][1] > 0
        assert r["moved"] == pytest.approx(r["expected"], rel=0, abs=0), r


@pytest.mark.parametrize("recompute", ["chunk", "layer"])
@pytest.mark.parametrize("k", [4, 1])
def test_with_state_on_the_host_the_gradient_is_normed_on_its_way_there(monkeypatch, k, recompute):
    """World size 1 with state offload: the host never reads its accumulator for the norm
    (clipping, the non-finite check). At k = acc the own chunk's gradient goes to the host once a
    step, and its norm is taken from the device buffer before the copy; at k = 1 (acc additions)
    the last addition takes it in the same pass as it adds. A backward that runs a layer at a
    time hands each layer's slice to the host as it finishes it, last layer first, and the last
    addition's norm is its slices'. All train like one process, clipped."""
    from tawpipe.runtime.offload import HostOffload

    torch.manual_seed(0)
    model = TinyLM(3)
    ref, ref_losses = reference_run(model, 4 * MB_ROWS, 3, 0.05)
    normed = record_norms(monkeypatch.setattr)
    additions: list[tuple[bool, int, int | None]] = []
    add = HostOffload.accumulate_grad

    def recorded(self, src, alpha=1.0, *, squared_norm=False, start=0, stop=None):
        additions.append((squared_norm, start, stop))
        return add(self, src, alpha, squared_norm=squared_norm, start=start, stop=stop)

    monkeypatch.setattr(HostOffload, "accumulate_grad", recorded)
    m = copy.deepcopy(model)
    engine = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=4,
                         optimizer=adamw, comm=NoComm(1), block_context=m.context, offload_state=True,
                         mb_per_fetch=k, max_grad_norm=0.05, recompute=recompute)
    losses = [engine.step(global_batch(step, 4 * MB_ROWS)) for step in range(3)]
    numel = engine.memory_report().master // 4
    per = numel // 3
    slices = [(0, numel)] if recompute == "chunk" else [(j * per, (j + 1) * per) for j in (2, 1, 0)]
    assert host_accumulator(engine) not in normed
    assert len(normed) == 3 * (2 if k == 4 else 1)  # a step: the own chunk's gradient on the device, the replicated
    plain, last = [(False, *s) for s in slices], [(True, *s) for s in slices]  # the last of a step normed
    assert additions == (plain if k == 4 else plain * 3 + last) * 3
    want = dict(ref.named_parameters())
    assert max(rel_err(p.detach(), want[n].detach()) for n, p in engine.named_parameters()) <= 1e-5
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    engine.close()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_gradient_streamed_to_the_host_a_layer_at_a_time_trains_bit_for_bit_as_one_sent_whole(monkeypatch, device):
    """bfloat16 compute, clipping, staging pieces of 257 elements: each layer's slice handed to
    the host as the backward finishes it against the whole gradient after the backward, bit for
    bit, and every step's norm the accumulator's. On CUDA each layer's gradient is held back on
    the GPU (a sleep queued before it is written), so a slice sent before its layer is done shows."""
    from tawpipe.engine.storage import ChunkStorage
    from tawpipe.plan.plan import Plan
    from tawpipe.runtime.offload import HostOffload

    dev = torch.device(device)
    monkeypatch.setitem(HostOffload.__init__.__kwdefaults__, "piece_numel", 257)
    if dev.type == "cuda":
        harvest = ChunkStorage.harvest

        def held_back(self, *args, **kwargs) -> None:
            torch.cuda._sleep(20_000_000)
            harvest(self, *args, **kwargs)

        monkeypatch.setattr(ChunkStorage, "harvest", held_back)
    norms = finished_norms(monkeypatch.setattr)
    slices: list[int] = []  # each addition's elements
    add = HostOffload.accumulate_grad

    def recorded(self, src, alpha=1.0, *, squared_norm=False, start=0, stop=None):
        slices.append((stop if stop is not None else self.numel) - start)
        return add(self, src, alpha, squared_norm=squared_norm, start=start, stop=stop)

    monkeypatch.setattr(HostOffload, "accumulate_grad", recorded)
    torch.manual_seed(0)
    model = TinyLM(4)
    runs = []
    for streamed in (True, False):
        with monkeypatch.context() as patch:
            if not streamed:
                patch.setattr(Plan, "streamed_accumulations", lambda self, rank: {})
            m = copy.deepcopy(model).to(dev)
            engine = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=Topology(1, 1), micro_batches=4,
                                 comm=NoComm(1), device=dev, offload_state=True, recompute="layer",
                                 compute_dtype=torch.bfloat16, max_grad_norm=0.05,
                                 block_context=lambda t: {a: v.to(dev) for a, v in m.context(t).items()})
        slices.clear()
        losses = [engine.step(tuple(t.to(dev) for t in global_batch(s, 4 * MB_ROWS))) for s in range(3)]
        assert len(slices) == 3 * (4 if streamed else 1) and len(set(slices)) == 1  # per layer, or the whole chunk
        runs.append((losses, {n: p.detach().cpu().clone() for n, p in engine.named_parameters()}))
        engine.close()
    (streamed_losses, streamed_params), (whole_losses, whole_params) = runs
    assert streamed_losses == whole_losses
    assert all(torch.equal(streamed_params[n], whole_params[n]) for n in streamed_params)
    assert len(norms) == 6 and all(a == pytest.approx(b, rel=2e-6) for a, b in norms), norms


@pytest.mark.parametrize("k", [4, 1])
def test_a_gradient_normed_on_its_way_to_the_host_still_skips_a_non_finite_step(monkeypatch, k):
    """The non-finite check moves with the norm (the device's at k = acc, the last addition's at
    k = 1): blocks whose gradients turn infinite in one step (the loss finite, the embedding and
    head frozen so that only the own chunk can tell) skip that step and leave every parameter as
    it was, the host accumulator never normed."""
    normed = record_norms(monkeypatch.setattr)
    torch.manual_seed(0)
    model = TinyLM(3)
    for p in (*model.embed.parameters(), *model.head.parameters()):
        p.requires_grad_(False)
    poison = [False]

    def block_forward(block, hidden, **ctx):
        out = block(hidden, **ctx)
        if poison[0] and out.requires_grad:
            out.register_hook(lambda g: torch.full_like(g, float("inf")))
        return out

    engine = make_engine(model.blocks, model.embed, model.head, lm_loss, topology=Topology(1, 1), micro_batches=4,
                         optimizer=adamw, comm=NoComm(1), block_context=model.context, offload_state=True,
                         mb_per_fetch=k, block_forward=block_forward)
    engine.step(global_batch(0, 4 * MB_ROWS))
    before = {n: p.detach().clone() for n, p in engine.named_parameters()}
    poison[0] = True
    loss = engine.step(global_batch(1, 4 * MB_ROWS))
    assert torch.isfinite(torch.tensor(loss)) and engine.skipped_steps == 1
    assert all(torch.equal(p.detach(), before[n]) for n, p in engine.named_parameters())
    poison[0] = False
    engine.step(global_batch(2, 4 * MB_ROWS))
    assert engine.skipped_steps == 1
    assert any(not torch.equal(p.detach(), before[n]) for n, p in engine.named_parameters())
    assert normed and host_accumulator(engine) not in normed
    engine.close()


@pytest.mark.parametrize("recompute", ["block", "chunk"])
def test_offloaded_inputs_come_back_one_ahead(monkeypatch, recompute):
    """With activation offload, one input is fetched back ahead while one is in use: under "block"
    one layer's input (a layer at a time), not a chunk's 8; under "chunk" one chunk input. Same
    update as without offload."""
    from tawpipe.engine import engine as engine_module
    from tawpipe.engine.activations import ActivationOffload

    made = []

    class Recording(ActivationOffload):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(engine_module, "ActivationOffload", Recording)
    _, offloaded, _ = _peak(recompute, 8, steps=2, offload_activations=True)
    _, kept, _ = _peak(recompute, 8, steps=2)
    (offload,) = made
    one_input = MB_ROWS * SEQ * HIDDEN * 4  # rows x seq x hidden, float32
    assert offload.most_fetched_bytes == one_input
    assert offload.fetched_bytes == offload.stored_bytes == 2 * 2 * (8 if recompute == "block" else 1) * one_input
    for name, p in kept.items():
        torch.testing.assert_close(offloaded[name], p, rtol=0, atol=0)


def test_an_input_fetched_ahead_is_not_overwritten_by_a_forward_before_its_backward():
    """WeiPipe runs a forward between two backwards (B1.0 F0.1 B2.0 on rank 0 of three): the
    input fetched ahead for the second backward must come back as it was stored, though the
    forward between stores an input of the same shape. Each one taken is the tensor stored."""
    from tawpipe.engine.activations import ActivationOffload

    order = [(1, 0, 0), (2, 0, 0), (0, 0, 0), (1, 1, 0)]  # the backwards' keys, in the rank's order
    offload = ActivationOffload(torch.device("cpu"), order)
    stored = {}

    def forward(key):
        stored[key] = torch.randn(MB_ROWS, SEQ, HIDDEN)
        offload.store(key, [stored[key].clone()])

    def backward(key):
        (got,) = offload.take(key)
        torch.testing.assert_close(got, stored[key], rtol=0, atol=0)

    for key in [(0, 0, 0), (2, 0, 0), (1, 0, 0)]:
        forward(key)
    backward((1, 0, 0))  # fetches (2, 0, 0) ahead
    forward((0, 1, 0))
    backward((2, 0, 0))
    forward((2, 1, 0))
    backward((0, 0, 0))
    forward((1, 1, 0))
    backward((1, 1, 0))


def _dropout_run(recompute: str, device: str, **options) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Two steps of a model with dropout after every block on one rank (one chunk of 4 layers,
    two micro-batches): the parameters after them, and what the caller's generator draws next."""
    dev = torch.device(device)
    torch.manual_seed(0)
    model = TinyLM(4).to(dev)
    engine = make_engine(model.blocks, model.embed, model.head, lm_loss, topology=Topology(1, 1), micro_batches=2,
                         comm=NoComm(1), device=dev, recompute=recompute,
                         block_context=lambda t: {k: v.to(dev) for k, v in model.context(t).items()},
                         block_forward=lambda block, h, **ctx: torch.nn.functional.dropout(block(h, **ctx), 0.3),
                         **options)
    torch.manual_seed(1)
    for step in range(2):
        engine.step(tuple(t.to(dev) for t in global_batch(step, 2 * MB_ROWS)))
    params = {n: p.detach().cpu().clone() for n, p in engine.named_parameters()}
    engine.close()
    return params, torch.rand(4, device=dev).cpu()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
@pytest.mark.parametrize("recompute, options", [("chunk", {}), ("layer", {}), ("block", {}),
                                                ("chunk", {"offload_activations": True}),
                                                ("block", {"offload_activations": True})])
def test_a_re_run_draws_the_dropout_masks_its_forward_drew(recompute, options, device):
    """A backward that runs its forward again replays the generators (as torch.utils.checkpoint
    does; on a GPU, the device's generator too): the update is the one of keeping the graph
    (recompute "none", which runs each forward once), and the caller's generator is where it would
    be without the re-runs."""
    want, after = _dropout_run("none", device)
    got, got_after = _dropout_run(recompute, device, **options)
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert torch.allclose(got[name], p, rtol=0, atol=1e-6), name
    assert torch.equal(got_after, after)


@pytest.mark.parametrize("recompute", ["none", "chunk"])
def test_the_embeddings_backward_draws_the_dropout_mask_its_forward_drew(recompute):
    """The backward runs ``embed`` again for its gradient (whatever the recompute): an embedding
    with dropout must draw the forward's mask there, and leave the caller's generator where plain
    training leaves it. Against plain torch on one rank, whose forward draws the same masks."""
    from engine_cases import adamw, train_alone

    torch.manual_seed(0)
    model = TinyLM(2)
    model.embed = torch.nn.Sequential(model.embed, torch.nn.Dropout(0.5))
    torch.manual_seed(1)
    want, _ = train_alone(copy.deepcopy(model), lambda step: global_batch(step, MB_ROWS), lm_loss, 3, None)
    want_after = torch.rand(4)
    engine = make_engine(model.blocks, model.embed, model.head, lm_loss, topology=Topology(1, 1), micro_batches=1,
                         comm=NoComm(1), optimizer=adamw, block_context=model.context, recompute=recompute)
    torch.manual_seed(1)
    for step in range(3):
        engine.step(global_batch(step, MB_ROWS))
    after = torch.rand(4)
    params = dict(want.named_parameters())
    for name, p in engine.named_parameters():
        torch.testing.assert_close(p.detach(), params[name].detach(), rtol=0, atol=1e-6, msg=name)
    assert torch.equal(after, want_after)
    engine.close()
