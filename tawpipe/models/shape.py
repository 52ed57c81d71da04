"""The one model-shape type of the plan, the cost model and the simulator, and its converters.

``ModelDims`` is a LLaMA-like decoder's shape with the batch it runs and the bytes its elements
take: everything the byte counts, the memory estimates and the compute model need, and nothing of
torch. ``from_hf_config`` reads a Hugging Face ``config.json``'s fields; ``LlamaConfig.dims``
(``models.llama``) gives the built-in model's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

LOSS_CHUNK_TOKENS = 2048  # tokens per slice of the chunked loss (``models.loss.linear_cross_entropy``)


@dataclass(frozen=True)
class ModelDims:
    """A LLaMA-like decoder (RMSNorm, SwiGLU, no biases; the head tied to the embedding unless
    ``tied`` is off)."""

    hidden: int
    layers: int
    heads: int = 32
    kv_heads: int | None = None  # None: multi-head attention (kv_heads = heads)
    vocab: int = 32000
    seq: int = 4096
    micro_batch: int = 1
    dtype_bytes: int = 2  # weights and activations on the wire
    grad_bytes: int = 4  # gradients on the wire
    ffn: int | None = None  # None: the LLaMA sizing of ``ffn_hidden``
    scores: bool = False  # attention keeps its S x S scores for backward: eager attention (not SDPA, the built-in's)
    tied: bool = True  # the head's weight is the embedding's (False: a second V x H matrix)
    head_dim: int | None = None  # None: hidden // heads (Qwen3's and Gemma's configs set their own)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("scores", "tied"):
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be true or false, got {value!r}")
            elif not (value is None and f.name in ("kv_heads", "ffn", "head_dim")) and (
                    not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{f.name} must be a whole number, got {value!r}")
        for name in ("hidden", "layers", "heads", "kv_heads", "vocab", "seq", "micro_batch", "dtype_bytes",
                     "grad_bytes", "ffn", "head_dim"):
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{name}={value}: every dimension of a model must be >= 1")
        kv = self.kv_groups
        if (self.head_dim is None and self.hidden % self.heads) or self.heads % kv:
            raise ValueError(f"hidden={self.hidden} must divide into heads={self.heads} (or give head_dim), which "
                             f"must divide into kv_heads={kv} groups")

    @property
    def ffn_hidden(self) -> int:
        return self.ffn if self.ffn is not None else 32 * -(-8 * self.hidden // 96)  # 32 * ceil((8H/3) / 32)

    @property
    def head_size(self) -> int:
        """Width of one head: ``head_dim`` where the config sets it, else H / heads."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def kv_groups(self) -> int:
        """Key/value heads: ``kv_heads``, or one per query head (multi-head attention)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): heads x head size."""
        return self.heads * self.head_size

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): key/value heads x head size."""
        return self.kv_groups * self.head_size

    @property
    def layer_numel(self) -> int:
        h = self.hidden
        return 2 * h * self.q_dim + 2 * h * self.kv_dim + 3 * h * self.ffn_hidden + 2 * h

    @property
    def decoder_numel(self) -> int:
        return self.layers * self.layer_numel

    @property
    def replicated_numel(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden  # embedding, head, final norm

    @property
    def activation_numel(self) -> int:
        return self.micro_batch * self.seq * self.hidden


# config.json field: ModelDims field (those without a default must be there)
_HF_FIELDS = {"hidden_size": "hidden", "num_hidden_layers": "layers", "num_attention_heads": "heads",
              "num_key_value_heads": "kv_heads", "vocab_size": "vocab", "intermediate_size": "ffn",
              "tie_word_embeddings": "tied", "head_dim": "head_dim"}
_HF_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def from_hf_config(doc: Any, where: str = "config.json", **batch: Any) -> ModelDims:
    """The shape a LLaMA-like Hugging Face ``config.json`` (its parsed JSON) describes, with
    ``batch``'s fields (seq, micro_batch, ...); ValueError naming ``where`` and the field otherwise."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object of config fields, got a {type(doc).__name__}")
    missing = [k for k in _HF_REQUIRED if k not in doc]
    if missing:
        raise ValueError(f"{where}: a LLaMA-like config needs {', '.join(map(repr, missing))}")
    try:
        return ModelDims(**{mine: doc[theirs] for theirs, mine in _HF_FIELDS.items() if doc.get(theirs) is not None},
                         **batch)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
