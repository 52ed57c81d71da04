"""The cost model's activations against what autograd keeps: ``working_set_bytes`` is the bytes
the built-in LLaMA's layers save for their backward (design §7.3), counted here from autograd's
saved tensors, each storage once, for several shapes and both compute dtypes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tawpipe.cost.memory import working_set_bytes
from tawpipe.models.llama import Block, LlamaConfig, rope_tables
from tawpipe.models.shape import ModelDims

SHAPES = [  # hidden, heads, key/value heads, MLP width, tokens, micro-batch rows
    (64, 4, 4, 176, 48, 1),  # multi-head attention
    (96, 6, 2, 256, 40, 2),  # grouped-query attention
    (64, 4, 1, 160, 32, 3),  # one key/value head
]


def saved_bytes(block: torch.nn.Module, x: torch.Tensor, *extra: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves in ``block(x, *extra)``, each storage once, less the
    block's parameters and its inputs (the layer's input is kept by its caller: a chunk input, or
    a layer's under recompute)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x, *extra)
    given = {t.untyped_storage().data_ptr() for t in (x, *extra, *block.parameters())}
    out.float().square().mean().backward()  # the graph it saved runs
    assert x.grad is not None and x.grad.abs().sum() > 0
    return sum(n for ptr, n in seen.items() if ptr not in given)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("hidden, heads, kv, ffn, seq, rows", SHAPES)
def test_what_a_layer_keeps_for_its_backward_is_what_the_cost_model_counts(dtype, hidden, heads, kv, ffn, seq, rows):
    torch.manual_seed(hidden * seq + rows)
    cfg = LlamaConfig(vocab_size=32, hidden=hidden, n_layers=1, n_heads=heads, n_kv_heads=kv, ffn_hidden=ffn,
                      max_seq_len=seq)
    block = Block(cfg).to(dtype)
    cos, sin = rope_tables(cfg.head_dim, seq, cfg.rope_theta)
    x = torch.randn(rows, seq, hidden, dtype=dtype, requires_grad=True)
    dims = ModelDims(hidden=hidden, layers=1, heads=heads, kv_heads=kv, ffn=ffn, seq=seq, micro_batch=rows,
                     dtype_bytes=dtype.itemsize)
    assert saved_bytes(block, x, cos, sin) == working_set_bytes(dims, 1)
    assert working_set_bytes(dataclasses.replace(dims, layers=3), 3) == 3 * working_set_bytes(dims, 1)


def test_eager_attention_adds_its_scores():
    """``scores`` (eager attention, which keeps its S x S probabilities) counts them on top."""
    dims = ModelDims(hidden=64, layers=1, heads=4, seq=128, dtype_bytes=2)
    flash = working_set_bytes(dims, 1)
    eager = working_set_bytes(dataclasses.replace(dims, scores=True), 1)
    assert eager - flash == 5 * 4 * 128 * 128  # Korthikanti et al.: 5·a·S² bytes at 16 bits
