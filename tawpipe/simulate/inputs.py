"""What ``tawpipe simulate`` reads from its flags and files: the model, the links and a device (a
preset, a calibration's JSON or this machine's CPU), each refused with a ``UsageError`` naming the
flag before anything is measured or written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from ..commands import UsageError
from ..models.shape import ModelDims
from ..sim.hardware import Device, Link, device, link
from ..sim.workload import model

EMULATED_EFFICIENCY = 0.994  # payload per byte the shaper meters (GSO packets: ~0.5% headers, measured)
LOOPBACK = "8gbit@50"  # inside an emulated node: loopback TCP between two rank processes


def model_arg(args: argparse.Namespace) -> ModelDims:
    try:
        return model(args.model, seq=args.seq_len, micro_batch=args.micro_batch_size, dtype_bytes=args.dtype_bytes,
                     grad_bytes=args.grad_bytes)
    except ValueError as e:  # the model registry's errors name --model themselves
        raise UsageError(str(e) if "--model" in str(e) else f"--model: {e}") from None


def link_arg(flag: str, spec: str) -> Link:
    try:
        return link(spec)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def read_json(path: Path, flag: str) -> Any:
    """The JSON in ``path``, or a UsageError naming the flag, the file and what is wrong with it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"{flag} {path}: is a directory; name the JSON file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag} {path}: cannot read it as text ({getattr(e, 'strerror', None) or e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{flag} {path}: not JSON, or cut short ({e.msg} at line {e.lineno}, column {e.colno})"
                         ) from None


_DEVICE_FIELDS = {f.name: f.default is dataclasses.MISSING for f in dataclasses.fields(Device)}  # name: required


def device_from(doc: Any, where: str) -> Device:
    """The ``Device`` a calibration wrote (``dataclasses.asdict``), or a UsageError naming
    ``where`` it came from and what is wrong with it."""
    required = [k for k, needed in _DEVICE_FIELDS.items() if needed]
    if not isinstance(doc, dict) or not set(required) <= doc.keys():
        raise UsageError(f"{where}: not a device written by --calibrate (it needs {', '.join(required)})")
    unknown = sorted(doc.keys() - _DEVICE_FIELDS.keys())
    if unknown:
        raise UsageError(f"{where}: not a device written by --calibrate (it has {', '.join(unknown)})")
    numbers = [k for k, v in doc.items() if k != "name" and v is not None
               and (isinstance(v, bool) or not isinstance(v, (int, float)))]
    if numbers or not isinstance(doc["name"], str):
        raise UsageError(f"{where}: {', '.join(numbers) or 'name'} must be a {'number' if numbers else 'string'}")
    try:
        return Device(**doc)
    except ValueError as e:
        raise UsageError(f"{where}: {e}") from None


def load_device(spec: str, dims: ModelDims) -> Device:
    """A preset, a device JSON written by ``--calibrate``, or ``cpu[:quota=CORES]``: this
    machine's CPU measured now at ``dims``' shapes, one thread under that quota (an emulated rank)."""
    if spec == "cpu" or spec.startswith("cpu:"):
        quota = _cpu_quota(spec)
        from ..sim.calibrate import calibrate  # needs torch; the rest of the simulator does not

        return calibrate(dims, threads=1, quota=quota)
    path = Path(spec)
    if path.suffix == ".json":
        if not path.exists():
            raise UsageError(f"--device {spec}: no such file (write one with --calibrate {spec})")
        return device_from(read_json(path, "--device"), f"--device {spec}")
    try:
        return device(spec)
    except ValueError as e:
        raise UsageError(f"--device: {e}") from None


def _cpu_quota(spec: str) -> float | None:
    """The quota in ``cpu[:quota=CORES]``."""
    _, _, opt = spec.partition(":")
    if not opt:
        return None
    key, _, value = opt.partition("=")
    try:
        quota = float(value) if key == "quota" else 0.0
    except ValueError:
        quota = 0.0
    if not quota > 0:
        raise UsageError(f"--device {spec}: expected cpu or cpu:quota=CORES, CORES a number above 0 such as 0.5")
    return quota


def shape_dims(config: dict[str, Any]) -> ModelDims:
    """A `tawpipe bench cluster` shape's model as the simulator counts it: float32, the embedding
    and the head untied."""
    return ModelDims(hidden=config["hidden"], layers=config["layers"], heads=config["heads"],
                     vocab=config["vocab"], seq=config["seq_len"], micro_batch=config["batch_size"],
                     dtype_bytes=4, grad_bytes=4, tied=False)
