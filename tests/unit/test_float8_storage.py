"""Float8 activation storage (``[activation_checkpoint] float8_storage``,
titanext.plugins.float8_storage), one process, debugdeepseek:

- the forward and every gradient but the weight gradients of the stored inputs' GEMMs (``wo``;
  the experts' ``w1`` and ``w3``) are bitwise those of high-precision storage, in bf16 and with
  recompute by module; those weight gradients stay above 28 dB SQNR (measured 31.7-33.1 dB in
  bf16, fp32 and bf16 autocast, docs/deepseek_v3.md);
- the saved bytes fall by exactly the float8 rows' saving: ``dim + ceil(dim / 128)`` bytes per
  row instead of 4 ``dim`` (fp32);
- the SwiGLU inputs (``expert_act_input``) in float8: the bytes fall by their float8 rows, the
  forward is bitwise, every gradient within the measured float8 error;
- with float8 linears and float8 routed experts: the bytes fall the same, and the gradients stay
  within the float8 error of float8 compute with high-precision storage;
- it refuses what would silently store nothing.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.unit.test_recompute_modules import _saved_after_forward
from titanext.models import build_model, get_model_args
from titanext.plugins.activation_checkpoint import apply_activation_checkpointing
from titanext.plugins.float8_storage import apply_float8_storage

BOTH = ("expert_up_proj_input", "attention_out_input")
SQNR_DB = 28.0
# SwiGLU's inputs in float8 reach the router's gradient (through the routing weights') and
# w2's (recomputed from them): worst gradient 26.9-29.5 dB over 4 batches x recompute on / off
# (debugdeepseek; torchao holds float8 weight gradients to 17 dB)
SWIGLU_SQNR_DB = 25.0
STORED_GRADS = ("attention.wo.weight", "moe.experts.w1", "moe.experts.w3")


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    args = get_model_args("llama3", "debugdeepseek")
    model = build_model("llama3", args, device="cpu")
    model.init_weights(seed=3)
    return model.to(dtype), args


def _grads(model, tokens):
    loss = model(tokens).float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    return (10 * torch.log10(ref.square().sum() / (ref - got).square().sum())).item()


@pytest.mark.parametrize("dtype,modules", [(torch.bfloat16, False), (torch.float32, True)])
def test_only_the_stored_inputs_weight_gradients_change(dtype, modules):
    ref_model, _ = _model(dtype)
    model = copy.deepcopy(ref_model)
    assert apply_float8_storage(model, BOTH) == {"expert_up_proj_input": 2,
                                                 "attention_out_input": 3}
    if modules:
        apply_activation_checkpointing(model, mode="modules",
                                       recompute_modules=("layernorm", "mla_up_proj", "moe_act"))
    tokens = torch.randint(0, 200, (4, 64))
    ref, got = _grads(ref_model, tokens), _grads(model, tokens)
    assert torch.equal(ref[0], got[0])
    changed = {n for n in ref[1] if not torch.equal(ref[1][n], got[1][n])}
    assert changed == {n for n in ref[1] if n.endswith(STORED_GRADS)}, changed
    worst = min(sqnr_db(ref[1][n], got[1][n]) for n in changed)
    assert worst > SQNR_DB, worst


def test_the_saved_bytes_fall_by_the_float8_rows():
    tokens = torch.randint(0, 200, (2, 64))
    args = get_model_args("llama3", "debugdeepseek")
    n_tokens, moe = tokens.numel(), args.moe

    def row_saving(dim: int) -> int:  # fp32 row -> float8 bytes and one exponent per 128
        return 4 * dim - (dim + math.ceil(dim / 128))

    base = _saved_after_forward(_model()[0], tokens)
    for name, want in (
            ("attention_out_input",
             args.n_layers * n_tokens * row_saving(args.n_heads * args.v_head_dim)),
            ("expert_up_proj_input",
             (args.n_layers - 1) * n_tokens * moe.top_k * row_saving(args.dim))):
        model, _ = _model()
        apply_float8_storage(model, [name])
        assert base - _saved_after_forward(model, tokens) == want, name


@pytest.mark.parametrize("modules", [False, True])
def test_swiglu_inputs_in_float8(modules):
    """``expert_act_input``: the routed experts' gate and up [rows, hidden] keep float8 bytes
    (also as the kept inputs of moe_act's recompute); the forward is bitwise, the gradients
    within the float8 error."""
    tokens = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(103))
    args = get_model_args("llama3", "debugdeepseek")
    rows, hidden = tokens.numel() * args.moe.top_k, args.moe.hidden_dim
    recompute = ("layernorm", "mla_up_proj", "moe_act")

    def build(store: bool):
        model, _ = _model()
        if store:
            assert apply_float8_storage(model, ["expert_act_input"]) == {"expert_act_input": 2}
        if modules:
            apply_activation_checkpointing(model, mode="modules", recompute_modules=recompute)
        return model

    saving = 2 * rows * (4 * hidden - (hidden + math.ceil(hidden / 128)))
    base = _saved_after_forward(build(False), tokens)
    assert base - _saved_after_forward(build(True), tokens) == (args.n_layers - 1) * saving
    ref, got = _grads(build(False), tokens), _grads(build(True), tokens)
    assert torch.equal(ref[0], got[0])
    worst = min(sqnr_db(ref[1][n], got[1][n]) for n in ref[1] if ref[1][n].any())
    assert worst > SWIGLU_SQNR_DB, worst


def test_float8_storage_with_float8_experts_and_linears():
    """With float8 routed experts and float8 linears (emulated here), the dispatched rows and
    wo's input are stored as well: the bytes fall by the float8 rows, the forward is bitwise and
    the gradients stay within the float8 error of float8 compute with bf16 storage."""
    pytest.importorskip("torchao")
    from titanext.plugins.float8 import apply_float8
    from titanext.plugins.float8_experts import apply_float8_experts

    tokens = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(0))
    args = get_model_args("llama3", "debugdeepseek")

    def build(store: bool):
        model, _ = _model()
        apply_float8(model, recipe="rowwise", filter_fqns=("output", "router"), emulate=True)
        apply_float8_experts(model, recipe="rowwise", emulate=True)
        assert type(model.layers["1"].attention.wo).__name__ == "Float8Linear"
        if store:
            apply_float8_storage(model, BOTH)
        return model

    base = _saved_after_forward(build(False), tokens)
    rows = tokens.numel()
    want = (args.n_layers * rows * _row_saving(args.n_heads * args.v_head_dim)
            + (args.n_layers - 1) * rows * args.moe.top_k * _row_saving(args.dim))
    assert base - _saved_after_forward(build(True), tokens) == want
    ref, got = _grads(build(False), tokens), _grads(build(True), tokens)
    assert torch.equal(ref[0], got[0])
    # the float8 GEMMs quantize the dequantized rows again for dW, often to the same values
    changed = {n for n in ref[1] if not torch.equal(ref[1][n], got[1][n])}
    assert changed <= {n for n in ref[1] if n.endswith(STORED_GRADS)}, changed
    worst = min((sqnr_db(ref[1][n], got[1][n]) for n in changed), default=math.inf)
    assert worst > SQNR_DB, worst


def _row_saving(dim: int) -> int:  # an fp32 row -> float8 bytes and one exponent per 128
    return 4 * dim - (dim + math.ceil(dim / 128))


def test_what_would_store_nothing_is_refused():
    model, _ = _model()
    model.layers["0"].attention.wo = type("MyLinear", (torch.nn.Linear,), {})(48, 64, bias=False)
    with pytest.raises(ValueError, match="layers.0.attention.wo is a MyLinear"):
        apply_float8_storage(model, ["attention_out_input"])
    dense = build_model("llama3", get_model_args("llama3", "debugtiny"))
    with pytest.raises(ValueError, match="names 'expert_up_proj_input', but no block"):
        apply_float8_storage(dense, ["expert_up_proj_input"])
    with pytest.raises(ValueError, match="unknown 'wo'"):
        apply_float8_storage(dense, ["wo"])
