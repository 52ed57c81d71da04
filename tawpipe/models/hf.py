"""Hugging Face ``transformers`` decoders through TawPipe (design §8.3).

The decoder layers are the blocks. The token embedding and the head (final norm, then the LM
projection) are replicated; a tied LM projection is the embedding's own parameter, which the
engine counts once. The rotary tables, the position ids and the attention mask reach every layer
through ``block_context``, computed per micro-batch the way the family's own model computes them.

An :class:`Adapter` says where a family keeps these parts. The default fits the layout LLaMA,
Mistral, Qwen2, Qwen3, Gemma, Phi-3, OLMo, StarCoder2 and others share (``LLAMA_LAYOUT``).
Another family takes a few lines, overriding only what differs; ``examples/hf_custom_family.py``
adds IBM's Granite, whose embedding and logits are scaled::

    class GraniteAdapter(Adapter):
        def embed_module(self, model):
            return Scaled(super().embed_module(model), model.config.embedding_multiplier)

        def head_module(self, model):
            return Scaled(super().head_module(model), 1 / model.config.logits_scaling)

    register("granite", GraniteAdapter())

Three ways in. Each materialises, on a rank, only the replicated modules and (through the engine's
``materialize``) its own chunk:

* :func:`from_pretrained`: a local ``save_pretrained`` directory; safetensors are read tensor by
  tensor, so a rank reads only what it owns and the replicated weights;
* :func:`from_config`: random initialisation, every part from its own seeded stream
  (``tawpipe.models.seeding``), so a chunk initialised alone equals the same chunk of the whole
  model, whatever the topology; :func:`initialize` gives a whole model that same initialisation;
* :func:`from_model`: a model the caller built, on the meta device or real.

``ModelParts.checkpoint_name`` and ``save_config`` let ``tawpipe.io.safetensors.export`` write
the trained model back as a ``save_pretrained`` directory, each rank its own chunk.

Long sequences. A model whose layers all attend fully and causally (no sliding window) and without
attention dropout trains with context parallelism: :func:`from_model` routes its attention through
an implementation registered with transformers (``tawpipe+<its own>``) that calls the model's own
implementation on whole sequences and, while a layer computes a :class:`SequenceSlice` (which the
parts' ``block_forward`` sets for the layer's call, as layers need not pass it on), gathers the
keys and values and attends each run of the slice to the keys before it
(``models.attention.sliced_attention``).
A head that is the final norm and a bias-free projection has the chunked loss (``head_loss``).
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .attention import sliced_attention
from .llama import llama_loss
from .loss import linear_cross_entropy
from .parts import PART_NAMES, ModelParts, SequenceSlice
from .seeding import draw_seed, layer_part, seeded
from .weights import INDEX, SINGLE, SafetensorsCheckpoint, has_safetensors

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


class Head(nn.Module):
    """The final norm, then the LM projection: ``head(hidden) -> logits``."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


class Adapter:
    """Where a decoder family keeps TawPipe's parts, as submodule paths of its ``*ForCausalLM``.

    Override the paths, or the methods, where a family differs from the LLaMA layout.
    """

    embed = "model.embed_tokens"
    layers = "model.layers"
    norm = "model.norm"
    lm_head = "lm_head"
    rotary = "model.rotary_emb"

    def embed_module(self, model: PreTrainedModel) -> nn.Module:
        """The replicated ``embed``: tokens -> hidden states, as the family's model computes them."""
        return model.get_submodule(self.embed)

    def head_module(self, model: PreTrainedModel) -> nn.Module:
        """The replicated ``head``: last hidden states -> logits."""
        return Head(model.get_submodule(self.norm), model.get_submodule(self.lm_head))

    def init_parts(self) -> tuple[str, ...]:
        """Submodule paths, besides the layers, that random initialisation draws for, in order
        (each from its own stream; a part tied to an earlier one is skipped)."""
        return (self.embed, self.norm, self.lm_head, self.rotary)

    def attention_kind(self, config: PretrainedConfig) -> str:
        """"full_attention" or "sliding_attention": the one kind every layer uses."""
        kinds = set(getattr(config, "layer_types", None) or ())
        if len(kinds) > 1:
            raise ValueError(
                f"this {config.model_type} model mixes attention kinds across layers ({sorted(kinds)}); "
                "tawpipe runs every chunk through one layer template, so all layers must use the same "
                "kind: set layer_types (or use_sliding_window / max_window_layers) so they agree"
            )
        if kinds:
            return kinds.pop()
        return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"

    def context(self, model: PreTrainedModel, hidden: torch.Tensor,
                position_ids: torch.Tensor) -> dict[str, Any]:
        """The keyword arguments every layer takes besides the hidden states.

        ``hidden`` stands in for the embeddings: only its shape, dtype and device are used.
        """
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        sliding = self.attention_kind(model.config) == "sliding_attention"
        make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
        mask = make_mask(config=model.config, inputs_embeds=hidden, attention_mask=None,
                         past_key_values=None, position_ids=position_ids)
        rotary = model.get_submodule(self.rotary)
        return {"attention_mask": mask, "position_ids": position_ids,
                "position_embeddings": rotary(hidden, position_ids)}

    def sliced_context(self, model: PreTrainedModel, hidden: torch.Tensor, seq: SequenceSlice) -> dict[str, Any]:
        """``context`` for the tokens of a slice ``seq`` of a sequence (context parallelism): the
        rotary tables at the slice's positions and no mask (the attention that :func:`from_model`
        routes attends causally by position). The tables are the whole sequence's, cut: a rotary
        whose frequencies follow the sequence's length (dynamic NTK, LongRoPE) must see the whole
        length on every member, not its slice's last position."""
        whole = torch.arange(seq.seq_len, device=hidden.device).unsqueeze(0)
        positions = seq.positions.to(hidden.device)
        rotary = model.get_submodule(self.rotary)
        return {"attention_mask": None, "position_ids": positions.unsqueeze(0),
                "position_embeddings": tuple(t[:, positions] for t in rotary(hidden, whole))}

    def context_parallel_refusal(self, config: PretrainedConfig) -> str | None:
        """Why this model cannot attend from a slice of the sequence (None: it can)."""
        if self.attention_kind(config) != "full_attention":
            return f"its sliding-window attention ({getattr(config, 'sliding_window', None)} tokens)"
        if getattr(config, "attention_dropout", 0.0):
            return (f"its attention dropout ({config.attention_dropout}), which the sliced attention does not "
                    "draw: set attention_dropout=0")
        return None

    def block_forward(self, block: nn.Module, hidden: torch.Tensor, **ctx: Any) -> torch.Tensor:
        """One layer; older layers return a tuple whose first element is the hidden states."""
        out = block(hidden, **ctx)
        return out[0] if isinstance(out, tuple) else out


class DroppedEmbeddingAdapter(Adapter):
    """A family whose model drops out the embeddings (``config.embedding_dropout``, StarCoder2's)
    before the first layer, outside the layers: the replicated ``embed`` does it too."""

    def embed_module(self, model: PreTrainedModel) -> nn.Module:
        embed = super().embed_module(model)
        p = getattr(model.config, "embedding_dropout", 0.0)
        return nn.Sequential(embed, nn.Dropout(p)) if p else embed


# Families laid out like LLaMA, each checked against its own model's logits, whole and sliced (tests/test_hf.py)
LLAMA_LAYOUT = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo", "olmo2", "starcoder2", "stablelm",
                "smollm3", "glm4", "ernie4_5")
ADAPTERS: dict[str, Adapter] = {t: Adapter() for t in LLAMA_LAYOUT}
ADAPTERS["starcoder2"] = DroppedEmbeddingAdapter()


def register(model_type: str, adapter: Adapter) -> None:
    """Train models whose ``config.model_type`` is ``model_type`` with ``adapter``."""
    if not isinstance(adapter, Adapter):
        raise TypeError(f"adapter must be a tawpipe.models.hf.Adapter, got {type(adapter).__name__}")
    ADAPTERS[model_type] = adapter


def adapter_for(config: PretrainedConfig) -> Adapter:
    adapter = ADAPTERS.get(config.model_type)
    if adapter is None:
        raise ValueError(
            f"no tawpipe adapter for model_type {config.model_type!r} (have {sorted(ADAPTERS)}); if it is "
            f"laid out like LLaMA, register('{config.model_type}', Adapter()) from tawpipe.models.hf, or "
            "subclass Adapter where it differs (see examples/hf_custom_family.py)"
        )
    return adapter


# ---------------------------------------------------------------------------------- building


def from_pretrained(path: str | os.PathLike[str], **kwargs: Any) -> ModelParts:
    """A local ``save_pretrained`` directory: its config, and its safetensors weights when it has
    any (random initialisation otherwise). ``kwargs`` as for :func:`from_model`."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: pass a directory written by save_pretrained")
    return from_config(path / "config.json", checkpoint=_checkpoint(path), **kwargs)


def _checkpoint(path: Path) -> SafetensorsCheckpoint | None:
    """The directory's safetensors weights; None where it holds none (random initialisation)."""
    if has_safetensors(path):
        return SafetensorsCheckpoint(path)
    bins = sorted(p.name for p in path.glob("*.bin"))
    if bins:
        more = ", ..." if len(bins) > 2 else ""
        raise ValueError(f"{path} holds PyTorch .bin weights ({', '.join(bins[:2])}{more}); "
                         "tawpipe reads safetensors only: convert them once with transformers, "
                         f"AutoModelForCausalLM.from_pretrained('{path}').save_pretrained('{path}', "
                         "safe_serialization=True)")
    stray = sorted(p.name for p in path.glob("*.safetensors"))
    if stray:
        raise ValueError(f"{path} holds {', '.join(stray[:2])}{', ...' if len(stray) > 2 else ''} but neither "
                         f"{SINGLE} nor {INDEX}: copy the index that came with the shards into it, or save "
                         "the model again with save_pretrained")
    return None


def check_pretrained(path: str | os.PathLike[str]) -> None:
    """Everything :func:`from_pretrained` would refuse in a ``save_pretrained`` directory, found
    before any process starts and without reading a tensor: .bin-only weights; shards the index
    names that are absent or lie outside the directory; damaged or truncated files; tensors the
    config's model lacks, has in other shapes, or layers beyond the config's (ValueError, one
    line, naming the file and the fix)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    checkpoint = _checkpoint(path)
    if checkpoint is None:
        return
    checkpoint.verify()
    config = AutoConfig.from_pretrained(path)
    adapter = adapter_for(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    blocks = list(model.get_submodule(adapter.layers))
    names = _NameMap(model, adapter, adapter.embed_module(model), adapter.head_module(model))
    prefix = adapter.layers + "."
    layers = {int(n[len(prefix):].split(".", 1)[0]) for n in checkpoint.names()
              if n.startswith(prefix) and n[len(prefix):].split(".", 1)[0].isdigit()}
    if layers and max(layers) >= len(blocks):
        raise ValueError(f"{path} holds weights of {max(layers) + 1} layers ({prefix}0 to {prefix}{max(layers)}) "
                         f"but its config.json builds {len(blocks)}: training would drop layers "
                         f"{len(blocks)}-{max(layers)}; set num_hidden_layers to {max(layers) + 1} in config.json")
    names.check(checkpoint)


def from_config(config: PretrainedConfig | str | os.PathLike[str], *,
                checkpoint: SafetensorsCheckpoint | None = None, **kwargs: Any) -> ModelParts:
    """A model built on the meta device from ``config`` (a ``PretrainedConfig`` or a config.json
    file); weights from ``checkpoint`` or seeded random initialisation. ``kwargs`` as for
    :func:`from_model`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not hasattr(config, "model_type"):
        config = AutoConfig.from_pretrained(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return from_model(model, checkpoint=checkpoint, **kwargs)


def from_model(model: PreTrainedModel, *, device: torch.device | str = "cpu",
               compute_dtype: torch.dtype = torch.float32, seed: int | None = None,
               checkpoint: SafetensorsCheckpoint | None = None, adapter: Adapter | None = None) -> ModelParts:
    """Cut ``model`` into the engine's parts.

    Meta-device parts are materialised: the replicated ones here, the blocks by the engine for its
    own chunk only. Their weights come from ``checkpoint``, else from seeded random
    initialisation (``seed`` None: drawn from the global torch RNG, so every rank must seed it
    alike). Real parts are used as they are; the replicated modules (and the rotary tables) move
    to ``device`` in float32, in place. Where the model can attend from a slice of the sequence
    (``Adapter.context_parallel_refusal``), its config's attention implementation becomes
    ``tawpipe+<its own>``, which runs its own on whole sequences (module doc). Every check runs
    here, before any communication.
    """
    adapter = adapter or adapter_for(model.config)
    refusal = adapter.context_parallel_refusal(model.config)  # also refuses mixed attention kinds now
    if refusal is None:
        model.config._attn_implementation = _sliceable(model.config._attn_implementation or "eager")
    device = torch.device(device)
    seed = draw_seed() if seed is None else seed
    blocks = list(model.get_submodule(adapter.layers))
    embed, head = adapter.embed_module(model), adapter.head_module(model)
    names = _NameMap(model, adapter, embed, head)
    if checkpoint is not None:
        names.check(checkpoint)
    rotary = model.get_submodule(adapter.rotary)
    _materialize_parts(model, adapter, [embed, head, rotary], seed, checkpoint, names)
    for m in (embed, head, rotary):
        m.to(device=device, dtype=torch.float32)  # the engine keeps replicated weights in float32

    def materialize(block: nn.Module, index: int) -> nn.Module:
        real = copy.deepcopy(block)  # the model keeps its meta block: no second copy of the chunk
        _empty_on_cpu([real])
        with seeded(seed, layer_part(index)):  # also gives buffers a checkpoint does not hold their values
            _init_module(model, real, set())
        if checkpoint is not None:
            prefix = f"{adapter.layers}.{index}."
            _load(real, checkpoint, {n: [prefix + n] for n, _ in real.named_parameters()})
        return real

    def stand_in(tokens: torch.Tensor) -> torch.Tensor:  # the embeddings' shape, dtype and device
        return torch.zeros((), dtype=compute_dtype, device=device).expand(*tokens.shape, model.config.hidden_size)

    def block_context(tokens: torch.Tensor) -> dict[str, Any]:
        return adapter.context(model, stand_in(tokens), torch.arange(tokens.shape[1], device=device).unsqueeze(0))

    def sliced_context(tokens: torch.Tensor, seq: SequenceSlice) -> dict[str, Any]:
        return {**adapter.sliced_context(model, stand_in(tokens), seq), "seq": seq}

    def block_forward(block: nn.Module, hidden: torch.Tensor, **ctx: Any) -> torch.Tensor:
        seq = ctx.pop("seq", None)
        if seq is None:
            return adapter.block_forward(block, hidden, **ctx)
        return _sliced_layer(adapter, block, hidden, seq, ctx)

    def save_config(directory: Path, dtype: torch.dtype) -> None:
        config = copy.deepcopy(model.config)
        config.dtype = dtype
        config.save_pretrained(directory)

    source = f"weights from {checkpoint.path}" if checkpoint is not None else f"random init, seed {seed}"
    unsliceable = "" if refusal is None else f"; no context parallelism: {refusal}"
    return ModelParts(
        blocks=blocks, embed=embed, head=head, loss_fn=llama_loss, block_forward=block_forward,
        block_context=block_context, sliced_context=sliced_context if refusal is None else None,
        materialize=materialize if any(p.is_meta for b in blocks for p in b.parameters()) else None,
        vocab_size=model.config.vocab_size,
        description=f"{type(model).__name__} ({model.config.model_type}, {len(blocks)} layers, {source}{unsliceable})",
        config=model.config.to_dict(), checkpoint_name=names.checkpoint_name, save_config=save_config,
        head_loss=chunked_head_loss if has_chunked_loss(head) else None,
    )


def context_parallel_refusal(config: PretrainedConfig) -> str | None:
    """Why a model of ``config`` cannot attend from a slice of the sequence, as its family's
    adapter says (None: it trains with context parallelism)."""
    return adapter_for(config).context_parallel_refusal(config)


def has_chunked_loss(head: nn.Module) -> bool:
    """Whether ``head`` is the final norm and a bias-free projection, whose loss
    :func:`chunked_head_loss` computes without the logits (an adapter's own head may scale them)."""
    return type(head) is Head and type(head.lm_head) is nn.Linear and head.lm_head.bias is None


def chunked_head_loss(head: Head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``llama_loss(head(hidden), targets)`` without the [tokens, vocabulary] float32 logits
    (``models.loss.linear_cross_entropy``): the engine's ``head_loss`` for long sequences."""
    return linear_cross_entropy(head.norm(hidden), head.lm_head.weight, targets)


@torch.no_grad()
def initialize(model: PreTrainedModel, seed: int, adapter: Adapter | None = None) -> None:
    """Draw every weight of a real ``model`` from its part's stream: the initialisation that
    :func:`from_config` gives chunk by chunk, for a whole-model reference."""
    adapter = adapter or adapter_for(model.config)
    done: set[int] = set()
    for i, layer in enumerate(model.get_submodule(adapter.layers)):
        with seeded(seed, layer_part(i)):
            _init_module(model, layer, done)
    for part in adapter.init_parts():
        with seeded(seed, part):
            _init_module(model, model.get_submodule(part), done)


# ---------------------------------------------------------------------------------- helpers


def _sliceable(base: str) -> str:
    """The attention implementation ``tawpipe+<base>`` (registered with transformers on first use):
    ``base`` on whole sequences, :func:`sliced_attention` on a slice's tokens (module doc). The
    masks of whole sequences are ``base``'s."""
    if base.startswith("tawpipe+"):
        return base  # routed already (the same model cut twice)
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"tawpipe+{base}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, functools.partial(_attention, base))
        if base in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


@dataclass
class _Slicing:
    """The slice a layer is computing (``_SLICING``) and how often its attention attended from it."""

    seq: SequenceSlice
    calls: int = 0


_SLICING: ContextVar[_Slicing | None] = ContextVar("tawpipe_slicing", default=None)


def _sliced_layer(adapter: Adapter, block: nn.Module, hidden: torch.Tensor, seq: SequenceSlice,
                  ctx: dict[str, Any]) -> torch.Tensor:
    """One layer on a slice's tokens: its routed attention reads the slice from ``_SLICING`` (a
    layer need not pass keyword arguments on to its attention, and some do not). A layer whose
    attention never came is refused: it would have attended within the slice alone."""
    slicing = _Slicing(seq)
    token = _SLICING.set(slicing)
    try:
        out = adapter.block_forward(block, hidden, **ctx)
    finally:
        _SLICING.reset(token)
    if slicing.calls == 0:
        raise RuntimeError(f"{type(block).__name__} did not call its attention through transformers' "
                           "AttentionInterface, so it cannot attend from a slice of the sequence: train this family "
                           "with context_parallel=1")
    return out


def _attention(base: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, *, scaling: float | None = None, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Transformers' attention call: queries (B, heads, tokens, d), keys and values (B, kv heads,
    tokens, d) -> output (B, tokens, heads, d) and no weights. No dropout on a slice:
    ``context_parallel_refusal`` leaves a model with attention dropout unrouted."""
    slicing = _SLICING.get()
    if slicing is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        # "eager" is no entry of transformers' interface: each family's module has its own function
        eager = sys.modules[type(module).__module__].eager_attention_forward if base == "eager" else None
        return ALL_ATTENTION_FUNCTIONS.get_interface(base, eager)(module, query, key, value, attention_mask,
                                                                  scaling=scaling, dropout=dropout, **kwargs)
    slicing.calls += 1
    return sliced_attention(query, key, value, slicing.seq, scaling).transpose(1, 2).contiguous(), None


class _NameMap:
    """Engine parameter names <-> checkpoint names, found by identity on the (meta) model before
    anything is materialised; a tied parameter has several checkpoint names."""

    def __init__(self, model: nn.Module, adapter: Adapter, embed: nn.Module, head: nn.Module) -> None:
        by_id: dict[int, list[str]] = {}
        self.shapes: dict[int, torch.Size] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
            self.shapes[id(p)] = p.shape
        self.by_id = by_id
        parts = ((PART_NAMES[0], embed), (PART_NAMES[2], head))
        self.replicated = {f"{prefix}.{n}": by_id[id(p)] for prefix, m in parts
                           for n, p in m.named_parameters(remove_duplicate=False)}
        self.layers = adapter.layers

    def checkpoint_name(self, engine_name: str) -> str:
        """The name ``save_pretrained`` gives the parameter the engine calls ``engine_name``."""
        if engine_name.startswith(PART_NAMES[1] + "."):
            return self.layers + engine_name[len(PART_NAMES[1]):]
        return self.replicated[engine_name][0]

    def check(self, checkpoint: SafetensorsCheckpoint) -> None:
        """Every parameter under one of its names, with its shape (headers only)."""
        have = checkpoint.names()
        chosen, missing = {}, []
        for pid, options in self.by_id.items():
            found = [n for n in options if n in have]
            if found:
                chosen[found[0]] = self.shapes[pid]
            else:
                missing.append(options[0])
        if missing:
            raise ValueError(f"{checkpoint.path} lacks {len(missing)} of the model's tensors (first: "
                             f"{sorted(missing)[:3]}): is it a checkpoint of this model and config?")
        wrong = sorted((n, checkpoint.shape(n), tuple(shape)) for n, shape in chosen.items()
                       if checkpoint.shape(n) != tuple(shape))
        if wrong:
            name, got, want = wrong[0]
            raise ValueError(f"{checkpoint.path}: {len(wrong)} tensors have other shapes than the config says, "
                             f"e.g. {name} is {got}, expected {want}: the config and the weights disagree; use the "
                             "config.json saved with these weights")


def _empty_on_cpu(modules: Iterable[nn.Module]) -> None:
    """Give every meta parameter and buffer of ``modules`` real, uninitialised float CPU memory,
    keeping shared parameters shared (a tied embedding stays tied)."""
    real: dict[int, torch.Tensor] = {}
    for module in modules:
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for name, t in table.items():
                    if t is None or not t.is_meta:
                        continue
                    if id(t) not in real:
                        dtype = torch.float32 if t.is_floating_point() else t.dtype
                        new = torch.empty_like(t, device="cpu", dtype=dtype)
                        real[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
                    table[name] = real[id(t)]


def _init_module(model: PreTrainedModel, module: nn.Module, done: set[int]) -> None:
    """The family's own ``_init_weights`` on every submodule, except those whose parameters were
    all drawn by an earlier part (a tied LM head)."""
    for sub in module.modules():
        own = list(sub.parameters(recurse=False))
        if own and all(id(p) in done for p in own):
            continue
        for p in own:  # re-draw even what transformers marked as initialised (loaded weights)
            p.__dict__.pop("_is_hf_initialized", None)
        model._init_weights(sub)
        done.update(id(p) for p in own)


def _load(module: nn.Module, checkpoint: SafetensorsCheckpoint, options: dict[str, list[str]]) -> None:
    """Copy each parameter of ``module`` from the first of its checkpoint names that exists."""
    have = checkpoint.names()
    pick = {n: next(c for c in cands if c in have) for n, cands in options.items()}
    tensors = checkpoint.read(pick.values())
    params = dict(module.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for n, c in pick.items():
            params[n].copy_(tensors[c])


def _is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def _materialize_parts(model: PreTrainedModel, adapter: Adapter, modules: list[nn.Module], seed: int,
                       checkpoint: SafetensorsCheckpoint | None, names: _NameMap) -> None:
    """Materialise the replicated modules and the rotary tables on the CPU: seeded random
    initialisation part by part, then the checkpoint's weights where there is one."""
    parts = [part for part in adapter.init_parts() if _is_meta(model.get_submodule(part))]
    if not parts:
        return
    _empty_on_cpu(modules)
    done: set[int] = set()
    for part in parts:
        with seeded(seed, part):
            _init_module(model, model.get_submodule(part), done)
    if checkpoint is not None:
        for prefix, m in ((PART_NAMES[0], modules[0]), (PART_NAMES[2], modules[1])):
            _load(m, checkpoint, {n: names.replicated[f"{prefix}.{n}"]
                                  for n, _ in m.named_parameters(remove_duplicate=False)})
