"""Hugging Face interop, in one place.

- :mod:`~titanext.hf.configs`: ``config.json`` <-> :class:`~titanext.models.ModelArgs` (Llama,
  Mistral, Mixtral, Qwen3, Qwen3-MoE), with DeepSeek-V3's in :mod:`~titanext.hf.deepseek`.
- :mod:`~titanext.hf.checkpoint`: HF safetensors in and out, under any layout.
- :mod:`~titanext.hf.convert`: HF safetensors <-> titanext DCP checkpoints, offline (the
  ``titanext-convert`` command line is :mod:`titanext.launch.convert`).
- :mod:`~titanext.hf.tokenizer`: ``tokenizer.json`` through the ``tokenizers`` library.
- :mod:`~titanext.hf.transformers`: adapters that let titanext's plugins drive ``transformers``
  models (optional dependency: import it explicitly).

``hf`` sits below ``data`` and ``config`` (which read HF tokenizers and configs) and imports
neither. Importing this package imports none of its modules.
"""
