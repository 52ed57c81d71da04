"""Teach TawPipe another Hugging Face family: IBM's Granite, in a few lines.

    python examples/hf_custom_family.py

Granite is laid out like LLaMA (``model.embed_tokens``, ``model.layers``, ``model.norm``,
``lm_head``), so the default ``Adapter`` finds its parts; but its model multiplies the embeddings
by ``embedding_multiplier`` and divides the logits by ``logits_scaling``, which the replicated
``embed`` and ``head`` must do too. A family that differs only in where its parts live sets the
``Adapter`` attributes instead (``layers = "transformer.h"``, ...); one laid out exactly like LLaMA
needs only ``register("its_model_type", Adapter())``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

from tawpipe import TawPipe, Topology
from tawpipe.runtime.launch import run_local
from tawpipe.models.hf import Adapter, from_config, register


class Scaled(nn.Module):
    """``module(x) * multiplier / divisor``, as the family's model computes it."""

    def __init__(self, module: nn.Module, multiplier: float = 1.0, divisor: float = 1.0) -> None:
        super().__init__()
        self.module, self.multiplier, self.divisor = module, multiplier, divisor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x) * self.multiplier / self.divisor


class GraniteAdapter(Adapter):
    def embed_module(self, model):
        return Scaled(super().embed_module(model), multiplier=model.config.embedding_multiplier)

    def head_module(self, model):
        return Scaled(super().head_module(model), divisor=model.config.logits_scaling)


register("granite", GraniteAdapter())


def small_granite():
    from transformers import GraniteConfig

    return GraniteConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=12.0,
                         logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.0625)


@torch.no_grad()
def same_logits_as_transformers() -> float:
    """Largest difference between transformers' Granite and its parts as TawPipe runs them."""
    from transformers import GraniteForCausalLM

    parts = from_config(small_granite(), seed=0)
    whole = GraniteForCausalLM(small_granite()).eval()
    tokens = torch.randint(0, 128, (2, 24))
    h, ctx = parts.embed(tokens), parts.block_context(tokens)
    for i, block in enumerate(parts.blocks):
        real = parts.materialize(block, i)
        whole.model.layers[i].load_state_dict(real.state_dict())
        h = parts.block_forward(real, h, **ctx)
    whole.model.embed_tokens.load_state_dict(parts.embed.module.state_dict())
    whole.model.norm.load_state_dict(parts.head.module.norm.state_dict())
    whole.lm_head.load_state_dict(parts.head.module.lm_head.state_dict())
    return (parts.head(h) - whole(tokens).logits).abs().max().item()


def train(rank: int, steps: int) -> list[float]:
    parts = from_config(small_granite(), seed=0)  # every rank: the same seed, its own chunk
    engine = TawPipe(parts, topology=Topology(nodes=1, per_node=2), micro_batches=2)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 128, (4, 16), generator=g)
    losses = [engine.step((x, x.roll(-1, dims=1))) for _ in range(steps)]
    engine.close()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="training steps on 2 ranks (0: only the check)")
    args = parser.parse_args()
    print(f"largest logit difference from transformers' Granite: {same_logits_as_transformers():.2e}")
    if args.steps:
        losses = run_local(train, 2, args.steps)[0]
        print(f"tawpipe on 2 ranks: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")


if __name__ == "__main__":
    main()
