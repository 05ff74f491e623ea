"""The ``hf`` flavor for DeepSeek-V3 (``DeepseekV3ForCausalLM``): its config.json to
:class:`~titanext.models.ModelArgs` and back.

The network is titanext's decoder with multi-head latent attention (``kv_lora_rank`` > 0),
sigmoid-routed experts with group-limited routing and the aux-loss-free bias
(``e_score_correction_bias``), ``first_k_dense_replace`` dense blocks first, YaRN, and
``num_nextn_predict_layers`` multi-token prediction modules (:mod:`titanext.models.mtp`).
``rope_interleave = true`` (DeepSeek's own checkpoints) is titanext's ``"interleaved"`` RoPE
layout, false its ``"half"``; the weights load unchanged either way. A field absent from
config.json takes the default of transformers' ``DeepseekV3Config``. Fields titanext cannot
map (another router, attention biases, another activation, another rope type) are a
:class:`~titanext.errors.ConfigError`, one line per field.

>>> from titanext.models.hf_configs import model_args_from_hf
>>> args = model_args_from_hf({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
...     "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
...     "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
...     "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "vocab_size": 300,
...     "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
...     "qk_rope_head_dim": 8, "v_head_dim": 12})
>>> args.mla, args.q_lora_rank, args.num_mtp_layers, args.moe.score_func
(True, 0, 1, 'sigmoid')
"""

from __future__ import annotations

from typing import Any

from titanext.errors import ConfigError
from titanext.models.args import ModelArgs, ModelArgsError, MoEArgs, YarnRopeScaling

__all__ = ["DEEPSEEK_V3", "deepseek_v3_args", "deepseek_v3_config"]

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
# transformers 5's DeepseekV3Config defaults, for fields a config.json leaves out
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True,
    "num_nextn_predict_layers": 1,
}
_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
         "num_hidden_layers", "num_attention_heads", "n_shared_experts", "n_routed_experts",
         "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group",
         "topk_group", "num_experts_per_tok", "first_k_dense_replace", "num_nextn_predict_layers")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "truncate")


def _get(cfg: dict[str, Any], key: str) -> Any:
    if key == "num_nextn_predict_layers" and key not in cfg and "num_mtp_layers" in cfg:
        return cfg["num_mtp_layers"]
    return cfg[key] if key in cfg else _DEFAULTS.get(key)


def _rope(cfg: dict[str, Any], where: str, problems: list[str]
          ) -> tuple[float, YarnRopeScaling | None]:
    merged = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        problems.append(f"{where}: rope type {rope_type!r} (rope_parameters / rope_scaling) is "
                        "not implemented for DeepseekV3ForCausalLM; supported: 'default', "
                        "'yarn'")
        return theta, None
    try:
        return theta, YarnRopeScaling(**{k: merged[k] for k in _YARN_KEYS if k in merged})
    except TypeError as e:
        problems.append(f"{where}: rope_parameters = {merged} is not a YaRN setting ({e})")
        return theta, None


def _moe(v: dict[str, Any], where: str, problems: list[str]) -> MoEArgs | None:
    """Routed experts: DeepSeek-V3's router (sigmoid, top-2-sum group scores, the bias)."""
    n, groups, kept, k = (v["n_routed_experts"], v["n_group"], v["topk_group"],
                          v["num_experts_per_tok"])
    if groups < 1 or n % groups:
        problems.append(f"{where}: n_group = {groups} must divide n_routed_experts = {n}")
    elif not 1 <= kept <= groups:
        problems.append(f"{where}: topk_group = {kept} must be in 1..n_group = {groups}")
    elif not 1 <= k <= kept * (n // groups):
        problems.append(f"{where}: num_experts_per_tok = {k} must be in 1..{kept * (n // groups)}"
                        f" (the experts of topk_group = {kept} groups)")
    if v["n_shared_experts"] < 1:
        problems.append(f"{where}: n_shared_experts = {v['n_shared_experts']}; transformers' "
                        "DeepseekV3 always has shared experts: allowed >= 1")
    if problems:
        return None
    return MoEArgs(num_experts=n, top_k=k, hidden_dim=v["moe_intermediate_size"],
                   num_shared_experts=v["n_shared_experts"], score_func="sigmoid",
                   route_norm=bool(v["norm_topk_prob"]),
                   route_scale=float(v["routed_scaling_factor"]), num_expert_groups=groups,
                   num_limited_groups=kept, load_balance_coeff=1e-3)


def deepseek_v3_args(cfg: dict[str, Any], where: str) -> ModelArgs:
    """The ModelArgs of a DeepseekV3 config.json (``cfg``, read from ``where``); ConfigError
    with one line per field titanext cannot map."""
    problems: list[str] = []
    v = {k: _get(cfg, k) for k in (*_INTS, "q_lora_rank", "norm_topk_prob", "rms_norm_eps",
                                   "routed_scaling_factor", "max_position_embeddings",
                                   "tie_word_embeddings", "rope_interleave")}
    for key in _INTS:
        if isinstance(v[key], bool) or not isinstance(v[key], int) or v[key] < 0:
            problems.append(f"{where}: {key} = {v[key]!r}; allowed: a non-negative integer")
    q_rank = v["q_lora_rank"]
    if q_rank is not None and (not isinstance(q_rank, int) or q_rank < 1):
        problems.append(f"{where}: q_lora_rank = {q_rank!r}; allowed: null (a full-rank query) "
                        "or a positive integer")
    for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                         ("hidden_act", "silu")):
        if cfg.get(key, allowed) != allowed:
            problems.append(f"{where}: {key} = {cfg[key]!r} is not implemented for "
                            f"DeepseekV3ForCausalLM (transformers' DeepseekV3 uses "
                            f"{allowed!r}); allowed: {allowed!r}")
    if cfg.get("attention_bias"):
        problems.append(f"{where}: attention_bias = true is not implemented (titanext's "
                        "linears have no bias); allowed: false")
    theta, scaling = _rope(cfg, where, problems)
    if problems:
        raise ConfigError(problems)
    moe = _moe(v, where, problems)
    if problems:
        raise ConfigError(problems)
    try:
        return ModelArgs(
            dim=v["hidden_size"], n_layers=v["num_hidden_layers"],
            n_heads=v["num_attention_heads"], vocab_size=v["vocab_size"],
            ffn_hidden_size=v["intermediate_size"], norm_eps=float(v["rms_norm_eps"]),
            rope_theta=theta, max_seq_len=int(v["max_position_embeddings"]),
            tie_embeddings=bool(v["tie_word_embeddings"]),
            rope_layout="interleaved" if v["rope_interleave"] else "half",
            rope_scaling=scaling, moe=moe, n_dense_layers=v["first_k_dense_replace"],
            q_lora_rank=q_rank or 0, kv_lora_rank=v["kv_lora_rank"],
            qk_nope_head_dim=v["qk_nope_head_dim"], qk_rope_head_dim=v["qk_rope_head_dim"],
            v_head_dim=v["v_head_dim"], num_mtp_layers=v["num_nextn_predict_layers"])
    except ModelArgsError as e:
        raise ConfigError([f"{where}: {p}" for p in e.problems]) from None


def deepseek_v3_config(args: ModelArgs, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepseekV3 config.json fields of ``args`` (an MLA model with DeepSeek-V3 routing),
    over ``base``'s other fields; ValueError for what ``DeepseekV3ForCausalLM`` cannot
    express."""
    m = args.moe
    unsupported = []
    if m is None:
        unsupported.append("no routed experts")
    else:
        if m.score_func != "sigmoid":
            unsupported.append(f"score_func {m.score_func!r} (transformers routes by sigmoid)")
        if m.num_shared_experts < 1:
            unsupported.append("no shared expert")
        if args.moe_layer_interval != 1:
            unsupported.append("dense blocks between MoE blocks")
        if not m.load_balance_coeff:
            unsupported.append("routing without the selection bias (load_balance_coeff)")
    if unsupported:
        raise ValueError("this MLA model has no transformers DeepseekV3 equivalent: "
                         + ", ".join(unsupported))
    cfg = dict(base or {})
    for key in ("rope_scaling", "torch_dtype", "head_dim", "qk_head_dim", "num_mtp_layers"):
        cfg.pop(key, None)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    rs = args.rope_scaling
    if isinstance(rs, YarnRopeScaling):
        rope.update(rope_type="yarn", **{k: getattr(rs, k) for k in _YARN_KEYS})
    elif rs is not None:
        raise ValueError(f"rope scaling {rs} has no DeepseekV3 equivalent (yarn only)")
    cfg.update(
        architectures=[DEEPSEEK_V3], model_type="deepseek_v3", vocab_size=args.vocab_size,
        hidden_size=args.dim, intermediate_size=args.ffn_hidden_dim,
        moe_intermediate_size=m.hidden_dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
        n_shared_experts=m.num_shared_experts, n_routed_experts=m.num_experts,
        routed_scaling_factor=m.route_scale, kv_lora_rank=args.kv_lora_rank,
        q_lora_rank=args.q_lora_rank or None, qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim, qk_nope_head_dim=args.qk_nope_head_dim,
        n_group=m.num_expert_groups, topk_group=m.num_limited_groups,
        num_experts_per_tok=m.top_k, first_k_dense_replace=args.n_dense_layers,
        norm_topk_prob=m.route_norm, hidden_act="silu",
        max_position_embeddings=args.max_seq_len, rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings, rope_parameters=rope,
        rope_interleave=args.rope_layout == "interleaved", attention_bias=False,
        num_nextn_predict_layers=args.num_mtp_layers)
    return cfg
