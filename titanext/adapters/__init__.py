"""Adapters for models from other libraries (optional dependencies; import them explicitly)."""
