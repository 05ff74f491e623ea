"""titanext's tests, grouped by kind: unit/ (in-process), multiprocess/ (gloo process groups),
e2e/ (the real launcher: python -m titanext.train / titanext-run, torchrun, exit codes) and
docs/ (README, docs pages, imports). spawn.py and hf_artifacts.py are the shared helpers."""

from pathlib import Path

# The repository root (pyproject.toml, train_configs/, examples/, docs/), whatever folder a
# test file sits in.
REPO_ROOT = Path(__file__).resolve().parent.parent
