"""Old path of :mod:`titanext.config.docs` (re-exports only)."""

from titanext.config.docs import (
    BEGIN_MARK,
    END_MARK,
    PAGE,
    UPDATE_COMMAND,
    main,
    reference_markdown,
    update_page,
)

__all__ = ["BEGIN_MARK", "END_MARK", "main", "PAGE", "reference_markdown", "UPDATE_COMMAND",
           "update_page"]

if __name__ == "__main__":  # python -m titanext.config_docs
    import sys

    sys.exit(main())
