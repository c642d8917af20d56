"""``python -m rlgate.cli``: the ``rlgate`` command."""

import sys

from rlgate.cli.main import main

sys.exit(main())
