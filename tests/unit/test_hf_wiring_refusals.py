"""What the zoo found WRONG after the adapters' first round is refused by name at wiring time:
a pipeline stage whose model's own forward reaches into a part another stage holds (RWKV reads
a skipped block's attributes; OPT's later stage computes something else), transformers experts
called or activated otherwise than titanext's EP experts replace (Llama 4, Inkling 2), an MLA
config without one rope dim (dots3). Each raises a ValueError before anything trains."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def _split(model_type: str, stage_index: int, probe: bool = True):
    from titanext.distributed.split import split_model
    from titanext.hf.transformers import stage_ends
    from titanext.hf.zoo.cells import block_path
    from titanext.hf.zoo.configs import build_tiny

    model = build_tiny(model_type)
    path = block_path(model)
    first, last = stage_ends(model, path.split("."))
    return split_model(model, [1, 1], stage_index, blocks=path, first=first, last=last,
                       skip_missing=True, probe=probe)


def test_a_stage_that_crashes_on_the_probe_batch_is_refused_naming_the_error():
    with pytest.raises(ValueError, match=r"split_model: stage 0 of RwkvForCausalLM .*fails on a "
                                         r"probe batch .*AttributeError"):
        _split("rwkv", 0)
    _split("rwkv", 0, probe=False)  # the probe, not the split, refuses it


def test_a_stage_that_computes_something_else_is_refused_naming_the_module():
    with pytest.raises(ValueError, match=r"split_model: stage 1 of OPTForCausalLM .*the first "
                                         r"module that differs is model\.decoder"):
        _split("opt", 1)
    assert _split("llama", 1) is not None  # an exact split passes its probe


@pytest.mark.parametrize("model_type, why", [
    ("llama4_text", r"is called as forward\(hidden_states\)"),
    ("inkling2_text", r"act_fn \(.*\) takes 2 inputs"),
])
def test_ep_refuses_experts_it_would_call_otherwise(model_type, why):
    from titanext.hf.transformers import apply_hf_expert_parallel
    from titanext.hf.zoo.configs import build_tiny

    model = build_tiny(model_type)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=why):
        apply_hf_expert_parallel(model, None)  # refused before any mesh is touched
    assert all(p.equal(before[n]) for n, p in model.named_parameters())  # nothing changed


def test_tp_refuses_an_mla_config_without_one_rope_dim():
    from titanext.hf.transformers import hf_tp_plan
    from titanext.hf.zoo.configs import build_tiny

    with pytest.raises(ValueError, match="gives no one qk_rope_head_dim"):
        hf_tp_plan(build_tiny("dots3_note_text"))
