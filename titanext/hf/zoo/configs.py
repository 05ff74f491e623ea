"""Tiny random copies of ``transformers`` causal-LM architectures, built from the config class
alone (no download), with settings that let a dropped factor show.

Sizes are passed under each family's own attribute names (``hidden_size`` / ``n_embd`` /
``d_model``, ...: the config class's ``attribute_map``). On top of the sizes, every scalar
multiplier, scale and soft-cap the config holds is moved off its neutral value, sliding windows
are shorter than the sequence, mixed ``layer_types`` keep two different kinds in the two layers,
and each architecture runs as two variants: untied head with ``pad_token_id`` None, and tied head
with ``pad_token_id`` 0. A config that hides a bug certifies nothing.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

__all__ = ["SEQ", "VARIANTS", "VOCAB", "ZooType", "build_tiny", "causal_lm_types", "classify",
           "non_neutral", "tiny_config", "zoo_types"]

VOCAB = 128
#: the global sequence length: zigzag CP over 2 ranks cuts it into 4 chunks of 4
SEQ = 16
#: a sliding window shorter than one CP chunk and than the sequence
WINDOW = 3
#: canonical size keywords; each goes to the config under the name its attribute_map gives
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, head_dim=16,
             max_position_embeddings=64, moe_intermediate_size=32,
             shared_expert_intermediate_size=32,
             num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
             decoder_sparse_step=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, n_embd=64, n_layer=2, n_head=4, n_inner=128,
             d_model=64, ffn_dim=128, n_positions=64, n_ctx=64, sliding_window=WINDOW,
             attention_dropout=0.0, hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
             attn_pdrop=0.0, dropout=0.0, rotary_dim=8, hidden_dropout_prob=0.0,
             initializer_range=0.2,
             state_size=8, expand=2, conv_kernel=4, n_groups=1, mamba_n_heads=8,
             mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2, chunk_size=8,
             time_step_rank=8, num_heads=8, mlp_expansion_factor=2)
#: integer attributes that name a size, scaled down when a config's default is large
_SIZE_NAME = re.compile(r"(size|dim|rank|hidden|intermediate|embd|inner|d_model|d_ff|width)")
_LAYER_NAME = re.compile(r"^(num_.*layers|n_layers?|num_layers)$")
#: scalar factors: moved away from neutral (1 for a multiplier or scale, None/0 for a soft-cap)
_FACTOR_NAME = re.compile(r"(multiplier|scale|scaling|softcap|soft_cap|logit_scale|scalar)")
_NOT_A_FACTOR = re.compile(
    r"(rope|init|eps|dropout|norm|coef|aux|std|range|theta|base|type)")
#: the two variants every architecture runs as
VARIANTS = {"untied, pad None": dict(tie_word_embeddings=False, pad_token_id=None),
            "tied, pad 0": dict(tie_word_embeddings=True, pad_token_id=0)}

#: causal-LM heads on bidirectional encoders (they need is_decoder=True and are not LMs)
_ENCODERS = {"bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra",
             "ernie", "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert",
             "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod", "xlm", "xlnet", "reformer"}
#: decoders of an encoder-decoder pair that their config does not flag as one
_DECODER_HALVES = {"trocr": "the text decoder of a vision encoder-decoder (TrOCR)",
                   "whisper": "the decoder of an encoder-decoder speech model"}


@dataclass(frozen=True)
class ZooType:
    """One model type of the causal-LM auto mapping: ``excluded`` is the reason it is not
    certified (empty when it is)."""

    model_type: str
    model_class: str
    excluded: str = ""


def causal_lm_types() -> dict[str, str]:
    """transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: model type -> causal-LM class name."""
    # transformers is the dev extra: imported only when the zoo runs
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def classify(model_type: str, model_class: str) -> ZooType:
    """Why ``model_type`` is excluded from the zoo, from its config class (no model built)."""
    # transformers is the dev extra: imported only when the zoo runs
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    if model_type in _ENCODERS:
        return ZooType(model_type, model_class, "encoder (bidirectional; its causal-LM head "
                       "needs is_decoder=True)")
    if model_type in _DECODER_HALVES:
        return ZooType(model_type, model_class, f"encoder-decoder ({_DECODER_HALVES[model_type]})")
    if not hasattr(transformers, model_class):
        return ZooType(model_type, model_class, f"transformers has no class {model_class}")
    try:
        cfg = CONFIG_MAPPING[model_type]()
    except Exception as e:  # noqa: BLE001 - a config that cannot be built is reported, not fatal
        return ZooType(model_type, model_class, f"its default config fails to build: "
                       f"{type(e).__name__}: {_first_line(e)}")
    if getattr(cfg, "is_encoder_decoder", False):
        return ZooType(model_type, model_class, "encoder-decoder")
    subs, _ = _sub_configs(cfg, CONFIG_MAPPING_NAMES)
    if subs:
        return ZooType(model_type, model_class, "needs extra inputs or sub-models (sub-configs: "
                       f"{', '.join(subs)})")
    return ZooType(model_type, model_class)


def _sub_configs(cfg, registered) -> tuple[list[str], list]:
    """(names of the sub-configs that configure another model, the other sub-configs) of
    ``cfg``: a vision tower or a text model has a ``model_type`` in ``registered``
    (transformers' CONFIG_MAPPING_NAMES); a group of this model's own settings (DBRX's and
    MPT's ``attn_config`` / ``ffn_config``) has none."""
    models, settings = [], []
    for name, value in vars(cfg).items():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            if value.model_type in registered:
                models.append(name)
            else:
                settings.append(value)
    return models, settings


def _shrink(default, kwargs: dict) -> dict:
    """``kwargs`` plus the family's own size names of ``default`` cut to tiny sizes, and its
    scalar factors set away from neutral."""
    for name, value in vars(default).items():
        if name in kwargs or isinstance(value, bool) or not isinstance(value, int):
            continue
        if _LAYER_NAME.match(name) and value > 2:
            kwargs[name] = 2
        elif "vocab_size" in name and value > VOCAB:  # per-layer input tables (Gemma 3n / 4)
            kwargs[name] = VOCAB
        elif (_SIZE_NAME.search(name) and value > 256 and "vocab" not in name
              and "position" not in name):
            kwargs[name] = 32
    for name, value in vars(default).items():
        factor = non_neutral(name, value)
        if factor is not None and name not in kwargs:
            kwargs[name] = factor
    return kwargs


def _shrink_settings(cfg, registered) -> None:
    """The model's own setting groups (sub-configs that are not sub-models) cut to tiny sizes
    in place, the hidden size matched to the model's."""
    hidden = next((getattr(cfg, k) for k in ("hidden_size", "d_model", "n_embd")
                   if isinstance(getattr(cfg, k, None), int)), None)
    for value in _sub_configs(cfg, registered)[1]:
        for name, new in _shrink(value, {}).items():
            setattr(value, name, hidden if name == "hidden_size" and hidden else new)


def zoo_types() -> list[ZooType]:
    """Every type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, classified."""
    return [classify(t, c) for t, c in sorted(causal_lm_types().items())]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:160] if text else ""


def non_neutral(name: str, value):
    """The value a scalar factor ``name`` is set to, or None to leave it."""
    if isinstance(value, bool) or not _FACTOR_NAME.search(name) or _NOT_A_FACTOR.search(name):
        return None
    if re.search(r"soft_?cap", name):
        return 2.0 if value in (None, 0, 0.0) or value > 10 else None
    if value in (None, 0):
        return None
    if isinstance(value, (int, float)) and float(value) == 1.0:
        return 0.6
    return None


def tiny_config(model_type: str, variant: str = "untied, pad None"):
    """The tiny config of ``model_type`` in ``variant`` (a key of :data:`VARIANTS`), with the
    record of what was set (``config.titanext_zoo_settings``)."""
    # transformers is the dev extra: imported only when the zoo runs
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    accepted = _accepted(cls)
    amap = dict(getattr(cls, "attribute_map", {}) or {})
    kwargs = {}
    for key, value in {**SIZES, **VARIANTS[variant]}.items():
        name = amap.get(key, key)
        if name in accepted or hasattr(default, name):
            kwargs[name] = value
    kwargs = _shrink(default, kwargs)  # the family's own size names and factors
    if "layer_types" in accepted:
        kinds = list(dict.fromkeys(getattr(default, "layer_types", None) or []))
        if len(kinds) >= 2:  # two kinds in two layers, a sliding one first where there is one
            pair = kinds[:2]
            kwargs["layer_types"] = pair[::-1] if pair[0] != "sliding_attention" else pair
        elif kinds:
            kwargs["layer_types"] = kinds * 2
    if "kv_lora_rank" in kwargs or "qk_rope_head_dim" in kwargs:
        kwargs.pop("head_dim", None)  # MLA: the rotary part's size is qk_rope_head_dim
        kv = amap.get("num_key_value_heads", "num_key_value_heads")
        kwargs[kv] = SIZES["num_attention_heads"]
    kwargs["use_cache"] = False  # no generation; state-space caches refuse a training forward
    kwargs = {k: v for k, v in kwargs.items()
              if (k in accepted or hasattr(default, k)) and not isinstance(
                  getattr(cls, k, None), property)}
    cfg = cls(**kwargs)
    _fit_lists(cfg, default)
    _shrink_settings(cfg, CONFIG_MAPPING_NAMES)
    cfg.titanext_zoo_settings = {k: v for k, v in kwargs.items() if k not in SIZES}
    return cfg


def _accepted(cls) -> set[str]:
    names = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            names |= set(inspect.signature(init).parameters)
        except (TypeError, ValueError):
            continue
    fields = getattr(cls, "__dataclass_fields__", None) or {}
    return names | set(fields)


def _fit_lists(cfg, default) -> None:
    """Per-layer lists sized for the default depth, cut to the tiny depth keeping two kinds."""
    layers = getattr(cfg, "num_hidden_layers", None)
    old = getattr(default, "num_hidden_layers", None)
    if not isinstance(layers, int) or not isinstance(old, int) or old == layers:
        return
    for name, value in list(vars(cfg).items()):
        if isinstance(value, list) and len(value) == old and name != "layer_types":
            kinds = list(dict.fromkeys(map(repr, value)))
            picked = [value[[repr(v) for v in value].index(k)] for k in kinds[:layers]]
            setattr(cfg, name, (picked + value[:layers])[:layers])


def build_tiny(model_type: str, variant: str = "untied, pad None", seed: int = 0):
    """The tiny random fp32 model of ``model_type`` (same weights for the same seed)."""
    import torch  # noqa: I001 (the zoo's configs load without torch for --list)
    import transformers  # the dev extra: imported only when the zoo runs

    cfg = tiny_config(model_type, variant)
    cls = getattr(transformers, causal_lm_types()[model_type])
    torch.manual_seed(seed)
    model = cls(cfg).float()
    model.eval()  # no dropout anywhere: the ranks and the reference must compute the same
    return model
