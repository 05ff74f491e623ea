"""Issue 35 on 2 gloo ranks, against one fp32 process (~1e-5) or a named error that leaves the
model untouched:

- tensor parallelism on transformers' Conv1D (GPT-2's MLP) with the Conv1D styles, also with the
  Conv1D weight gradients deferred (DTensor dW); torch's styles on the subclassed Linears of a
  fixture whose middle module calls F.linear on its own parameter (replicated, and named);
- FSDP over GPT-2 with float8 Conv1D against one float8 process (the ranks' batches as
  micro-batches);
- validate before mutating: torch's linear styles on a Conv1D, a bad AC option after a valid TP
  plan, and ``parallelize(..., ep=2)`` on an HF MoE model without ``blocks=`` all raise before
  any plugin changes the model (parameter objects, values and module classes compared);
- expert parallelism on torchtitan's MoE layout (router, token reorderer, inner grouped experts
  with stacked w1 / w2 / w3 under either version's names), found by its call, FSDP x EP through
  ``parallelize``.
All cases share one spawn."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.matmul_models import MixedMatmuls, gpt2_tokens, tiny_gpt2
from tests.spawn import run_distributed
from tests.torchtitan_style_moe import TTGroupedExperts, TTMoEModel


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _snapshot(model: torch.nn.Module) -> dict:
    """Parameter objects, values and module classes: what 'untouched' compares."""
    return {"params": {n: (id(p), p.detach().clone()) for n, p in model.named_parameters()},
            "types": {n: type(m) for n, m in model.named_modules()}}


def _untouched(before: dict, model: torch.nn.Module) -> bool:
    after = _snapshot(model)
    return (before["types"] == after["types"] and before["params"].keys() == after["params"].keys()
            and all(i == after["params"][n][0] and torch.equal(v, after["params"][n][1])
                    for n, (i, v) in before["params"].items()))


def _dims(**degrees):
    from titanext.distributed.parallel_dims import ParallelDims

    full = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=2)
    dims = ParallelDims(**{**full, **degrees})
    dims.build_mesh("cpu")
    return dims


def _gpt2_tp_case(defer: bool) -> dict:
    """TP 2 on GPT-2's MLP Conv1D (c_fc column-wise, c_proj row-wise); attention replicated.
    ``defer``: the Conv1D's weight gradients are queued (DTensor dW) and run after backward."""
    import contextlib

    from titanext.plugins.tensor_parallel import (
        Conv1DColwiseParallel,
        Conv1DRowwiseParallel,
        apply_tensor_parallel,
    )
    from titanext.plugins.weight_grad import (
        WeightGradQueue,
        defer_weight_grads,
        weight_grad_deferral,
    )

    ref = tiny_gpt2()
    model = copy.deepcopy(ref)
    queue = WeightGradQueue()
    if defer:
        defer_weight_grads(model)
    apply_tensor_parallel(model, _dims(tp=2).tp_mesh, {
        "transformer.h.*.mlp.c_fc": Conv1DColwiseParallel(),
        "transformer.h.*.mlp.c_proj": Conv1DRowwiseParallel()})
    assert model.transformer.h[0].mlp.c_fc.weight.placements[0].dim == 1
    ids = gpt2_tokens()
    loss_ref = ref(ids, labels=ids).loss
    loss_ref.backward()
    with weight_grad_deferral(queue) if defer else contextlib.nullcontext():
        loss = model(ids, labels=ids).loss
        loss.backward()
    assert len(queue) == (9 if defer else 0)
    queue.run()
    grads = {n: (_full(p.grad), ref.get_parameter(n).grad) for n, p in model.named_parameters()}
    return {"loss": (loss.detach(), loss_ref.detach()), "grads": grads}


def _gpt2_fsdp_float8_case() -> dict:
    """FSDP 2 on GPT-2 with float8 (tensorwise, emulated) Conv1D against one float8 process that
    runs the ranks' batches as micro-batches (dynamic scales follow the micro-batch)."""
    from titanext.distributed.parallelize import parallelize
    from titanext.plugins.float8 import apply_float8

    ref = tiny_gpt2()
    apply_float8(ref, recipe="tensorwise", filter_fqns=["lm_head"], emulate=True)
    model = parallelize(copy.deepcopy(ref), _dims(dp_shard=2), blocks="transformer.h")
    batches = [gpt2_tokens(seed=10 + r) for r in range(2)]
    for ids in batches:
        (ref(ids, labels=ids).loss / 2).backward()  # FSDP averages over dp = 2
    ids = batches[dist.get_rank()]
    model(ids, labels=ids).loss.backward()
    return {n: (_full(p.grad), ref.get_parameter(n).grad) for n, p in model.named_parameters()}


def _mixed_tp_case() -> dict:
    """TP 2 on the subclassed Linears around a module calling F.linear on its own parameter:
    ``up`` column-wise gathered, ``down`` row-wise, ``mid`` replicated (and named so)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from titanext.plugins.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    ref = MixedMatmuls()
    model = copy.deepcopy(ref)
    apply_tensor_parallel(model, _dims(tp=2).tp_mesh, {
        "up": ColwiseParallel(output_layouts=Replicate()),
        "down": RowwiseParallel(input_layouts=Replicate())})
    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(2))
    y, y_ref = model(x), ref(x)
    y.square().mean().backward()
    y_ref.square().mean().backward()
    grads = {n: (_full(p.grad), ref.get_parameter(n).grad) for n, p in model.named_parameters()}
    return {"out": (y.detach(), y_ref.detach()), "grads": grads}


def _refusals() -> dict:
    """Errors that must come before any change: the model is compared with its snapshot."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from tests.hf_artifacts import make_tiny_qwen3  # noqa: F401  (transformers present)
    from titanext.distributed.parallelize import parallelize

    out = {}
    gpt2 = tiny_gpt2()
    before = _snapshot(gpt2)
    try:
        parallelize(gpt2, _dims(tp=2), blocks="transformer.h",
                    tp_plan={"transformer.h.*.mlp.c_fc": ColwiseParallel(),
                             "transformer.h.*.mlp.c_proj": RowwiseParallel()})
        out["tp_torch_style_on_conv1d"] = ("no error", False)
    except ValueError as e:
        out["tp_torch_style_on_conv1d"] = (str(e), _untouched(before, gpt2))

    from titanext.config import Recipe
    from titanext.plugins.tensor_parallel import Conv1DColwiseParallel, Conv1DRowwiseParallel

    before = _snapshot(gpt2)
    try:  # a valid TP plan, then an AC option that only the AC plugin would have rejected
        parallelize(gpt2, _dims(tp=2), Recipe(ac="selective", ac_option="every2"),
                    blocks="transformer.h",
                    tp_plan={"transformer.h.*.mlp.c_fc": Conv1DColwiseParallel(),
                             "transformer.h.*.mlp.c_proj": Conv1DRowwiseParallel()})
        out["ac_option_after_tp"] = ("no error", False)
    except ValueError as e:
        out["ac_option_after_tp"] = (str(e), _untouched(before, gpt2))

    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)
    moe = transformers.Qwen3MoeForCausalLM(cfg).float()
    before = _snapshot(moe)
    try:  # FSDP needs the blocks (model.model.layers): that must fail before EP runs
        parallelize(moe, _dims(dp_shard=2, ep=2))
        out["ep_without_blocks"] = ("no error", False)
    except ValueError as e:
        out["ep_without_blocks"] = (str(e), _untouched(before, moe))
    return out


def _torchtitan_ep_case(names: str) -> dict:
    """parallelize(model, dp_shard=2 x ep=2) on the torchtitan-layout MoE vs one process."""
    from titanext.distributed.parallelize import parallelize

    torch.manual_seed(0)
    ref = TTMoEModel(names)
    model = parallelize(copy.deepcopy(ref), _dims(dp_shard=2, ep=2))
    inner = model.layers[0].moe.routed_experts.inner_experts
    assert isinstance(inner, TTGroupedExperts)  # wrapped in place: its own forward runs
    assert all(isinstance(p, DTensor) for p in inner.parameters())
    xs = [torch.randn(2, 5 + r, 16, generator=torch.Generator().manual_seed(3 + r))
          for r in range(2)]
    (sum(ref(x).square().sum() for x in xs) / 2).backward()  # FSDP averages over dp = 2
    out = model(xs[dist.get_rank()])
    out.square().sum().backward()
    grads = {n: (_full(p.grad), ref.get_parameter(n).grad) for n, p in model.named_parameters()}
    return {"out": (out.detach(), ref(xs[dist.get_rank()]).detach()), "grads": grads}


def _body(rank: int, world_size: int) -> dict:
    return {"gpt2_tp": _gpt2_tp_case(False), "gpt2_tp_deferred": _gpt2_tp_case(True),
            "mixed_tp": _mixed_tp_case(), "gpt2_fsdp_float8": _gpt2_fsdp_float8_case(),
            "refusals": _refusals(),
            **{f"tt_{names}": _torchtitan_ep_case(names) for names in ("v0.2", "v0.3")}}


def _close(pairs: dict, what: str) -> None:
    for name, (got, want) in pairs.items():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()),
                                   msg=lambda m, n=name: f"{what} {n}: {m}")


def test_conv1d_tp_refusals_and_torchtitan_ep_match_one_process():
    for got in run_distributed(_body, 2, timeout_s=120):
        for key in ("gpt2_tp", "gpt2_tp_deferred"):
            _close({"loss": got[key]["loss"]}, key)
            _close(got[key]["grads"], key)
        _close(got["gpt2_fsdp_float8"], "GPT-2 FSDP x float8 Conv1D")
        case = got["mixed_tp"]
        _close({"out": case["out"]}, "subclassed Linear TP")
        _close(case["grads"], "subclassed Linear TP")
        for names in ("v0.2", "v0.3"):
            case = got[f"tt_{names}"]
            _close({"out": case["out"]}, f"torchtitan MoE {names}")
            _close(case["grads"], f"torchtitan MoE {names}")
        refusals = got["refusals"]
        msg, untouched = refusals["tp_torch_style_on_conv1d"]
        assert msg.startswith(
            "apply_tensor_parallel: transformer.h.0.mlp.c_fc (ColwiseParallel)"), msg
        assert "use titanext.plugins.tensor_parallel.Conv1DColwiseParallel" in msg
        assert untouched
        msg, untouched = refusals["ac_option_after_tp"]
        assert msg == ("activation_checkpoint.selective_ac_option = 'every2'; allowed: 'op' or a "
                       "positive integer"), msg
        assert untouched
        msg, untouched = refusals["ep_without_blocks"]
        assert msg.startswith("parallelize: FSDP need the model's blocks: Qwen3MoeForCausalLM "
                              "has no 'layers'"), msg
        assert "blocks='path.to.container'" in msg
        assert untouched
