"""titanext.config: parsing, inheritance, CLI overrides, per-field and cross-field validation.

Every test is in-process and fast: loading a config never starts a process group.
"""

from __future__ import annotations

import dataclasses
import doctest
import pickle
from pathlib import Path

import pytest

import titanext.config as config_mod
import titanext.config._values as values_mod
import titanext.config.degrees as degrees_mod
import titanext.config.loader as loader_mod
import titanext.config.rules as rules_mod
import titanext.config.schema as schema_mod
from titanext.config import (
    SECTIONS,
    ConfigError,
    JobConfig,
    check_config,
    config_help,
    field_docs,
    gradient_accumulation_steps,
    load_config,
    parse_cli,
    resolved_dp_shard,
    to_toml,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "train_configs"
SHIPPED = [("debug_model.toml", 4), ("llama3_8b.toml", 8), ("llama3_70b.toml", 64)]


def problems_of(args=(), world_size=None, path=None) -> list[str]:
    """The problem lines load_config reports (an empty list when the config is valid)."""
    try:
        load_config(None if path is None else str(path), list(args), world_size=world_size)
    except ConfigError as e:
        return e.problems
    return []


def the_problem(args=(), world_size=None, path=None) -> str:
    """The single problem a config has (fails if it has none or several)."""
    found = problems_of(args, world_size, path)
    assert len(found) == 1, found
    return found[0]


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def all_keys():
    return [(s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


# -- documentation ------------------------------------------------------------------------------

@pytest.mark.parametrize("section,key", all_keys())
def test_every_key_has_a_docstring(section, key):
    assert field_docs()[(section, key)].strip(), f"{section}.{key} needs an attribute docstring"


def test_help_lists_every_key_with_type_default_and_docstring():
    text = config_help()
    docs = field_docs()
    for section, key in all_keys():
        line = next((ln for ln in text.splitlines()
                     if ln.strip().startswith(f"--{section}.{key} ")),
                    None)
        assert line is not None, f"--{section}.{key} missing from --help"
        assert "default" in line
        # The docstring's first words appear (wrapped text keeps word order).
        assert " ".join(docs[(section, key)].split()[:3]) in " ".join(text.split())
    for section in SECTIONS:
        assert f"[{section}]" in text


def test_help_shows_allowed_values():
    text = " ".join(config_help().split())
    assert "--parallelism.zero_stage (integer, default 3; one of 1, 2, 3)" in text
    assert "--optimizer.beta1 (number, default 0.9; >= 0 and < 1)" in text


@pytest.mark.parametrize("module", [config_mod, schema_mod, loader_mod, rules_mod, values_mod,
                                    degrees_mod])
def test_module_doctests(monkeypatch, module):
    monkeypatch.chdir(ROOT)  # the examples name train_configs/ relative to the repo
    result = doctest.testmod(module, verbose=False)
    assert result.failed == 0 and result.attempted >= 1


def test_package_doctests_cover_what_the_module_did():
    # config.py had more than 5 doctest examples; the package keeps at least as many.
    attempted = sum(doctest.testmod(m, verbose=False).attempted
                    for m in (config_mod, schema_mod, loader_mod, rules_mod, values_mod))
    assert attempted > 5


# -- shipped configs ----------------------------------------------------------------------------

@pytest.mark.parametrize("name,world_size", SHIPPED)
def test_shipped_configs_validate(name, world_size):
    cfg = load_config(str(CONFIGS / name), world_size=world_size)
    assert resolved_dp_shard(cfg, world_size) >= 1


def test_shipped_config_details():
    debug = load_config(str(CONFIGS / "debug_model.toml"), world_size=4)
    assert (debug.model.name, debug.model.flavor, debug.training.dataset) == \
        ("llama3", "debugmodel", "shakespeare")
    assert (debug.training.steps, debug.metrics.log_freq) == (50, 5)
    assert debug.parallelism.data_parallel_shard_degree == -1
    assert (debug.optimizer.lr, debug.lr_scheduler.warmup_steps) == (8e-4, 2)
    assert debug.lr_scheduler.decay_type == "linear"
    assert not debug.checkpoint.enable and debug.metrics.enable_tensorboard
    assert resolved_dp_shard(debug, 4) == 4

    big = load_config(str(CONFIGS / "llama3_8b.toml"), world_size=8)
    assert big.model.flavor == "8B" and big.training.seq_len == 8192
    assert big.activation_checkpoint.mode == "selective" and big.compile.enable
    assert gradient_accumulation_steps(big, 8) == 32 // (2 * 4)

    huge = load_config(str(CONFIGS / "llama3_70b.toml"), world_size=64)
    assert huge.model.flavor == "70B" and huge.parallelism.tensor_parallel_degree == 8
    assert huge.activation_checkpoint.mode == "full"
    assert resolved_dp_shard(huge, 64) == 8


def test_70b_config_needs_whole_tp_groups():
    problem = the_problem(world_size=4, path=CONFIGS / "llama3_70b.toml")
    assert "cannot fill the rest of the world size 4" in problem
    assert "tensor_parallel_degree(8)" in problem


# -- round trip ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,world_size", SHIPPED)
def test_to_toml_round_trips_shipped_configs(tmp_path, name, world_size):
    cfg = load_config(str(CONFIGS / name), world_size=world_size)
    again = load_config(str(write(tmp_path, "resolved.toml", to_toml(cfg))), world_size=world_size)
    assert again == cfg


def test_to_toml_round_trips_unusual_values(tmp_path):
    overrides = ["--job.description=quotes \" and \\ back\\slash, tab\t, ünïcode",
                 "--lr_scheduler.decay_ratio=0.25", "--checkpoint.load_step=7",
                 "--optimizer.eps=1e-12", "--compile.components=model,loss",
                 "--activation_checkpoint.selective_op_save_list=mm,bmm",
                 "--training.max_norm=0", "--metrics.progress_bar=false"]
    cfg = load_config(None, overrides)
    again = load_config(str(write(tmp_path, "resolved.toml", to_toml(cfg))))
    assert again == cfg
    assert again.checkpoint.load_step == 7 and again.lr_scheduler.decay_ratio == 0.25


def test_to_toml_drops_extends_because_inheritance_is_resolved(tmp_path):
    write(tmp_path, "base.toml", "[training]\nsteps = 7\n")
    child = write(tmp_path, "child.toml", '[job]\nextends = "base.toml"\n')
    cfg = load_config(str(child))
    text = to_toml(cfg)
    assert "extends" not in text.replace("inheritance", "")
    again = load_config(str(write(tmp_path, "resolved.toml", text)))
    assert again.training.steps == 7
    assert dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, extends=None)) == again


# -- inheritance --------------------------------------------------------------------------------

def test_extends_merges_key_by_key(tmp_path):
    write(tmp_path, "base.toml", "[training]\nsteps = 7\nseq_len = 128\n[optimizer]\nlr = 0.01\n")
    child = write(tmp_path, "child.toml",
                  '[job]\nextends = "base.toml"\n[training]\nsteps = 9\n')
    cfg = load_config(str(child))
    assert (cfg.training.steps, cfg.training.seq_len, cfg.optimizer.lr) == (9, 128, 0.01)


def test_extends_multi_level_with_paths_relative_to_each_file(tmp_path):
    write(tmp_path, "common/root.toml", "[training]\nsteps = 1\nseed = 5\nlocal_batch_size = 2\n")
    write(tmp_path, "common/mid.toml",
          '[job]\nextends = "root.toml"\n[training]\nsteps = 2\nseq_len = 64\n')
    leaf = write(tmp_path, "exp/leaf.toml",
                 '[job]\nextends = "../common/mid.toml"\n[training]\nsteps = 3\n')
    cfg = load_config(str(leaf))
    t = cfg.training
    assert (t.steps, t.seq_len, t.seed, t.local_batch_size) == (3, 64, 5, 2)
    assert cfg.job.extends == "../common/mid.toml"


def test_cli_overrides_beat_every_file(tmp_path):
    write(tmp_path, "base.toml", "[training]\nsteps = 7\n")
    child = write(tmp_path, "child.toml", '[job]\nextends = "base.toml"\n[training]\nsteps = 8\n')
    assert load_config(str(child), ["--training.steps=9"]).training.steps == 9


def test_extends_cycle_is_an_error(tmp_path):
    write(tmp_path, "a.toml", '[job]\nextends = "b.toml"\n')
    write(tmp_path, "b.toml", '[job]\nextends = "a.toml"\n')
    problem = the_problem(path=tmp_path / "a.toml")
    assert "job.extends" in problem and "cycle" in problem
    assert "a.toml" in problem and "b.toml" in problem


def test_extends_self_is_a_cycle(tmp_path):
    path = write(tmp_path, "self.toml", '[job]\nextends = "self.toml"\n')
    assert "cycle" in the_problem(path=path)


def test_missing_base_file_names_the_extends_entry(tmp_path):
    child = write(tmp_path, "child.toml", '[job]\nextends = "nope.toml"\n')
    problem = the_problem(path=child)
    assert "job.extends = 'nope.toml'" in problem and "does not exist" in problem


def test_extends_must_be_a_string(tmp_path):
    child = write(tmp_path, "child.toml", "[job]\nextends = 3\n")
    assert any("job.extends = 3" in p for p in problems_of(path=child))


def test_problems_in_a_base_file_are_reported(tmp_path):
    write(tmp_path, "base.toml", "[training]\nstepz = 7\n")
    child = write(tmp_path, "child.toml", '[job]\nextends = "base.toml"\n')
    assert "unknown key 'training.stepz'" in the_problem(path=child)


def test_extends_cannot_be_overridden_on_the_command_line():
    problem = the_problem(["--job.extends=base.toml"])
    assert "job.extends" in problem and "command line" in problem


def test_missing_and_malformed_files(tmp_path):
    assert "does not exist" in the_problem(path=tmp_path / "missing.toml")
    bad = write(tmp_path, "bad.toml", "[training\nsteps = 1\n")
    problem = the_problem(path=bad)
    assert "bad.toml" in problem and "not valid TOML" in problem


def test_a_key_given_twice_is_named_with_its_table_and_lines(tmp_path):
    # tomllib alone says "Cannot overwrite a value (at line 10, column 6)".
    path = write(tmp_path, "twice.toml", '[job]\ndump_folder = "out"\n\n[training]\nsteps = 10\n'
                 'seq_len = 128\nnotes = """\nsteps = 3\n"""\nsteps = 20\n')
    assert the_problem(path=path) == (f"{path}: line 10: key 'steps' in [training] is given "
                                      "twice (first on line 5); keep one")
    # quoted and bare spellings are the same key; the last line needs no newline
    path = write(tmp_path, "quoted.toml", '[parallelism]\n"zero_stage" = 2\nzero_stage = 3')
    assert "line 3: key 'zero_stage' in [parallelism] is given twice (first on line 2)" \
        in the_problem(path=path)
    path = write(tmp_path, "tables.toml", "[training]\nsteps = 1\n\n[training]\nseq_len = 64\n")
    assert the_problem(path=path) == (f"{path}: line 4: table [training] is given twice (first "
                                      "on line 1); merge the two into one [training]")
    # the same key in two tables is fine
    path = write(tmp_path, "ok.toml", "[float8]\nenable = false\n[compile]\nenable = false\n")
    assert problems_of(path=path) == []


def test_a_key_given_twice_in_a_base_file_names_the_extends_entry(tmp_path):
    write(tmp_path, "base.toml", "[training]\nsteps = 1\nsteps = 2\n")
    child = write(tmp_path, "child.toml", '[job]\nextends = "base.toml"\n')
    problem = the_problem(path=child)
    assert problem.startswith("job.extends = 'base.toml' in ")
    assert "line 3: key 'steps' in [training] is given twice" in problem


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n", "\n\n"])
def test_an_empty_config_file_is_an_error_not_a_run_on_the_defaults(tmp_path, text):
    path = write(tmp_path, "empty.toml", text)
    problem = the_problem(path=path)
    assert problem.startswith(f"config file {str(path)!r} is empty: it sets no [section]")
    # an empty base file is as suspicious as an empty child
    child = write(tmp_path, "child.toml", '[job]\nextends = "empty.toml"\n')
    assert "is empty" in the_problem(path=child)


# -- CLI overrides ------------------------------------------------------------------------------

def test_override_both_syntaxes():
    cfg = load_config(None, ["--training.steps=5", "--training.seq_len", "64",
                             "--parallelism.data_parallel_shard_degree", "-1"])
    assert (cfg.training.steps, cfg.training.seq_len) == (5, 64)
    assert cfg.parallelism.data_parallel_shard_degree == -1


@pytest.mark.parametrize("text,expected", [("true", True), ("false", False), ("1", True),
                                           ("0", False), ("yes", True), ("no", False),
                                           ("True", True), ("NO", False)])
def test_bool_override_spellings(text, expected):
    cfg = load_config(None, [f"--training.deterministic={text}"])
    assert cfg.training.deterministic is expected


def test_bare_bool_override_means_true():
    cfg = load_config(None, ["--checkpoint.enable", "--training.deterministic"])
    assert cfg.checkpoint.enable and cfg.training.deterministic


def test_typed_overrides():
    cfg = load_config(None, ["--optimizer.lr=1", "--compile.components=model, loss",
                             "--checkpoint.load_step=12", "--lr_scheduler.decay_ratio=0.2"])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.compile.components == ["model", "loss"]
    assert cfg.checkpoint.load_step == 12  # int | str: a number becomes an int
    assert cfg.lr_scheduler.decay_ratio == 0.2
    cfg = load_config(None, ["--checkpoint.load_step=none", "--lr_scheduler.decay_ratio=none"])
    assert cfg.checkpoint.load_step == "none"  # int | str: a word stays a string
    assert cfg.lr_scheduler.decay_ratio is None  # Optional: "none" unsets it


@pytest.mark.parametrize("override,expected", [
    ("--training.steps=abc", "training.steps = 'abc' has the wrong type: expected integer"),
    ("--training.steps=2.5", "training.steps = '2.5' has the wrong type: expected integer"),
    ("--optimizer.lr=fast", "optimizer.lr = 'fast' has the wrong type: expected number"),
    ("--training.shuffle=maybe", "training.shuffle = 'maybe' has the wrong type: expected boolean"),
])
def test_override_type_errors_name_key_value_and_type(override, expected):
    assert expected in the_problem([override])


def test_override_unknown_key_and_section():
    assert the_problem(["--parallelism.tensor_paralel_degree=2"]) == (
        "unknown key 'parallelism.tensor_paralel_degree'; did you mean 'tensor_parallel_degree'?")
    assert the_problem(["--traning.steps=2"]) == ("unknown section [traning]; did you mean "
                                                  "'training'?")


@pytest.mark.parametrize("args,expected", [
    (["--training.steps"], "override --training.steps has no value"),
    (["--training.steps", "--training.seq_len=64"], "override --training.steps has no value"),
    (["--training..steps=3"], "is malformed"),
    (["--training.steps.max=3"], "is malformed"),
    (["--.steps=3"], "is malformed"),
    (["steps=3"], "unrecognised argument 'steps=3'"),
])
def test_malformed_overrides_are_config_errors(args, expected):
    with pytest.raises(ConfigError) as info:
        parse_cli(args)
    assert any(expected in p for p in info.value.problems), info.value.problems
    assert any(expected in p for p in problems_of(args))


def test_parse_cli_separates_config_flags_and_overrides():
    path, overrides, flags = parse_cli(["--config", "a.toml", "--training.steps", "5", "-h",
                                        "--metrics.log_freq=2", "--print-config"])
    assert path == "a.toml"
    assert overrides == ["--training.steps=5", "--metrics.log_freq=2"]
    assert flags == {"help": True, "print_config": True}
    path, overrides, flags = parse_cli(["--config=b.toml", "--help"])
    assert (path, overrides, flags) == ("b.toml", [], {"help": True, "print_config": False})
    assert parse_cli([]) == (None, [], {"help": False, "print_config": False})


def test_parse_cli_output_feeds_load_config():
    path, overrides, _ = parse_cli(["--config", str(CONFIGS / "debug_model.toml"),
                                    "--training.steps", "3", "--checkpoint.enable"])
    cfg = load_config(path, overrides, world_size=4)
    assert cfg.training.steps == 3 and cfg.checkpoint.enable


def test_config_without_path_is_an_error():
    with pytest.raises(ConfigError, match="--config needs a file path"):
        parse_cli(["--config"])


def test_load_config_args_take_only_overrides():
    assert "only --section.key overrides" in the_problem(["--config", "x.toml"])


# -- TOML types and unknown names ---------------------------------------------------------------

@pytest.mark.parametrize("toml,expected", [
    ('[training]\nsteps = "ten"\n',
     "training.steps = 'ten' has the wrong type: expected integer, got string"),
    ("[training]\nsteps = true\n",
     "training.steps = true has the wrong type: expected integer, got boolean"),
    ("[training]\nsteps = 10.0\n",
     "training.steps = 10.0 has the wrong type: expected integer, got number"),
    ("[training]\nshuffle = 1\n",
     "training.shuffle = 1 has the wrong type: expected boolean, got integer"),
    ('[compile]\ncomponents = "model"\n',
     "compile.components = 'model' has the wrong type: expected list of string, got string"),
    ("[compile]\ncomponents = [1]\n",
     "compile.components = [1] has the wrong type: expected list of string, got list"),
    ("[checkpoint]\nload_step = 1.5\n",
     "checkpoint.load_step = 1.5 has the wrong type: expected integer or string, got number"),
    ("[lr_scheduler]\ndecay_ratio = \"half\"\n",
     "lr_scheduler.decay_ratio = 'half' has the wrong type: expected number or unset, got string"),
])
def test_toml_type_errors_name_key_value_and_type(tmp_path, toml, expected):
    assert the_problem(path=write(tmp_path, "c.toml", toml)) == expected


def test_int_is_accepted_where_a_float_is_expected(tmp_path):
    cfg = load_config(str(write(tmp_path, "c.toml", "[optimizer]\nlr = 1\nweight_decay = 0\n")))
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert isinstance(cfg.optimizer.weight_decay, float)


def test_unknown_names_in_a_file(tmp_path):
    path = write(tmp_path, "c.toml", "steps = 3\n[parallelism]\ntensor_paralel_degree = 2\n"
                                     "[traning]\nsteps = 1\n[training]\nwarmup_steps = 3\n")
    found = problems_of(path=path)
    assert "unknown key 'parallelism.tensor_paralel_degree'; did you mean " \
           "'tensor_parallel_degree'?" in found
    assert "unknown section [traning]; did you mean 'training'?" in found
    assert "unknown key 'training.warmup_steps'; did you mean 'lr_scheduler.warmup_steps'?" in found
    assert any("'steps' = 3 is outside any [section]" in p and "training.steps" in p
               for p in found)
    assert len(found) == 4


def test_unknown_key_without_a_close_match_lists_the_keys():
    problem = the_problem(["--comm.zzz=1"])
    assert "unknown key 'comm.zzz'" in problem and "init_timeout_seconds" in problem


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
     "'shakespeare', 'text', 'tokens', 'synthetic'; did you mean 'shakespeare'?"),
    ("--optimizer.name=adamw", "optimizer.name = 'adamw' is not allowed; choose one of 'AdamW', "
     "'Adam'; did you mean 'AdamW'?"),
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


# -- cross-field rules --------------------------------------------------------------------------

def test_degree_product_must_equal_world_size():
    problem = the_problem(["--parallelism.data_parallel_shard_degree=2"], world_size=8)
    assert "multiply to 2, not the world size 8" in problem
    assert "data_parallel_shard_degree(2)" in problem and "= -1 to fill the rest" in problem


def test_dp_shard_minus_one_must_divide_the_rest():
    problem = the_problem(["--parallelism.data_parallel_replicate_degree=3"], world_size=8)
    assert "data_parallel_shard_degree = -1 cannot fill the rest of the world size 8" in problem
    assert "data_parallel_replicate_degree(3)" in problem and "= 3" in problem


def test_without_world_size_dp_shard_minus_one_counts_as_one():
    cfg = load_config(None, ["--parallelism.data_parallel_shard_degree=3"])
    assert resolved_dp_shard(cfg, None) == 3
    assert resolved_dp_shard(load_config(None), None) == 1
    # dp = 1 x 1, so a global batch of 16 is 2 micro-batches of 8
    assert problems_of(["--training.global_batch_size=16"]) == []
    assert "local_batch_size(8) x dp(1) = 8" in the_problem(["--training.global_batch_size=12"])


def test_expert_parallel_needs_a_moe_model():  # the other EP rules: tests/test_expert_parallel.py
    problem = the_problem(["--parallelism.expert_parallel_degree=2"], world_size=2)
    assert problem == ("parallelism.expert_parallel_degree = 2 needs a MoE model, but model.flavor "
                       "= 'debugmodel' has no MoE blocks; use a MoE flavor (e.g. 'debugmoe') or "
                       "set it to 1")


def _cp_problems(args, world_size=8):
    """Problems minus any 'not supported yet' line (degrees that are still landing)."""
    return [p for p in problems_of(args, world_size) if "not supported yet" not in p]


def test_seq_len_divisible_by_2_cp_tp_with_sequence_parallel():
    found = _cp_problems(["--parallelism.context_parallel_degree=2",
                          "--parallelism.tensor_parallel_degree=2", "--training.seq_len=252"])
    assert found == ["training.seq_len = 252 must be divisible by 2 x context_parallel_degree(2) x "
                     "tensor_parallel_degree(2) (sequence parallel) = 8"]
    assert _cp_problems(["--parallelism.context_parallel_degree=2",
                         "--parallelism.tensor_parallel_degree=2", "--training.seq_len=248"]) == []


def test_seq_len_divisible_by_2_cp_without_sequence_parallel():
    base = ["--parallelism.context_parallel_degree=2", "--parallelism.tensor_parallel_degree=2",
            "--parallelism.enable_sequence_parallel=false"]
    assert _cp_problems([*base, "--training.seq_len=252"]) == []  # 252 % 4 == 0; tp not counted
    assert _cp_problems([*base, "--training.seq_len=250"]) == [
        "training.seq_len = 250 must be divisible by 2 x context_parallel_degree(2) = 4"]


@pytest.mark.parametrize("layout", ["contiguous", "none"])
def test_seq_len_divisible_by_cp_only_with_contiguous_layout(layout):
    base = ["--parallelism.context_parallel_degree=2",
            f"--parallelism.context_parallel_load_balance={layout}"]
    assert _cp_problems([*base, "--training.seq_len=250"], world_size=2) == []
    assert _cp_problems([*base, "--training.seq_len=251"], world_size=2) == [
        "training.seq_len = 251 must be divisible by context_parallel_degree(2) = 2"]


def test_cp_layout_uses_the_plugin_names_and_reads_none_as_contiguous(tmp_path):
    # One vocabulary: TOML says what ring_attention(layout=...) says; 'none' is an alias.
    for text in ('"contiguous"', '"none"'):
        path = tmp_path / "cp.toml"
        path.write_text(f"[parallelism]\ncontext_parallel_load_balance = {text}\n")
        cfg = load_config(str(path))
        assert cfg.parallelism.context_parallel_load_balance == "contiguous"
    cli = load_config(None, ["--parallelism.context_parallel_load_balance=none"])
    assert cli.parallelism.context_parallel_load_balance == "contiguous"
    assert 'context_parallel_load_balance = "contiguous"' in to_toml(cli).splitlines()
    assert "one of 'zigzag', 'contiguous' ('none' means 'contiguous')" in config_help()
    # Code that builds a config in Python must use the canonical name: only the loader translates.
    cfg = JobConfig()
    cfg.parallelism.context_parallel_load_balance = "none"
    with pytest.raises(ConfigError, match="is an alias that only TOML files and the command line "
                                          "accept; set 'contiguous'"):
        check_config(cfg)


def test_cp_with_pp_is_accepted_at_load():
    # Pipeline stages get the CP-sharded position ids (tests/test_composition.py runs it).
    assert problems_of(["--parallelism.context_parallel_degree=2",
                        "--parallelism.pipeline_parallel_degree=2"], world_size=4) == []


def test_cp_options_are_validated():
    found = _cp_problems(["--parallelism.context_parallel_degree=2",
                          "--parallelism.context_parallel_comm=ring",
                          "--parallelism.context_parallel_load_balance=zigzg"], world_size=2)
    assert found == [
        "parallelism.context_parallel_load_balance = 'zigzg' is not allowed; choose one of "
        "'zigzag', 'contiguous' ('none' means 'contiguous'); did you mean 'zigzag'?",
        "parallelism.context_parallel_comm = 'ring' is not allowed; choose one of 'p2p', "
        "'allgather', 'alltoall'"]


def test_seq_len_divisible_by_tp_with_sequence_parallel():
    problem = the_problem(["--parallelism.tensor_parallel_degree=2", "--training.seq_len=255"],
                          world_size=2)
    assert problem == ("training.seq_len = 255 must be divisible by tensor_parallel_degree = 2 "
                       "with enable_sequence_parallel = true")
    assert problems_of(["--parallelism.tensor_parallel_degree=2", "--training.seq_len=255",
                        "--parallelism.enable_sequence_parallel=false"], world_size=2) == []


def test_heads_must_divide_by_tp():
    # debugmodel: 8 heads over 4 kv heads, vocab 512
    problem = the_problem(["--parallelism.tensor_parallel_degree=8"], world_size=8)
    assert problem == ("parallelism.tensor_parallel_degree = 8 must divide the model's "
                       "n_kv_heads = 4 (llama3 debugmodel); choose a divisor of 4")
    assert problems_of(["--parallelism.tensor_parallel_degree=4"], world_size=8) == []


@pytest.fixture
def odd_model(monkeypatch):
    """A registered flavor with shapes no shipped flavor has: 6 heads, vocab 200."""
    from titanext.models import MODEL_FLAVORS
    from titanext.models.args import ModelArgs

    flavors = dict(MODEL_FLAVORS["llama3"])
    flavors["odd"] = ModelArgs(dim=48, n_layers=3, n_heads=6, n_kv_heads=None, vocab_size=200,
                               max_seq_len=512)
    monkeypatch.setitem(MODEL_FLAVORS, "llama3", flavors)
    return ["--model.flavor=odd"]


def test_n_heads_and_vocab_must_divide_by_tp(odd_model):
    found = problems_of([*odd_model, "--parallelism.tensor_parallel_degree=4",
                         "--training.seq_len=256"], world_size=4)
    assert "parallelism.tensor_parallel_degree = 4 must divide the model's n_heads = 6 " \
           "(llama3 odd); choose a divisor of 6" in found
    # n_kv_heads = None means as many kv heads as heads
    assert "parallelism.tensor_parallel_degree = 4 must divide the model's n_kv_heads = 6 " \
           "(llama3 odd); choose a divisor of 6" in found
    assert not any("vocab_size = 200 (" in p and "must divide" in p for p in found)  # 200 % 4 == 0
    found = problems_of([*odd_model, "--parallelism.tensor_parallel_degree=3",
                         "--training.seq_len=255"], world_size=3)
    assert "parallelism.tensor_parallel_degree = 3 must divide the model's vocab_size = 200 " \
           "(llama3 odd); choose a divisor of 200" in found


def test_model_vocab_must_hold_the_tokenizer(odd_model):
    found = problems_of(odd_model)
    assert found == ["model.tokenizer = 'byte' produces 258 token ids but the model's vocab_size = "
                     "200 (llama3 odd); pick a flavor with vocab_size >= 258"]


def test_seq_len_at_most_max_seq_len():
    assert the_problem(["--training.seq_len=4096"]) == (
        "training.seq_len = 4096 exceeds the model's max_seq_len = 2048 (llama3 debugmodel)")
    assert problems_of(["--training.seq_len=2048"]) == []


def test_pipeline_needs_a_layer_per_stage():
    found = problems_of(["--model.flavor=debugtiny", "--parallelism.pipeline_parallel_degree=4"],
                        world_size=4)
    assert ("parallelism.pipeline_parallel_degree = 4 is more than the model's n_layers = 2 "
            "(llama3 debugtiny); every stage needs a layer") in found
    assert len(found) == 2  # plus "not supported yet"


def test_global_batch_must_be_a_multiple_of_local_times_dp():
    problem = the_problem(["--training.global_batch_size=48"], world_size=4)
    assert problem.startswith("training.global_batch_size = 48 must be a multiple of "
                              "local_batch_size(8) x dp(4) = 32")
    assert "data_parallel_shard_degree(4)" in problem
    # HSDP: dp counts both data-parallel axes
    problem = the_problem(["--training.global_batch_size=24",
                           "--parallelism.data_parallel_replicate_degree=2"], world_size=4)
    assert "local_batch_size(8) x dp(4) = 32" in problem
    assert "data_parallel_replicate_degree(2) x data_parallel_shard_degree(2)" in problem
    # smaller than one micro-batch per rank is not a multiple either
    assert "= 32" in the_problem(["--training.global_batch_size=16"], world_size=4)


def test_gradient_accumulation_steps():
    cfg = load_config(None, ["--training.global_batch_size=128"], world_size=4)
    assert gradient_accumulation_steps(cfg, 4) == 128 // (8 * 4)
    assert gradient_accumulation_steps(load_config(None, world_size=4), 4) == 1
    tp_cfg = load_config(None, ["--training.global_batch_size=64",
                                "--parallelism.tensor_parallel_degree=2"], world_size=8)
    assert gradient_accumulation_steps(tp_cfg, 8) == 64 // (8 * 4)  # TP ranks share a batch
    with pytest.raises(ConfigError, match="global_batch_size = 128 must be a multiple"):
        gradient_accumulation_steps(cfg, 64)  # 8 x 64 = 512 > 128


def test_resolved_dp_shard():
    cfg = load_config(None, ["--parallelism.tensor_parallel_degree=2",
                             "--parallelism.data_parallel_replicate_degree=2"])
    assert resolved_dp_shard(cfg, 16) == 4
    with pytest.raises(ConfigError, match="cannot fill the rest of the world size 6"):
        resolved_dp_shard(cfg, 6)


@pytest.mark.parametrize("args,values", [
    (["--parallelism.tensor_parallel_degree=2"], "got 2 and 1"),
    (["--parallelism.data_parallel_replicate_degree=2"], "got 1 and 2"),
])
def test_zero_stage_1_needs_no_tp_and_no_replicate(args, values):
    problem = the_problem(["--parallelism.zero_stage=1", *args], world_size=4)
    assert problem.startswith("parallelism.zero_stage = 1 ")
    assert "tensor_parallel_degree = 1 and data_parallel_replicate_degree = 1" in problem
    assert values in problem


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stage_1_and_2_without_sharding_are_fine(stage):
    assert problems_of([f"--parallelism.zero_stage={stage}",
                        "--parallelism.data_parallel_shard_degree=1"], world_size=1) == []


def test_reshard_policy_conflicts_with_zero_stage_2():
    for policy in ("always", "never"):
        problem = the_problem(["--parallelism.zero_stage=2",
                               f"--parallelism.fsdp_reshard_after_forward={policy}"])
        assert problem.startswith(f"parallelism.fsdp_reshard_after_forward = '{policy}' conflicts "
                                  "with zero_stage = 2")
    assert problems_of(["--parallelism.zero_stage=3",
                        "--parallelism.fsdp_reshard_after_forward=never"]) == []


def test_text_dataset_needs_an_existing_path(tmp_path):
    assert the_problem(["--training.dataset=text"]).startswith(
        "training.dataset = 'text' needs training.dataset_path")
    missing = tmp_path / "nope.txt"
    assert the_problem(["--training.dataset=text", f"--training.dataset_path={missing}"]) \
        .startswith(f"training.dataset_path = '{missing}' does not exist")
    corpus = write(tmp_path, "corpus.txt", "hello world\n")
    assert problems_of(["--training.dataset=text", f"--training.dataset_path={corpus}"]) == []


def test_dataset_path_with_another_dataset_is_an_error(tmp_path):
    corpus = write(tmp_path, "corpus.txt", "hello\n")
    problem = the_problem([f"--training.dataset_path={corpus}"])
    assert "is only read with dataset = 'text'" in problem and "'shakespeare'" in problem
    assert problems_of(["--training.dataset_path="]) == []  # "" unsets it


def test_compile_with_selective_op_ac_is_allowed():
    assert problems_of(["--compile.enable=true", "--activation_checkpoint.mode=selective",
                        "--activation_checkpoint.selective_ac_option=op"], world_size=4) == []


# -- reporting ----------------------------------------------------------------------------------

def test_all_problems_are_reported_together_one_line_each(tmp_path):
    path = write(tmp_path, "c.toml", '[training]\nsteps = "many"\nseq_len = 4096\n'
                                     "[optimizer]\nlr = "
                                     "-1\n[parallelism]\ntensor_paralel_degree = 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), ["--parallelism.data_parallel_shard_degree=3",
                                "--parallelism.pipeline_parallel_degree=2",
                                "--parallelism.pipeline_parallel_schedule=ZBH3"], world_size=4)
    problems = info.value.problems
    assert str(info.value).splitlines() == problems
    assert all("\n" not in p for p in problems)
    joined = "\n".join(problems)
    for expected in ("training.steps = 'many'", "unknown key 'parallelism.tensor_paralel_degree'",
                     "optimizer.lr = -1.0", "pipeline_parallel_schedule = 'ZBH3' is not allowed",
                     "multiply to 6, not the world size 4", "training.seq_len = 4096 exceeds"):
        assert expected in joined
    assert len(problems) == 6, problems


def test_a_wrongly_typed_key_is_not_reasoned_about_by_other_rules(tmp_path):
    # tp is unreadable, so no "tp must divide heads" or product messages follow from a guess.
    assert problems_of(["--parallelism.tensor_parallel_degree=two"], world_size=8) == [
        "parallelism.tensor_parallel_degree = 'two' has the wrong type: expected "
        "integer, got string"]


def test_config_error_is_a_value_error_that_survives_pickling():
    err = ConfigError(["a.b = 1 is bad", "c.d = 2 is bad"])
    assert isinstance(err, ValueError)
    assert str(err) == "a.b = 1 is bad\nc.d = 2 is bad"
    again = pickle.loads(pickle.dumps(err))
    assert again.problems == err.problems and str(again) == str(err)
    assert ConfigError("one").problems == ["one"]


def test_validate_checks_configs_built_in_python():
    check_config(JobConfig(), world_size=8)
    cfg = JobConfig()
    cfg.parallelism.tensor_parallel_degree = "2"
    cfg.training.steps = 0
    with pytest.raises(ConfigError) as info:
        check_config(cfg, world_size=8)
    assert info.value.problems == [
        "training.steps = 0 is out of range; it must be >= 1",
        "parallelism.tensor_parallel_degree = '2' has the wrong type: expected integer, got string"]
    with pytest.raises(ConfigError, match="world size 0 must be a positive integer"):
        check_config(JobConfig(), world_size=0)


def test_loading_starts_no_process_group_and_writes_nothing(tmp_path):
    import torch.distributed as dist

    dump = tmp_path / "job"
    load_config(str(CONFIGS / "debug_model.toml"), [f"--job.dump_folder={dump}",
                                                    "--checkpoint.enable"], world_size=4)
    assert not dist.is_initialized()
    assert not dump.exists()


# -- the package stays light and names stay unambiguous ------------------------------------------

def test_schedule_names_known_without_importing_schedules_are_real():
    from titanext.schedules import SCHEDULE_NAMES

    from titanext.config import _checks

    assert set(_checks._KNOWN_SCHEDULES) <= set(SCHEDULE_NAMES)


def test_default_save_ops_are_aten_ops():
    import torch

    from titanext.plugins.options import DEFAULT_SAVE_OPS

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


ULYSSES_BAD = [
    (4, ["--parallelism.context_parallel_degree=4",
         "--parallelism.context_parallel_ulysses_degree=3"],
     "parallelism.context_parallel_ulysses_degree = 3 must divide context_parallel_degree = 4 "
     "(cp = Ulysses x ring); choose a divisor of 4"),
    (4, ["--parallelism.context_parallel_degree=2", "--parallelism.context_parallel_comm=alltoall",
      "--parallelism.context_parallel_ulysses_degree=4"],
     "parallelism.context_parallel_ulysses_degree = 4 contradicts context_parallel_comm = "
     "'alltoall'"),
    (6, ["--parallelism.context_parallel_degree=6",
         "--parallelism.context_parallel_ulysses_degree=3"],
     "parallelism.context_parallel_ulysses_degree = 3 must divide the model's n_heads = 8 "
     "(llama3 debugtiny)"),
    (6, ["--parallelism.context_parallel_degree=3", "--parallelism.context_parallel_comm=alltoall"],
     "parallelism.context_parallel_comm = 'alltoall' (Ulysses over context_parallel_degree = 3) "
     "must divide the model's n_kv_heads = 4 (llama3 debugtiny) or be a multiple of it"),
    (4, ["--parallelism.context_parallel_degree=4", "--parallelism.context_parallel_comm=alltoall",
         "--training.seq_len=90"],
     "training.seq_len = 90 must be divisible by 2 x context_parallel_degree(4) = 8"),
    (4, ["--parallelism.context_parallel_degree=4",
         "--parallelism.context_parallel_ulysses_degree=2",
         "--parallelism.context_parallel_load_balance=contiguous", "--training.seq_len=90"],
     "training.seq_len = 90 must be divisible by context_parallel_degree(4) = 4"),
]


@pytest.mark.parametrize("world,args,line", ULYSSES_BAD, ids=lambda x: str(x)[:40])
def test_ulysses_and_document_masking_rules_are_one_line_each(world, args, line):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--model.flavor=debugtiny", "--training.seq_len=96", *args],
                    world_size=world)
    lines = str(info.value).splitlines()
    assert any(found.startswith(line) for found in lines), lines


def test_ulysses_hybrid_and_document_masking_configs_load():
    for args in (["--parallelism.context_parallel_comm=alltoall"],
                 ["--parallelism.context_parallel_ulysses_degree=2"],
                 ["--parallelism.context_parallel_ulysses_degree=4",
                  "--parallelism.context_parallel_comm=alltoall",
                  "--training.document_masking=true"]):
        cfg = load_config(None, ["--model.flavor=debugtiny", "--training.seq_len=96",
                                 "--parallelism.context_parallel_degree=4", *args], world_size=4)
        assert cfg.parallelism.context_parallel_degree == 4
    # pipeline stages get each micro-batch's document ids (PipelineRunner.step), also under CP
    cfg = load_config(None, ["--model.flavor=debugtiny", "--training.seq_len=96",
                             "--training.document_masking=true",
                             "--parallelism.context_parallel_degree=4",
                             "--parallelism.pipeline_parallel_degree=2"], world_size=8)
    assert cfg.training.document_masking and cfg.parallelism.pipeline_parallel_degree == 2


@pytest.mark.parametrize("flag", ["--help", "--print-config"])
def test_help_and_print_config_piped_into_a_closed_reader_exit_0_without_a_traceback(flag):
    """`python -m titanext.train --help | head -1`: the reader closes the pipe early."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "titanext.train", "--config",
                             "train_configs/debug_model.toml", flag],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # the reader is gone before anything is written (`head` at its end)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err, err
