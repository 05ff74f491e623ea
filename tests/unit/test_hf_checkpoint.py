"""HF checkpoints in and out: the offline converter's round trip is bitwise, an export loads in
transformers with the same logits, and the initial load under FSDP, TP, PP and EP (4 gloo
ranks, one spawn) gives every rank exactly the single-process model's weights."""

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
from tests.spawn import run_distributed
from titanext.components.tokenizer import build_tokenizer
from titanext.errors import ConfigError
from titanext.hf.checkpoint import load_hf_weights, load_initial_weights, save_hf_checkpoint
from titanext.hf.convert import hf_to_dcp
from titanext.hf.convert import main as convert_main
from titanext.models import build_model
from titanext.models.hf import model_args_from_hf

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


# -- initial load under every layout ----------------------------------------------------------
# name: (hf dir, ParallelDims degrees, rope layout, source); 4 ranks each. "hf" reads the
# safetensors, "dcp" the titanext DCP checkpoint that hf-to-dcp made of them, "slices" the
# safetensors without DCP.
LAYOUTS = {
    "fsdp4": ("plain", dict(dp_shard=4), "half", "hf"),
    "fsdp4_tied": ("tied", dict(dp_shard=4), "half", "hf"),
    "fsdp2_tp2_tied": ("tied", dict(dp_shard=2, tp=2), "half", "hf"),
    "fsdp2_tp2": ("plain", dict(dp_shard=2, tp=2), "half", "hf"),
    # the named flavors' RoPE pairing: q/k rows permuted while reading TP x FSDP shards
    "fsdp2_tp2_interleaved": ("plain", dict(dp_shard=2, tp=2), "interleaved", "hf"),
    "pp2_fsdp2": ("plain", dict(pp=2, dp_shard=2), "half", "hf"),
    "ep2_fsdp4_mixtral": ("mixtral", dict(dp_shard=4, ep=2), "half", "hf"),
    "ep4_mixtral": ("mixtral", dict(dp_shard=4, ep=4), "half", "hf"),
    "ep2_fsdp4_qwen3_moe": ("qwen3_moe", dict(dp_shard=4, ep=2), "half", "hf"),
    "pp2_tp2_from_dcp": ("plain", dict(pp=2, tp=2), "half", "dcp"),
    # every tensor by safetensors slice reads (the path without DCP's HuggingFaceStorageReader)
    "fsdp2_tp2_slices": ("plain", dict(dp_shard=2, tp=2), "half", "slices"),
}


def _load_layouts(rank: int, world_size: int, dirs: dict[str, str], export_root: str
                  ) -> dict[str, dict[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    from titanext.distributed.parallel_dims import ParallelDims
    from titanext.distributed.pipeline import split_model
    from titanext.plugins.expert_parallel import apply_expert_parallel
    from titanext.plugins.fsdp import apply_fsdp
    from titanext.plugins.tensor_parallel import apply_tensor_parallel

    out = {}
    for name, (which, degrees, layout, source) in LAYOUTS.items():
        args = dataclasses.replace(model_args_from_hf(dirs[which]), rope_layout=layout)
        dims = ParallelDims(**{"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1,
                               "ep": 1, **degrees}, world_size=world_size)
        dims.build_mesh("cpu")
        model = build_model("llama3", args, device="meta")
        if dims.pp_enabled:
            model = split_model(model, [2, 2], dims.pp_mesh.get_local_rank())
        if dims.tp_enabled:
            apply_tensor_parallel(model, dims.tp_mesh, sequence_parallel=True,
                                  loss_parallel=False)
        experts = []
        if dims.ep_enabled:
            experts = [model.get_submodule(f) for f in apply_expert_parallel(model, dims.ep_mesh)]
        apply_fsdp(model, dims.fsdp_mesh, pp_enabled=dims.pp_enabled, expert_units=experts,
                   expert_mesh=dims.expert_fsdp_mesh if experts else None)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        if source == "slices":
            load_hf_weights([model], dirs[which], args, use_dcp=False)
        else:
            path = dirs[which] if source == "hf" else dirs[which + "_dcp"]
            load_initial_weights([model], path, args, in_hf=source == "hf")
        mesh = dims.world_mesh
        keep = all(c == 0 for n, c in zip(mesh.mesh_dim_names, mesh.get_coordinate())
                   if n != "pp")
        params = {}
        for fqn, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if keep:
                params[fqn] = full.detach().clone()
        if args.tie_embeddings and keep:
            assert model.output.weight is model.tok_embeddings.weight
        # and back out: every rank gathers, the lowest holder of each tensor writes it
        save_hf_checkpoint([model], os.path.join(export_root, name), args)
        out[name] = params
    return out


@pytest.mark.slow
def test_initial_load_and_export_under_every_layout(hf_dirs, tmp_path):
    """Each rank's shards after the load equal the one-process load, and the export written
    from the sharded model equals the source safetensors bitwise (pipeline stages: one file
    per stage plus the index)."""
    per_rank = run_distributed(_load_layouts, world_size=4, args=(hf_dirs, str(tmp_path)),
                               timeout_s=120)
    for name, (which, _, layout, _) in LAYOUTS.items():
        args = dataclasses.replace(model_args_from_hf(hf_dirs[which]), rope_layout=layout)
        ref = build_model("llama3", args, device="cpu")
        load_hf_weights([ref], hf_dirs[which], args)
        expected = dict(ref.named_parameters())
        got = {}
        for result in per_rank:
            got.update(result[name])
        assert sorted(got) == sorted(expected), name
        for fqn, value in expected.items():
            assert torch.equal(got[fqn], value), f"{name}: {fqn}"
        source, exported = _tensors(hf_dirs[which]), _tensors(str(tmp_path / name))
        assert sorted(source) == sorted(exported), name
        for key, value in source.items():
            assert torch.equal(exported[key], value), f"{name} export: {key}"
        files = [f for f in os.listdir(tmp_path / name) if f.endswith(".safetensors")]
        assert len(files) == (2 if "pp2" in name else 1), (name, files)
