"""Rank functions for the context-parallelism tests (module level, so spawned processes can
import them): the built-in LLaMA trained by the engine with context groups, against the same
model trained in one process on whole sequences (which never touches tawpipe's engine)."""

from __future__ import annotations

import torch

from tawpipe.cost.traffic import context_bytes
from tawpipe.models.llama import Llama, LlamaConfig, llama_loss, llama_parts
from tawpipe.plan.topology import Topology

from engine_cases import adamw, make_engine, rel_err, train_alone

CFG = LlamaConfig(vocab_size=64, hidden=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32)
ROWS, SEQ, SEED = 2, 16, 7


def sequences(step: int, rows: int, ignored: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random sequences; ``ignored``: targets 4 to 11 (member 1's slice at c = 2) are -100 at even
    steps, 4 to 10 at odd ones (the slice then counts one target a row, the other member eight)."""
    g = torch.Generator().manual_seed(500 + step)
    tok = torch.randint(0, CFG.vocab_size, (rows, SEQ + 1), generator=g)
    x, y = tok[:, :-1], tok[:, 1:].clone()
    if ignored:
        y[:, 4:12 - step % 2] = -100
    return x, y


def reference(rows: int, steps: int, clip: float | None, ignored: bool) -> tuple[Llama, list[float]]:
    """Single-process training of the whole model on every sequence of each step."""
    return train_alone(Llama(CFG, SEED), lambda step: sequences(step, rows, ignored), llama_loss, steps, clip)


def exactness(rank: int, cases: list[dict]) -> list[dict]:
    """Each case: the engine with ``context_parallel`` after ``steps`` steps, each context group
    given the same sequences (rank // c's share of the global batch), against ``reference``."""
    world = torch.distributed.get_world_size()
    out = []
    for case in cases:
        case = dict(case)
        nodes, acc, c, steps = case.pop("nodes"), case.pop("acc"), case["context_parallel"], case.pop("steps", 2)
        clip, dev = case.get("max_grad_norm"), torch.device(case.pop("device", "cpu"))
        uneven, ignored = case.pop("uneven_val", False), case.pop("ignored", False)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # every rank on the one GPU (comm "gloo-staged")
        topo = Topology(nodes=nodes, per_node=world // nodes)
        groups, n = world // c, acc * ROWS
        trained, ref_losses = reference(groups * n, steps, clip, ignored)
        want = dict(trained.named_parameters())
        engine = make_engine(llama_parts(CFG, seed=SEED, device=dev), topology=topo, micro_batches=acc, optimizer=adamw,
                             device=dev, **case)
        losses = []
        for step in range(steps):
            x, y = sequences(step, groups * n, ignored)
            mine = slice((rank // c) * n, (rank // c + 1) * n)
            losses.append(engine.step((x[mine].to(dev), y[mine].to(dev))))
        errs = {name: rel_err(p.detach().cpu(), want[name].detach()) for name, p in engine.named_parameters()}
        planned = steps * context_bytes(engine.plan, rank, CFG.dims(seq=SEQ, micro_batch=ROWS, dtype_bytes=4), c,
                                        case.get("recompute", "chunk"))
        exchanged, _ = engine.context_traffic()  # the steps' exchanges, before the evaluation's
        val = [sequences(100 + b, groups * ROWS, ignored) for b in range(2)]
        # "uneven_val": context group g evaluates the first 1 + g % 2 batches of its rows, not both
        counts = [1 + g % 2 if uneven else 2 for g in range(groups)]
        mine = slice((rank // c) * ROWS, (rank // c + 1) * ROWS)
        val_loss = engine.evaluate([(x[mine].to(dev), y[mine].to(dev)) for x, y in val[:counts[rank // c]]])
        engine.close()
        with torch.no_grad():  # the mean over the union of every group's batches, one term per batch
            want_val = sum(llama_loss(trained(x[g * ROWS:(g + 1) * ROWS]), y[g * ROWS:(g + 1) * ROWS]).item()
                           for g in range(groups) for x, y in val[:counts[g]]) / sum(counts)
        out.append({"case": case, "rank": rank, "param_err": max(errs.values()), "worst": max(errs, key=errs.get),
                    "losses": losses, "ref_losses": ref_losses, "exchanged": exchanged, "planned": planned,
                    "val": val_loss, "want_val": want_val})
    return out


def refusals(rank: int, cases: list[dict]) -> list[str]:
    """Each case must raise on every rank, before the step changes anything: the error's text."""
    world = torch.distributed.get_world_size()
    out = []
    for case in cases:
        case = dict(case)
        seq, odd = case.pop("seq", SEQ), case.pop("odd_batch", False)
        engine = make_engine(llama_parts(CFG, seed=SEED), topology=Topology(1, world), micro_batches=1,
                             optimizer=adamw, **case)
        before = {n: p.detach().clone() for n, p in engine.named_parameters()}
        x, y = sequences(0, 2)
        x, y = x[:, :seq], y[:, :seq]
        if odd and rank == world - 1:
            x = (x + 1) % CFG.vocab_size
        try:
            engine.step((x[:1], y[:1]))
        except ValueError as e:
            out.append(str(e))
        else:
            out.append("no error")
        unchanged = all(torch.equal(p.detach(), before[n]) for n, p in engine.named_parameters())
        out.append(f"unchanged={unchanged}")
        x, y = sequences(1, 2)  # and the engine still trains
        out.append(f"then {engine.step((x[:1], y[:1])):.3f}")
        engine.close()
    return out
