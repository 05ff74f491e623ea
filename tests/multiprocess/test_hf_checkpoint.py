"""HF checkpoints under every layout: the initial load under FSDP, TP (both RoPE pairings, also
without DCP's reader), PP and EP (Mixtral, Qwen3-MoE), from safetensors or from a DCP
checkpoint, gives every one of 4 gloo ranks (one spawn) exactly the single-process model's
weights, and the export written from each sharded model equals the source safetensors bitwise.
The tiny HF checkpoints come from tests/unit/test_hf_checkpoint.py's ``hf_dirs`` fixture.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.spawn import run_distributed
from tests.unit import test_hf_checkpoint as in_process
from tests.unit.test_hf_checkpoint import _tensors
from titanext.hf.checkpoint import load_hf_weights, load_initial_weights, save_hf_checkpoint
from titanext.models import build_model
from titanext.models.hf_configs import model_args_from_hf

hf_dirs = in_process.hf_dirs  # the tiny HF checkpoints: a module-scoped fixture


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
