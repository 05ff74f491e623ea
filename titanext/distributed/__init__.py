"""The distributed recipe: degrees to a mesh, a model to its parallel layout, and the pipeline.

- :mod:`~titanext.distributed.parallel_dims`: :class:`ParallelDims`, one source of truth for
  the degrees, and the DeviceMesh with named axes built from them.
- :mod:`~titanext.distributed.parallelize`: :func:`parallelize`, the recipe (TP/SP -> EP -> CP
  -> AC -> compile -> FSDP2/HSDP or DDP), callable on any model.
- :mod:`~titanext.distributed.pipeline`: split a model into stages, place them, build and run
  the schedule (:class:`PipelineRunner`).
- :mod:`~titanext.distributed.process_group`: process-group start-up and timeouts;
  :mod:`~titanext.distributed.determinism`: seeding; :mod:`~titanext.distributed.grad_clip`:
  global gradient-norm clipping.
- :mod:`~titanext.distributed.failsafe`: rank failure (no rank left waiting; the training
  command's end).

Importing this package imports none of them.
"""
