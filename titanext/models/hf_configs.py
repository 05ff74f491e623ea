"""The ``hf`` flavor: model shapes from a Hugging Face ``config.json``.

:func:`model_args_from_hf` reads ``<hf_assets_path>/config.json`` and returns the
:class:`~titanext.models.ModelArgs` of the same network, or raises
:class:`~titanext.errors.ConfigError` naming every field titanext does not implement (a
different model is never built silently). :func:`hf_config_from_model_args` goes the other way
for exports; :func:`read_json` reads the JSON files of an HF model directory (config.json,
tokenizer_config.json) with errors that name the file.

Supported architectures: ``LlamaForCausalLM`` and ``MistralForCausalLM`` without a sliding
window, ``Qwen3ForCausalLM`` (QK-norm, explicit head_dim), and the MoE models
``MixtralForCausalLM`` (softmax top-k renormalised over the chosen experts: titanext's
``score_func="softmax", route_norm=True``) and ``Qwen3MoeForCausalLM`` (``norm_topk_prob`` is
``route_norm``; dense layers from ``mlp_only_layers`` / ``decoder_sparse_step`` when they
form titanext's "first k dense, then every n-th" pattern), and ``DeepseekV3ForCausalLM``
(multi-head latent attention, DeepSeek-V3 routing, multi-token prediction:
:mod:`titanext.models.hf_deepseek`). The model uses HF's RoPE pairing
(``rope_layout="half"``; DeepSeek-V3: its ``rope_interleave``), so HF weights load without any
permutation.

>>> from titanext.models.hf_configs import model_args_from_hf
>>> args = model_args_from_hf("path/to/hf_dir")   # an HF model directory  # doctest: +SKIP
>>> read_json("no/such/config.json")
Traceback (most recent call last):
...
titanext.errors.ConfigError: no/such/config.json does not exist
"""

from __future__ import annotations

import json
import os
from typing import Any

from titanext.errors import ConfigError
from titanext.models.args import ModelArgs, MoEArgs, RopeScaling
from titanext.models.hf_deepseek import DEEPSEEK_V3, deepseek_v3_args, deepseek_v3_config

__all__ = ["HF_ARCHITECTURES", "hf_config_from_model_args", "load_hf_config",
           "model_args_from_hf", "read_json"]

#: architecture -> model_type of the HF configs the ``hf`` flavor builds.
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "MixtralForCausalLM": "mixtral", "Qwen3ForCausalLM": "qwen3",
                    "Qwen3MoeForCausalLM": "qwen3_moe", DEEPSEEK_V3: "deepseek_v3"}
_ROPE_TYPES = ("default", "llama3")


def read_json(path: str) -> dict:
    """``path`` parsed, or a ConfigError naming the file (missing, unreadable or not JSON)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not valid JSON: expected an object, got "
                          f"{type(data).__name__}")
    return data


def load_hf_config(path: str) -> tuple[dict[str, Any], str]:
    """(config.json of the HF directory ``path`` as a dict, the file's path)."""
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ConfigError(f"model.hf_assets_path = {path!r} is not a directory; it must hold a "
                          "Hugging Face config.json (and tokenizer.json)")
    return read_json(file), file


def _rope(cfg: dict[str, Any], where: str, problems: list[str]
          ) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5's ``rope_parameters`` or 4's fields."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        problems.append(f"{where}: rope type {rope_type!r} (rope_parameters / rope_scaling) is "
                        f"not implemented; supported: {', '.join(map(repr, _ROPE_TYPES))}")
        return float(theta), None
    if rope_type == "default":
        return float(theta), None
    return float(theta), RopeScaling(
        factor=float(merged["factor"]), low_freq_factor=float(merged["low_freq_factor"]),
        high_freq_factor=float(merged["high_freq_factor"]),
        original_max_seq_len=int(merged["original_max_position_embeddings"]))


def model_args_from_hf(source: str | dict[str, Any], *, where: str | None = None) -> ModelArgs:
    """The :class:`ModelArgs` of the HF config at ``source`` (a directory or a parsed dict).

    ConfigError, one line per problem, each naming the file and the field: another
    architecture, attention or MLP biases, a sliding window, a rope type other than default /
    llama3, an activation other than SiLU, a head_dim other than hidden_size / heads.
    """
    if isinstance(source, str):
        cfg, where = load_hf_config(source)
    else:
        cfg, where = source, where or "config.json"
    problems: list[str] = []
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    arch = next((a for a in archs if a in HF_ARCHITECTURES), None)
    if arch is None and model_type not in HF_ARCHITECTURES.values():
        raise ConfigError(
            f"{where}: architectures = {archs} (model_type {model_type!r}) is not supported by "
            f"flavor 'hf'; supported: {', '.join(HF_ARCHITECTURES)}")
    model_type = model_type or HF_ARCHITECTURES[arch]
    if model_type == "deepseek_v3":  # MLA, DeepSeek routing, MTP: titanext.models.hf_deepseek
        return deepseek_v3_args(cfg, where)
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size")
    missing = [k for k in required if not isinstance(cfg.get(k), int)]
    if missing:
        raise ConfigError(f"{where}: missing or non-integer field(s) {', '.join(missing)}")
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            problems.append(f"{where}: {key} = true is not implemented (titanext's linears have "
                            "no bias)")
    if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True):
        problems.append(f"{where}: sliding_window = {cfg['sliding_window']} is not implemented "
                        "(full causal attention only)")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        problems.append(f"{where}: hidden_act = {act!r} is not implemented; supported: 'silu'")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim % 2):
        problems.append(f"{where}: head_dim = {head_dim!r} must be an even integer")
        head_dim = None
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        problems.append(f"{where}: layer_types = {sorted(set(layer_types))} is not implemented "
                        "(full causal attention only)")
    if cfg.get("pretraining_tp", 1) != 1:
        problems.append(f"{where}: pretraining_tp = {cfg['pretraining_tp']} is not supported; "
                        "use 1")
    theta, scaling = _rope(cfg, where, problems)
    moe, ffn = None, cfg["intermediate_size"]
    if model_type == "mixtral":
        if cfg.get("router_jitter_noise"):
            problems.append(f"{where}: router_jitter_noise = {cfg['router_jitter_noise']} is not "
                            "implemented; use 0")
        moe = MoEArgs(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                      hidden_dim=ffn, score_func="softmax", route_norm=True,
                      load_balance_coeff=None)
    layers = {}
    if model_type == "qwen3_moe":
        moe, layers = _qwen3_moe(cfg, where, problems)
    if problems:
        raise ConfigError(problems)
    return ModelArgs(
        dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads, vocab_size=cfg["vocab_size"],
        ffn_hidden_size=ffn, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), rope_layout="half",
        rope_scaling=scaling, moe=moe,
        attn_head_dim=head_dim if head_dim and head_dim * n_heads != dim else None,
        qk_norm=model_type in ("qwen3", "qwen3_moe"), **layers)


def _qwen3_moe(cfg: dict[str, Any], where: str, problems: list[str]
               ) -> tuple[MoEArgs | None, dict[str, int]]:
    """Qwen3-MoE routing and which layers are sparse, as (MoEArgs, ModelArgs layer fields).

    HF makes layer i sparse unless it is in ``mlp_only_layers`` and when (i + 1) is a multiple
    of ``decoder_sparse_step``; titanext's pattern is "dense first k, then every interval-th",
    so other patterns are a ConfigError."""
    n_layers = cfg["num_hidden_layers"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense_only = set(cfg.get("mlp_only_layers") or [])
    sparse = [i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0]
    if not experts or not sparse:
        return None, {}
    first = sparse[0]
    interval = sparse[1] - sparse[0] if len(sparse) > 1 else 1
    if sparse != list(range(first, n_layers, interval)):
        problems.append(f"{where}: decoder_sparse_step = {step} with mlp_only_layers = "
                        f"{sorted(dense_only)} makes layers {sparse} sparse, which is not 'the "
                        "first k dense, then every n-th' (the pattern titanext implements)")
        return None, {}
    moe = MoEArgs(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                  hidden_dim=cfg["moe_intermediate_size"], score_func="softmax",
                  route_norm=bool(cfg.get("norm_topk_prob", False)), load_balance_coeff=None)
    return moe, {"n_dense_layers": first, "moe_layer_interval": interval}


def hf_config_from_model_args(args: ModelArgs, *, dtype: str = "float32",
                              bos_id: int | None = None, eos_id: int | None = None,
                              base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A transformers config.json dict for ``args`` (Llama, or Mixtral for a MoE model).

    ``base`` (the source config.json of an ``hf`` flavor) keeps its other fields; the shape
    fields and ``dtype`` are always written from ``args``. ValueError for models transformers'
    Llama / Mixtral cannot express (DeepSeek-style routing, shared experts, dense+MoE mixes).
    """
    if args.mla:
        cfg = deepseek_v3_config(args, base)
        cfg["dtype"] = dtype
        for key, value in (("bos_token_id", bos_id), ("eos_token_id", eos_id)):
            if value is not None:
                cfg[key] = value
        return cfg
    moe, qwen = args.moe, args.qk_norm
    family = ("Qwen3Moe" if moe else "Qwen3") if qwen else ("Mixtral" if moe else "Llama")
    if moe is not None:
        unsupported = []
        if not qwen and (args.n_dense_layers or args.moe_layer_interval != 1):
            unsupported.append("dense layers between MoE layers")
        if moe.num_shared_experts:
            unsupported.append("shared experts")
        if moe.score_func != "softmax" or moe.route_scale != 1.0 or not (moe.route_norm or qwen):
            unsupported.append("routing other than softmax top-k"
                               + ("" if qwen else " with route_norm"))
        if moe.num_expert_groups != 1:
            unsupported.append("group-limited routing")
        if unsupported:
            raise ValueError(f"this MoE model has no transformers equivalent ({family}): "
                             + ", ".join(unsupported))
    cfg = dict(base or {})
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        rs = args.rope_scaling
        rope.update(rope_type="llama3", factor=rs.factor, low_freq_factor=rs.low_freq_factor,
                    high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_seq_len)
    cfg.pop("rope_scaling", None)
    cfg.pop("torch_dtype", None)
    model_type = {"Qwen3Moe": "qwen3_moe", "Qwen3": "qwen3", "Mixtral": "mixtral",
                  "Llama": "llama"}[family]
    cfg.update(
        architectures=[f"{family}ForCausalLM"], model_type=model_type,
        hidden_size=args.dim,
        intermediate_size=moe.hidden_dim if moe and not qwen else args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=args.vocab_size,
        rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, rope_parameters=rope,
        max_position_embeddings=args.max_seq_len, tie_word_embeddings=args.tie_embeddings,
        hidden_act="silu", attention_bias=False, dtype=dtype)
    if qwen:
        cfg.update(use_sliding_window=False, sliding_window=None)
        cfg.pop("layer_types", None)
    if moe is None:
        cfg["mlp_bias"] = False
    elif qwen:
        dense = [i for i in range(args.n_layers) if not args.is_moe_layer(i)]
        cfg.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   moe_intermediate_size=moe.hidden_dim, norm_topk_prob=moe.route_norm,
                   decoder_sparse_step=1, mlp_only_layers=dense)
        cfg.pop("num_local_experts", None)
    else:
        cfg.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   sliding_window=None, router_jitter_noise=0.0)
    if bos_id is not None:
        cfg["bos_token_id"] = bos_id
    if eos_id is not None:
        cfg["eos_token_id"] = eos_id
    return cfg
