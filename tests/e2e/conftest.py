"""The 671B dry run starts in the background as soon as the session knows it will run its test
(tests/e2e/test_dry_run.py: start_early)."""

LARGE_TEST = "test_a_large_config_dry_runs_fits_and_the_planner_is_within_15_percent"


def pytest_collection_finish(session):
    if any(item.name == LARGE_TEST for item in session.items):
        from tests.e2e import test_dry_run

        test_dry_run.start_early(test_dry_run.LARGE)
