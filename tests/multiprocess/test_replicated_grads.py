"""The invariant "replicated gradients agree" (titanext.plugins.replicated_grads) on gloo ranks:
it names the parameter and the dim of a real mismatch at the first step, and stays silent on
right wirings (TP with the QK-norm rule, FSDP x TP, HSDP). All cases share one spawn per size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.invariant_models import VOCAB, qk_norm_lm, tp_plan
from tests.spawn import run_distributed


def _batch(rows: int = 4, seq: int = 8):
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _loss(model, rows=slice(None)):
    x, y = _batch()
    return F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten())


def _tp_case(mesh, qk_norm_rule: bool) -> tuple[list[str], str]:
    """(the check's lines, apply_tensor_parallel's WARNING line on rank 0)."""
    import logging

    from titanext.plugins.replicated_grads import replicated_grad_problems
    from titanext.plugins.tensor_parallel import apply_tensor_parallel

    class Keep(logging.Handler):
        lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    handler = Keep()
    logging.getLogger("titanext").addHandler(handler)
    torch.manual_seed(0)
    model = qk_norm_lm()
    try:
        apply_tensor_parallel(model, mesh["tp"], tp_plan(qk_norm_rule=qk_norm_rule))
    finally:
        logging.getLogger("titanext").removeHandler(handler)
    _loss(model).backward()
    return replicated_grad_problems(model, {"tp": mesh["tp"]}), " ".join(handler.lines)


class _Outer(torch.optim.SGD):
    """An optimizer stepping another inside its step (as ZeroRedundancyOptimizer does)."""

    def __init__(self, params, lr):
        params = list(params)
        super().__init__(params, lr=lr)
        self.inner = torch.optim.SGD(params, lr=lr)

    def step(self, closure=None):
        return self.inner.step()


def _hook_case(mesh) -> dict:
    """install_replicated_grad_check: checks the first `steps` steps once each, then stops;
    several installs at once (the first step's pre hook finds two)."""
    from titanext.plugins.replicated_grads import install_replicated_grad_check
    from titanext.plugins.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    model = qk_norm_lm()
    apply_tensor_parallel(model, mesh["tp"], tp_plan(qk_norm_rule=True))
    # another install that ends first, registered before: its hooks must end without mutating
    # torch's hook dicts while torch iterates over them (a second trainer in one process)
    install_replicated_grad_check(model, {"tp": mesh["tp"]}, steps=1)
    check = install_replicated_grad_check(model, {"tp": mesh["tp"]}, steps=2)
    opt = _Outer(model.parameters(), lr=0.1)
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)  # not the model's
    for _ in range(3):
        _loss(model).backward()
        opt.step()
        other.step()
        opt.zero_grad()
    return {"calls": check.calls, "model_released": check.modules == []}


def _body_tp(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    (with_rule, log_with), (without_rule, log_without) = _tp_case(mesh, True), _tp_case(mesh,
                                                                                       False)
    out = {"with_rule": with_rule, "without_rule": without_rule, "hook": _hook_case(mesh),
           "logs": (log_with, log_without)}
    dist.barrier()
    return out


def _body_2d(rank, world_size):
    """dp x tp: FSDP over dp (its DTensors span dp only: tp is checked as an implicit dim), a
    wiring without FSDP whose gradients are never reduced over dp (caught on dp), HSDP's
    replicate dim (a DTensor Replicate placement), and parallelize()'s optimizer-step hook."""
    from torch.distributed.device_mesh import init_device_mesh

    from titanext.distributed.parallel_dims import ParallelDims
    from titanext.distributed.parallelize import parallelize
    from titanext.plugins.fsdp import apply_fsdp
    from titanext.plugins.replicated_grads import (
        ReplicatedGradientMismatch,
        replicated_grad_problems,
    )
    from titanext.plugins.tensor_parallel import apply_tensor_parallel

    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    mine = slice(2 * dp, 2 * dp + 2)
    for rule in (True, False):
        torch.manual_seed(0)
        model = qk_norm_lm()
        apply_tensor_parallel(model, mesh["tp"], tp_plan(qk_norm_rule=rule))
        apply_fsdp(model, mesh["dp"])
        _loss(model, mine).backward()
        out[f"fsdp_tp_{rule}"] = replicated_grad_problems(model, {"tp": mesh["tp"],
                                                                 "dp": mesh["dp"]})
    torch.manual_seed(0)
    model = qk_norm_lm()  # plain data parallel without any gradient reduction
    _loss(model, mine).backward()
    out["unreduced_dp"] = replicated_grad_problems(model, {"dp": mesh["dp"]})

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(0)
    model = qk_norm_lm()
    apply_fsdp(model, hsdp)
    rows = slice(hsdp.get_coordinate()[0] * 2 + hsdp.get_coordinate()[1], None, 4)
    _loss(model, rows).backward()
    out["hsdp"] = replicated_grad_problems(model, {})

    # parallelize(): checked before the first optimizer steps, with no code in the loop
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4)
    dims.build_mesh("cpu")
    for rule in (True, False):
        torch.manual_seed(0)
        model = parallelize(qk_norm_lm(), dims, tp_plan=tp_plan(qk_norm_rule=rule),
                            check_replicated_grads=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            for _ in range(2):
                _loss(model, mine).backward()
                opt.step()
                opt.zero_grad()
            out[f"parallelize_{rule}"] = "ok"
        except ReplicatedGradientMismatch as e:
            out[f"parallelize_{rule}"] = str(e)
    dist.barrier()
    return out


@pytest.mark.torch_seam  # torch's global optimizer step hooks, SequenceParallel's Replicate grads
def test_replicated_gradients_are_checked_over_tp():
    results = run_distributed(_body_tp, 2)
    for r in results:
        assert r["with_rule"] == [], r["with_rule"]
        lines = r["without_rule"]
        # q_norm and k_norm of both blocks, nothing else
        assert len(lines) == 4, lines
        assert all(("q_norm.weight" in x or "k_norm.weight" in x) for x in lines), lines
        assert "gradients differ across tp ranks (rel" in lines[0]
        assert "needs a rule" in lines[0]
    assert results[0]["without_rule"] == results[1]["without_rule"]  # every rank says the same
    log_with, log_without = results[0]["logs"]  # rank 0's WARNING line names them beforehand
    assert "NO RULE" not in log_with, log_with
    assert "NO RULE inside a split attention / MLP" in log_without, log_without
    assert "layers.0.attention.q_norm.weight" in log_without, log_without
    # 3 steps of a nested optimizer, steps=2: two checks (not four), then the hooks let go
    assert [r["hook"] for r in results] == [{"calls": 2, "model_released": True}] * 2


def test_replicated_gradients_are_checked_over_fsdp_hsdp_and_parallelize():
    results = run_distributed(_body_2d, 4)
    for r in results:
        assert r["fsdp_tp_True"] == [], r["fsdp_tp_True"]
        bad = r["fsdp_tp_False"]
        assert bad and all("norm.weight: gradients differ across tp ranks" in x for x in bad), bad
        # no reduction at all: every parameter differs over dp
        assert len(r["unreduced_dp"]) == sum(1 for _ in qk_norm_lm().parameters())
        assert all("across dp ranks" in x and "not reduced" in x for x in r["unreduced_dp"])
        assert r["hsdp"] == [], r["hsdp"]
        assert r["parallelize_True"] == "ok", r["parallelize_True"]
        assert r["parallelize_False"].startswith("step 1: layers.")
        assert "q_norm.weight: gradients differ across tp ranks" in r["parallelize_False"]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("shift", [0, 1, 7])
def test_checksum_spread_is_relative(shift, seed):
    from titanext.plugins.replicated_grads import _local_sums, _spread

    g = torch.randn(100, generator=torch.Generator().manual_seed(seed))
    other = g.roll(shift)  # a permutation: only the position-weighted sum sees it
    a, b = _local_sums(g, {}), _local_sums(other, {})
    spread = _spread(torch.maximum(a, b), torch.minimum(a, b), 100)
    assert (spread > 1e-3) == bool(shift), spread


def test_checksums_in_chunks_equal_one_pass(monkeypatch):
    from titanext.plugins import replicated_grads

    g = torch.randn(1000)
    whole = replicated_grads._local_sums(g, {})
    monkeypatch.setattr(replicated_grads, "_CHUNK", 64)
    assert torch.allclose(replicated_grads._local_sums(g, {}), whole, rtol=1e-12, atol=1e-12)


def _body_trainer(rank, world_size, folder):
    """The trainer at tp = 2 without SP (the norms are plain tensors replicated over tp): the
    check runs on the first `check_replicated_grads_steps` steps and is silent; a gradient
    perturbed on one tp rank stops step 1 naming the parameter."""
    from tests.spawn import fp32_trainer_overrides
    from titanext.config import load_config
    from titanext.plugins import replicated_grads
    from titanext.trainer import Trainer

    calls = []
    original = replicated_grads.ReplicatedGradCheck.__call__

    def counted(self, step=None):
        calls.append(step)
        return original(self, step)

    replicated_grads.ReplicatedGradCheck.__call__ = counted
    out = {}
    try:
        for i, perturb in enumerate((False, True)):
            cfg = load_config(None, [
                *fp32_trainer_overrides(steps=3, seq_len=32, flavor="debugtiny",
                                        check_steps=None),  # the default
                "--parallelism.tensor_parallel_degree=2",
                "--parallelism.enable_sequence_parallel=false",
                "--parallelism.data_parallel_shard_degree=1",
                f"--job.dump_folder={folder}/{i}"], world_size=world_size)
            trainer = Trainer(cfg)
            if perturb and rank == 1:
                def scale(p):
                    p.grad.mul_(1.5)

                trainer.model.norm.weight.register_post_accumulate_grad_hook(scale)
            calls.clear()
            try:
                trainer.train()
                out[perturb] = ("ok", list(calls))
            except replicated_grads.ReplicatedGradientMismatch as e:
                out[perturb] = (str(e), list(calls))
    finally:
        replicated_grads.ReplicatedGradCheck.__call__ = original
    dist.barrier()
    return out


def test_the_trainer_checks_the_first_steps(tmp_path):
    results = run_distributed(_body_trainer, 2, args=(str(tmp_path),), timeout_s=120)
    for r in results:
        assert r[False] == ("ok", [1, 2]), r[False]  # default: the first 2 of 3 steps
        msg, calls = r[True]
        assert calls == [1] and msg.startswith("step 1: norm.weight: gradients differ across "
                                               "tp ranks (rel 0.56)"), msg


def _body_released(rank, world_size, folder):
    """A trainer whose run ends before its checked steps (1 step, check on 2): once the trainer
    goes, its model and its check (holding the trainer's meshes, whose groups run gloo's
    threads) go too. torch's global optimizer hooks outlive the trainer and held both before:
    every trainer of a process leaked them (the test pools retired on 100+ gloo threads)."""
    import gc
    import weakref

    from tests.spawn import fp32_trainer_overrides
    from titanext.config import load_config
    from titanext.plugins.replicated_grads import ReplicatedGradCheck
    from titanext.trainer import Trainer

    cfg = load_config(None, [
        *fp32_trainer_overrides(steps=1, seq_len=32, flavor="debugtiny", check_steps=None),
        "--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1",
        f"--job.dump_folder={folder}"], world_size=world_size)
    trainer = Trainer(cfg)
    trainer.train()
    checks = [weakref.ref(o) for o in gc.get_objects() if isinstance(o, ReplicatedGradCheck)]
    model = weakref.ref(trainer.model)
    del trainer
    gc.collect()
    return len(checks), model() is None, all(c() is None for c in checks)


def test_an_unfinished_check_lets_the_trainer_go(tmp_path):
    for checks, model_gone, checks_gone in run_distributed(_body_released, 2,
                                                           args=(str(tmp_path),), timeout_s=120):
        assert checks == 1 and model_gone and checks_gone
