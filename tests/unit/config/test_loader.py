"""titanext.config.loader: TOML files with ``[job] extends``, command-line overrides,
``--help``, ``--print-config`` (to_toml), the shipped configs, and all problems reported together.

In-process and fast (loading a config never starts a process group), except one test that pipes
``python -m titanext.train --help`` into a reader that has gone.
"""

from __future__ import annotations

import dataclasses
import doctest
import pickle

import pytest

import titanext.config as config_mod
import titanext.config._values as values_mod
import titanext.config.degrees as degrees_mod
import titanext.config.loader as loader_mod
import titanext.config.rules as rules_mod
import titanext.config.schema as schema_mod
from tests.unit.config.helpers import CONFIGS, ROOT, all_keys, problems_of, the_problem, write
from titanext.config import (
    SECTIONS,
    ConfigError,
    config_help,
    field_docs,
    gradient_accumulation_steps,
    load_config,
    parse_cli,
    resolved_dp_shard,
    to_toml,
)

SHIPPED = [("debug_model.toml", 4), ("llama3_8b.toml", 8), ("llama3_70b.toml", 64)]


# -- documentation ------------------------------------------------------------------------------

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


def test_config_error_is_a_value_error_that_survives_pickling():
    err = ConfigError(["a.b = 1 is bad", "c.d = 2 is bad"])
    assert isinstance(err, ValueError)
    assert str(err) == "a.b = 1 is bad\nc.d = 2 is bad"
    again = pickle.loads(pickle.dumps(err))
    assert again.problems == err.problems and str(again) == str(err)
    assert ConfigError("one").problems == ["one"]


def test_loading_starts_no_process_group_and_writes_nothing(tmp_path):
    import torch.distributed as dist

    dump = tmp_path / "job"
    load_config(str(CONFIGS / "debug_model.toml"), [f"--job.dump_folder={dump}",
                                                    "--checkpoint.enable"], world_size=4)
    assert not dist.is_initialized()
    assert not dump.exists()


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
