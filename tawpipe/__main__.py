"""`python -m tawpipe ...` is the `tawpipe` command."""

import sys

from .cli import main

sys.exit(main())
