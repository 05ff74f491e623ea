"""Each plugin works on a user's own nn.Module, without the trainer (the library route). FSDP,
TP and ``parallelize`` on gloo ranks: tests/multiprocess/test_plugins_user_model.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titanext.plugins.activation_checkpoint import apply_activation_checkpointing
from titanext.plugins.compile import apply_compile


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class UserModel(nn.Module):
    """Not titanext's model: blocks live in `body`, not in `layers`."""

    def __init__(self, d: int = 32, n: int = 3):
        super().__init__()
        self.body = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        for b in self.body:
            x = b(x)
        return self.head(x)


def _reference(seed: int = 0):
    torch.manual_seed(seed)
    model = UserModel()
    x = torch.randn(8, 5, 32)
    return model, x


def _grads(model):
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters()}


def _ref_grads():
    model, x = _reference()
    model(x).square().mean().backward()
    return _grads(model)


@pytest.mark.parametrize("mode,option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_activation_checkpointing_on_user_model_keeps_gradients(mode, option):
    model, x = _reference()
    apply_activation_checkpointing(model, mode=mode, option=option, blocks=model.body)
    names_before = [n for n, _ in model.named_parameters()]
    model(x).square().mean().backward()
    assert [n for n, _ in model.named_parameters()] == names_before  # checkpoints stay compatible
    for name, ref in _ref_grads().items():
        torch.testing.assert_close(model.get_parameter(name).grad, ref,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_activation_checkpointing_saves_memory():
    """Full AC keeps fewer saved tensors alive between forward and backward."""

    def saved_bytes(model, x):
        total = []

        def pack(t):
            total.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x).square().mean()
        out.backward()
        return sum(total)

    model, x = _reference()
    plain = saved_bytes(model, x)
    apply_activation_checkpointing(model, mode="full", blocks=model.body)
    assert saved_bytes(model, x) < plain / 2


def test_bad_ac_options_are_named():
    model, _ = _reference()
    with pytest.raises(ValueError, match="mode = 'sometimes'"):
        apply_activation_checkpointing(model, mode="sometimes", blocks=model.body)
    with pytest.raises(ValueError, match="selective_ac_option = 'x'"):
        apply_activation_checkpointing(model, mode="selective", option="x", blocks=model.body)
    with pytest.raises(ValueError, match="unknown aten op 'not_an_op'"):
        apply_activation_checkpointing(model, mode="selective", option="op", save_ops=["not_an_op"],
                                       blocks=model.body)
    with pytest.raises(ValueError, match="pass blocks="):
        apply_activation_checkpointing(model, mode="full")


def test_compile_each_block_of_user_model():
    model, x = _reference()
    ref = model(x)
    apply_compile(model, backend="inductor", blocks=model.body)
    names = [n for n, _ in model.named_parameters()]
    assert not any("_orig_mod" in n for n in names)
    torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-5)
