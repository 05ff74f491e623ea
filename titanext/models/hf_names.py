"""titanext tensor names and their Hugging Face names (the state-dict adapter), and the checks,
from file headers only, that a checkpoint holds every tensor of a model: torch-free at import, so
the config runs them while loading (:mod:`titanext.config.hf_rules`); the loading and saving
itself is :mod:`titanext.hf.checkpoint`.

- :func:`hf_names`: titanext FQN -> HF tensor names (a stacked expert weight maps to one HF
  tensor per expert).
- :func:`check_hf_checkpoint`: every tensor the model needs is there with the right shape, or
  a :class:`~titanext.errors.ConfigError` naming the first mismatched tensor, both shapes and
  the file. It reads only the safetensors headers, so validation runs it before training.
- :func:`check_dcp_checkpoint`: the same for a titanext DCP checkpoint (its metadata only).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

from titanext.errors import ConfigError
from titanext.models import build_model
from titanext.models.args import ModelArgs

__all__ = ["check_dcp_checkpoint", "check_hf_checkpoint", "hf_names", "hf_tensor_index"]

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_EXPERTS = {"moe.experts.w1": "w1", "moe.experts.w2": "w2", "moe.experts.w3": "w3"}
# MoE names per family: Mixtral's, and Qwen3-MoE's (the models with QK-norm).
_ROUTER = {False: "block_sparse_moe.gate.weight", True: "mlp.gate.weight"}
_EXPERT_NAME = {False: "block_sparse_moe.experts.{e}.{w}.weight",
                True: "mlp.experts.{e}.{w}.weight"}
_QWEN_EXPERT_W = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# titanext state with no HF counterpart: the aux-loss-free routing bias (zero unless trained
# with load_balance_coeff) is skipped, with a warning on export when it is not zero.
_NO_HF = ("moe.router.expert_bias",)
# DeepSeek-V3 (MLA models): attention, the router with its bias, shared experts; its MTP
# modules are model.layers.{n_layers + k} (enorm, hnorm, eh_proj, shared_head.norm, the block)
_DEEPSEEK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
            "eh_proj.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight"}


def hf_names(fqn: str, args: ModelArgs) -> list[str] | None:
    """HF names of titanext tensor ``fqn``: one name, or one per expert for a stacked expert
    weight ([num_experts, ...]); None for state HF does not have (tied ``output.weight``, the
    routing bias).

    >>> from titanext.models import ModelArgs
    >>> hf_names("layers.3.attention.wq.weight", ModelArgs())
    ['model.layers.3.self_attn.q_proj.weight']
    """
    if fqn == "tok_embeddings.weight":
        return ["model.embed_tokens.weight"]
    if fqn == "norm.weight":
        return ["model.norm.weight"]
    if fqn == "output.weight":
        return None if args.tie_embeddings else ["lm_head.weight"]
    m = _MTP.match(fqn)
    if m is not None:
        layer, rest = args.n_layers + int(m.group(1)), m.group(2)
        if rest in _MTP_OWN:
            return [f"model.layers.{layer}.{_MTP_OWN[rest]}"]
        if rest.startswith("block."):
            return hf_names(f"layers.{layer}.{rest.removeprefix('block.')}", args)
        raise KeyError(f"{fqn!r} has no Hugging Face name")
    m = _LAYER.match(fqn)
    if m is None:
        raise KeyError(f"{fqn!r} has no Hugging Face name")
    layer, rest = m.groups()
    prefix = f"model.layers.{layer}."
    if args.mla and rest in _DEEPSEEK:
        return [prefix + _DEEPSEEK[rest]]
    if rest in _PER_LAYER:
        return [prefix + _PER_LAYER[rest]]
    if rest == "moe.router.gate.weight":
        return [prefix + _ROUTER[args.qk_norm]]
    if rest in _EXPERTS:
        w = _EXPERTS[rest]
        w = _QWEN_EXPERT_W[w] if args.qk_norm or args.mla else w
        template = _EXPERT_NAME[args.qk_norm or args.mla]
        return [prefix + template.format(e=e, w=w) for e in range(args.moe.num_experts)]
    if rest in _NO_HF:
        return None
    raise KeyError(f"{fqn!r} has no Hugging Face name")


def _is_stacked(fqn: str) -> bool:
    """Whether ``fqn`` is a stacked expert weight [num_experts, ...] (one HF tensor each)."""
    return fqn.endswith(tuple(_EXPERTS))


def _permuted_heads(fqn: str, args: ModelArgs) -> int | None:
    """Heads of ``fqn`` if it is a q/k projection that needs the RoPE permutation, else None."""
    if args.rope_layout == "half" or args.mla:  # MLA: HF's rope_interleave is the layout
        return None
    if fqn.endswith("attention.wq.weight"):
        return args.n_heads
    if fqn.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


# -- reading --------------------------------------------------------------------------------
def hf_tensor_index(path: str) -> dict[str, tuple[str, list[int], str]]:
    """HF tensor name -> (file, shape, dtype) from the safetensors headers under ``path``."""
    from safetensors import safe_open  # optional dependency (the HF path)

    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint.initial_load_path = {path!r} is not a directory")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"checkpoint.initial_load_path = {path!r} holds no *.safetensors "
                          "file (with initial_load_in_hf = true it must be a Hugging Face "
                          "model directory)")
    index: dict[str, tuple[str, list[int], str]] = {}
    for name in files:
        file = os.path.join(path, name)
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    index[key] = (file, list(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ConfigError(f"{file} is not a valid safetensors file: {e}") from None
    return index


def _expected(args: ModelArgs) -> Iterator[tuple[str, str, list[int]]]:
    """(titanext fqn, HF name, HF shape) of every tensor the whole model loads, in order."""
    model = build_model("llama3", args, device="meta")
    for fqn, t in model.state_dict().items():
        names = hf_names(fqn, args)
        if names is None:
            continue
        shape = list(t.shape[1:]) if _is_stacked(fqn) else list(t.shape)
        for name in names:
            yield fqn, name, shape


def check_hf_checkpoint(path: str, args: ModelArgs) -> dict[str, tuple[str, list[int], str]]:
    """The tensor index of ``path`` if it holds every tensor of the model ``args`` describes,
    with matching shapes; else ConfigError naming the first missing or mismatched tensor, its
    file and both shapes. Reads only headers."""
    index = hf_tensor_index(path)
    for fqn, name, shape in _expected(args):
        if name not in index:
            fix = ("; it has no multi-token prediction weights (transformers' save_pretrained "
                   "leaves them out): set model.num_mtp_layers = 0 to train without MTP"
                   if fqn.startswith("mtp.") else "; the checkpoint does not match the model")
            raise ConfigError(f"checkpoint.initial_load_path = {path!r}: tensor {name!r} (for "
                              f"{fqn}) is missing{fix}")
        file, found, _ = index[name]
        if found != shape:
            raise ConfigError(f"checkpoint.initial_load_path: {file}: tensor {name!r} has shape "
                              f"{found}, but the model's {fqn} needs {shape}; the checkpoint does "
                              "not match model.flavor")
    return index


def check_dcp_checkpoint(path: str, args: ModelArgs) -> None:
    """ConfigError unless the titanext DCP checkpoint ``path`` holds every model tensor of
    ``args`` with the right shape (names the first mismatched tensor and both shapes)."""
    from torch.distributed.checkpoint import FileSystemReader  # torch: the config loads us

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise ConfigError(f"checkpoint.initial_load_path = {path!r} is not a DCP checkpoint (no "
                          ".metadata file); for a Hugging Face directory set "
                          "checkpoint.initial_load_in_hf = true")
    from titanext._safe_load import check_dcp_metadata  # torch, as above

    check_dcp_metadata(os.path.join(path, ".metadata"))  # a pickle: nothing in it may run
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    for fqn, t in build_model("llama3", args, device="meta").state_dict().items():
        meta = saved.get(f"model.{fqn}")
        if meta is None:
            raise ConfigError(f"checkpoint.initial_load_path = {path!r}: tensor model.{fqn} is "
                              "missing; the checkpoint does not match model.flavor")
        if list(meta.size) != list(t.shape):
            raise ConfigError(f"checkpoint.initial_load_path = {path!r}: tensor model.{fqn} has "
                              f"shape {list(meta.size)}, but the model needs {list(t.shape)}; "
                              "the checkpoint does not match model.flavor")
