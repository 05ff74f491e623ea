"""The zoo certification: which ``transformers`` causal-LM architecture takes which titanext
plugin, each cell run on 2 gloo ranks against one process (docs/zoo.md).

- :mod:`~titanext.hf.zoo.configs`: tiny random copies of any architecture of the auto mapping,
  with every scalar factor off its neutral value, and the excluded types with their reasons.
- :mod:`~titanext.hf.zoo.cells`: one architecture's cells (FSDP, TP through ``hf_tp_plan``, CP,
  pipeline through ``hf_pipeline_stage`` and ``split_model``, EP, AC, the float8 / deferral
  accounting): exact, refused (reason) or WRONG (figures).
- :mod:`~titanext.hf.zoo.pool` / :mod:`~titanext.hf.zoo.cli`: ``titanext-zoo`` (also
  ``python -m titanext.hf.zoo``) on one persistent group of 2 ranks, and the table.

>>> from titanext.hf.zoo.configs import tiny_config
>>> tiny_config("granite").embedding_multiplier != 1.0  # a dropped factor shows
True
"""
