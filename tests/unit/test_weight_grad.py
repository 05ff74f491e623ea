"""Deferred weight gradients give exactly the gradients autograd gives nn.Linear.

Each test builds the converted module and a plain twin with the same weights, runs the twin
with plain autograd, and the converted one with I (backward inside a deferral context) and W
(the queue run afterwards). fp32 throughout; 1e-6. Under TP, FSDP2 and EP on 2 gloo ranks, and
through the trainer: tests/multiprocess/test_weight_grad.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from titanext.models.moe import GroupedExperts
from titanext.plugins.weight_grad import (
    DeferredLinear,
    WeightGradQueue,
    defer_weight_grads,
    weight_grad_deferral,
)

TOL = dict(rtol=1e-6, atol=1e-6)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_same_grads(got: nn.Module, want: nn.Module) -> None:
    g, w = _grads(got), _grads(want)
    assert g.keys() == w.keys()
    for name in w:
        torch.testing.assert_close(g[name], w[name], **TOL, msg=name)


def _deferred_step(model: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> WeightGradQueue:
    queue = WeightGradQueue()
    with weight_grad_deferral(queue):
        model(x).backward(dy)
    return queue


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_deferred_linear_matches_nn_linear(bias, input_requires_grad):
    torch.manual_seed(0)
    ref = nn.Linear(16, 24, bias=bias)
    model = copy.deepcopy(ref)
    assert defer_weight_grads(model) == [""]
    x = torch.randn(3, 5, 16, requires_grad=input_requires_grad)
    x2 = x.detach().clone().requires_grad_(input_requires_grad)
    dy = torch.randn(3, 5, 24)
    ref(x).backward(dy)
    queue = _deferred_step(model, x2, dy)
    # I: the input and bias gradients now, the weight gradient queued
    assert model.weight.grad is None and len(queue) == 1
    if bias:
        torch.testing.assert_close(model.bias.grad, ref.bias.grad, **TOL)
    if input_requires_grad:
        torch.testing.assert_close(x2.grad, x.grad, **TOL)
    queue.run()  # W
    assert len(queue) == 0
    _assert_same_grads(model, ref)


def test_outside_the_context_it_is_nn_linear_bitwise():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8, bias=False))
    model = copy.deepcopy(ref)
    names = [n for n, _ in model.named_parameters()]
    assert defer_weight_grads(model) == ["0", "2"]
    assert all(isinstance(m, nn.Linear) for m in (model[0], model[2]))
    assert [n for n, _ in model.named_parameters()] == names
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    x = torch.randn(4, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, ref_out = model(x2), ref(x)
    assert torch.equal(out, ref_out)
    out.sum().backward()
    ref_out.sum().backward()
    assert torch.equal(x2.grad, x.grad)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def test_filter_and_subclasses_stay_unconverted():
    from titanext.models.moe import RouterGate

    model = nn.ModuleDict({"keep": nn.Linear(4, 4), "skip": nn.Linear(4, 4),
                           "gate": RouterGate(4, 2, bias=False)})
    got = defer_weight_grads(model, module_filter_fn=lambda m, fqn: fqn != "skip")
    assert got == ["keep"]
    assert type(model["skip"]) is nn.Linear and type(model["gate"]) is RouterGate
    assert defer_weight_grads(model, module_filter_fn=lambda m, fqn: fqn != "skip") == []


def test_queue_accumulates_like_autograd():
    """Two micro-batches, a gradient already present: first write creates, later ones add."""
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    model = copy.deepcopy(ref)
    defer_weight_grads(model)
    xs, dys = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    for x, dy in zip(xs, dys, strict=True):
        ref(x).backward(dy)
    queues = [_deferred_step(model, x, dy) for x, dy in zip(xs, dys, strict=True)]
    assert model.weight.grad is None
    for q in queues:
        q.run()
    _assert_same_grads(model, ref)


def test_no_queue_computes_the_weight_grad_inside_autograd():
    torch.manual_seed(0)
    ref = nn.Linear(8, 4)
    model = copy.deepcopy(ref)
    defer_weight_grads(model)
    x, dy = torch.randn(6, 8), torch.randn(6, 4)
    ref(x).backward(dy)
    with weight_grad_deferral():
        model(x).backward(dy)
    _assert_same_grads(model, ref)


def test_take_hands_over_one_microbatch():
    model = nn.Linear(4, 4)
    defer_weight_grads(model)
    queue = _deferred_step(model, torch.randn(2, 4), torch.randn(2, 4))
    runner = queue.take()
    assert len(queue) == 0 and len(runner) == 1
    runner()
    assert len(runner) == 0 and model.weight.grad is not None


class _Block(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


@pytest.mark.parametrize("mode,option", [("full", "op"), ("selective", "op"),
                                         ("selective", "2")])
def test_activation_checkpointing(mode, option):
    """Recomputation happens during I, inside the context; the queue keeps only X and dY."""
    from titanext.plugins.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(0)
    ref = nn.Sequential(_Block(), _Block())
    model = copy.deepcopy(ref)
    defer_weight_grads(model)
    blocks = list(model)
    apply_activation_checkpointing(model, mode=mode, option=option, blocks=blocks)
    x, dy = torch.randn(2, 6, 16, requires_grad=True), torch.randn(2, 6, 16)
    x2 = x.detach().clone().requires_grad_()
    ref(x).backward(dy)
    queue = WeightGradQueue()
    with weight_grad_deferral(queue):
        out = model(x2)
        calls = [b.calls for b in blocks]
        out.backward(dy)
    recomputed = [b.calls - c for b, c in zip(blocks, calls, strict=True)]
    assert sum(recomputed) >= 1, "nothing was recomputed during I"
    assert len(queue) == 4 and len(queue.tensors()) == 8  # (X, dY) per linear
    torch.testing.assert_close(x2.grad, x.grad, **TOL)
    queue.run()
    _assert_same_grads(model, ref)


@pytest.mark.parametrize("grouped_mm", [True, False])
def test_grouped_experts(grouped_mm):
    torch.manual_seed(0)
    ref = GroupedExperts(4, 8, 12, use_grouped_mm=grouped_mm)
    for w in (ref.w1, ref.w2, ref.w3):
        nn.init.normal_(w, std=0.2)
    model = copy.deepcopy(ref)
    assert defer_weight_grads(model) == [""]
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(10, 8)
    ref(x, counts).backward(dy)
    queue = WeightGradQueue()
    with weight_grad_deferral(queue):
        model(x2, counts).backward(dy)
    assert len(queue) == 3 and model.w1.grad is None
    torch.testing.assert_close(x2.grad, x.grad, **TOL)
    queue.run()
    _assert_same_grads(model, ref)
    with torch.no_grad():  # outside the context: GroupedExperts' own forward
        assert torch.equal(model(x, counts), ref(x, counts))


def test_converted_class_is_a_linear():
    assert issubclass(DeferredLinear, nn.Linear)
