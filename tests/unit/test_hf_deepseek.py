"""HF DeepSeek-V3 checkpoints in and out: a tiny random ``DeepseekV3ForCausalLM`` (MLA, YaRN,
sigmoid group-limited routing with its bias, one MTP layer) loaded with ``flavor = "hf"`` gives
transformers' logits and transformers' ``MtpModel`` logits within 1e-5 relative in fp32; an
export loads back into transformers with the same logits; the converter's round trip is
bitwise; every config.json field titanext cannot map is a ConfigError line naming it."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests import REPO_ROOT
from tests.hf_artifacts import deepseek_mtp_reference, make_tiny_deepseek_v3
from titanext.errors import ConfigError
from titanext.hf.checkpoint import load_hf_weights, save_hf_checkpoint
from titanext.launch.convert import main as convert_main
from titanext.models import build_model
from titanext.models.hf_configs import model_args_from_hf
from titanext.models.hf_names import check_hf_checkpoint
from titanext.models.mtp import mtp_labels

pytest.importorskip("transformers")
LAYERS = 3


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """{variant: (directory, HF main model, MTP reference)}: DeepSeek-V3's own settings, and
    a full-rank query with HF's half RoPE pairing."""
    root = tmp_path_factory.mktemp("dsv3")
    out = {}
    for name, kw in {"v3": {}, "full_q_half_rope": {"q_lora_rank": None,
                                                     "rope_interleave": False}}.items():
        d = str(root / name)
        main, blocks, extra = make_tiny_deepseek_v3(d, layers=LAYERS, **kw)
        out[name] = (d, main.eval(), deepseek_mtp_reference(main, blocks, extra, LAYERS))
    return out


def _tokens(n: int = 2, seq: int = 41) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, 320, (n, seq), generator=torch.Generator().manual_seed(1))
    return x[:, :-1], x[:, 1:]


def _ours(directory: str, **replace) -> tuple[torch.nn.Module, object]:
    args = dataclasses.replace(model_args_from_hf(directory), **replace)
    model = build_model("llama3", args, device="cpu")
    load_hf_weights([model], directory, args)
    return model, args


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@torch.no_grad()
def _reference(main, mtp, inputs, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits and its MTP layer's logits (the MTP layer sees the main model's
    last hidden state and the next tokens, as in MtpModel's drafting)."""
    out = main(inputs, output_hidden_states=True)
    pos = torch.arange(inputs.shape[1])[None].expand(inputs.shape[0], -1)
    h = mtp.forward_layer(0, out.hidden_states[-1], pos, None, input_ids=labels)
    return out.logits, mtp._project_to_logits(h)


@pytest.mark.parametrize("variant", ["v3", "full_q_half_rope"])
def test_logits_and_mtp_logits_match_transformers(ds, variant):
    directory, main, mtp = ds[variant]
    model, args = _ours(directory)
    assert args.mla and args.num_mtp_layers == 1
    assert args.rope_layout == ("interleaved" if variant == "v3" else "half")
    inputs, labels = _tokens()
    want, want_mtp = _reference(main, mtp, inputs, labels)
    with torch.no_grad():
        got = model(inputs)
        got_mtp = model.mtp_logits(inputs, mtp_labels(labels, 1))[0]
    assert _rel(got, want) < 1e-5
    assert _rel(got_mtp, want_mtp) < 1e-5
    bias = model.layers["1"].moe.router.expert_bias
    assert bias.abs().sum() > 0  # e_score_correction_bias loaded (it changes the routing)


def test_export_loads_back_into_transformers_with_the_same_logits(ds, tmp_path):
    from transformers import AutoModelForCausalLM

    directory, _, _ = ds["v3"]
    model, args = _ours(directory)
    with torch.no_grad():  # change the weights, so the export is not a copy of the source
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
        model.layers["2"].moe.router.expert_bias.add_(0.05)
    out = str(tmp_path / "export")
    save_hf_checkpoint([model], out, args, hf_assets_path=directory)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["rope_interleave"] is True
    theirs = AutoModelForCausalLM.from_pretrained(out).float().eval()
    inputs, labels = _tokens()
    with torch.no_grad():
        assert _rel(model(inputs), theirs(inputs).logits) < 1e-5
    # the MTP layer went out under DeepSeek's names and comes back in
    index = check_hf_checkpoint(out, args)
    assert f"model.layers.{LAYERS}.shared_head.head.weight" in index
    assert f"model.layers.{LAYERS}.mlp.experts.7.up_proj.weight" in index
    again, _ = _ours(out)
    future = mtp_labels(labels, 1)
    with torch.no_grad():
        torch.testing.assert_close(again.mtp_logits(inputs, future)[0],
                                   model.mtp_logits(inputs, future)[0], rtol=0, atol=0)


def test_convert_round_trip_is_bitwise_with_the_mtp_layer(ds, tmp_path):
    from safetensors.torch import load_file

    src = ds["v3"][0]
    assert convert_main(["hf-to-dcp", src, str(tmp_path / "dcp")]) == 0
    assert convert_main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "back")]) == 0
    a = load_file(os.path.join(src, "model.safetensors"))
    b = {}
    for f in os.listdir(tmp_path / "back"):
        if f.endswith(".safetensors"):
            b.update(load_file(str(tmp_path / "back" / f)))
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_checkpoint_without_mtp_weights_names_the_fix(ds, tmp_path):
    """transformers' save_pretrained drops the MTP layers but keeps num_nextn_predict_layers."""
    directory, main, _ = ds["v3"]
    plain = str(tmp_path / "plain")
    main.save_pretrained(plain)
    args = model_args_from_hf(plain)
    with pytest.raises(ConfigError, match="set model.num_mtp_layers = 0"):
        check_hf_checkpoint(plain, args)
    model, _ = _ours(plain, num_mtp_layers=0)
    inputs, _ = _tokens()
    with torch.no_grad():
        assert _rel(model(inputs), main(inputs).logits) < 1e-5


@pytest.mark.parametrize("field,value,says", [
    ("scoring_func", "softmax", "scoring_func = 'softmax' is not implemented"),
    ("topk_method", "greedy", "topk_method = 'greedy' is not implemented"),
    ("n_group", 3, "n_group = 3 must divide n_routed_experts = 8"),
    ("attention_bias", True, "attention_bias = true is not implemented"),
    ("kv_lora_rank", -4, "kv_lora_rank = -4; allowed: a non-negative integer"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0}, "rope type 'dynamic'"),
])
def test_an_unmappable_config_field_is_one_line_naming_it(ds, tmp_path, field, value, says):
    d = tmp_path / "bad"
    shutil.copytree(ds["v3"][0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        model_args_from_hf(str(d))
    assert len(e.value.problems) == 1 and says in e.value.problems[0], e.value.problems
    assert "config.json" in e.value.problems[0]


def test_the_cli_exits_2_naming_the_field(ds, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(ds["v3"][0], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["scoring_func"] = "softmax"
    (d / "config.json").write_text(json.dumps(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "titanext.train", "--model.flavor=hf",
         f"--model.hf_assets_path={d}", "--training.dataset=synthetic"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    lines = [x for x in proc.stderr.splitlines() + proc.stdout.splitlines() if x.strip()]
    assert proc.returncode == 2, proc
    assert len(lines) == 1 and "scoring_func = 'softmax'" in lines[0], lines
