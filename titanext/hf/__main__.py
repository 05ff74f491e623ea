"""``python -m titanext.hf`` is the ``titanext-convert`` command (:mod:`titanext.hf.convert`)."""

import sys

from titanext.hf.convert import main

sys.exit(main())
