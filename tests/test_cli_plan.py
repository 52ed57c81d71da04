"""`tawpipe plan` and the subcommand hooks of the command line."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import tawpipe
from tawpipe.cli import main
from tawpipe.cost.memory import MemoryEstimate, fitting, memory_per_rank
from tawpipe.plan.plan import Plan
from tawpipe.plan.schedule import build_plan
from tawpipe.plan.topology import Topology
from tawpipe.cost.traffic import estimate, plan_traffic
from tawpipe.models.shape import ModelDims

from cli_cases import refused

PAPER_N4_SLOT5 = ("| 5 | **B2**(m0); P2P W1 r2→r0; bcast from r0; reduce G3→r0; P2P G3 r0→r3 "
                  "| **B3**(m0); P2P W2 r1→r3; bcast from r3 |")
PAPER_N6_SLOT8 = ("| 8 | **B3**; P2P W2 r4→r0; bcast from r0; reduce G4→r0; P2P G4 r0→r3 "
                  "| **B4**; P2P W3 r1→r3; bcast from r3; reduce G5→r2; P2P G5 r2→r5 "
                  "| **B5**; P2P W4 r3→r5; bcast from r5 |")


def run(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def table_of(out: str) -> str:
    return "\n".join(line for line in out.splitlines() if line.startswith("|"))


@pytest.mark.parametrize("nodes,per_node,layers,acc,line", [
    (2, 2, 4, 2, PAPER_N4_SLOT5), (3, 2, 6, 1, PAPER_N6_SLOT8),
])
def test_plan_prints_the_papers_worked_tables(capsys, nodes, per_node, layers, acc, line):
    out = run(capsys, "plan", "--nodes", str(nodes), "--per-node", str(per_node), "--layers", str(layers),
              "--micro-batches", str(acc), "--grad-route", "leader")
    expected = build_plan(Topology(nodes, per_node), layers, acc, grad_route="leader").table()
    assert table_of(out) == expected  # equal to the paper's tables: see test_tables.py
    assert line in out.splitlines()
    assert "no deadlock" in out and f"{nodes * per_node * nodes * per_node * acc} gradient" in out


def test_plan_json_is_the_plan(capsys):
    out = run(capsys, "plan", "--nodes", "2", "--per-node", "3", "--layers", "7", "--micro-batches", "2", "--json",
              "--actions")
    plan = Plan.from_json(out)
    assert plan == build_plan(Topology(2, 3), 7, 2, layer_numel=1, weight_bytes=1, grad_bytes=1)


@pytest.mark.parametrize("json_out", [False, True])
def test_plan_leaves_the_collector_as_it_found_it(capsys, json_out):
    """The command freezes what is alive while it proves and prints a plan (the collector need not
    walk it), then unfreezes it: a caller's process (this test's) goes on collecting its cycles,
    instead of keeping them to exit (where nanobind reports triton's, imported by torch, as leaks)."""
    import gc

    assert gc.get_freeze_count() == 0 and gc.isenabled()
    main(["plan", "--nodes", "2", "--per-node", "2", "--layers", "4", "--micro-batches", "2", "--model", "micro",
          *(["--json"] if json_out else [])])
    assert capsys.readouterr().out
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_plan_weipipe_table(capsys):
    out = run(capsys, "plan", "--nodes", "1", "--per-node", "4", "--layers", "4", "--micro-batches", "2",
              "--algo", "weipipe")
    assert "| 4 | F:W0(m1) B:W1(m0) ⇒ f0,b1 | F:W1(m0) ⇒ f1,b0 | F:W2(m0) ⇒ f2,b3 | F:W3(m0) ⇒ f3,b2 |" in out
    assert "final G3→3" in out


@pytest.mark.parametrize("algo", ["tawpipe", "weipipe"])
def test_the_summary_counts_the_slots_the_table_prints(capsys, algo):
    out = run(capsys, "plan", "--nodes", "2", "--per-node", "2", "--layers", "6", "--micro-batches", "3",
              "--algo", algo)
    rows = [line.split("|")[1].strip() for line in table_of(out).splitlines()[2:]]
    numbered = [r for r in rows if r.lstrip("−-").isdigit()]
    compute_slots = [r for r in numbered if not r.startswith(("−", "-"))]
    assert compute_slots == [str(i) for i in range(len(compute_slots))]
    m = re.search(r"(\d+) slots as tabled, a prologue and the step's slot", out)
    assert m and int(m.group(1)) == len(compute_slots)


def test_the_peers_rows_of_a_plan_of_replicas_are_the_whole_jobs_count(capsys):
    """The tawpipe and weipipe rows are counted on replica 0 (every replica sends what it does):
    the same figures as counting every rank of the job."""
    args = ("plan", "--nodes", "6", "--per-node", "2", "--layers", "6", "--micro-batches", "2", "--replicas", "3",
            "--no-table", "--hidden", "256", "--heads", "8", "--seq-len", "512")
    out = run(capsys, *args)
    dims = ModelDims(layers=6, hidden=256, heads=8, seq=512)
    for algo in ("tawpipe", "weipipe"):
        plan = build_plan(Topology(6, 2), 6, 2, algo=algo, replicas=3, layer_numel=dims.layer_numel,
                          weight_bytes=dims.dtype_bytes, grad_bytes=dims.grad_bytes,
                          replicated_numel=dims.replicated_numel)
        whole = plan_traffic(plan)
        row = f"{algo:>10}  {whole.total() / 12 / 1e9:>11.2f} GB  {max(whole.per_node()) / 1e9:>17.2f} GB"
        assert row in out.splitlines(), (row, out)


def _busiest_grads(out: str) -> float:
    m = re.search(r"grads: busiest rank across nodes r\d+ ([\d,.]+)", out)
    return float(m.group(1).replace(",", ""))


def test_summary_shows_the_rail_cut_of_the_busiest_rank(capsys):
    args = ("plan", "--nodes", "3", "--per-node", "8", "--layers", "24", "--micro-batches", "4", "--no-table")
    leader = run(capsys, *args, "--grad-route", "leader")
    rail = run(capsys, *args, "--grad-route", "rail")
    assert "|" not in leader
    assert _busiest_grads(leader) == 4 * 16  # acc·N·(G-1)/G chunks of one layer
    assert _busiest_grads(leader) / _busiest_grads(rail) == pytest.approx(8)


def test_model_dimensions_give_bytes_and_peer_estimates(capsys):
    out = run(capsys, "plan", "--nodes", "2", "--per-node", "2", "--layers", "8", "--micro-batches", "2",
              "--no-table", "--hidden", "256", "--heads", "8", "--seq-len", "1024")
    for method in ("ddp", "fsdp", "hsdp", "1f1b", "weipipe", "tawpipe"):
        assert re.search(rf"^\s+{method}\s+[\d.]+ GB\s+[\d.]+ GB$", out, re.M), method
    assert re.search(r"weights: busiest rank across nodes r\d \d[\d.]* [kMG]?B", out)


@pytest.mark.parametrize("argv,match", [
    (["plan", "--nodes", "2", "--per-node", "2", "--layers", "3", "--micro-batches", "1"], "--layers 3 < world size 4"),
    (["plan", "--nodes", "0", "--per-node", "2", "--layers", "3", "--micro-batches", "1"],
     "argument --nodes: expected an integer >= 1, got 0"),
    (["plan", "--nodes", "2", "--per-node", "2", "--hidden", "64", "--seq-len", "0", "--micro-batches", "1"],
     "argument --seq-len: expected an integer >= 1, got 0"),
    (["plan", "--nodes", "2", "--per-node", "2", "--layers", "4", "--micro-batches", "1", "--bogus"], "unrecognized"),
    (["plan", "--nodes", "2", "--per-node", "2", "--layers", "4", "--micro-batches", "1", "--mb-per-fetch", "3"],
     "--mb-per-fetch 3 does not divide --micro-batches 1"),
])
def test_plan_errors_are_clear(capsys, argv, match):
    assert match in refused(capsys, *argv)


def test_train_and_bench_are_delegated_lazily(monkeypatch):
    seen = {}
    fake = types.ModuleType("tawpipe.bench", "Fake bench.")
    fake.add_arguments = lambda p: p.add_argument("--repeat", type=int, default=1)

    def fake_main(args: argparse.Namespace) -> int:
        seen["args"] = args
        return 7

    fake.main = fake_main
    monkeypatch.setitem(sys.modules, "tawpipe.bench", fake)
    assert main(["bench", "--repeat", "3"]) == 7
    assert seen["args"].repeat == 3
    monkeypatch.setitem(sys.modules, "tawpipe.bench", None)
    with pytest.raises(SystemExit, match="not available"):
        main(["bench"])


def test_module_entry_point():
    root = Path(tawpipe.__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    out = subprocess.run(
        [sys.executable, "-m", "tawpipe.cli", "plan", "--nodes", "2", "--per-node", "2", "--layers", "4",
         "--micro-batches", "2", "--grad-route", "leader"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    assert PAPER_N4_SLOT5 in out.splitlines()


def _python(code: str) -> subprocess.CompletedProcess:
    root = Path(tawpipe.__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_the_layers_help_states_the_bound_with_replicas(capsys):
    """--layers needs one layer per rank of a pipeline, G x s / R with replicas; its help said G x s,
    which a plan of replicas does not need."""
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "decoder layers L (>= G x s / --replicas: a layer per rank of a pipeline)" in " ".join(
        capsys.readouterr().out.split())
    out = run(capsys, "plan", "--nodes", "2", "--per-node", "2", "--layers", "2", "--micro-batches", "1",
              "--replicas", "2", "--no-table")
    assert "2 layers in chunks of [1, 1]" in out and "2 replicas of 2 ranks" in out


def test_the_recompute_auto_help_says_bytes_first(capsys):
    """--recompute auto takes, of the savers that fit, the fewest inter-node bytes, then the fastest
    (cost.memory.auto_savers_plan; design §7.3); plan's and train's help said "the fastest"."""
    for command in ("plan", "train"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "those that move the fewest inter-node bytes, then the fastest" in " ".join(
            capsys.readouterr().out.split()), command


def test_help_plan_and_train_arguments_do_not_import_torch():
    """`tawpipe --help`, `tawpipe plan` and `tawpipe train --help`, a bad train flag or a --model that
    names nothing stay fast: the package root loads its names on first use, plan and cost import no
    torch, and train's flags live in a torch-free module (importing torch took 1-2 s of a 1.5 s
    `--help`; a mistyped --model was refused after 4 s, now 0.3 s)."""
    done = _python(
        "import sys, contextlib, io\n"
        "import tawpipe.cli\n"
        "assert 'torch' not in sys.modules, 'import tawpipe.cli imported torch'\n"
        "for argv in (['--help'], ['plan', '--help'], ['plan', '--nodes', '2', '--per-node', '2', '--layers', '8',\n"
        "             '--micro-batches', '2', '--hidden', '64', '--no-table'],\n"
        "             ['plan', '--nodes', '2', '--per-node', '2', '--model', '7b', '--micro-batches', '2', '--no-table'],\n"
        "             ['train', '--help'], ['train', '--stpes', '3'], ['train', '--steps', '0'],\n"
        "             ['train', '--seq', '8'], ['train', '--dtype', 'float64'], ['train', '--model', 'tiyn']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \\\n"
        "            contextlib.suppress(SystemExit):\n"
        "        tawpipe.cli.main(argv)\n"
        "    assert 'torch' not in sys.modules, f'tawpipe {argv} imported torch'\n"
    )
    assert done.returncode == 0, done.stderr


def test_the_package_root_loads_its_names_on_first_use():
    done = _python(
        "import sys\n"
        "import tawpipe\n"
        "assert 'torch' not in sys.modules\n"
        "assert {'TawPipe', 'ops', 'Topology'} <= set(dir(tawpipe)) and tawpipe.__version__\n"
        "from tawpipe import Plan, Precision, TawPipe, Topology, build_plan, verify\n"
        "from tawpipe.engine.engine import TawPipe as engine_class\n"
        "assert TawPipe is engine_class and tawpipe.TawPipe is TawPipe\n"
        "import torch\n"
        "assert callable(torch.ops.tawpipe.pack) and tawpipe.ops.pack\n"
        "try:\n"
        "    tawpipe.nothing\n"
        "except AttributeError as e:\n"
        "    assert 'nothing' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    assert done.returncode == 0, done.stderr
    # with torch already imported, `import tawpipe` registers torch.ops.tawpipe.* at once, as it used to
    done = _python("import torch, tawpipe\nassert callable(torch.ops.tawpipe.pack)\n")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("code", [
    "import tawpipe, torch",
    # a library's probe for torch (transformers asks find_spec first) must not spend the hook
    "import importlib.util, tawpipe\nimportlib.util.find_spec('torch')\nimport torch",
    "import tawpipe\nimport transformers\nimport torch",
])
def test_import_tawpipe_registers_the_ops_in_either_order(code):
    """Users who call the ops from other frameworks import tawpipe wherever their imports put it."""
    done = _python(code + "\nassert callable(torch.ops.tawpipe.pack) and callable(torch.ops.tawpipe.unpack_accumulate)\n")
    assert done.returncode == 0, done.stderr


MODEL_3X2 = ("plan", "--nodes", "3", "--per-node", "2", "--layers", "8", "--micro-batches", "2", "--no-table",
             "--hidden", "256", "--heads", "8", "--vocab", "512", "--seq-len", "512", "--dtype-bytes", "4",
             "--prefetch-depth", "3", "--reuse-weights")


def test_host_rows_move_the_resident_bytes_through_fewer_buffers(capsys):
    """--reuse-weights host: per k, the resident depth's inter-node bytes with depth 1's staging,
    the stashed chunks counted on the host; within a budget only they fit, they are the pick."""
    rows = {}
    out = run(capsys, *MODEL_3X2, "--prefetch-depth", "1", "--reuse-weights", "host")
    for m in re.finditer(r"^\s+(\d)\s+(\d) (host|reuse resident)\s+([\d.]+) GB\s+([\d.]+) GiB\s+[\d.]+ GiB\s+"
                         r"([\d.]+) GiB\s+([\d.]+) GiB$", out, re.M):
        rows[(int(m[1]), m[3])] = tuple(float(m[i]) for i in (4, 5, 6, 7))
    assert rows.keys() == {(1, "host"), (2, "host"), (1, "reuse resident"), (2, "reuse resident")}, out
    for k in (1, 2):
        (gb, staging, host, total), (gb_res, staging_res, host_res, total_res) = rows[(k, "host")], \
            rows[(k, "reuse resident")]
        assert gb == gb_res and staging < staging_res and host > 0 == host_res and total < total_res
    budget = (rows[(2, "host")][3] + rows[(1, "reuse resident")][3]) / 2
    out = run(capsys, *MODEL_3X2, "--prefetch-depth", "1", "--reuse-weights", "host", "--memory-budget", f"{budget:.4f}")
    assert "fewest inter-node bytes with k=2, --prefetch-depth 1 --reuse-weights host" in out


def test_memory_budget_picks_the_fewest_bytes_that_fit(capsys):
    """One row per k at the given depth and with every chunk resident, sized like the plans; the
    suggestion is the fitting row with the fewest inter-node bytes, not simply the deepest."""
    topo, dims = Topology(3, 2), ModelDims(hidden=256, layers=8, heads=8, vocab=512, seq=512, dtype_bytes=4)
    expected = {}
    for k, depth in itertools.product((1, 2), (3, "resident")):
        plan = build_plan(topo, 8, 2, prefetch_depth=depth, mb_per_fetch=k, reuse_weights=True,
                          layer_numel=dims.layer_numel, weight_bytes=4, grad_bytes=4,
                          replicated_numel=dims.replicated_numel)
        expected[(k, plan.options["prefetch_depth"])] = (max(plan_traffic(plan).per_node()) / 1e9,
                                                         memory_per_rank(plan, dims).total / 2**30)
    out = run(capsys, *MODEL_3X2)
    rows = {(int(m[1]), int(m[2])): (float(m[3]), float(m[4]))
            for m in re.finditer(r"^\s+(\d)\s+(\d) reuse(?: resident)?\s+([\d.]+) GB .* ([\d.]+) GiB$", out, re.M)}
    assert rows.keys() == expected.keys() == {(1, 3), (2, 3), (1, 5), (2, 5)}
    for key, (gb, gib) in expected.items():
        assert rows[key] == (pytest.approx(gb, abs=6e-4), pytest.approx(gib, abs=6e-4))
    (k1_d3, k2_d3, k1_res, k2_res) = (expected[c][1] for c in ((1, 3), (2, 3), (1, 5), (2, 5)))
    assert expected[(1, 5)][0] > expected[(2, 3)][0] and k1_res > k2_d3  # so k=1 resident is never the pick
    for budget, pick in (((k2_d3 + k1_res) / 2, "k=2, --prefetch-depth 3"),
                         ((k1_res + k2_res) / 2, "k=2, --prefetch-depth 3"),
                         (k2_res + 0.01, "k=2, --prefetch-depth 5")):
        out = run(capsys, *MODEL_3X2, "--memory-budget", f"{budget:.4f}")
        assert f"largest k 2; fewest inter-node bytes with {pick} --reuse-weights" in out
    out = run(capsys, *MODEL_3X2, "--memory-budget", f"{min(k1_d3, k2_d3) - 0.01:.4f}")
    assert "nothing fits, not even k=1" in out
    out = run(capsys, *MODEL_3X2, "--memory-budget", "0.0001")  # not even with the chunks on the host
    auto = next(line for line in out.splitlines() if line.startswith("auto (tawpipe train's default): "))
    assert "say how much with --memory-budget, or give --mb-per-fetch, --prefetch-depth and --reuse-weights" in auto
    for bad in ("0", "-1", "nan", "inf"):  # as tawpipe train refuses them
        assert "--memory-budget must be a finite number of GiB > 0" in refused(capsys, *MODEL_3X2, "--memory-budget", bad)


def test_json_gives_the_memory_the_tables_print(capsys):
    """--json with a model: this plan's bytes per rank (as ``memory_per_rank`` counts them), each k
    option of the table, and within --memory-budget the lines' pick and auto's choice."""
    topo, dims = Topology(3, 2), ModelDims(hidden=256, layers=8, heads=8, vocab=512, seq=512, dtype_bytes=4)
    sizes = dict(layer_numel=dims.layer_numel, weight_bytes=4, grad_bytes=4, replicated_numel=dims.replicated_numel)
    plan = build_plan(topo, 8, 2, prefetch_depth=3, reuse_weights=True, **sizes)
    memory = json.loads(run(capsys, *MODEL_3X2, "--json"))["memory"]
    assert memory["per_rank"]["total"] == memory_per_rank(plan, dims).total
    assert "budget" not in memory
    options = {(o["mb_per_fetch"], o["prefetch_depth"], o["reuse_weights"]): o for o in memory["options"]}
    assert options.keys() == {(1, 3, True), (2, 3, True), (1, 5, True), (2, 5, True)}
    for (k, d, r), o in options.items():
        plan_k = build_plan(topo, 8, 2, prefetch_depth=d, mb_per_fetch=k, reuse_weights=r, **sizes)
        assert o["inter_node_busiest_node"] == max(plan_traffic(plan_k).per_node())
        assert o["per_rank"]["staging"] == memory_per_rank(plan_k, dims).staging
    budget = (options[(2, 3, True)]["per_rank"]["total"] + options[(1, 5, True)]["per_rank"]["total"]) / 2 / 2**30
    argv = [*MODEL_3X2, "--memory-budget", f"{budget:.4f}"]
    lines = run(capsys, *argv).splitlines()
    chosen = json.loads(run(capsys, *argv, "--json"))["memory"]["budget"]
    assert chosen["largest_mb_per_fetch"] == 2
    assert chosen["fewest_inter_node"] == {"mb_per_fetch": 2, "prefetch_depth": 3, "reuse_weights": True}
    assert "auto (tawpipe train's default): " + chosen["auto"] in lines


def test_fitting_breaks_ties_on_memory_and_reports_the_largest_k():
    def mem(gib):
        return MemoryEstimate(persistent=gib * 2**30, staging=0, replicated=0, activations=0)

    options = {(1, 1, False): (9.0, mem(1)), (2, 1, False): (5.0, mem(3)), (2, 3, True): (5.0, mem(2)),
               (4, 1, False): (4.0, mem(8))}
    assert fitting(options, 4 * 2**30) == (2, (2, 3, True))
    assert fitting(options, 1 * 2**30) == (1, (1, 1, False))
    assert fitting(options, 0.5 * 2**30) == (None, None)


def test_prefetch_depth_takes_a_number_or_resident(capsys):
    assert "--prefetch-depth" in refused(capsys, "plan", "--nodes", "2", "--per-node", "2", "--layers", "4",
                                         "--micro-batches", "1", "--prefetch-depth", "deep")
    assert "--reuse-weights" in refused(capsys, "plan", "--nodes", "2", "--per-node", "2", "--layers", "4",
                                        "--micro-batches", "1", "--prefetch-depth", "resident")
    # beyond the resident depth (d + 1 >= the pipeline's ranks) a plan costs buffers and gains nothing
    for replicas, most in ((1, 7), (2, 3)):
        argv = ["plan", "--nodes", "4", "--per-node", "2", "--layers", "8", "--micro-batches", "1", "--no-table",
                "--replicas", str(replicas), "--prefetch-depth"]
        assert f"--prefetch-depth {most + 1} is beyond {most}, where {most + 1} staging buffers" in refused(
            capsys, *argv, str(most + 1))
        assert main(argv + [str(most)]) == 0
        assert f"prefetch depth {most}," in capsys.readouterr().out


@pytest.mark.parametrize("algo", ["tawpipe", "weipipe"])
def test_peer_table_counts_weipipe_and_tawpipe_from_their_plans(capsys, algo):
    """At 2 micro-batches the closed forms are 10-35% off; the table's tawpipe row is the plan
    printed (the user's options), the weipipe row WeiPipe's plan, the others closed forms."""
    topo, dims = Topology(2, 2), ModelDims(hidden=256, layers=8, heads=8, vocab=512, seq=512, dtype_bytes=4)
    taw = dict(mb_per_fetch=2, prefetch_depth="resident", reuse_weights=True) if algo == "tawpipe" else {}
    flags = ("--mb-per-fetch", "2", "--prefetch-depth", "resident", "--reuse-weights") if taw else ()
    out = run(capsys, "plan", "--nodes", "2", "--per-node", "2", "--layers", "8", "--micro-batches", "2",
              "--no-table", "--algo", algo, *flags, "--hidden", "256", "--heads", "8", "--vocab", "512",
              "--seq-len", "512", "--dtype-bytes", "4")
    sizes = dict(layer_numel=dims.layer_numel, weight_bytes=4, grad_bytes=4, replicated_numel=dims.replicated_numel)
    plans = {"tawpipe": build_plan(topo, 8, 2, **taw, **sizes),
             "weipipe": build_plan(topo, 8, 2, algo="weipipe", **sizes)}
    rows = {m[1]: (float(m[2]), float(m[3]))
            for m in re.finditer(r"^\s+(\w+)\s+([\d.]+) GB\s+([\d.]+) GB$", out, re.M)}

    def printed(sent: float, inter: float):  # two decimals in GB
        return pytest.approx(sent / 1e9, abs=0.0051), pytest.approx(inter / 1e9, abs=0.0051)

    for method, plan in plans.items():
        t = plan_traffic(plan)
        assert rows[method] == printed(t.total() / topo.world_size, max(t.per_node()))
    ddp = estimate("ddp", dims, topo, 2)
    assert rows["ddp"] == printed(ddp.sent_per_rank, ddp.inter_node_per_node)
    assert estimate("weipipe", dims, Topology(1, 1), 2).sent_per_rank == 0  # no ring on one rank


def test_savers_that_do_not_go_together_are_refused_naming_the_flags(capsys):
    """recompute "none" keeps whole graphs, so nothing is there to offload: the cost model's
    Savers refuse it (as the engine's MemoryPolicy does), and `tawpipe plan` says so in flags."""
    from tawpipe.cost.memory import Savers
    from tawpipe.engine.policy import MemoryPolicy

    for make in (Savers, MemoryPolicy):
        with pytest.raises(ValueError, match="recompute='none' does not run from"):
            make("none", offload_activations=True)
        with pytest.raises(ValueError, match="recompute must be one of"):
            make("selective")
    line = refused(capsys, "plan", "--nodes", "2", "--per-node", "2", "--layers", "8", "--micro-batches", "2",
                   "--recompute", "none", "--offload-activations")
    assert "--offload-activations keeps a chunk's input on the host, which --recompute none does not run from" in line
    assert line.endswith("use --recompute chunk, --recompute layer or --recompute block")


@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "8192"], "--seq-len needs a model to count with: add --model NAME or --hidden H"),
    (["--memory-budget", "4"], "--memory-budget needs a model to count with"),
    (["--inter", "25gbe"], "--inter needs a model to count with"),
    (["--offload-state"], "--offload-state needs a model to count with"),
    (["--model", "tiny", "--heads", "4"], "--heads describes a model of your own (with --hidden); --model tiny gives "
                                          "its own: drop it"),
    (["--model", "tiny", "--vocab", "512"], "--vocab describes a model of your own"),
])
def test_a_flag_the_plan_would_ignore_is_refused(capsys, extra, message):
    """Sizes mean nothing without a model, and --hidden's shape flags nothing beside --model: the
    plan used to print as if they were not given."""
    base = ["plan", "--nodes", "2", "--per-node", "2", "--layers", "8", "--micro-batches", "2", "--no-table"]
    assert message in refused(capsys, *base, *extra)
    assert main(base + ["--inter", "10gbe", "--seq-len", "4096"]) == 0  # the defaults, given again


@pytest.mark.parametrize("shape, way", [
    ("128 16 1", r"run the nodes as replicas \(--replicas 2\)$"),
    ("128 16 4", r"run the nodes as replicas \(--replicas 4\) or fewer --micro-batches$"),
    ("2 1024 4", r"use at most 1 --micro-batches with --replicas 2$"),
    ("1 2048 1", r"even one node of 2048 ranks is too large a pipeline to build here$"),
])
def test_a_plan_too_large_to_build_is_refused_naming_a_way_that_fits(capsys, shape, way):
    """Refused before anything is built (the largest allowed takes about 45 s), with a way out
    that does fit: a replica count, fewer micro-batches only where there is more than one."""
    nodes, per_node, acc = shape.split()
    line = refused(capsys, "plan", "--nodes", nodes, "--per-node", per_node, "--micro-batches", acc,
                   "--layers", "4096", "--no-table")
    assert "more than the 4,000,000 this command builds: " in line and re.search(way, line), line


def test_the_k_table_leaves_out_what_it_cannot_build_in_time(capsys, monkeypatch):
    """Every k at two depths is a plan each: where they would hold more forwards and backwards
    than the command builds, only the asked row is printed (no plan built for it), and says so."""
    import tawpipe.cli as cli

    argv = ["plan", "--nodes", "2", "--per-node", "2", "--layers", "8", "--micro-batches", "4", "--no-table",
            "--model", "tiny", "--memory-budget", "0.7"]
    full = run(capsys, *argv)
    assert len(re.findall(r"^\s+\d+\s+\d[ a-z]*\s+[\d.]+ GB\s+[\d.]+ GiB", full, re.M)) == 6  # k = 1, 2, 4 at two depths
    built = []
    monkeypatch.setattr(cli, "build_plan", lambda *a, **kw: built.append(kw) or build_plan(*a, **kw))
    monkeypatch.setattr(cli, "MOST_COMPUTE_ACTIONS", 500)  # the plan's 128 forwards and backwards fit, 6 x 128 not
    out = run(capsys, *argv)
    rows = re.findall(r"^\s+(\d+)\s+(\d[ a-z]*?)\s+[\d.]+ GB\s+[\d.]+ GiB", out, re.M)
    assert rows == [("1", "1")]
    assert "the other k and depths left out: their plans would hold 128 forwards and backwards each" in out
    assert "within 0.7 GiB" not in out and "auto (tawpipe train's default): " in out
    assert [kw.get("algo", "tawpipe") for kw in built] == ["tawpipe", "weipipe"]  # the plan and its peer only
    memory = json.loads(run(capsys, *argv, "--json"))["memory"]
    assert len(memory["options"]) == 1 and memory["options_left_out"].startswith("the other k and depths left out")
    assert memory["budget"]["largest_mb_per_fetch"] is None
