"""A package's public names, loaded on first use (PEP 562).

The packages whose names pull torch in (the root, ``models``, ``runtime.comm``) load them only when
asked, so that the command line, the plan, the cost model and the model registry cost no torch
import. ``names`` maps a public name to the module that defines it; a name equal to its module's
last component (``"ops": "tawpipe.ops"``) is the module itself.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: each of ``names`` is imported on first use
    and kept in the package's namespace, so later lookups skip ``__getattr__``."""

    def __getattr__(name: str) -> Any:
        try:
            module = names[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = importlib.import_module(module)
        if module.rpartition(".")[2] != name:
            value = getattr(value, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
