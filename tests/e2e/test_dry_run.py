"""The dry run (``[comm] mode = "fake_backend"``): one process plays rank R of N over torch's fake
process group and fake tensors, builds the real trainer, steps once and prints its memory and
communication next to the planner's (docs/dry_run.md)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import REPO_ROOT, pool
from titanext.config import ConfigError, load_config
from titanext.launch.dry_run import fewer_microbatches

ROOT = REPO_ROOT
SUMMARY = re.compile(r"^titanext: dry run: rank (\d+) of (\d+), peak memory (\d+\.\d\d) GiB "
                     r"\(planner: (\d+\.\d\d) GiB\), step comm (\d+\.\d\d) GB$")


def _argv(config: str | None, overrides: tuple[str, ...]) -> tuple[str, ...]:
    path = ("--config", str(ROOT / "train_configs" / config)) if config else ()
    return (*path, "--comm.mode=fake_backend", "--metrics.enable_tensorboard=false", *overrides)


def _main(argv: tuple[str, ...], environ: dict, out_path: str, err_path: str) -> None:
    """``python -m titanext.train argv`` in a process forked from the test pools' server, which
    has torch and the trainer imported (tests/pool.py: half of a small dry run's CPU was
    ``python -m``'s start-up), writing its output where ``out_path`` and ``err_path`` say."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(ROOT)
    for fd, path in ((1, out_path), (2, err_path)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, fd)
        os.close(file)
    from titanext.distributed.failsafe import exit_process
    from titanext.train import main

    exit_process(main(list(argv)))


def _start(argv: tuple[str, ...], *, daemon: bool = False):
    """``python -m titanext.train argv`` started (:func:`_main`); :func:`_finish` collects it."""
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # an ordinary process, no torchrun
    folder = tempfile.mkdtemp()
    out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
    process = pool.fork_context().Process(target=_main, args=(argv, env, out, err), daemon=daemon)
    process.start()
    return argv, process, folder


def _finish(started, timeout: float) -> subprocess.CompletedProcess:
    argv, process, folder = started
    try:
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(["titanext.train", *argv], timeout)
        with open(os.path.join(folder, "out")) as o, open(os.path.join(folder, "err")) as e:
            return subprocess.CompletedProcess(["titanext.train", *argv], process.exitcode,
                                               o.read(), e.read())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run(argv: tuple[str, ...], timeout: int) -> subprocess.CompletedProcess:
    if argv in _EARLY:
        return _finish(_EARLY.pop(argv), timeout)
    return _finish(_start(argv), timeout)


#: dry runs started when the session's tests were collected (:func:`start_early`), by command line
_EARLY: dict[tuple[str, ...], tuple] = {}


def start_early(config: str | None, overrides: tuple[str, ...]) -> None:
    """Start this dry run now, in the background, for the test that will ask for it: a dry run
    steps fake tensors in Python on one core, and the tests before it (tests/docs, the
    planner's advice) mostly keep one core busy. tests/e2e/conftest.py calls it for LARGE when
    the session will run its test. A daemon: a session that ends before the test asks does not
    wait for it."""
    argv = _argv(config, tuple(overrides))
    if argv not in _EARLY:
        _EARLY[argv] = _start(argv, daemon=True)


#: every dry run of this module by its command line: one asked for again (the DualPipe case at 32
#: micro-batches, in two tests) is answered from its first run
_DONE: dict[tuple[str, ...], subprocess.CompletedProcess] = {}


def dry_runs(*runs: tuple[str | None, tuple[str, ...]], timeout: int = 240
             ) -> list[subprocess.CompletedProcess]:
    """``python -m titanext.train`` as a dry run of each ``(config, overrides)``
    (``train_configs/<config>``; None: the defaults), each in a process of its own (:func:`_main`),
    side by side: a dry run steps fake tensors in Python on one core, so two run in the time of
    one on CI's two cores."""
    commands = [_argv(config, tuple(overrides)) for config, overrides in runs]
    todo = list(dict.fromkeys(c for c in commands if c not in _DONE))
    if todo:
        with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as threads:
            for command, out in zip(todo, threads.map(lambda c: _run(c, timeout), todo),
                                    strict=True):
                _DONE[command] = out
    return [_DONE[c] for c in commands]


def dry_run(config: str | None, *overrides: str, timeout: int = 240
            ) -> subprocess.CompletedProcess:
    """One dry run of ``config`` with ``overrides`` (:func:`dry_runs`)."""
    return dry_runs((config, overrides), timeout=timeout)[0]


#: the 671B dry run (about 50 s of CPU on one core): started at collection (tests/e2e/conftest.py)
LARGE = ("deepseek_v3_671b.toml", (
    "--checkpoint.enable=false", "--comm.fake_rank=1024", "--training.local_batch_size=32",
    "--training.global_batch_size=4096", "--parallelism.pipeline_parallel_microbatches=32",
    "--float8.enable=false", "--float8.moe_experts=false"))


def test_a_large_config_dry_runs_fits_and_the_planner_is_within_15_percent():
    """The DeepSeek-V3 671B config at its real world size (rank 1024 of 2048, pp rank 8: PP 16
    with DualPipe, EP 64, ZeRO-2 over 128, MLA; recompute by module with one block of this
    stage recomputed whole, three float8-stored inputs, bf16 Adam moments; the middle ranks
    hold the most deferred weight gradients, capped at 2; two-level float8 dispatch
    overlapped) builds, steps, fits in 80 GiB and prints its summary line; the planner is
    within 15% of the measured peak. At 32 micro-batches of its 120 (DualPipe's floor at pp 16:
    about 50 s of CPU, where the shipped 120 take about 70 s a rank: docs/deepseek_v3.md has
    those figures) and without float8 linears: the planner does not model the float8 inputs
    torchao's linears save for their backward (2026-11-29: dry run 67.95 GiB, planner 63.02)."""
    out = dry_run(LARGE[0], *LARGE[1], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    m = SUMMARY.match(out.stdout.strip().splitlines()[-1])
    assert m and (int(m[1]), int(m[2])) == (1024, 2048), out.stdout[-2000:]
    measured, planner = float(m[3]), float(m[4])
    assert measured <= 80, measured
    assert abs(planner / measured - 1) <= 0.15, (measured, planner)
    assert "alltoall" in out.stdout and "send" in out.stdout  # EP and the pipeline moved data


# the pp=2 ZBV case runs torch's pipeline start-up on fake tensors (V placement: stages 1 and 2
# share rank 1); torch 2.11 and 2.13 start stages through different private protocols
@pytest.mark.parametrize("world_size,rank,extra", [
    (8, 3, ()), (64, 63, ()),
    pytest.param(8, 5, ("--parallelism.pipeline_parallel_degree=2",
                        "--parallelism.pipeline_parallel_schedule=ZBV"),
                 marks=pytest.mark.torch_seam, id="8-5-pp2_zbv"),
])
def test_debug_model_dry_run_prints_the_summary_line(world_size, rank, extra):
    out = dry_run("debug_model.toml", f"--comm.fake_world_size={world_size}",
                  f"--comm.fake_rank={rank}", *extra)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    m = SUMMARY.match(last)
    assert m, last
    assert (int(m[1]), int(m[2])) == (rank, world_size)
    assert float(m[3]) > 0 and float(m[4]) > 0 and float(m[5]) > 0  # FSDP gathers and reduces
    assert "allgather" in out.stdout and "reduce_scatter" in out.stdout


def test_overlapped_expert_parallel_dry_runs():
    """DualPipe's paired chunks run one side on a worker thread, where torch's per-thread fake
    mode is not active: that side made real count tensors and its recompute found 0 routed rows
    (a CheckpointError). A dry run steps the pair on one thread (nothing to overlap there)."""
    out = dry_run("debug_moe.toml", "--comm.fake_world_size=16", "--comm.fake_rank=0",
                  "--model.flavor=debugdeepseek", "--parallelism.expert_parallel_degree=4",
                  "--parallelism.pipeline_parallel_degree=2",
                  "--parallelism.pipeline_parallel_schedule=DualPipe",
                  "--parallelism.pipeline_parallel_microbatches=4",
                  "--parallelism.expert_parallel_dispatch=two_level",
                  "--parallelism.expert_parallel_ranks_per_node=2",
                  "--parallelism.expert_parallel_float8_dispatch=true",
                  "--parallelism.expert_parallel_comm_overlap=true",
                  "--activation_checkpoint.mode=full")
    assert out.returncode == 0, out.stderr[-3000:]
    assert SUMMARY.match(out.stdout.strip().splitlines()[-1]), out.stdout[-2000:]


PEAK_BYTES = re.compile(r"^titanext: dry run: peak of the step = (\d+) bytes$", re.M)
OPTIMIZER_PEAK_BYTES = re.compile(
    r"^titanext: dry run: peak in the optimizer step = (\d+) bytes$", re.M)
COMM_ROW = re.compile(r"^(\w+) +(\d+) +(\S+)$", re.M)  # collective, calls, GB


def _peak_and_comm(out: subprocess.CompletedProcess) -> tuple[int, dict[str, tuple[str, str]]]:
    assert out.returncode == 0, out.stderr[-3000:]
    return (int(PEAK_BYTES.search(out.stdout)[1]),
            {m[1]: (m[2], m[3]) for m in COMM_ROW.finditer(out.stdout) if m[1] != "collective"})


def test_dualpipe_dry_run_peak_does_not_grow_with_the_micro_batches():
    """DualPipe's middle rank (debug model, pp 4, rank 1, full AC) holds as many micro-batches
    whatever their count. The dry run measured 73.05 / 76.05 MiB at 8 / 32 (one boundary tensor
    more per micro-batch): MemTracker's module hooks kept every micro-batch's graph, and its
    received input, until the step ended (issue 45). Stepping every micro-batch (the default
    steps 8 of 32 here: the case below, which reuses the run at 32). The optimizer step's own
    peak does not grow either: it was 4 boundary tensors more per micro-batch (76.05 / 88.05 MiB
    at 8 / 32), the meta stand-ins of the released receive buffers, which the tracker's phase
    summed as memory."""
    at_8, at_32 = dry_runs(*(_fewer_case("dualpipe", m, "--comm.fake_microbatches=all")
                             for m in (8, 32)))
    peaks = {8: _peak_and_comm(at_8)[0], 32: _peak_and_comm(at_32)[0]}
    step_peaks = {m: int(OPTIMIZER_PEAK_BYTES.search(out.stdout)[1])
                  for m, out in ((8, at_8), (32, at_32))}
    assert peaks[32] == peaks[8], peaks  # bytes; the growth was 3 MiB
    assert step_peaks[32] == step_peaks[8], step_peaks


FEWER_CASES = {  # (config, world size, rank, micro-batches, fewest, overrides)
    "dualpipe": ("debug_model.toml", 4, 1, 32, 10, [
        "--parallelism.pipeline_parallel_degree=4", "--activation_checkpoint.mode=full",
        "--parallelism.pipeline_parallel_schedule=DualPipe"]),
    "1f1b_fsdp": ("debug_model.toml", 8, 2, 16, 5, [
        "--parallelism.pipeline_parallel_degree=4", "--activation_checkpoint.mode=full",
        "--parallelism.pipeline_parallel_schedule=1F1B"]),
    # V placement, split backward; at 3 micro-batches (a run holding the first W repeated) the
    # peak was 2.9 MB under the full step's
    "zbv": ("debug_model.toml", 2, 1, 12, 5, [
        "--parallelism.pipeline_parallel_degree=2",
        "--parallelism.pipeline_parallel_schedule=ZBV"]),
    # MLA and MoE blocks, EP two-level float8 dispatch overlapped with the paired chunks (as
    # the 671B; its DualPipe needs more blocks than the debug models have at pp 4)
    "1f1b_ep_overlap": ("debug_moe.toml", 8, 0, 16, 6, [
        "--model.flavor=debugdeepseek", "--parallelism.expert_parallel_degree=4",
        "--parallelism.pipeline_parallel_degree=2", "--activation_checkpoint.mode=full",
        "--parallelism.pipeline_parallel_schedule=1F1B",
        "--parallelism.expert_parallel_dispatch=two_level",
        "--parallelism.expert_parallel_ranks_per_node=2",
        "--parallelism.expert_parallel_float8_dispatch=true",
        "--parallelism.expert_parallel_comm_overlap=true"]),
}


def _fewer_case(case: str, microbatches: int | None = None, *more: str
                ) -> tuple[str, tuple[str, ...]]:
    """FEWER_CASES[case] as a dry run's (config, overrides), at ``microbatches`` (None: its
    own count)."""
    config, world, rank, m, _, extra = FEWER_CASES[case]
    m = m if microbatches is None else microbatches
    return config, (f"--comm.fake_world_size={world}", f"--comm.fake_rank={rank}", *extra,
                    f"--parallelism.pipeline_parallel_microbatches={m}",
                    f"--training.local_batch_size={m}", *more)


@pytest.mark.parametrize("case", FEWER_CASES)
def test_fewest_micro_batches_give_the_full_steps_peak_and_comm(case):
    """A pipelined dry run steps the fewest micro-batches whose action list is the full one less
    repetitions of a balanced steady state (docs/dry_run.md): its peak is the full step's to the
    byte, and its collectives (the middle micro-batch's added per micro-batch not run) are the
    full step's, call for call."""
    m, fewest = FEWER_CASES[case][3:5]
    fewer, every = dry_runs(_fewer_case(case), _fewer_case(case, None,
                                                           "--comm.fake_microbatches=all"))
    assert f"pipeline: {fewest} of {m} micro-batches stepped (exact)" in fewer.stdout, \
        fewer.stdout[-3000:]
    assert _peak_and_comm(fewer) == _peak_and_comm(every)


def test_a_rank_holding_the_last_stage_steps_every_micro_batch():
    """Each micro-batch's returned loss stays to the step's end there (measured: 32 bytes more
    at 24 than at 8 micro-batches on DualPipe's rank 0), so its peak grows with the count."""
    cfg = load_config(str(ROOT / "train_configs" / "debug_model.toml"), [
        "--comm.mode=fake_backend", "--comm.fake_world_size=4", "--comm.fake_rank=0",
        "--parallelism.pipeline_parallel_degree=4",
        "--parallelism.pipeline_parallel_schedule=DualPipe",
        "--parallelism.pipeline_parallel_microbatches=24", "--training.local_batch_size=24"])
    same, rep, why = fewer_microbatches(cfg, 4, 0)
    assert same is cfg and rep is None and "holds the last stage" in why
    reduced, rep, why = fewer_microbatches(cfg, 4, 1)
    assert (reduced.parallelism.pipeline_parallel_microbatches, rep.fewer) == (10, 10), why
    assert reduced.training.local_batch_size == 10 and cfg.training.local_batch_size == 24


def test_a_one_rank_moe_model_dry_runs_in_float32():
    """One rank, no FSDP: the experts run in float32, where the CPU's grouped GEMM runs but
    torch's fake kernel for it takes only bf16 (it crashed), and the per-expert loop needs
    counts a fake tensor does not have: a dry run takes the loop over balanced counts, and
    reads no fake tensor's address (torch warns that doing so will become an error)."""
    out = dry_run("debug_moe.toml")
    assert out.returncode == 0, out.stderr[-3000:]
    assert SUMMARY.match(out.stdout.strip().splitlines()[-1]), out.stdout[-2000:]
    assert "data pointer of FakeTensor" not in out.stderr, out.stderr[-3000:]


def test_bad_fake_world_exits_2_with_one_line():
    world, rank = dry_runs(("debug_model.toml", ("--comm.fake_world_size=6",
                                                 "--parallelism.tensor_parallel_degree=4")),
                           ("debug_model.toml", ("--comm.fake_world_size=8",
                                                 "--comm.fake_rank=8")),  # outside the world
                           timeout=60)
    for out, what in ((world, "world size 6"), (rank, "comm.fake_rank = 8")):
        assert out.returncode == 2
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert what in out.stderr


def test_fake_world_rules():
    cfg = load_config(None, ["--comm.mode=fake_backend", "--parallelism.tensor_parallel_degree=2",
                             "--parallelism.pipeline_parallel_degree=2"], world_size=1)
    from titanext.config.layout import fake_world_size

    assert fake_world_size(cfg) == 4  # the degrees' product, dp_shard = -1 counting 1
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--comm.mode=fake_backend", "--comm.fake_world_size=4",
                           "--comm.fake_rank=4"])
    assert e.value.problems == ["comm.fake_rank = 4 must be below the dry run's world size 4"]
    with pytest.raises(ConfigError) as e:  # real mode keeps the launcher's world size
        load_config(None, ["--parallelism.tensor_parallel_degree=2"], world_size=1)


# -- truth both ways: dry run against a real gloo run, planner against the dry run --------------

TRUTH_CASES = {  # 4 ranks each; every case runs for real and as a dry run in ONE spawn
    "fsdp": ("debug_model.toml", []),
    "tp": ("debug_model.toml", ["--parallelism.tensor_parallel_degree=2"]),
    "cp": ("debug_model.toml", ["--parallelism.context_parallel_degree=2"]),
    "pp": ("debug_pp.toml", []),
    "ep": ("debug_moe.toml", ["--parallelism.expert_parallel_degree=2"]),
    # two-level dispatch over 2 "nodes" of 2 ranks, float8 rows (node groups on fake ranks too)
    "ep_two_level": ("debug_moe.toml", ["--parallelism.expert_parallel_degree=4",
                                        "--parallelism.expert_parallel_dispatch=two_level",
                                        "--parallelism.expert_parallel_ranks_per_node=2",
                                        "--parallelism.expert_parallel_float8_dispatch=true"]),
    # Muon's owner exchange: the real plan, buffers and all_to_alls in the dry run too
    # (bfloat16 pieces in both: 'auto' is float32 on a CPU and bfloat16 in a dry run)
    "muon": ("debug_muon.toml", ["--optimizer.muon_ns_dtype=bfloat16"]),
}
STEP_CASES = ("muon",)  # the optimizer step's own peak is checked as well
DRY_RANKS = (0, 3)  # a dry run of every rank would only repeat these (pp: first and last)
PLANNER_CASES = tuple(TRUTH_CASES)  # the planner's 15% holds on every case


def _truth(rank: int, world_size: int, folder: str) -> dict[str, tuple]:
    """{case: (real peak, dry-run peak, planner; the same three in the optimizer step)} on this
    rank (dry runs on DRY_RANKS only)."""
    import torch.distributed as dist

    from tests.pool import forget_meshes
    from titanext._fake_backend import init_fake_process_group
    from titanext.launch.dry_run import measure, measure_real

    base = ["--training.dataset=synthetic", "--metrics.enable_tensorboard=false",
            "--checkpoint.enable=false", f"--job.dump_folder={folder}/{rank}"]
    real = {name: measure_real(load_config(str(ROOT / "train_configs" / config),
                                           [*base, *args], world_size=world_size))
            for name, (config, args) in TRUTH_CASES.items()}
    dist.barrier()
    dist.destroy_process_group()
    # torch's caches still hold the real run's meshes, naming groups that are gone: an equal
    # mesh of the dry run would come back with them (passing alone, where the fake world's
    # group names happen to repeat the real one's, and failing after other cases)
    forget_meshes()
    init_fake_process_group(rank, world_size)  # the same process now plays its rank
    out = {}
    for name, (config, args) in TRUTH_CASES.items():
        if rank in DRY_RANKS:
            fake = measure(load_config(str(ROOT / "train_configs" / config), [
                *base, *args, "--comm.mode=fake_backend", f"--comm.fake_world_size={world_size}",
                f"--comm.fake_rank={rank}"]))
            out[name] = (real[name].peak, fake.peak, fake.planner, real[name].optimizer_peak,
                         fake.optimizer_peak, fake.planner_optimizer)
    return out


def test_dry_run_matches_the_real_run_and_the_planner_matches_the_dry_run(tmp_path):
    """The dry run's peak is within 5% of the same tracker's peak in a real gloo run of the same
    config (FSDP, TP, CP, PP, EP and Muon at 4 ranks), and the planner within 15% of the dry
    run; with Muon the optimizer step's own peak (the owners' buffers) too."""
    from tests.spawn import run_distributed

    results = run_distributed(_truth, 4, args=(str(tmp_path),), timeout_s=240)
    bad = []
    for rank in DRY_RANKS:
        for name, figures in results[rank].items():
            for moment, (real, fake, planner) in (("", figures[:3]),
                                                  (" (optimizer step)", figures[3:])):
                if moment and name not in STEP_CASES:
                    continue
                if abs(fake / real - 1) > 0.05:
                    bad.append(f"{name} rank {rank}{moment}: dry run {fake} vs real {real} bytes")
                if name in PLANNER_CASES and abs(planner / fake - 1) > 0.15:
                    bad.append(f"{name} rank {rank}{moment}: planner {planner:.0f} vs dry run "
                               f"{fake} bytes")
    assert not bad, "\n".join(bad)


def test_the_1b_with_float8_dry_runs_where_the_planner_says():
    """The same 1B run with every linear but the output in float8 tensorwise (as the GPU check
    ran it) and the fused optimizer, whose peak is the backward, where float8 could change what
    is saved: the dry run 27.80 GiB as in bf16 (selective AC saves the same bf16 outputs;
    torchao's linears save their high-precision input and the weight), the planner 27.77 GiB.
    No GPU measured this one (docs/benchmarks.md)."""
    from tests.unit.test_plan_calibration import gpucheck_overrides

    out = dry_run(None, *gpucheck_overrides(), "--optimizer.implementation=fused",
                  "--float8.enable=true", "--float8.recipe=tensorwise",
                  "--float8.filter_fqns=output", "--float8.auto_filter=false")
    assert out.returncode == 0, out.stderr[-3000:]
    m = SUMMARY.match(out.stdout.strip().splitlines()[-1])
    assert m, out.stdout[-2000:]
    dry, planner = float(m[3]), float(m[4])
    assert abs(planner / dry - 1) <= 0.10, (dry, planner)
    assert "float8: 112 matmul module(s) converted" in out.stdout + out.stderr  # 16 x 7


def test_dry_run_of_the_1b_gpu_run_is_within_10_percent_of_its_measured_peak():
    """The GPU check's 1B bf16 run (2 x 2048, one H200) as a dry run (about 10 s): its peak,
    the foreach AdamW step, and the planner's are within 10% of max_memory_allocated there
    (docs/planner.md#calibration; compile is off in a dry run, which the step's peak does not
    see)."""
    from tests.unit.test_plan_calibration import gpucheck_overrides, measured_1b_peak

    out = dry_run(None, *gpucheck_overrides())
    assert out.returncode == 0, out.stderr[-3000:]
    m = SUMMARY.match(out.stdout.strip().splitlines()[-1])
    assert m, out.stdout[-2000:]
    measured = measured_1b_peak() / 2**30
    for what, gib in (("dry run", float(m[3])), ("planner", float(m[4]))):
        assert abs(gib / measured - 1) <= 0.10, (what, gib, measured)


def test_memory_recipe_dry_run_is_where_the_planner_says():
    """Issue 45's memory recipe on the DeepSeek-V3 debug model (MLA, a dense block, routed and
    shared experts) under FSDP over 2 fake ranks in bf16: recompute by module with DeepSeek-V3's
    choice (norms, MLA up-projections, SwiGLU), both float8-stored inputs and bf16 Adam moments.
    The planner's MLA terms, the recompute and float8 drops are within 10% of the dry run's peak
    (0.905 when measured; every single choice 0.92-0.93, docs/deepseek_v3.md)."""
    out = dry_run(None, "--model.flavor=debugdeepseek", "--training.dataset=synthetic",
                  "--training.seq_len=512", "--training.local_batch_size=2",
                  "--training.mixed_precision_param=bfloat16", "--checkpoint.enable=false",
                  "--comm.fake_world_size=2", "--comm.fake_rank=0",
                  "--activation_checkpoint.mode=modules", "--optimizer.state_dtype=bfloat16",
                  "--activation_checkpoint.float8_storage=expert_up_proj_input,"
                  "attention_out_input")
    assert out.returncode == 0, out.stderr[-3000:]
    m = SUMMARY.match(out.stdout.strip().splitlines()[-1])
    assert m, out.stdout[-2000:]
    assert "Optstate" in out.stdout
    measured = float(out.stdout.split("peak of the step")[1].split()[0])
    planner = float(out.stdout.split("\nplanner")[1].split()[0])
    assert abs(planner / measured - 1) <= 0.10, (measured, planner)
