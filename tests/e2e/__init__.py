"""Tests through the real launcher: python -m titanext.train / titanext-run, torchrun, examples,
exit codes."""
