"""The trainer's components: each one piece of a training job, usable on its own.

- :mod:`~titanext.components.checkpoint`: DCP checkpoints of the whole training state
  (:class:`~titanext.components.checkpoint.CheckpointManager`), atomic and reshardable;
  :mod:`~titanext.components.checkpoint_manifest` names what a checkpoint was trained with.
- :mod:`~titanext.components.optim`: optimizer and learning-rate schedule.
- :mod:`~titanext.components.metrics`: console and TensorBoard metrics, tables.
- :mod:`~titanext.data.tokenizer`: the byte tokenizer and ``build_tokenizer``.
- :mod:`~titanext.components.validation`: held-out loss (``[validation]``).

Importing this package imports none of them.
"""
