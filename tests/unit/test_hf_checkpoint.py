"""HF checkpoints in and out: the offline converter's round trip is bitwise, an export loads in
transformers with the same logits, and a mismatched initial load names the tensor. The initial
load under FSDP, TP, PP and EP (4 gloo ranks): tests/multiprocess/test_hf_checkpoint.py."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.hf_artifacts import (
    make_bpe_tokenizer,
    make_tiny_llama,
    make_tiny_mixtral,
    make_tiny_qwen3,
)
from titanext.data.tokenizer import build_tokenizer
from titanext.errors import ConfigError
from titanext.hf.checkpoint import load_hf_weights, load_initial_weights, save_hf_checkpoint
from titanext.hf.convert import hf_to_dcp
from titanext.launch.convert import main as convert_main
from titanext.models import build_model
from titanext.models.hf_configs import model_args_from_hf

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfck")
    dirs = {name: str(root / name) for name in ("plain", "tied", "bf16", "mixtral", "qwen3_moe")}
    make_tiny_llama(dirs["plain"], rope_scaling=True, layers=4)
    make_tiny_llama(dirs["tied"], tie=True, layers=4)
    make_tiny_llama(dirs["bf16"], dtype=torch.bfloat16)
    make_tiny_mixtral(dirs["mixtral"])
    make_bpe_tokenizer(dirs["mixtral"])
    make_tiny_qwen3(dirs["qwen3_moe"], moe=True, mlp_only_layers=[0], norm_topk_prob=True)
    dirs["plain_dcp"] = str(root / "plain_dcp")
    hf_to_dcp(dirs["plain"], dirs["plain_dcp"], progress=False)
    return dirs


def _tensors(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


@pytest.mark.parametrize("which", ["plain", "tied", "bf16", "mixtral", "qwen3_moe"])
def test_convert_round_trip_is_bitwise(hf_dirs, tmp_path, capsys, which):
    src = hf_dirs[which]
    assert convert_main(["hf-to-dcp", src, str(tmp_path / "dcp")]) == 0
    # a tiny shard limit: several files and an index, reassembled by name
    assert convert_main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"),
                         "--max-shard-gb", "1e-5"]) == 0
    assert "dcp-to-hf [" in capsys.readouterr().err  # the progress bar
    a, b = _tensors(src), _tensors(str(tmp_path / "back"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert os.path.isfile(tmp_path / "back" / "model.safetensors.index.json")


def test_convert_bad_input_exits_2(hf_dirs, tmp_path, capsys):
    assert convert_main(["hf-to-dcp", str(tmp_path), str(tmp_path / "x")]) == 2
    assert "config.json does not exist" in capsys.readouterr().err
    assert convert_main(["dcp-to-hf", hf_dirs["plain"], str(tmp_path / "y")]) == 2
    assert "not a DCP checkpoint" in capsys.readouterr().err


def test_initial_load_from_mismatched_dcp_names_tensor_and_shapes(hf_dirs):
    from titanext.models import get_model_args

    args = get_model_args("llama3", "debugtiny")
    model = build_model("llama3", args, device="cpu")
    with pytest.raises(ConfigError) as e:
        load_initial_weights([model], hf_dirs["plain_dcp"], args, in_hf=False)
    assert "model.tok_embeddings.weight has shape [320, 64]" in str(e.value)
    assert "needs [264, 64]" in str(e.value)
    with pytest.raises(ConfigError, match="initial_load_in_hf = true"):
        load_initial_weights([model], hf_dirs["plain"], args, in_hf=False)


@pytest.mark.parametrize("which", ["plain", "mixtral", "qwen3_moe"])
def test_export_loads_in_transformers_with_equal_logits(hf_dirs, tmp_path, which):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = hf_dirs[which]
    args = model_args_from_hf(src)
    model = build_model("llama3", args, device="cpu")
    load_hf_weights([model], src, args)
    with torch.no_grad():  # change the weights, so the export is not a copy of the source
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    tok = build_tokenizer("hf", src) if which == "mixtral" else None
    out = str(tmp_path / "export")
    save_hf_checkpoint([model], out, args, tokenizer=tok, hf_assets_path=src)
    theirs = AutoModelForCausalLM.from_pretrained(out)
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (theirs(tokens).logits - model(tokens)).abs().max().item() < 1e-5
    if tok is not None:
        assert AutoTokenizer.from_pretrained(out)("To be")["input_ids"] == tok.encode("To be")


def test_named_flavor_export_permutes_rope_rows(tmp_path):
    """A model with the named flavors' interleaved RoPE exports with HF's pairing."""
    from transformers import AutoModelForCausalLM

    from titanext.models import get_model_args

    args = dataclasses.replace(get_model_args("llama3", "debugtiny"), vocab_size=320)
    model = build_model("llama3", args, device="cpu")
    model.init_weights(seed=3)
    save_hf_checkpoint([model], str(tmp_path / "e"), args)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "e"))
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (theirs(tokens).logits - model(tokens)).abs().max().item() < 1e-5
