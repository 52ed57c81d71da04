"""`tawpipe simulate` refuses a bad input the one way every command does: one line on stderr,
``tawpipe simulate: ...`` naming the flag or the file, exit status 2, before anything is measured
or written; a run in which nothing could be simulated is refused the same way."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from tawpipe.cli import main
from tawpipe.sim import compare
from tawpipe.sim.hardware import Device

DEV = Device("test", matmul_flops=5e13, attention_flops=4e13, memory_bandwidth=1e12, memory=80e9, peak=1e14)


def _refused(argv: list[str], capsys) -> str:
    """The one line ``tawpipe simulate argv`` printed on stderr, having exited with status 2 and
    printed nothing on stdout."""
    assert main(["simulate", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tawpipe simulate: ")
    return lines[0]


@pytest.fixture
def no_measuring(monkeypatch):
    """Calibration fails the test: a refusal must come before the ~80 s of measuring."""
    from tawpipe.sim import calibrate

    def measured(*args, **kwargs):
        raise AssertionError("measured before refusing")

    monkeypatch.setattr(calibrate, "calibrate", measured)


def _blocked(tmp_path: Path) -> Path:
    """A path nothing can be written at: under a regular file."""
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "out"


FLAG_CASES = [
    (["--replicas", "0", "--methods", "tawpipe"], "--replicas 0: must be at least 1"),
    (["--replicas", "2", "--nodes", "3", "--methods", "tawpipe"], "--replicas 2 does not divide --nodes 3"),
    (["--micro-batches", "0"], "--micro-batches 0: must be at least 1"),
    (["--map", "out", "--jobs", "0"], "--jobs 0: must be at least 1"),
    (["--jobs", "2"], "--jobs is how many processes play the map's cells: give it with --map"),
    (["--micro-batches", "-1"], "--micro-batches -1: must be at least 1"),
    (["--mb-per-fetch", "0", "--methods", "tawpipe"], "--mb-per-fetch 0: must be at least 1"),
    (["--mb-per-fetch", "3", "--micro-batches", "2", "--methods", "tawpipe"], "--mb-per-fetch 3 does not divide"),
    (["--prefetch-depth", "-1", "--methods", "tawpipe"], "--prefetch-depth: expected a number of slots >= 1"),
    (["--prefetch-depth", "resident", "--no-reuse-weights"], "--no-reuse-weights"),
    (["--advise", "--recompute", "none", "--offload-activations"],
     "--advise: --offload-activations keeps a chunk's input on the host, which --recompute none does not run from"),
    (["--stages", "1"], "--stages 1: must be at least 2"),
    (["--nodes", "0"], "--nodes 0: must be at least 1"),
    (["--seq-len", "0"], "--seq-len 0: must be at least 1"),
    (["--inter", "fast"], "--inter: link 'fast'"),
    (["--link-efficiency", "0", "--validate", "cluster.json"], "--link-efficiency 0: must be above 0"),
    (["--model", "9b"], "unknown --model '9b'; choose one of micro, tiny, paper"),
    # a path that is not there is a missing file, not a model of an unknown name
    (["--model", "no-such.json"], "--model no-such.json: no such file or directory; give the path of a config"),
    (["--model", "no/such/dir"], "--model no/such/dir: no such file or directory"),
    (["--device", "h100:memory=abc"], "--device: device 'h100:memory=abc': memory='abc' is not a number of GiB"),
    (["--device", "tpu"], "--device"),
    (["--device", "cpu:quota=-1"], "--device cpu:quota=-1"),
    (["--device", "cpu:cores=2"], "--device cpu:cores=2"),
    (["--calibrate", "dev.json", "--threads", "0"], "--threads 0: must be at least 1"),
    (["--calibrate", "dev.json", "--quota", "-1"], "--quota -1: must be a number of cores above 0"),
    (["--calibrate", "dev.json", "--calibrate-on", "tpu"], "--calibrate-on"),
    (["--calibrate", "BLOCKED"], "--calibrate"),
    (["--timeline", "BLOCKED", "--methods", "tawpipe"], "--timeline"),
    (["--timeline", "trace.json", "--methods", "ddp"], "--timeline"),
    (["--map", "BLOCKED"], "--map"),
    (["--paper", "BLOCKED"], "--paper"),
    (["--validate", "cluster.json", "--out", "BLOCKED"], "--out"),
    (["--out", "out"], "--out"),
    (["--paper", "p", "--map", "m"], "--paper and --map"),
    # the spellings used before name the one to use now
    (["--seq", "1024"], "--seq is now --seq-len"),
    (["--micro-batch", "1"], "--micro-batch is now --micro-batch-size"),
    (["--acc", "2"], "--acc is now --micro-batches"),
    (["--no-recompute"], "--no-recompute is now --recompute none"),
]


# a flag that nothing would read where it is given: refused, not ignored
SCOPE_CASES = [
    (["--paper", "p", "--advise"], "--advise does not apply to --paper, which plays the paper's own 24-GPU setup"),
    (["--paper", "p", "--nodes", "4"], "--nodes does not apply to --paper"),
    (["--paper", "p", "--reuse-weights", "host"], "--reuse-weights host does not apply to --paper"),
    (["--map", "m", "--model", "7b"], "--model does not apply to --map, which plays its own grid of clusters, models "
                                      "and methods: with it give only --jobs"),
    (["--published", "p", "--device", "a100"], "--device does not apply to --published, which replays published runs "
                                               "as their authors describe them: give it alone"),
    (["--validate", "cluster.json", "--json"], "--json does not apply to --validate"),
    (["--calibrate", "dev.json", "--nodes", "2"], "--nodes does not apply to --calibrate"),
    (["--threads", "2"], "--threads is how many CPU threads --calibrate measures with: give it with --calibrate"),
    (["--quota", "0.5"], "--quota is the CPU quota per rank --calibrate measures under"),
    (["--calibrate-on", "cuda"], "--calibrate-on is the device --calibrate measures: give it with --calibrate"),
    (["--link-efficiency", "0.5"], "--link-efficiency is the share of a shaped link's rate that --validate plays: "
                                   "give it with --validate"),
    (["--stages", "4", "--methods", "ddp"], "--stages sets the 1f1b row, which --methods leaves out: add 1f1b"),
    (["--mb-per-fetch", "2", "--methods", "ddp", "1f1b"], "--mb-per-fetch sets the tawpipe row"),
    (["--no-reuse-weights", "--methods", "weipipe"], "--no-reuse-weights sets the tawpipe row"),
    (["--replicas", "3", "--methods", "weipipe"], "--replicas sets the tawpipe and tawpipe-paper rows"),
]


@pytest.mark.parametrize("argv, says", FLAG_CASES)
def test_a_bad_flag_is_refused_in_one_line_before_anything_runs(argv, says, tmp_path, monkeypatch, capsys,
                                                                 no_measuring):
    monkeypatch.chdir(tmp_path)
    line = _refused([str(_blocked(tmp_path)) if a == "BLOCKED" else a for a in argv], capsys)
    assert says in line
    assert not (tmp_path / "dev.json").exists() and not (tmp_path / "trace.json").exists()
    assert not (tmp_path / "p").exists() and not (tmp_path / "m").exists()


@pytest.fixture
def no_playing(monkeypatch):
    """Playing a method fails the test: a run too large must be refused before it starts."""
    def played(*args, **kwargs):
        raise AssertionError("played before refusing")

    monkeypatch.setattr(compare, "run", played)
    monkeypatch.setattr(compare, "advise", played)


@pytest.mark.parametrize("argv, says", [
    (["--micro-batches", "100000"], "--micro-batches 100000: the data-parallel peers (ddp, fsdp, fsdp-mm, fsdp-node, "
                                    "hsdp) play each micro-batch's 24 layers on the 8 ranks of a node, which would take "
                                    "the simulator about "),
    (["--micro-batches", "100000", "--methods", "tawpipe", "ddp"], "--micro-batches 100000: the data-parallel peers "
                                                                   "(ddp) play"),
    (["--micro-batches", "5000", "--context-parallel", "2", "--methods", "hsdp"], "24 layers in 2 slices"),
    (["--per-node", "4096"], "--per-node 4096: the data-parallel peers (ddp, fsdp, fsdp-mm, fsdp-node, hsdp) gather "
                             "and reduce over the ranks of a node, and even one micro-batch would take the simulator"),
    (["--advise", "--micro-batches", "64", "--methods", "ddp"], "--advise: its 42 settings at --micro-batches 64 hold "
                                                                "1,720,320 forwards and backwards in all, more than the "
                                                                "1,200,000 it plays"),
])
def test_a_run_too_large_to_play_is_refused_naming_how_far_to_go(argv, says, capsys, no_playing):
    line = _refused(argv, capsys)
    assert says in line
    if "--advise" not in argv:  # the largest value that plays, and the way around it
        flag = "--per-node" if "--per-node" in argv else "--micro-batches"
        most = int(re.search(rf"give at most {flag} (\d+)", line).group(1))
        assert 1 <= most < int(argv[argv.index(flag) + 1]) and "out of --methods" in line


@pytest.fixture
def no_runs_of_their_own(monkeypatch):
    """The map, the paper's setup, the published runs and the validation fail the test: a flag that
    does not apply to them must be refused before they start (the map takes hours)."""
    import tawpipe.simulate
    from tawpipe.sim import atlas_report
    from tawpipe.simulate import published, validate

    def ran(*args, **kwargs):
        raise AssertionError("ran before refusing")

    for module, name in ((atlas_report, "main_map"), (tawpipe.simulate, "_paper"), (published, "main_published"),
                         (validate, "validate")):
        monkeypatch.setattr(module, name, ran)


@pytest.mark.parametrize("argv, says", SCOPE_CASES)
def test_a_flag_nothing_reads_where_it_is_given_is_refused(argv, says, tmp_path, monkeypatch, capsys, no_measuring,
                                                           no_runs_of_their_own):
    monkeypatch.chdir(tmp_path)
    assert says in _refused(argv, capsys)
    assert not any(tmp_path.iterdir())


CONFIG = {"nodes": 2, "per_node": 2, "hidden": 64, "layers": 4, "heads": 4, "seq_len": 256, "vocab": 128,
          "micro_batches": 2, "batch_size": 1}
COMPUTE = "compute fixed at 0.50 core(s) per rank (1 thread(s) each)"
BAD_FILES = [
    ("--device", None),  # missing
    ("--device", "DIR"),
    ("--device", "not json"),
    ("--device", '{"name": "cut short", "matmul'),
    ("--device", json.dumps({"hidden_size": 1024, "num_hidden_layers": 24})),  # a model's config
    ("--device", json.dumps({**dataclasses.asdict(DEV), "memory": "80 GB"})),
    ("--device", json.dumps({**dataclasses.asdict(DEV), "memory": -1})),
    ("--validate", None),
    ("--validate", "DIR"),
    ("--validate", "not json"),
    ("--validate", '{"shapes": ['),
    ("--validate", json.dumps({"rate": "100mbit"})),
    ("--validate", json.dumps([1, 2])),
    ("--validate", json.dumps({"rate": "fast", "compute": COMPUTE, "shapes": []})),
    ("--validate", json.dumps({"rate": "100mbit", "compute": COMPUTE, "shapes": [{"rows": []}]})),
    ("--validate", json.dumps({"rate": "100mbit", "compute": COMPUTE,
                               "shapes": [{"config": CONFIG, "rows": [{"status": "ok", "method": "ddp"}]}]})),
    ("--validate", json.dumps({"rate": "100mbit", "compute": COMPUTE,  # true is not a number of nodes
                               "shapes": [{"config": {**CONFIG, "nodes": True}, "rows": []}]})),
    ("--validate", json.dumps({"rate": "100mbit", "compute": "whatever the machine gives",
                               "shapes": [{"config": CONFIG, "rows": []}]})),
    ("--validate", json.dumps({"rate": "100mbit", "compute": COMPUTE,
                               "shapes": [{"config": CONFIG, "rows": [], "calibration": {"name": "x"}}]})),
]


@pytest.mark.parametrize("flag, text", BAD_FILES)
def test_a_bad_file_is_refused_naming_the_flag_and_the_file(flag, text, tmp_path, capsys, no_measuring):
    path = tmp_path / "in.json"
    if text == "DIR":
        path.mkdir()
    elif text is not None:
        path.write_text(text)
    line = _refused([flag, str(path)], capsys)
    assert f"{flag} {path}" in line


@pytest.mark.parametrize("argv, says", [
    (["--nodes", "100000", "--methods", "tawpipe"], "use more replicas, each pipeline over fewer nodes (--replicas"),
    (["--nodes", "4", "--methods", "weipipe"], "WeiPipe runs one pipeline over every device"),
    # the replicas that shorten it among a billion nodes' divisors, found at once (a count to a billion took minutes)
    (["--nodes", "1000000000", "--methods", "tawpipe"], "each pipeline over fewer nodes (--replicas 500000000, "
                                                        "1000000000)"),
    (["--nodes", "4", "--methods", "tawpipe", "tawpipe-paper"], "tawpipe, tawpipe-paper: a pipeline of 32 ranks"),
    (["--methods", "1f1b", "--stages", "5"], "--stages 2, 4, 8, 24"),
    # in the flags' terms: the micro-batches per device given, not the pipeline's stages x that
    (["--nodes", "128", "--model", "70b", "--methods", "1f1b", "--stages", "64", "--micro-batches", "64"],
     "1f1b: 1F1B with 64 stages at 64 micro-batches per device runs 4,096 micro-batches through each pipeline, about "
     "1,048,576 tasks, more than the 1,000,000 the simulator plays: use fewer stages per pipeline (--stages 2, 4, 8, "
     "16, 32; its data-parallel copies are symmetric) or at most --micro-batches 61"),
    # the schedules' own reasons in flags, not as the library's keywords (recompute='none')
    (["--methods", "tawpipe", "--offload-activations", "--recompute", "none"],
     "tawpipe: --offload-activations keeps a chunk's input on the host, which --recompute none does not run from"),
])
def test_a_run_with_nothing_simulated_is_refused_saying_why(argv, says, capsys):
    line = _refused(argv, capsys)
    assert line.startswith("tawpipe simulate: nothing was simulated: ") and says in line
    assert not re.search(r"\w=", line)  # no keyword=value of the library


def test_a_model_with_a_size_of_zero_is_refused_naming_the_size(tmp_path, capsys, no_measuring):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 0, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "vocab_size": 100, "intermediate_size": 128}))
    line = _refused(["--model", str(config)], capsys)
    assert line == f"tawpipe simulate: --model {config}: hidden=0: every dimension of a model must be >= 1"
