"""Adam / AdamW whose moments are stored in a lower precision than the parameters.

``[optimizer] state_dtype = "bfloat16"`` keeps ``exp_avg`` and ``exp_avg_sq`` in bf16, as the
DeepSeek-V3 report does: the optimizer state of an fp32-master model shrinks from 8 to 4 bytes
per parameter. Each step upcasts one parameter's moments to fp32, runs torch's own Adam update
(``torch.optim.adam.adam``, single-tensor path) and rounds the moments back to the nearest bf16.
The update is deterministic, so a resume is bitwise; the rounding is the only difference from
``torch.optim.AdamW`` (at ``state_dtype=torch.float32`` this class is ``torch.optim.AdamW``
bit for bit).

Why not torchao: ``torchao.optim._AdamW`` keeps its moments in the *parameter's* dtype (it is
meant for bf16 parameters with stochastic rounding), and its 8-bit / 4-bit / fp8 optimizers store
quantized tensor subclasses; all of them ``torch.compile`` one graph per parameter shape on every
first step. None of them stores bf16 moments for fp32 (FSDP2-sharded or ZeRO-1) parameters.

>>> import torch
>>> p = torch.nn.Parameter(torch.ones(4))
>>> opt = LowPrecisionStateAdam([p], lr=0.1, state_dtype=torch.bfloat16)
>>> p.grad = torch.full((4,), 0.5)
>>> opt.step()
>>> opt.state[p]["exp_avg"].dtype, p.dtype
(torch.bfloat16, torch.float32)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adam import adam

__all__ = ["LowPrecisionStateAdam", "LowPrecisionStateAdamW"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


class LowPrecisionStateAdam(torch.optim.Adam):
    """``torch.optim.Adam`` (``decoupled_weight_decay=True``: AdamW), moments in ``state_dtype``.

    Takes ``torch.optim.Adam``'s arguments except amsgrad, foreach, fused, capturable and
    differentiable (the step runs one parameter at a time, so that only one parameter's fp32
    moments exist at once). The state dict holds the moments in ``state_dtype``; loading one
    (``Optimizer.load_state_dict`` casts state to the parameter's dtype) casts them back, which is
    exact for state saved from this class.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *,
                 decoupled_weight_decay: bool = False, maximize: bool = False,
                 state_dtype: torch.dtype = torch.bfloat16) -> None:
        if not state_dtype.is_floating_point:
            raise ValueError(f"state_dtype = {state_dtype}; a floating-point dtype is needed")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                         foreach=False)
        self.state_dtype = state_dtype
        self.register_load_state_dict_post_hook(_recast_moments)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # torch.optim.Adam's CPU step counter: a float32 scalar tensor
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for name in _MOMENTS:
                        state[name] = torch.zeros_like(p, dtype=self.state_dtype,
                                                       memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq = (state[name].to(p.dtype) for name in _MOMENTS)
                adam([p], [p.grad], [exp_avg], [exp_avg_sq], [], [state["step"]], foreach=False,
                     decoupled_weight_decay=group["decoupled_weight_decay"], amsgrad=False,
                     beta1=beta1, beta2=beta2, lr=group["lr"],
                     weight_decay=group["weight_decay"], eps=group["eps"],
                     maximize=group["maximize"])
                state["exp_avg"].copy_(exp_avg)  # round to nearest: deterministic
                state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss


class LowPrecisionStateAdamW(LowPrecisionStateAdam):
    """AdamW (decoupled weight decay) with moments in ``state_dtype``."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, maximize: bool = False,
                 state_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=True, maximize=maximize,
                         state_dtype=state_dtype)


def _recast_moments(optimizer: LowPrecisionStateAdam) -> None:
    """``Optimizer.load_state_dict`` cast the moments to the parameters' dtype: cast them back."""
    for state in optimizer.state.values():
        for name in _MOMENTS:
            if name in state and state[name].dtype != optimizer.state_dtype:
                state[name] = state[name].to(optimizer.state_dtype)
