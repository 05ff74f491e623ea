"""Hugging Face interop at run time: weights in and out of parallelized models, and
``transformers`` models driven by titanext's plugins.

- :mod:`~titanext.hf.checkpoint`: HF safetensors in and out, under any layout.
- :mod:`~titanext.hf.convert`: HF safetensors <-> titanext DCP checkpoints, offline (the
  ``titanext-convert`` command line is :mod:`titanext.launch.convert`).
- :mod:`~titanext.hf.transformers`: adapters that let titanext's plugins drive ``transformers``
  models (optional dependency: import it explicitly).

``hf`` sits above ``distributed`` (its adapters drive the plugins and the pipeline split). What
the layers below it read lives with them: ``config.json`` <-> :class:`~titanext.models.ModelArgs`
in :mod:`titanext.models.hf_configs` (DeepSeek-V3's in :mod:`titanext.models.hf_deepseek`), the
HF tensor names and the header-only checkpoint checks in :mod:`titanext.models.hf_names`,
``tokenizer.json`` in :mod:`titanext.data.hf_tokenizer`, and the config rules of the HF path in
:mod:`titanext.config.hf_rules`. Importing this package imports none of its modules.
"""
