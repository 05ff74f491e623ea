"""Every matmul is accounted for (issue 35): float8 and weight-gradient deferral convert
transformers' Conv1D exactly as they convert the nn.Linear it stands for, and name a module that
multiplies by its own parameter. Multi-process (TP on Conv1D): tests/multiprocess/
test_matmul_accounting.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from tests.matmul_models import MixedMatmuls, gpt2_tokens, tiny_gpt2
from titanext.plugins._loud import is_conv1d, matmul_kind
from titanext.plugins.float8 import apply_float8
from titanext.plugins.weight_grad import WeightGradQueue, defer_weight_grads, weight_grad_deferral

CONV1D = [f"transformer.h.{i}.{m}" for i in range(2)
          for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


def _as_linears(model: nn.Module) -> nn.Module:
    """The same model with every Conv1D replaced by the nn.Linear it stands for (W^T)."""
    model = copy.deepcopy(model)
    for fqn in CONV1D:
        parent, _, child = fqn.rpartition(".")
        conv = model.get_submodule(fqn)
        lin = nn.Linear(*conv.weight.shape)
        with torch.no_grad():
            lin.weight.copy_(conv.weight.t())
            lin.bias.copy_(conv.bias)
        model.get_submodule(parent).register_module(child, lin)
    return model


def _conv1d_grads(model: nn.Module, transposed: bool) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if transposed and n.endswith(".weight") and n.rpartition(".")[0] in CONV1D:
            g = g.t()
        out[n] = g
    return out


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_float8_conv1d_is_float8_linear_on_the_transposed_weight(recipe):
    """GPT-2's 8 Conv1D convert; loss and every gradient equal those of the model whose Conv1D
    are nn.Linear(W^T) converted by the same recipe (the lm_head kept, as docs/float8.md says)."""
    model = tiny_gpt2()
    linear = _as_linears(model)
    names = list(model.state_dict())
    assert apply_float8(model, recipe=recipe, filter_fqns=["lm_head"], emulate=True) == CONV1D
    assert apply_float8(linear, recipe=recipe, filter_fqns=["lm_head"], emulate=True) == CONV1D
    assert list(model.state_dict()) == names  # same parameters, names, shapes
    assert all(is_conv1d(model.get_submodule(f)) for f in CONV1D)
    ids = gpt2_tokens()
    loss, loss_lin = model(ids, labels=ids).loss, linear(ids, labels=ids).loss
    loss.backward()
    loss_lin.backward()
    torch.testing.assert_close(loss, loss_lin, rtol=1e-6, atol=0)
    got, want = _conv1d_grads(model, True), _conv1d_grads(linear, False)
    for n in got:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


def test_float8_conv1d_stays_near_high_precision():
    """float8 emulation tolerance, as tests/unit/test_float8.py measures it (SQNR of the loss
    change and of the gradients against fp32 above torchao's 17 dB)."""
    ref = tiny_gpt2()
    model = copy.deepcopy(ref)
    apply_float8(model, recipe="tensorwise", filter_fqns=["lm_head"], emulate=True)
    ids = gpt2_tokens()
    ref(ids, labels=ids).loss.backward()
    model(ids, labels=ids).loss.backward()
    for fqn in CONV1D:
        g, w = model.get_submodule(fqn).weight.grad, ref.get_submodule(fqn).weight.grad
        assert 20 * torch.log10(w.norm() / (g - w).norm()) > 17, fqn


def test_deferred_conv1d_gradients_equal_autograd():
    """Deferral converts GPT-2's Conv1D (and the tied head); queued dW = X^T dY gives autograd's
    gradients bitwise, and outside a context the model is the original one."""
    ref = tiny_gpt2()
    model = copy.deepcopy(ref)
    assert defer_weight_grads(model) == [*CONV1D, "lm_head"]
    ids = gpt2_tokens()
    ref(ids, labels=ids).loss.backward()
    queue = WeightGradQueue()
    with weight_grad_deferral(queue):
        model(ids, labels=ids).loss.backward()
    assert model.get_submodule(CONV1D[0]).weight.grad is None and len(queue) == 9
    queue.run()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_converters_name_a_module_multiplying_by_its_own_parameter(caplog):
    """A subclassed Linear converts; F.linear on an own parameter is named with the fix, in the
    WARNING line and, when nothing else converts, in the error."""
    assert matmul_kind(MixedMatmuls().mid) == "param_matmul"
    with caplog.at_level(logging.WARNING, logger="titanext"):
        assert apply_float8(MixedMatmuls(), emulate=True) == ["up", "down"]
        assert defer_weight_grads(MixedMatmuls()) == ["up", "down"]
    lines = [r.getMessage() for r in caplog.records if "not converted" in r.getMessage()]
    assert len(lines) == 2, lines
    for plugin, line in zip(("float8", "weight_grad"), lines, strict=True):
        assert line.startswith(f"{plugin}: 1 matmul module(s) not converted: mid "
                               "(OwnWeightProjection multiplies by its own 2-D parameter weight "
                               f"outside nn.Linear, which {plugin} cannot convert; hold it in an "
                               "nn.Linear"), line
    only = MixedMatmuls()
    with pytest.raises(ValueError) as e:
        apply_float8(only, filter_fqns=["up", "down"], emulate=True)
    assert "mid (OwnWeightProjection multiplies by its own 2-D parameter" in str(e.value)
    assert "hold the weights multiplied outside nn.Linear in nn.Linear modules" in str(e.value)
    assert "module_filter_fn returning True" not in str(e.value)
    with pytest.raises(ValueError) as e:
        defer_weight_grads(only, module_filter_fn=lambda m, fqn: fqn == "mid")
    msg = str(e.value)
    assert "found mid (OwnWeightProjection, multiplies by its own 2-D parameter)" in msg, msg
    assert "hold the weights multiplied outside nn.Linear in nn.Linear modules" in msg
    assert "pass module_filter_fn returning True" not in msg


def test_tp_plan_targets_refuse_styles_that_cannot_shard_a_matmul_before_sharding():
    """torch's linear styles on a Conv1D, or on a module calling F.linear on its own parameter,
    are refused by name with the fix, without a process group and without changing the model."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from titanext.plugins.tensor_parallel import (
        Conv1DColwiseParallel,
        Conv1DRowwiseParallel,
        default_plan_problems,
        tp_plan_targets,
    )

    gpt2 = tiny_gpt2()
    with pytest.raises(ValueError) as e:
        tp_plan_targets(gpt2, 2, {"transformer.h.*.mlp.c_fc": ColwiseParallel(),
                                  "transformer.h.*.mlp.c_proj": Conv1DRowwiseParallel()})
    msg = str(e.value)
    assert msg.startswith("apply_tensor_parallel: transformer.h.0.mlp.c_fc (ColwiseParallel): "
                          "transformers Conv1D holds its weight as [in, out]"), msg
    assert "transformer.h.1.mlp.c_fc (ColwiseParallel)" in msg and "c_proj" not in msg
    _, _, kept = tp_plan_targets(gpt2, 2, {"transformer.h.*.mlp.c_fc": Conv1DColwiseParallel()})
    assert list(kept) == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
    with pytest.raises(ValueError, match=r"mid \(RowwiseParallel on OwnWeightProjection\): the "
                       "column / row styles shard nn.Linear, nn.Embedding and Conv1D weights"):
        tp_plan_targets(MixedMatmuls(), 2, {"up": ColwiseParallel(), "mid": RowwiseParallel()})
    problems = default_plan_problems(gpt2)
    assert "transformer.h.0.attn.c_attn (Conv1D) is named by no rule" in problems
