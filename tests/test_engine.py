"""The engine on a real multi-process gloo job: exact against single-process training, traffic
equal to the plan, sharded memory. CI runs a representative subset; `-m slow` runs the matrix."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

from tawpipe.runtime.launch import run_local

from engine_cases import evaluation, exactness

PARAM_RTOL = 1e-5
PAPER = dict(mb_per_fetch=1, prefetch_depth=1, reuse_weights=False)  # the paper's schedule; the default is "auto"


def _divisors(n: int) -> list[int]:
    return [g for g in range(1, n + 1) if n % g == 0]


def _check(results: list[list[dict]]) -> None:
    for rank_results in results:
        for r in rank_results:
            c = r["case"]
            assert r["finite"], c
            assert r["param_err"] <= PARAM_RTOL, (c, r["rank"], r["worst"], r["param_err"])
            # the update itself (not just the parameters) matches the reference closely
            assert r["update_err"] <= 5e-3, (c, r["rank"], r["update_err"])
            for a, b in zip(r["losses"], r["ref_losses"]):
                assert abs(a - b) <= 1e-5 * abs(b), (c, r["losses"], r["ref_losses"])


def _check_traffic(results: list[list[dict]]) -> None:
    for rank_results in results:
        for r in rank_results:
            # each channel executes exactly its part of the plan and nothing else (the step's
            # statistics are an action of the plan too): its collectives in plan order, and its
            # messages, which gloo posts as soon as each is ready, as the same multiset
            for channel in ("weights", "grads", "replicated", "replicas", "step"):
                for p2p in (False, True):
                    executed = [rec[1:] for rec in r["recorded"] if rec[0] == channel
                                and (rec[1] in ("send", "recv")) == p2p]
                    planned = [p[1:] for p in r["plan_comm"] if p[0] == channel and (p[1] in ("send", "recv")) == p2p]
                    if p2p:
                        executed, planned = sorted(executed, key=repr), sorted(planned, key=repr)
                    assert executed == planned, (r["case"], r["rank"], channel)
            assert len(r["recorded"]) == len(r["plan_comm"])
            world = tuple(range(len(results)))
            assert [x[:3] for x in r["setup"]] == [("step", "all_reduce", world)], r["setup"]


CI_CASES = {
    1: [dict(nodes=1, acc=2, layers=3)],
    2: [dict(nodes=2, acc=2, layers=3), dict(nodes=1, acc=1, layers=2)],
    4: [
        dict(nodes=2, acc=2, layers=4, **PAPER),
        dict(nodes=2, acc=2, layers=4),  # "auto": k=2, every chunk resident
        dict(nodes=2, acc=3, layers=5, grad_route="leader"),
        dict(nodes=4, acc=2, layers=6),  # s = 1
        dict(nodes=1, acc=1, layers=5),  # G = 1
        dict(nodes=2, acc=1, layers=4, overlap=False),
        dict(nodes=2, acc=2, layers=4, max_grad_norm=0.05),
        dict(nodes=2, acc=2, layers=5, recompute="none"),
        dict(nodes=2, acc=2, layers=4, mb_per_fetch=2),  # k = micro-batches
        dict(nodes=2, acc=4, layers=5, mb_per_fetch=2, prefetch_depth=3),
        dict(nodes=2, acc=3, layers=5, prefetch_depth=2, reuse_weights=True),  # chunks kept resident
        dict(nodes=2, acc=4, layers=4, mb_per_fetch=4, grad_route="leader"),  # k = micro-batches = 4
        dict(nodes=2, acc=2, layers=4, prefetch_depth=2, recompute="none", overlap=False),
        dict(nodes=1, acc=2, layers=5, algo="weipipe"),
        dict(nodes=2, acc=3, layers=4, algo="weipipe", recompute="none"),
        dict(nodes=2, acc=2, layers=5, offload_state=True, max_grad_norm=0.05),  # state in host memory
        dict(nodes=1, acc=2, layers=4, offload_state=True, algo="weipipe"),
        # a layer at a time in the backward: chunks of 3 and 2 layers, with k > 1 and clipping, WeiPipe
        dict(nodes=2, acc=2, layers=9, recompute="layer"),
        dict(nodes=2, acc=4, layers=8, recompute="layer", mb_per_fetch=2, max_grad_norm=0.05),
        dict(nodes=1, acc=2, layers=9, recompute="layer", algo="weipipe"),
        # every layer's input kept by the forward (per-block checkpointing), alone, offloaded, WeiPipe
        dict(nodes=2, acc=2, layers=9, recompute="block", max_grad_norm=0.05),
        dict(nodes=2, acc=4, layers=8, recompute="block", offload_activations=True, mb_per_fetch=2),
        dict(nodes=1, acc=2, layers=6, recompute="block", algo="weipipe", offload_state=True),
        # the chunk inputs in host memory between forward and backward, with either recompute
        dict(nodes=2, acc=2, layers=5, offload_activations=True, max_grad_norm=0.05),
        dict(nodes=2, acc=4, layers=8, offload_activations=True, recompute="layer", mb_per_fetch=2,
             offload_state=True),
        dict(nodes=1, acc=2, layers=4, offload_activations=True, algo="weipipe"),
        # fetched chunks kept in host memory for their later uses (every chunk crosses the network
        # once per iteration through two buffers): k = 1 restores them in every later round too
        dict(nodes=2, acc=4, layers=5, mb_per_fetch=1, prefetch_depth=1, reuse_weights="host", max_grad_norm=0.05),
        dict(nodes=2, acc=2, layers=4, mb_per_fetch=2, prefetch_depth=1, reuse_weights="host",
             offload_activations=True),
        dict(nodes=1, acc=2, layers=5, prefetch_depth=1, reuse_weights="host", offload_state=True),
    ],
    6: [dict(nodes=3, acc=2, layers=7),
        dict(nodes=3, acc=2, layers=6, mb_per_fetch=2, prefetch_depth="resident", reuse_weights=True),
        dict(nodes=3, acc=4, layers=7, mb_per_fetch=2, prefetch_depth=2, reuse_weights="host", max_grad_norm=0.05)],
}


@pytest.mark.parametrize("world", sorted(CI_CASES))
def test_exact_vs_single_process(world: int) -> None:
    results = run_local(exactness, world, CI_CASES[world], timeout=240)
    _check(results)
    _check_traffic(results)


# Fine-tuning with frozen parameters (requires_grad=False: whole layers, single tensors, the
# embedding and head), and blocks with constant buffers: as exact as any other model. Six layers on
# four ranks make chunks of 2, 2, 1 and 1 layers, so the first chunk is frozen whole.
MODEL_CASES = [
    dict(nodes=2, acc=2, layers=6, frozen="some", max_grad_norm=0.05),
    dict(nodes=2, acc=2, layers=6, frozen="some", recompute="layer", mb_per_fetch=2),
    dict(nodes=2, acc=2, layers=6, frozen="some", recompute="none"),
    dict(nodes=2, acc=2, layers=6, frozen="some", recompute="block", offload_state=True),
    dict(nodes=1, acc=2, layers=6, frozen="some", algo="weipipe"),
    dict(nodes=2, acc=2, layers=6, frozen="replicated", max_grad_norm=0.05),  # a rank trains nothing
    dict(nodes=2, acc=2, layers=6, block="buffers", max_grad_norm=0.05),
    dict(nodes=2, acc=2, layers=6, block="buffers", recompute="layer", offload_activations=True),
    dict(nodes=2, acc=2, layers=6, block="buffers", recompute="none", frozen="some"),
]


def test_frozen_parameters_and_block_buffers_are_exact() -> None:
    """Each case against plain torch AdamW on the trainable parameters only: every parameter to
    1e-5, a frozen one not moved at all, and the engine's parameters requires_grad as given."""
    results = run_local(exactness, 4, MODEL_CASES, timeout=240)
    _check(results)
    for rank_results in results:
        for r in rank_results:
            assert r["frozen_moved"] == 0.0, (r["case"], r["rank"], r["frozen_moved"])
            assert r["requires_grad_as_given"], (r["case"], r["rank"])
    # with embed and head frozen, the replicated all-reduce has nothing to sum and is not sent
    _check_traffic([[r for r in rank_results if r["case"].get("frozen") != "replicated"] for rank_results in results])


COMPILED_CASES = [
    dict(nodes=2, acc=2, layers=6, compile="aot_eager", max_grad_norm=0.05),
    dict(nodes=2, acc=2, layers=6, compile="aot_eager", recompute="layer", offload_activations=True, block="buffers"),
]


def test_a_compiled_block_forward_trains_exactly_and_compiles_once_for_every_layer() -> None:
    """``torch.compile(block_forward)``, a user's first speed knob: as exact as the eager function,
    and the blocks of every chunk, fetched into the same staging or not, run the graphs traced once
    (at most a forward with and one without autograd), whatever the layers and steps."""
    results = run_local(exactness, 4, COMPILED_CASES, timeout=600)
    _check(results)
    for rank_results in results:
        for r in rank_results:
            assert 1 <= r["graphs"] <= 2, (r["case"], r["rank"], r["graphs"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4, 6, 8])
def test_exact_full_matrix(world: int) -> None:
    cases = [
        dict(nodes=g, acc=acc, layers=layers, **PAPER)
        for g, acc, layers in itertools.product(_divisors(world), (1, 2, 3), (2 * world, 2 * world + 1))
    ]
    for g in _divisors(world):  # every k, deeper prefetch, and the WeiPipe baseline
        cases += [dict(nodes=g, acc=4, layers=world + 1, mb_per_fetch=k, prefetch_depth=d)
                  for k, d in ((2, 1), (4, 2), (1, 3))]
        cases += [dict(nodes=g, acc=4, layers=world + 1, mb_per_fetch=k, prefetch_depth=d, reuse_weights=True)
                  for k, d in ((1, 1), (2, 3))]
    if world > 1:
        cases += [dict(nodes=1, acc=acc, layers=world + 1, algo="weipipe") for acc in (1, 3)]
    results = run_local(exactness, world, cases, timeout=1800)
    _check(results)
    _check_traffic(results)


def test_low_precision_loss_trajectory_follows_fp32() -> None:
    """bf16 compute, and fp16 with dynamic loss scaling: float32 masters and accumulators keep the
    loss trajectory within 2e-2 of single-process float32 training, with gradients on the wire in
    bf16 too (the replicas' sums included), each transfer as the plan sizes it."""
    cases = [dict(nodes=2, acc=2, layers=4, steps=6, dtype=dt) for dt in (torch.bfloat16, torch.float16)]
    # gradients on the wire in the compute dtype (still accumulated in float32 by the owner)
    cases.append(dict(nodes=2, acc=2, layers=4, steps=6, dtype=torch.bfloat16, grad_wire_dtype=torch.bfloat16,
                      mb_per_fetch=2))
    # ... and the replicas' sum of their accumulators too, at half the bytes of float32 (the plan's)
    cases.append(dict(nodes=2, acc=2, layers=4, steps=6, dtype=torch.bfloat16, grad_wire_dtype=torch.bfloat16,
                      replicas=2, max_grad_norm=0.5))
    cases.append(dict(nodes=2, acc=2, layers=8, steps=6, dtype=torch.bfloat16, recompute="layer",
                      offload_activations=True))
    cases.append(dict(nodes=2, acc=2, layers=8, steps=6, dtype=torch.bfloat16, recompute="block",
                      offload_activations=True))
    # frozen parameters through the one-layer compute-dtype scratch; buffers in the compute dtype
    cases.append(dict(nodes=2, acc=2, layers=8, steps=6, dtype=torch.bfloat16, recompute="layer", frozen="some",
                      block="buffers"))
    results = run_local(exactness, 4, cases, timeout=240)
    _check_traffic(results)
    assert any(rec[0] == "replicas" for rec in results[0][3]["recorded"])
    for r in results[0]:
        diffs = [abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])]
        assert r["finite"] and max(diffs) <= 2e-2, (r["case"], diffs)
        assert r["skipped"] == 0, r["case"]  # no overflow at this scale: every step was taken
        assert r["frozen_moved"] == 0.0, r["case"]


def test_memory_is_sharded() -> None:
    results = run_local(exactness, 4, [dict(nodes=2, acc=1, layers=8, steps=1, **PAPER)], timeout=240)
    for (r,) in results:
        mem = r["memory"]
        # float32 master + AdamW moments + float32 gradient accumulator: 16 bytes per own parameter
        assert mem.persistent == pytest.approx(mem.sharded_target, rel=1e-9), str(mem)
        whole_model_16 = 16 * mem.decoder_params
        assert mem.persistent <= whole_model_16 / 4 + 1
        weights = {k: v for k, v in mem.staging.items() if k.startswith("w")}
        assert len(weights) <= 3, mem.staging
        chunk_bytes_f32 = 4 * mem.decoder_params / 4
        assert all(v <= chunk_bytes_f32 for v in mem.staging.values()), mem.staging


def test_checkpoint_resume_and_full_state_dict(tmp_path) -> None:
    from engine_cases import resume

    results = run_local(resume, 4, str(tmp_path), timeout=240)
    for r in results:
        assert r["loss3_resumed"] == pytest.approx(r["loss3"], rel=1e-6)
        assert r["resumed_err"] <= 1e-6
    assert results[0]["full_err"] <= PARAM_RTOL


@pytest.mark.parametrize("case", [
    dict(nodes=2, acc=2, layers=5, val_batches=2),  # uneven chunks
    # the state on the host: the step loaded each own chunk for the next step into a buffer that
    # the evaluation then fills with other chunks, so the next step must load it again
    dict(nodes=1, acc=2, layers=5, val_batches=2, offload_state=True),
    dict(nodes=1, acc=1, layers=4, val_batches=1, algo="weipipe"),
    # ranks with 1 and 2 batches: each divided the sum by its own count, so each returned another wrong value
    dict(nodes=1, acc=1, layers=2, val_batches=2, uneven=True, world=2),
])
def test_evaluate_is_a_plan_program_and_exact(case):
    """``TawPipe.evaluate``: the single-process loss of the union of every rank's batches to 1e-5
    (whatever number each rank passes), its traffic exactly the evaluation program's on the
    engine's own Comm, and the training state untouched."""
    results = run_local(evaluation, case.get("world", 4), case, timeout=300)
    for r in results:
        assert abs(r["loss"] - r["want"]) <= 1e-5 * abs(r["want"]), (r["loss"], r["want"])
        assert r["planned"] and len(r["recorded"]) == len(r["planned"]), r["recorded"]
        for channel in {p[0] for p in r["planned"]}:  # each channel runs its part in order
            assert [x for x in r["recorded"] if x[0] == channel] == [x for x in r["planned"] if x[0] == channel]
        assert r["after"][0] == r["after"][1] and r["same_step"] == 0.0
    assert len({r["loss"] for r in results}) == 1  # every rank reports the global mean


class _DropoutBlock(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(h, h), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.lin(x)))


def test_evaluate_runs_the_model_in_eval_mode_and_restores_every_modules_mode() -> None:
    """``evaluate`` ran the blocks in training mode: dropout on, so two calls gave two losses,
    neither a plain ``model.eval()`` evaluation's, and the engine's block templates could not be
    switched. Now the blocks, embed and head run in eval mode, and each module's own mode comes
    back after (mixed modes included), so the next step trains with dropout again."""
    from engine_cases import HIDDEN, VOCAB, global_batch, lm_loss
    from test_engine_errors import NoComm

    from tawpipe import CommPolicy, ModelParts, TawPipe, Topology

    torch.manual_seed(0)
    blocks = nn.ModuleList(_DropoutBlock(HIDDEN) for _ in range(3))
    embed = nn.Sequential(nn.Embedding(VOCAB, HIDDEN), nn.Dropout(0.5))
    head = nn.Sequential(nn.Dropout(0.5), nn.Linear(HIDDEN, VOCAB))
    head[0].eval()  # a mode of its own: it must come back as it was
    engine = TawPipe(ModelParts(blocks, embed, head, lm_loss), topology=Topology(1, 1), micro_batches=1,
                     comm=CommPolicy(NoComm(1)))
    modes = [m.training for m in (*embed.modules(), *head.modules())]
    batches = [global_batch(b, 2) for b in range(3)]
    losses = [engine.evaluate(batches) for _ in range(2)]
    assert [m.training for m in (*embed.modules(), *head.modules())] == modes
    with torch.no_grad():
        for m in (blocks, embed, head):
            m.eval()
        want = 0.0
        for x, y in batches:
            h = embed(x)
            for block in blocks:
                h = block(h)
            want += lm_loss(head(h), y).item() / len(batches)
    assert losses[0] == losses[1] and losses[0] == pytest.approx(want, rel=1e-6), (losses, want)
    x, y = global_batch(9, 2)
    at_rest = engine.evaluate([(x, y)])
    # the same weights, embed and head now in eval mode (the reference's model.eval()): only the blocks'
    # templates can drop out, and back in training mode they do
    assert abs(engine.step((x, y)) - at_rest) > 1e-3
