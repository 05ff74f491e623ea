"""Muon in one process is torch.optim.Muon (plus torch's AdamW for the other groups), bit for
bit; a 3-D expert weight is one torch.optim.Muon matrix per expert; the owner plan balances
the Newton-Schulz work (titanext.components.muon, muon_plan, param_groups)."""

from __future__ import annotations

import pytest
import torch

from titanext.components.muon import MuonWithAdamW
from titanext.components.muon_plan import Piece, ns_flops, plan_owners
from titanext.components.param_groups import group_problems, param_groups


def _params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"wide": (6, 10), "tall": (12, 5), "norm": (6,), "bias": (12,)}
    return {n: torch.nn.Parameter(torch.randn(*s, generator=g)) for n, s in shapes.items()}


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=g) * 0.3


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_groups_equal_torch_muon_and_adamw(adjust, nesterov):
    ours, ref = _params(), _params()
    muon_kw = dict(lr=0.02, weight_decay=0.05, momentum=0.9, nesterov=nesterov,
                   adjust_lr_fn=adjust)
    opt = MuonWithAdamW([
        {"params": [ours["wide"], ours["tall"]], "optimizer": "Muon", **muon_kw},
        {"params": [ours["norm"], ours["bias"]], "optimizer": "AdamW", "lr": 1e-3,
         "weight_decay": 0.0, "eps": 1e-8, "betas": (0.9, 0.95)}])
    ref_muon = torch.optim.Muon([ref["wide"], ref["tall"]], **muon_kw)
    ref_adamw = torch.optim.AdamW([ref["norm"], ref["bias"]], lr=1e-3, weight_decay=0.0,
                                  eps=1e-8, betas=(0.9, 0.95))
    for step in range(4):
        _grads(ours, step), _grads(ref, step)
        opt.step(), ref_muon.step(), ref_adamw.step()
    for name in ours:
        assert torch.equal(ours[name], ref[name]), name
    assert set(opt.state[ours["wide"]]) == {"momentum_buffer"}  # one buffer, not two


def test_expert_weight_is_one_muon_matrix_per_expert():
    g = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(3, 4, 6, generator=g))
    experts = [torch.nn.Parameter(w.detach()[e].clone()) for e in range(3)]
    opt = MuonWithAdamW([w], lr=0.01)
    ref = torch.optim.Muon(experts, lr=0.01)
    for _ in range(3):
        grad = torch.randn(3, 4, 6, generator=g)
        w.grad = grad
        for e, p in enumerate(experts):
            p.grad = grad[e].clone()
        opt.step(), ref.step()
    assert torch.equal(w.detach(), torch.stack([p.detach() for p in experts]))


def test_muon_refuses_a_vector():
    with pytest.raises(ValueError, match="2-D matrices and 3-D expert weights"):
        b = torch.nn.Parameter(torch.zeros(4))
        b.grad = torch.ones(4)
        MuonWithAdamW([b]).step()


def test_owner_plan_balances_newton_schulz_work():
    # 4 ranks, FSDP-style row shards of 12 matrices of three sizes
    shapes = [(64, 32)] * 4 + [(32, 32)] * 4 + [(96, 32)] * 4
    world = 4
    pieces = [[Piece(f"m{i}", (1, *s), (0, r * s[0] // world, 0), (1, s[0] // world, s[1]))
               for i, s in enumerate(shapes)] for r in range(world)]
    plan = plan_owners(pieces)
    naive = sum(ns_flops(*s) for s in shapes)  # every rank orthogonalizes every matrix
    largest = max(ns_flops(*s) for s in shapes)
    assert max(plan.flops) <= naive / world + largest
    assert sum(plan.flops) == naive  # each matrix once
    assert sorted(m.owner for m in plan.matrices) == sorted([0, 1, 2, 3] * 3)


def test_owner_plan_refuses_pieces_that_do_not_tile():
    pieces = [[Piece("w", (1, 4, 4), (0, 0, 0), (1, 2, 4))],
              [Piece("w", (1, 4, 4), (0, 1, 0), (1, 2, 4))]]  # rows 0-1 and 1-2: row 1 twice
    with pytest.raises(ValueError, match="do not tile"):
        plan_owners(pieces)


SHAPES = {"tok_embeddings.weight": (16, 8), "layers.0.attention.wq.weight": (8, 8),
          "layers.0.attention_norm.weight": (8,), "layers.0.moe.router.gate.weight": (4, 8),
          "layers.0.moe.experts.w1": (4, 8, 8), "norm.weight": (8,), "output.weight": (16, 8)}


def test_shipped_groups():
    groups = {g.weight_decay_from: g for g in param_groups(SHAPES, name="Muon")}
    assert groups["muon"].names == ("layers.0.attention.wq.weight", "layers.0.moe.experts.w1")
    assert groups["none"].names == ("layers.0.attention_norm.weight", "norm.weight")
    assert set(groups["default"].names) == {"tok_embeddings.weight", "output.weight",
                                            "layers.0.moe.router.gate.weight"}
    assert [g.optimizer for g in param_groups(SHAPES, name="AdamW")] == ["AdamW"]


def test_group_rules_give_one_line_each():
    problems = group_problems(SHAPES, name="Muon", muon_params=["layers.*", "nothing.*"],
                              no_decay_params=["*.bias"])
    assert problems == [
        "optimizer.muon_params = 'layers.*' selects 1-D parameters "
        "(layers.0.attention_norm.weight); Muon updates matrices only (2-D, or 3-D expert "
        "weights)",
        "optimizer.muon_params = 'nothing.*' matches no parameter of the model",
        "optimizer.no_decay_params = '*.bias' matches no parameter of the model"]
    assert group_problems(SHAPES, name="Muon", muon_params=["layers.0.attention.*.weight"],
                          no_decay_params=["layers.0.attention.w*"]) == [
        "parameter layers.0.attention.wq.weight is in two groups (optimizer.muon_params and "
        "optimizer.no_decay_params); remove it from one (Muon groups take "
        "optimizer.muon_weight_decay = 0 for no decay)"]


@pytest.mark.parametrize("args, problem", [
    (["--optimizer.muon_params=layers.*", "--optimizer.state_dtype=float32"],
     "optimizer.muon_params = ['layers.*'] is only read with optimizer.name = 'Muon', but "
     "optimizer.name = 'AdamW'; set name = 'Muon' or unset muon_params"),
    (["--optimizer.name=Muon", "--optimizer.state_dtype=bfloat16"],
     "optimizer.state_dtype = 'bfloat16' lowers AdamW / Adam moments; with optimizer.name = "
     "'Muon' only 'float32' is allowed"),
    (["--optimizer.name=Muon", "--optimizer.muon_split_params=wq = 8"],
     "optimizer.muon_split_params = ['wq = 8'] is not allowed; allowed: 'GLOB = SIZES' or "
     "'GLOB = cols SIZES' with two or more sizes > 0 joined by + ('wq = 8' is not)"),
    (["--optimizer.muon_split_params=wq = 4+4"],
     "optimizer.muon_split_params = ['wq = 4+4'] is only read with optimizer.name = 'Muon', "
     "but optimizer.name = 'AdamW'; set name = 'Muon' or unset muon_split_params"),
], ids=["muon_params_without_muon", "bf16_moments_with_muon", "split_syntax",
        "split_without_muon"])
def test_config_rules_for_the_optimizer_keys(args, problem):
    """Keys read only with Muon, bf16 moments with Muon (which keeps no Adam moments for its
    matrices) and the split syntax are config errors at load, one line each."""
    from titanext.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert e.value.problems == [problem]


def test_split_fused_matrices_equal_torch_muon_on_the_logical_matrices():
    """A fused [q; k; v] (rows), a Conv1D-style [in, q | k | v] (columns) and a stacked
    [gate; up] expert weight, each orthogonalized per logical matrix, equal torch.optim.Muon on
    the separate matrices bit for bit (momentum and weight decay are elementwise; Newton-Schulz
    and the per-shape learning rate are per logical matrix)."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.nn.Parameter(torch.randn(16, 6, generator=g))         # [q 8; k 4; v 4] x 6
    conv = torch.nn.Parameter(torch.randn(6, 12, generator=g))        # 6 x [q 6 | k 3 | v 3]
    gate_up = torch.nn.Parameter(torch.randn(2, 10, 6, generator=g))  # 2 experts, [gate 5; up 5]
    splits = {"qkv": (0, (8, 4, 4)), "conv": (1, (6, 3, 3)), "gate_up": (0, (5, 5))}
    kw = dict(lr=0.02, weight_decay=0.05, momentum=0.9, adjust_lr_fn="original")
    opt = MuonWithAdamW([qkv, conv, gate_up], splits=splits, **kw,
                        param_names={id(qkv): "qkv", id(conv): "conv", id(gate_up): "gate_up"})
    parts = {"qkv": lambda t: t.split([8, 4, 4], 0), "conv": lambda t: t.split([6, 3, 3], 1),
             "gate_up": lambda t: [h for e in t for h in e.split([5, 5], 0)]}
    fused = {"qkv": qkv, "conv": conv, "gate_up": gate_up}
    ref = {n: [torch.nn.Parameter(x.detach().clone()) for x in parts[n](p)]
           for n, p in fused.items()}
    ref_opt = torch.optim.Muon([x for xs in ref.values() for x in xs], **kw)
    whole = {n: p.detach().clone() for n, p in fused.items()}  # the same steps orthogonalized whole
    whole_params = {n: torch.nn.Parameter(t) for n, t in whole.items()}
    whole_opt = MuonWithAdamW(list(whole_params.values()), **kw)
    for _ in range(3):
        for n, p in fused.items():
            p.grad = torch.randn(p.shape, generator=g)
            whole_params[n].grad = p.grad.clone()
            for x, gx in zip(ref[n], parts[n](p.grad)):
                x.grad = gx.contiguous()
        opt.step(), ref_opt.step(), whole_opt.step()
    for n, p in fused.items():
        assert torch.equal(torch.cat([x.detach().reshape(-1) for x in ref[n]]),
                           torch.cat([x.reshape(-1) for x in parts[n](p.detach())])), n
        assert not torch.allclose(p, whole_params[n], atol=1e-3), n  # the split matters


def test_owner_plan_counts_a_split_matrix_per_logical_matrix():
    pieces = [[Piece("qkv", (1, 16, 8), (0, 8 * r, 0), (1, 8, 8))] for r in range(2)]
    plan = plan_owners(pieces, splits={"qkv": (0, (8, 4, 4))})
    assert plan.matrices[0].split == (0, (8, 4, 4))
    assert sum(plan.flops) == ns_flops(8, 8) + 2 * ns_flops(4, 8)


def test_split_rules_give_one_line_each():
    shapes = {**SHAPES, "layers.0.attention.wqkv.weight": (16, 8)}
    ok = ["layers.*.wqkv.weight = 8+4+4", "*.experts.w1 = cols 6+2"]
    assert group_problems(shapes, name="Muon", muon_split_params=ok) == []
    from titanext.components.param_groups import muon_splits
    assert muon_splits(shapes, ok) == {"layers.0.attention.wqkv.weight": (0, (8, 4, 4)),
                                       "layers.0.moe.experts.w1": (1, (6, 2))}
    bad = ["layers.*.wqkv.weight = 8+4+2", "*.nothing = 2+2", "output.weight = 8+8"]
    assert group_problems(shapes, name="Muon", muon_split_params=bad) == [
        "optimizer.muon_split_params entry 'layers.*.wqkv.weight = 8+4+2': sizes 8+4+2 = 14 do "
        "not tile the 16 rows of layers.0.attention.wqkv.weight (shape (16, 8)); they must add "
        "up to 16",
        "optimizer.muon_split_params entry '*.nothing = 2+2' matches no parameter of the model",
        "optimizer.muon_split_params entry 'output.weight = 8+8' selects output.weight, which "
        "Muon does not update (not in optimizer.muon_params); split only Muon matrices"]


def test_split_entries_load():
    from titanext.config import load_config

    cfg = load_config(None, ["--optimizer.name=Muon",
                             "--optimizer.muon_split_params=a = 4+4,b = cols 2+2"])
    assert cfg.optimizer.muon_split_params == ["a = 4+4", "b = cols 2+2"]
