"""Recompute by module (``[activation_checkpoint] mode = "modules"``,
titanext.plugins.recompute_modules), in one process (fp32 CPU):

- every choice, on the DeepSeek-V3 debug model (MLA, a dense block, routed + shared experts) and
  on the GQA MoE one, gives bitwise the losses and gradients of no recompute, also with deferred
  weight gradients (a zero-bubble schedule's W step) and with a split backward that reads the
  recomputed tensors twice;
- only the named parts' tensors leave memory: the saved activations after the forward fall by
  exactly the bytes of the norms' (layernorm) and SwiGLU's (moe_act) outputs and intermediates,
  and by something for every other choice;
- names are checked: unknown, absent from the model, or without mode = "modules" are errors,
  in Python and in the config (one line each);
- ``full_blocks``: the first blocks fully checkpointed, the rest by module: bitwise, and the
  saved bytes between the two recipes.

The multi-process layouts (EP x PP, FSDP, two-level dispatch with hot-expert copies, DualPipe)
are in tests/multiprocess/test_recompute_no_redispatch.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from titanext._fake_backend import mem_tracker
from titanext.config import ConfigError, load_config
from titanext.config.layout import Recipe, recipe_from_config
from titanext.models import build_model, get_model_args
from titanext.plugins.activation_checkpoint import apply_activation_checkpointing
from titanext.plugins.recompute_modules import recompute_modules
from titanext.plugins.weight_grad import WeightGradQueue, defer_weight_grads, weight_grad_deferral

ALL = ("layernorm", "mla_up_proj", "core_attn", "moe_act", "mlp", "shared_experts")
GQA_MOE = tuple(n for n in ALL if n != "mla_up_proj")


def _model(flavor: str, names: tuple[str, ...] = (), defer: bool = False):
    torch.manual_seed(0)
    args = get_model_args("llama3", flavor)
    model = build_model("llama3", args, device="cpu")
    model.init_weights(seed=3)
    if defer:
        defer_weight_grads(model)
    if names:
        apply_activation_checkpointing(model, mode="modules", recompute_modules=names)
    return model, args


def _step(model, tokens, defer: bool = False, split: bool = False):
    """(loss, {name: grad}) of one forward and backward; ``defer``: inside a deferral context,
    the queued weight GEMMs run after it; ``split``: input gradients first, then the parameters'
    with the graph kept (a split backward reads every saved tensor twice)."""
    queue = WeightGradQueue() if defer else None
    with weight_grad_deferral(queue) if defer else contextlib.nullcontext():
        loss = model(tokens).float().square().mean()
        if split:
            params = [p for p in model.parameters() if p.requires_grad]
            h = model.tok_embeddings.weight
            torch.autograd.grad(loss, [h], retain_graph=True)
            for p, g in zip(params, torch.autograd.grad(loss, params), strict=True):
                p.grad = g
        else:
            loss.backward()
    if queue is not None:
        queue.run()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_bitwise(ref, got, what):
    assert torch.equal(ref[0], got[0]), (what, ref[0], got[0])
    bad = [n for n in ref[1] if not torch.equal(ref[1][n], got[1][n])]
    assert not bad, f"{what}: gradients differ from no recompute: {bad}"


@pytest.mark.parametrize("flavor,names", [("debugdeepseek", ALL), ("debugmoe", GQA_MOE)])
def test_recompute_by_module_is_bitwise_no_recompute(flavor, names):
    tokens = torch.randint(0, 200, (2, 32))
    for defer, split in ((False, False), (True, False), (False, True)):
        ref = _step(_model(flavor, defer=defer)[0], tokens, defer, split)
        got = _step(_model(flavor, names, defer=defer)[0], tokens, defer, split)
        _assert_bitwise(ref, got, (flavor, names, defer, split))


def test_full_blocks_mix_full_and_module_recompute():
    """``full_blocks = n``: the first n blocks fully checkpointed, the rest by module; bitwise no
    recompute, and the saved bytes step from recompute by module (n = 0) down to full AC (n =
    every block, exactly its bytes)."""
    tokens = torch.randint(0, 200, (2, 32))
    ref = _step(_model("debugdeepseek")[0], tokens)
    saved = []
    for n in range(4):
        model, _ = _model("debugdeepseek")
        apply_activation_checkpointing(model, mode="modules", recompute_modules=ALL, full_blocks=n)
        _assert_bitwise(ref, _step(model, tokens), ("full_blocks", n))
        saved.append(_saved_after_forward(model, tokens))
    full, _ = _model("debugdeepseek")
    apply_activation_checkpointing(full, mode="full")
    assert saved[0] > saved[1] > saved[2] > saved[3] == _saved_after_forward(full, tokens), saved
    with pytest.raises(ValueError, match="full_blocks = 1 with mode = 'full'"):
        apply_activation_checkpointing(full, mode="full", full_blocks=1)
    with pytest.raises(ValueError, match="full_blocks = -1"):
        Recipe(ac="modules", recompute_modules=("mlp",), ac_full_blocks=-1)
    ac = "--activation_checkpoint."
    assert _problems(ac + "full_blocks=2") == [
        "activation_checkpoint.full_blocks = 2 only applies with mode = 'modules', but mode = "
        "'none'; set mode = 'modules' or full_blocks = 0"]
    assert _problems(ac + "mode=modules", ac + "full_blocks=1", ac + "keep_all_to_all=true") == []


def _saved_after_forward(model, tokens) -> int:
    """Activation bytes alive after the forward (what the backward will read)."""
    tracker = mem_tracker()
    tracker.track_external(model)
    with tracker:
        out = model(tokens)
        snap = tracker.get_tracker_snapshot("current")
        out.float().square().mean().backward()
    return sum(v.get("Activation", 0) for v in snap.values() if isinstance(v, dict))


def test_only_the_named_parts_leave_memory():
    batch, seq = 2, 64
    tokens = torch.randint(0, 200, (batch, seq))
    base = _saved_after_forward(_model("debugdeepseek")[0], tokens)
    saved = {n: base - _saved_after_forward(_model("debugdeepseek", (n,))[0], tokens)
             for n in ALL}
    args = get_model_args("llama3", "debugdeepseek")
    tokens_n, f32 = batch * seq, 4
    # each of the 3 blocks' 2 RMSNorms kept x * rsqrt and its output [T, dim], and rsqrt [T, 1]
    assert saved["layernorm"] == 3 * 2 * (2 * tokens_n * args.dim + tokens_n) * f32, saved
    # each MoE block's experts kept the weighted silu(gate) * up [T * top_k, hidden] (w2's
    # input; the weighted SwiGLU itself keeps only gate, up and the weights, which stay)
    moe = args.moe
    rows = tokens_n * moe.top_k
    assert saved["moe_act"] == (args.n_layers - 1) * rows * moe.hidden_dim * f32, saved
    assert all(v > 0 for v in saved.values()), saved


def test_names_are_checked():
    model, _ = _model("debugmoe")
    with pytest.raises(ValueError, match="names 'mla_up_proj', but no block of Transformer"):
        recompute_modules(model, ["layernorm", "mla_up_proj"])
    with pytest.raises(ValueError, match="unknown 'norms'"):
        recompute_modules(model, ["norms"])
    with pytest.raises(ValueError, match="mode = 'full' with recompute_modules"):
        apply_activation_checkpointing(model, mode="full", recompute_modules=["mlp"])
    assert recompute_modules(_model("debugtiny")[0], ["mla_up_proj"], required=False) == {
        "mla_up_proj": 0}
    with pytest.raises(ValueError, match="needs ac = 'modules'"):
        Recipe(recompute_modules=("mlp",))
    with pytest.raises(ValueError, match="ac = 'modules' needs recompute_modules"):
        Recipe(ac="modules")


def _problems(*overrides: str) -> list[str]:
    try:
        load_config(None, list(overrides))
    except ConfigError as e:
        return e.problems
    return []


def test_config_rules_and_the_resolved_default():
    ac = "--activation_checkpoint."
    moe, ds = "--model.flavor=debugmoe", "--model.flavor=debugdeepseek"
    assert _problems(moe, ac + "recompute_modules=mlp") == [
        "activation_checkpoint.recompute_modules = ['mlp'] only applies with mode = 'modules', "
        "but mode = 'none'; set mode = 'modules' or remove recompute_modules"]
    got = _problems(moe, ac + "mode=modules", ac + "recompute_modules=mla_up_proj,shared_expert")
    assert len(got) == 1 and "'shared_expert' is not one of them" in got[0], got
    got = _problems("--model.flavor=debugmodel", ac + "mode=modules",
                    ac + "recompute_modules=mla_up_proj,moe_act")
    assert [p.split(",")[0] for p in got] == [
        "activation_checkpoint.recompute_modules names 'mla_up_proj'",
        "activation_checkpoint.recompute_modules names 'moe_act'"], got
    got = _problems(ds, ac + "mode=modules", ac + "recompute_modules=core_attn",
                    "--parallelism.context_parallel_degree=2")
    assert len(got) == 1 and "context parallelism's exchanges" in got[0], got
    got = _problems(ds, ac + "mode=modules", ac + "keep_all_to_all=true")
    assert len(got) == 1 and "never recomputes an all-to-all" in got[0], got
    resolved = {flavor: recipe_from_config(load_config(None, [f"--model.flavor={flavor}",
                                                              ac + "mode=modules"])).recompute
                for flavor in ("debugmodel", "debugmoe", "debugdeepseek")}
    assert resolved == {"debugmodel": "modules:layernorm",
                        "debugmoe": "modules:layernorm+moe_act",
                        "debugdeepseek": "modules:layernorm+mla_up_proj+moe_act"}, resolved


def test_compiled_blocks_keep_the_regions_eager_and_bitwise():
    """Each part runs between the compiled graphs (aot_eager: the graphs' own saved tensors go
    through the block's handles); losses and gradients are bitwise those of eager mode without
    recompute."""
    from titanext.plugins.compile import apply_compile

    tokens = torch.randint(0, 200, (2, 16))
    got, _ = _model("debugmoe", GQA_MOE)
    apply_compile(got, backend="aot_eager", fullgraph=False)
    _assert_bitwise(_step(_model("debugmoe")[0], tokens), _step(got, tokens), "aot_eager")
