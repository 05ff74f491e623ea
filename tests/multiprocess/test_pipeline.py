"""Pipeline parallelism: stage split / placement units, config rules, and parity of every
schedule (chosen from the config, run by the real Trainer) with one fp32 process."""

from __future__ import annotations

import pytest
import torch

from tests import REPO_ROOT
from tests.spawn import assert_params_follow, fp32_trainer_overrides, run_distributed, trainer_runs
from titanext.config import ConfigError, load_config
from titanext.distributed.pipeline import layers_per_stage, pipeline_stage_ids, split_model
from titanext.models import build_model, get_model_args

STEPS = 2


# -- split and placement ------------------------------------------------------------------------
def test_layers_per_stage_even_and_lighter_ends():
    assert layers_per_stage(8, 4) == [2, 2, 2, 2]
    assert layers_per_stage(10, 4, first_stage_less_layers=1,
                            last_stage_less_layers=1) == [2, 3, 3, 2]
    assert layers_per_stage(6, 3, explicit=[1, 3, 2]) == [1, 3, 2]
    with pytest.raises(ValueError, match="at least one layer"):
        layers_per_stage(4, 4, first_stage_less_layers=1)
    with pytest.raises(ValueError, match="layers_per_stage"):
        layers_per_stage(6, 3, explicit=[1, 2])


def test_layers_per_stage_evens_out_ranks_not_only_stages():
    from titanext.schedules import stage_owners

    def per_rank(counts, owners):
        return [sum(c for c, r in zip(counts, owners, strict=True) if r == q)
                for q in sorted(set(owners))]

    # V placement at pp 2: rank 0 holds stages 0 and 3; stages alone would give it 2 of 6 blocks
    v = stage_owners("v", 2, 2)
    assert v == [0, 1, 1, 0]
    assert per_rank(layers_per_stage(6, 4), v) == [2, 4]
    assert per_rank(layers_per_stage(6, 4, stage_ranks=v), v) == [3, 3]
    for n_layers, pp in [(6, 2), (7, 2), (10, 4), (26, 4), (30, 8)]:
        owners = stage_owners("v", pp, 2)
        loads = per_rank(layers_per_stage(n_layers, 2 * pp, stage_ranks=owners), owners)
        assert max(loads) - min(loads) <= 1, (n_layers, pp, loads)
    # one stage per rank (or loop placement that is already even): the old split, unchanged
    assert layers_per_stage(10, 4, stage_ranks=[0, 1, 2, 3]) == layers_per_stage(10, 4)
    assert layers_per_stage(6, 4, stage_ranks=stage_owners("loop", 2, 2)) == [1, 2, 2, 1]


def test_placement_comes_from_the_schedule_class():
    assert pipeline_stage_ids("1F1B", pp_rank=1, pp=4) == [1]
    assert pipeline_stage_ids("ZBH2", pp_rank=3, pp=4) == [3]
    assert pipeline_stage_ids("ZBV", pp_rank=1, pp=4) == [1, 6]              # V
    assert pipeline_stage_ids("ZBVZeroBubble", pp_rank=0, pp=2) == [0, 3]
    assert pipeline_stage_ids("Interleaved1F1B", pp_rank=1, pp=2, stages_per_rank=3) == [1, 3, 5]


def test_split_model_keeps_names_and_drops_ends():
    model = build_model("llama3", get_model_args("llama3", "debugmodel"), device="meta")
    counts = layers_per_stage(6, 3)
    parts = [split_model(model, counts, i) for i in range(3)]
    assert [list(p.layers.keys()) for p in parts] == [["0", "1"], ["2", "3"], ["4", "5"]]
    assert parts[0].tok_embeddings is not None and parts[0].output is None
    assert parts[1].tok_embeddings is None and parts[1].norm is None
    assert parts[2].output is not None and parts[2].tok_embeddings is None
    names = {n for p in parts for n, _ in p.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    assert len(model.layers) == 6  # the source model is untouched


def test_split_user_model_module_list():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(4, 8)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
            self.head = torch.nn.Linear(8, 2)

    net = Net()
    last = split_model(net, [2, 2], 1, blocks="blocks", first=("inp",), last=("head",))
    assert last.inp is None and len(last.blocks) == 2 and last.head is not None
    assert torch.equal(last.blocks[0].weight, net.blocks[2].weight)


# -- config rules -------------------------------------------------------------------------------
def _problems(*overrides, world_size=2):
    try:
        load_config(None, ["--model.flavor=debugtiny", *overrides], world_size=world_size)
    except ConfigError as e:
        return e.problems
    return []


def test_config_rules():
    pp2 = "--parallelism.pipeline_parallel_degree=2"
    assert _problems(pp2, "--parallelism.pipeline_parallel_schedule=ZBH2") == []
    (msg,) = _problems(pp2, "--parallelism.pipeline_parallel_schedule=zbh2")
    assert "did you mean 'ZBH2'" in msg
    (msg,) = _problems(pp2, "--training.local_batch_size=8",
                       "--parallelism.pipeline_parallel_microbatches=3")
    assert "local_batch_size = 8 must be divisible" in msg
    # debugtiny has 2 layers: ZBV needs 4 stages at pp=2.
    (msg,) = _problems(pp2, "--parallelism.pipeline_parallel_schedule=ZBV")
    assert "at least one layer" in msg
    assert _problems(pp2, "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble",
                     "--model.flavor=debugmodel", "--compile.enable=true")
    (msg,) = _problems(pp2, "--parallelism.pipeline_parallel_schedule=1F1B",
                       "--parallelism.pipeline_parallel_stages_per_rank=2")
    assert "stages_per_rank" in msg


def test_config_rules_for_what_cannot_work():
    pp2 = "--parallelism.pipeline_parallel_degree=2"
    pp4 = "--parallelism.pipeline_parallel_degree=4"

    def sched(name):
        return f"--parallelism.pipeline_parallel_schedule={name}"

    def mb(n):
        return [f"--parallelism.pipeline_parallel_microbatches={n}",
                "--training.local_batch_size=12"]

    assert _problems(pp2, sched("DualPipe"), *mb(4)) == []                  # 2 stages, 2 copies
    assert "even number >= 2 x pp = 4" in _problems(pp2, sched("DualPipe"), *mb(3))[0]
    assert "even number >= 2 x pp = 8" in _problems(pp4, sched("DualPipe"), *mb(6),
                                                   "--model.flavor=debugmodel", world_size=4)[0]
    assert "needs an even degree" in " ".join(_problems(
        "--parallelism.pipeline_parallel_degree=3", sched("DualPipe"), *mb(6),
        "--model.flavor=debugmodel", world_size=3))
    assert "needs >= 2 x pp = 4" in _problems(pp2, sched("DualPipeV"), *mb(3),
                                              "--model.flavor=debugmodel")[0]
    # 2 layers cannot fill 4 stages (V), DualPipe needs only pp = 2 stages
    assert "at least one layer" in _problems(pp2, sched("DualPipeV"), *mb(4))[0]
    autograd = "--parallelism.pipeline_parallel_split_backward=autograd"
    for name in ("ZBV", "Auto", "ZBH1", "ZBVZeroBubble", "DualPipeV"):
        (msg,) = _problems(pp2, sched(name), *mb(4), "--model.flavor=debugmodel",
                           "--compile.enable=true", autograd)
        assert "torch.compile" in msg, (name, msg)
    # deferred weight gradients (the default) need no graph walk: compile is allowed, except
    # by torch's own V schedules, which refuse compiled stages
    for name in ("ZBV", "Auto", "ZBH1", "DualPipeV"):
        assert _problems(pp2, sched(name), *mb(4), "--model.flavor=debugmodel",
                         "--compile.enable=true") == [], name
    (msg,) = _problems(pp2, sched("ZBVZeroBubble"), *mb(4), "--model.flavor=debugmodel",
                       "--compile.enable=true")
    assert "refuses torch.compile'd stages" in msg
    assert _problems(pp2, sched("1F1B"), *mb(4), "--compile.enable=true") == []
    (msg,) = _problems(pp2, sched("ZBH2"), "--parallelism.zero_stage=1", world_size=4)
    assert "zero_stage = 1" in msg
    (msg,) = _problems(pp2, sched("DualPipe"), *mb(4), "--parallelism.tensor_parallel_degree=2",
                       world_size=4)
    assert "tensor_parallel_degree = 2" in msg
    assert "must be divisible" in _problems(pp2, sched("ZBH1"), *mb(5))[0]
    # torch's 1F1B checks m >= stages only once it holds real stages: caught at load instead
    (msg,) = _problems(pp2, sched("1F1B"), "--parallelism.pipeline_parallel_microbatches=1")
    assert "1F1B needs at least one micro-batch per stage (2)" in msg


# -- parity through the Trainer -----------------------------------------------------------------
BASE = fp32_trainer_overrides(steps=STEPS, seq_len=32)  # with Adam's non-amplifying eps


def _register_pp8():
    """An 8-layer debugtiny-width flavor, so pp = 4 with 2 stages per rank splits layers."""
    from titanext.models import MODEL_FLAVORS, ModelArgs

    MODEL_FLAVORS["llama3"].setdefault("pp8", ModelArgs(dim=64, n_layers=8, n_heads=8, n_kv_heads=4,
                                                        vocab_size=264, multiple_of=32))


def _train_many(rank, world_size, runs, dump_folder, pp8=False):
    """Several Trainer runs in one spawn (start-up dominates on 2 cores)."""
    if pp8:
        _register_pp8()
    return trainer_runs(BASE, runs, dump_folder, world_size)


def _merge(results):
    """Per run: (losses of rank 0, every rank's parameters merged). A parameter held by two
    ranks (DualPipe's mirrored copies) must be bitwise equal on both."""
    merged = []
    for i in range(len(results[0])):
        params = {}
        for rank_out in results:
            for name, value in rank_out[i][1].items():
                if name in params:
                    assert torch.equal(params[name], value), f"run {i}: copies of {name} differ"
                params[name] = value
        merged.append((results[0][i][0], params))
    return merged


def _check(ref, got, label, param_rtol=1e-5):
    ref_losses, ref_params = ref
    losses, params = got
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                               msg=lambda m: f"{label}: losses {losses} vs {ref_losses}\n{m}")
    assert params.keys() == ref_params.keys(), label
    assert losses[-1] < losses[0], f"{label}: the loss should fall"
    assert_params_follow(label, params, ref_params, rtol=param_rtol)


TINY_SCHEDULES = ["GPipe", "1F1B", "ZBH1", "ZBH2"]
MULTI_STAGE_SCHEDULES = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                         "ZBV", "Auto", "DualPipeV", "DualPipe", "TorchDualPipeV"]


def test_every_schedule_name_is_covered_by_the_trainer_parity_runs():
    from titanext.schedules import SCHEDULE_NAMES

    assert set(TINY_SCHEDULES + MULTI_STAGE_SCHEDULES) == set(SCHEDULE_NAMES)


def _runs(flavor, schedules, mb, extra=()):
    return [[f"--model.flavor={flavor}", "--training.local_batch_size=8",
             "--parallelism.pipeline_parallel_degree=2",
             f"--parallelism.pipeline_parallel_schedule={s}",
             f"--parallelism.pipeline_parallel_microbatches={mb}", *extra] for s in schedules]


@pytest.mark.parametrize("flavor,schedules,mb", [
    ("debugtiny", TINY_SCHEDULES, 4),
    ("debugmodel", MULTI_STAGE_SCHEDULES, 4),
])
def test_every_schedule_matches_one_process(tmp_path, flavor, schedules, mb):
    ref = run_distributed(_train_many, 1, args=(
        [[f"--model.flavor={flavor}", "--training.local_batch_size=8"]], str(tmp_path / "ref")),
        timeout_s=120)[0][0]
    runs = _runs(flavor, schedules, mb)
    if flavor == "debugmodel":  # DualPipe sums its mirrored copies in the last accumulation step
        runs += _runs(flavor, ["DualPipe"], 4, ["--training.local_batch_size=4",
                                                "--training.global_batch_size=8"])
    results = run_distributed(_train_many, 2, args=(runs, str(tmp_path)), timeout_s=240)
    merged = _merge(results)
    for name, got in zip(schedules, merged, strict=False):
        _check(ref, got, name)
    if flavor == "debugmodel":  # accumulation adds one more fp32 summation order
        _check(ref, merged[-1], "DualPipe grad-accum", param_rtol=3e-5)


@pytest.mark.layout_parity
def test_pp2_x_fsdp2_and_grad_accum_match_one_process(tmp_path):
    ref = run_distributed(_train_many, 1, args=(
        [["--model.flavor=debugtiny", "--training.local_batch_size=8"]], str(tmp_path / "ref")),
        timeout_s=120)[0][0]
    runs = [["--model.flavor=debugtiny", "--training.local_batch_size=4",
             "--parallelism.pipeline_parallel_degree=2",
             f"--parallelism.pipeline_parallel_schedule={s}",
             "--parallelism.pipeline_parallel_microbatches=2"] for s in ("1F1B", "ZBH2")]
    runs.append(["--model.flavor=debugtiny", "--training.local_batch_size=2",
                 "--training.global_batch_size=8", "--parallelism.pipeline_parallel_degree=2",
                 "--parallelism.pipeline_parallel_schedule=ZBH1"])
    # bf16 parameters, fp32 reduction: FSDP2 adds each micro-batch's bf16 gradient to an fp32
    # accumulator. 1F1B's does it in the backward; ZBH2's deferred W's must do it too, each at
    # once (consecutive W's summed in bf16 first would round differently), so both are bitwise
    # equal: the same bf16 GEMMs, summed in fp32 in micro-batch order.
    runs += [[*run, "--training.mixed_precision_param=bfloat16"] for run in runs[:2]]
    runs.append([*runs[-1], "--parallelism.pipeline_parallel_split_backward=autograd"])
    results = run_distributed(_train_many, 4, args=(runs, str(tmp_path)), timeout_s=240)
    merged = _merge(results)
    for label, got in zip(["pp2xfsdp2 1F1B", "pp2xfsdp2 ZBH2", "pp2xfsdp2 grad-accum ZBH1"],
                          merged, strict=False):
        # Gradient accumulation adds one more fp32 summation order (as CP does in test_parity).
        _check(ref, got, label, param_rtol=3e-5 if "accum" in label else 1e-5)
    (f_losses, f_params), *split = merged[3:]
    for how, (z_losses, z_params) in zip(("deferred", "autograd"), split, strict=True):
        assert f_losses == z_losses, \
            f"bf16 params: ZBH2 ({how}) losses {z_losses} vs 1F1B {f_losses}"
        for name, p in f_params.items():
            assert torch.equal(z_params[name], p), \
                f"bf16 params: ZBH2's ({how}) {name} differs from 1F1B's"


def _split_schedules_match_one_process(tmp_path, flavor, ref_batch, extra, what, *,
                                       schedules=("ZBH1", "ZBV"), timeout_s=240, **check):
    """``schedules`` at pp = 2 (deferred weight gradients, the default) with the overrides
    ``extra`` against one process with the same ``extra`` over ``ref_batch``."""
    ref = run_distributed(_train_many, 1, args=(
        [[f"--model.flavor={flavor}", *ref_batch, *extra]], str(tmp_path / "ref")),
        timeout_s=timeout_s)[0][0]
    results = run_distributed(_train_many, 2, args=(_runs(flavor, list(schedules), 4, extra),
                                                    str(tmp_path)), timeout_s=timeout_s)
    for name, got in zip(schedules, _merge(results), strict=True):
        _check(ref, got, f"{name} + {what}", **check)


def test_deferred_split_with_op_level_selective_ac_matches_one_process(tmp_path):
    """Op-level selective AC under split schedules: with deferred weight gradients there is one
    backward per micro-batch (the recompute runs during I), so torch's op-level checkpoint works;
    ZBH1 and ZBV (V placement, local stage hand-off) at pp = 2."""
    _split_schedules_match_one_process(
        tmp_path, "debugmodel", ["--training.local_batch_size=8"],
        ["--activation_checkpoint.mode=selective",
         "--activation_checkpoint.selective_ac_option=op"], "op-level SAC")


def test_float8_split_schedules_match_one_process_float8(tmp_path):
    """float8 (emulated on CPU) under split schedules with deferral on (the default): torchao's
    Float8Linear keeps its own backward (dW during I; one log line says so), everything else
    defers. Reference: float8 in one process over the same micro-batches (gradient
    accumulation), so every float8 scale (amax of one micro-batch) is the same."""
    _split_schedules_match_one_process(
        tmp_path, "debugtiny", ["--training.local_batch_size=2", "--training.global_batch_size=8"],
        ["--float8.enable=true"], "float8", schedules=("ZBH1", "ZBH2"), param_rtol=3e-5)


@pytest.mark.torch_seam
def test_compiled_split_schedules_with_deferral_match_one_process(tmp_path):
    """Per-block torch.compile (aot_eager: dynamo and AOT autograd without inductor's codegen
    time) under ZBH1 and ZBV with deferred weight gradients: the converted linears are graph
    breaks (blocks compile without fullgraph), against a compiled one-process run."""
    _split_schedules_match_one_process(
        tmp_path, "debugmodel", ["--training.local_batch_size=8"],
        ["--compile.enable=true", "--compile.backend=aot_eager"], "compile", timeout_s=300)


def test_parity_check_can_fail(tmp_path):
    """A pipeline whose loss scale were wrong (here: a different lr) must be caught."""
    ref = run_distributed(_train_many, 1, args=(
        [["--model.flavor=debugtiny", "--training.local_batch_size=8"]], str(tmp_path / "ref")),
        timeout_s=120)[0][0]
    runs = [r + ["--optimizer.lr=2e-3"] for r in _runs("debugtiny", ["1F1B"], 4)]
    got = _merge(run_distributed(_train_many, 2, args=(runs, str(tmp_path)), timeout_s=120))[0]
    with pytest.raises(AssertionError):
        _check(ref, got, "wrong lr")


PP4_SCHEDULES = ["ZBH1", "ZBV", "DualPipeV", "DualPipe", "Auto"]


@pytest.mark.slow
def test_pp4_schedules_match_one_process(tmp_path):
    """pp = 4, 8 micro-batches, an 8-layer model (8 one-layer V stages; DualPipe: two copies of
    4 two-layer stages), every run in one 4-rank spawn."""
    flags = ["--model.flavor=pp8", "--training.local_batch_size=8"]
    ref = run_distributed(_train_many, 1, args=([flags], str(tmp_path / "ref"), True),
                          timeout_s=120)[0][0]
    runs = [[*flags, "--parallelism.pipeline_parallel_degree=4",
             f"--parallelism.pipeline_parallel_schedule={s}",
             "--parallelism.pipeline_parallel_microbatches=8"] for s in PP4_SCHEDULES]
    results = run_distributed(_train_many, 4, args=(runs, str(tmp_path), True), timeout_s=300)
    for name, got in zip(PP4_SCHEDULES, _merge(results), strict=True):
        _check(ref, got, f"pp4 {name}")


@pytest.mark.slow
def test_example_with_own_stages_runs_and_matches(tmp_path):
    """examples/pipeline_own_stages.py (the example of docs/pipeline.md) under torchrun, 2 ranks."""
    import re

    from tests.spawn import run_example

    root = REPO_ROOT
    names = ["ZBV", "DualPipe", "ZBH1"]
    out = run_example(root / "examples" / "pipeline_own_stages.py", 2, *names, cwd=tmp_path,
                      timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    errors = dict(re.findall(r"^(\w+): largest parameter error vs one process: (\S+)$",
                             out.stdout, re.M))
    assert sorted(errors) == sorted(names), out.stdout
    assert all(float(e) < 1e-5 for e in errors.values()), errors
    for name in names:
        losses = [float(v) for v in re.findall(rf"^{name} step \d: loss (\S+)$", out.stdout, re.M)]
        assert len(losses) == 3 and losses[-1] < losses[0], (name, losses)


def _dualpipe_resume(rank, world_size, folder):
    """DualPipe: 6 steps straight; 3 steps, save, resume for 3 (DualPipe, and 1F1B from the
    same checkpoint: the saved state is one copy of the model, keyed like the unsplit one)."""
    import shutil

    from titanext.config import load_config
    from titanext.trainer import Trainer

    def run(sub, schedule, until=None):
        cfg = load_config(None, [
            *BASE, "--model.flavor=debugtiny", "--training.local_batch_size=4",
            "--training.steps=6", "--checkpoint.enable=true", "--checkpoint.interval=3",
            "--parallelism.pipeline_parallel_degree=2",
            "--parallelism.pipeline_parallel_microbatches=4",
            f"--parallelism.pipeline_parallel_schedule={schedule}",
            f"--job.dump_folder={folder}/{sub}"],
            world_size=world_size)
        return Trainer(cfg).train(until_step=until)

    full = run("a", "DualPipe")
    first = run("b", "DualPipe", until=3)
    if rank == 0:
        shutil.copytree(f"{folder}/b", f"{folder}/c")
    torch.distributed.barrier()
    return full, first, run("b", "DualPipe"), run("c", "1F1B")


@pytest.mark.slow
def test_dualpipe_checkpoint_resumes_exactly_and_under_another_schedule(tmp_path):
    full, first, rest, other = run_distributed(_dualpipe_resume, 2, args=(str(tmp_path),),
                                               timeout_s=240)[0]
    assert len(first) == 3 and first + rest == full  # bitwise: same layout, same order
    torch.testing.assert_close(torch.tensor(other), torch.tensor(full[3:]), rtol=1e-5, atol=0)
