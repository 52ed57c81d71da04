"""Imported by the fork server that starts a local job's workers, before it serves (its preload,
see ``workers.start_context``): torch and the launcher's code, once for every worker forked after,
and the rule that the server dies with the launcher that started it.

The server outlives a job: the launcher's later jobs fork from it too. Each worker dies with the
server (``workers.die_with_parent``), so a launcher killed outright leaves no process behind.
"""

import os

from . import launch  # noqa: F401 - imported here once for every worker (torch with it)
from .workers import die_with_parent

die_with_parent(os.getppid())  # the launcher
