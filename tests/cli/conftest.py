"""Fixtures the command tests share with the tests of the modules the commands drive."""

from tests.test_export import drafter_dir  # noqa: F401 (a fixture: a tiny drafter saved to disk)
