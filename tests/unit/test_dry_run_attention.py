"""The dry run's fused-kernel attention for MLA (titanext.launch.dry_run.use_fused_attention):
v zero-padded to the query's head dim gives the same output and gradients, and SDPA then takes
its fused kernel instead of the math path (which keeps seq x seq scores)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titanext.launch.dry_run import use_fused_attention
from titanext.models import build_model, get_model_args


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_fused_attention_matches_and_avoids_the_math_path():
    torch.manual_seed(0)
    args = get_model_args("llama3", "debugdeepseek")
    assert args.value_head_dim != args.head_dim
    model = build_model("llama3", args, device="cpu")
    model.init_weights(seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 16))

    def run():
        model.zero_grad()
        with _Ops() as ops:
            out = model(tokens)
            out.float().pow(2).mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()], ops.names

    ref, ref_grads, ref_ops = run()
    assert use_fused_attention([model]) == args.n_layers
    got, grads, ops = run()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    assert not any("flash" in n for n in ref_ops) and "_safe_softmax" in ref_ops
    assert any("flash" in n for n in ops) and "_safe_softmax" not in ops
