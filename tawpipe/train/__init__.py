"""``tawpipe train``: the training tool on top of the engine.

``config`` (the flags, the config file and the checks that need no torch), ``job`` (the local or
torchrun job, checkpoints, validation, export), ``data`` (token sources and batches), ``metrics``
(JSON lines and TensorBoard). Only ``config`` is imported to parse the command line, so that
``--help`` and a bad flag are answered without importing torch.
"""

from __future__ import annotations

import argparse

from .. import models
from ..commands import UsageError, as_flags
from ..runtime.workers import start_server
from .config import DESCRIPTION, TrainConfig, add_arguments, check, under_torchrun

__all__ = ["DESCRIPTION", "TrainConfig", "add_arguments", "main"]


def main(args: argparse.Namespace) -> int:
    cfg = TrainConfig.from_args(args)
    check(cfg)  # a value out of range, or a --model that names nothing: refused before torch is imported
    try:
        models.check(cfg.model)  # reads at most a config file (a Hugging Face one imports transformers)
    except ValueError as e:
        raise UsageError(as_flags(str(e))) from None
    if not under_torchrun():  # a local job: its workers' server imports torch and the job while this process does
        start_server(["tawpipe.train.job"])
    from .job import main as run

    return run(args)
