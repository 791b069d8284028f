"""``python -m emulator.nvmetcp.conformance``: see :func:`.run.main`."""

import sys

from emulator.nvmetcp.conformance.run import main

sys.exit(main())
