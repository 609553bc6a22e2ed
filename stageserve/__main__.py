"""``python -m stageserve`` is the ``stageserve`` command."""

import sys

from stageserve.cli import main

sys.exit(main())
