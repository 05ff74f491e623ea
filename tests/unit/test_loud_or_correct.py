"""Loud or correct, in one process: float8 and deferral on nn.Linear subclasses (issue 24 cases 1
and 2), TP plan checks before sharding (case 4), FusedColwiseParallel's checks and expert-layout
detection (case 3). The gloo cases are in tests/multiprocess/test_loud_or_correct.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

from tests.own_models import (
    HalfLinear,
    LlamaLikeModel,
    MoEModel,
    MyLinear,
    NoExpertsMoE,
    SubclassMLP,
)
from titanext.plugins.expert_parallel import (
    ModuleListExperts,
    StackedExperts,
    call_experts,
    detect_experts_layout,
)
from titanext.plugins.float8 import apply_float8
from titanext.plugins.tensor_parallel import (
    FusedColwiseParallel,
    default_plan_problems,
    tp_plan_matches,
)
from titanext.plugins.weight_grad import (
    DeferredLinear,
    WeightGradQueue,
    defer_weight_grads,
    weight_grad_deferral,
)


def _plain_copy(model: nn.Module) -> nn.Module:
    """The same model with every MyLinear as a plain nn.Linear (same weights)."""
    plain = copy.deepcopy(model)
    for m in plain.modules():
        if type(m) is MyLinear:
            m.__class__ = nn.Linear
    return plain


def test_float8_converts_linear_subclasses_that_keep_forward(caplog):
    """Case 1: a library's Linear(nn.Linear) converts, exactly as nn.Linear would; the subclass
    with its own forward is named in one WARNING line and kept."""
    torch.manual_seed(0)
    model = SubclassMLP()
    plain = _plain_copy(model)
    with caplog.at_level(logging.WARNING, logger="titanext"):
        got = apply_float8(model, emulate=True)
    lines = [r.getMessage() for r in caplog.records if "override forward" in r.getMessage()]
    assert len(lines) == 1 and "gate (HalfLinear)" in lines[0], lines
    assert got == ["up", "down"] and apply_float8(plain, emulate=True) == ["up", "down"]
    assert type(model.gate) is HalfLinear
    x = torch.randn(4, 32)
    assert torch.equal(model(x), plain(x))


def test_float8_on_own_forward_linears_only_raises_or_is_included_by_the_filter():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"no matmul of SubclassMLP converts.*gate \(overrides"):
        apply_float8(SubclassMLP(own_forward_only=True), emulate=True)
    with pytest.raises(ValueError, match="no matmul module at all"):
        apply_float8(nn.Sequential(nn.ReLU()), emulate=True)
    model = SubclassMLP(own_forward_only=True)
    got = apply_float8(model, emulate=True, module_filter_fn=lambda m, fqn: fqn != "gate")
    assert got == ["up", "down"] and type(model.gate) is HalfLinear


def test_deferral_converts_linear_subclasses_and_matches_autograd(caplog):
    """Case 2: deferral converts MyLinear (isinstance kept), the gradients equal autograd's."""
    torch.manual_seed(0)
    model = SubclassMLP()
    ref = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="titanext"):
        assert defer_weight_grads(model) == ["up", "down"]
    assert isinstance(model.up, MyLinear) and isinstance(model.up, DeferredLinear)
    assert any("gate (HalfLinear)" in r.getMessage() for r in caplog.records)
    assert defer_weight_grads(model) == []  # idempotent, no error
    x = torch.randn(6, 32)
    ref(x).square().sum().backward()
    queue = WeightGradQueue()
    with weight_grad_deferral(queue):
        model(x).square().sum().backward()
    assert len(queue) == 2 and model.up.weight.grad is None
    queue.run()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_deferral_that_converts_nothing_raises():
    with pytest.raises(ValueError, match="defer_weight_grads: nothing of SubclassMLP converts"):
        defer_weight_grads(SubclassMLP(own_forward_only=True))
    assert defer_weight_grads(SubclassMLP(own_forward_only=True),
                              module_filter_fn=lambda m, fqn: True) == ["up", "down", "gate"]


def test_default_tp_plan_rejects_a_model_of_another_layout_before_sharding():
    """Case 4: the checks run before anything is sharded (no process group needed)."""
    problems = default_plan_problems(LlamaLikeModel())
    assert "no blocks at layers.*" in problems[0]
    assert "model.layers.0.self_attn.q_proj (Linear) is named by no rule" in problems
    rows = tp_plan_matches(LlamaLikeModel(), {"model.layers.*.self_attn.q_proj": ColwiseParallel(),
                                              "layers.*.attention.wq": ColwiseParallel()})
    assert [(r["rule"], r["modules"]) for r in rows] == [
        ("model.layers.*.self_attn.q_proj", 2), ("layers.*.attention.wq", 0)]
    assert rows[0]["matched"] == "model.layers.0.self_attn.q_proj, model.layers.1.self_attn.q_proj"


@pytest.mark.parametrize("sizes,match", [((8, 8, 8), "add up to 24, but the weight has 32 rows"),
                                         ((16, 8, 7), r"parts \[7\] are not divisible by tp = 2")])
def test_fused_colwise_names_what_it_can_check(sizes, match):
    from unittest import mock

    mesh = mock.Mock()
    mesh.size.return_value = 2
    with pytest.raises(ValueError, match=match) as e:
        FusedColwiseParallel(split_sizes=sizes)._apply(nn.Linear(4, 32 if sizes[2] == 8 else 31),
                                                      mesh)
    assert "grouped per KV head" in str(e.value)


def test_expert_layouts_are_detected_and_unknown_ones_named():
    for layout, want in (("module_list", ModuleListExperts), ("stacked_out_in", StackedExperts),
                         ("fused_in_out", StackedExperts)):
        experts = MoEModel(layout).layers[0].experts
        assert isinstance(detect_experts_layout("layers.0.experts", experts), want)
    fused = detect_experts_layout("e", MoEModel("fused_in_out").layers[0].experts)
    assert (fused.gate, fused.up, fused.transposed) == ("gate_up_proj", None, True)
    assert detect_experts_layout("layers.0.experts", NoExpertsMoE().layers[0].experts) is None


@pytest.mark.parametrize("layout", ["module_list", "stacked_out_in", "stacked_in_out",
                                    "fused_out_in", "fused_in_out"])
def test_adapters_compute_what_the_experts_compute(layout):
    """Each layout's adapter on the unsplit weights == the module's own forward (one process)."""
    torch.manual_seed(0)
    experts = MoEModel(layout).layers[0].experts
    adapter = detect_experts_layout("experts", experts)
    w = adapter.weights(experts)
    x, idx = torch.randn(9, 16), torch.randint(0, 4, (9, 2))
    weights = torch.rand(9, 2)
    want = call_experts(experts, x, idx, weights)
    got = torch.zeros_like(x)
    for t in range(9):
        for j in range(2):
            one = {n: v[idx[t, j]] for n, v in w.items()}
            got[t] += weights[t, j] * adapter.expert(one, x[t:t + 1])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
