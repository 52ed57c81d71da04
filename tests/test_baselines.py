"""Every baseline computes the update of single-process training on the same global batch.

The reference here is written out directly (model, data windows, one optimizer step), sharing
nothing with tawpipe.bench.baselines but the model and data modules. Plain SGD makes the update
proportional to the gradient, so a wrong loss scale, a missing or doubled micro-batch, or a
gradient reduced over the wrong ranks all show; one AdamW run covers the bench's optimizer.
The reference always takes the plain loss of the whole logits, also where the methods compute
the head's loss in chunks (``RunConfig.loss="chunked"``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tawpipe.bench import baselines
from tawpipe.bench.baselines import RunConfig
from tawpipe.train.data import batch, load_tokens
from tawpipe.runtime.launch import run_local
from tawpipe.models.llama import Llama, LlamaConfig

TINY = RunConfig(nodes=2, per_node=2, hidden=32, heads=4, layers=4, seq_len=16, micro_batches=2,
                 batch_size=2, warmup=1, steps=1, lr=0.05, optimizer="sgd", seed=3)


def _reference(cfg: RunConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of two steps and the first update, by plain training on all ranks' windows."""
    torch.manual_seed(cfg.seed)
    model = Llama(LlamaConfig(vocab_size=cfg.vocab, hidden=cfg.hidden, n_layers=cfg.layers, n_heads=cfg.heads,
                              n_kv_heads=cfg.heads, max_seq_len=cfg.seq_len, tie_embeddings=False))
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    else:
        mats = [p for p in model.parameters() if p.dim() >= 2]
        vecs = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": mats, "weight_decay": 0.1}, {"params": vecs, "weight_decay": 0.0}],
                                lr=cfg.lr, betas=(0.9, 0.95))
    tokens = load_tokens(None).train
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, update = [], {}
    n_windows = cfg.world_size * cfg.micro_batches
    for step in range(2):
        windows = [batch(tokens, cfg.seq_len, cfg.batch_size, seed=cfg.seed, step=step, index=i)
                   for i in range(n_windows)]
        x = torch.cat([w[0] for w in windows])
        y = torch.cat([w[1] for w in windows])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    return losses, update


def _run(method: str, cfg: RunConfig, tmp_path) -> tuple[list[float], dict[str, torch.Tensor], list[dict]]:
    cfg = dataclasses.replace(cfg, check_dir=str(tmp_path))
    records = run_local(baselines.METHODS[method], cfg.world_size, cfg, timeout=180)
    losses = []
    for step in range(2):
        vals = [r["losses"][step] for r in records if r["losses"][step] is not None]
        losses.append(sum(vals) / len(vals))
    return losses, baselines.merge_params(str(tmp_path), cfg.world_size), records


def _assert_update(name: str, after: torch.Tensor, init: torch.Tensor, expected: torch.Tensor) -> None:
    """The update agrees to 1e-5 of its norm, beyond the float32 resolution of the parameter.

    An update of ~1e-6 on a weight of ~1e-2 is resolved only to one ulp (~1e-9) of the weight,
    whichever method computed it; any real error (a lost or doubled contribution) is far larger.
    """
    ulp = (torch.nextafter(after, after + 1) - after).abs()
    err = (after - init - expected).norm()
    assert err <= 1e-5 * expected.norm() + ulp.norm(), f"{name}: {err:.3g} vs update norm {expected.norm():.3g}"


def _assert_same_update(method: str, cfg: RunConfig, tmp_path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """``method`` computes the reference's losses and first update; its records and the initial
    parameters."""
    ref_losses, ref_update = _reference(cfg)
    losses, params, records = _run(method, cfg, tmp_path)
    torch.manual_seed(cfg.seed)
    init = dict(Llama(cfg.model_config()).named_parameters())
    assert set(params) == set(ref_update)
    for name, delta in ref_update.items():
        _assert_update(name, params[name], init[name].detach(), delta)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    return records, init


@pytest.mark.parametrize("method, shape", [("ddp", (2, 2)), ("fsdp", (2, 2)), ("fsdp-mm", (2, 2)),
                                           ("fsdp-node", (2, 2)), ("hsdp", (2, 2)), ("1f1b", (3, 1))])
def test_same_update_as_single_process(method, shape, tmp_path):
    # 1F1B on 3 stages of 4 layers: uneven stages (2, 1, 1)
    cfg = dataclasses.replace(TINY, nodes=shape[0], per_node=shape[1])
    records, init = _assert_same_update(method, cfg, tmp_path)
    for r in records:
        assert len(r["step_seconds"]) == cfg.steps and r["peak_rss_bytes"] > 0
        assert r["link_bytes"] is None  # not on an emulated cluster
    # persistent memory, SGD (no state): parameters and gradients, whole or sharded
    full = 2 * 4 * sum(t.numel() for t in init.values())
    held = [r["persistent_bytes"] for r in records]
    if method == "ddp":
        assert held == [full] * cfg.world_size
    elif method in ("fsdp", "fsdp-mm", "fsdp-node"):
        assert sum(held) == pytest.approx(full, rel=0.02)  # shards (dim 0 padded to world size)
    elif method == "hsdp":
        assert sum(held) == pytest.approx(cfg.nodes * full, rel=0.02)  # one sharded copy per node
    else:
        assert sum(held) == full  # each stage its own layers


@pytest.mark.parametrize("method, shape", [("ddp", (2, 2)), ("fsdp-node", (2, 2)), ("1f1b", (3, 1))])
def test_chunked_loss_and_a_larger_vocabulary_give_the_same_update(method, shape, tmp_path):
    # FSDP2 keeps the head's weight unsharded only inside the root's forward, and 1F1B's loss is
    # the last stage's head: both must see the gradient of the chunked loss.
    cfg = dataclasses.replace(TINY, nodes=shape[0], per_node=shape[1], vocab=512, loss="chunked")
    _assert_same_update(method, cfg, tmp_path)


@pytest.mark.parametrize("loss, fused", [("plain", False), ("chunked", True)])
def test_the_loss_option_picks_the_heads_loss(loss, fused):
    # The chunked loss is exact, so only how it is computed tells it from the plain one: its
    # gradient comes from linear_cross_entropy's own autograd function, not through the logits.
    cfg = dataclasses.replace(TINY, nodes=3, per_node=1, vocab=300, loss=loss)
    torch.manual_seed(cfg.seed)
    model = Llama(cfg.model_config())
    x, y = torch.randint(0, 256, (2, cfg.seq_len)), torch.randint(0, 300, (2, cfg.seq_len))
    expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    first, middle, last = (baselines._Stage(model, cfg, s, 3) for s in range(3))
    hidden = last(middle(first(x)))  # 1F1B's last stage sends out its hidden state
    assert hidden.shape == (2, cfg.seq_len, cfg.hidden)
    for value in (baselines._Stage(model, cfg)(x, y), last.loss(hidden, y)):  # DDP/FSDP2's whole model, 1F1B
        assert value.item() == pytest.approx(expected, rel=1e-5)
        assert ("LinearCrossEntropy" in type(value.grad_fn).__name__) == fused


def test_adamw_matches_the_bench_optimizer(tmp_path):
    # Adam's first step is ~lr*sign(g): gradients within rounding of zero flip a whole step,
    # so the update is compared in norm over all parameters (see tawpipe.bench.cluster.UPDATE_TOL).
    cfg = dataclasses.replace(TINY, optimizer="adamw", lr=1e-3)
    ref_losses, ref_update = _reference(cfg)
    losses, params, _ = _run("fsdp-mm", cfg, tmp_path)
    torch.manual_seed(cfg.seed)
    init = dict(Llama(cfg.model_config()).named_parameters())
    num = sum((params[n] - init[n].detach() - d).square().sum() for n, d in ref_update.items())
    den = sum(d.square().sum() for d in ref_update.values())
    assert (num / den).sqrt().item() < 1e-4
    assert losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("layers, stages", [(8, 6), (4, 4), (7, 3)])
def test_stage_layers_cover_the_model_in_order(layers, stages):
    ranges = [baselines.stage_layers(layers, stages, s) for s in range(stages)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize("kw, what", [(dict(layers=3), "at least as many layers"), (dict(hidden=30), "heads"),
                                      (dict(optimizer="adam"), "optimizer"), (dict(steps=0), "steps"),
                                      (dict(vocab=255), "vocab must be an integer >= 256"),
                                      (dict(vocab=512.0), "vocab"), (dict(loss="fused"), "loss must be one of")])
def test_config_rejects_bad_input(kw, what):
    with pytest.raises(ValueError, match=what):
        dataclasses.replace(TINY, **kw)
