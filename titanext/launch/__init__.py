"""Starting, checking and ending runs.

- :mod:`~titanext.launch.run`: ``titanext-run`` (also ``python -m titanext.launch``), which
  validates the config for torchrun's world size (exit 2) before torchrun spawns anything.
- :mod:`~titanext.launch.preflight`: output folders and the checkpoint, checked before the
  process group exists.
- :mod:`~titanext.launch.faults`: fail fast, once, on every rank.
- :mod:`~titanext.launch.dry_run`: the real build and step on a fake process group.
- :mod:`~titanext.launch.local`: a function run in several local gloo processes (tests and
  benchmarks).

Importing this package imports none of them.
"""
