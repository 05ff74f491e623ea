"""Optimizer construction, the LR schedule, and gradient-norm clipping (single process)."""

from __future__ import annotations

import math

import pytest
import torch

from titanext.components.optim import build_lr_scheduler, build_optimizer, lr_lambda
from titanext.distributed.grad_clip import clip_grad_norm_


def factors(total, **kw):
    kw = {"warmup_steps": 0, "decay_ratio": None, "decay_type": "linear", "min_lr_factor": 0.0,
          **kw}
    return [lr_lambda(s, total_steps=total, **kw) for s in range(total)]


def test_warmup_reaches_the_peak_on_its_last_step():
    f = factors(10, warmup_steps=4)
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]


def test_linear_decay_after_warmup_towards_min():
    f = factors(10, warmup_steps=2, min_lr_factor=0.1)
    assert f[2] == 1.0
    assert all(a > b for a, b in zip(f[2:], f[3:]))
    assert f[-1] == pytest.approx(0.1 + 0.9 * (1 / 8))


def test_warmup_stable_decay():
    f = factors(10, warmup_steps=2, decay_ratio=0.4)
    assert f[2:6] == [1.0] * 4  # stable phase
    assert f[6] == 1.0 and f[7] < 1.0


@pytest.mark.parametrize("kind", ["linear", "sqrt", "cosine"])
def test_decay_shapes_are_monotone_and_bounded(kind):
    f = factors(20, warmup_steps=3, decay_type=kind, min_lr_factor=0.2)
    tail = f[3:]
    assert all(a >= b for a, b in zip(tail, tail[1:])) and min(tail) >= 0.2


def test_cosine_midpoint():
    f = factors(11, decay_type="cosine")
    assert f[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 11)))


def test_scheduler_drives_the_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([p], lr=1.0)
    sched = build_lr_scheduler(opt, warmup_steps=2, total_steps=4)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == [0.5, 1.0, 1.0, 0.5]


def test_bad_names_are_errors():
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="optimizer.name = 'SGD'"):
        build_optimizer(p, name="SGD")
    with pytest.raises(ValueError, match="implementation = 'fast'"):
        build_optimizer(p, implementation="fast")


def test_clip_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    for x, y in zip(a, b):
        x.grad = torch.randn_like(x) * 3
        y.grad = x.grad.clone()
    ours = clip_grad_norm_(a, 1.0)
    ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    torch.testing.assert_close(ours, ref)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad)


def test_clip_with_zero_max_norm_only_measures():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 2.0)
    assert clip_grad_norm_([p], 0.0).item() == pytest.approx(4.0)
    assert torch.equal(p.grad, torch.full((4,), 2.0))


def test_inf_norm():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, -5.0, 2.0])
    assert clip_grad_norm_([p], 1.0, norm_type=math.inf).item() == 5.0
