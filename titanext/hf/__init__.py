"""Hugging Face interop, in one place.

- :mod:`~titanext.hf.checkpoint`: HF safetensors in and out, under any layout.
- :mod:`~titanext.hf.convert`: ``titanext-convert hf-to-dcp | dcp-to-hf`` (also
  ``python -m titanext.hf``).
- :mod:`~titanext.hf.tokenizer`: ``tokenizer.json`` through the ``tokenizers`` library.
- :mod:`~titanext.hf.transformers`: adapters that let titanext's plugins drive ``transformers``
  models (optional dependency: import it explicitly).

The config.json <-> :class:`~titanext.models.ModelArgs` mapping is :mod:`titanext.models.hf`;
the HF config rules are :mod:`titanext.config.hf_rules`. Importing this package imports none of
them.
"""
