"""``python -m titanext.planning``: the ``titanext-plan`` command (:mod:`titanext.planning.cli`)."""

import sys

from titanext.planning.cli import main

sys.exit(main())
