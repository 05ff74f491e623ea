"""The 671B dry run starts in the background as soon as the session knows it will run its test
(tests/e2e/test_dry_run.py: start_early), unless pytest-xdist runs the session in streams.
"""

import os


def pytest_collection_finish(session):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects every test, and one runs
        return  # it: the other stream keeps the second core busy meanwhile, as the early start does
    from tests.e2e import test_dry_run

    large = test_dry_run.test_a_large_config_dry_runs_fits_and_the_planner_is_within_15_percent
    if any(getattr(item, "function", None) is large for item in session.items):
        test_dry_run.start_early(*test_dry_run.LARGE)
