"""Imported by the fork server that starts a local job's workers, before it serves (its preload,
see ``workers.start_context``): torch and the launcher's code, once for every worker forked after,
and the rule that the server dies with the launcher that started it.

With torch comes ``torch._dynamo``: torch imports it on first use inside a worker (an optimizer's
step, a non-reentrant checkpoint), 1.7-2.5 s of CPU that every rank of every job paid again.

Nothing imported here may touch CUDA (``tests/test_launch.py`` checks): a process forked from
one that has initialised the CUDA driver cannot use it, and every worker is forked from this one.

The server outlives a job: the launcher's later jobs fork from it too. Each worker dies with the
server (``workers.die_with_parent``), so a launcher killed outright leaves no process behind. The
server dies with the launcher from before its first import of torch, so a launcher that ends while
the server is still importing (a run its checks refused, ``workers.start_server``) leaves nothing
running either.
"""

import os

from .workers import die_with_parent  # torch-free

die_with_parent(os.getppid())  # the launcher

import torch._dynamo  # noqa: E402,F401 - see above

from . import launch  # noqa: E402,F401 - imported here once for every worker (torch with it)
