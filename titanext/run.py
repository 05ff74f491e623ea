"""Old path of :mod:`titanext.launch.run` (re-exports only)."""

from titanext.launch.run import (
    USAGE,
    console_main,
    main,
    split_argv,
    world_size_of,
)

__all__ = ["console_main", "main", "split_argv", "USAGE", "world_size_of"]

if __name__ == "__main__":  # python -m titanext.run
    console_main()
