"""The one default of every blocking wait: ``TAWPIPE_TIMEOUT`` seconds, 300 when unset."""

from __future__ import annotations

import math
import numbers
import os

DEFAULT_TIMEOUT = 300.0
ENV = "TAWPIPE_TIMEOUT"


def default_timeout() -> float:
    """``TAWPIPE_TIMEOUT`` if set (a finite number of seconds > 0), else 300."""
    text = os.environ.get(ENV)
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{ENV}={text!r} is not a number of seconds > 0: set it to e.g. 300, or unset it")
    return value


def timeout_seconds(value: float | None) -> float:
    """``value`` seconds where given, else the default: a zero, negative or infinite timeout would
    make every wait fail at once or hang for ever, so it is refused."""
    if value is None:
        return default_timeout()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"timeout must be a number of seconds > 0 (or None: ${ENV}, else {DEFAULT_TIMEOUT:g}), "
                         f"got {value!r}")
    return float(value)
