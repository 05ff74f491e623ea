"""tests/unit/ starts no process group: each unit test is checked for it (the inner loop,
``pytest tests/unit tests/docs``, stays in pytest's own processes)."""

import pytest
import torch.distributed as dist

from tests import pool


@pytest.fixture(autouse=True)
def _no_process_group():
    cases = pool.cases_run
    yield
    assert pool.cases_run == cases, (
        "a unit test ran a multi-process case: move it to tests/multiprocess/")
    assert not dist.is_initialized(), (
        "a unit test left a process group behind (a Trainer builds one even on one rank): "
        "move it to tests/multiprocess/")
