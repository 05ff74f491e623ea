"""``python -m titanext.planning`` is ``python -m titanext.plan``."""

import sys

from titanext.planning.cli import main

sys.exit(main())
