"""A LLaMA-style decoder, split so that a weight-pipeline engine can hold its parts separately.

The model is three pieces plus a per-sequence context:

* ``model.embed``  — token embedding, ``embed(tokens) -> hidden`` (replicated by the engine);
* ``model.blocks`` — ``nn.ModuleList`` of structurally identical :class:`Block` s, each
  ``block(h, cos, sin) -> h`` (the pipelined weights; identical structure lets one flat buffer
  layout serve every block);
* ``model.head``   — final RMSNorm + LM projection, ``head(h) -> logits`` (replicated). When
  embeddings are tied, ``head.out.weight`` *is* ``embed.weight``;
* ``model.block_context(seq_len, device)`` — the RoPE tables every block needs, passed to
  :func:`block_forward` as keyword arguments.

Blocks carry no layer index and no buffers, so any block can run with any other block's weights.
Every part draws its initial weights from its own seeded stream, so :func:`llama_parts` can leave
the blocks on the meta device and each rank materialises only its own chunk. The architecture is
Hugging Face's ``LlamaForCausalLM`` (:func:`hf_name`, :func:`hf_config`), which is how a trained
model is exported.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention import sliced_attention
from .loss import linear_cross_entropy
from .parts import ModelParts, SequenceSlice
from .presets import PRESETS
from .seeding import draw_seed, generator, layer_part
from .shape import ModelDims


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    hidden: int = 128
    n_layers: int = 8
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int | None = None  # None: 32 * ceil((8 * hidden / 3) / 32), the LLaMA sizing
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.ffn_hidden is None:
            self.ffn_hidden = 32 * math.ceil(8 * self.hidden / 3 / 32)
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A built-in model of ``models.presets``; ``overrides`` replace fields (a preset without
        its own ffn size follows a new hidden)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls.from_dims(PRESETS[name], **overrides)

    @classmethod
    def from_dims(cls, dims: ModelDims, **overrides: Any) -> LlamaConfig:
        """The built-in model of the shape ``dims``, sized for ``dims.seq`` tokens."""
        return cls(**{**dict(vocab_size=dims.vocab, hidden=dims.hidden, n_layers=dims.layers, n_heads=dims.heads,
                             n_kv_heads=dims.kv_groups, ffn_hidden=dims.ffn, max_seq_len=dims.seq,
                             tie_embeddings=dims.tied),
                      **overrides})

    def dims(self, **batch: Any) -> ModelDims:
        """This model's shape as the cost model and the simulator count it, with ``batch``'s
        fields (seq, micro_batch, dtype_bytes, ...)."""
        return ModelDims(hidden=self.hidden, layers=self.n_layers, heads=self.n_heads, kv_heads=self.n_kv_heads,
                         vocab=self.vocab_size, ffn=self.ffn_hidden, tied=self.tie_embeddings, **batch)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares is taken in float32: in bf16 it loses too many bits.
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of position * frequency, each (seq_len, head_dim // 2), float32.

    Angles are formed in float64 so that large positions keep their precision.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device)
                         / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of ``x`` (B, heads, T, d) by their position's angles.

    Done in float32 and cast back, so low-precision activations still rotate accurately.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: query head i reads key/value head i // (n_heads / n_kv)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seq: SequenceSlice | None = None) -> torch.Tensor:
        """``x`` the tokens of a whole sequence, or of ``seq``'s slice of one: its queries then
        attend to the whole sequence's keys and values, which ``seq.gather`` brings."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # each token rotated by its own position
        if seq is None:
            # enable_gqa lets SDPA share each K/V head across its query group without copying it.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        else:
            y = sliced_attention(q, k, v, seq)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder layer; holds weights only, the RoPE tables come in as arguments."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seq: SequenceSlice | None = None) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), cos, sin, seq)
        return h + self.mlp(self.mlp_norm(h))


def block_forward(block: nn.Module, hidden: torch.Tensor, **ctx: Any) -> torch.Tensor:
    """The engine's hook for running one block with the context from ``block_context`` (or
    ``sliced_context``)."""
    return block(hidden, ctx["cos"], ctx["sin"], ctx.get("seq"))


class Head(nn.Module):
    """Final RMSNorm followed by the projection to vocabulary logits."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.out = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(h))


class Llama(nn.Module):
    """The whole model; also the reference that single-process tests train.

    ``seed`` keys every part's initial weights (``tawpipe.models.seeding``): the embedding, each
    block and the head draw from their own streams, so block i is the same whether the model is
    built whole or a rank builds only its own chunk. ``None`` draws the seed from the global torch
    RNG, so ``torch.manual_seed(s)`` before construction still fixes the model. With
    ``meta_blocks=True`` the blocks are built on the meta device and :meth:`materialize` (the
    engine's hook) builds one with its initial weights, on the CPU, when a rank asks for it.
    """

    def __init__(self, cfg: LlamaConfig, seed: int | None = None, *, meta_blocks: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.seed = draw_seed() if seed is None else seed
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        with torch.device("meta") if meta_blocks else nullcontext():
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.out.weight = self.embed.weight
        # Kept off the module (not buffers) so .to()/.half() never move or round them, and built
        # on the CPU explicitly so a model constructed under torch.device("meta") still has them.
        self._rope = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device="cpu")
        self._rope_cache: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw every weight from its part's stream; parameters on the meta device are skipped.

        Residual-branch outputs get std / sqrt(2 * n_layers) so the residual stream's variance
        does not grow with depth. Norm weights are 1.
        """
        std = self.config.init_std
        _normal_(self.embed.weight, std, generator(self.seed, "embed"))
        for i, block in enumerate(self.blocks):
            self._init_block(block, i)
        self.head.norm.weight.fill_(1.0)
        if not self.config.tie_embeddings:
            _normal_(self.head.out.weight, std, generator(self.seed, "head"))

    def _init_block(self, block: Block, index: int) -> None:
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        g = generator(self.seed, layer_part(index))
        for name, p in block.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                _normal_(p, out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std, g)

    @torch.no_grad()
    def materialize(self, block: nn.Module, index: int) -> Block:
        """Block ``index`` with its initial weights, on the CPU (the engine's ``materialize``)."""
        with torch.device("meta"):
            real = Block(self.config).to_empty(device="cpu")  # no default init: every weight is drawn below
        self._init_block(real, index)
        return real

    def block_context(self, seq_len: int, device: torch.device | str,
                      dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Keyword arguments every block needs for a sequence of ``seq_len`` tokens.

        ``dtype`` None keeps the tables in float32 (the rotation is computed in float32 anyway).
        """
        if not 0 < seq_len <= self.config.max_seq_len:
            raise ValueError(f"seq_len={seq_len} outside 1..max_seq_len="
                             f"{self.config.max_seq_len}")
        key = (torch.device(device), dtype or torch.float32)
        if key not in self._rope_cache:
            self._rope_cache[key] = tuple(t.to(device=key[0], dtype=key[1]) for t in self._rope)
        cos, sin = self._rope_cache[key]
        return {"cos": cos[:seq_len], "sin": sin[:seq_len]}

    def sliced_context(self, seq: SequenceSlice, device: torch.device | str,
                       dtype: torch.dtype | None = None) -> dict[str, Any]:
        """``block_context`` for the tokens of a slice of a sequence (context parallelism): the
        RoPE tables at the slice's positions, and the slice, through which attention sees the
        whole sequence."""
        whole = self.block_context(seq.seq_len, device, dtype)
        at = seq.positions.to(whole["cos"].device)
        return {"cos": whole["cos"][at], "sin": whole["sin"][at], "seq": seq}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Single-device reference: (B, T) int64 tokens -> (B, T, vocab) logits."""
        h = self.embed(tokens)
        ctx = self.block_context(tokens.shape[1], tokens.device)
        for block in self.blocks:
            h = block_forward(block, h, **ctx)
        return self.head(h)


def _normal_(p: torch.Tensor, std: float, g: torch.Generator) -> None:
    """Fill ``p`` from N(0, std^2) drawn in float32 on the CPU (the same numbers on any device);
    a meta parameter is left alone."""
    if p.is_meta:
        return
    if p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous():
        p.normal_(0.0, std, generator=g)  # the same draws as into a fresh float32 CPU tensor
    else:
        p.copy_(torch.empty(p.shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=g))


def llama_parts(cfg: LlamaConfig, *, seed: int | None = None, device: torch.device | str = "cpu",
                compute_dtype: torch.dtype = torch.float32) -> ModelParts:
    """The model cut for the engine: blocks on the meta device (each rank materialises its own
    chunk), embedding and head real on ``device``, RoPE tables in ``compute_dtype``."""
    model = Llama(cfg, seed, meta_blocks=True)
    model.embed.to(device)
    model.head.to(device)
    return ModelParts(
        blocks=model.blocks, embed=model.embed, head=model.head, loss_fn=llama_loss, block_forward=block_forward,
        block_context=lambda tokens: model.block_context(tokens.shape[1], device, compute_dtype),
        sliced_context=lambda tokens, seq: model.sliced_context(seq, device, compute_dtype),
        materialize=model.materialize, vocab_size=cfg.vocab_size,
        description=(f"built-in LLaMA ({cfg.n_layers} layers, hidden {cfg.hidden}, {cfg.n_heads} heads / "
                     f"{cfg.n_kv_heads} KV, vocabulary {cfg.vocab_size}, seed {model.seed})"),
        config=dataclasses.asdict(cfg),
        checkpoint_name=hf_name,
        save_config=lambda directory, dtype: hf_config(cfg, dtype).save_pretrained(directory),
        head_loss=chunked_head_loss,
    )


_HF_BLOCK = {"attn_norm": "input_layernorm", "attn": "self_attn", "mlp_norm": "post_attention_layernorm"}
_HF_REPLICATED = {"embed.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight",
                  "head.out.weight": "lm_head.weight"}


def hf_name(name: str) -> str:
    """The Hugging Face ``LlamaForCausalLM`` name of this model's parameter ``name``."""
    if name.startswith("blocks."):
        _, layer, part, rest = name.split(".", 3)
        return f"model.layers.{layer}.{_HF_BLOCK.get(part, part)}.{rest}"
    return _HF_REPLICATED[name]


def hf_config(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> Any:
    """The ``transformers.LlamaConfig`` of the same architecture (same RoPE pairing, norms, SwiGLU)."""
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, hidden_act="silu",
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std, dtype=dtype,
    )


def llama_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position, computed in float32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def chunked_head_loss(head: Head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``llama_loss(head(hidden), targets)`` without the [tokens, vocabulary] float32 logits
    (``models.loss.linear_cross_entropy``): the engine's ``head_loss`` for long sequences."""
    return linear_cross_entropy(head.norm(hidden), head.out.weight, targets)


def num_params(model: Llama, *, exclude_embedding: bool = False) -> int:
    """Distinct parameters (a tied embedding counts once); optionally without ``embed.weight``.

    With tied embeddings, excluding the embedding also excludes the head projection (same tensor).
    """
    total = sum(p.numel() for p in model.parameters())
    return total - model.embed.weight.numel() if exclude_embedding else total


def block_numel(cfg: LlamaConfig) -> int:
    """Parameters in one :class:`Block`, from the config alone (for sizing weight buffers)."""
    q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = cfg.hidden * q_out + 2 * cfg.hidden * kv_out + q_out * cfg.hidden
    return attn + 3 * cfg.hidden * cfg.ffn_hidden + 2 * cfg.hidden


def embed_head_numel(cfg: LlamaConfig) -> int:
    """Distinct parameters in ``embed`` + ``head`` together (the replicated part)."""
    table = cfg.vocab_size * cfg.hidden
    return table + cfg.hidden + (0 if cfg.tie_embeddings else table)
