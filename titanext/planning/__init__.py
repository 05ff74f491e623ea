"""The planner (``titanext-plan``, also ``python -m titanext.planning``; the command line is
:mod:`titanext.planning.cli`).

One estimate (:func:`~titanext.planning.estimate.plan_config`) is assembled from named pieces:

- :mod:`~titanext.planning.layout`: a config's layout resolved once (degrees, dtypes,
  gradient accumulation by the config's own rule, micro-batches, the pipeline split).
- :mod:`~titanext.planning.shapes`: exact parameter counts by role, from the meta model.
- :mod:`~titanext.planning.memory`: parameters, gradients, optimizer state and activations per
  rank (the formulas are in its docstring).
- :mod:`~titanext.planning.comm`: bytes and collectives per parallelism, alpha-beta times.
- :mod:`~titanext.planning.stages`: a schedule's stages per rank, micro-batches in flight and
  bubble, from the schedule simulator.
- :mod:`~titanext.planning.roofline`: the time of one micro-batch through a rank's layers.
- :mod:`~titanext.planning.hardware`: per-GPU peak FLOP/s, memory and link figures (H100, H200,
  A100, B200; every figure overridable).
- :mod:`~titanext.planning.moe`: what MoE blocks and expert parallelism add.
- :mod:`~titanext.planning.estimate` puts them together; :mod:`~titanext.planning.advice`
  ranks the layouts of a world size; :mod:`~titanext.planning.report` draws the memory picture.
"""
