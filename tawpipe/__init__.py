"""tawpipe: topology-aware weight pipeline parallelism for PyTorch.

The layers, each a package that imports only those below it (design §1): ``ops`` (kernels),
``models``, ``plan``, ``cost``, ``runtime``, ``engine``, ``io``, then the tools: ``cluster``,
``train``, ``bench`` and the ``cli``.
"""

from . import ops  # loads the native extension: registers torch.ops.tawpipe.*
from .engine import TawPipe
from .engine.precision import Precision
from .plan import Plan, Topology, build_plan, verify
from .version import __version__

__all__ = ["Plan", "Precision", "TawPipe", "Topology", "__version__", "build_plan", "ops", "verify"]
