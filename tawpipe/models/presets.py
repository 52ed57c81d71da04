"""The built-in models by name: the one registry that ``tawpipe train``, ``plan``, ``simulate`` and
``bench`` read (``--model NAME``).

Each is a ``ModelDims``: LLaMA-like, the embedding tied to the head but in LLaMA 2's 7B, 13B and
70B, which have their own output matrix (``tied=False``). ``seq`` is the sequence the
model is sized for (its rotary tables); every command replaces it with the one it runs.
"""

from __future__ import annotations

from .shape import ModelDims

PRESETS: dict[str, ModelDims] = {
    # Byte-level models small enough to train on a CPU.
    "micro": ModelDims(hidden=64, layers=4, heads=4, kv_heads=2, vocab=256, seq=64),
    "tiny": ModelDims(hidden=128, layers=8, heads=4, kv_heads=2, vocab=256, seq=256),
    # The TawPipe code's script.py model, which its 24-GPU run trains.
    "paper": ModelDims(hidden=1024, layers=24, heads=32, vocab=32000),
    # The paper's model family: 48 layers, 32 heads (no GQA), 32k vocabulary.
    "paper-1024": ModelDims(hidden=1024, layers=48, heads=32, vocab=32000, seq=2048),
    "paper-2048": ModelDims(hidden=2048, layers=48, heads=32, vocab=32000, seq=2048),
    "paper-4096": ModelDims(hidden=4096, layers=48, heads=32, vocab=32000, seq=2048),
    # LLaMA shapes (Touvron et al. 2023: LLaMA 2, untied; Llama 3.2 1B, tied).
    "1b": ModelDims(hidden=2048, layers=16, heads=32, kv_heads=8, vocab=128256, ffn=8192),
    "7b": ModelDims(hidden=4096, layers=32, heads=32, vocab=32000, ffn=11008, tied=False),
    "13b": ModelDims(hidden=5120, layers=40, heads=40, vocab=32000, ffn=13824, tied=False),
    "70b": ModelDims(hidden=8192, layers=80, heads=64, kv_heads=8, vocab=32000, ffn=28672, tied=False),
}
