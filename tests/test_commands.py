"""Every `tawpipe` command speaks alike: help that renders, one spelling per concept, a mistyped
flag answered with the closest one, a renamed flag with its new name, and every bad input one
line on stderr with exit status 2."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tawpipe import cli, commands
from tawpipe.commands import RENAMED, Parser
from tawpipe.train import TrainConfig, preflight

from cli_cases import nothing_starts, refused

ROOT = Path(__file__).resolve().parent.parent

COMMANDS = [(), ("plan",), ("train",), ("simulate",), ("bench",), ("bench", "cluster"), ("bench", "comm"),
            ("bench", "context"), ("bench", "overlap"), ("bench", "prefetch"), ("cluster",), ("cluster", "run"),
            ("cluster", "down")]
MODULES = {"train": "tawpipe.train", "simulate": "tawpipe.simulate", "bench": "tawpipe.bench",
           "cluster": "tawpipe.cluster", "bench cluster": "tawpipe.bench.cluster", "bench comm": "tawpipe.bench.comm",
           "bench context": "tawpipe.bench.context", "bench overlap": "tawpipe.bench.overlap",
           "bench prefetch": "tawpipe.bench.prefetch"}


def _help(*command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        cli.main([*command, "--help"])
    assert e.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "tawpipe")
def test_every_help_renders_for_a_user(command):
    """No argparse format left unexpanded (a bare % in a help text), no Python object dumped into
    the text, no reST markup of a developer docstring; a paragraph saying what the command does."""
    text = _help(*command)
    assert "%(" not in text and "{'option_strings'" not in text and "``" not in text, text
    usage, _, rest = text.partition("\n\n")
    assert usage.startswith("usage: tawpipe")
    assert len(rest.split("\n\n")[0].split()) >= 8, f"no description: {rest[:200]!r}"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, by its name, built as the command builds it."""
    out: dict[str, argparse.ArgumentParser] = {"plan": next(
        a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["plan"]}
    for name, module in MODULES.items():
        p = Parser(prog=f"tawpipe {name}")
        commands.load(name, module).add_arguments(p)
        out[name] = p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction) and name == "cluster":
                out.update({f"cluster {n}": sub for n, sub in action.choices.items()})
    return out


PARSERS = _parsers()
# concept: (its one spelling, the commands that take it)
CONCEPTS = {
    "tokens per sequence": ("--seq-len", ("plan", "train", "simulate", "bench cluster", "bench overlap")),
    "sequences per micro-batch": ("--micro-batch-size", ("plan", "train", "simulate", "bench cluster",
                                                         "bench overlap")),
    "micro-batches per device and step": ("--micro-batches", ("plan", "train", "simulate", "bench cluster",
                                                              "bench overlap")),
    "the model": ("--model", ("plan", "train", "simulate", "bench overlap")),
    "nodes and devices per node": ("--per-node", ("plan", "train", "simulate", "bench cluster", "bench comm",
                                                  "bench overlap", "cluster run")),
    "the inter-node link": ("--inter", ("plan", "simulate")),
    "recompute in the backward": ("--recompute", ("simulate", "bench cluster")),
}


@pytest.mark.parametrize("concept", CONCEPTS)
def test_one_spelling_per_concept(concept):
    flag, where = CONCEPTS[concept]
    for name in where:
        assert flag in PARSERS[name]._option_string_actions, f"tawpipe {name} lacks {flag} ({concept})"
    old = [o for o, new in RENAMED.items() if new.split()[0] == flag]
    for name, p in PARSERS.items():
        # bench cluster's --preset names a benchmark configuration, not a model
        clash = [o for o in old if o in p._option_string_actions and (name, o) != ("bench cluster", "--preset")]
        assert not clash, f"tawpipe {name} spells {concept} {clash} instead of {flag}"


def test_no_command_abbreviates_flags():
    """A prefix is no flag: `--seq` must not pass for `--seq-len`, nor `--micro-batch` for either
    of the two flags it begins."""
    assert all(not p.allow_abbrev for p in PARSERS.values())


@pytest.mark.parametrize("argv, suggestion", [
    (("train", "--stpes", "5"), "--steps"),
    (("plan", "--nodes", "2", "--per-node", "2", "--layers", "4", "--micro-batchs", "2"), "--micro-batches"),
    (("simulate", "--nodse", "2"), "--nodes"),
    (("bench", "cluster", "--round", "1"), "--rounds"),
    (("train", "--dtype", "bfloat"), "'bfloat16'"),
    (("trian",), "'train'"),
])
def test_a_mistyped_flag_or_choice_is_answered_with_the_closest(capsys, argv, suggestion):
    line = refused(capsys, *argv, prog="tawpipe" if argv == ("trian",) else None)
    assert f"(did you mean {suggestion}?)" in line, line


@pytest.mark.parametrize("argv, old, new", [
    (("train", "--batch-size", "2"), "--batch-size", "--micro-batch-size"),
    (("train", "--preset", "micro"), "--preset", "--model"),
    (("plan", "--nodes", "2", "--per-node", "2", "--layers", "4", "--micro-batches", "2", "--seq", "64"),
     "--seq", "--seq-len"),
    (("plan", "--nodes", "2", "--per-node", "2", "--layers", "4", "--micro-batches", "2", "--link-gbps", "10"),
     "--link-gbps", "--inter"),
    (("simulate", "--acc", "2"), "--acc", "--micro-batches"),
    (("simulate", "--micro-batch", "2"), "--micro-batch", "--micro-batch-size"),
    (("bench", "cluster", "--batch-size", "2"), "--batch-size", "--micro-batch-size"),
])
def test_an_old_spelling_is_refused_naming_the_new_one(capsys, argv, old, new):
    assert f"{old} is now {new}" in refused(capsys, *argv)


def test_the_number_types_refuse_a_value_out_of_range():
    assert commands.int_at_least(2)("3") == 3 and commands.int_at_least(0)("0") == 0
    for text in ("1", "-4", "x", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected an integer >= 2"):
            commands.int_at_least(2)(text)
    assert commands.positive_float("0.5") == 0.5 and commands.nonnegative_float("0") == 0.0
    for text in ("0", "-1", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a finite number > 0"):
            commands.positive_float(text)
    for text in ("-0.1", "nan", "-inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a finite number >= 0"):
            commands.nonnegative_float(text)


# A value a bench cannot run with (what it did before: a traceback from the ranks, or a run of
# nothing), and what its one line must name.
BENCH_REFUSALS = [
    (("overlap", "--nodes", "0"), "--nodes"),  # started a local job of 0 ranks
    (("overlap", "--per-node", "-1"), "--per-node"),
    (("overlap", "--micro-batches", "0"), "--micro-batches"),
    (("overlap", "--steps", "0"), "--steps"),  # statistics.median of no steps
    (("overlap", "--seq-len", "0"), "--seq-len"),
    (("overlap", "--micro-batch-size", "0"), "--micro-batch-size"),
    (("overlap", "--layers", "2"), "--layers 2 < world size 4"),  # the engine refused it in every rank
    (("overlap", "--comm-ratio", "-1"), "--comm-ratio"),  # a negative sleep in every rank
    (("overlap", "--comm-ratio", "nan"), "--comm-ratio"),
    (("prefetch", "--numel", "0"), "--numel"),  # silently the default
    (("prefetch", "--repeats", "0"), "--repeats"),  # statistics.median of nothing
    (("prefetch", "--pieces", "0"), "--pieces"),
    (("prefetch", "--pieces", "4096,x"), "--pieces"),  # a ValueError traceback
    (("prefetch", "--pieces", ","), "--pieces"),  # measured no piece size
    (("prefetch", "--device", "nope"), "--device nope"),  # torch's RuntimeError traceback
    (("comm", "-T", "0"), "--timeout"),  # silently $TAWPIPE_TIMEOUT
    (("comm", "-T", "-1"), "--timeout"),
    (("comm", "--time-budget", "-1"), "--time-budget"),
    (("comm", "--nodes", "0"), "--nodes"),
    (("comm", "--per-node", "0"), "--per-node"),
    (("comm", "--ops", ","), "--ops"),  # a sweep of nothing
    (("context", "--nodes", "0"), "--nodes"),  # ClusterSpec's ValueError traceback
    (("context", "--per-node", "0"), "--per-node"),
    (("context", "--context-parallel", "1"), "--context-parallel"),  # the run without, twice
    (("context", "--context-parallel", "3"), "--context-parallel 3 does not divide --per-node 2"),
    (("context", "--seq-len", "8190"), "--seq-len 8190 is not a multiple of 2 x --context-parallel"),
    (("context", "--hidden", "130"), "--hidden 130"),
    (("context", "--layers-per-rank", "0"), "--layers-per-rank"),
    (("context", "--micro-batches", "0"), "--micro-batches"),
    (("context", "--steps", "0"), "--steps"),
    (("context", "--timeout", "0"), "--timeout"),
    (("context", "--rate", "fast"), "--rate"),
    (("context", "--cpus-per-rank", "0"), "cpus-per-rank"),
    (("cluster", "--prefetch-depth", "0"), "--prefetch-depth"),  # the engine refused it in every rank
    (("cluster", "--timeout", "-5"), "--timeout"),
    (("cluster", "--rate", "0mbit"), "--rate"),
    (("cluster", "--queue-ms", "0"), "--queue-ms"),
    (("cluster", "--micro-batch-size", "0"), "--micro-batch-size"),  # was named batch-size
    (("cluster", "--layers-per-rank", "0"), "--layers-per-rank"),  # was named layers
]


@pytest.mark.parametrize("argv, named", BENCH_REFUSALS, ids=[" ".join(argv) for argv, _ in BENCH_REFUSALS])
def test_a_bench_refuses_what_it_cannot_run_with_before_it_starts(capsys, monkeypatch, tmp_path, argv, named):
    nothing_starts(monkeypatch)
    monkeypatch.chdir(tmp_path)
    line = refused(capsys, "bench", *argv)
    assert named in line, line
    assert not list(tmp_path.iterdir())  # no results folder either


def test_overlap_refuses_a_comm_ratio_whose_delay_would_outlast_the_waits(capsys, monkeypatch, tmp_path):
    """The delay is sized from the compute measured on the ranks: where a step's injected delay would
    take more than half of $TAWPIPE_TIMEOUT, the bench stops after that measurement with one line
    naming both knobs (it ran for hours at a large --comm-ratio, and its transfers waited 120 s
    whatever $TAWPIPE_TIMEOUT said)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TAWPIPE_TIMEOUT", "30")
    line = refused(capsys, "bench", "overlap", "--nodes", "1", "--per-node", "2", "--layers", "2", "--steps", "1",
                   "--comm-ratio", "1e6", "--out", "")
    assert re.fullmatch(r"tawpipe bench overlap: --comm-ratio 1e\+06 injects [0-9.]+ s of delay per step \(the compute "
                        r"takes [0-9.]+ s\), more than half the 30 s a wait may take: lower --comm-ratio to at most "
                        r"\d+, or raise TAWPIPE_TIMEOUT", line), line
    assert not list(tmp_path.iterdir())


BENCHES = ("comm", "overlap", "prefetch", "context", "cluster")


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan"])
@pytest.mark.parametrize("what", BENCHES)
def test_every_bench_refuses_a_bad_tawpipe_timeout_before_it_starts(capsys, monkeypatch, tmp_path, what, value):
    """Each bench waits (its ranks' engines, or the offload's streams) for $TAWPIPE_TIMEOUT seconds:
    a value that is no number of seconds > 0 is refused with train's and comm's one line, before
    any rank or measurement starts (overlap raised it from run_local as a traceback, prefetch ignored
    it, context and cluster started ranks that each raised it)."""
    nothing_starts(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TAWPIPE_TIMEOUT", value)
    line = refused(capsys, "bench", what, *(("--device", "cpu") if what == "prefetch" else ()))
    assert line == (f"tawpipe bench {what}: TAWPIPE_TIMEOUT={value!r} is not a number of seconds > 0: set it to e.g. "
                    "300, or unset it"), line
    assert not list(tmp_path.iterdir())


def _host_has(monkeypatch, available: int) -> None:
    """This host, as the benches' memory checks see it, has ``available`` bytes."""
    import tawpipe.bench

    monkeypatch.setattr(tawpipe.bench, "host_available", lambda: (available, "as the test says"))


# Runs that need more memory than the host has (a test's 1 GiB, or any host), and what the one line names.
MEMORY_REFUSALS = [
    (("prefetch", "--device", "cpu", "--numel", str(1 << 26)),  # 38 B per element and 160 MiB: 2.53 GiB
     "--numel 67,108,864: the bench needs about 2.53 GiB (2,717,908,992 bytes) of host memory"),
    (("comm", "--nodes", "1", "--per-node", "2", "-c", "0", "-e", "512M"),  # 2 x (384 MiB + 2 x 512 MiB)
     "2 rank(s) (--nodes 1 x --per-node 2) at -e 536,870,912 bytes of float32, each 1.38 GiB: the bench needs about "
     "2.75 GiB"),
    (("comm", "--nodes", "1", "--per-node", "1", "-d", "bfloat16", "-e", "64M"),  # 384 MiB + (2 + 12) x 64 MiB
     "1 rank(s) (--nodes 1 x --per-node 1) at -e 67,108,864 bytes of bfloat16, each 1.25 GiB"),
    (("comm", "--nodes", "1", "--per-node", "3", "-e", "1K"),  # 3 ranks' runtime
     "3 rank(s) (--nodes 1 x --per-node 3) at -e 1,024 bytes of float32, each 384.0 MiB: the bench needs about "
     "1.13 GiB"),
    (("overlap", "--nodes", "4", "--per-node", "2", "--layers", "8"),  # 8 ranks' runtime, before the plan is built
     "8 ranks (--nodes 4 x --per-node 2), each 384.0 MiB before its model: the bench needs about 3.00 GiB"),
    (("overlap", "--nodes", "1", "--per-node", "2", "--layers", "2", "--model", "1b"),  # a 1.5 GiB model per rank
     "2 ranks (--nodes 1 x --per-node 2) of --model 1b x 2 --layers at --seq-len 64"),
    (("context", "--hidden", "1024", "--seq-len", "8192"),  # before any namespace: as any user
     "4 ranks (--nodes 2 x --per-node 2) of 4 layers of width 1024 at --seq-len 8,192, --micro-batches 2, each"),
    (("cluster", "--nodes", "2", "--hidden", "1024", "--methods", "tawpipe"),
     "2 x 2 ranks of 8 layers of width 1024 at --seq-len 512, --micro-batches 2 of --micro-batch-size 1: each rank "
     "up to"),
    (("cluster", "--nodes", "2", "--micro-batches", "64"),  # the reference on 256 sequences at once
     "the single-process reference on the 256 sequences of a step"),
]


@pytest.mark.parametrize("argv, named", MEMORY_REFUSALS, ids=[" ".join(argv) for argv, _ in MEMORY_REFUSALS])
def test_a_bench_that_needs_more_memory_than_the_host_has_is_refused_before_it_starts(capsys, monkeypatch, tmp_path,
                                                                                      argv, named):
    nothing_starts(monkeypatch)
    monkeypatch.chdir(tmp_path)
    _host_has(monkeypatch, 2**30)
    line = refused(capsys, "bench", *argv)
    assert named in line and "of host memory, but 1.00 GiB is available (as the test says): use " in line, line
    assert not list(tmp_path.iterdir())


def test_a_cluster_bench_counts_its_heaviest_method_and_no_more(capsys, monkeypatch, tmp_path):
    """bench cluster's memory check counts the heaviest method it runs: DDP's ranks hold the whole
    model's state, TawPipe's their own chunk's, so a run of TawPipe alone needs less per rank."""
    nothing_starts(monkeypatch)
    monkeypatch.chdir(tmp_path)
    _host_has(monkeypatch, 2**20)
    hidden = str(random.choice([512, 768, 1024]))

    def per_rank(*methods: str) -> float:
        line = refused(capsys, "bench", "cluster", "--nodes", "2", "--hidden", hidden, "--methods", *methods)
        number, unit = re.search(r"each rank up to ([\d.,]+) (MiB|GiB)", line).groups()
        return float(number.replace(",", "")) * (1024 if unit == "GiB" else 1)

    assert per_rank("tawpipe") < per_rank("ddp") == per_rank("tawpipe", "ddp") == per_rank("ddp", "fsdp")
    assert not list(tmp_path.iterdir())


def test_the_cluster_references_memory_is_not_overcounted():
    """The refusal is safe only if the estimate never exceeds what the run holds: the reference's
    measured peak above its imports is at least ``reference_bytes`` less the runtime (measured
    1.2 to 2.2 times), on a LLaMA of random width and length."""
    rng = random.Random()
    hidden, seq = rng.choice([256, 384, 512]), rng.choice([256, 512, 1024])
    code = f"""
import re
from tawpipe.bench import baselines
from tawpipe.bench.footprint import reference_bytes
from tawpipe.train.data import load_tokens
from tawpipe.train.preflight import RUNTIME_BYTES
def kib(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read())[1]) * 1024
load_tokens(None)
cfg = baselines.RunConfig(hidden={hidden}, layers=4, heads=8, seq_len={seq})
dims = cfg.model_config().dims(seq={seq}, micro_batch=1, dtype_bytes=4, grad_bytes=4, scores=False)
open("/proc/self/clear_refs", "w").write("5")
base = kib("VmRSS")
baselines.reference(cfg)
print(kib("VmHWM") - base, reference_bytes(dims, cfg.world_size * cfg.micro_batches) - RUNTIME_BYTES)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    measured, estimate = map(float, run.stdout.split())
    assert measured >= estimate > 0, (hidden, seq, measured, estimate)


@pytest.mark.parametrize("emulated, world, local, named", [
    (True, 8, 2, "8 rank(s) (the emulated cluster's ranks, all on this host)"),
    (False, 16, 8, "8 rank(s) (this host's ranks)")])
def test_comm_under_a_launcher_counts_the_ranks_that_share_this_host(capsys, monkeypatch, tmp_path, emulated, world,
                                                                     local, named):
    """Each rank of `tawpipe bench comm` under a launcher checks its host's memory: torchrun's node
    holds LOCAL_WORLD_SIZE ranks, but `tawpipe cluster run`'s emulated nodes are all on one host, so
    there it counts the whole job (it counted one node's ranks: 2 of 8, which fit where 8 do not)."""
    from tawpipe.cluster import LINK_ENV

    nothing_starts(monkeypatch)
    monkeypatch.chdir(tmp_path)
    _host_has(monkeypatch, 3 * 2**30)  # holds 2 ranks of 1.25 GiB
    for key, value in dict(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(local)).items():
        monkeypatch.setenv(key, value)
    if emulated:
        monkeypatch.setenv(LINK_ENV, "veth0")
    line = refused(capsys, "bench", "comm", "-d", "bfloat16", "-e", "64M", "--out", "")  # 384 MiB + 14 x 64 MiB a rank
    assert f"{named} at -e 67,108,864 bytes of bfloat16, each 1.25 GiB: the bench needs about 10.00 GiB" in line, line


TOO_LARGE = [
    (("prefetch", "--device", "cpu", "--numel", str(10**14)), "--numel 100,000,000,000,000"),  # 3 PB
    (("comm", "--nodes", "100000"), "200000 rank(s) (--nodes 100000 x --per-node 2)"),  # 73 TiB of runtimes
    (("comm", "--nodes", "1", "--per-node", "1", "-e", "1000000G"), "at -e 1,073,741,824,000,000 bytes"),
    (("overlap", "--seq-len", "100000000"), "--seq-len 100,000,000: the corpus has"),  # its rotary tables: 25 GiB
    (("overlap", "--model", "70b", "--layers", "80"), "of --model 70b x 80 --layers"),  # 280 GB per rank
]


@pytest.mark.parametrize("argv, named", TOO_LARGE, ids=[" ".join(argv) for argv, _ in TOO_LARGE])
def test_a_bench_too_large_for_any_host_is_refused_before_it_allocates(capsys, monkeypatch, tmp_path, argv, named):
    """Sizes no host has: the bench used to allocate until torch raised, the kernel killed it, or the
    ranks died of it."""
    nothing_starts(monkeypatch)
    monkeypatch.chdir(tmp_path)
    line = refused(capsys, "bench", *argv)
    assert named in line, line


@pytest.mark.parametrize("depth", ["0", "-2"])
@pytest.mark.parametrize("argv", [("plan", "--nodes", "2", "--per-node", "2", "--layers", "4", "--micro-batches", "2"),
                                  ("train",), ("bench", "cluster")], ids=lambda argv: " ".join(argv[:2]))
def test_a_prefetch_depth_below_one_is_refused_while_the_command_line_is_read(capsys, monkeypatch, argv, depth):
    """No plan fetches weights fewer than one slot ahead: the depth is refused as --mb-per-fetch 0 is,
    naming the depths there are (plan and bench cluster refused it from the planner, train after
    reading the data and the model)."""
    nothing_starts(monkeypatch)
    line = refused(capsys, *argv, "--prefetch-depth", depth)
    assert line.endswith(f": argument --prefetch-depth: expected a number of slots >= 1 or 'resident', got {depth}"), \
        line
    assert commands.prefetch_depth("1") == 1 and commands.prefetch_depth("resident") == "resident"


def test_library_keywords_are_given_as_flags():
    said = commands.as_flags("mb_per_fetch=3 does not divide micro_batches=2; pass reuse_weights=True, or "
                             "give memory_budget; prefetch_depth='resident' needs reuse_weights")
    assert said == ("--mb-per-fetch 3 does not divide --micro-batches 2; pass --reuse-weights, or give "
                    "--memory-budget; --prefetch-depth resident needs --reuse-weights")
    assert commands.as_flags("reuse_weights=False") == "--no-reuse-weights"
    assert commands.as_flags("a larger MemoryPolicy.budget, or (MemoryPolicy.budget)") == \
        "a larger --memory-budget, or (--memory-budget)"
    assert commands.as_flags("the --micro-batches flag and num_layers") == "the --micro-batches flag and --layers"
    assert commands.as_flags("context_parallel=3 does not divide") == "--context-parallel 3 does not divide"
    assert commands.as_flags("Topology.per_node must be >= 1") == "--per-node must be >= 1"


def test_tawpipe_plan_names_the_flags_of_a_cluster_or_model_size_of_zero(capsys):
    """Not Topology.nodes, nor the whole ModelDims: the flags the user gave."""
    plan = ("plan", "--nodes", "2", "--per-node", "2", "--micro-batches", "2", "--layers", "4")
    assert refused(capsys, *plan[:2], "0", *plan[3:]) == "tawpipe plan: argument --nodes: expected an integer >= 1, got 0"
    assert refused(capsys, *plan, "--hidden", "0") == "tawpipe plan: argument --hidden: expected an integer >= 1, got 0"


@pytest.mark.parametrize("name", ["tiny", "paper", "7b"])
def test_a_built_in_model_works_in_train_plan_and_simulate(capsys, name):
    """One registry: the same names in every command."""
    assert cli.main(["plan", "--nodes", "2", "--per-node", "2", "--model", name, "--micro-batches", "2",
                     "--seq-len", "256", "--no-table"]) == 0
    assert f"({models_numel(name):,} decoder" in capsys.readouterr().out
    assert cli.main(["simulate", "--nodes", "2", "--per-node", "2", "--model", name, "--seq-len", "256",
                     "--methods", "tawpipe", "ddp"]) == 0
    assert re.search(rf"{name}: H=\d+ L=\d+", capsys.readouterr().out)
    try:
        pre = preflight.validate(TrainConfig(model=name, steps=1, seq_len=16, micro_batch_size=1))
    except ValueError as e:  # known, built, and too large for this host: the refusal says so
        assert str(e).startswith("not enough memory: "), e
    else:
        assert pre.memory.startswith("memory estimate: ")


def models_numel(name: str) -> int:
    from tawpipe.models.presets import PRESETS

    return PRESETS[name].decoder_numel
