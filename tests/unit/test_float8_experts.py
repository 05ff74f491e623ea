"""Float8 routed experts (titanext.plugins.float8_experts), emulated on CPU.

- output, dx and each dW stay within float8 error of the fp32 experts: SQNR >= 17 dB (torchao's
  threshold for weight gradients; measured ~28 dB for both recipes);
- a row's result and an expert's dW depend only on that expert's rows (what makes expert
  parallelism match one process): the experts split in two halves give the same numbers;
- deferred weight gradients (the zero-bubble W step) give the float8 recipe's dW, not fp32's;
- the emulated path compiles (fullgraph=False) and the model without experts is refused.
Through the trainer under EP x FSDP: tests/multiprocess/test_float8_experts.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from titanext._compat import inductor_cache_options
from titanext.models.moe import GroupedExperts
from titanext.plugins.float8_experts import FLOAT8_EXPERT_RECIPES, apply_float8_experts
from titanext.plugins.weight_grad import (
    WeightGradQueue,
    defer_weight_grads,
    weight_grad_deferral,
)

COUNTS = torch.tensor([70, 0, 200, 30])  # an empty expert, groups not multiples of 16 or 128


def _experts(dim: int = 256, hidden: int = 384, seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    experts = GroupedExperts(len(COUNTS), dim, hidden)
    for w in experts.parameters():
        nn.init.normal_(w, std=0.02)
    return experts


def _run(experts: nn.Module, x: torch.Tensor, dy: torch.Tensor, counts=COUNTS):
    x = x.detach().clone().requires_grad_()
    y = experts(x, counts)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in experts.named_parameters()}


def _sqnr(got: torch.Tensor, want: torch.Tensor) -> float:
    return (20 * torch.log10(want.norm() / (got - want).norm())).item()


@pytest.mark.parametrize("recipe", FLOAT8_EXPERT_RECIPES)
def test_sqnr_against_fp32_experts(recipe):
    ref = _experts()
    f8 = copy.deepcopy(ref)
    assert apply_float8_experts(f8, recipe=recipe, emulate=True) == [""]
    x, dy = torch.randn(int(COUNTS.sum()), 256), torch.randn(int(COUNTS.sum()), 256)
    y_ref, dx_ref, dw_ref = _run(ref, x, dy)
    y, dx, dw = _run(f8, x, dy)
    assert not torch.equal(y, y_ref)  # float8 did something
    assert _sqnr(y, y_ref) >= 17, _sqnr(y, y_ref)
    assert _sqnr(dx, dx_ref) >= 17, _sqnr(dx, dx_ref)
    for name in dw_ref:
        assert _sqnr(dw[name], dw_ref[name]) >= 17, (name, _sqnr(dw[name], dw_ref[name]))


@pytest.mark.parametrize("recipe", FLOAT8_EXPERT_RECIPES)
def test_scales_stay_inside_one_experts_rows(recipe):
    """Experts 0-1 and 2-3 run apart (as two ep ranks hold them) give every row's output and
    every dW of the whole module: no scale spans two experts."""
    whole = _experts()
    apply_float8_experts(whole, recipe=recipe, emulate=True)
    x, dy = torch.randn(int(COUNTS.sum()), 256), torch.randn(int(COUNTS.sum()), 256)
    y, dx, dw = _run(whole, x, dy)
    cut = int(COUNTS[:2].sum())
    for lo, hi, rows in ((0, 2, slice(0, cut)), (2, 4, slice(cut, None))):
        half = GroupedExperts(2, 256, 384)
        with torch.no_grad():
            for name, p in half.named_parameters():
                p.copy_(getattr(whole, name)[lo:hi])
        apply_float8_experts(half, recipe=recipe, emulate=True)
        y_h, dx_h, dw_h = _run(half, x[rows], dy[rows], COUNTS[lo:hi])
        torch.testing.assert_close(y_h, y[rows], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(dx_h, dx[rows], rtol=1e-6, atol=1e-7)
        for name in dw_h:
            torch.testing.assert_close(dw_h[name], dw[name][lo:hi], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("recipe", FLOAT8_EXPERT_RECIPES)
def test_deferred_weight_grads_use_the_recipe(recipe):
    ref = _experts(64, 96)
    apply_float8_experts(ref, recipe=recipe, emulate=True)
    deferred = copy.deepcopy(ref)
    assert defer_weight_grads(deferred) == [""]
    fp32 = _experts(64, 96)
    x, dy = torch.randn(int(COUNTS.sum()), 64), torch.randn(int(COUNTS.sum()), 64)
    _, dx_ref, dw_ref = _run(ref, x, dy)
    queue = WeightGradQueue()
    with weight_grad_deferral(queue):
        _, dx, _ = _run(deferred, x, dy)
    assert len(queue) == 3 and deferred.w1.grad is None
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-7)
    queue.run()
    _, _, dw_fp32 = _run(fp32, x, dy)
    for name, p in deferred.named_parameters():
        torch.testing.assert_close(p.grad, dw_ref[name], rtol=1e-6, atol=1e-7)
        assert not torch.allclose(p.grad, dw_fp32[name], rtol=1e-3, atol=0)  # float8's dW


def test_experts_on_kernels_keep_their_own_backward():
    """torchao's kernels compute an expert's dx and dW in one autograd function, so
    defer_weight_grads leaves those experts unconverted (as torchao's Float8Linear): their dW
    comes at I, and nothing of theirs waits for W. Before 2026-11-29 they were converted and
    the deferred path ran the recipe's halves emulated in fp32, on the GPU too. The emulated
    experts still defer. On the CPU the kernels' stand-in (own_backward, emulated math) gives
    the non-deferred gradients bitwise."""
    from titanext.plugins.float8_experts import Float8GroupedMM

    ref = _experts(64, 96)
    ref.float8_grouped_mm = Float8GroupedMM("rowwise", emulate=True, own_backward=True)
    kept = copy.deepcopy(ref)
    assert defer_weight_grads(kept) == [] and type(kept) is GroupedExperts
    x, dy = torch.randn(int(COUNTS.sum()), 64), torch.randn(int(COUNTS.sum()), 64)
    _, dx_ref, dw_ref = _run(ref, x, dy)
    queue = WeightGradQueue()
    with weight_grad_deferral(queue):
        _, dx, dw = _run(kept, x, dy)
    assert len(queue) == 0
    assert torch.equal(dx, dx_ref) and all(torch.equal(dw[n], dw_ref[n]) for n in dw_ref)
    emulated = _experts(64, 96)
    apply_float8_experts(emulated, recipe="rowwise", emulate=True)
    assert not emulated.float8_grouped_mm.own_backward and defer_weight_grads(emulated) == [""]


def test_a_dry_run_plans_the_kernels_structure():
    """``target_kernels`` (the trainer's dry run): rowwise experts that are not forced to
    emulate keep their own backward, as on a float8 GPU; forced emulation and blockwise (no
    kernel anywhere) do not; emulate = false is accepted for the target."""
    def mm(**kw):
        experts = _experts(32, 32)
        apply_float8_experts(experts, **kw)
        return experts.float8_grouped_mm

    assert mm(recipe="rowwise", emulate="auto", target_kernels=True).own_backward
    assert mm(recipe="rowwise", emulate=False, target_kernels=True).own_backward
    assert mm(recipe="rowwise", emulate="auto", target_kernels=True).emulate  # math on a CPU
    assert not mm(recipe="rowwise", emulate=True, target_kernels=True).own_backward
    assert not mm(recipe="blockwise", emulate="auto", target_kernels=True).own_backward
    assert not mm(recipe="rowwise", emulate="auto").own_backward  # this CPU: emulated, deferred


def test_emulated_experts_compile():
    """The emulation runs eagerly inside a compiled block (a graph break), so the recipe
    compiles such blocks with fullgraph=False (has_emulated_float8_experts)."""
    from titanext.models.moe import MoE, MoEArgs
    from titanext.plugins.float8_experts import has_emulated_float8_experts

    torch.manual_seed(0)
    moe = MoE(dim=32, args=MoEArgs(num_experts=4, top_k=2, hidden_dim=48))
    for p in moe.parameters():
        nn.init.normal_(p, std=0.05)
    assert not has_emulated_float8_experts(moe)
    apply_float8_experts(moe, recipe="rowwise", emulate=True)
    assert has_emulated_float8_experts(moe)
    x = torch.randn(2, 8, 32)
    eager = moe(x)
    compiled = torch.compile(moe, fullgraph=False, options=inductor_cache_options("inductor"))
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    assert moe.experts.w1.grad is not None


def test_refusals():
    with pytest.raises(ValueError, match="has no GroupedExperts"):
        apply_float8_experts(nn.Sequential(nn.Linear(16, 16)))
    with pytest.raises(ValueError, match="emulate = false"):
        apply_float8_experts(_experts(32, 32), recipe="blockwise", emulate=False)
    with pytest.raises(ValueError, match="allowed: rowwise, blockwise"):
        apply_float8_experts(_experts(32, 32), recipe="tensorwise")


@pytest.mark.parametrize("args, needle", [
    (["--model.flavor=debugmodel", "--float8.moe_experts=true"], "needs a MoE model"),
    (["--model.flavor=debugmoe", "--float8.moe_experts=true",
      "--float8.moe_experts_recipe=blockwise", "--float8.emulate=false"], "always runs emulated"),
    (["--model.flavor=debugmoe", "--float8.moe_experts_recipe=tensorwise"],
     "'rowwise', 'blockwise'"),
])
def test_config_refuses_meaningless_combinations(args, needle):
    from titanext.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert len(e.value.problems) == 1 and needle in e.value.problems[0], e.value.problems


@pytest.mark.parametrize("recipe", FLOAT8_EXPERT_RECIPES)
def test_dry_run_fake_tensors(recipe):
    """The dry run ([comm] mode = "fake_backend") runs the experts on fake tensors, whose
    grouped-GEMM meta function takes bf16 only."""
    from titanext._fake_backend import fake_tensor_mode
    from titanext.plugins.float8_experts import Float8GroupedMM

    with fake_tensor_mode():
        x = torch.randn(10, 64, requires_grad=True)
        w = torch.randn(4, 96, 64, requires_grad=True)
        offs = torch.tensor([3, 3, 8, 10], dtype=torch.int32)
        y = Float8GroupedMM(recipe, emulate=True)(x, w, offs)
        y.sum().backward()
        assert y.shape == (10, 96) and w.grad.shape == w.shape and x.grad.shape == x.shape


def test_dry_run_stand_in_for_the_kernels_saves_what_torchao_saves():
    """On fake tensors, experts that keep the kernels' structure run the kernels' stand-in:
    like torchao's function it saves the padded bf16 input and the weight (no fp32 copy of the
    rows, as the emulation's autograd function makes), and gives dx and dW their shapes."""
    from titanext._fake_backend import fake_tensor_mode
    from titanext.plugins.float8_experts import Float8GroupedMM

    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with fake_tensor_mode():
        x = torch.randn(10, 64, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(4, 96, 64, dtype=torch.bfloat16, requires_grad=True)
        offs = torch.tensor([3, 3, 8, 10], dtype=torch.int32)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = Float8GroupedMM("rowwise", emulate=True, own_backward=True)(x, w, offs)
        y.float().sum().backward()
        assert y.shape == (10, 96) and w.grad.shape == w.shape and x.grad.shape == x.shape
    assert ((80, 64), torch.bfloat16) in saved, saved  # the padded input: 16-row groups
    assert not [s for s in saved if s[1] == torch.float32], saved


@pytest.mark.parametrize("counts", [[70, 0, 200, 30], [1000, 0, 3001, 1191], [16, 32, 0, 48]])
def test_kernel_path_pads_each_expert_and_the_whole_to_16_rows(monkeypatch, counts):
    """The kernel path (CUDA only) pads each expert's rows to 16 and the whole buffer to a
    multiple of 16 rows: torchao's weight-gradient GEMM reads the row count as a stride of 16
    bytes' multiples (an H200 run with 5,192 rows failed there). A stand-in for torchao's
    kernel checks both and computes a plain grouped GEMM; the rows come back in order."""
    import sys
    import types

    from titanext.plugins import float8_experts as f8e

    def fake(xp, w_t, ends, out_dtype, pad_token_groups_for_grouped_mm):
        assert xp.shape[0] % 16 == 0, xp.shape
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        assert bool(((ends - starts) % 16 == 0).all()) and int(ends[-1]) <= xp.shape[0]
        out = xp.new_zeros(xp.shape[0], w_t.shape[-1])
        for e, (s, t) in enumerate(zip(starts.tolist(), ends.tolist())):
            out[s:t] = xp[s:t] @ w_t[e]
        return out.to(out_dtype)

    mod = types.ModuleType("torchao.prototype.moe_training")
    mod._to_fp8_rowwise_then_scaled_grouped_mm = fake
    monkeypatch.setitem(sys.modules, "torchao.prototype.moe_training", mod)
    torch.manual_seed(0)
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    # small whole numbers: every product and sum is exact in fp32, so the padded GEMM equals
    # the reference bitwise whatever blocking the row count picks (AVX2's MKL kernels round a
    # 208-row product other than a 200-row one in the last bit)
    x = torch.randint(-4, 5, (sum(counts), 8)).float()
    w = torch.randint(-4, 5, (len(counts), 5, 8)).float()
    want = torch.cat([x[s:t] @ w[e].T for e, (s, t) in
                      enumerate(zip([0] + offs.tolist()[:-1], offs.tolist()))])
    torch.testing.assert_close(f8e._kernel_grouped_mm(x, w, offs), want, rtol=0, atol=0)
