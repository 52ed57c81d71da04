"""PEP 517 build backend: setuptools, building against the torch tawpipe will run with.

tawpipe._C is compiled against torch's headers and only loads into that same torch. Asked for a
plain "torch", an isolated build (``pip install .``) installs the newest torch on the index (on
Linux a CUDA build of several GB) whatever the machine has, and compiles against it. Instead the
build asks for exactly the torch the installing Python already has (a CPU build on a CPU machine),
found by running that Python in isolated mode, outside pip's build environment. Where it has
none, it asks for TAWPIPE_BUILD_TORCH (default ``torch==2.13.0``, the version install.sh pins).
setup.py then pins the installed tawpipe to the torch it was built against.
"""

from __future__ import annotations

import os
import subprocess
import sys

from setuptools.build_meta import *  # noqa: F401,F403 - every hook not redefined here

DEFAULT_TORCH = "torch==2.13.0"


def torch_requirement() -> str:
    spec = os.environ.get("TAWPIPE_BUILD_TORCH", "").strip()
    if spec:
        return spec
    # -I: no PYTHONPATH, so pip's build environment (put on it by pip) is not seen.
    found = subprocess.run([sys.executable, "-I", "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True)
    version = found.stdout.strip()
    return f"torch=={version}" if found.returncode == 0 and version else DEFAULT_TORCH


# setuptools' own versions of these hooks run setup.py, which imports torch: not installed yet.
def get_requires_for_build_wheel(config_settings=None):
    return [torch_requirement()]


def get_requires_for_build_editable(config_settings=None):
    return [torch_requirement()]


def get_requires_for_build_sdist(config_settings=None):
    return [torch_requirement()]
