"""Pieces of the planner (``python -m titanext.plan``; the entry point is :mod:`titanext.plan`).

- :mod:`~titanext.planning.hardware`: per-GPU peak FLOP/s, memory and link figures (H100, H200,
  A100, B200; every figure overridable).
- :mod:`~titanext.planning.roofline`: the time of one micro-batch through a rank's layers from
  those figures (matmuls at the compute or memory roof, elementwise work at the memory roof).
- :mod:`~titanext.planning.pipeline`: what a pipeline schedule means for one rank: its stages
  and layers, the micro-batches in flight and the bubble, both from the schedule simulator.
"""
