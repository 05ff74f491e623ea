"""Session-wide test plumbing: the gloo worker pools (tests/pool.py) end with the session, and
the summary says how many started for how many cases (start-up is the cost they save), summed
over pytest-xdist's workers where the run has them (``-n 2``, the README's test command).

Every test starts from one fixed torch seed. A fresh Python process seeds torch's generator at
random, so an unseeded test drew other numbers in every run and after every other test: stop 52's
CI failed on a test whose random routing hit an edge for about one seed in three. With a fixed
seed, a run here and a run on CI draw the same numbers (each multi-process case starts from the
same seed: tests/pool.py)."""

import os

import pytest
import torch

from tests import pool


def pytest_configure(config):
    """Under pytest-xdist (``-n 2``: the README's test command) each stream computes on its share
    of the cores. torch's default is one intra-op thread per core in every process, and two
    streams of OpenMP threads spinning on each other's cores made in-process tests up to 60x
    slower (tests/unit/test_float8_storage.py: 0.33 s alone, 22 s beside the other stream)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers and os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(pool.SEED)


def pytest_collection_finish(session):
    """Every module the tests import is in by now and lives as long as the session: frozen
    (:func:`tests.pool.freeze_what_lives`), the collector's full passes walk only what tests
    make."""
    pool.freeze_what_lives()


#: What each pool's process reported: this one's, and under ``-n`` (pytest-xdist: the README's test
#: command runs two streams, each with pools of its own) each worker's, sent back at its end.
_POOL_STATS: list[dict] = []


def _pool_stats() -> dict:
    return {"started": pool.pools_started, "cases": pool.cases_run,
            "ended": dict(pool.pools_ended), "retired_by": list(pool.retired_by)}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # xdist's controller: a worker ended
    stats = getattr(node, "workeroutput", {}).get("pools")
    if stats:
        _POOL_STATS.append(stats)


def pytest_terminal_summary(terminalreporter):
    stats = [*_POOL_STATS, _pool_stats()]
    cases = sum(s["cases"] for s in stats)
    if cases:
        ended: dict[str, int] = {}
        for s in stats:
            for why, n in s["ended"].items():
                ended[why] = ended.get(why, 0) + n
        ended_text = ", ".join(f"{n} {why}" for why, n in sorted(ended.items()))
        terminalreporter.write_line(
            f"gloo worker pools: {sum(s['started'] for s in stats)} started for {cases} "
            f"multi-process cases" + (f" ({ended_text})" if ended_text else ""))
        for s in stats:
            for line in s["retired_by"]:
                terminalreporter.write_line(f"  retired after {line}")


def pytest_sessionfinish(session, exitstatus):
    pool.shutdown()
    if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller prints
        session.config.workeroutput["pools"] = _pool_stats()
