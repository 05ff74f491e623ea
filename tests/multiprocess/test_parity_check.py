"""titanext.parity on models written here in other libraries' styles: right wirings pass, the
issue's silent traps fail it (FusedColwiseParallel on a qkv grouped per KV head; CP without
the global positions; EP on experts it cannot see), and so does a one-line bug in a wiring.
parallelize's FSDP over its flattened ``dp_shard_cp`` counts as dp_shard parallelism, the default
loss runs a transformers model under CP, and a rank's failure keeps its traceback (issue 44).

All ten checks share one 2-rank spawn (check_all); the CLI test runs the example's wiring.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]
VOCAB, DIM, HEADS, KV_HEADS, SEQ = 64, 32, 4, 2, 16
HD, GROUP = DIM // HEADS, HEADS // KV_HEADS


# -- a decoder in another style: qkv grouped per KV head, rotary without positions -----------

def sdpa(q, k, v, *, causal=True, scale=None, document_ids=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


class Rotary(nn.Module):  # forward takes no positions: rows 0..seq-1 of its tables
    def __init__(self):
        super().__init__()
        angles = torch.outer(torch.arange(SEQ).float(),
                             1.0 / 10000 ** (torch.arange(0, HD, 2).float() / HD))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        cos, sin = self.cos[: x.shape[2]], self.sin[: x.shape[2]]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        # rows grouped per KV head: [q of group g (GROUP heads), k_g, v_g] for each g
        self.qkv = nn.Linear(DIM, KV_HEADS * (GROUP + 2) * HD, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.rotary = Rotary()
        self.attn_fn = sdpa

    def forward(self, x):
        b, s, _ = x.shape
        groups = self.qkv(x).view(b, s, -1, (GROUP + 2) * HD)  # local groups under TP
        q, k, v = groups.split([GROUP * HD, HD, HD], dim=-1)
        q = q.reshape(b, s, -1, HD).transpose(1, 2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        y = self.attn_fn(self.rotary(q), self.rotary(k), v, causal=True, scale=None)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GroupedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_grouped():
    return GroupedLM()


def _tp(model, ctx, qkv_style):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from titanext.plugins.tensor_parallel import apply_tensor_parallel

    apply_tensor_parallel(model, ctx.mesh["tp"], {
        "layers.*.attn.qkv": qkv_style, "layers.*.attn.out": RowwiseParallel(),
        "layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()})
    return model


def wire_tp_colwise(model, ctx):  # right: tp (2) divides the KV heads (2)
    from torch.distributed.tensor.parallel import ColwiseParallel

    return _tp(model, ctx, ColwiseParallel())


def wire_tp_fused(model, ctx):  # trap 5: the docs' old advice, on a grouped qkv
    from titanext.plugins.tensor_parallel import FusedColwiseParallel

    return _tp(model, ctx, FusedColwiseParallel(split_sizes=(HEADS * HD, KV_HEADS * HD,
                                                             KV_HEADS * HD)))


def _cp(model, ctx, *, index_tables):
    from titanext.plugins.context_parallel import apply_context_parallel
    from titanext.plugins.fsdp import apply_fsdp

    apply_context_parallel(model, ctx.cp_mesh)
    if index_tables:  # rotary without positions: its rows must be the rank's global positions
        positions = ctx.positions()
        for m in model.modules():
            if isinstance(m, Rotary):
                m.cos, m.sin = m.cos[positions], m.sin[positions]
    return apply_fsdp(model, ctx.mesh["cp"], blocks=model.layers)  # averages over cp


def wire_cp(model, ctx):
    return _cp(model, ctx, index_tables=True)


def wire_cp_no_positions(model, ctx):  # trap 6
    return _cp(model, ctx, index_tables=False)


# -- a MoE in two expert layouts --------------------------------------------------------------

E, HIDDEN = 4, 16


class StackedExperts(nn.Module):  # titanext's experts protocol: expert index first
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, DIM, HIDDEN) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, HIDDEN, DIM) * 0.1)

    def forward(self, x, num_tokens_per_expert):
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        chunks = x.split(num_tokens_per_expert.tolist())
        return torch.cat([F.gelu(c @ w1[e]) @ w2[e] for e, c in enumerate(chunks)])


class ListExperts(nn.ModuleList):  # Mixtral style: one MLP per expert, called in a loop
    def __init__(self):
        super().__init__(nn.Sequential(nn.Linear(DIM, HIDDEN, bias=False), nn.GELU(),
                                       nn.Linear(HIDDEN, DIM, bias=False)) for _ in range(E))


class MoELM(nn.Module):
    def __init__(self, stacked=True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.router = nn.Linear(DIM, E, bias=False)
        self.experts = StackedExperts() if stacked else ListExperts()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        flat = x.flatten(0, 1)
        weight, idx = self.router(flat).softmax(-1).max(-1)  # top-1
        order = idx.argsort(stable=True)
        counts = torch.bincount(idx, minlength=E)
        if isinstance(self.experts, StackedExperts):
            routed = self.experts(flat[order], counts)
        else:
            routed = torch.cat([self.experts[e](c)
                                for e, c in enumerate(flat[order].split(counts.tolist()))])
        out = torch.zeros_like(flat).index_copy(0, order, routed) * weight.unsqueeze(-1)
        return self.head(x + out.view_as(x))


def build_moe():
    return MoELM(stacked=True)


def build_moe_list():
    return MoELM(stacked=False)


def _ep(model, ctx, divide=True):
    from titanext.plugins.expert_parallel import apply_expert_parallel

    ep = ctx.mesh["ep"]
    apply_expert_parallel(model, ep, filter_fn=lambda fqn, m: isinstance(m, StackedExperts))
    n = ep.size()

    def sync(p):  # each ep rank fed its own rows: average like data parallelism
        if isinstance(p.grad, DTensor):  # experts: complete where they live, summed over ranks
            p.grad.div_(n)
        else:
            dist.all_reduce(p.grad, group=ep.get_group())
            if divide:
                p.grad.div_(n)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(sync)
    return model


def wire_ep(model, ctx):
    return _ep(model, ctx)


def wire_ep_bug(model, ctx):  # the one-line bug: dense gradients summed, not averaged
    return _ep(model, ctx, divide=False)


# -- issue 44: parallelize's composite mesh dim, an HF model under CP, the failing rank --------

def wire_parallelize_fsdp(model, ctx):
    """parallelize's FSDP: it shards over its own flattened dim ``dp_shard_cp``."""
    from titanext.distributed.parallel_dims import ParallelDims
    from titanext.distributed.parallelize import parallelize

    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2)
    dims.build_mesh("cpu")
    return parallelize(model, dims, blocks="layers")


def build_hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
        tie_word_embeddings=False))


def wire_hf_cp(model, ctx):
    """The adapter and FSDP over cp (averaging the ranks' gradients); the default loss hands
    the model its sharded positions."""
    from titanext.hf.transformers import apply_hf_context_parallel, hf_blocks
    from titanext.plugins.fsdp import apply_fsdp

    apply_hf_context_parallel(model, ctx.cp_mesh)
    return apply_fsdp(model, ctx.cp_mesh, blocks=hf_blocks(model))


def wire_fails_on_rank_1(model, ctx):
    if ctx.rank == 1:
        raise RuntimeError("deliberate failure in wire_fails_on_rank_1")
    return model


# -- the checks --------------------------------------------------------------------------------

def _checks():
    from titanext.parity import ParityCheck

    def c(build, wire, names):
        return ParityCheck(build=build, wiring=wire, world_size=2, mesh_names=names, seq=SEQ)

    return {
        "tp_colwise": c(build_grouped, wire_tp_colwise, ("tp",)),
        "tp_fused_on_grouped": c(build_grouped, wire_tp_fused, ("tp",)),
        "cp_positions": c(build_grouped, wire_cp, ("cp",)),
        "cp_no_positions": c(build_grouped, wire_cp_no_positions, ("cp",)),
        "ep": c(build_moe, wire_ep, ("ep",)),
        "ep_unseen_experts": c(build_moe_list, wire_ep, ("ep",)),
        "ep_one_line_bug": c(build_moe, wire_ep_bug, ("ep",)),
        "parallelize_fsdp": c(build_grouped, wire_parallelize_fsdp, ("dp_shard",)),
        "hf_cp": c(build_hf_llama, wire_hf_cp, ("cp",)),
        # last: a failure on one rank ends the group, and the checks after it would respawn
        "fails_on_rank_1": c(build_grouped, wire_fails_on_rank_1, ("dp",)),
    }


@pytest.fixture(scope="module")
def reports():
    from titanext.parity import check_all

    checks = _checks()
    return dict(zip(checks, check_all(list(checks.values()), timeout_s=120)))


@pytest.mark.parametrize("name", ["tp_colwise", "cp_positions", "ep"])
def test_right_wirings_pass(reports, name):
    report = reports[name]
    assert report.ok, str(report)
    assert report.grad_errors[0][1] < 1e-5 and all(e < 1e-5 for _, _, e in report.losses)


def test_report_says_what_was_applied(reports):
    tp, cp, ep = reports["tp_colwise"], reports["cp_positions"], reports["ep"]
    assert tp.placements["layers.0.attn.qkv.weight"] == {"tp": "Shard(dim=0)"}
    assert tp.placements["layers.1.down.weight"] == {"tp": "Shard(dim=1)"}
    assert "embed.weight" not in tp.placements
    assert cp.comm["cp_sends"] > 0 and cp.comm["ep_all_to_alls"] == 0
    assert ep.comm["ep_all_to_alls"] > 0 and ep.placements["experts.w1"] == {"ep": "Shard(dim=0)"}
    text = str(tp)
    assert "OK: matches one process" in text and "DTensor [tp: Shard(dim=0)]" in text


def test_fused_colwise_on_a_grouped_qkv_is_flagged(reports):
    report = reports["tp_fused_on_grouped"]
    assert not report.ok
    worst, err = report.grad_errors[0]
    assert "attn.qkv" in worst or err > 1e-2, str(report)
    assert any("gradients differ" in p for p in report.problems)


def test_cp_without_global_positions_is_flagged(reports):
    report = reports["cp_no_positions"]
    assert not report.ok and report.grad_errors[0][1] > 1e-3, str(report)
    assert report.losses[0][2] < 1e-2  # the loss alone hardly shows it


def test_ep_on_experts_it_cannot_see_is_flagged(reports):
    report = reports["ep_unseen_experts"]
    assert not report.ok
    assert any("'ep'" in p or "expert" in p.lower() for p in report.problems), report.problems


def test_a_one_line_bug_in_a_wiring_fails_it(reports):
    report = reports["ep_one_line_bug"]
    assert not report.ok and report.grad_errors[0][1] > 0.1, str(report)


def test_parallelize_fsdp_over_dp_shard_cp_counts_as_dp_shard(reports):
    """parallelize shards over the flattened ``dp_shard_cp``: no "no dp_shard parallelism"."""
    report = reports["parallelize_fsdp"]
    assert report.ok, str(report)
    assert any("dp_shard_cp" in pl for pl in report.placements.values()), report.placements


def test_default_loss_runs_an_hf_model_under_cp(reports):
    """The default loss gives a transformers model [rows, local_seq] positions (1-D ones
    crashed in its rotary embedding: "size of tensor a (4) must match ... (8)")."""
    pytest.importorskip("transformers")
    report = reports["hf_cp"]
    assert report.ok, str(report)
    assert report.comm["cp_sends"] + report.comm["cp_collectives"] > 0


def test_the_failing_rank_traceback_is_kept(reports):
    report = reports["fails_on_rank_1"]
    assert not report.ok and "rank 1" in report.error, str(report)
    assert report.traceback.startswith("rank 1:"), report.traceback
    assert "wire_fails_on_rank_1" in report.traceback and "Traceback" in report.traceback


def test_bad_settings_name_each_problem():
    from titanext.parity import ParityCheck, problems_of

    bad = ParityCheck(build=build_grouped, wiring=wire_tp_colwise, world_size=2,
                      mesh_shape=(3,), mesh_names=("cp",), seq=6, tol=0, optimizer="lamb")
    lines = problems_of(bad)
    assert any("product 3 must equal world_size = 2" in x for x in lines)
    assert any(x.startswith("tol = 0") for x in lines)
    assert any("optimizer = 'lamb'" in x for x in lines)


def test_command_line_exit_codes():
    """Exit 0 for the example's right TP wiring (tables printed), 2 on bad arguments with one
    line each and no traceback."""
    example = ROOT / "examples" / "parity_check.py"
    ok = subprocess.run([sys.executable, "-m", "titanext.parity", "--model",
                         f"{example}:build", "--wiring", f"{example}:wire_tp", "--world-size",
                         "2", "--mesh-names", "tp"], capture_output=True, text=True,
                        cwd=ROOT, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr[-3000:]
    assert "OK: matches one process" in ok.stdout and "rel error" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "titanext.parity", "--model", "nomodule:build",
                          "--wiring", f"{example}:wire_tp", "--world-size", "2",
                          "--mesh-shape", "3", "--tol", "-1"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 4 and all(x.startswith("python -m titanext.parity: ") for x in lines)
    assert "--model 'nomodule:build'" in lines[0] and "mesh_shape = (3,)" in lines[1]
    assert "tol = -1.0" in lines[2] and "batch = 4" in lines[3], lines


def test_example_walks_a_library_style_model_through_tp_cp_and_pp():
    """examples/parity_check.py (docs/own_model.md): its right wirings (TP on a grouped qkv, CP
    with ring SDPA and indexed rotary tables, PP over transformer.h) pass and the fused-qkv
    one fails; the script asserts that itself."""
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "parity_check.py")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "pp: two stages of transformer.h, 1F1B: ok" in out.stdout
    assert "FusedColwiseParallel on it (wrong): FAILED" in out.stdout
