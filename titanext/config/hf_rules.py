"""The config rules of the Hugging Face path (docs/hf_checkpoints.md), one owner for each.

:func:`hf_problems` checks ``[model] hf_assets_path`` (config.json and tokenizer.json parse and
describe something titanext implements), the tokenizer's vocabulary against the model, tied
embeddings against pipeline stages, and ``[checkpoint] initial_load_path`` against the model
(shapes read from file headers only). The config calls it while loading
(:func:`titanext.config.rules.collect_problems`); it takes plain values, not the config.

>>> hf_problems(flavor="hf", tokenizer="byte", hf_assets_path=None, model_vocab=None)[0][:46]
"model.flavor = 'hf' needs model.hf_assets_path"
"""

from __future__ import annotations

import dataclasses

from titanext.data.hf_tokenizer import HFTokenizer
from titanext.errors import ConfigError
from titanext.models.args import ModelArgs
from titanext.models.hf_configs import model_args_from_hf
from titanext.models.hf_names import check_dcp_checkpoint, check_hf_checkpoint

__all__ = ["hf_problems"]


def hf_problems(*, flavor: str, tokenizer: str, hf_assets_path: str | None, model_vocab: int | None,
                tp: int = 1, pp: int = 1, initial_load_path: str | None = None,
                initial_load_in_hf: bool = False, model_args: ModelArgs | None = None,
                num_mtp_layers: int = -1) -> list[str]:
    """The config rules of the HF path, one line per problem (``titanext.config.rules`` calls it):

    - ``flavor = "hf"`` or ``tokenizer = "hf"`` need ``hf_assets_path``; its config.json /
      tokenizer.json must parse and describe something titanext implements;
    - the tokenizer's ids must fit the model's embedding (``model_vocab``, or the hf config's);
    - tied embeddings cannot be split over pipeline stages;
    - ``initial_load_path`` must match the model (shapes read from headers only).

    ``model_args`` is the model of a named flavor (None for ``flavor = "hf"``);
    ``num_mtp_layers`` >= 0 replaces its (or config.json's) MTP depth (``[model]``'s key).
    """
    problems: list[str] = []
    needs_assets = [k for k, v in (("model.flavor", flavor), ("model.tokenizer", tokenizer))
                    if v == "hf"]
    if needs_assets and not hf_assets_path:
        return [f"{k} = 'hf' needs model.hf_assets_path (a Hugging Face model directory with "
                "config.json and tokenizer.json)" for k in needs_assets]
    args = model_args
    if flavor == "hf":
        try:
            args = model_args_from_hf(hf_assets_path)
        except ConfigError as e:
            problems.extend(e.problems)
    if args is not None and num_mtp_layers >= 0:
        args = dataclasses.replace(args, num_mtp_layers=num_mtp_layers)
    if tokenizer == "hf":
        try:
            tok = HFTokenizer(hf_assets_path)
        except ConfigError as e:
            problems.extend(e.problems)
        else:
            vocab = args.vocab_size if args is not None else model_vocab
            if vocab is not None and tok.vocab_size > vocab:
                problems.append(f"{tok.file}: the tokenizer has {tok.vocab_size} token ids, more "
                                f"than the model's vocab_size = {vocab}; use a model whose "
                                "embedding holds the tokenizer's vocabulary")
    if args is not None and args.tie_embeddings and pp > 1:
        problems.append(
            f"parallelism.pipeline_parallel_degree = {pp}: the model ties its input and output "
            "embeddings (config.json tie_word_embeddings = true), which live on the first and "
            "the last pipeline stage; use FSDP / HSDP / TP / CP / EP, or an untied model")
    if initial_load_path and args is not None and not problems:
        try:
            if initial_load_in_hf:
                check_hf_checkpoint(initial_load_path, args)
            else:
                check_dcp_checkpoint(initial_load_path, args)
        except ConfigError as e:
            problems.extend(e.problems)
    return problems
