"""Plugins every test run shares, tests/ and e2e/ alike (here, so that both see them)."""

pytest_plugins = ["tests.ci_skips", "tests.fixtures.docker", "tests.fixtures.processes"]
