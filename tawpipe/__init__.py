"""tawpipe: topology-aware weight pipeline parallelism for PyTorch."""

from . import ops  # loads the native extension: registers torch.ops.tawpipe.*
from .engine import TawPipe
from .plan import Plan, build_plan, verify
from .topology import Topology

__version__ = "0.1.0"
__all__ = ["Plan", "TawPipe", "Topology", "build_plan", "ops", "verify"]
