"""titanext.config.schema: the section dataclasses (a docstring for every key, names that shadow
no runtime class, defaults that are real) and the per-field checks.

Every test is in-process and fast: loading a config never starts a process group.
"""

from __future__ import annotations

import pytest

from tests.unit.config.helpers import ROOT, all_keys, problems_of, the_problem, write
from titanext.config import SECTIONS, field_docs

# -- documentation ------------------------------------------------------------------------------

@pytest.mark.parametrize("section,key", all_keys())
def test_every_key_has_a_docstring(section, key):
    assert field_docs()[(section, key)].strip(), f"{section}.{key} needs an attribute docstring"


# -- per-field checks ---------------------------------------------------------------------------

@pytest.mark.parametrize("override,expected", [
    ("--model.tokenizer=tiktoken",
     "model.tokenizer = 'tiktoken' is not allowed; choose one of 'byte'"),
    ("--training.local_batch_size=0",
     "training.local_batch_size = 0 is out of range; it must be >= 1"),
    ("--training.global_batch_size=0",
     "training.global_batch_size = 0 is not allowed; allowed: -1 or"),
    ("--training.global_batch_size=-2", "training.global_batch_size = -2 is not allowed"),
    ("--training.seq_len=0", "training.seq_len = 0 is out of range; it must be >= 1"),
    ("--training.steps=0", "training.steps = 0 is out of range; it must be >= 1"),
    ("--training.max_norm=-0.5", "training.max_norm = -0.5 is out of range; it must be >= 0"),
    ("--training.mixed_precision_param=fp16",
     "training.mixed_precision_param = 'fp16' is not allowed; choose one of 'auto', "
     "'bfloat16', 'float32'"),
    ("--training.mixed_precision_reduce=float16",
     "training.mixed_precision_reduce = 'float16' is not allowed; choose one of "
     "'float32', 'bfloat16'"),
    ("--training.seed=-1", "training.seed = -1 is out of range; it must be >= 0"),
    ("--training.dataset=shakespear",
     "training.dataset = 'shakespear' is not allowed; choose one of "
     "'shakespeare', 'text', 'tokens', 'synthetic', 'hf'; did you mean 'shakespeare'?"),
    ("--optimizer.name=adamw", "optimizer.name = 'adamw' is not allowed; choose one of 'AdamW', "
     "'Adam', 'Muon'; did you mean 'AdamW'?"),
    ("--optimizer.lr=0", "optimizer.lr = 0.0 is out of range; it must be > 0"),
    ("--optimizer.beta1=1", "optimizer.beta1 = 1.0 is out of range; it must be >= 0 and < 1"),
    ("--optimizer.beta2=-0.1", "optimizer.beta2 = -0.1 is out of range; it must be >= 0 and < 1"),
    ("--optimizer.eps=0", "optimizer.eps = 0.0 is out of range; it must be > 0"),
    ("--optimizer.weight_decay=-1",
     "optimizer.weight_decay = -1.0 is out of range; it must be >= 0"),
    ("--optimizer.implementation=fast", "optimizer.implementation = 'fast' is not allowed; choose "
     "one of 'for-loop', 'foreach', 'fused'"),
    ("--lr_scheduler.warmup_steps=-1",
     "lr_scheduler.warmup_steps = -1 is out of range; it must be >= 0"),
    ("--lr_scheduler.decay_ratio=1.5",
     "lr_scheduler.decay_ratio = 1.5 is out of range; it must be >= 0 and <= 1"),
    ("--lr_scheduler.decay_type=exp",
     "lr_scheduler.decay_type = 'exp' is not allowed; choose one of "
     "'linear', 'sqrt', 'cosine'"),
    ("--lr_scheduler.min_lr_factor=2",
     "lr_scheduler.min_lr_factor = 2.0 is out of range; it must be >= 0 and <= 1"),
    ("--parallelism.data_parallel_replicate_degree=0",
     "parallelism.data_parallel_replicate_degree = 0 is out of range; it must be >= 1"),
    ("--parallelism.data_parallel_shard_degree=0",
     "parallelism.data_parallel_shard_degree = 0 is not allowed; allowed: -1 or an integer >= 1"),
    ("--parallelism.data_parallel_shard_degree=-2",
     "parallelism.data_parallel_shard_degree = -2 is not allowed; allowed: -1 or an integer >= 1"),
    ("--parallelism.fsdp_reshard_after_forward=sometimes",
     "parallelism.fsdp_reshard_after_forward = 'sometimes' is not allowed; choose one "
     "of 'default', "
     "'always', 'never'"),
    ("--parallelism.zero_stage=4",
     "parallelism.zero_stage = 4 is not allowed; choose one of 1, 2, 3"),
    ("--parallelism.tensor_parallel_degree=0",
     "parallelism.tensor_parallel_degree = 0 is out of range; it must be >= 1"),
    ("--parallelism.context_parallel_degree=0",
     "parallelism.context_parallel_degree = 0 is out of range; it must be >= 1"),
    ("--parallelism.pipeline_parallel_degree=0",
     "parallelism.pipeline_parallel_degree = 0 is out of range; it must be >= 1"),
    ("--parallelism.expert_parallel_degree=0",
     "parallelism.expert_parallel_degree = 0 is out of range; it must be >= 1"),
    ("--activation_checkpoint.mode=partial",
     "activation_checkpoint.mode = 'partial' is not allowed; "
     "choose one of 'none', 'selective', 'full'"),
    ("--activation_checkpoint.selective_ac_option=x",
     "activation_checkpoint.selective_ac_option = 'x' is not allowed; allowed: 'op' or a positive"),
    ("--activation_checkpoint.selective_ac_option=0",
     "activation_checkpoint.selective_ac_option = '0' is not allowed; allowed: 'op' or a positive"),
    ("--activation_checkpoint.selective_op_save_list=mm,not_an_op",
     "activation_checkpoint.selective_op_save_list = ['mm', 'not_an_op'] is not allowed; allowed: "
     "aten op names only; 'not_an_op' is not torch.ops.aten.not_an_op"),
    ("--compile.components=model,los", "compile.components = ['model', 'los'] is not allowed; "
     "allowed: any of 'model', 'loss'; 'los' is not one of them; did you mean 'loss'?"),
    ("--compile.backend=tvm", "compile.backend = 'tvm' is not allowed; choose one of 'inductor', "
     "'aot_eager', 'eager'"),
    ("--checkpoint.interval=0", "checkpoint.interval = 0 is out of range; it must be >= 1"),
    ("--checkpoint.load_step=-1", "checkpoint.load_step = -1 is not allowed; allowed: 'latest', "
     "'none' or a step number >= 0"),
    ("--checkpoint.load_step=newest", "checkpoint.load_step = 'newest' is not allowed"),
    ("--checkpoint.keep_latest_k=-1",
     "checkpoint.keep_latest_k = -1 is out of range; it must be >= 0"),
    ("--metrics.log_freq=0", "metrics.log_freq = 0 is out of range; it must be >= 1"),
    ("--comm.init_timeout_seconds=0",
     "comm.init_timeout_seconds = 0 is out of range; it must be >= 1"),
    ("--comm.train_timeout_seconds=0",
     "comm.train_timeout_seconds = 0 is out of range; it must be >= 1"),
    ("--model.name=lama3", "model.name = 'lama3' is not a known model; choose one of 'llama3'; "
     "did you mean 'llama3'?"),
    ("--model.flavor=8b", "model.flavor = '8b' is not a flavor of model 'llama3'; choose one of"),
])
def test_field_rule_names_key_value_and_what_is_allowed(override, expected):
    assert expected in the_problem([override])


def test_model_flavor_hint():
    assert the_problem(["--model.flavor=8b"]).endswith("did you mean '8B'?")
    assert the_problem(["--model.flavor=debugmdoel"]).endswith("did you mean 'debugmodel'?")


def test_load_step_written_as_a_quoted_number_gets_a_hint(tmp_path):
    path = write(tmp_path, "c.toml", '[checkpoint]\nload_step = "5"\n')
    assert "without quotes" in the_problem(path=path)


@pytest.mark.parametrize("override", [
    "--training.max_norm=0", "--checkpoint.keep_latest_k=1", "--checkpoint.load_step=0",
    "--activation_checkpoint.selective_ac_option=2", "--lr_scheduler.decay_ratio=0",
    "--lr_scheduler.decay_ratio=1", "--lr_scheduler.warmup_steps=0", "--optimizer.beta1=0",
    "--compile.components=", "--compile.components=loss",
])
def test_edge_values_that_are_allowed(override):
    assert problems_of([override]) == []


# -- the package stays light and names stay unambiguous ------------------------------------------

def test_schedule_names_known_without_importing_schedules_are_real():
    from titanext.config import field_rules
    from titanext.schedules import SCHEDULE_NAMES

    assert set(field_rules._KNOWN_SCHEDULES) <= set(SCHEDULE_NAMES)


def test_default_save_ops_are_aten_ops():
    import torch

    from titanext.plugins.rules import DEFAULT_SAVE_OPS

    # The config skips the aten lookup for the defaults, so they must be real ops.
    assert all(hasattr(torch.ops.aten, name) for name in DEFAULT_SAVE_OPS)


def test_no_section_class_shadows_a_runtime_class():
    import ast

    import torch

    runtime = {node.name for path in (ROOT / "titanext").rglob("*.py")
               if "config" not in path.relative_to(ROOT / "titanext").parts
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
    for module in (torch.nn, torch.optim, torch.optim.lr_scheduler):
        runtime |= {name for name in dir(module) if isinstance(getattr(module, name), type)}
    sections = {cls.__name__ for cls in SECTIONS.values()}
    assert not sections & runtime, sorted(sections & runtime)
    assert SECTIONS["moe"].__name__ == "MoEConfig"
