"""Old path of :mod:`titanext.planning.cli` (re-exports only)."""

from titanext.planning.cli import (
    DEVICES,
    Device,
    ModelShape,
    Plan,
    activation_bytes_per_token_layer,
    advise,
    gpt_activation_bytes,
    main,
    memory_svg,
    model_shape,
    plan_config,
    toml_snippet,
    zero_bytes_per_rank,
)

__all__ = ["activation_bytes_per_token_layer", "advise", "Device", "DEVICES",
           "gpt_activation_bytes", "main", "memory_svg", "model_shape", "ModelShape",
           "Plan", "plan_config", "toml_snippet", "zero_bytes_per_rank"]

if __name__ == "__main__":  # python -m titanext.plan
    import sys

    sys.exit(main())
