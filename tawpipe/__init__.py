"""tawpipe: topology-aware weight pipeline parallelism for PyTorch.

The layers, each a package that imports only those below it (design §1): ``ops`` (kernels),
``models``, ``plan``, ``cost``, ``runtime``, ``engine``, ``io``, then the tools: ``cluster``,
``train``, ``bench`` and the ``cli``.

The public names are loaded on first use (PEP 562), so that ``import tawpipe.cli`` (``tawpipe
--help``, ``tawpipe plan``) does not import torch: ``from tawpipe import TawPipe`` and
``tawpipe.ops`` work as before. ``torch.ops.tawpipe.*`` are registered by ``import tawpipe`` in
either order: at once where torch is already imported (loading the extension costs a few
milliseconds), else as soon as torch finishes importing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import TYPE_CHECKING, Any

from .lazy import lazy
from .version import __version__

if TYPE_CHECKING:
    from . import ops
    from .engine import TawPipe
    from .engine.policy import CommPolicy, MemoryPolicy, PrecisionPolicy, SchedulePolicy
    from .engine.precision import DynamicScaling, Precision
    from .models.parts import ModelParts
    from .plan import Plan, Topology, build_plan, verify

__all__ = ["CommPolicy", "DynamicScaling", "MemoryPolicy", "ModelParts", "Plan", "Precision", "PrecisionPolicy",
           "SchedulePolicy", "TawPipe", "Topology", "__version__", "build_plan", "ops", "verify"]

__getattr__, __dir__ = lazy(__name__, {
    "TawPipe": "tawpipe.engine",
    **dict.fromkeys(("DynamicScaling", "Precision"), "tawpipe.engine.precision"),
    "ModelParts": "tawpipe.models.parts",
    **dict.fromkeys(("CommPolicy", "MemoryPolicy", "PrecisionPolicy", "SchedulePolicy"), "tawpipe.engine.policy"),
    **dict.fromkeys(("Plan", "Topology", "build_plan", "verify"), "tawpipe.plan"),
    "ops": "tawpipe.ops",
})


class _OpsOnceTorchLoads(importlib.abc.MetaPathFinder):
    """Imports ``tawpipe.ops`` right after torch's own import, so that ``import tawpipe, torch``
    registers ``torch.ops.tawpipe.*`` as ``import torch, tawpipe`` does, while ``import tawpipe``
    alone (the command line) imports no torch. It finds torch's spec through the other finders and
    steps aside once torch is loaded (a ``find_spec`` alone, as a library's probe for torch, loads
    nothing)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is not None and spec.loader is not None:
            exec_torch = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                exec_torch(module)
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                importlib.import_module("tawpipe.ops")

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "torch" in sys.modules:  # torch is loaded already: register torch.ops.tawpipe.* now, as ever
    from . import ops  # noqa: F811
else:
    sys.meta_path.insert(0, _OpsOnceTorchLoads())
