"""Hugging Face models through TawPipe: the parts compute what the model computes, 2x2 training
matches single-process Hugging Face training, exported directories load with from_pretrained,
each rank reads and materialises only its own chunk, and bad input is refused up front."""

from __future__ import annotations

import copy
import json
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tawpipe.runtime.launch import run_local
from tawpipe.models import hf  # noqa: E402
from tawpipe.models.parts import parts_signature
from tawpipe.models.weights import SafetensorsCheckpoint
from tawpipe.plan.topology import Topology
import hf_cases  # noqa: E402
from engine_cases import adamw, make_engine, train_alone  # noqa: E402
from test_engine_errors import NoComm  # noqa: E402

transformers.logging.set_verbosity_error()
VOCAB = 101
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)


def small(cls, layers: int = 4, **kw):
    return cls(**{**SMALL, "num_hidden_layers": layers, **kw})


FAMILIES = {
    "llama": (LlamaForCausalLM, small(LlamaConfig, tie_word_embeddings=False)),
    "qwen2": (Qwen2ForCausalLM, small(Qwen2Config, tie_word_embeddings=True)),
    "qwen3": (Qwen3ForCausalLM, small(Qwen3Config, head_dim=16)),  # not hidden / heads: queries 64 wide
    "mistral-sliding": (MistralForCausalLM, small(MistralConfig, sliding_window=5)),
    **{t: (AutoModelForCausalLM.from_config, AutoConfig.for_model(t, **SMALL, num_hidden_layers=3, pad_token_id=0))
       for t in hf.LLAMA_LAYOUT if t not in ("llama", "mistral", "qwen2", "qwen3")},
}


def saved(tmp_path, name: str, **save_kw):
    cls, config = FAMILIES[name]
    model = cls(config)  # transformers' own random init (global RNG)
    model.save_pretrained(tmp_path / name, **save_kw)
    return model, tmp_path / name


def parts_logits(parts, tokens: torch.Tensor) -> torch.Tensor:
    """The model run part by part, the way the engine composes it (every block materialised)."""
    h = parts.embed(tokens)
    ctx = parts.block_context(tokens)
    for i, block in enumerate(parts.blocks):
        real = parts.materialize(block, i) if parts.materialize else block
        h = parts.block_forward(real, h, **ctx)
    return parts.head(h)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@torch.no_grad()
def test_parts_compute_the_models_logits(tmp_path, name):
    # A sharded checkpoint (index + 3 files) for one family, a single file for the others.
    model, path = saved(tmp_path, name, **({"max_shard_size": "20KB"} if name == "llama" else {}))
    assert (path / "model.safetensors.index.json").is_file() == (name == "llama")
    parts = hf.from_pretrained(path)
    tokens = torch.randint(0, VOCAB, (3, 13))
    want = model.eval()(tokens).logits
    torch.testing.assert_close(parts_logits(parts, tokens), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@torch.no_grad()
def test_seeded_meta_initialisation_equals_the_whole_models(name):
    """``from_config`` builds each part from its own seeded stream on the meta device: the parts
    compute what the whole model computes after ``hf.initialize`` with the same seed (nothing of a
    family's layers, buffers included, is left uninitialised)."""
    cls, config = FAMILIES[name]
    whole = cls(config).eval()
    hf.initialize(whole, 11)
    parts = hf.from_config(config, seed=11)
    tokens = torch.randint(0, VOCAB, (2, 9))
    torch.testing.assert_close(parts_logits(parts, tokens), whole(tokens).logits, rtol=0, atol=2e-6)


def group_logits(parts, tokens: torch.Tensor, degree: int) -> torch.Tensor:
    """The model run part by part as a context group of ``degree`` runs it, a thread per member:
    each takes its mirrored slice of every sequence, and ``gather`` puts every member's keys and
    values back in sequence order (a barrier in place of the exchange)."""
    from tawpipe.engine.context import slice_positions
    from tawpipe.models.parts import SequenceSlice, position_runs

    seq_len = tokens.shape[1]
    at = [slice_positions(seq_len, degree, i) for i in range(degree)]
    shared: dict[int, tuple[torch.Tensor, ...]] = {}
    barrier = threading.Barrier(degree, timeout=60)
    logits = torch.empty(*tokens.shape, VOCAB)
    blocks = [parts.materialize(b, i) if parts.materialize else b for i, b in enumerate(parts.blocks)]

    def member(i: int) -> None:
        def gather(*own: torch.Tensor) -> tuple[torch.Tensor, ...]:
            shared[i] = own
            barrier.wait()
            whole = []
            for j, t in enumerate(own):
                w = t.new_empty(*t.shape[:-2], seq_len, t.shape[-1])
                for m in range(degree):
                    w[..., at[m], :] = shared[m][j]
                whole.append(w)
            barrier.wait()  # every member has read this layer's shares
            return tuple(whole)

        mine = tokens[:, at[i]]
        with torch.no_grad():  # grad mode is per thread
            ctx = parts.sliced_context(mine, SequenceSlice(at[i], seq_len, gather, position_runs(at[i])))
            h = parts.embed(mine)
            for block in blocks:
                h = parts.block_forward(block, h, **ctx)
            logits[:, at[i]] = parts.head(h)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(degree)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return logits


@pytest.mark.parametrize("name", sorted(n for n in FAMILIES if n != "mistral-sliding"))
@torch.no_grad()
def test_a_context_group_computes_the_models_logits(tmp_path, name):
    """Every family whose layers attend fully: its layers pass the slice through to the routed
    attention, and two or four members, each on its slice, give the whole model's logits."""
    model, path = saved(tmp_path, name)
    parts = hf.from_pretrained(path)
    tokens = torch.randint(0, VOCAB, (2, 16))
    want = model.eval()(tokens).logits
    for degree in (2, 4):
        torch.testing.assert_close(group_logits(parts, tokens, degree), want, rtol=0, atol=2e-6)


@torch.no_grad()
def test_a_context_group_attends_with_the_layers_own_scaling():
    """A family may scale its attention scores otherwise than by 1/sqrt(head_dim) (Granite's
    attention_multiplier, Gemma 2's query_pre_attn_scalar): the routed attention on a slice scales
    by the layer's own ``scaling``, and a context group gives the whole model's logits."""
    cls, config = FAMILIES["llama"]
    model = cls(copy.deepcopy(config)).eval()
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.2  # not 1/sqrt(8)
    tokens = torch.randint(0, VOCAB, (2, 16))
    want = model(tokens).logits
    parts = hf.from_model(model)
    torch.testing.assert_close(group_logits(parts, tokens, 2), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [3.0] * 4,
                                   "original_max_position_embeddings": 12}])
def test_a_members_rotary_tables_are_the_whole_sequences_at_its_positions(rope):
    """Rotaries whose frequencies follow the sequence's length (dynamic NTK past
    max_position_embeddings, LongRoPE past the original length): a member of a context group, a
    process of its own, sees the whole sequence's length, not its slice's last position."""
    from tawpipe.engine.context import slice_positions
    from tawpipe.models.parts import SequenceSlice, position_runs

    config = small(LlamaConfig, layers=1, max_position_embeddings=8 if rope["rope_type"] == "dynamic" else 32,
                   rope_scaling=rope)
    tokens = torch.randint(0, VOCAB, (2, 16))
    for degree in (2, 4):
        for i in range(degree):
            whole = hf.from_model(LlamaForCausalLM(config)).block_context(tokens)["position_embeddings"]
            at = slice_positions(16, degree, i)
            parts = hf.from_model(LlamaForCausalLM(config))  # a fresh rotary, as on another rank
            got = parts.sliced_context(tokens[:, at], SequenceSlice(at, 16, None, position_runs(at)))
            for g, w in zip(got["position_embeddings"], whole):
                torch.testing.assert_close(g, w[:, at], rtol=0, atol=0)


def test_a_layer_whose_attention_bypasses_the_interface_is_refused_on_a_slice():
    """A family whose layers compute attention without transformers' dispatch would attend within
    its slice alone: the layer's call is refused instead of computing that."""
    from tawpipe.models.parts import SequenceSlice, position_runs

    cls, config = FAMILIES["llama"]
    parts = hf.from_model(cls(config))
    block = parts.blocks[0]
    block.self_attn.forward = lambda hidden_states, **kw: (hidden_states.flip(1), None)  # its own attention
    at = torch.tensor([0, 1, 6, 7])
    tokens = torch.randint(0, VOCAB, (1, 4))
    seq = SequenceSlice(at, 8, lambda *kv: pytest.fail("no exchange was asked for"), position_runs(at))
    with pytest.raises(RuntimeError, match="LlamaDecoderLayer did not call its attention through transformers' "
                                           "AttentionInterface.*context_parallel=1"):
        parts.block_forward(block, parts.embed(tokens), **parts.sliced_context(tokens, seq))


@torch.no_grad()
def test_routed_attention_leaves_whole_sequences_as_the_model_computes_them():
    """``from_model`` routes a real model's attention through ``tawpipe+<its own>``: its own
    forward, and the parts', give the logits they gave before, bit for bit, for each of
    transformers' implementations; cutting it twice routes it once."""
    for impl in ("sdpa", "eager"):
        config = small(Qwen3Config, head_dim=8)
        config._attn_implementation = impl
        model = Qwen3ForCausalLM(config).eval()
        tokens = torch.randint(0, VOCAB, (2, 12))
        want = model(tokens).logits
        parts = hf.from_model(model)
        hf.from_model(model)
        assert model.config._attn_implementation == f"tawpipe+{impl}"
        assert torch.equal(model(tokens).logits, want)
        assert torch.equal(parts_logits(parts, tokens), want)


def test_chunked_head_loss_equals_the_plain_loss_of_the_logits():
    cls, config = FAMILIES["llama"]
    parts = hf.from_model(cls(config))
    assert parts.head_loss is hf.chunked_head_loss
    hidden = torch.randn(3, 7, SMALL["hidden_size"], requires_grad=True)
    targets = torch.randint(0, VOCAB, (3, 7))
    got = parts.head_loss(parts.head, hidden, targets)
    want = parts.loss_fn(parts.head(hidden), targets)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    params = [hidden, *parts.head.parameters()]
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # a head an adapter scales has no chunked loss: its logits are not the projection's
    assert not hf.has_chunked_loss(nn.Sequential(parts.head))


@pytest.mark.parametrize("recompute", ["none", "chunk"])
def test_embedding_dropout_trains_as_the_familys_model(tmp_path, recompute):
    """StarCoder2's model drops out the embeddings before its first layer: the engine's ``embed``
    does too, drawing the masks transformers' training draws (one rank, the same generator), and
    exports under the model's names."""
    from tawpipe.io.safetensors import export

    config = AutoConfig.for_model("starcoder2", **SMALL, num_hidden_layers=2, pad_token_id=0, embedding_dropout=0.5)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "in")
    g = torch.Generator().manual_seed(2)
    tokens = [torch.randint(0, VOCAB, (2, 13), generator=g) for _ in range(3)]
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    torch.manual_seed(1)
    want, _ = train_alone(AutoModelForCausalLM.from_pretrained(tmp_path / "in", dtype=torch.float32).train(),
                          batches.__getitem__, lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()),
                          len(batches), None)
    want_after = torch.rand(4)
    parts = hf.from_pretrained(tmp_path / "in")
    engine = make_engine(parts, topology=Topology(1, 1), micro_batches=1, comm=NoComm(1), optimizer=adamw,
                         recompute=recompute)
    torch.manual_seed(1)
    for batch in batches:
        engine.step(batch)
    after = torch.rand(4)
    export(engine, parts, tmp_path / "out")
    engine.close()
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    for n, p in want.state_dict().items():
        torch.testing.assert_close(got[n], p, rtol=0, atol=1e-6, msg=n)
    assert torch.equal(after, want_after)


def _train_reference(path, batches, max_grad_norm=None):
    """Single-process Hugging Face training on whole sequences with the same AdamW as the ranks."""
    model, losses = train_alone(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), batches.__getitem__,
                                lambda out, y: F.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten()),
                                len(batches), max_grad_norm)
    return model.eval(), losses


def _hf_names(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's gathered names, spelled as Hugging Face's (LLaMA layout)."""
    fixed = {"embed.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight",
             "head.lm_head.weight": "lm_head.weight"}
    return {fixed.get(n, n.replace("blocks.", "model.layers.", 1)): torch.from_numpy(t) for n, t in full.items()}


TOPOLOGIES = [(2, 2), (1, 4), (4, 1)]
PAPER = dict(mb_per_fetch=1, prefetch_depth=1, reuse_weights=False)
SLICED = [  # context parallelism: family, engine options (rows per micro-batch: 2, 16 tokens)
    ("llama", dict(nodes=2, acc=2, context_parallel=2, chunked_loss=True, max_grad_norm=0.05, **PAPER)),
    ("qwen3", dict(nodes=1, acc=1, context_parallel=4, recompute="layer", **PAPER)),  # q/k norms, head_dim 16
    ("qwen2", dict(nodes=2, acc=2, context_parallel=2, replicas=2, recompute="block")),  # tied, biases
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local 4-rank job for the distributed tests: LLaMA (untied) and Qwen2 (tied, biases)
    trained on 2 nodes x 2 ranks for 3 AdamW steps in fp32 and exported; and a 6-layer Qwen2
    built on the meta device under three topologies (4 ranks: uneven chunks)."""
    tmp_path = tmp_path_factory.mktemp("hf")
    cases, refs = [], {}
    for name in ("llama", "qwen2"):
        model, path = saved(tmp_path, name)
        micro_batches, rows = 2, 2
        batches = []
        for _ in range(3):
            x = torch.randint(0, VOCAB, (4 * micro_batches * rows, 11))
            batches.append((x, torch.randint(0, VOCAB, x.shape)))
        cases.append({"dir": str(path), "export": str(tmp_path / f"{name}-trained"), "micro_batches": micro_batches,
                      "batches": batches})
        refs[name] = batches
    # An earlier save in the export directory, which transformers would load before the index.
    (tmp_path / "llama-trained").mkdir()
    model.save_pretrained(tmp_path / "llama-trained")
    seed = int(torch.randint(0, 2**31, ()))
    config = small(Qwen2Config, layers=6, tie_word_embeddings=True)
    sliced = []
    for name, options in SLICED:
        _, path = saved(tmp_path / "sliced", name)
        groups = 4 // options["context_parallel"]  # each context group its own rows
        x = torch.randint(0, VOCAB, (2, groups * options["acc"] * 2, 16))
        sliced.append({"dir": str(path), "batches": list(zip(x, torch.randint(0, VOCAB, x.shape))), **options})
    results = run_local(hf_cases.train_export_and_meta_init, 4, cases, config, seed, TOPOLOGIES, sliced)
    return {"cases": cases, "refs": refs, "train": [r["train"] for r in results],
            "meta": [r["meta"] for r in results], "seed": seed, "config": config,
            "sliced_cases": sliced, "sliced": [r["sliced"] for r in results]}


@pytest.mark.parametrize("i, name", [(0, "llama"), (1, "qwen2")])
def test_2x2_training_matches_single_process_hf_and_export_loads(cluster, i, name):
    case = cluster["cases"][i]
    ref, ref_losses = _train_reference(case["dir"], cluster["refs"][name])
    ranks = [r[i] for r in cluster["train"]]
    # The global mean loss of every step, on every rank.
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    # Each rank read and materialised only its own layers and the replicated tensors.
    replicated = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for r in ranks:
        start, stop = r["own_layers"]
        assert r["asked"] == list(range(start, stop))
        own = {n for n in r["read"] if n.startswith("model.layers.")}
        assert {int(n.split(".")[2]) for n in own} == set(range(start, stop))
        assert set(r["read"]) - own <= replicated and "model.embed_tokens.weight" in r["read"]
    # Trained weights: the exported directory equals the single-process reference and holds
    # exactly what the engine holds; both give the same logits.
    exported = AutoModelForCausalLM.from_pretrained(case["export"], dtype=torch.float32).eval()
    index = json.loads((Path(case["export"]) / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 5  # 4 chunk shards + the replicated one
    assert sorted(p.name for p in Path(case["export"]).glob("*.safetensors")) == sorted(set(index["weight_map"].values()))
    want = dict(ref.named_parameters())
    for n, p in exported.named_parameters():
        torch.testing.assert_close(p, want[n], rtol=0, atol=1e-5, msg=lambda m, n=n: f"{name} {n}: {m}")
    engine_model = type(ref)(ref.config).eval()
    engine_model.load_state_dict(_hf_names(ranks[0]["full"]), strict=False)
    assert all(torch.equal(p, dict(engine_model.named_parameters())[n]) for n, p in exported.named_parameters())
    tokens = torch.randint(0, VOCAB, (2, 17))
    with torch.no_grad():
        got = exported(tokens).logits
        assert torch.equal(got, engine_model(tokens).logits)
        torch.testing.assert_close(got, ref(tokens).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("i", range(len(SLICED)))
def test_context_parallel_training_equals_single_process_hf_on_whole_sequences(cluster, i):
    """Each context group's ranks split every sequence, their attention routed through
    ``tawpipe+sdpa`` (sliced on a slice, the model's own on whole sequences); the losses and the
    trained weights equal transformers' own training on whole sequences."""
    name, options = SLICED[i]
    assert_sliced_training_matches(cluster["sliced_cases"][i], [r[i] for r in cluster["sliced"]],
                                   options.get("max_grad_norm"), name)


def assert_sliced_training_matches(case: dict, ranks: list[dict], max_grad_norm: float | None, name: str) -> None:
    """``hf_cases.train_sliced``'s results for ``case`` against transformers' own training on whole
    sequences: every rank's losses, its K/V bytes against the cost model's, rank 0's weights."""
    ref, ref_losses = _train_reference(case["dir"], case["batches"], max_grad_norm)
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        # the keys and values crossed the group (the sliced attention ran), as many bytes as the cost
        # model counts from the config's shape (Qwen3's head size is not H / heads)
        assert r["exchanged"] == r["planned"] > 0, (r["exchanged"], r["planned"])
    want = ref.state_dict()  # a tied projection under both names, as the gathered state has it
    got = _hf_names(ranks[0]["full"])
    assert set(got) == set(want)
    # The weights to 1e-4: AdamW's first steps divide each gradient element by its own size, so the
    # rounding of small elements (attention's, behind Qwen3's q/k norms) shows as up to ~3e-5 of a
    # tensor, without context parallelism too (2e-6); the losses above hold a wrong attention to 1e-5.
    for n, p in got.items():
        if n.endswith("k_proj.bias"):  # its true gradient is 0 (a shift of every score of a query): AdamW
            torch.testing.assert_close(p, want[n], rtol=0, atol=1e-5)  # steps on rounding noise, lr-sized
        else:
            err = ((p - want[n]).norm() / want[n].norm()).item()
            assert err <= 1e-4, (name, n, err)


def test_meta_init_gives_each_chunk_the_whole_models_weights_on_any_topology(cluster):
    """Every rank materialises only its own layers, and they equal the whole model's, initialised
    part by part with the same seed, whatever the topology."""
    seed, config = cluster["seed"], cluster["config"]
    whole = Qwen2ForCausalLM(config)
    hf.initialize(whole, seed)
    want = {**{f"blocks.{n[len('model.layers.'):]}": p for n, p in whole.named_parameters()
               if n.startswith("model.layers.")},
            "embed.weight": whole.model.embed_tokens.weight, "head.norm.weight": whole.model.norm.weight}
    for t, topology in enumerate(TOPOLOGIES):
        covered = set()
        for r in cluster["meta"]:
            res = r[t]
            start, stop = res["own_layers"]
            assert res["asked"] == list(range(start, stop))
            covered |= set(range(start, stop))
            for n, p in res["params"].items():
                assert torch.equal(torch.from_numpy(p), want[n].detach()), (topology, n)
        assert covered == set(range(6))
    # transformers' own scheme, drawn per part: it depends on the seed.
    assert whole.model.layers[0].self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.15)
    other = Qwen2ForCausalLM(config)
    hf.initialize(other, seed + 1)
    assert not torch.equal(other.model.layers[0].mlp.up_proj.weight, whole.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_with_one_rank_materialises_every_block_once(tmp_path, dtype):
    _, path = saved(tmp_path, "qwen2")
    parts = hf.from_pretrained(path, compute_dtype=dtype)
    asked: list[int] = []
    hf_cases._spy_materialize(parts, asked)
    engine = make_engine(parts, topology=Topology(1, 1), micro_batches=2, comm=NoComm(1),
                         compute_dtype=dtype)
    assert asked == [0, 1, 2, 3]
    assert all(b.self_attn.q_proj.weight.is_meta for b in parts.blocks)  # the model keeps no copy
    x = torch.randint(0, VOCAB, (4, 9))
    losses = [engine.step((x, x.roll(-1, 1))) for _ in range(4)]
    assert losses[-1] < losses[0]
    engine.close()


def test_checks_before_start_see_the_engines_model(tmp_path):
    """`tawpipe train` checks a resume against the model's shapes on the meta device, before any
    rank starts: they must be the signature the engine's checkpoints carry."""
    from tawpipe import models

    _, path = saved(tmp_path, "qwen2")
    blocks, embed, head, vocab = models.meta_model(str(path))
    engine = make_engine(hf.from_pretrained(path), topology=Topology(1, 1), micro_batches=1,
                         comm=NoComm(1))
    assert parts_signature(blocks, embed, head) == engine.model_signature() and vocab == VOCAB
    engine.close()


# ---------------------------------------------------------------------------------- bad input


def test_tawpipe_train_names_every_family_it_takes():
    from tawpipe.train import add_arguments
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert all(t in parser.epilog for t in hf.ADAPTERS)


def test_unknown_family_names_the_fix():
    from transformers import GraniteConfig

    with pytest.raises(ValueError, match=r"no tawpipe adapter for model_type 'granite'.*register\('granite'"):
        hf.from_config(small(GraniteConfig))


@pytest.mark.parametrize("config, why", [
    (small(MistralConfig, sliding_window=5), r"sliding-window attention \(5 tokens\)"),
    (small(LlamaConfig, attention_dropout=0.1), r"attention dropout \(0.1\).*attention_dropout=0"),
])
def test_what_cannot_attend_from_a_slice_is_refused_context_parallelism_with_the_reason(config, why):
    parts = hf.from_config(config, seed=1)
    assert parts.sliced_context is None and parts.blocks[0].self_attn.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match=f"context_parallel=2: .*{why}.* has no sliced_context"):
        make_engine(parts, topology=Topology(1, 2), micro_batches=1, comm=NoComm(2), context_parallel=2)


def test_mixed_attention_kinds_are_refused():
    config = small(Qwen2Config, use_sliding_window=True, sliding_window=4, max_window_layers=2)
    assert len(set(config.layer_types)) == 2
    with pytest.raises(ValueError, match="mixes attention kinds"):
        hf.from_config(config)


def test_export_refuses_a_save_config_that_does_not_take_the_dtype_before_writing(tmp_path):
    """``ModelParts.save_config`` was documented as save_config(directory) but called with
    (directory, dtype): a one-argument hook raised TypeError once the shards were written (and on
    rank 0 alone, whose peers then lost it). The hook is checked before anything is written."""
    import dataclasses

    from tawpipe.io.safetensors import export

    config = small(LlamaConfig, layers=2)
    parts = hf.from_config(config, seed=1)
    parts = dataclasses.replace(parts, save_config=lambda directory: config.save_pretrained(directory))
    engine = make_engine(parts, topology=Topology(1, 1), micro_batches=1, comm=NoComm(1))
    with pytest.raises(TypeError, match=r"ModelParts.save_config is called as save_config\(directory, dtype\) .*"
                                        r"but <lambda>\(directory\) cannot be .*nothing was written"):
        export(engine, parts, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    parts = dataclasses.replace(parts, save_config=lambda directory, dtype: config.save_pretrained(directory))
    export(engine, parts, tmp_path / "out")  # the documented hook exports
    assert (tmp_path / "out" / "config.json").is_file()


def test_a_config_that_cannot_be_written_fails_every_rank_naming_it(tmp_path):
    """rank 0 writes the config; when that raised, rank 0 left before the barrier and rank 1
    failed with "Connection closed by peer". The ranks now agree on whether every part was
    written: rank 0 raises its error, rank 1 names rank 0."""
    results = run_local(hf_cases.export_with_a_failing_config, 2, str(tmp_path / "out"),
                        small(LlamaConfig, layers=2).to_diff_dict(), timeout=120)
    assert results[0] == "OSError: [Errno 28] No space left on device", results
    assert re.match(r"ExportError: export to .*out: rank\(s\) \[0\] could not write their part; see their errors",
                    results[1]), results


def test_checkpoint_that_does_not_fit_the_config_is_refused(tmp_path):
    _, path = saved(tmp_path, "llama")
    wider = small(LlamaConfig, intermediate_size=64)
    wider.save_pretrained(path)  # the config now disagrees with the weights
    with pytest.raises(ValueError, match="other shapes than the config says.*mlp"):
        hf.from_pretrained(path)
    deeper = small(LlamaConfig, layers=5, tie_word_embeddings=False)
    deeper.save_pretrained(path)
    with pytest.raises(ValueError, match=r"lacks 9 of the model's tensors.*model.layers.4"):
        hf.from_pretrained(path)


def test_directories_without_safetensors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf.from_pretrained(tmp_path)
    model, path = saved(tmp_path, "llama")
    (path / "model.safetensors").unlink()
    parts = hf.from_pretrained(path)  # a config alone: random initialisation
    assert "random init" in parts.description
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors only"):
        hf.from_pretrained(path)


def test_checkpoint_reader(tmp_path):
    from safetensors.torch import save_file

    a, b = torch.randn(3, 4), torch.arange(5)
    save_file({"a": a, "b": b}, tmp_path / "one.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path / "one.safetensors")
    assert ckpt.names() == {"a", "b"} and ckpt.shape("a") == (3, 4)
    got = ckpt.read(["b"])
    assert list(got) == ["b"] and torch.equal(got["b"], b)
    with pytest.raises(KeyError, match="no tensor 'c'"):
        ckpt.read(["c"])
    index = tmp_path / "x.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "one.safetensors", "z": "missing.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        SafetensorsCheckpoint(index)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        SafetensorsCheckpoint(tmp_path / "empty")
