"""``python -m titanext.launch`` is the ``titanext-run`` command (:mod:`titanext.launch.run`)."""

from titanext.launch.run import console_main

console_main()
