"""`python -m expertd.server.cli`: the `expertd` command without its console script."""

import sys

from .commands import main

sys.exit(main())
