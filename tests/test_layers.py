"""The layers of vitgraph hold (pyproject.toml's [tool.importlinter] contracts, written down in
docs/design.md): no import back up, no circle, function-level imports included."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_imports_follow_the_layers():
    pytest.importorskip("importlinter", reason="import-linter is not installed "
                                               "(pip install -e .[test])")
    # the use case, not importlinter.cli: the CLI's logging set-up disables every other logger
    # of the process (vitgraph's too, for the tests after this one)
    from importlinter import configuration
    from importlinter.application import use_cases
    configuration.configure()
    # True: every contract kept; the report printed above names any import that breaks one
    assert use_cases.lint_imports(config_filename=str(ROOT / "pyproject.toml"), cache_dir=None)
