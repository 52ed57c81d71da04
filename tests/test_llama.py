"""The LLaMA decoder: shapes, causality, attention/RoPE maths, the engine split, init, sizes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tawpipe.models.llama import (
    Llama,
    LlamaConfig,
    apply_rope,
    block_forward,
    block_numel,
    embed_head_numel,
    llama_loss,
    num_params,
)


def micro(**overrides) -> Llama:
    return Llama(LlamaConfig.preset("micro", **overrides))


def tokens(cfg: LlamaConfig, batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, seq))


def test_shapes_of_every_part():
    model = micro()
    cfg = model.config
    x = tokens(cfg, batch=3, seq=17)
    h = model.embed(x)
    assert h.shape == (3, 17, cfg.hidden)
    ctx = model.block_context(17, "cpu")
    assert ctx["cos"].shape == ctx["sin"].shape == (17, cfg.head_dim // 2)
    assert block_forward(model.blocks[0], h, **ctx).shape == h.shape
    assert model.head(h).shape == (3, 17, cfg.vocab_size)
    assert model(x).shape == (3, 17, cfg.vocab_size)


def test_future_tokens_do_not_change_earlier_logits():
    model = micro()
    x = tokens(model.config, seq=20)
    t = 11
    y = x.clone()
    y[:, t] = (x[:, t] + 1 + torch.randint(0, 254, (x.shape[0],))) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().amax() > 1e-3


def _reference_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as complex multiplication of (x[:d/2] + i x[d/2:]) by exp(i * pos * freq)."""
    t, d = x.shape[-2], x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(t, d // 2, dtype=torch.float64),
                      torch.arange(t, dtype=torch.float64)[:, None] * freq)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double()) * rot
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


def _reference_attention(attn: nn.Module, x: torch.Tensor, cfg: LlamaConfig,
                         expand) -> torch.Tensor:
    """Causal attention with K/V heads explicitly expanded to one per query head."""
    b, t, _ = x.shape
    d, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    q = (x @ attn.q_proj.weight.T).view(b, t, nh, d).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T).view(b, t, nkv, d).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T).view(b, t, nkv, d).transpose(1, 2)
    q, k = _reference_rope(q, cfg.rope_theta), _reference_rope(k, cfg.rope_theta)
    k, v = expand(k, nh // nkv), expand(v, nh // nkv)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    y = scores.softmax(-1) @ v
    return y.transpose(1, 2).reshape(b, t, nh * d) @ attn.o_proj.weight.T


def test_gqa_matches_repeat_kv_reference():
    model = micro(n_heads=4, n_kv_heads=2)
    cfg = model.config
    attn = model.blocks[1].attn
    x = torch.randn(2, 19, cfg.hidden)
    ctx = model.block_context(19, "cpu")
    with torch.no_grad():
        got = attn(x, ctx["cos"], ctx["sin"])
        want = _reference_attention(attn, x, cfg, lambda kv, g: kv.repeat_interleave(g, dim=1))
        # The wrong grouping (head i reading kv head i % n_kv) must be told apart.
        wrong = _reference_attention(attn, x, cfg, lambda kv, g: kv.repeat(1, g, 1, 1))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (got - wrong).abs().amax() > 1e-3


def test_rope_preserves_norms():
    model = micro()
    ctx = model.block_context(40, "cpu")
    x = torch.randn(3, 2, 40, model.config.head_dim)
    rotated = apply_rope(x, ctx["cos"], ctx["sin"])
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(rotated[:, :, 1:], x[:, :, 1:])  # position 0 is the identity


def test_rope_score_depends_only_on_offset():
    model = micro()
    d = model.config.head_dim
    ctx = model.block_context(64, "cpu")
    q, k = torch.randn(d), torch.randn(d)

    def score(m: int, n: int) -> torch.Tensor:
        qm = apply_rope(q.view(1, 1, 1, d), ctx["cos"][m:m + 1], ctx["sin"][m:m + 1])
        kn = apply_rope(k.view(1, 1, 1, d), ctx["cos"][n:n + 1], ctx["sin"][n:n + 1])
        return (qm * kn).sum()

    for shift in (1, 17, 40):
        torch.testing.assert_close(score(5 + shift, 2 + shift), score(5, 2), rtol=1e-4,
                                   atol=1e-5)
    assert (score(5, 2) - score(5, 3)).abs() > 1e-4


def test_tied_head_shares_the_embedding_parameter():
    model = micro(tie_embeddings=True)
    assert model.head.out.weight is model.embed.weight
    replicated = nn.ModuleList([model.embed, model.head])
    assert len(list(replicated.parameters())) == 2  # embed/out weight once, final norm once
    x = tokens(model.config)
    llama_loss(model(x), tokens(model.config)).backward()
    assert model.embed.weight.grad is model.head.out.weight.grad

    untied = micro(tie_embeddings=False)
    assert untied.head.out.weight is not untied.embed.weight
    assert not torch.equal(untied.head.out.weight, untied.embed.weight)


def test_blocks_have_identical_structure():
    model = micro()
    layouts = [[(n, p.shape, p.dtype) for n, p in b.named_parameters()] for b in model.blocks]
    assert all(layout == layouts[0] for layout in layouts)
    assert [n for n, _ in model.blocks[0].named_buffers()] == []
    assert not torch.equal(model.blocks[0].attn.q_proj.weight, model.blocks[1].attn.q_proj.weight)


def test_embed_blocks_head_by_hand_equals_forward():
    model = micro()
    x = tokens(model.config, seq=31)
    with torch.no_grad():
        h = model.embed(x)
        ctx = model.block_context(x.shape[1], x.device)
        for block in model.blocks:
            h = block_forward(block, h, **ctx)
        assert torch.equal(model.head(h), model(x))


def test_bfloat16_forward_tracks_float32():
    model = micro()
    x = tokens(model.config, seq=16)
    with torch.no_grad():
        want = model(x)
        half = micro().to(torch.bfloat16)
        half.load_state_dict(model.state_dict())
        h = half.embed(x)
        ctx = half.block_context(16, "cpu", dtype=torch.bfloat16)
        assert ctx["cos"].dtype == torch.bfloat16
        for block in half.blocks:
            h = block_forward(block, h, **ctx)
        got = half.head(h)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


def test_loss_is_mean_token_cross_entropy():
    logits = torch.randn(3, 7, 11)
    targets = torch.randint(0, 11, (3, 7))
    nll = -logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(llama_loss(logits, targets), nll.mean())


def test_adamw_lowers_loss_on_a_repeated_batch():
    model = micro()
    x = tokens(model.config, batch=4, seq=32)
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = llama_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), rel=0.1)
    assert losses[-1] < 0.4 * losses[0]


def test_same_seed_same_model_and_init_statistics():
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    a = Llama(LlamaConfig.preset("tiny"))
    torch.manual_seed(seed)
    b = Llama(LlamaConfig.preset("tiny"))
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(),
                                                 b.state_dict().values()))
    # A chunk cut out of one model equals the same chunk of its twin.
    for i in (2, 3):
        for p, q in zip(a.blocks[i].parameters(), b.blocks[i].parameters()):
            assert torch.equal(p, q)

    cfg = a.config
    assert all(torch.equal(p, torch.ones_like(p))
               for n, p in a.named_parameters() if n.endswith("norm.weight"))
    out = torch.cat([torch.cat([blk.attn.o_proj.weight.flatten(),
                                blk.mlp.down_proj.weight.flatten()]) for blk in a.blocks])
    inner = torch.cat([blk.attn.q_proj.weight.flatten() for blk in a.blocks])
    assert out.std().item() == pytest.approx(cfg.init_std / math.sqrt(2 * cfg.n_layers), rel=0.03)
    assert inner.std().item() == pytest.approx(cfg.init_std, rel=0.03)
    assert a.embed.weight.std().item() == pytest.approx(cfg.init_std, rel=0.03)


@pytest.mark.parametrize("name, expected, rel", [
    ("paper-1024", 640e6, 0.005),
    ("paper-4096", 9.81e9, 0.001),
])
def test_paper_param_counts_on_meta(name, expected, rel):
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset(name))
    cfg = model.config
    assert model.embed.weight.is_meta
    assert num_params(model) == pytest.approx(expected, rel=rel)
    assert num_params(model) == cfg.n_layers * block_numel(cfg) + embed_head_numel(cfg)
    assert num_params(model, exclude_embedding=True) == (num_params(model)
                                                         - cfg.vocab_size * cfg.hidden)


@pytest.mark.parametrize("tie", [True, False])
def test_numel_helpers_match_modules(tie):
    model = micro(tie_embeddings=tie, n_kv_heads=1, ffn_hidden=96)
    cfg = model.config
    assert block_numel(cfg) == sum(p.numel() for p in model.blocks[0].parameters())
    replicated = nn.ModuleList([model.embed, model.head])
    assert embed_head_numel(cfg) == sum(p.numel() for p in replicated.parameters())


def test_config_sizes_and_validation():
    assert LlamaConfig.preset("paper-1024").ffn_hidden == 2752
    assert LlamaConfig.preset("paper-4096").ffn_hidden == 10944
    cfg = LlamaConfig.preset("tiny", hidden=96)
    assert cfg.ffn_hidden == 32 * math.ceil(8 * 96 / 3 / 32) and cfg.n_layers == 8
    with pytest.raises(ValueError, match="unknown preset"):
        LlamaConfig.preset("huge")
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig.preset("micro", n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads"):
        LlamaConfig.preset("micro", hidden=66)
    with pytest.raises(ValueError, match="max_seq_len"):
        micro().block_context(65, "cpu")


@pytest.mark.parametrize("nodes, per_node, layers", [(2, 2, 8), (1, 4, 6), (3, 1, 7), (1, 1, 3)])
def test_each_rank_materialises_its_chunk_as_the_whole_model_has_it(nodes, per_node, layers):
    """Meta blocks + materialize, rank by rank, give exactly the whole model's blocks (any topology,
    uneven chunks too), and the replicated modules are the whole model's."""
    from tawpipe.plan.schedule import build_plan
    from tawpipe.plan.topology import Topology

    seed = int(torch.randint(0, 2**31, ()))
    cfg = LlamaConfig.preset("micro", n_layers=layers, tie_embeddings=layers % 2 == 0)
    whole = Llama(cfg, seed)
    plan = build_plan(Topology(nodes, per_node), layers, 1)
    covered = []
    for rank in range(nodes * per_node):
        lazy = Llama(cfg, seed, meta_blocks=True)
        assert all(p.is_meta for p in lazy.blocks.parameters())
        for n in ("embed.weight", "head.norm.weight", "head.out.weight"):
            assert torch.equal(lazy.get_parameter(n), whole.get_parameter(n))
        start, stop = plan.chunk_layers[plan.own_chunk(rank)]
        for i in range(start, stop):
            real = lazy.materialize(lazy.blocks[i], i)
            for (n, p), q in zip(real.named_parameters(), whole.blocks[i].parameters()):
                assert torch.equal(p, q), (rank, i, n)
            covered.append(i)
    assert sorted(covered) == list(range(layers))
    assert not torch.equal(Llama(cfg, seed + 1).blocks[0].attn.q_proj.weight, whole.blocks[0].attn.q_proj.weight)


def test_built_in_model_is_hugging_face_llama():
    """The export names and config describe the same function: transformers' LlamaForCausalLM
    with these weights computes these logits."""
    transformers = pytest.importorskip("transformers")
    from tawpipe.models.llama import hf_config, hf_name

    for tie in (True, False):
        model = micro(tie_embeddings=tie, n_kv_heads=1)
        ref = transformers.LlamaForCausalLM(hf_config(model.config)).eval()
        missing, unexpected = ref.load_state_dict({hf_name(n): p for n, p in model.named_parameters()}, strict=False)
        assert not unexpected and missing == (["lm_head.weight"] if tie else [])
        x = tokens(model.config, seq=64)
        with torch.no_grad():
            torch.testing.assert_close(ref(x).logits, model(x), rtol=0, atol=2e-5)
