"""Old home of the ``transformers`` adapters, now :mod:`titanext.hf.transformers`."""
