"""The plan layer: one iteration of every rank as data, and the proof that it is right.

``topology`` (groups of devices), ``actions`` (the op table), ``plan`` (the Plan and its JSON),
``registry`` (the schedules by name), ``tawpipe`` and ``weipipe`` (the built-in schedules),
``events`` (how a schedule writes its plan), ``schedule`` (``build_plan``), ``programs`` (setup,
gather, validation), ``verify`` (the symbolic proof), ``tables`` (the printout). Pure data and
pure functions: this layer imports no torch, and of tawpipe only the model's shape (for the
schedules' closed forms).
"""

from .actions import OPS, Action, Channel, Op, PlanError
from .plan import GRAD_ROUTES, Plan
from .registry import Schedule, register
from .schedule import RESIDENT, build_plan
from .topology import Topology
from .verify import verify

__all__ = ["GRAD_ROUTES", "OPS", "RESIDENT", "Action", "Channel", "Op", "Plan", "PlanError", "Schedule", "Topology",
           "build_plan", "register", "verify"]
