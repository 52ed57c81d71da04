"""`tawpipe train`'s configuration: the flags, the config file, and the checks that need no torch.

Nothing here imports torch, so ``tawpipe train --help`` and a mistyped or out-of-range flag are
answered at once. A config file (TOML or YAML, keys named as the flags) sets the flags' defaults,
each value converted and checked as its flag's would be; flags on the command line override it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..commands import UsageError, add_reuse_weights, prefetch_depth
from ..cost.memory import AUTO, MARGIN
from ..models.presets import PRESETS
from ..plan import registry
from ..runtime.comm.registry import names as comm_names

DESCRIPTION = (
    "Train a model with TawPipe. With no arguments it starts an emulated cluster on this machine (2 nodes x 2 "
    "ranks, gloo, CPU) and trains a tiny byte-level LLaMA on the Python standard library's own source files. "
    "Under torchrun the same command trains across real nodes, NCCL on GPUs. Every input is checked before any "
    "worker starts; --mb-per-fetch, --prefetch-depth and --reuse-weights left 'auto' are chosen for the fewest "
    "inter-node bytes that fit the memory, and the start summary says why."
)

COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class TrainConfig:
    nodes: int = 2
    per_node: int = 2
    model: str = "tiny"
    layers: int | None = None
    data: str | None = None
    steps: int = 100
    micro_batches: int = 2
    micro_batch_size: int = 4
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 5
    dtype: str = "float32"
    max_grad_norm: float | None = 1.0
    grad_route: str = "rail"
    algo: str = "tawpipe"
    prefetch_depth: int | str = AUTO
    mb_per_fetch: int | str = AUTO
    reuse_weights: bool | str = AUTO
    memory_budget: float | None = None
    replicas: int = 1
    context_parallel: int = 1
    grad_wire_dtype: str = "float32"
    loss: str = "auto"
    recompute: str = "chunk"
    offload_state: bool = False
    offload_activations: bool = False
    comm: str = "torch"
    seed: int = 0
    save: str | None = None
    save_every: int | None = None
    resume: str | None = None
    export: str | None = None
    val_every: int = 25
    val_batches: int = 2
    metrics: str | None = None
    tensorboard: str | None = None
    log_every: int = 1
    max_skipped_in_a_row: int = 10

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainConfig:
        """The flags' values; --nodes and --per-node not given are the defaults (under torchrun
        the job's shape replaces them: ``job``)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items()
                      if k in names and not (k in ("nodes", "per_node") and v is None)})


# may change on resume: they do not change what is trained (at most the order of a sum). So may
# --nodes and --per-node, where their product, the ranks that draw batches, stays the same.
NOT_TRAINING = ("save", "save_every", "resume", "export", "val_every", "val_batches", "metrics", "tensorboard",
                "log_every", "prefetch_depth", "mb_per_fetch", "reuse_weights", "memory_budget", "replicas",
                "max_skipped_in_a_row", "loss", "comm", "recompute", "offload_state", "offload_activations",
                "algo", "grad_route")


def flag(name: str) -> str:
    """The flag of a ``TrainConfig`` field."""
    return "--" + name.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.epilog = (f"Built-in models for --model: {', '.join(PRESETS)}. Hugging Face model types: llama, mistral, "
                "qwen2, qwen3, gemma, phi3, olmo, olmo2, starcoder2, stablelm, smollm3, glm4, ernie4_5 "
                "(tawpipe.models.hf.register adds others).")
    p.add_argument("--config", default=None, help="TOML or YAML file of flag values, keys named as the flags "
                   "(micro-batches = 4); flags on the command line override it")
    p.add_argument("--nodes", type=int, default=None,
                   help=f"emulated nodes (default: {d.nodes}); under torchrun its --nnodes, which a value given must "
                        "match")
    p.add_argument("--per-node", type=int, default=None,
                   help=f"ranks per emulated node (default: {d.per_node}); under torchrun its --nproc-per-node, which "
                        "a value given must match")
    p.add_argument("--model", default=d.model,
                   help="a built-in model (below), a Hugging Face save_pretrained directory, or a config .json "
                        "(a Hugging Face config.json, or LlamaConfig fields)")
    p.add_argument("--layers", type=int, default=None, help="override a built-in model's layer count")
    p.add_argument("--data", default=None, help="text file, uint16 .bin (nanoGPT's), or .npy of integer tokens of any "
                   "width (uint32 past 65,536 tokens) (default: Python stdlib sources)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches, help="micro-batches per rank per step")
    p.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps, then cosine decay to 10%%")
    p.add_argument("--dtype", choices=COMPUTE_DTYPES, default=d.dtype, help="compute dtype")
    p.add_argument("--max-grad-norm", type=_or_word(float, "none", None), default=d.max_grad_norm,
                   help="clip the global gradient norm to this; 'none': do not clip")
    p.add_argument("--grad-route", choices=("rail", "leader"), default=d.grad_route,
                   help="router of inter-node gradients")
    p.add_argument("--algo", choices=registry.names(), default=d.algo,
                   help="the schedule (weipipe: the paper's baseline)")
    p.add_argument("--prefetch-depth", type=_or_auto(prefetch_depth), default=d.prefetch_depth,
                   help="fetch weights this many slots ahead; 'resident' (with --reuse-weights): every fetched "
                        "chunk stays in a staging buffer, the fewest bytes for the most staging memory; 'auto': "
                        "chosen with k and reuse, the fewest inter-node bytes that fit --memory-budget")
    p.add_argument("--mb-per-fetch", type=_or_auto(int), default=d.mb_per_fetch,
                   help="k: micro-batches a resident chunk runs per fetch (divides --micro-batches); "
                        "inter-node bytes fall by k (see tawpipe plan --memory-budget); 'auto': chosen")
    add_reuse_weights(p, default=d.reuse_weights,
                      help="do not fetch again a chunk still in a staging buffer; 'host': and keep the fetched chunks "
                           "the buffers cannot in pinned host memory (neither flag: auto)")
    margin = f"{MARGIN:.0%}".replace("%", "%%")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GiB",
                   help="memory per rank within which 'auto' chooses k, the depth and reuse (default: under torchrun "
                        "the GPU's free memory, else the host's available memory shared by its ranks; less "
                        f"{margin} and the runtime's own)")
    p.add_argument("--replicas", type=int, default=d.replicas,
                   help="R: the nodes form R replicas of nodes/R nodes, each a pipeline of its own; a chunk's R "
                        "owners add their gradients once per step (see tawpipe plan --replicas)")
    p.add_argument("--context-parallel", type=int, default=d.context_parallel, metavar="C",
                   help="C ranks of a node compute each micro-batch together, each on two mirrored slices of its "
                        "sequences (keys and values exchanged inside the node): a rank keeps 1/C of the "
                        "activations; C divides --per-node, --seq-len is a multiple of 2C; the global batch is "
                        "then nodes x per-node / C x micro-batches sequences (built-in models, and Hugging Face "
                        "ones whose layers attend fully, without attention dropout)")
    p.add_argument("--grad-wire-dtype", choices=("float32", "compute"), default=d.grad_wire_dtype,
                   help="dtype gradients travel in; the owner accumulates in float32 either way")
    p.add_argument("--loss", choices=("plain", "chunked", "auto"), default=d.loss,
                   help="chunked: the head and cross-entropy a slice of tokens at a time, never the whole "
                        "[tokens, vocabulary] float32 logits (equal to plain to ~1e-6; a head that is a norm and a "
                        "bias-free projection, as built-in and Hugging Face models have); auto: chunked where such "
                        "a model's logits would outweigh a layer's activations")
    p.add_argument("--recompute", choices=("chunk", "layer", "block", "none", "auto"), default=d.recompute,
                   help="what a backward runs again: the chunk from its input (the paper's), the same a layer at a "
                        "time (one layer's activations alive at once), each layer from its input kept by the "
                        "forward (torch's per-block checkpointing: no second run), or nothing (every forward's "
                        "graph kept); auto: of the memory savers that fit the memory (recompute, and on a GPU "
                        "the offloads too), those that move the fewest inter-node bytes, then the fastest; an "
                        "offload flag given kept")
    p.add_argument("--offload-state", action="store_true",
                   help="keep the own chunk's float32 master, gradients and optimizer state in host memory")
    p.add_argument("--offload-activations", action="store_true",
                   help="keep the chunk inputs a forward saves for its backward in host memory until then")
    p.add_argument("--comm", choices=comm_names(), default=d.comm,
                   help="the communication backend: torch (torch.distributed: gloo, or NCCL on GPUs) or another "
                        "registered one (nccl-native: tawpipe's own NCCL, GPUs under torchrun)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the initial model and of the batches")
    _add_output_arguments(p, d)
    _config_file_sets_defaults(p)


def _add_output_arguments(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """What a run writes and watches: checkpoints, export, validation, metrics, the skip limit."""
    p.add_argument("--save", default=None, metavar="DIR",
                   help="checkpoint directory: a checkpoint at the end (and every --save-every steps)")
    p.add_argument("--save-every", type=int, default=None, metavar="N", help="also checkpoint every N steps")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint: a step directory, or the latest one under DIR")
    p.add_argument("--export", default=None, metavar="DIR", help="write the trained model here as a Hugging Face "
                   "save_pretrained directory (safetensors; each rank writes its own chunk)")
    p.add_argument("--val-every", type=int, default=d.val_every,
                   help="validation loss on the held-out split every this many steps and at the end (0: never)")
    p.add_argument("--val-batches", type=int, default=d.val_batches, help="validation micro-batches per rank")
    p.add_argument("--metrics", default=None, metavar="FILE", help="append a JSON record per logged step to FILE")
    p.add_argument("--tensorboard", default=None, metavar="DIR", help="also write the metrics as TensorBoard events")
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between metrics records")
    p.add_argument("--max-skipped-in-a-row", type=int, default=d.max_skipped_in_a_row, metavar="N",
                   help="stop with an error when N steps in a row are skipped (loss or gradients not finite), "
                        "or when every step of the run was; 0: never")


def _or_auto(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``, or "auto" (the cost model chooses the value)."""
    return _or_word(parse, AUTO, AUTO)


def _or_word(parse: Callable[[str], Any], word: str, value: Any) -> Callable[[str], Any]:
    """``parse``, or ``word`` meaning ``value``."""
    def parse_or_word(text: str) -> Any:
        return value if text == word else parse(text)

    parse_or_word.__name__ = parse.__name__  # argparse names the type in its errors
    return parse_or_word


def _config_file_sets_defaults(p: argparse.ArgumentParser) -> None:
    """Make ``p`` read --config's file before the command line: the file's values become the
    flags' defaults, converted and checked as the flags' values are, so the flags given win."""
    parse_known_args = p.parse_known_args
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")

    def with_config(args: list[str] | None = None, namespace: argparse.Namespace | None = None):
        args = sys.argv[1:] if args is None else list(args)
        path = pre.parse_known_args(args)[0].config
        if path:
            p.set_defaults(**read_config_file(p, path))
        return parse_known_args(args, namespace)

    p.parse_known_args = with_config  # type: ignore[method-assign]


def read_config_file(p: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The values a TOML or YAML file gives ``p``'s flags, by destination; UsageError naming the
    file and the key where one is unknown or not a value its flag takes."""
    values = _load(path)
    actions = {o: a for a in p._actions for o in a.option_strings
               if o.startswith("--") and o not in ("--config", "--help")}
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = "--" + str(key).replace("_", "-")
        if name not in actions:
            raise UsageError(f"--config {path}: unknown key {key!r}; keys are the flags' names: "
                             f"{', '.join(sorted(f[2:] for f in actions))}")
        converted = _convert(actions[name], name, value, path) if value is not None else _UNSET
        if converted is not _UNSET:
            out[actions[name].dest] = converted
    return out


def _load(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--config {path}: no such file")
    if file.suffix not in (".toml", ".yaml", ".yml"):
        raise UsageError(f"--config {path}: use a .toml, .yaml or .yml file")
    try:
        if file.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib

            values = tomllib.loads(file.read_text())
        else:
            import yaml

            values = yaml.safe_load(file.read_text()) or {}
    except ImportError as e:
        raise UsageError(f"--config {path}: reading it needs pip install "
                         f"{'pyyaml' if e.name == 'yaml' else e.name}") from None
    except Exception as e:  # a syntax error: tomllib.TOMLDecodeError or yaml.YAMLError
        raise UsageError(f"--config {path}: {e}") from None
    if not isinstance(values, dict):
        raise UsageError(f"--config {path}: expected a table of flag values")
    return values


_UNSET = object()  # a config key that sets nothing: a flag given as false


def _convert(action: argparse.Action, name: str, value: Any, path: str) -> Any:
    """``value`` as ``action`` would store it from the command line: a flag without a value
    (``no-reuse-weights = true``, or ``reuse-weights = true`` for its value-less form) stores what
    giving it stores, and as false sets nothing (``_UNSET``)."""
    both_ways = isinstance(action, argparse.BooleanOptionalAction)
    if both_ways or action.nargs == 0 or (action.nargs == "?" and isinstance(value, bool)):
        if not isinstance(value, bool):
            raise UsageError(f"--config {path}: {name} takes true or false, got {value!r}")
        return value if both_ways else action.const if value else _UNSET
    text = str(value).lower() if isinstance(value, bool) else str(value)
    try:
        converted = action.type(text) if action.type else text
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        kind = getattr(action.type, "__name__", "")
        why = str(e) if isinstance(e, argparse.ArgumentTypeError) else f"invalid {kind} value: {text!r}"
        raise UsageError(f"--config {path}: {name}: {why}") from None
    if action.choices is not None and converted not in action.choices:
        raise UsageError(f"--config {path}: {name}: invalid choice: {converted!r} "
                         f"(choose from {', '.join(map(repr, action.choices))})")
    return converted


def check(cfg: TrainConfig) -> None:
    """The checks of single values, which need nothing but the values: UsageError, one line."""
    for name in ("steps", "micro_batches", "micro_batch_size", "seq_len", "nodes", "per_node", "layers",
                 "save_every", "val_batches", "log_every", "replicas", "context_parallel"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UsageError(f"{flag(name)} must be >= 1, got {value}")
    for name in ("warmup", "val_every", "max_skipped_in_a_row", "seed"):
        if getattr(cfg, name) < 0:
            raise UsageError(f"{flag(name)} must be >= 0, got {getattr(cfg, name)}")
    for name in ("lr", "max_grad_norm", "memory_budget"):
        value = getattr(cfg, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"{flag(name)} must be a finite number > 0, got {value}")
    if cfg.save_every is not None and cfg.save is None:
        raise UsageError("--save-every needs --save DIR")


def under_torchrun() -> bool:
    """Whether this process is a rank torchrun started (its environment says so)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
