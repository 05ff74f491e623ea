"""Session-wide test plumbing: the gloo worker pools (tests/pool.py) end with the session, and
the summary says how many started for how many cases (start-up is the cost they save)."""

from tests import pool


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
