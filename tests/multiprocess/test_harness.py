"""The pooled gloo workers (tests/pool.py) behave like fresh spawns, and a failing or hung case
is named, with its rank and traceback, and never takes the next case down."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests import pool
from tests.spawn import run_distributed


def _leave_state_behind(rank: int, world_size: int) -> tuple[int, float, str | None]:
    seen = (os.getpid(), torch.rand(1).item(), os.environ.get("TITANEXT_POOL_PROBE"))
    os.environ["TITANEXT_POOL_PROBE"] = "leaked"
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234 + rank)
    torch.set_grad_enabled(False)
    return seen


def _state(rank: int, world_size: int) -> tuple:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return (os.getpid(), torch.rand(1).item(), os.environ.get("TITANEXT_POOL_PROBE"),
            torch.get_default_dtype(), torch.is_grad_enabled(), total.item())


def test_a_case_starts_from_a_fresh_process_state_on_the_same_workers():
    first = run_distributed(_leave_state_behind, 2)
    second = run_distributed(_state, 2)
    for rank in range(2):
        pid, rand, probe = first[rank]
        assert second[rank][0] == pid  # the same worker process: no new start-up
        # the worker's own start-up seed again (torch seeds each new process at random)
        assert second[rank][1:] == (rand, probe, torch.float32, True, 1.0)


def _wrong_gradient_on_rank_1(rank: int, world_size: int) -> None:
    weight = torch.nn.Parameter(torch.ones(4))
    (weight * torch.arange(4.0)).sum().backward()
    if rank == 1:
        weight.grad[2] += 1e-3  # the planted error
    reduced = weight.grad.clone()
    dist.all_reduce(reduced)
    torch.testing.assert_close(weight.grad, reduced / world_size, rtol=1e-6, atol=0)


def test_a_failing_rank_names_its_case_and_the_next_case_runs():
    with pytest.raises(AssertionError) as failure:
        run_distributed(_wrong_gradient_on_rank_1, 2, timeout_s=10)
    report = str(failure.value)
    assert "test_a_failing_rank_names_its_case_and_the_next_case_runs" in report
    assert "_wrong_gradient_on_rank_1" in report
    assert "rank 0 of 2 failed" in report or "rank 1 of 2 failed" in report
    assert "Tensor-likes are not close" in report
    assert run_distributed(_state, 2)[0][-1] == 1.0  # a new pool took the dead one's place


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("planted on rank 1")
    dist.barrier()  # rank 0 waits on the failed rank: the pool must not


def test_the_first_error_is_the_report_and_waiting_ranks_are_not_waited_for():
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_distributed(_raise_on_rank_1, 2, timeout_s=60)
    assert time.monotonic() - start < 20  # not the 60 s collective timeout
    report = str(failure.value)
    assert "rank 1 of 2 failed" in report and "ValueError: planted on rank 1" in report
    assert "rank(s) [0] of 2 still running" in report and "_raise_on_rank_1" in report


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def test_a_hung_case_times_out_alone_with_every_rank_stack(monkeypatch):
    run_distributed(_state, 2)  # a started pool: the deadline counts the case alone
    monkeypatch.setattr(pool, "DEADLINE_FLOOR_S", 2.0)
    with pytest.raises(AssertionError) as failure:
        pool.run(_sleep_forever, 2, timeout_s=0.5)
    report = str(failure.value)
    assert "still running after 2 s" in report and "rank(s) [0, 1] of 2" in report
    assert report.count("_sleep_forever") >= 3  # the case's name and both ranks' stacks
    monkeypatch.undo()
    assert run_distributed(_state, 2)[0][-1] == 1.0


def _died(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)
    dist.barrier()


def test_a_rank_that_dies_is_named_with_its_exit_code():
    with pytest.raises(AssertionError) as failure:
        run_distributed(_died, 2, timeout_s=30)
    assert "rank 0 of 2 failed:\nthe process died (exit code 3)" in str(failure.value)


def _end_the_group(rank: int, world_size: int) -> int:
    dist.barrier()
    dist.destroy_process_group()
    return os.getpid()


def test_a_case_that_ends_the_process_group_retires_its_pool():
    pids = run_distributed(_end_the_group, 2)
    after = run_distributed(_state, 2)
    assert [a[0] for a in after] != pids and after[0][-1] == 1.0


def _groups_after_a_mesh(rank: int, world_size: int) -> tuple[int, int, int]:
    from torch.distributed.device_mesh import init_device_mesh

    threads = len(os.listdir(f"/proc/{os.getpid()}/task"))
    before = len(dist.distributed_c10d._world.pg_map)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh["dp", "tp"]._flatten("dp_tp")
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.get_group("tp"))
    return before, len(dist.distributed_c10d._world.pg_map), threads


def test_the_groups_a_case_creates_end_with_it():
    """Each gloo group keeps threads that wake up: left behind by hundreds of cases, they kept
    idle workers busy. The next case sees only the default group, meshes work again, and the
    destroyed groups' threads are gone (without a garbage collection they stayed: +6 threads a
    case here)."""
    made = run_distributed(_groups_after_a_mesh, 4)
    assert made[0][1] > 1
    again = run_distributed(_groups_after_a_mesh, 4)
    assert [a[:2] for a in again] == [(1, made[0][1])] * 4
    assert run_distributed(_groups_after_a_mesh, 4) == again
