"""python -m titanext.hf.zoo: see :mod:`titanext.hf.zoo.cli`."""

import sys

from titanext.hf.zoo.cli import main

sys.exit(main())
