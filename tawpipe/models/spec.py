"""What a ``--model`` names, and the model it builds: a built-in model (``models.presets``), a
Hugging Face ``save_pretrained`` directory or ``config.json``, or a JSON object of ``LlamaConfig``
fields. ``check`` and ``dims`` read at most a config file and need no torch; ``load`` and
``meta_model`` build the model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .presets import PRESETS
from .shape import ModelDims, from_hf_config

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from .llama import LlamaConfig
    from .parts import ModelParts


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
    raise _unknown(spec)


def _unknown(spec: str) -> ValueError:
    """The error for a ``spec`` that names nothing: a path that does not exist is said to be missing
    (not an unknown model's name), a bare name is told the models there are."""
    if any(sep in spec for sep in ("/", "\\")) or spec.endswith(".json") or spec.startswith(("~", ".")):
        return ValueError(f"--model {spec}: no such file or directory; give the path of a config .json file or of "
                          f"a directory written by save_pretrained, or a built-in model ({', '.join(PRESETS)})")
    return ValueError(f"unknown --model {spec!r}; choose one of {', '.join(PRESETS)}, a directory written "
                      "by save_pretrained, or a config .json file")


def dims(spec: str, **batch: Any) -> ModelDims:
    """The shape of the model ``spec`` names, with ``batch``'s fields (seq, micro_batch,
    dtype_bytes, ...): read from the registry or the config file alone, without torch or
    transformers; ValueError naming the file and the field where it is not a model's config."""
    if spec in PRESETS:
        return dataclasses.replace(PRESETS[spec], **batch)
    path = Path(spec, "config.json") if Path(spec).is_dir() else Path(spec)
    if not path.is_file():
        raise _unknown(spec)
    doc = _read_json(path)
    if "model_type" in doc or "hidden_size" in doc:
        return from_hf_config(doc, f"--model {path}", **batch)
    config = _llama_config(doc, path)
    try:
        return config.dims(**batch)
    except ValueError as e:
        raise ValueError(f"--model {path}: {e}") from None


def load(spec: str, *, seed: int | None = None, device: torch.device | str = "cpu",
         compute_dtype: torch.dtype | None = None, layers: int | None = None,
         vocab_size: int | None = None, max_seq_len: int | None = None) -> ModelParts:
    """The model ``spec`` names, cut for the engine with only the replicated parts real.

    ``spec``: a built-in preset ("tiny", "paper-1024", ...), a Hugging Face ``save_pretrained``
    directory (weights read chunk by chunk; random init where it has only a config), or a config
    file: a Hugging Face config.json (random init), or a JSON object of ``LlamaConfig`` fields.
    ``layers``, ``vocab_size`` and ``max_seq_len`` override a built-in model's config (a Hugging
    Face config is used as written). ``seed`` keys the random initialisation; ``compute_dtype``
    defaults to float32.
    """
    import torch

    from .llama import llama_parts

    compute_dtype = torch.float32 if compute_dtype is None else compute_dtype
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
    import torch

    from .llama import Llama

    kind = check(spec)
    if kind in ("hf-dir", "hf-json"):
        from transformers import AutoModelForCausalLM

        from tawpipe.models.hf import adapter_for

        config = hf_config(spec)
        adapter = adapter_for(config)
        with _no_random_fill_on_meta(), torch.device("meta"):  # the device's mode above this one
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return (list(model.get_submodule(adapter.layers)), adapter.embed_module(model), adapter.head_module(model),
                config.vocab_size)
    cfg = _builtin_config(spec, kind, layers=layers, vocab_size=vocab_size, max_seq_len=max_seq_len)
    with _no_random_fill_on_meta(), torch.device("meta"):  # the device's mode above this one
        model = Llama(cfg, seed=0)
    return list(model.blocks), model.embed, model.head, cfg.vocab_size


def _no_random_fill_on_meta() -> torch.overrides.TorchFunctionMode:
    """A mode in which initialisation (``torch.nn.init``, and the tensors' random fills) leaves
    meta tensors as they are: they hold no values, and torch runs them on meta through Python
    references that import ``torch._dynamo`` (2.5 s of CPU, most of ``tawpipe train``'s checks)."""
    import torch
    from torch.overrides import TorchFunctionMode

    fills = {getattr(torch.Tensor, f) for f in ("normal_", "uniform_", "erfinv_", "exponential_", "bernoulli_",
                                                 "random_", "log_normal_", "cauchy_", "geometric_")}

    class NoRandomFillOnMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            init = func in fills or getattr(func, "__module__", None) == "torch.nn.init"  # every one fills in place
            tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
            if init and isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
            return func(*args, **kwargs)

    return NoRandomFillOnMeta()


def check_weights(spec: str) -> None:
    """For a Hugging Face directory, every problem of its weight files that loading would meet
    (``tawpipe.models.hf.check_pretrained``: headers only, no tensor is read); ValueError, one line.
    Other specs have no weight files."""
    if check(spec) == "hf-dir":
        from tawpipe.models import hf

        hf.check_pretrained(spec)


def _builtin_config(spec: str, kind: str, **overrides: int | None) -> LlamaConfig:
    from .llama import LlamaConfig

    base = LlamaConfig.preset(spec) if kind == "preset" else _llama_config(_read_json(Path(spec)), Path(spec))
    names = {"layers": "n_layers", "vocab_size": "vocab_size", "max_seq_len": "max_seq_len"}
    return dataclasses.replace(base, **{names[k]: v for k, v in overrides.items() if v is not None})


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--model {path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--model {path}: expected a JSON object of config fields")
    return doc


def _llama_config(doc: dict, path: Path) -> LlamaConfig:
    from .llama import LlamaConfig

    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(doc) - fields)
    if unknown:
        raise ValueError(f"--model {path}: unknown LlamaConfig fields {unknown}; known: {sorted(fields)} "
                         "(a Hugging Face config needs its model_type)")
    try:
        return LlamaConfig(**doc)
    except (TypeError, ValueError) as e:  # a field of the wrong type, or shapes that do not divide
        raise ValueError(f"--model {path}: {e}") from None


def hf_config(spec: str | Path) -> PretrainedConfig:
    """The Hugging Face config of the model ``spec`` names: a ``save_pretrained`` directory's
    config.json, or the file itself; ValueError where transformers is not installed."""
    path = Path(spec)
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(f"--model {path} is a Hugging Face model: pip install 'tawpipe[hf]' "
                         "(transformers and safetensors)") from None
    return AutoConfig.from_pretrained(path / "config.json" if path.is_dir() else path)


def _hf_config(path: Path) -> None:
    """Whether tawpipe can train the Hugging Face model of config ``path``: ValueError if not."""
    from tawpipe.models.hf import adapter_for

    config = hf_config(path)
    adapter_for(config).attention_kind(config)
