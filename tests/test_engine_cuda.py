"""The engine on a GPU (one rank: NCCL refuses two ranks on one device): the CUDA paths of the
executor (a stream per channel, events between them, host offload's streamed loads) give the
same parameters as single-device training. Skipped without CUDA."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine_cases import MB_ROWS, TinyLM, adamw, global_batch, lm_loss, make_engine, reference_run, rel_err
from tawpipe.runtime.launch import free_port, run_local
from tawpipe.plan.topology import Topology

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = [
    dict(),
    dict(mb_per_fetch=2, prefetch_depth=2),
    dict(recompute="none"),
    dict(offload_state=True),
    dict(overlap=False, max_grad_norm=0.05),
    dict(comm="nccl-native"),
    dict(recompute="layer", max_grad_norm=0.05),
    dict(offload_activations=True),
    dict(offload_activations=True, recompute="layer", offload_state=True, mb_per_fetch=2),
    dict(recompute="block", offload_activations=True),
    dict(reuse_weights="host", prefetch_depth=1, mb_per_fetch=1),
]


def _built(case: dict, layers: int, rows: int, topology: Topology, dev: torch.device, **options):
    """The case's engine on ``dev``, and single-device training of the same model for 3 steps of
    ``rows`` rows (the reference and its losses)."""
    case = dict(case)
    clip = case.pop("max_grad_norm", None)
    torch.manual_seed(0)
    model = TinyLM(layers)
    ref, ref_losses = reference_run(model, rows, 3, clip)
    m = copy.deepcopy(model).to(dev)
    engine = make_engine(m.blocks, m.embed, m.head, lm_loss, topology=topology, micro_batches=2, optimizer=adamw,
                         max_grad_norm=clip, device=dev,
                         block_context=lambda t: {k: v.to(dev) for k, v in m.context(t).items()}, **options, **case)
    return engine, ref, ref_losses


def _run(port: int, cases: list[dict], results) -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120), device_id=dev)
    out = []
    try:
        for case in cases:
            engine, ref, ref_losses = _built(case, 3, 2 * MB_ROWS, Topology(1, 1), dev)
            losses = [engine.step(tuple(t.to(dev) for t in global_batch(step, 2 * MB_ROWS))) for step in range(3)]
            ref_params = dict(ref.named_parameters())
            err = max(rel_err(p.detach().cpu(), ref_params[n].detach()) for n, p in engine.named_parameters())
            loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            engine.close()
            out.append((err, loss_err))
    finally:
        dist.destroy_process_group()
    results.put(out)


def test_engine_on_cuda_is_exact() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    p = ctx.Process(target=_run, args=(free_port(), CASES, results))
    p.start()
    p.join(timeout=600)
    assert p.exitcode == 0, p.exitcode
    for case, (err, loss_err) in zip(CASES, results.get()):
        assert err <= 1e-5 and loss_err <= 1e-5, (case, err, loss_err)


SHARED = [dict(), dict(recompute="layer", offload_activations=True, offload_state=True, max_grad_norm=0.05),
          dict(reuse_weights="host", prefetch_depth=1, mb_per_fetch=1, max_grad_norm=0.05)]


def _shared(rank: int, cases: list[dict]) -> list[float]:
    """One rank of a 2x2 job whose 4 processes share GPU 0 over gloo-staged: its parameters
    after 3 steps against single-device training (relative error, worst)."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    out, rows = [], 2 * MB_ROWS
    for case in cases:
        engine, ref, _ = _built(case, 5, 4 * rows, Topology(2, 2), dev, comm="gloo-staged")
        for step in range(3):
            x, y = global_batch(step, 4 * rows)
            engine.step((x[rank * rows:(rank + 1) * rows].to(dev), y[rank * rows:(rank + 1) * rows].to(dev)))
        ref_params = dict(ref.named_parameters())
        out.append(max(rel_err(p.detach().cpu(), ref_params[n].detach()) for n, p in engine.named_parameters()))
        engine.close()
    return out


def test_four_ranks_share_the_gpu_over_gloo_staged() -> None:
    """Every schedule path on CUDA beyond world size 1 (streams, events, offload) on one GPU."""
    for rank, errs in enumerate(run_local(_shared, 4, SHARED, timeout=300)):
        for case, err in zip(SHARED, errs):
            assert err <= 1e-5, (rank, case, err)


def test_hugging_face_context_parallelism_on_the_gpu_is_exact(tmp_path) -> None:
    """A Hugging Face LLaMA whose head size is not H / heads, its attention routed through
    ``tawpipe+sdpa`` (SDPA's lower-right causal kernels with the model's score scale on a slice),
    four ranks of a 2x2 job sharing GPU 0 with context parallelism 2 and the chunked loss: the
    losses and weights of transformers' own training on whole sequences, the K/V bytes counted."""
    pytest.importorskip("transformers")
    import hf_cases
    from test_hf import VOCAB, assert_sliced_training_matches, small
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(small(LlamaConfig, head_dim=16, tie_word_embeddings=False)).save_pretrained(tmp_path / "m")
    x = torch.randint(0, VOCAB, (2, 2 * 2 * 2, 16))
    case = dict(dir=str(tmp_path / "m"), batches=list(zip(x, torch.randint(0, VOCAB, x.shape))), nodes=2, acc=2,
                context_parallel=2, device="cuda:0", comm="gloo-staged", chunked_loss=True, recompute="layer")
    ranks = [r[0] for r in run_local(hf_cases.train_sliced, 4, [case], timeout=300)]
    assert_sliced_training_matches(case, ranks, None, "llama on cuda")


def test_context_parallelism_on_the_gpu_is_exact() -> None:
    """TawPipe with context parallelism on CUDA (the K/V exchange staged through pinned host
    memory, the slices' attention through SDPA's lower-right causal kernels): four ranks of a 2x2
    job sharing GPU 0 train what one process trains on whole sequences."""
    from context_cases import exactness

    cases = [dict(nodes=2, acc=2, context_parallel=2, device="cuda:0", comm="gloo-staged", mb_per_fetch=1,
                  prefetch_depth=1, reuse_weights=False, max_grad_norm=0.05),
             dict(nodes=2, acc=2, context_parallel=2, device="cuda:0", comm="gloo-staged", recompute="layer",
                  offload_activations=True)]
    for rank_results in run_local(exactness, 4, cases, timeout=300):
        for r in rank_results:
            assert r["param_err"] <= 1e-5, (r["case"], r["rank"], r["worst"], r["param_err"])
            assert r["exchanged"] == r["planned"] > 0, r["case"]
