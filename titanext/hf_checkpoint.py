"""Old path of :mod:`titanext.hf.checkpoint` (re-exports only)."""

from titanext.hf.checkpoint import (
    check_dcp_checkpoint,
    check_hf_checkpoint,
    hf_names,
    hf_tensor_index,
    load_hf_weights,
    load_initial_weights,
    permute_for_rope,
    save_hf_checkpoint,
    to_hf_state_dict,
    write_hf_assets,
)

__all__ = ["check_dcp_checkpoint", "check_hf_checkpoint", "hf_names", "hf_tensor_index",
           "load_hf_weights", "load_initial_weights", "permute_for_rope",
           "save_hf_checkpoint", "to_hf_state_dict", "write_hf_assets"]
