"""The engine layer: ``TawPipe`` executes a plan on real tensors, and makes no schedule decision.

``policy`` (the engine's options: what schedule, what precision, what memory savers, what
backend), ``inputs`` (what the user hands the engine, checked), ``storage`` (what a rank stores),
``compute`` (the math of a chunk), ``precision`` (loss scaling, clipping, non-finite steps),
``fingerprint`` (what ranks must agree on), ``offload`` (the own chunk in host memory), ``auto``
(the memory the cost model's choice of the "auto" options may plan for), ``engine`` (the wiring,
and every operation the engine offers: step, evaluate, state dicts, gather, export tables).
Imports ``ops``, ``models`` (the model contract), ``plan``, ``cost`` and ``runtime``.
"""

from .engine import TawPipe, default_optimizer
from .policy import CommPolicy, MemoryPolicy, PrecisionPolicy, SchedulePolicy
from .precision import DynamicScaling

__all__ = ["CommPolicy", "DynamicScaling", "MemoryPolicy", "PrecisionPolicy", "SchedulePolicy", "TawPipe",
           "default_optimizer"]
