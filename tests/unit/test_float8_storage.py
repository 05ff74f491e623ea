"""Float8 activation storage (``[activation_checkpoint] float8_storage``,
titanext.plugins.float8_storage), one process, debugdeepseek:

- the forward and every gradient but the weight gradients of the stored inputs' GEMMs (``wo``;
  the experts' ``w1`` and ``w3``) are bitwise those of high-precision storage, in bf16 and with
  recompute by module; those weight gradients stay above 28 dB SQNR (measured 31.7-33.1 dB in
  bf16, fp32 and bf16 autocast, docs/deepseek_v3.md);
- the saved bytes fall by exactly the float8 rows' saving: ``dim + ceil(dim / 128)`` bytes per
  row instead of 4 ``dim`` (fp32);
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
