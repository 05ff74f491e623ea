"""Old path of :mod:`titanext.hf.transformers` (re-exports only)."""

from titanext.hf.transformers import (
    HFCausalLMStage,
    HFExpertParallel,
    apply_hf_context_parallel,
    apply_hf_expert_parallel,
    hf_blocks,
    hf_llama_tp_plan,
    hf_pipeline_stage,
    hf_shard_batch,
)

__all__ = ["apply_hf_context_parallel", "apply_hf_expert_parallel", "hf_blocks",
           "hf_llama_tp_plan", "hf_pipeline_stage", "hf_shard_batch", "HFCausalLMStage",
           "HFExpertParallel"]
