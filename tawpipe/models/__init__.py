"""Models shaped for the weight-pipeline engine: embed, identical blocks, head, block context."""

from tawpipe.models.llama import (
    Block,
    Llama,
    LlamaConfig,
    block_forward,
    block_numel,
    embed_head_numel,
    llama_loss,
    num_params,
)

__all__ = [
    "Block",
    "Llama",
    "LlamaConfig",
    "block_forward",
    "block_numel",
    "embed_head_numel",
    "llama_loss",
    "num_params",
]
