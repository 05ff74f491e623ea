"""Session-wide test plumbing: the gloo worker pools (tests/pool.py) end with the session."""

from tests import pool


def pytest_sessionfinish(session, exitstatus):
    pool.shutdown()
