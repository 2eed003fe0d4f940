"""``python -m flashlite demo``: the same as the ``flashlite`` command."""

import sys

from .cli import main

sys.exit(main())
