"""Models shaped for the weight-pipeline engine, and :func:`load`, which picks one by name.

* ``tawpipe.models.llama``: the built-in LLaMA-style decoder and its presets;
* ``tawpipe.models.hf``: Hugging Face ``transformers`` decoders (optional dependency);
* ``tawpipe.models.parts``: :class:`ModelParts`, what both hand to the engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.nn as nn

from tawpipe.models.llama import (
    PRESETS,
    Block,
    Llama,
    LlamaConfig,
    block_forward,
    block_numel,
    embed_head_numel,
    llama_loss,
    llama_parts,
    num_params,
)
from tawpipe.models.parts import ModelParts


def check(spec: str) -> str:
    """What ``spec`` names: "preset", "llama-json" (LlamaConfig fields), "hf-dir" or "hf-json";
    otherwise ValueError saying what is wrong and what to pass. Reads at most a config file, so it
    can run before any process starts."""
    if spec in PRESETS:
        return "preset"
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {spec}: the directory has no config.json; pass a directory written "
                             "by save_pretrained")
        _hf_config(path / "config.json")
        return "hf-dir"
    if path.is_file():
        if path.suffix != ".json":
            raise ValueError(f"--model {spec}: a model config must be a .json file")
        doc = _read_json(path)
        if "model_type" in doc:
            _hf_config(path)
            return "hf-json"
        _llama_config(doc, path)
        return "llama-json"
    raise ValueError(f"unknown --model {spec!r}; choose one of {', '.join(sorted(PRESETS))}, a directory written "
                     "by save_pretrained, or a config .json file")


def load(spec: str, *, seed: int | None = None, device: torch.device | str = "cpu",
         compute_dtype: torch.dtype = torch.float32, layers: int | None = None,
         vocab_size: int | None = None, max_seq_len: int | None = None) -> ModelParts:
    """The model ``spec`` names, cut for the engine with only the replicated parts real.

    ``spec``: a built-in preset ("tiny", "paper-1024", ...), a Hugging Face ``save_pretrained``
    directory (weights read chunk by chunk; random init where it has only a config), or a config
    file: a Hugging Face config.json (random init), or a JSON object of ``LlamaConfig`` fields.
    ``layers``, ``vocab_size`` and ``max_seq_len`` override a built-in model's config (a Hugging
    Face config is used as written). ``seed`` keys the random initialisation.
    """
    kind = check(spec)
    if kind in ("hf-dir", "hf-json"):
        from tawpipe.models import hf

        opts = dict(seed=seed, device=device, compute_dtype=compute_dtype)
        return hf.from_pretrained(spec, **opts) if kind == "hf-dir" else hf.from_config(spec, **opts)
    cfg = _builtin_config(spec, kind, layers=layers, vocab_size=vocab_size, max_seq_len=max_seq_len)
    return llama_parts(cfg, seed=seed, device=device, compute_dtype=compute_dtype)


def meta_model(spec: str, *, layers: int | None = None, vocab_size: int | None = None,
               max_seq_len: int | None = None) -> tuple[list[nn.Module], nn.Module, nn.Module, int]:
    """The blocks, embed and head of the model ``spec`` names, all on the meta device, and its
    vocabulary: its shapes at no cost in memory, for checks before any process starts."""
    kind = check(spec)
    if kind in ("hf-dir", "hf-json"):
        from transformers import AutoConfig, AutoModelForCausalLM

        from tawpipe.models.hf import adapter_for

        config = AutoConfig.from_pretrained(Path(spec) / "config.json" if kind == "hf-dir" else spec)
        adapter = adapter_for(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return (list(model.get_submodule(adapter.layers)), adapter.embed_module(model), adapter.head_module(model),
                config.vocab_size)
    cfg = _builtin_config(spec, kind, layers=layers, vocab_size=vocab_size, max_seq_len=max_seq_len)
    with torch.device("meta"):
        model = Llama(cfg, seed=0)
    return list(model.blocks), model.embed, model.head, cfg.vocab_size


def check_weights(spec: str) -> None:
    """For a Hugging Face directory, every problem of its weight files that loading would meet
    (``tawpipe.models.hf.check_pretrained``: headers only, no tensor is read); ValueError, one line.
    Other specs have no weight files."""
    if check(spec) == "hf-dir":
        from tawpipe.models import hf

        hf.check_pretrained(spec)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the memory of activations depends on: hidden size, attention heads, vocabulary."""

    hidden: int
    heads: int
    vocab: int


def shape(spec: str, *, layers: int | None = None, vocab_size: int | None = None,
          max_seq_len: int | None = None) -> Shape:
    """The hidden size, heads and vocabulary of the model ``spec`` names (configs only)."""
    kind = check(spec)
    if kind in ("hf-dir", "hf-json"):
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(Path(spec) / "config.json" if kind == "hf-dir" else spec)
        return Shape(c.hidden_size, c.num_attention_heads, c.vocab_size)
    cfg = _builtin_config(spec, kind, layers=layers, vocab_size=vocab_size, max_seq_len=max_seq_len)
    return Shape(cfg.hidden, cfg.n_heads, cfg.vocab_size)


def _builtin_config(spec: str, kind: str, **overrides: int | None) -> LlamaConfig:
    base = dict(PRESETS[spec]) if kind == "preset" else dataclasses.asdict(_llama_config(_read_json(Path(spec)), Path(spec)))
    names = {"layers": "n_layers", "vocab_size": "vocab_size", "max_seq_len": "max_seq_len"}
    return LlamaConfig(**{**base, **{names[k]: v for k, v in overrides.items() if v is not None}})


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--model {path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--model {path}: expected a JSON object of config fields")
    return doc


def _llama_config(doc: dict, path: Path) -> LlamaConfig:
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(doc) - fields)
    if unknown:
        raise ValueError(f"--model {path}: unknown LlamaConfig fields {unknown}; known: {sorted(fields)} "
                         "(a Hugging Face config needs its model_type)")
    return LlamaConfig(**doc)


def _hf_config(path: Path) -> None:
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(f"--model {path} is a Hugging Face model: pip install 'tawpipe[hf]' "
                         "(transformers and safetensors)") from None
    from tawpipe.models.hf import adapter_for

    config = AutoConfig.from_pretrained(path)
    adapter_for(config).attention_kind(config)


__all__ = [
    "PRESETS",
    "Block",
    "Llama",
    "LlamaConfig",
    "ModelParts",
    "block_forward",
    "block_numel",
    "Shape",
    "check",
    "check_weights",
    "embed_head_numel",
    "llama_loss",
    "llama_parts",
    "load",
    "meta_model",
    "num_params",
    "shape",
]
