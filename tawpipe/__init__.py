"""tawpipe: topology-aware weight pipeline parallelism for PyTorch."""

from . import ops  # loads the native extension: registers torch.ops.tawpipe.*
from .engine import TawPipe
from .plan import Plan
from .precision import Precision
from .schedule import build_plan
from .topology import Topology
from .verify import verify

__version__ = "0.1.0"
__all__ = ["Plan", "Precision", "TawPipe", "Topology", "build_plan", "ops", "verify"]
