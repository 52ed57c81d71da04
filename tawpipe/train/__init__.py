"""``tawpipe train``: the training tool on top of the engine.

``job`` (the command: configuration, the local or torchrun job, checkpoints, validation,
export), ``data`` (token sources and batches), ``metrics`` (JSON lines and TensorBoard).
"""

from .job import TrainConfig, add_arguments, main

__all__ = ["TrainConfig", "add_arguments", "main"]
