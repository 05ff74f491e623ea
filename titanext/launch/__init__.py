"""Starting, checking and ending runs, and the commands that read a job config.

- :mod:`~titanext.launch.run`: ``titanext-run`` (also ``python -m titanext.launch``), which
  validates the config for torchrun's world size (exit 2) before torchrun spawns anything.
- :mod:`~titanext.launch.preflight`: output folders and the checkpoint, checked before the
  process group exists.
- :mod:`~titanext.launch.convert`: ``titanext-convert`` (HF <-> DCP checkpoints;
  ``dcp-to-hf --config`` reads the model from a training config).
- :mod:`~titanext.launch.data`: ``titanext-data tokenize`` (``--config`` reads the tokenizer).
- :mod:`~titanext.launch.dry_run`: the real build and step on a fake process group.
- :mod:`~titanext.launch.local`: a function run in several local gloo processes (tests and
  benchmarks).

Fail-fast on every rank is :mod:`titanext.distributed.failsafe`, below the trainer that uses it.

Importing this package imports none of them.
"""
