"""Optimizer construction, the LR schedule, and gradient-norm clipping (single process)."""

from __future__ import annotations

import copy
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


# -- [optimizer] state_dtype -------------------------------------------------------------------
def _steps(opt, params, n=5):
    torch.manual_seed(3)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_float32_state_through_the_low_precision_path_is_torch_bit_for_bit(name):
    from titanext.components.lowp_adam import LowPrecisionStateAdam

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(5))]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    ref = getattr(torch.optim, name)(a, lr=0.05, weight_decay=0.1, foreach=False)
    ours = LowPrecisionStateAdam(b, lr=0.05, weight_decay=0.1, state_dtype=torch.float32,
                                 decoupled_weight_decay=name == "AdamW")
    _steps(ref, a)
    _steps(ours, b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref.state[x][k], ours.state[y][k])


def test_bfloat16_state_is_adamw_with_moments_rounded_to_bf16_each_step():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(7, 3))
    start = p.detach().clone()
    opt = build_optimizer([p], lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1,
                          state_dtype="bfloat16")
    _steps(opt, [p])
    # The reference, written out: AdamW in fp64 whose step uses this step's moments and stores
    # them rounded to bf16 for the next.
    torch.manual_seed(3)
    w, m, v = start.double(), torch.zeros_like(start), torch.zeros_like(start)
    for t in range(1, 6):
        g = torch.randn_like(start).double()
        w = w * (1 - 0.05 * 0.1)
        m = 0.8 * m.double() + 0.2 * g
        v = 0.9 * v.double() + 0.1 * g * g
        w = w - 0.05 * (m / (1 - 0.8 ** t)) / ((v / (1 - 0.9 ** t)).sqrt() + 1e-6)
        m, v = m.bfloat16(), v.bfloat16()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16 and p.dtype == torch.float32
    torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=1e-6)
    # fp32 and fp64 moments may round to neighbouring bf16 values: one bf16 ulp at most
    torch.testing.assert_close(opt.state[p]["exp_avg"], m, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], v, rtol=2 ** -7, atol=0)


def test_bfloat16_state_survives_a_state_dict_round_trip_bitwise():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = build_optimizer([p], lr=0.05, state_dtype="bfloat16")
    _steps(opt, [p], n=2)
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = build_optimizer([q], lr=0.05, state_dtype="bfloat16")
    # as read from a file (torch would share the step tensors); torch casts the moments to fp32
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt2.state[q]["exp_avg"].dtype == torch.bfloat16
    _steps(opt, [p], n=2)
    _steps(opt2, [q], n=2)
    assert torch.equal(p, q)


def test_bad_state_dtype_is_an_error():
    with pytest.raises(ValueError, match="state_dtype = 'float16'; allowed: float32, bfloat16"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], state_dtype="float16")
