"""titanext.config.rules: the cross-field rules and the layout arithmetic of
titanext.config.degrees (degree product, dp_shard = -1, batch and accumulation, CP/TP/PP/EP).

Every test is in-process and fast: loading a config never starts a process group.
"""

from __future__ import annotations

import pytest

from tests.unit.config.helpers import CONFIGS, problems_of, the_problem, write
from titanext.config import (
    ConfigError,
    JobConfig,
    check_config,
    config_help,
    gradient_accumulation_steps,
    load_config,
    resolved_dp_shard,
    to_toml,
)

# -- shipped configs ----------------------------------------------------------------------------

def test_70b_config_needs_whole_tp_groups():
    problem = the_problem(world_size=4, path=CONFIGS / "llama3_70b.toml")
    assert "cannot fill the rest of the world size 4" in problem
    assert "tensor_parallel_degree(8)" in problem


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


def test_expert_parallel_needs_a_moe_model():  # other EP rules: tests/unit/test_expert_parallel.py
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
    # Pipeline stages get the CP-sharded position ids (tests/multiprocess/test_composition.py
    # runs it).
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


@pytest.mark.parametrize("ac", [[], ["--activation_checkpoint.mode=selective"]])
def test_keep_all_to_all_needs_whole_checkpointed_blocks(ac):
    problem = the_problem(["--activation_checkpoint.keep_all_to_all=true", *ac])
    assert problem.startswith("activation_checkpoint.keep_all_to_all = true needs whole "
                              "checkpointed blocks, but mode = "), problem
    assert "use mode = 'full' or a layer-level selective_ac_option" in problem


def test_keep_all_to_all_runs_with_expert_parallelism_and_full_or_layer_ac():
    for ac in (["--activation_checkpoint.mode=full"],
               ["--activation_checkpoint.mode=selective",
                "--activation_checkpoint.selective_ac_option=2"]):
        assert problems_of(["--model.flavor=debugmoe", "--parallelism.expert_parallel_degree=2",
                            "--activation_checkpoint.keep_all_to_all=true", *ac],
                           world_size=2) == []


# -- reporting ----------------------------------------------------------------------------------

def test_a_wrongly_typed_key_is_not_reasoned_about_by_other_rules(tmp_path):
    # tp is unreadable, so no "tp must divide heads" or product messages follow from a guess.
    assert problems_of(["--parallelism.tensor_parallel_degree=two"], world_size=8) == [
        "parallelism.tensor_parallel_degree = 'two' has the wrong type: expected "
        "integer, got string"]


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


def test_float8_torchao_recipes_need_torchao_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    assert the_problem(["--float8.enable=true", "--float8.recipe=rowwise"]) == (
        "float8.recipe = 'rowwise' needs torchao >= 0.17, which is not installed here (pip "
        "install torchao); recipe = 'blockwise' runs without it")
    assert problems_of(["--float8.enable=true", "--float8.recipe=blockwise"]) == []
MLA_BAD = [
    (8, ["--parallelism.tensor_parallel_degree=8"],
     "parallelism.tensor_parallel_degree = 8 must divide the model's n_heads = 4 (llama3 "
     "debugdeepseek); choose a divisor of 4"),
    (8, ["--parallelism.context_parallel_degree=8", "--parallelism.context_parallel_comm=alltoall"],
     "parallelism.context_parallel_comm = 'alltoall' (Ulysses over context_parallel_degree = 8) "
     "must divide the model's n_heads = 4 (llama3 debugdeepseek): Ulysses splits the heads over "
     "its ranks; choose a smaller Ulysses degree"),
    (8, ["--parallelism.tensor_parallel_degree=2", "--parallelism.context_parallel_degree=4",
         "--parallelism.context_parallel_ulysses_degree=4"],
     "parallelism.context_parallel_ulysses_degree = 4 must divide the model's n_heads / "
     "tensor_parallel_degree = 2 (llama3 debugdeepseek)"),
]


@pytest.mark.parametrize("world,args,line", MLA_BAD, ids=lambda x: str(x)[:40])
def test_mla_heads_that_tp_or_ulysses_cannot_split_are_one_line(world, args, line):
    """MLA has one key and value per head: one line about n_heads, none about n_kv_heads."""
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--model.flavor=debugdeepseek", "--training.seq_len=64", *args],
                    world_size=world)
    lines = str(info.value).splitlines()
    assert [found for found in lines if found.startswith(line)], lines
    assert not any("n_kv_heads" in found for found in lines), lines
