"""`tawpipe train`: model selection, config files, help, validation loss, metrics, export."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tawpipe
from tawpipe import models
from tawpipe.cli import main
from tawpipe.data import batch, load_tokens
from tawpipe.metrics import MetricsWriter, _flatten, check_tensorboard
from tawpipe.models.llama import Llama, LlamaConfig, llama_loss
from tawpipe.train import add_arguments

ROOT = Path(tawpipe.__file__).resolve().parent.parent


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tawpipe train")
    add_arguments(p)
    return p


def test_help_shows_defaults_and_presets(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--steps STEPS optimizer steps (default: 100)" in out
    assert "(default: tiny)" in out and "(default: float32)" in out
    for preset in models.PRESETS:
        assert preset in out
    assert "qwen2" in out


@pytest.mark.parametrize("suffix, text", [
    (".toml", 'steps = 7\nmicro_batches = 3\nmodel = "micro"\nlr = 0.01\n'),
    (".yaml", "steps: 7\nmicro-batches: 3\nmodel: micro\nlr: 0.01\n"),
])
def test_config_file_keys_mirror_the_flags_and_flags_win(tmp_path, suffix, text):
    file = tmp_path / f"run{suffix}"
    file.write_text(text)
    args = parser().parse_args(["--config", str(file), "--steps", "9"])
    assert (args.steps, args.micro_batches, args.model, args.lr) == (9, 3, "micro", 0.01)
    assert parser().parse_args(["--steps", "9", "--config", str(file)]).steps == 9  # wherever --config is


@pytest.mark.parametrize("text, match", [
    ("stepz = 3\n", "unknown key 'stepz'; keys are the flags' names: .*steps"),
    ("steps = 'many'\n", "--steps: invalid int value: 'many'"),
    ("dtype = 'float64'\n", "--dtype: invalid choice: 'float64'"),
    ("steps = \n", "--config .*run.toml: "),
    ("config = 'other.toml'\n", "unknown key 'config'"),
])
def test_config_file_errors_name_the_key(tmp_path, capsys, text, match):
    file = tmp_path / "run.toml"
    file.write_text(text)
    with pytest.raises(SystemExit):
        parser().parse_args(["--config", str(file)])
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize("argv, match", [
    (["--model", "no-such-model"], "neither a preset .*tiny.*nor a config .json"),
    (["--val-every", "-1"], "--val-every must be >= 0"),
    (["--val-batches", "0"], "--val-batches must be >= 1"),
])
def test_bad_arguments_fail_before_any_rank_starts(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(["train", *argv])


def test_model_specs(tmp_path):
    assert models.check("tiny") == "preset"
    cfg_file = tmp_path / "llama.json"
    cfg_file.write_text(json.dumps({"hidden": 48, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2}))
    assert models.check(str(cfg_file)) == "llama-json"
    parts = models.load(str(cfg_file), seed=1, vocab_size=300)
    assert len(parts.blocks) == 3 and parts.vocab_size == 300 and parts.embed.weight.shape == (300, 48)
    assert all(p.is_meta for b in parts.blocks for p in b.parameters())
    cfg_file.write_text(json.dumps({"hiddden": 48}))
    with pytest.raises(ValueError, match=r"unknown LlamaConfig fields \['hiddden'\]"):
        models.check(str(cfg_file))
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        models.check(str(tmp_path / "dir"))
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path / "dir")
    assert models.check(str(tmp_path / "dir")) == "hf-dir"
    assert models.check(str(tmp_path / "dir" / "config.json")) == "hf-json"
    assert "random init, seed 5" in models.load(str(tmp_path / "dir"), seed=5).description


def test_metrics_writer_and_tensorboard(tmp_path, monkeypatch):
    w = MetricsWriter(tmp_path / "sub" / "m.jsonl")
    w.write({"step": 1, "loss": 2.5, "peak_memory": [{"host": 10}, {"host": 12}]})
    w.write({"step": 2, "loss": 2.0})
    w.close()
    lines = [json.loads(x) for x in (tmp_path / "sub" / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and lines[0]["peak_memory"][1]["host"] == 12
    assert _flatten({"step": 1, "a": {"b": [3, 4]}, "s": "x", "f": True}) == [("step", 1.0), ("a/b/0", 3.0),
                                                                              ("a/b/1", 4.0)]
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        check_tensorboard()


def test_train_end_to_end_with_config_validation_metrics_and_export(tmp_path):
    """A short local 2x2 run of the built-in model: the summary, one metrics record per step with
    every rank's peak memory, validation losses equal to an independent evaluation of the saved
    model, and an export that transformers loads and that computes the built-in model's logits."""
    config = tmp_path / "run.toml"
    config.write_text('model = "micro"\nsteps = 3\nseq-len = 24\nbatch-size = 2\nval-every = 2\nval-batches = 2\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "tawpipe", "train", "--config", str(config), "--layers", "5", "--seed", "3",
           "--metrics", str(tmp_path / "m.jsonl"), "--save", str(tmp_path / "final.pt")]
    has_hf = importlib.util.find_spec("transformers") is not None
    if has_hf:
        cmd += ["--export", str(tmp_path / "hf")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for line in ("data: python", "vocabulary 256", "model: built-in LLaMA (5 layers", "seed 3",
                 "topology: 2 node(s) x 2 rank(s) = 4 ranks, chunks of [2, 1, 1, 1] layers", "compute float32",
                 "memory per rank (rank 0): own chunk", "validation loss: step 2"):
        assert line in text, line
    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [("val_loss" in r) for r in records] == [False, True, True]
    for r in records:
        assert r["tokens"] == r["step"] * 4 * 2 * 2 * 24 and r["tokens_per_s"] > 0
        assert len(r["peak_memory"]) == 4 and all(m["host"] > 50 * 2**20 for m in r["peak_memory"])
        assert len(r["bytes_per_iter"]["inter_node"]) == 4 and r["bytes_per_iter"]["inter_node"][0] > 0
    # The last validation loss, recomputed without tawpipe from the saved final weights.
    saved = torch.load(tmp_path / "final.pt", weights_only=True)
    cfg = LlamaConfig.preset("micro", n_layers=5, max_seq_len=24)
    model = Llama(cfg)
    model.load_state_dict(saved["model"])
    val = load_tokens(None).val
    with torch.no_grad():
        losses = [llama_loss(model(x), y).item()
                  for x, y in (batch(val, 24, 2, seed=3, step=0, index=i) for i in range(4 * 2))]
    assert records[-1]["val_loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
    if has_hf:
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
        x = torch.randint(0, 256, (2, 24))
        with torch.no_grad():
            torch.testing.assert_close(exported(x).logits, model(x), rtol=0, atol=2e-5)
