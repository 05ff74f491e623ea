"""Session-wide test plumbing: the gloo worker pools (tests/pool.py) end with the session, and
the summary says how many started for how many cases (start-up is the cost they save).

Every test starts from one fixed torch seed. A fresh Python process seeds torch's generator at
random, so an unseeded test drew other numbers in every run and after every other test: stop 52's
CI failed on a test whose random routing hit an edge for about one seed in three. With a fixed
seed, a run here and a run on CI draw the same numbers (each multi-process case starts from the
same seed: tests/pool.py)."""

import pytest
import torch

from tests import pool


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(pool.SEED)


def pytest_collection_finish(session):
    """Every module the tests import is in by now and lives as long as the session: frozen
    (:func:`tests.pool.freeze_what_lives`), the collector's full passes walk only what tests
    make."""
    pool.freeze_what_lives()


def pytest_terminal_summary(terminalreporter):
    if pool.cases_run:
        ended = ", ".join(f"{n} {why}" for why, n in sorted(pool.pools_ended.items()))
        terminalreporter.write_line(
            f"gloo worker pools: {pool.pools_started} started for {pool.cases_run} multi-process "
            f"cases" + (f" ({ended})" if ended else ""))
        for line in pool.retired_by:
            terminalreporter.write_line(f"  retired after {line}")


def pytest_sessionfinish(session, exitstatus):
    pool.shutdown()
