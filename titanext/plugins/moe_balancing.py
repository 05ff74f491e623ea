"""MoE load balancing across a parallel job: one hook the train step calls once per step.

Aux-loss-free balancing (``titanext.models.moe.update_expert_bias``) needs each block's expert
loads over the whole global batch. Under data and context parallelism every rank routes
different tokens, and under pipeline parallelism a rank holds only some blocks (DualPipe:
two copies of each block that see half of the micro-batches each). :class:`MoEBalancing`
sums the loads over both, updates the expert biases of the blocks this process holds, and
keeps the loads (and the sequence aux loss) for the metrics.

>>> balancing = MoEBalancing(model, device=torch.device("cpu"))  # a MoE model  # doctest: +SKIP
>>> optimizer.step()                                   # in a training loop  # doctest: +SKIP
>>> balancing.step(model_parts, pp_group=None, dp_group=dp_group)  # torchrun  # doctest: +SKIP
>>> shown, tensorboard_only = balancing.metrics(model_parts)  # same loop  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from titanext.models.moe import MoE, expert_load, set_aux_loss_weight, update_expert_bias

__all__ = ["MoEBalancing", "reset_routing_counts"]


def reset_routing_counts(module: nn.Module) -> None:
    """Forget the routing counts of every MoE block in ``module`` (e.g. of a forward that
    only inferred shapes, see ``titanext.distributed.pipeline.ignore_shape_inference_forward``)."""
    for m in module.modules():
        if isinstance(m, MoE):
            m.tokens_per_expert.zero_()


class MoEBalancing:
    """Expert-bias updates and load metrics for the MoE blocks of ``model``.

    ``model`` is the whole model (e.g. on the meta device, before a pipeline split): its block
    names are the keys of :attr:`load`. Pipeline stages keep the whole model's names, so the
    parts passed to :meth:`step` are matched by name. A model without MoE blocks makes every
    call a no-op.
    """

    def __init__(self, model: nn.Module, *, device: torch.device):
        blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]
        self.names = [n for n, _ in blocks]
        self.num_experts = blocks[0][1].args.num_experts if blocks else 0
        self.aux_loss_alpha = blocks[0][1].args.aux_loss_alpha if blocks else 0.0
        self.device = device
        self.load: dict[str, torch.Tensor] = {}  # {block FQN: max/mean load} of the last step

    def weigh_aux_loss(self, parts: Sequence[nn.Module], sequences_per_step: int) -> None:
        """Weigh the sequence aux loss 1 / (sequences per rank per step) per sequence, so that
        after FSDP's average over dp x cp it is the mean over the global step's sequences (CP
        slices count as sequences), next to the token-mean cross-entropy."""
        for part in parts:
            set_aux_loss_weight(part, 1.0 / sequences_per_step)

    def _held(self, parts: Sequence[nn.Module]) -> list[tuple[int, MoE]]:
        """(index in :attr:`names`, block) of every MoE block in ``parts``."""
        index = {n: i for i, n in enumerate(self.names)}
        return [(index[n], m) for part in parts for n, m in part.named_modules()
                if isinstance(m, MoE)]

    def step(self, parts: Sequence[nn.Module], *, pp_group: dist.ProcessGroup | None = None,
             dp_group: dist.ProcessGroup | None = None) -> None:
        """After ``optimizer.step()``: sum the loads over ``pp_group`` (every rank learns every
        block's load; DualPipe's two copies add up to the one model's counts) and over
        ``dp_group`` (the dp x cp ranks that see different tokens), then update the biases
        of the blocks in ``parts``."""
        if not self.names:
            return
        held = self._held(parts)
        loads = torch.zeros(len(self.names), self.num_experts, device=self.device)
        for i, m in held:
            loads[i] += m.tokens_per_expert.float()
        if pp_group is not None:
            dist.all_reduce(loads, group=pp_group)
        if dp_group is not None:
            dist.all_reduce(loads, group=dp_group)
        for i, m in held:  # the summed counts, then the update of this process's blocks only
            m.tokens_per_expert.copy_(loads[i])
        for part in parts:
            update_expert_bias(part, group=None)
        self.load.clear()  # in place: callers may keep a reference to the dict
        self.load.update(zip(self.names, expert_load(loads), strict=True))

    def metrics(self, parts: Sequence[nn.Module], *, pp_group: dist.ProcessGroup | None = None
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(console + TensorBoard, TensorBoard only) metrics of the last step: the largest
        block load, the sequence aux loss (last micro-batch, summed over blocks) and each
        block's load."""
        if not self.load:
            return {}, {}
        shown = {"moe_load": torch.stack(list(self.load.values())).max()}
        if self.aux_loss_alpha:
            aux = torch.zeros(len(self.names), device=self.device)
            for i, m in self._held(parts):
                if m.aux_loss is not None:
                    aux[i] = m.aux_loss
            if pp_group is not None:  # each block from a rank that holds it (aux >= 0)
                dist.all_reduce(aux, op=dist.ReduceOp.MAX, group=pp_group)
            shown["moe_aux_loss"] = aux.sum()
        return shown, {f"moe_load/{name}": v for name, v in self.load.items()}
