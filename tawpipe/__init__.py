"""tawpipe: topology-aware weight pipeline parallelism for PyTorch.

The layers, each a package that imports only those below it (design §1): ``ops`` (kernels),
``models``, ``plan``, ``cost``, ``runtime``, ``engine``, ``io``, then the tools: ``cluster``,
``train``, ``bench`` and the ``cli``.

The public names are loaded on first use (PEP 562), so that ``import tawpipe.cli`` (``tawpipe
--help``, ``tawpipe plan``) does not import torch: ``from tawpipe import TawPipe`` and
``tawpipe.ops`` work as before. ``torch.ops.tawpipe.*`` are registered when ``tawpipe.ops`` is
imported: by the engine, by ``tawpipe.ops``, and by ``import tawpipe`` itself where torch is
already imported (then loading the extension costs a few milliseconds).
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from .version import __version__

if TYPE_CHECKING:
    from . import ops
    from .engine import TawPipe
    from .engine.precision import Precision
    from .plan import Plan, Topology, build_plan, verify

__all__ = ["Plan", "Precision", "TawPipe", "Topology", "__version__", "build_plan", "ops", "verify"]

_LAZY = {  # public name: (module, attribute; None for the module itself)
    "TawPipe": ("tawpipe.engine", "TawPipe"),
    "Precision": ("tawpipe.engine.precision", "Precision"),
    "Plan": ("tawpipe.plan", "Plan"),
    "Topology": ("tawpipe.plan", "Topology"),
    "build_plan": ("tawpipe.plan", "build_plan"),
    "verify": ("tawpipe.plan", "verify"),
    "ops": ("tawpipe.ops", None),
}


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if "torch" in sys.modules:  # torch is loaded already: register torch.ops.tawpipe.* now, as ever
    from . import ops  # noqa: F811
