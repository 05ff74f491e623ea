"""titanext.config.torchtitan_keys: torchtitan's TOML files (0.1 and 0.2 llama3 debug, 8B, 70B,
405B; fixtures in tests/unit/config/torchtitan/) load as they are and resolve to the same config
as the files written with titanext's names (tx*.toml), with one line per renamed or ignored key
and one problem per refused key. In-process and fast; the trainer run of the debug fixture is in
tests/multiprocess/test_torchtitan_config.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.hf_artifacts import make_bpe_tokenizer
from tests.unit.config.helpers import CONFIGS, ROOT, write
from titanext.config import SECTIONS, ConfigError, load_config
from titanext.config.loader import tomllib  # tomli before Python 3.11
from titanext.config.torchtitan_keys import (
    TORCHTITAN_KEYS,
    _hf_dataset_hint,
    is_torchtitan,
    key_table_markdown,
    translate_torchtitan,
)

FIXTURES = Path(__file__).parent / "torchtitan"
MODELS = [("debug_model", 8), ("llama3_8b", 64), ("llama3_70b", 64), ("llama3_405b", 128)]
ASYNC_TP_OFF = ["--parallelism.enable_async_tensor_parallel=false"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return Path(make_bpe_tokenizer(str(tmp_path_factory.mktemp("tt") / "tokenizer")))


@pytest.fixture
def in_job_dir(tokenizer_dir, monkeypatch):
    """Run from a folder holding ./tokenizer, the path the fixtures name."""
    monkeypatch.chdir(tokenizer_dir.parent)
    return tokenizer_dir.parent


def _has_key(key: str) -> bool:
    section, name = key.split(".")
    return name in {f.name for f in dataclasses.fields(SECTIONS[section])}


def _load(path, args=(), world_size=None):
    return load_config(str(path), list(args), world_size=world_size)


def _info_lines(err: str) -> list[str]:
    prefix = "titanext: config: INFO: "
    return [line[len(prefix):] for line in err.splitlines() if line.startswith(prefix)]


# -- the four configs of each release ------------------------------------------------------------

@pytest.mark.parametrize("release", ["01", "02"])
@pytest.mark.parametrize("model,world_size", MODELS)
def test_torchtitan_file_resolves_to_its_titanext_twin(in_job_dir, capsys, release, model,
                                                       world_size):
    args = ASYNC_TP_OFF if model == "llama3_405b" else []
    theirs = _load(FIXTURES / f"tt{release}_{model}.toml", args, world_size)
    ours = _load(FIXTURES / f"tx{release}_{model}.toml", (), world_size)
    assert theirs == ours
    assert _info_lines(capsys.readouterr().err)  # the torchtitan file said what it renamed


@pytest.mark.parametrize("release", ["01", "02"])
def test_405b_async_tp_is_the_one_refusal(in_job_dir, release):
    with pytest.raises(ConfigError) as e:
        _load(FIXTURES / f"tt{release}_llama3_405b.toml", (), 128)
    assert e.value.problems == [
        "parallelism.enable_async_tensor_parallel = true is not allowed; allowed: false (async "
        "TP needs CUDA symmetric memory and torch.compile, which titanext cannot test; use "
        "plain TP)"]


def test_debug_01_prints_one_line_per_renamed_or_ignored_key(in_job_dir, capsys):
    _load(FIXTURES / "tt01_debug_model.toml")
    assert _info_lines(capsys.readouterr().err) == [
        "torchtitan's job.print_args = false is ignored: prints the config at start-up; "
        "titanext has --print-config",
        "torchtitan's job.use_for_integration_test = true is ignored: marks torchtitan's CI "
        "configs; no effect on a run",
        "torchtitan's model.flavor = 'debugmodel' is titanext's debugmodel (dim 256, 6 layers as "
        "torchtitan's, but 8 heads over 4 kv heads and a vocab of 512; torchtitan's: 16 heads, "
        "vocab 2048), so its losses are not torchtitan's",
        "torchtitan's model.tokenizer_path is read as model.hf_assets_path",
        "torchtitan's model.tokenizer_path also sets model.tokenizer = 'hf'",
        "torchtitan's lr_scheduler.lr_min is read as lr_scheduler.min_lr_factor",
        "torchtitan's training.compile is read as compile.enable",
        "torchtitan's checkpoint.enable_checkpoint is read as checkpoint.enable",
        "torchtitan's checkpoint.last_save_model_weights_only = false is ignored: torchtitan "
        "0.1's name of model_weights_only; moot while checkpointing is off",
        "torchtitan's float8.precompute_float8_dynamic_scale_for_fsdp is read as "
        "float8.precompute_scale",
        "torchtitan's float8.filter_fqns is read as float8.filter_fqns = ['*output*']",
    ]


def test_debug_02_lines(in_job_dir, capsys):
    _load(FIXTURES / "tt02_debug_model.toml")
    lines = _info_lines(capsys.readouterr().err)
    for line in [
        "torchtitan's job.print_config = false is ignored: prints the config at start-up; "
        "titanext has --print-config",
        "torchtitan's model.hf_assets_path also sets model.tokenizer = 'hf'",
        "torchtitan's quantize.linear.float8.enable_fsdp_float8_all_gather is read as "
        "float8.enable_fsdp_float8_all_gather",
        "torchtitan's quantize.linear.float8.filter_fqns is read as float8.filter_fqns = "
        "['*output*']",
        "torchtitan's validation.dataset = 'c4_validation' is ignored: same name; torchtitan's "
        "c4_validation is refused with the fix (ignored while validation is off)",
    ]:
        assert line in lines


def test_titanext_files_are_never_reinterpreted():
    for path in sorted(CONFIGS.glob("*.toml")):
        assert not is_torchtitan(tomllib.loads(path.read_text())), path
    for path in sorted(FIXTURES.glob("tx*.toml")):
        assert not is_torchtitan(tomllib.loads(path.read_text())), path


# -- renames, conversions and refusals, one key at a time ----------------------------------------

def _one(tmp_path, text: str):
    """(config or None, problems) of a torchtitan file (its print_args marks it as one)."""
    path = write(tmp_path, "tt.toml", "[job]\nprint_args = false\n" + text)
    try:
        return _load(path), []
    except ConfigError as e:
        return None, e.problems


@pytest.mark.parametrize("text,attr,value", [
    ("[training]\nbatch_size = 3\n", "training.local_batch_size", 3),
    ("[training]\ncompile = true\n", "compile.components", ["model", "loss"]),
    ("[lr_scheduler]\nlr_min = 0.1\n", "lr_scheduler.min_lr_factor", 0.1),
    ("[parallelism]\ndisable_loss_parallel = true\n", "parallelism.enable_loss_parallel", False),
    ("[parallelism]\ncontext_parallel_rotate_method = \"alltoall\"\n",
     "parallelism.context_parallel_comm", "p2p"),
    ("[parallelism]\ncontext_parallel_load_balancer = \"headtail\"\n",
     "parallelism.context_parallel_load_balance", "zigzag"),
    ("[checkpoint]\nload_step = -1\n", "checkpoint.load_step", "latest"),
    ("[checkpoint]\nload_step = 20\n", "checkpoint.load_step", 20),
    ("[debug]\nseed = 5\n", "training.seed", 5),
    ("[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_microbatch_size = 2\n"
     "[training]\nlocal_batch_size = 8\n", "parallelism.pipeline_parallel_microbatches", 4),
    ("[comm]\nmode = \"default\"\n", "comm.mode", "real"),
    ("[model]\nconverters = [\"float8\"]\n[float8]\nfilter_fqns = [\"output\", "
     "\"auto_filter_small_kn\"]\n", "float8.auto_filter", True),
    ("[float8]\nrecipe_name = \"rowwise\"\n[model]\nconverters = [\"quantize.linear.float8\"]\n",
     "float8.recipe", "rowwise"),
])
def test_conversions(tmp_path, text, attr, value):
    cfg, problems = _one(tmp_path, text)
    assert problems == []
    section, key = attr.split(".")
    assert getattr(getattr(cfg, section), key) == value


@pytest.mark.parametrize("text,line", [
    ("[training]\ndataset = \"c4_test\"\n",
     "torchtitan's training.dataset = 'c4_test' is refused: torchtitan's 'c4_test' is a Hugging "
     "Face dataset titanext does not download; set training.dataset = \"text\" and "
     "training.dataset_path to your copy (.jsonl, .parquet, .arrow or .txt; docs/data.md)"
     + _hf_dataset_hint("training.dataset")),  # a hint once titanext has dataset = "hf"
    ("[model]\ntokenizer_path = \"./assets/tokenizer/original/tokenizer.model\"\n",
     "torchtitan's model.tokenizer_path = './assets/tokenizer/original/tokenizer.model' is "
     "refused: titanext reads a Hugging Face tokenizer.json from a directory (tiktoken and "
     "sentencepiece .model files are not read); set it to that directory, or use "
     "model.hf_assets_path"),
    ("[model]\nconverters = [\"mx\"]\n",
     "torchtitan's model.converters = ['mx'] is refused: titanext converts linears to float8 "
     "only ([float8] enable); it has no 'mx' converter"),
    ("[parallelism]\npipeline_parallel_layers_per_stage = 4\n",
     "torchtitan's parallelism.pipeline_parallel_layers_per_stage = 4 is refused: torchtitan's "
     "is one int (layers of every stage, embedding and head counted); titanext's is a list of "
     "blocks per stage: write that list"),
    ("[training]\nenable_cpu_offload = true\n",
     "torchtitan's training.enable_cpu_offload = true is refused: titanext has no FSDP CPU "
     "offload"),
    ("[fault_tolerance]\nenable = true\n",
     "torchtitan's fault_tolerance.enable = true is refused: titanext has no torchft; it "
     "restarts from checkpoints (docs/checkpoints_and_faults.md)"),
    ("[validation]\nenable = true\ndataset = \"shakespeare\"\nsteps = -1\n",
     "torchtitan's validation.steps = -1 is refused: -1 (the whole held-out set) has no "
     "titanext equivalent; give a number of batches"),
    ("[training]\nbatch_size = 2\nlocal_batch_size = 2\n",
     "training.batch_size (torchtitan's spelling) and training.local_batch_size are both given; "
     "keep training.local_batch_size"),
])
def test_refusals_are_one_line_each(tmp_path, text, line):
    _, problems = _one(tmp_path, text)
    assert problems == [line]


@pytest.mark.parametrize("key,off,on", [("metrics.enable_wandb", "false", "true"),
                                        ("checkpoint.async_mode", '"disabled"', '"async"'),
                                        ("checkpoint.export_dtype", '"float32"', '"bfloat16"')])
def test_same_name_keys_are_read_as_titanext_reads_them(tmp_path, key, off, on):
    section, name = key.split(".")
    assert _one(tmp_path, f"[{section}]\n{name} = {off}\n")[1] == []
    problems = _one(tmp_path, f"[{section}]\n{name} = {on}\n")[1]
    assert not any(p.startswith("torchtitan's") for p in problems)  # titanext's own rules only


def test_refusal_exits_2_through_the_cli(tmp_path, capsys):
    from titanext.train import main

    path = write(tmp_path, "tt.toml", "[job]\nprint_args = false\n[training]\n"
                                      "dataset = \"c4\"\n")
    assert main(["--config", str(path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "config error" in line]
    assert len(err) == 1 and "torchtitan's training.dataset = 'c4' is refused" in err[0]


# -- the table and its page ----------------------------------------------------------------------

def test_every_target_is_a_titanext_key_and_every_entry_says_why():
    for key, entry in TORCHTITAN_KEYS.items():
        assert entry.kind in ("same", "rename", "convert", "ignore", "refuse"), key
        assert entry.why, key
        if entry.kind in ("rename", "convert"):
            assert _has_key(entry.target), (key, entry.target)
        if entry.kind == "same":
            assert _has_key(key), key


def test_translation_leaves_input_alone():
    raw = {"training": {"batch_size": 4}}
    out, _, _ = translate_torchtitan(raw)
    assert raw == {"training": {"batch_size": 4}} and out == {"training": {"local_batch_size": 4}}


def test_docs_page_holds_the_whole_table():
    assert key_table_markdown() in (ROOT / "docs" / "torchtitan.md").read_text()


def test_hf_weights_from_hf_assets_path_become_initial_load_path():
    raw = {"model": {"hf_assets_path": "hf/Llama-3.1-8B"},
           "checkpoint": {"enable": True, "initial_load_in_hf": True, "last_save_model_only": True}}
    out, notes, problems = translate_torchtitan(raw)
    assert out["checkpoint"]["initial_load_path"] == "hf/Llama-3.1-8B"
    assert "torchtitan's checkpoint.initial_load_in_hf also sets checkpoint.initial_load_path = " \
           "'hf/Llama-3.1-8B'" in notes
    assert problems == [] and out["checkpoint"]["model_weights_only"] is True  # checkpointing on
