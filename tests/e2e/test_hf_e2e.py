"""End to end: start from an HF directory on 2 ranks (FSDP), train a few steps with its
tokenizer on a JSON-lines corpus, export with last_save_in_hf, and load the export in
transformers: its loss on a batch equals titanext's (1e-4), and the first step's loss equals
the source model's loss in transformers on that step's batch, also under TP 2, CP 2 and PP 2,
and for a Qwen3-MoE directory under EP 2."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from tests import REPO_ROOT
from tests.hf_artifacts import make_bpe_tokenizer, make_tiny_llama, make_tiny_qwen3
from tests.spawn import fp32_trainer_overrides, run_distributed
from titanext.config import load_config
from titanext.errors import ConfigError

pytest.importorskip("transformers")

SEQ, STEPS = 64, 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from importlib import resources

    root = tmp_path_factory.mktemp("hfe2e")
    hf = str(root / "hf")
    make_tiny_llama(hf)
    tied = str(root / "tied")
    make_tiny_llama(tied, tie=True)
    moe = str(root / "qwen3_moe")
    make_tiny_qwen3(moe, moe=True, mlp_only_layers=[0], norm_topk_prob=True)
    make_bpe_tokenizer(moe)
    text = resources.files("titanext").joinpath("assets/shakespeare.txt").read_text("utf-8")
    corpus = root / "corpus.jsonl"
    with open(corpus, "w") as f:
        for paragraph in text.split("\n\n")[:400]:
            f.write(json.dumps({"id": 1, "text": paragraph}) + "\n")
    overrides = [
        *[o for o in fp32_trainer_overrides(steps=STEPS, seq_len=SEQ)
          if not o.startswith("--training.dataset")],
        "--model.flavor=hf", "--model.tokenizer=hf", f"--model.hf_assets_path={hf}",
        "--training.dataset=text", f"--training.dataset_path={corpus}",
        "--training.local_batch_size=2", "--parallelism.data_parallel_shard_degree=2",
        "--checkpoint.enable=true", "--checkpoint.interval=100",
        f"--checkpoint.initial_load_path={hf}", "--checkpoint.initial_load_in_hf=true",
        "--checkpoint.last_save_in_hf=true", "--optimizer.lr=1e-2",
        f"--job.dump_folder={root / 'run'}",  # last: _train_and_probe derives other folders
    ]
    return {"hf": hf, "moe": moe, "tied": tied, "corpus": str(corpus), "overrides": overrides,
            "root": root}


def _probe_batch(hf: str) -> torch.Tensor:
    from titanext.data.tokenizer import build_tokenizer

    tok = build_tokenizer("hf", hf)
    ids = tok.encode("ROMEO: But, soft! what light through yonder window breaks? " * 6,
                     bos=True)
    return torch.tensor(ids[: SEQ + 1]).view(1, -1).repeat(2, 1)


def _mean_loss(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()).item()


# More layouts starting from HF weights (no export), 3 steps each: name -> (HF directory: the
# Llama, a tied Llama or the Qwen3-MoE, reference run of the loss curve, overrides).
TP2, FSDP2 = ["--parallelism.tensor_parallel_degree=2"], [
    "--parallelism.data_parallel_shard_degree=2", "--training.local_batch_size=2"]
OTHER_LAYOUTS = {
    "tp2": ("hf", "main", TP2),
    "cp2": ("hf", "main", ["--parallelism.context_parallel_degree=2"]),
    "pp2": ("hf", "main", ["--parallelism.pipeline_parallel_degree=2",
                           "--parallelism.pipeline_parallel_schedule=1F1B",
                           "--parallelism.pipeline_parallel_microbatches=2"]),
    # tied embeddings: TP keeps embedding and output head one (vocab-sharded) parameter
    "tied_fsdp2": ("tied", None, FSDP2),
    "tied_tp2": ("tied", "tied_fsdp2", TP2),
    # QK-norm under TP (the norm weights replicated, their gradients summed over tp)
    "qwen3_moe_fsdp2_ep2": ("moe", None, [*FSDP2, "--parallelism.expert_parallel_degree=2"]),
    "qwen3_moe_tp2": ("moe", "qwen3_moe_fsdp2_ep2", TP2),
}


def _train_and_probe(rank: int, world_size: int, overrides: list[str], dirs: dict[str, str]
                     ) -> tuple[list[float], float, dict[str, list[float]]]:
    from titanext.trainer import Trainer

    trainer = Trainer(load_config(None, overrides, world_size=world_size))
    losses = trainer.train()
    tokens = _probe_batch(dirs["hf"])
    with torch.no_grad():  # FSDP forward: every rank runs it on the same batch
        probe = _mean_loss(trainer.model(tokens), tokens)
    others = {}
    for name, (which, _, extra) in OTHER_LAYOUTS.items():
        cfg = load_config(None, [*overrides, "--parallelism.data_parallel_shard_degree=1",
                                 "--training.local_batch_size=4",
                                 "--checkpoint.enable=false", "--checkpoint.last_save_in_hf=false",
                                 f"--job.dump_folder={overrides[-1]}-{name}",
                                 f"--model.hf_assets_path={dirs[which]}",
                                 f"--checkpoint.initial_load_path={dirs[which]}", *extra],
                          world_size=world_size)
        others[name] = Trainer(cfg).train()
    return losses, probe, others


@pytest.mark.slow
def test_hf_start_train_export_reload(job):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from titanext.data import build_dataloader
    from titanext.data.tokenizer import build_tokenizer

    (losses, ours, others), _ = run_distributed(_train_and_probe, world_size=2,
                                        args=(job["overrides"], job), timeout_s=180)
    export = os.path.join(job["root"], "run", "checkpoint", f"step-{STEPS}-hf")
    assert sorted(os.listdir(export)) == ["config.json", "generation_config.json",
                                          "model.safetensors", "tokenizer.json",
                                          "tokenizer_config.json"]
    tokens = _probe_batch(job["hf"])
    with torch.no_grad():
        theirs = _mean_loss(AutoModelForCausalLM.from_pretrained(export)(tokens).logits, tokens)
    assert abs(theirs - ours) < 1e-4, (theirs, ours)
    tok = build_tokenizer("hf", job["hf"])
    assert AutoTokenizer.from_pretrained(export)("Hark")["input_ids"] == tok.encode("Hark")

    # The same step's DCP checkpoint converted offline gives the same safetensors, bitwise.
    from safetensors.torch import load_file

    from titanext.launch.convert import main as convert_main

    offline = os.path.join(job["root"], "offline")
    assert convert_main(["dcp-to-hf", os.path.join(job["root"], "run", "checkpoint",
                                                   f"step-{STEPS}"), offline,
                         "--hf-assets", job["hf"]]) == 0
    a, b = load_file(os.path.join(export, "model.safetensors")), load_file(
        os.path.join(offline, "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)

    # Step 1 trained on the source weights: its loss is the source model's on that batch (the
    # loader's global order does not depend on the layout, so one process sees the same batch).
    loader = build_dataloader(dataset="text", dataset_path=job["corpus"], tokenizer=tok,
                              seq_len=SEQ, local_batch_size=4, dp_rank=0, dp_degree=1)
    inputs, labels = loader.next_batch()[:2]

    def first_loss(directory: str) -> float:
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(directory)(inputs).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).item()

    first = first_loss(job["hf"])
    assert abs(first - losses[0]) < 1e-5, (first, losses[0])
    for name, other in others.items():  # every layout starts from the source weights ...
        which, reference, _ = OTHER_LAYOUTS[name]
        ref = first if which == "hf" else first_loss(job[which])
        assert abs(ref - other[0]) < 1e-5, (name, ref, other[0])
        if reference is not None:  # ... and follows its reference run's loss curve
            curve = losses if reference == "main" else others[reference]
            assert torch.allclose(torch.tensor(other), torch.tensor(curve), rtol=0, atol=1e-5), (
                name, other, curve)
    source = AutoModelForCausalLM.from_pretrained(job["hf"])
    assert abs(theirs - _mean_loss(source(tokens).logits.detach(), tokens)) > 1e-3  # it trained


def _config_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides, world_size=2)
    return str(e.value)


def test_bad_hf_inputs_are_config_errors_naming_the_file(job, tmp_path):
    base = job["overrides"]
    # missing tokenizer.json / config.json
    (tmp_path / "empty").mkdir()
    msg = _config_error([*base, f"--model.hf_assets_path={tmp_path / 'empty'}"])
    assert str(tmp_path / "empty" / "config.json") in msg
    assert str(tmp_path / "empty" / "tokenizer.json") in msg
    # malformed config.json
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bad / name).write_bytes(open(os.path.join(job["hf"], name), "rb").read())
    (bad / "config.json").write_text("{oops")
    assert f"{bad / 'config.json'} is not valid JSON" in _config_error(
        [*base, f"--model.hf_assets_path={bad}"])
    # a tokenizer larger than a named flavor's embedding (debugtiny: 264 rows, tokenizer 300)
    msg = _config_error([*base, "--model.flavor=debugtiny", "--checkpoint.initial_load_path=",
                         "--checkpoint.initial_load_in_hf=false"])
    assert ("tokenizer.json: the tokenizer has 300 token ids, more than the model's "
            "vocab_size = 264") in msg
    # weights that do not match the flavor
    msg = _config_error([*base, "--model.tokenizer=byte", "--model.flavor=debugtiny"])
    assert "model.embed_tokens.weight" in msg and "[320, 64]" in msg and "[264, 64]" in msg
    # tied embeddings under PP
    tied = tmp_path / "tied"
    make_tiny_llama(str(tied), tie=True)
    msg = _config_error([*base, f"--model.hf_assets_path={tied}",
                         f"--checkpoint.initial_load_path={tied}",
                         "--parallelism.data_parallel_shard_degree=1",
                         "--parallelism.pipeline_parallel_degree=2"])
    assert "tie_word_embeddings" in msg and "pipeline_parallel_degree = 2" in msg


def test_bad_hf_input_exits_2_before_training(job, tmp_path, capsys):
    from titanext.train import main

    (tmp_path / "empty").mkdir()
    code = main(["--model.flavor=hf", "--model.tokenizer=hf",
                 f"--model.hf_assets_path={tmp_path / 'empty'}"])
    assert code == 2
    assert "config.json does not exist" in capsys.readouterr().err


def test_example_builder_and_config(tmp_path, monkeypatch):
    """examples/make_tiny_hf_model.py builds what train_configs/hf_llama_example.toml reads."""
    import subprocess
    import sys

    root = REPO_ROOT
    monkeypatch.chdir(tmp_path)
    subprocess.run([sys.executable, str(root / "examples" / "make_tiny_hf_model.py"), "./tiny_hf",
                    "--jsonl", "./tiny_corpus.jsonl", "--vocab-size", "300"], check=True,
                   env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True)
    cfg = load_config(str(root / "train_configs" / "hf_llama_example.toml"), world_size=2)
    assert (cfg.model.flavor, cfg.model.tokenizer, cfg.checkpoint.last_save_in_hf) == (
        "hf", "hf", True)
    from titanext.planning.cli import model_shape

    assert (model_shape(cfg).n_layers, model_shape(cfg).dim) == (4, 128)  # the planner reads it
