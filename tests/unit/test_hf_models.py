"""The ``hf`` flavor and tokenizer: shapes from config.json, logits equal to transformers',
every unsupported field a ConfigError naming it, and the HF tokenizer."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from tests.hf_artifacts import (
    BOS,
    EOS,
    TOKENIZER_VOCAB,
    make_tiny_llama,
    make_tiny_mixtral,
    make_tiny_qwen3,
)
from titanext.data.hf_tokenizer import HFTokenizer
from titanext.data.tokenizer import build_tokenizer
from titanext.errors import ConfigError
from titanext.hf.checkpoint import load_hf_weights
from titanext.models import build_model
from titanext.models.hf_configs import model_args_from_hf
from titanext.models.hf_names import check_hf_checkpoint

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for name, kw in {"plain": {}, "tied": {"tie": True},
                     "scaled": {"rope_scaling": True}}.items():
        dirs[name] = str(root / name)
        make_tiny_llama(dirs[name], **kw)
    dirs["mixtral"] = str(root / "mixtral")
    make_tiny_mixtral(dirs["mixtral"])
    dirs["qwen3"] = str(root / "qwen3")
    make_tiny_qwen3(dirs["qwen3"], tie_word_embeddings=True)
    dirs["qwen3_moe"] = str(root / "qwen3_moe")
    make_tiny_qwen3(dirs["qwen3_moe"], moe=True)
    # layer 0 dense, norm_topk_prob: titanext's n_dense_layers = 1 and route_norm
    dirs["qwen3_moe_dense0"] = str(root / "qwen3_moe_dense0")
    make_tiny_qwen3(dirs["qwen3_moe_dense0"], moe=True, mlp_only_layers=[0], norm_topk_prob=True)
    return dirs


def _ours(directory: str, **replace) -> torch.nn.Module:
    args = dataclasses.replace(model_args_from_hf(directory), **replace)
    model = build_model("llama3", args, device="cpu")
    load_hf_weights([model], directory, args)
    return model


def _max_logit_error(directory: str, **replace) -> float:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokens = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (ref(tokens).logits - _ours(directory, **replace)(tokens)).abs().max().item()


@pytest.mark.parametrize("which", ["plain", "tied", "scaled", "mixtral", "qwen3", "qwen3_moe",
                                   "qwen3_moe_dense0"])
def test_logits_equal_transformers(hf_dirs, which):
    # 96 positions > original_max_position_embeddings = 32: llama3 rope scaling is exercised
    assert _max_logit_error(hf_dirs[which]) < 1e-5


def test_interleaved_rope_with_permuted_weights_equals_transformers(hf_dirs):
    """The named flavors' RoPE pairing: q/k rows permuted on load give the same network."""
    assert _max_logit_error(hf_dirs["scaled"], rope_layout="interleaved") < 1e-5


def test_logits_differ_without_rope_scaling(hf_dirs):
    """The comparison is sensitive: dropping the llama3 scaling changes the logits."""
    assert _max_logit_error(hf_dirs["scaled"], rope_scaling=None) > 1e-3


def test_model_args_from_config(hf_dirs):
    args = model_args_from_hf(hf_dirs["tied"])
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.ffn_hidden_dim,
            args.vocab_size, args.rope_theta, args.norm_eps, args.max_seq_len,
            args.tie_embeddings, args.rope_layout) == (64, 2, 4, 2, 96, 320, 500000.0, 1e-5,
                                                       256, True, "half")
    moe = model_args_from_hf(hf_dirs["mixtral"]).moe
    assert (moe.num_experts, moe.top_k, moe.hidden_dim, moe.score_func, moe.route_norm) == (
        4, 2, 32, "softmax", True)
    qwen = model_args_from_hf(hf_dirs["qwen3_moe_dense0"])
    assert (qwen.head_dim, qwen.qk_norm, qwen.n_dense_layers, qwen.moe_layer_interval,
            qwen.ffn_hidden_dim, qwen.moe.route_norm) == (32, True, 1, 1, 96, True)


def _write_config(hf_dir: str, tmp_path, **changes) -> str:
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    out = tmp_path / "cfg"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


@pytest.mark.parametrize("changes, field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 33}, "head_dim"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}, "DeepseekV2"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_unsupported_config_is_config_error_naming_field_and_file(hf_dirs, tmp_path, changes,
                                                                   field):
    directory = _write_config(hf_dirs["plain"], tmp_path, **changes)
    with pytest.raises(ConfigError) as e:
        model_args_from_hf(directory)
    assert field in str(e.value) and os.path.join(directory, "config.json") in str(e.value)


def test_qwen3_moe_sparse_pattern_titanext_cannot_express(hf_dirs, tmp_path):
    directory = _write_config(hf_dirs["qwen3_moe"], tmp_path, mlp_only_layers=[2])
    with pytest.raises(ConfigError, match=r"makes layers \[0, 1\] sparse"):
        model_args_from_hf(directory)


def test_missing_or_malformed_config_json(tmp_path):
    with pytest.raises(ConfigError, match="config.json does not exist"):
        model_args_from_hf(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json is not valid JSON"):
        model_args_from_hf(str(tmp_path))


def test_mismatched_checkpoint_names_tensor_and_both_shapes(hf_dirs):
    args = dataclasses.replace(model_args_from_hf(hf_dirs["plain"]), ffn_hidden_size=128)
    with pytest.raises(ConfigError) as e:
        check_hf_checkpoint(hf_dirs["plain"], args)
    msg = str(e.value)
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "[96, 64]" in msg
    assert "[128, 64]" in msg and "model.safetensors" in msg


# -- tokenizer ------------------------------------------------------------------------------
def test_hf_tokenizer_matches_transformers(hf_dirs):
    from transformers import AutoTokenizer

    ours = build_tokenizer("hf", hf_dirs["plain"])
    theirs = AutoTokenizer.from_pretrained(hf_dirs["plain"])
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler"
    ids = ours.encode(text, bos=True, eos=True)
    assert ids[0] == ours.bos_id == theirs.convert_tokens_to_ids(BOS)
    assert ids[-1] == ours.eos_id == theirs.convert_tokens_to_ids(EOS)
    assert ids[1:-1] == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == text
    assert ours.vocab_size == TOKENIZER_VOCAB


def test_hf_tokenizer_specials_without_tokenizer_config(hf_dirs, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(
        open(os.path.join(hf_dirs["plain"], "tokenizer.json"), "rb").read())
    tok = HFTokenizer(str(tmp_path))  # found by name among the special tokens
    assert (tok.bos_id, tok.eos_id) == (0, 1)


def test_hf_tokenizer_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.json does not exist"):
        build_tokenizer("hf", str(tmp_path))
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(ConfigError, match="tokenizer.json is not a valid tokenizer.json"):
        build_tokenizer("hf", str(tmp_path))
    with pytest.raises(ConfigError, match="hf_assets_path"):
        build_tokenizer("hf", None)
