"""Old path of :mod:`titanext.hf.convert` (re-exports only)."""

from titanext.hf.convert import (
    Progress,
    dcp_to_hf,
    hf_to_dcp,
    main,
)

__all__ = ["dcp_to_hf", "hf_to_dcp", "main", "Progress"]

if __name__ == "__main__":  # python -m titanext.convert
    import sys

    sys.exit(main())
