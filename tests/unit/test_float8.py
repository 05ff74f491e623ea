"""Float8 linears (titanext.plugins.float8): accuracy, the filter, config, composition.

Accuracy is measured as torchao measures it: the SQNR of the float8 result against the same
computation in float32, with torchao's thresholds (18 dB output, 17 dB weight gradient).
Training against high precision: tests/multiprocess/test_float8.py.
"""

from __future__ import annotations

import doctest
import logging

import pytest
import torch
from torch import nn

from titanext._compat import inductor_cache_options
from titanext.config import ConfigError, load_config
from titanext.models import build_model, get_model_args
from titanext.plugins import float8 as float8_mod
from titanext.plugins.float8 import (
    FLOAT8_RECIPES,
    apply_float8,
    auto_filter_keeps,
    float8_linear_fqns,
    float8_module_filter,
    resolve_auto_filter,
    resolve_emulate,
)
from titanext.plugins.float8_blockwise import Float8BlockwiseLinear, blockwise_qdq


def sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    return (20 * torch.log10(ref.norm() / (ref - actual).norm())).item()


def _linear_pair(recipe: str, k: int = 512, n: int = 256, seed: int = 0):
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(k, n, bias=False))
    f8 = nn.Sequential(nn.Linear(k, n, bias=False))
    f8.load_state_dict(ref.state_dict())
    assert apply_float8(f8, recipe=recipe) == ["0"]
    return ref, f8


def _fwd_bwd(ref: nn.Module, f8: nn.Module, x: torch.Tensor) -> dict[str, float]:
    x_ref, x_f8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_f8 = ref(x_ref), f8(x_f8)
    grad = torch.randn_like(y_ref)
    y_ref.backward(grad)
    y_f8.backward(grad)
    return {"output": sqnr(y_ref, y_f8), "weight_grad": sqnr(ref[0].weight.grad, f8[0].weight.grad),
            "input_grad": sqnr(x_ref.grad, x_f8.grad)}


@pytest.mark.parametrize("recipe", FLOAT8_RECIPES)
def test_sqnr_of_each_recipe_meets_torchao_thresholds(recipe):
    ref, f8 = _linear_pair(recipe)
    s = _fwd_bwd(ref, f8, torch.randn(2, 128, 512))  # 3D input, as in a transformer
    assert s["output"] >= 18, s
    assert s["weight_grad"] >= 17, s
    assert s["input_grad"] >= 17, s
    # Float8 must actually be in the loop: quantization error is visible.
    assert s["output"] < 60, s


def test_blockwise_beats_tensorwise_with_outlier_channels():
    torch.manual_seed(0)
    x = torch.randn(256, 512)
    x[:, [3, 77]] *= 1000.0  # two outlier input channels, as in LLM activations
    results = {recipe: _fwd_bwd(*_linear_pair(recipe), x) for recipe in ("tensorwise", "blockwise")}
    assert results["blockwise"]["output"] > results["tensorwise"]["output"] + 1.0, results
    assert results["blockwise"]["weight_grad"] > results["tensorwise"]["weight_grad"] + 1.0, results


def test_blockwise_qdq_scales_each_block_on_its_own():
    t = torch.randn(256, 256)
    t[:128, :128] *= 1e6  # one huge block must not spoil the other three
    out = blockwise_qdq(t, 128, 128)
    for rows, cols in ((slice(128, None), slice(None)), (slice(None), slice(128, None))):
        assert sqnr(t[rows, cols], out[rows, cols]) > 28
    # Tensorwise scaling of the same tensor flushes the small blocks towards zero.
    flat = blockwise_qdq(t, 256, 256)
    assert sqnr(t[128:, 128:], flat[128:, 128:]) < 10
    # Shapes that are not multiples of the block are padded, not rejected.
    odd = torch.randn(3, 200)
    assert sqnr(odd, blockwise_qdq(odd, 1, 128)) > 28


def test_blockwise_linear_keeps_parameters_and_bias():
    lin = nn.Linear(256, 128)
    f8 = Float8BlockwiseLinear.from_float(lin)
    assert f8.weight is lin.weight and f8.bias is lin.bias
    x = torch.randn(4, 256)
    assert sqnr(lin(x), f8(x)) > 25


# -- the filter -----------------------------------------------------------------------------------

def _debug_model():
    return build_model("llama3", get_model_args("llama3", "debugtiny"), device="meta")


BLOCK_LINEARS = ["attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]


@pytest.mark.parametrize("filter_fqns, expected_layers", [
    (["output"], {0: BLOCK_LINEARS, 1: BLOCK_LINEARS}),
    ([], {0: BLOCK_LINEARS, 1: BLOCK_LINEARS}),  # output (264 = vocab) is not divisible by 16
    (["output", "layers.0"], {1: BLOCK_LINEARS}),
    (["wq", "layers.*.feed_forward.w2"],
     {i: [n for n in BLOCK_LINEARS if n not in ("attention.wq", "feed_forward.w2")]
      for i in (0, 1)}),
])
def test_filter_converts_exactly_the_expected_modules(filter_fqns, expected_layers):
    model = _debug_model()  # on meta: converters run before anything is materialised
    converted = apply_float8(model, filter_fqns=filter_fqns)
    expected = [f"layers.{i}.{n}" for i, names in expected_layers.items() for n in names]
    assert sorted(converted) == sorted(expected)
    assert sorted(float8_linear_fqns(model)) == sorted(expected)
    assert type(model.output) is nn.Linear


def test_filter_skips_dims_not_divisible_by_16_and_small_shapes_with_auto_filter():
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40), nn.Linear(40, 64))
    assert apply_float8(model) == ["0"]
    big = nn.ModuleDict({"small": nn.Linear(2048, 1024),
                         "large": nn.Linear(8192, 16384, device="meta")})
    big.small.to("meta")
    assert apply_float8(big, auto_filter=True) == ["large"]
    # torchao's measured break-even points (H100, fwd+bwd): 1024x2048x1024 loses,
    # 4096x8192x16384 wins.
    assert not auto_filter_keeps("tensorwise", 1024, 2048)
    assert auto_filter_keeps("tensorwise", 16384, 8192)
    assert not auto_filter_keeps("rowwise", 4096, 2048) and auto_filter_keeps("rowwise", 8192, 4096)


ATTN, FFN = ["wq", "wk", "wv", "wo"], ["w1", "w2", "w3"]
#: what the auto filter converts in one block of the 1B and 8B flavors, per recipe (the table
#: of docs/float8.md); wk and wv (N = kv heads x 128 = 512 / 1024) never gain
AUTO_FILTER_TABLE = {
    ("1B", "tensorwise"): ["wq", "wo", "w1", "w2", "w3"],
    ("1B", "rowwise"): ["w1", "w3"],
    ("1B", "rowwise_with_gw_hp"): ["w1", "w3"],
    ("1B", "blockwise"): ["w1", "w3"],
    **{("8B", r): ["wq", "wo", "w1", "w2", "w3"] for r in FLOAT8_RECIPES},
}


@pytest.mark.parametrize("flavor, recipe", sorted(AUTO_FILTER_TABLE))
def test_auto_filter_converts_the_tabled_linears_of_the_1b_and_8b_flavors(flavor, recipe):
    with torch.device("meta"):
        block = build_model("llama3", get_model_args("llama3", flavor)).layers["0"]
    keep = float8_module_filter(recipe=recipe, filter_fqns=["output"], auto_filter=True)
    converted = [fqn.split(".")[-1] for fqn, m in block.named_modules()
                 if isinstance(m, nn.Linear) and keep(m, f"layers.0.{fqn}")]
    assert converted == AUTO_FILTER_TABLE[flavor, recipe]
    everything = float8_module_filter(recipe=recipe, filter_fqns=["output"], auto_filter=False)
    assert all(everything(m, f"layers.0.{fqn}") for fqn, m in block.named_modules()
               if isinstance(m, nn.Linear))


def test_auto_filter_auto_follows_emulation_and_force_fqns_overrides_it():
    assert resolve_auto_filter("auto", emulated=False) is True  # float8 tensor cores: the rule
    assert resolve_auto_filter("auto", emulated=True) is False  # emulated: no speed to gain
    assert resolve_auto_filter(False, emulated=False) is False
    with pytest.raises(ValueError, match="auto_filter"):
        resolve_auto_filter("sometimes", emulated=True)
    small = nn.Sequential(nn.Linear(2048, 512), nn.Linear(512, 1024))  # both lose
    # on CPU float8 is emulated: "auto" converts everything eligible
    assert apply_float8(small, auto_filter="auto", device="cpu") == ["0", "1"]
    small = nn.Sequential(nn.Linear(2048, 512), nn.Linear(512, 1024))
    with pytest.raises(ValueError, match="auto_filter"):  # nothing left: loud, not silent
        apply_float8(small, auto_filter=True)
    assert apply_float8(small, auto_filter=True, force_fqns=["1"]) == ["1"]
    small = nn.Sequential(nn.Linear(2048, 512), nn.Linear(512, 1024))
    assert apply_float8(small, auto_filter=True, force_fqns=["*"], filter_fqns=["0"]) == ["1"]


def test_config_auto_filter_defaults_to_auto_and_takes_force_fqns():
    f8 = load_config(None, ["--float8.enable=true"]).float8
    assert (f8.auto_filter, f8.force_fqns) == ("auto", [])
    f8 = load_config(None, ["--float8.enable=true", "--float8.auto_filter=true",
                            "--float8.force_fqns=wk,wv"]).float8
    assert (f8.auto_filter, f8.force_fqns) == (True, ["wk", "wv"])
    with pytest.raises(ConfigError, match="float8.auto_filter"):
        load_config(None, ["--float8.enable=true", "--float8.auto_filter=maybe"])


def test_module_filter_fn_and_user_model_example():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    assert apply_float8(model, module_filter_fn=lambda m, fqn: fqn != "2") == ["0"]
    failures, _ = doctest.testmod(float8_mod, verbose=False)
    assert failures == 0


def test_apply_float8_rejects_bad_arguments():
    with pytest.raises(ValueError, match="did you mean 'rowwise'"):
        apply_float8(nn.Linear(16, 16), recipe="rowwse")
    with pytest.raises(ValueError, match="recipe='tensorwise'"):
        apply_float8(nn.Sequential(nn.Linear(16, 16)), recipe="rowwise",
                     enable_fsdp_float8_all_gather=True)


def test_emulate_auto_is_on_without_float8_hardware_and_says_so(caplog):
    assert resolve_emulate("auto", "cpu") is True
    assert resolve_emulate(False, "cpu") is False
    with caplog.at_level(logging.INFO, logger="titanext"):
        apply_float8(nn.Sequential(nn.Linear(32, 32)), device="cpu")
    assert "emulated" in caplog.text and "converted 1 matmul module" in caplog.text


# -- config ---------------------------------------------------------------------------------------

def test_config_float8_section_and_its_rules():
    cfg = load_config(None, ["--float8.enable=true", "--float8.recipe=rowwise",
                             "--float8.emulate=false"])
    f8 = cfg.float8
    assert (f8.recipe, f8.emulate, f8.filter_fqns) == ("rowwise", False, ["output"])
    cases = {
        "--float8.recipe=rowwse": "did you mean 'rowwise'",
        "--float8.emulate=maybe": "float8.emulate",
    }
    for arg, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["--float8.enable=true", arg])
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--float8.enable=true", "--float8.recipe=rowwise",
                           "--float8.precompute_scale=true",
                           "--float8.enable_fsdp_float8_all_gather=true",
                           "--parallelism.zero_stage=1"])
    text = "\n".join(e.value.problems)
    assert "recipe = 'rowwise'" in text and "zero_stage = 1" in text
    with pytest.raises(ConfigError, match="precompute_scale"):
        load_config(None, ["--float8.enable=true", "--float8.precompute_scale=true"])
    with pytest.raises(ConfigError, match="blockwise"):
        load_config(None, ["--float8.enable=true", "--float8.recipe=blockwise",
                           "--parallelism.tensor_parallel_degree=2"], world_size=2)


# -- composition -----------------------------------------------------------------------------------


def _grads(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(tokens).float().square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_activation_checkpointing_recomputes_the_same_float8_numerics(recipe):
    from titanext.plugins.activation_checkpoint import apply_activation_checkpointing

    grads = []
    for mode in ("none", "full"):
        model = _debug_model()
        apply_float8(model, recipe=recipe, filter_fqns=["output"])
        apply_activation_checkpointing(model, mode=mode)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
        grads.append(_grads(model, tokens))
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=0)


@pytest.mark.torch_seam
def test_torch_compile_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 64, bias=False))
    apply_float8(model)
    x = torch.randn(32, 64)
    eager = model(x)
    # keyed by the vector ISA, as titanext compiles (inductor's cache shared by kernel paths)
    compiled = torch.compile(model, backend="inductor",
                             options=inductor_cache_options("inductor"))(x)
    assert sqnr(eager, compiled) > 40


def test_float8_tp_plan_uses_torchao_styles_only_for_tensorwise_blocks():
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from titanext.plugins.float8 import supports_float8_tp
    from titanext.plugins.tensor_parallel import llama_tp_plan

    plan = llama_tp_plan(float8=True)
    assert isinstance(plan["layers.*.attention.wq"], Float8ColwiseParallel)
    assert isinstance(plan["layers.*.feed_forward.w2"], Float8RowwiseParallel)
    assert type(plan["output"]).__name__ == "ColwiseParallel"  # the head stays high precision
    linears = [f"layers.{i}.{n}" for i in (0, 1) for n in BLOCK_LINEARS]
    for recipe, expected in (("tensorwise", True), ("rowwise", False)):
        model = _debug_model()
        apply_float8(model, recipe=recipe, filter_fqns=["output"])
        assert supports_float8_tp(model, linears) is expected
    model = _debug_model()
    apply_float8(model, filter_fqns=["output", "layers.1.attention.wq"])
    assert not supports_float8_tp(model, linears)


def test_the_planner_resolves_auto_filter_for_the_device_it_plans(monkeypatch):
    """A plan for an H100 converts what the trainer converts on an H100 (torchao's size rule),
    wherever the planner runs; a plan for a device without float8 tensor cores emulates and
    converts every eligible linear (rowwise keeps only the 1B's w1 and w3 on float8 hardware)."""
    from titanext.config import load_config
    from titanext.planning.estimate import plan_config
    from titanext.planning.hardware import DEVICES
    from titanext.planning.layout import resolve_layout

    cfg = load_config(None, ["--model.flavor=1B", "--float8.enable=true",
                             "--float8.recipe=rowwise", "--training.dataset=synthetic"],
                      world_size=1)

    def converted(**kw):
        return [lin.name for lin in resolve_layout(cfg, 1, **kw).linears if lin.float8]

    assert converted(float8_hardware=True) == ["feed_forward.w1", "feed_forward.w3"]
    assert len(converted(float8_hardware=False)) == 7
    import titanext.planning.layout as layout_module

    calls, real = [], layout_module._auto_filter
    monkeypatch.setattr(layout_module, "_auto_filter",
                        lambda f8, hw: calls.append(hw) or real(f8, hw))
    for name in ("h100", "a100"):
        plan_config(cfg, 1, device=DEVICES[name])
    assert calls == [True, False]  # each plan resolves the rule for its own device


def test_the_planner_counts_a_moe_blocks_own_linears_in_float8():
    """The converter swaps every eligible linear of a MoE block too (attention, shared experts;
    the router gate and the grouped experts are not linears it takes): the plan's MoE block says
    the same, not bf16."""
    from titanext.config import load_config
    from titanext.planning.layout import resolve_layout

    cfg = load_config(None, ["--model.flavor=deepseek_v3_16b", "--float8.enable=true",
                             "--training.dataset=synthetic", "--training.seq_len=512"],
                      world_size=1)
    moe = {lin.name: lin.float8 for lin in resolve_layout(cfg, 1, float8_hardware=True).moe_linears}
    assert moe["moe.shared_experts.w1"] and moe["attention.wo"]
    assert not moe["moe.router.gate"] and not moe["moe.experts.w1"]
