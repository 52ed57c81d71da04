"""The plan layer: one iteration of every rank as data, and the proof that it is right.

``topology`` (groups of devices), ``actions`` (the op table), ``plan`` (the Plan and its JSON),
``schedule`` (TawPipe and WeiPipe build plans), ``programs`` (setup, gather, validation),
``verify`` (the symbolic proof), ``tables`` (the printout). Pure data and pure functions: this
layer imports nothing of tawpipe's, not even torch.
"""

from .actions import OPS, Action, Channel, Op, PlanError
from .plan import ALGOS, GRAD_ROUTES, Plan
from .schedule import RESIDENT, build_plan
from .topology import Topology
from .verify import verify

__all__ = ["ALGOS", "GRAD_ROUTES", "OPS", "RESIDENT", "Action", "Channel", "Op", "Plan", "PlanError", "Topology",
           "build_plan", "verify"]
