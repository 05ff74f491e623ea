"""Tests that spawn gloo process groups on CPU (mostly through tests.spawn.run_distributed).
A file sits here when most of its tests do."""
