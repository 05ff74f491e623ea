"""The config package: schema (sections, per-field checks), loader (TOML, extends, CLI
overrides, --help, to_toml) and rules (cross-field rules, degrees)."""

import pytest

# helpers.the_problem asserts; pytest explains a failing assert there as in a test module
pytest.register_assert_rewrite("tests.unit.config.helpers")
