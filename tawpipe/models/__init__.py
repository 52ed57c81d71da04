"""Models shaped for the weight-pipeline engine, and what a ``--model`` names.

* ``tawpipe.models.shape``: ``ModelDims``, the one model-shape type of the plan, the cost model
  and the simulator; ``tawpipe.models.presets``: the built-in models by name;
* ``tawpipe.models.spec``: ``check``, ``dims``, ``hf_config``, ``load`` and ``meta_model`` of a ``--model``;
* ``tawpipe.models.llama``: the built-in LLaMA-style decoder;
* ``tawpipe.models.hf``: Hugging Face ``transformers`` decoders (optional dependency);
* ``tawpipe.models.parts``: :class:`ModelParts`, what both hand to the engine.

The names below are loaded on first use (PEP 562), so that the shape and the registry, which the
torch-free layers read, cost no torch import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy

if TYPE_CHECKING:
    from .llama import (Block, Llama, LlamaConfig, block_forward, block_numel, embed_head_numel, llama_loss,
                        llama_parts, num_params)
    from .parts import ModelParts
    from .presets import PRESETS
    from .shape import ModelDims
    from .spec import check, check_weights, dims, hf_config, load, meta_model

_NAMES = {  # public name: the module of this package that defines it
    "PRESETS": f"{__name__}.presets",
    "ModelDims": f"{__name__}.shape",
    "ModelParts": f"{__name__}.parts",
    **dict.fromkeys(("check", "check_weights", "dims", "hf_config", "load", "meta_model"), f"{__name__}.spec"),
    **dict.fromkeys(("Block", "Llama", "LlamaConfig", "block_forward", "block_numel", "embed_head_numel",
                     "llama_loss", "llama_parts", "num_params"), f"{__name__}.llama"),
}

__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy(__name__, _NAMES)
