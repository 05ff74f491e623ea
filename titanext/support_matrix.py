"""Old path of :mod:`titanext.config.support_matrix` (re-exports only)."""

from titanext.config.support_matrix import (
    BEGIN_MARK,
    COLUMNS,
    END_MARK,
    PAGE,
    ROWS,
    UPDATE_COMMAND,
    Cell,
    Matrix,
    P,
    check,
    main,
    support_matrix,
    to_markdown,
    to_text,
    update_page,
)

__all__ = ["BEGIN_MARK", "Cell", "check", "COLUMNS", "END_MARK", "main", "Matrix", "P", "PAGE",
           "ROWS", "support_matrix", "to_markdown", "to_text", "UPDATE_COMMAND",
           "update_page"]

if __name__ == "__main__":  # python -m titanext.support_matrix
    import sys

    sys.exit(main())
