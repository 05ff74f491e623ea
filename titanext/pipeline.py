"""Old path of :mod:`titanext.distributed.pipeline` (re-exports only)."""

from titanext.distributed.pipeline import (
    SPLIT_BACKWARD,
    PipelineRunner,
    StageTimer,
    build_pipeline,
    ignore_shape_inference_forward,
    layers_per_stage,
    pass_position_ids,
    pipeline_stage_ids,
    split_model,
)

__all__ = ["build_pipeline", "ignore_shape_inference_forward", "layers_per_stage",
           "pass_position_ids", "pipeline_stage_ids", "PipelineRunner",
           "SPLIT_BACKWARD", "split_model", "StageTimer"]
