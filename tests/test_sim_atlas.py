"""The map (``tawpipe.sim.atlas``, issue #24 item 4): its rows are consistent with the simulator
and with themselves, its search finds TawPipe's best setting, and it writes what it promises."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tawpipe.cost.memory import Savers, memory_per_rank
from tawpipe.sim import atlas, atlas_report, compare
from tawpipe.sim.atlas import Grid
from tawpipe.sim.hardware import Cluster, device, link
from tawpipe.sim.peers import peer_memory
from tawpipe.sim.play import engine_plan
from tawpipe.sim.workload import Workload, model

# 2 nodes x 4 H100s, LLaMA 1B at S = 2k: every method applies and each cell plays in well under a
# second; 20 GiB devices so that some methods (DDP: ~27 GiB) do not fit.
TINY = Grid(nodes=(2,), per_node=4, links=("10gbe", "400gb"), models=("1b",), seqs=(2048,), device="h100:memory=20")


@pytest.fixture(scope="module")
def tiny():
    return atlas.map_rows(TINY)


def _fitting(row):
    return {m: e for m, e in row["methods"].items() if e.get("fits") and e.get("time_s") is not None}


def test_every_cell_has_a_row_with_every_method(tiny):
    rows, stats = tiny
    assert [(r["nodes"], r["link"], r["model"], r["seq"]) for r in rows] == [
        (2, "10gbe", "1b", 2048), (2, "400gb", "1b", 2048)]
    for r in rows:
        assert set(r["methods"]) == set(atlas.METHODS)
        assert r["gpus"] == 8 and r["acc"] == TINY.acc
    assert stats["played"] >= 2 and not stats["bound_violations"]


def test_the_winner_is_the_fastest_method_that_fits(tiny):
    rows, _ = tiny
    assert any(not e.get("fits") for r in rows for e in r["methods"].values())  # the test bites
    for r in rows:
        ok = _fitting(r)
        assert r["winner"] in ok
        assert ok[r["winner"]]["time_s"] == min(e["time_s"] for e in ok.values())
        others = {m: e for m, e in ok.items() if m != "tawpipe"}
        assert r["best_other"] == min(others, key=lambda m: others[m]["time_s"])


def test_tawpipes_margin_is_the_ratio_of_the_two_times(tiny):
    rows, _ = tiny
    for r in rows:
        m = r["methods"]
        assert r["tawpipe_margin"] == pytest.approx(m[r["best_other"]]["time_s"] / m["tawpipe"]["time_s"], rel=1e-12)
        assert (r["winner"] == "tawpipe") == (r["tawpipe_margin"] > 1)


def test_a_method_that_does_not_fit_never_wins():
    fast = {"time_s": 1.0, "fits": False}
    row = atlas.decide({"methods": {"tawpipe": {"time_s": 3.0, "fits": True}, "ddp": fast,
                                    "hsdp": {"time_s": 2.0, "fits": True}, "1f1b": {"error": "n/a", "fits": False,
                                                                                  "time_s": None}}})
    assert (row["winner"], row["best_other"]) == ("hsdp", "hsdp")
    assert row["tawpipe_margin"] == pytest.approx(2 / 3)
    none = atlas.decide({"methods": {"tawpipe": {"time_s": 3.0, "fits": False}, "ddp": fast}})
    assert none["winner"] is None and none["tawpipe_margin"] is None


def test_the_search_finds_tawpipes_best_setting_that_fits(tiny):
    rows, _ = tiny
    dev = device(TINY.device)
    for r in rows:
        cluster = Cluster(2, 4, dev, link("nvlink"), link(r["link"]))
        work = Workload(model("1b", seq=2048, micro_batch=1), dev)
        times = []
        for s in atlas.taw_settings(2, 4, work.dims.layers, TINY.acc):
            for savers in atlas.SAVERS:  # every setting with every choice of memory savers
                row = compare.run("tawpipe", cluster, work, TINY.acc, settings=s, savers=savers,
                                  chunked_loss=TINY.chunked_loss)
                if row.fits:
                    times.append(row.time_s)
        assert r["methods"]["tawpipe"]["time_s"] <= min(times) * (1 + atlas.PRUNE) + 1e-12
        assert r["methods"]["tawpipe"]["time_s"] >= min(times) - 1e-12


def test_a_plan_built_once_plays_as_compare_runs_it():
    dev = device("h100")
    cluster = Cluster(2, 4, dev, link("nvlink"), link("100gb"))
    work = Workload(model("1b", seq=2048, micro_batch=1), dev)
    s = {"replicas": 2, "mb_per_fetch": 2, "prefetch_depth": 1, "reuse_weights": False}
    ref = compare.run("tawpipe", cluster, work, 4, settings=s)
    plan = engine_plan(cluster, work, 4, **s)
    mine = compare.play("tawpipe", plan, cluster, work, 4, s)
    for key in ("time_s", "compute_s", "inter_bytes", "intra_bytes", "mfu"):
        assert getattr(mine, key) == pytest.approx(getattr(ref, key), rel=1e-12), key
    assert mine.bottleneck == ref.bottleneck
    assert mine.memory.total == pytest.approx(memory_per_rank(plan, work.dims).total + compare.loss_bytes(work.dims, chunked=False))
    assert atlas.compute_floor(plan, work) <= mine.time_s
    ref = compare.run("1f1b", cluster, work, 4)  # P = N, compare's default
    mine = atlas.pipeline_row(cluster, work, 4, stages=8)
    assert atlas.compute_floor(plan, work, savers=Savers("layer")) > atlas.compute_floor(plan, work)
    assert (mine.time_s, mine.memory.total) == (pytest.approx(ref.time_s, rel=1e-12), ref.memory.total)


def test_settings_and_stages_follow_the_rules():
    # 16 nodes x 8, L = 32: pipelines of at most 32 ranks, R over the divisors of 16
    rs = {s["replicas"] for s in atlas.taw_settings(16, 8, 32, 8)}
    assert rs == {4, 8, 16}
    ks = {s["mb_per_fetch"] for s in atlas.taw_settings(16, 8, 32, 8)}
    assert ks == {1, 2, 4, 8}
    assert atlas.pipeline_stages(3, 8, 32) == [24, 8]  # P | 24, P <= 32, tiling nodes
    assert atlas.pipeline_stages(128, 8, 80) == [64, 32, 16]  # and 16: the largest dividing L
    assert atlas.pipeline_stages(3, 8, 16) == [8, 4]


def test_a_cell_the_simulator_refuses_records_why(monkeypatch):
    # 5 nodes x 4 = 20 ranks > 16 layers: WeiPipe's one pipeline cannot exist, TawPipe needs R = 5
    grid = Grid(nodes=(5,), per_node=4, links=("100gb",), models=("1b",), seqs=(2048,))
    real = compare.run

    def refuse(method, *args, **kwargs):
        if method == "ddp":
            raise ValueError("too large a plan")
        return real(method, *args, **kwargs)

    monkeypatch.setattr(atlas.compare, "run", refuse)
    (row,), _ = atlas.map_rows(grid)
    assert "n/a" in row["methods"]["weipipe"]["error"] and row["methods"]["weipipe"]["fits"] is False
    assert row["methods"]["ddp"]["error"] == "too large a plan"
    assert {t["settings"]["replicas"] for t in row["tawpipe_tried"]} == {5}
    assert row["winner"] not in ("weipipe", "ddp")


def test_main_map_writes_json_markdown_and_png(tmp_path, monkeypatch, capsys, tiny):
    rows, stats = tiny
    monkeypatch.setattr(atlas_report, "QUICK", replace(TINY, contexts=(1,)))  # what fits where: without CP
    monkeypatch.setattr(atlas_report, "map_rows", lambda grid, **_: (rows, stats))
    assert atlas_report.main_map(tmp_path, quick=True) == 0
    doc = json.loads((tmp_path / "map.json").read_text())
    assert doc["rows"] == json.loads(json.dumps(rows)) and doc["grid"]["acc"] == TINY.acc
    md = (tmp_path / "map.md").read_text()
    assert "## 1B" in md and "| 8 | 10gbe |" in md and md.strip() in capsys.readouterr().out
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for r in rows:
        assert f"×{r['tawpipe_margin']:.2f}" in md and not math.isnan(r["tawpipe_margin"])


def test_the_map_read_again_keeps_its_largest_fits_while_the_source_is_the_same(tmp_path, monkeypatch, tiny):
    """``largest_fits`` takes minutes on the full grid: ``map.json`` keeps it under the source's
    fingerprint, a map made again reads it, and a map of another grid or source counts it again."""
    rows, stats = tiny
    grid = replace(TINY, contexts=(1,))
    monkeypatch.setattr(atlas_report, "QUICK", grid)
    monkeypatch.setattr(atlas_report, "map_rows", lambda grid, **_: (rows, stats))
    counted = []
    real = atlas_report.largest_fits
    monkeypatch.setattr(atlas_report, "largest_fits", lambda g: counted.append(g) or real(g))
    assert atlas_report.main_map(tmp_path, quick=True) == 0 and len(counted) == 1
    first = json.loads((tmp_path / "map.json").read_text())["stats"]
    assert first["fingerprint"] == atlas.fingerprint(grid)
    assert atlas_report.main_map(tmp_path, quick=True) == 0 and len(counted) == 1  # read, not counted
    assert json.loads((tmp_path / "map.json").read_text())["stats"]["largest_fits"] == first["largest_fits"]
    monkeypatch.setattr(atlas_report, "fingerprint", lambda g: "another source")
    assert atlas_report.main_map(tmp_path, quick=True) == 0 and len(counted) == 2
    monkeypatch.setattr(atlas_report, "QUICK", replace(grid, acc=4))  # the same source, another grid
    assert atlas_report.main_map(tmp_path, quick=True) == 0 and len(counted) == 3


def test_the_map_played_in_processes_is_the_map_played_in_one(tiny):
    """``map_rows`` given a pool (``tawpipe simulate --map --jobs``): each (nodes, model) group in a
    process of its own, the rows in the grid's order and their statistics summed, as in one process."""
    grid = replace(TINY, nodes=(2, 3))
    alone, alone_stats = atlas.map_rows(grid)
    assert alone[:2] == tiny[0]
    heard = []
    with atlas_report.processes(2) as pool:
        pooled, pooled_stats = atlas.map_rows(grid, pool=pool, progress=heard.append)
    assert pooled == alone and len(heard) == len(alone) == 4
    for key in ("played", "pruned", "bound_violations"):
        assert pooled_stats[key] == alone_stats[key]
    assert pooled_stats["seconds"].keys() == alone_stats["seconds"].keys() == {"2x4 1b", "3x4 1b"}


def _played(time_s: float, compute_s: float, inter_gb: float = 1.0, **settings) -> dict:
    return {"time_s": time_s, "compute_s": compute_s, "exposed_comm_s": time_s - compute_s, "fits": True,
            "inter_gb": inter_gb, "bottleneck": "inter-node link", "settings": settings, "pcie_gb": 0.0}


def _cell(seq: int, gpus: int, **methods: dict) -> dict:
    taw = methods.pop("tawpipe", None) or {"fits": False, "time_s": None}
    row = {"seq": seq, "gpus": gpus, "link": "10gbe", "model": "7b", "tawpipe_tried": [{"least_memory_gib": 91.5}],
           "methods": {"tawpipe": taw, **{m.replace("_", "-"): e for m, e in methods.items()}}}
    return atlas.decide(row)


def test_the_report_counts_standings_and_names_each_shortfall_with_why():
    """TawPipe against the fastest other method, or the fastest of FSDP2's ways to shard: wins by
    more than TIE, ties, loses, fits alone or not; the losing cells named with the larger of the
    extra compute and the extra exposed communication, or the memory TawPipe would need."""
    g = torch.Generator().manual_seed(3)
    base = 10 + 5 * torch.rand((), generator=g).item()
    rows = [
        _cell(4096, 24, tawpipe=_played(base, 0.7 * base, 30.0, replicas=3), fsdp=_played(1.2 * base, 0.8 * base),
              **{"1f1b": _played(0.8 * base, 0.7 * base, 3.0, stages=4, recompute=True)}),  # 1F1B wins: comm
        _cell(32768, 24, tawpipe=_played(base, 0.95 * base, recompute="layer"),
              hsdp=_played(1.01 * base, 0.5 * base, context_parallel=2)),  # tie with HSDP
        _cell(32768, 128, tawpipe=_played(base, 0.97 * base, replicas=1), ddp=_played(0.9 * base, 0.8 * base),
              fsdp_mm=_played(1.5 * base, base)),  # DDP wins on compute; beats FSDP2
        _cell(65536, 24, fsdp=_played(base, base)),  # TawPipe does not fit
        _cell(65536, 128, tawpipe=_played(base, base)),  # only TawPipe fits
        _cell(131072, 128),  # nothing fits
    ]
    assert atlas_report.standings(rows) == {"loses": 2, "ties": 1, "TawPipe does not fit": 1,
                                            "only TawPipe fits": 1, "neither fits": 1}
    assert atlas_report.standings(rows, atlas_report.FSDP2_FAMILY, 32768) == {
        "ties": 1, "wins": 1, "TawPipe does not fit": 1, "only TawPipe fits": 1, "neither fits": 1}
    c = atlas_report.summary(rows)
    assert (c["wins"], c["ties"], c["loses"], c["tawpipe_does_not_fit"], c["nothing_fits"]) == (1, 1, 2, 1, 1)
    assert (c["s_ge_32768_tawpipe_fastest_or_within_tie"], c["s_ge_32768_where_something_fits"]) == (2, 4)
    long = atlas_report.shortfalls(rows, 16384)
    assert [s["cell"] for s in long] == ["7B, 128 GPUs, 10gbe, 32k", "7B, 24 GPUs, 10gbe, 64k"]
    assert long[0]["winner"] == "DDP" and long[0]["margin"] == pytest.approx(0.9)
    assert long[0]["why"] == (f"compute: {0.97 * base:.3g} s against {0.8 * base:.3g} (TawPipe R=1 k=1 d1 no savers; "
                              "DDP no checkpointing)")
    assert long[1]["why"] == "does not fit: 92 GiB per device at the least" and long[1]["margin"] is None
    short = atlas_report.shortfalls(rows, 0, 16384)
    assert len(short) == 1 and short[0]["winner"] == "1F1B"
    assert short[0]["why"].startswith(f"communication: {0.3 * base:.3g} s exposed against {0.1 * base:.3g}, 30 GB")
    waits = _cell(16384, 24, tawpipe=_played(base, 0.8 * base, 2.0, replicas=2), fsdp=_played(0.9 * base, 0.85 * base, 9.0))
    assert atlas_report.why_not(waits).startswith(
        f"waits: {0.2 * base:.3g} s beyond its compute against {0.05 * base:.3g}, with fewer bytes through the busiest "
        "node's port (2 GB against 9): its pipeline's fill and drain (TawPipe's bottleneck")
    text = atlas_report.shortfalls_markdown(rows)
    assert text.count("| 7B, ") == 3 and "None." not in text
    assert "| 7B, 24 GPUs, 10gbe, 4k | 1F1B | ×0.80 | communication" in text


def test_the_tables_name_each_setting():
    """A TawPipe setting in the map's tables: the fetched chunks kept on the host show as "+host"
    (the map's legend promises it), reuse as "+reuse", context parallelism as "CPc"."""
    shown = atlas_report._settings_text
    assert shown({"replicas": 2, "mb_per_fetch": 4, "prefetch_depth": 1, "reuse_weights": "host"}) == "R=2 k=4 d1+host"
    assert shown({"resident": True, "reuse_weights": True, "context_parallel": 4}, "chunk") == "R=1 k=1 res+reuse CP4 chunk"
    assert shown({"prefetch_depth": 1, "reuse_weights": False}) == "R=1 k=1 d1"


def test_a_map_cut_short_goes_on_from_the_cells_it_saved(tmp_path, monkeypatch, tiny):
    """``map_rows(cells=...)``: every cell played is saved; run again, the cells saved under the
    same fingerprint are read instead of played, and one saved under another (TawPipe's own too) is
    played again."""
    rows, stats = atlas.map_rows(TINY, cells=tmp_path)
    assert rows == tiny[0] and stats["played"] == tiny[1]["played"]
    saved = sorted(tmp_path.glob("*.json"))
    assert [f.name for f in saved] == ["2x4-1b-2048-10gbe.json", "2x4-1b-2048-400gb.json"]
    stale = json.loads(saved[0].read_text())
    saved[0].write_text(json.dumps({**stale, "fingerprint": "another", "tawpipe_fingerprint": "another",
                                    "row": {**stale["row"], "winner": "x"}}))
    played = []
    real = atlas._tawpipe
    monkeypatch.setattr(atlas, "_tawpipe", lambda *a, **k: played.append(a[2].dims.seq) or real(*a, **k))
    again, again_stats = atlas.map_rows(TINY, cells=tmp_path)
    assert again == rows and again_stats["played"] == stats["played"] and len(played) == 1
    assert json.loads(saved[0].read_text())["fingerprint"] == atlas.fingerprint(TINY) != "another"


def test_a_cell_whose_tawpipe_search_is_current_plays_only_the_other_methods_again(tmp_path, monkeypatch, tiny):
    """A saved cell of another fingerprint but TawPipe's own: its TawPipe entry and what its search
    tried are kept, the others played again and the winner decided again."""
    atlas.map_rows(TINY, cells=tmp_path)
    saved = sorted(tmp_path.glob("*.json"))[0]
    cell = json.loads(saved.read_text())
    assert cell["tawpipe_fingerprint"] == atlas.fingerprint(TINY, atlas.PEERS_ONLY)
    row = cell["row"]
    kept = {**row["methods"]["tawpipe"], "time_s": row["methods"]["tawpipe"]["time_s"] / 10}  # marks what is kept
    fsdp = row["methods"]["fsdp"]
    row = {**row, "methods": {**row["methods"], "tawpipe": kept, "fsdp": {**fsdp, "time_s": 1e-9}}, "winner": "fsdp"}
    saved.write_text(json.dumps({**cell, "fingerprint": "another", "row": row, "searched_seconds": 100.0}))
    monkeypatch.setattr(atlas, "_tawpipe", lambda *a, **k: pytest.fail("TawPipe searched again"))
    again, _ = atlas.map_rows(TINY, cells=tmp_path)
    assert again[0]["methods"]["tawpipe"] == kept and again[0]["tawpipe_tried"] == cell["row"]["tawpipe_tried"]
    assert again[0]["methods"]["fsdp"] == tiny[0][0]["methods"]["fsdp"] != row["methods"]["fsdp"]
    assert again[0]["winner"] == "tawpipe" and again[1:] == tiny[0][1:]
    resaved = json.loads(saved.read_text())
    assert resaved["fingerprint"] == atlas.fingerprint(TINY) and resaved["searched_seconds"] == 100.0
    assert 100.0 < resaved["seconds"] < 100.0 + cell["seconds"]


def test_tawpipes_search_calls_nothing_of_the_peers_model(monkeypatch):
    """Why TawPipe's fingerprint may leave ``sim/peers.py`` out: with every function and class of
    it failing wherever it was imported, TawPipe's search of a cell still runs."""
    import sys

    from tawpipe.sim import peers

    def fail(*a, **k):
        raise AssertionError("TawPipe's search called the peers' model")

    for module in [m for n, m in sys.modules.items() if n.startswith("tawpipe.")]:
        for attr, value in list(vars(module).items()):
            if callable(value) and getattr(value, "__module__", None) == peers.__name__:
                monkeypatch.setattr(module, attr, fail)
    searched = []
    monkeypatch.setattr(atlas, "_play_cell", lambda *a: searched.append(a[-1]) or {})
    atlas.map_rows(TINY)
    assert len(searched) == 2 and all(entry["time_s"] > 0 and tried for entry, tried in searched)


def test_the_fingerprint_follows_the_played_sources_only(monkeypatch):
    """A cell's fingerprint changes with the source that plays it (the player) and not with the
    report's or the calibration's, so the tables can change without the map played again."""
    base, real = atlas.fingerprint(TINY), Path.read_bytes

    def edited(name: str):
        return lambda f: real(f) + (b"# edited" if f.name == name else b"")

    taw = atlas.fingerprint(TINY, atlas.PEERS_ONLY)
    for name, changes, taw_changes in (("play.py", True, True), ("memory.py", True, True), ("peers.py", True, False),
                                       ("atlas_report.py", False, False), ("calibrate.py", False, False)):
        monkeypatch.setattr(Path, "read_bytes", edited(name))
        assert (atlas.fingerprint(TINY) != base) is changes, name
        assert (atlas.fingerprint(TINY, atlas.PEERS_ONLY) != taw) is taw_changes, name
    monkeypatch.setattr(Path, "read_bytes", real)
    assert atlas.fingerprint(TINY) == base != atlas.fingerprint(replace(TINY, acc=TINY.acc + 1))
    assert atlas.fingerprint(replace(TINY, seqs=TINY.seqs[:1], links=TINY.links[1:])) == base  # a cell of it


def test_each_peer_runs_its_fastest_variant_that_fits():
    """Per-layer checkpointing and save_on_cpu only where the peer does not fit without them: on a
    20 GiB device FSDP2 needs checkpointing at S = 16k and not at 2k."""
    dev = device("h100:memory=20")
    cluster = Cluster(2, 4, dev, link("nvlink"), link("100gb"))
    for seq in (2048, 16384):
        work = Workload(model("1b", seq=seq, micro_batch=1), dev)
        times = {}
        for recompute in (False, True):
            for offload in (False, True):
                row = compare.run("fsdp", cluster, replace(work, recompute=recompute), 4, chunked_loss=True,
                                  savers=Savers(offload_activations=True) if offload else None)
                if row.fits:
                    times[(recompute, offload)] = row.time_s
        chosen = atlas.peer_entry("fsdp", cluster, work, 4, True)
        assert times and chosen["time_s"] == pytest.approx(min(times.values()), rel=1e-12), (seq, times)


def test_the_largest_fitting_sequence_fits_and_the_next_does_not():
    """``largest_fits`` per method: at its S some variant the map tries fits, at the next none does
    (checked against peer_memory for FSDP2 and against every TawPipe setting and savers' memory;
    without context parallelism, which these checks do not try)."""
    seqs = (2048, 8192, 32768, 131072)
    fits = atlas.largest_fits(replace(TINY, contexts=(1,)), nodes=2, models=("1b",), seqs=seqs)["1b"]
    dev = device(TINY.device)
    cluster = Cluster(2, 4, dev, link("nvlink"), link(TINY.links[0]))
    assert fits["ddp"] is None or fits["ddp"] < fits["fsdp"]  # 20 GiB: DDP's whole model barely fits, if at all

    def fsdp_fits(seq: int) -> bool:
        dims = model("1b", seq=seq, micro_batch=1)
        return any(compare.fits(peer_memory("fsdp", dims, cluster, TINY.acc, r, offload=o, chunked_loss=True), cluster)
                   for r in (False, True) for o in (False, True))

    def taw_fits(seq: int) -> bool:
        work = Workload(model("1b", seq=seq, micro_batch=1), dev)
        plans = [engine_plan(cluster, work, TINY.acc, **s) for s in atlas.taw_settings(2, 4, 16, TINY.acc)]
        return any(compare.fits(compare.with_loss(memory_per_rank(p, work.dims, sv), work.dims, True), cluster)
                   for p in plans for sv in atlas.SAVERS)

    for name, check in (("fsdp", fsdp_fits), ("tawpipe", taw_fits)):
        largest = fits[name]
        assert largest is not None and check(largest), name
        bigger = [s for s in seqs if s > largest]
        assert not bigger or not check(bigger[0]), name


LONG = replace(TINY, seqs=(16384,), contexts=(1, 2, 4), context_from=16384)


def test_at_long_s_the_map_searches_context_parallelism_for_tawpipe_and_the_peers():
    """At S >= context_from every TawPipe setting is tried with each context-parallel degree (its
    plans for c·acc micro-batches) and so is each data-parallel peer; the entries name the degree
    they chose, and a degree lowers the memory it is tried with."""
    assert LONG.contexts_at(16384) == (1, 2, 4) and LONG.contexts_at(8192) == (1,)
    rows, stats = atlas.map_rows(LONG)
    assert not stats["bound_violations"]
    for r in rows:
        tried = {t["settings"].get("context_parallel", 1) for t in r["tawpipe_tried"]}
        assert tried == {1, 2, 4}
        for m in ("tawpipe", "fsdp", "hsdp"):
            e = r["methods"][m]
            if e.get("fits"):
                assert e["settings"].get("context_parallel", 1) in (1, 2, 4)
        least = {c: min(t["least_memory_gib"] for t in r["tawpipe_tried"]
                        if t["settings"].get("context_parallel", 1) == c and t.get("least_memory_gib") is not None)
                 for c in (1, 2, 4)}
        assert least[4] < least[2] < least[1]
