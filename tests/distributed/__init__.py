"""Test helpers that run a body in several gloo processes (see titanext.local_launch)."""

from titanext.local_launch import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
